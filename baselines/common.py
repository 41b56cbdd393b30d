"""Plumbing shared by the baseline adapters (native, zero3, fsdp, gemini).

What every baseline does the same way, so that the systems differ only in how they place and move
weights, gradients and optimizer state:

* the loss: ``CausalLMLoss`` wraps the HF causal LM and returns the step's shared loss (module doc of
  ``megatrain.system``): CE *sum* of a micro-batch over its shifted, labelled targets divided by the
  labelled-token count of the whole step. Logits are made chunk-wise (``loss_chunk_tokens`` tokens at a
  time, each chunk recomputed in backward), as the engine does, so no baseline holds [tokens x vocab]
  fp32 logits at long context; ``loss_chunk_tokens=0`` uses the HF forward's full logits instead;
* batches: ``prepare_step`` derives labels, shifts them, counts the step's labelled tokens and splits
  the batch into micro-batches;
* memory: ``baselines.monitor.Monitor`` (peak RSS from a background thread), GPU peaks from torch's allocator,
  pinned bytes from torch's caching host allocator;
* failure: running out of GPU or host memory surfaces as ``OutOfMemory(kind="gpu"|"host")``, raised
  from ``build``/``step`` (``oom_guard``), so a runner records a status instead of crashing;
* process groups: a world-size-1 group created in-process (``ensure_process_group``), destroyed by the
  system that created it.
"""
from __future__ import annotations

import gc
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .monitor import Monitor
from .oom import OutOfMemory, classify_oom, oom_guard  # noqa: F401  (re-exported)
from megatrain.system import (IGNORE_INDEX, MemoryStats, OptimConfig, StepResult, labels_from_batch,
                              shift_labels, split_micro_batches)

# Options every adapter accepts (each adds its own, see the adapter's OPTIONS).
COMMON_OPTIONS = {
    "attn_implementation": "sdpa",  # HF attention kernel: "sdpa" (flash/mem-efficient on CUDA) or "eager"
    "loss_chunk_tokens": 4096,  # tokens per logits chunk in the loss; 0 = HF forward's full logits
}


# -- memory accounting ----------------------------------------------------------------------------
def pinned_host_bytes() -> int:
    """Peak bytes held by torch's pinned (caching host) allocator, -1 where unknown. Covers
    ``tensor.pin_memory()`` / ``pin_memory=True`` allocations (DeepSpeed, FSDP2 and Gemini use those)."""
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return -1
        stats = torch.cuda.host_memory_stats()
        return int(stats.get("allocated_bytes.peak", stats.get("allocated_bytes.all.peak", -1)))
    except Exception:
        return -1


# -- process group --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_single_process_env(local_rank: int = 0) -> None:
    """The torchrun-style variables a world-size-1 in-process run needs (DeepSpeed and ColossalAI read
    them); a fresh MASTER_PORT each time, so consecutive systems never collide."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def ensure_process_group(backend: str, device: torch.device) -> bool:
    """A world-size-1 default process group; returns True if this call created it (then the caller
    destroys it in ``close``), False if one existed already (left alone)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("the baselines run as a single process; found a process group of world size "
                               f"{dist.get_world_size()}")
        return False
    set_single_process_env(device.index or 0)
    init_method = f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"
    dist.init_process_group(backend=backend, init_method=init_method, rank=0, world_size=1)
    return True


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# -- model and weights ----------------------------------------------------------------------------
def resolve_device(device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        raise ValueError(f"unsupported device {device!r}: use 'cuda' or 'cpu'")
    return dev


def check_options(system: str, options: dict | None, defaults: dict) -> dict:
    """``defaults`` updated with ``options``; unknown keys raise ValueError listing the valid ones."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"unknown {system} options {unknown}; valid: {', '.join(sorted(defaults))}")
    merged = dict(defaults)
    merged.update(options)
    return merged


def read_hf_config(init_dir, attn_implementation: str):
    from transformers import AutoConfig

    path = Path(init_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"initial-weights directory {str(path)!r} has no config.json")
    config = AutoConfig.from_pretrained(str(path))
    config._attn_implementation = attn_implementation
    config.use_cache = False
    return config


def causal_lm_class(config):
    """The HF causal-LM class for ``config``, imported now (importing it lazily inside
    ``deepspeed.zero.Init`` breaks torch._dynamo's import, which checks Tensor.__new__'s signature)."""
    import torch._dynamo  # noqa: F401  (import before any constructor patching)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def load_hf_model(init_dir, attn_implementation: str):
    """The HF model with the shared initial weights, fp32, on the CPU, in train mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(init_dir), dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    model.config.use_cache = False
    model.train()
    return model


def enable_activation_checkpointing(model) -> None:
    """HF's per-decoder-layer checkpointing, non-reentrant (works with ZeRO-3, FSDP2 and Gemini hooks).
    transformers >= 5.2x names it ``activation_checkpointing_enable`` (the old name warns); older 5.x
    only has ``gradient_checkpointing_enable``."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpoint_tensors(init_dir):
    """Yield (name, tensor) of every tensor in a ``save_pretrained`` folder, one tensor in RAM at a time
    (single model.safetensors or sharded with model.safetensors.index.json)."""
    from safetensors import safe_open

    from megatrain.checkpoint import weight_map

    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map(init_dir).items():
        by_file.setdefault(fname, []).append(name)
    for fname, names in by_file.items():
        with safe_open(str(Path(init_dir) / fname), framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)


def fp32_rotary_buffers(model: nn.Module) -> list[str]:
    """Recompute rotary-embedding buffers (``inv_freq`` ...) in fp32 where something cast them down.

    DeepSpeed's ``zero.Init`` (bf16) and Gemini's ``GeminiDDP`` cast floating buffers to bf16; RoPE with
    bf16 ``inv_freq`` rotates position p by p * inv_freq * (1 +- 2^-9): radians off at long context, a
    different model than the one the other systems train. Rebuilds each rotary module from its config
    (outside any constructor-patching context) and copies its buffers in fp32 onto the current device.
    Returns the names of the buffers it replaced.
    """
    fixed = []
    for mod_name, mod in model.named_modules():
        bufs = getattr(mod, "_buffers", {})
        if "inv_freq" not in bufs or bufs["inv_freq"] is None:
            continue
        if all(b is None or not b.is_floating_point() or b.dtype == torch.float32 for b in bufs.values()):
            continue
        with torch.device("cpu"):
            fresh = type(mod)(config=mod.config)
        for bname, buf in list(bufs.items()):
            if buf is None or not buf.is_floating_point() or buf.dtype == torch.float32:
                continue
            ref = fresh._buffers.get(bname)
            if ref is None:
                continue
            bufs[bname] = ref.to(device=buf.device, dtype=torch.float32)
            fixed.append(f"{mod_name}.{bname}" if mod_name else bname)
    return fixed


def non_fp32_float_buffers(model: nn.Module) -> list[str]:
    return [n for n, b in model.named_buffers() if b is not None and b.is_floating_point() and b.dtype != torch.float32]


# -- the shared loss ------------------------------------------------------------------------------
def _chunk_ce_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


class CausalLMLoss(nn.Module):
    """``forward(input_ids, targets, denom, ...)`` -> CE sum over ``targets`` (already shifted) / denom.

    The HF model is ``self.lm`` (parameter names gain the prefix ``lm.``). With ``chunk_tokens > 0``
    the decoder's last hidden state is projected by ``lm.lm_head`` ``chunk_tokens`` tokens at a time,
    each chunk under non-reentrant checkpointing (its logits are recomputed in backward), so peak logits
    memory is one chunk; calling the ``lm_head`` module (not its weight) keeps ZeRO-3 / FSDP2 / Gemini
    parameter fetching in charge. ``chunk_tokens == 0``: the HF forward's full logits.
    """

    def __init__(self, lm: nn.Module, chunk_tokens: int = 4096):
        super().__init__()
        if chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens must be >= 0, got {chunk_tokens}")
        self.lm = lm
        self.chunk_tokens = int(chunk_tokens)

    def forward(self, input_ids, targets, denom, attention_mask=None, position_ids=None):
        kwargs = {"input_ids": input_ids}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        flat_t = targets.reshape(-1)
        if self.chunk_tokens == 0:
            logits = self.lm(**kwargs).logits
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat_t,
                                    ignore_index=IGNORE_INDEX, reduction="sum")
            return total / denom
        hidden = self.lm.model(**kwargs).last_hidden_state
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        head = self.lm.get_output_embeddings()
        total = None
        n = flat_h.shape[0]
        for start in range(0, n, self.chunk_tokens):
            end = min(start + self.chunk_tokens, n)
            part = torch.utils.checkpoint.checkpoint(_chunk_ce_sum, head, flat_h[start:end], flat_t[start:end],
                                                     use_reentrant=False)
            total = part if total is None else total + part
        return total / denom


@dataclass
class MicroBatch:
    inputs: dict  # input_ids, targets, optional attention_mask / position_ids, on the device


def prepare_step(batch: dict, micro_batches: int, device: torch.device) -> tuple[list[MicroBatch], int, int]:
    """(micro-batches on ``device``, labelled-token count of the step, tokens of the step)."""
    labels = labels_from_batch(batch)
    targets = shift_labels(labels)
    denom = int((targets != IGNORE_INDEX).sum())
    full = {"input_ids": batch["input_ids"], "targets": targets}
    for key in ("attention_mask", "position_ids"):
        if batch.get(key) is not None:
            full[key] = batch[key]
    nb = device.type == "cuda"
    mbs = [MicroBatch({k: v.to(device, non_blocking=nb) for k, v in mb.items()})
           for mb in split_micro_batches(full, micro_batches)]
    return mbs, max(denom, 1), int(batch["input_ids"].numel())


def check_optim(optim: OptimConfig) -> None:
    if not isinstance(optim, OptimConfig):
        raise TypeError(f"optim must be a megatrain.system.OptimConfig, got {type(optim).__name__}")


def clip_norm(optim: OptimConfig) -> float:
    """The clipping threshold, 0.0 for none."""
    return float(optim.max_grad_norm) if optim.max_grad_norm and optim.max_grad_norm > 0 else 0.0


# -- base class ------------------------------------------------------------------------------------
class BaselineSystem:
    """What the adapters share: options checking, device, info, memory peaks, timing, OOM mapping, close.

    An adapter sets ``name``, ``OPTIONS`` (its defaults, ``COMMON_OPTIONS`` included) and ``CHOICES``
    (option -> allowed values), and implements ``_build(init_dir, opts, dtype, activation_checkpointing)``
    and ``_step(batch, t0)``. The constructor checks the options, builds, records the build's memory
    peaks, and closes a half-built system before re-raising."""

    name = "baseline"
    OPTIONS: dict = COMMON_OPTIONS
    CHOICES: dict = {}

    def __init__(self, *, init_dir, optim: OptimConfig, micro_batches: int = 1, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16, activation_checkpointing: bool = True,
                 options: dict | None = None):
        opts = check_options(self.name, options, self.OPTIONS)
        for key, allowed in self.CHOICES.items():
            if opts[key] not in allowed:
                raise ValueError(f"{self.name} {key} must be one of {', '.join(map(str, allowed))}, got {opts[key]!r}")
        self._check_device(torch.device(device), dtype)
        check_optim(optim)
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.device = resolve_device(device)
        self.optim = optim
        self.micro_batches = int(micro_batches)
        self.info: dict = {}
        self.build_memory: dict = {}
        self.steps_done = 0
        self._owns_process_group = False
        self._closed = False
        self.model = self.optimizer = self.scheduler = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            reset_host = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
            if reset_host is not None:
                try:
                    reset_host()
                except Exception:
                    pass
        self._sampler = Monitor(interval=0.02, gpu=False).start()
        try:
            self._build(init_dir, opts, dtype, activation_checkpointing)
            self._finish_build()
        except BaseException:
            self.close()
            raise

    def _check_device(self, device: torch.device, dtype: torch.dtype) -> None:
        """Refuse a device/dtype the system cannot run on, before anything is allocated."""

    def _build(self, init_dir, opts: dict, dtype: torch.dtype, activation_checkpointing: bool) -> None:
        raise NotImplementedError

    def _finish_build(self) -> None:
        """Record the build's peaks (loading weights, partitioning, chunking are transient) and restart
        peak tracking, so ``memory()`` reports training: resident state plus the steps' transients."""
        self._sampler.sample()
        self.build_memory = {"build_host_rss_peak": self._sampler.peak_rss}
        self._sampler.reset_peak()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.build_memory["build_gpu_peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
            self.build_memory["build_gpu_peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def _clip_and_update(self, total, tokens: int, lr: float, t0: float) -> StepResult:
        """Global grad-norm clipping (DTensor-aware; no clipping without a threshold), AdamW step, LR
        schedule step, gradients freed; the step's result. For adapters driving a torch optimizer."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = clip_norm(self.optim)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_value, norm_value = float(total), float(norm)
        return StepResult(loss=loss_value, tokens=tokens, step_time_s=self.elapsed(t0), lr=lr, grad_norm=norm_value)

    def lr_for_step(self, step: int) -> float:
        return self.optim.lr_at(step)

    def step(self, batch: dict) -> StepResult:
        if self._closed:
            raise RuntimeError(f"{self.name}: step() after close()")
        with oom_guard(self.name, f"step {self.steps_done}"):
            t0 = time.perf_counter()
            result = self._step(batch, t0)
        self._sampler.sample()
        self.steps_done += 1
        return result

    def _step(self, batch: dict, t0: float) -> StepResult:
        raise NotImplementedError

    def elapsed(self, t0: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def memory(self) -> MemoryStats:
        self._sampler.sample()
        stats = MemoryStats(host_rss=self._sampler.peak_rss, host_pinned=pinned_host_bytes(),
                            extra={"system": self.name, **self.build_memory})
        if self.device.type == "cuda":
            stats.gpu_peak_allocated = torch.cuda.max_memory_allocated(self.device)
            stats.gpu_peak_reserved = torch.cuda.max_memory_reserved(self.device)
        return stats

    def _release(self) -> None:
        """Drop the system's own objects: by default a plain torch model + optimizer (+ scheduler);
        adapters holding framework engines override it."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
            optimizer.state.clear()
        self.model = self.optimizer = self.scheduler = None

    def close(self) -> None:
        """Free the system's GPU and pinned memory and its process group; never raises for a cleanup
        step that fails (after an OOM or a CUDA error the runner still needs the rest done)."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for action in (self._release, gc.collect, self._free_cuda_cache, self._close_process_group,
                       self._sampler.stop):
            try:
                action()
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{getattr(action, '__name__', action)}: {type(exc).__name__}: {exc}")
        if errors:
            self.info["close_errors"] = errors

    def _free_cuda_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _close_process_group(self) -> None:
        if self._owns_process_group:
            self._owns_process_group = False
            self._destroy_process_group()

    def _destroy_process_group(self) -> None:
        destroy_process_group()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def build_guarded(cls, system: str, **kwargs):
    """Construct ``cls(**kwargs)``; out-of-memory becomes ``OutOfMemory(phase="build")``. (Each adapter's
    constructor closes its half-built self before re-raising, so nothing stays allocated.)"""
    with oom_guard(system, "build"):
        return cls(**kwargs)
