"""DeepSpeed with CPU offload: three systems behind the shared interface.

* ``zero3``: ZeRO-3 with parameters and optimizer state offloaded to pinned CPU memory.
* ``zero2``: ZeRO-2 with the optimizer offloaded only (bf16 parameters and gradients stay on the GPU):
  what a user whose model fits the GPU's memory in bf16 picks instead.
* ``superoffload``: ZeRO-3 with ``offload_optimizer.super_offload`` (DeepSpeed >= 0.18; SuperOffload's
  CPU optimizer runs in a worker process and overlaps the backward). Its worker can give up with
  "SuperOffload CPU optimizer timeout after N seconds": that becomes the row's status ``timeout`` with
  the message as its reason (``baselines.oom.failure_status``).

Configured as a DeepSpeed user training one large model on one GPU would: pinned CPU offload,
``overlap_comm``, ``contiguous_gradients``, bf16 mixed precision, DeepSpeedCPUAdam (AdamW mode) on the
fp32 master partitions, DeepSpeed's own gradient clipping, HF activation checkpointing. Bucket sizes:
the tuned values ``TUNED_ZERO`` (reduce and prefetch bucket 5e8, persistence threshold 1e6, max live
parameters 1e9; on the H200, 3B shape at 16x1024, these measured 140 TFLOPS against 124 with HF's
"auto" sizes h^2 / 0.9 h^2 / 10 h). ``options["zero_optimization"]`` overrides any of them, and every
row records the settings that ran (``info["settings"]``).

Runs in-process without the ``deepspeed`` launcher: a world-size-1 process group (nccl on CUDA, gloo on
CPU) and the torchrun-style environment variables DeepSpeed reads.

Initial weights (the fairness point): the model is built under ``deepspeed.zero.Init`` (parameters are
partitioned to pinned CPU memory as they are created, the full model never sits on the GPU), then
*every* parameter is overwritten from the shared ``save_pretrained`` folder with
``GatheredParameters(modifier_rank=0)``; HF's own random init is skipped under ``zero.Init``
(``no_init_weights``, as transformers does: it gave a step-0 loss of ~1560 instead of ~12 on a 3B model, and it
indexes ``weight[padding_idx]`` of an already-partitioned embedding when the config sets ``pad_token_id``). With bf16 the fp32 master partitions, which
DeepSpeed derives from the bf16 parameters, are then set to the exact fp32 checkpoint values
(``safe_set_full_fp32_param``), so the masters start where every other system starts. Rotary
``inv_freq`` buffers, which ``zero.Init`` creates in bf16, are rebuilt in fp32.

``dtype=torch.float32`` (the run's ``dtype: fp32``, e.g. the ``accuracy_sft`` sweep's ``fp32`` point) is
DeepSpeed without mixed precision, on the GPU too: ``"bf16": {"enabled": false}``, fp32 parameters under
``zero.Init``, fp32 compute; the fp32 partitions are the loaded checkpoint values themselves
(``tests/test_baselines_zero3.py::test_zero3_fp32_dtype_wins_over_the_bf16_path``).

CPU (CI parity) path: DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``, auto-detected on a machine
without CUDA) with gloo, fp32, and ``torch.optim.AdamW`` as the client optimizer (``cpu_adam`` is
bit-for-bit the same kernel as on the GPU node but takes ~45 s to JIT-compile; ``options["optimizer"]=
"cpu_adam"`` selects it). The CPU accelerator's shared-memory all-reduce op (a JIT-compiled extension
only multi-rank CPU jobs use) is not built.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import sys

import torch

from megatrain.system import OptimConfig, StepResult

from .common import (COMMON_OPTIONS, BaselineSystem, CausalLMLoss, build_guarded, causal_lm_class,
                     checkpoint_tensors, clip_norm, enable_activation_checkpointing,
                     ensure_process_group, fp32_rotary_buffers, load_hf_model, non_fp32_float_buffers, prepare_step,
                     read_hf_config)

# The tuned ZeRO settings (defaults of every DeepSpeed system here; stage-3 keys only where stage 3 runs).
TUNED_ZERO = {
    "reduce_bucket_size": int(5e8),
    "allgather_bucket_size": int(5e8),  # stage 2
    "stage3_prefetch_bucket_size": int(5e8),
    "stage3_param_persistence_threshold": int(1e6),
    "stage3_max_live_parameters": int(1e9),
}
# HF Trainer's "auto" resolution, from the hidden size h (what the harness used before tuning).
def hf_auto_buckets(hidden_size: int) -> dict:
    h = int(hidden_size)
    return {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h}


# SuperOffload's reduce bucket and optimizer sub-group (DeepSpeedExamples' SuperOffload scripts use 4e8).
SUPEROFFLOAD_SUB_GROUP = 4e8

# What each DeepSpeed system offloads.
VARIANTS = {
    "zero3": {"stage": 3, "offload_param": True, "super_offload": False},
    "zero2": {"stage": 2, "offload_param": False, "super_offload": False},
    "superoffload": {"stage": 3, "offload_param": False, "super_offload": True},
}

OPTIONS = dict(
    COMMON_OPTIONS,
    buckets="tuned",  # "tuned" (TUNED_ZERO) or "hf_auto" (h^2-derived, HF Trainer's "auto")
    cpuadam_cores_perc=0.9,  # superoffload: share of the cores its CPU Adam worker gets
    optimizer="auto",  # "auto" (cpu_adam on CUDA, falling back to torch_adamw if it cannot be built;
                       # torch_adamw on CPU), "cpu_adam" (DeepSpeedCPUAdam), "torch_adamw"
    zero_optimization=None,  # dict merged into the zero_optimization section (e.g. bucket sizes)
    ds_config=None,  # dict merged (recursively) into the whole DeepSpeed config last
    exact_fp32_master=True,  # bf16: set the fp32 master partitions to the checkpoint's fp32 values
    cpu_bf16=False,  # tests only: run the bf16 path (bf16 zero.Init, exact masters) on the CPU accelerator
)


def _merge(base: dict, extra: dict | None) -> dict:
    out = copy.deepcopy(base)
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def make_ds_config(hidden_size: int, optim: OptimConfig, micro_batches: int, *, bf16: bool,
                   torch_optimizer: bool, zero_overrides: dict | None = None,
                   config_overrides: dict | None = None, variant: str = "zero3", buckets: str = "tuned",
                   cpuadam_cores_perc: float = 0.9) -> dict:
    """The DeepSpeed config dict (no "auto" values: those only resolve inside HF's Trainer)."""
    v = VARIANTS[variant]
    if buckets not in ("tuned", "hf_auto"):
        raise ValueError(f"buckets must be 'tuned' or 'hf_auto', got {buckets!r}")
    sizes = dict(TUNED_ZERO) if buckets == "tuned" else dict(TUNED_ZERO, **hf_auto_buckets(hidden_size))
    offload_optimizer = {"device": "cpu", "pin_memory": True}
    if v["super_offload"]:
        offload_optimizer.update(super_offload=True, ratio=0.9, cpuadam_cores_perc=float(cpuadam_cores_perc))
    zero = {"stage": v["stage"], "offload_optimizer": offload_optimizer, "overlap_comm": True,
            "contiguous_gradients": True, "reduce_bucket_size": sizes["reduce_bucket_size"]}
    if v["super_offload"]:
        # DeepSpeedExamples' SuperOffload recipe (training/DeepSpeed-SuperOffload): no comm overlap,
        # reduce bucket and optimizer sub-group 4e8 (each sub-group is one task for the CPU Adam worker;
        # with 1e9 one task moved 4 GB of master and 4 GB of gradient through shared memory).
        zero.update(overlap_comm=False, reduce_bucket_size=int(SUPEROFFLOAD_SUB_GROUP))
    if v["stage"] == 3:
        if v["offload_param"]:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero.update({k: sizes[k] for k in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                                           "stage3_max_live_parameters")})
        zero.update(stage3_max_reuse_distance=int(1e9),
                    sub_group_size=int(SUPEROFFLOAD_SUB_GROUP if v["super_offload"] else 1e9),
                    stage3_gather_16bit_weights_on_model_save=False)
    else:
        zero.update(allgather_bucket_size=sizes["allgather_bucket_size"], allgather_partitions=True,
                    reduce_scatter=True)
    cfg = {
        # DeepSpeed derives train_batch_size = micro x accumulation x world; the row count of our
        # micro-batches does not enter the computation, only the accumulation boundary does.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": int(micro_batches),
        "gradient_clipping": clip_norm(optim),
        "bf16": {"enabled": bool(bf16)},
        "fp16": {"enabled": False},
        "zero_optimization": _merge(zero, zero_overrides),
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if torch_optimizer:
        # DeepSpeed insists on its CPU Adam with offload unless told otherwise.
        cfg["zero_force_ds_cpu_optimizer"] = False
    return _merge(cfg, config_overrides)


def settings_of(ds_config: dict) -> dict:
    """The knobs of a DeepSpeed config worth a row's ``settings`` column (flat, short names)."""
    zero = ds_config["zero_optimization"]
    keep = ("stage", "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold", "stage3_max_live_parameters", "overlap_comm")
    out = {k.replace("stage3_", ""): zero[k] for k in keep if k in zero}
    out["offload_param"] = "offload_param" in zero
    if zero["offload_optimizer"].get("super_offload"):
        out["super_offload"] = True
        out["cpuadam_cores_perc"] = zero["offload_optimizer"].get("cpuadam_cores_perc")
        out["sub_group_size"] = zero.get("sub_group_size")
        # DeepSpeed #7906: SuperOffload speculates (CPU Adam per sub-group during backward, rolled back on
        # overflow) only without clipping; with gradient_clipping > 0 every sub-group waits for the norm.
        clip = float(ds_config.get("gradient_clipping") or 0.0)
        out["gradient_clipping"] = clip
        out["speculation"] = clip == 0.0
    return out


def _no_shm_op():
    return None


def import_deepspeed(device_type: str):
    """Import DeepSpeed with the accelerator matching ``device_type`` (CPU: ``DS_ACCELERATOR=cpu`` must be
    set before the first import; without CUDA DeepSpeed picks the CPU accelerator by itself)."""
    if device_type == "cpu" and "deepspeed" not in sys.modules:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator().device_name()
    if accel != device_type:
        raise RuntimeError(f"DeepSpeed's accelerator is {accel!r} but device={device_type!r}: set "
                           f"DS_ACCELERATOR={device_type} before deepspeed is first imported")
    if device_type == "cpu":
        # TorchBackend JIT-compiles a shared-memory all-reduce op on the CPU accelerator (~1 min, used only
        # by multi-rank CPU inference all-reduce); a world of one never needs it.
        comm_torch = sys.modules.get("deepspeed.comm.torch")
        if comm_torch is not None:
            comm_torch.build_shm_op = _no_shm_op
    return deepspeed


def _no_init_weights():
    """transformers' context that skips weight init (torch.nn.init and ``PreTrainedModel.init_weights``)."""
    try:
        from transformers.initialization import no_init_weights  # transformers 5.x
    except ImportError:
        from transformers.modeling_utils import no_init_weights  # 4.x
    return no_init_weights()


def build_partitioned(ds, cls, hf_config, ds_config: dict):
    """``cls(hf_config)`` under ``deepspeed.zero.Init`` without HF's weight init, then tied.

    As transformers' own ZeRO-3 loading does (``no_init_weights`` around ``zero.Init``): every parameter
    is overwritten from the checkpoint afterwards (``_load_weights`` refuses a model with any parameter
    not in the checkpoint), so HF's random init is wasted work, and it fails outright under ``zero.Init``
    when the config sets ``pad_token_id``: ``_init_weights`` zeroes ``weight[padding_idx]`` of a weight
    that is already partitioned (empty) -> IndexError. The embedding keeps its ``padding_idx`` (its row
    gets no gradient, as in native and MegaTrain). ``no_init_weights`` also skips the tying that
    ``init_weights`` does, so ``tie_weights`` runs here, outside ``zero.Init``, as in transformers.
    """
    with _no_init_weights(), ds.zero.Init(config_dict_or_path=ds_config):
        lm = cls(hf_config)
    lm.tie_weights()
    return lm


class DeepSpeedSystem(BaselineSystem):
    """The DeepSpeed adapter; ``variant`` (a key of ``VARIANTS``) picks what is offloaded."""

    name = "zero3"
    variant = "zero3"
    OPTIONS = OPTIONS
    CHOICES = {"optimizer": ("auto", "cpu_adam", "torch_adamw"), "buckets": ("tuned", "hf_auto")}
    engine = module = None

    # -- build ------------------------------------------------------------------------------------
    def _build(self, init_dir, opts, dtype, activation_checkpointing) -> None:
        on_cuda = self.device.type == "cuda"
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"zero3 supports bf16 or fp32 compute, got {dtype}")
        bf16 = dtype == torch.bfloat16 and (on_cuda or bool(opts["cpu_bf16"]))
        # SuperOffload and ZenFlow pin this process to a share of the cores for good; close() gives them back
        self._affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        ds = self.deepspeed = import_deepspeed(self.device.type)
        self._owns_process_group = ensure_process_group("nccl" if on_cuda else "gloo", self.device)
        # DeepSpeed reads the launcher's variables even when the group exists already.
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", str(self.device.index or 0)),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
            os.environ.setdefault(key, value)
        ds.init_distributed(dist_backend="nccl" if on_cuda else "gloo", auto_mpi_discovery=False, verbose=False)

        choice = opts["optimizer"]
        if choice == "auto":
            choice = "cpu_adam" if on_cuda else "torch_adamw"
        hf_config = read_hf_config(init_dir, opts["attn_implementation"])
        ds_config = self._make_config(hf_config, opts, bf16, choice)
        stage3 = ds_config["zero_optimization"]["stage"] == 3

        if stage3:
            # 1) Build partitioned, straight into (pinned) CPU memory.
            cls = causal_lm_class(hf_config)
            lm = build_partitioned(ds, cls, hf_config, ds_config)
            fixed = fp32_rotary_buffers(lm)
            # 2) Overwrite every parameter with the shared initial weights.
            self._load_weights(lm, init_dir)
        else:  # stage 2: a plain fp32 model; DeepSpeed moves it to the GPU and keeps fp32 masters on the CPU
            lm, fixed = load_hf_model(init_dir, opts["attn_implementation"]), []
        if activation_checkpointing:
            enable_activation_checkpointing(lm)
        lm.config.use_cache = False
        lm.train()
        self.module = CausalLMLoss(lm, opts["loss_chunk_tokens"])

        # 3) Optimizer and engine.
        opt_name = self._initialize(ds, ds_config, choice, opts)
        if bf16 and opts["exact_fp32_master"] and stage3:
            self._set_fp32_masters(lm, init_dir)
        fixed += fp32_rotary_buffers(lm)  # in case initialize cast buffers (0.19.8 keeps fp32 ones)
        base = type(self).name
        self.name = f"{base}[torch-adamw]" if opt_name.startswith("torch.") else base
        self.info.update(system=self.name, optimizer=opt_name, compute_dtype="bfloat16" if bf16 else "float32",
                         settings=settings_of(ds_config),
                         deepspeed_version=ds.__version__, ds_config=ds_config,
                         rotary_buffers_rebuilt_fp32=fixed, non_fp32_buffers=non_fp32_float_buffers(lm),
                         exact_fp32_master=bool(bf16 and opts["exact_fp32_master"] and stage3),
                         activation_checkpointing=bool(activation_checkpointing),
                         options={k: v for k, v in opts.items() if k not in ("ds_config", "zero_optimization")})

    def _make_config(self, hf_config, opts: dict, bf16: bool, choice: str) -> dict:
        """The DeepSpeed config of this variant (ZenFlow overrides it)."""
        return make_ds_config(hf_config.hidden_size, self.optim, self.micro_batches, bf16=bf16,
                              torch_optimizer=(choice == "torch_adamw" or opts["optimizer"] == "auto"),
                              zero_overrides=opts["zero_optimization"], config_overrides=opts["ds_config"],
                              variant=self.variant, buckets=opts["buckets"],
                              cpuadam_cores_perc=opts["cpuadam_cores_perc"])

    def _initialize(self, ds, ds_config: dict, choice: str, opts: dict) -> str:
        """``deepspeed.initialize`` with our client optimizer; sets ``self.engine``, returns the optimizer's
        name (ZenFlow lets DeepSpeed build its own optimizer instead)."""
        optimizer, opt_name = self._make_optimizer(choice, opts["optimizer"] == "auto")
        self.engine, _, _, _ = ds.initialize(model=self.module, optimizer=optimizer, config=ds_config)
        del optimizer
        return opt_name

    def _load_weights(self, lm, init_dir) -> None:
        ds = self.deepspeed
        by_name = dict(lm.named_parameters(remove_duplicate=False))  # tied aliases map to one parameter
        loaded: set[int] = set()
        for name, tensor in checkpoint_tensors(init_dir):
            param = by_name.get(name)
            if param is None:
                raise KeyError(f"{init_dir}: tensor {name!r} has no parameter in {type(lm).__name__}")
            shape = tuple(getattr(param, "ds_shape", param.shape))
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {shape}")
            with ds.zero.GatheredParameters([param], modifier_rank=0):
                with torch.no_grad():
                    param.data.copy_(tensor)
            loaded.add(id(param))
        missing = [n for n, p in lm.named_parameters() if id(p) not in loaded]
        if missing:
            raise KeyError(f"{init_dir} lacks initial weights for {missing[:5]}"
                           f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''}")

    def _set_fp32_masters(self, lm, init_dir) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        by_name = dict(lm.named_parameters(remove_duplicate=False))
        done: set[int] = set()
        for name, tensor in checkpoint_tensors(init_dir):
            param = by_name[name]
            if id(param) in done:
                continue
            safe_set_full_fp32_param(param, tensor.to(torch.float32))
            done.add(id(param))

    def _make_optimizer(self, choice: str, auto: bool):
        o = self.optim
        params = list(self.module.parameters())
        if choice == "cpu_adam" or VARIANTS[self.variant]["super_offload"]:
            try:
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                        weight_decay=o.weight_decay, adamw_mode=True), "DeepSpeedCPUAdam"
            except Exception as exc:  # the op failed to JIT-compile
                if not auto or VARIANTS[self.variant]["super_offload"]:  # SuperOffload needs its CPU Adam
                    raise
                self.info["cpu_adam_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        kwargs = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        try:
            # DeepSpeed swaps in fp32 CPU partitions; torch's fused CPU AdamW is the fastest on those.
            return torch.optim.AdamW(params, fused=True, **kwargs), "torch.AdamW(fused)"
        except (RuntimeError, ValueError):
            return torch.optim.AdamW(params, **kwargs), "torch.AdamW"

    # -- step -------------------------------------------------------------------------------------
    def _step(self, batch, t0) -> StepResult:
        engine = self.engine
        mbs, denom, tokens = prepare_step(batch, self.micro_batches, self.device)
        lr = self.lr_for_step(self.steps_done)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        start = engine.global_steps
        total = None
        for mb in mbs:
            loss = engine(**mb.inputs, denom=denom)
            # The loss is already scaled by this micro-batch's share of the step's labelled tokens.
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
            total = loss.detach().float() if total is None else total + loss.detach().float()
        if engine.global_steps != start + 1:
            raise RuntimeError(f"zero3: expected one optimizer step per {self.micro_batches} micro-batches, "
                               f"DeepSpeed took {engine.global_steps - start}")
        norm = engine.get_global_grad_norm()
        loss_value = float(total)
        norm_value = float(norm) if norm is not None else float("nan")
        return StepResult(loss=loss_value, tokens=tokens, step_time_s=self.elapsed(t0), lr=lr, grad_norm=norm_value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named fp32 master weights gathered to CPU (for parity tests; small models only)."""
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for name, param in self.module.lm.named_parameters(remove_duplicate=False):
            out[name] = safe_get_full_fp32_param(param).detach().float().cpu().clone()
        return out

    # -- close ------------------------------------------------------------------------------------
    def _release(self) -> None:
        engine, self.engine, self.module = self.engine, None, None
        try:
            if engine is not None:
                try:
                    engine.destroy()
                finally:
                    del engine
        finally:
            affinity = getattr(self, "_affinity", None)
            if affinity and os.sched_getaffinity(0) != affinity:
                os.sched_setaffinity(0, affinity)  # the next system in this process gets every core again

    def _destroy_process_group(self) -> None:
        import deepspeed.comm as dist

        try:
            dist.destroy_process_group()  # also drops DeepSpeed's cached group handles
        except Exception:
            import torch.distributed

            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


class Zero3System(DeepSpeedSystem):
    name = variant = "zero3"


class Zero2System(DeepSpeedSystem):
    name = variant = "zero2"


class SuperOffloadSystem(DeepSpeedSystem):
    name = variant = "superoffload"

    def _step(self, batch, t0) -> StepResult:
        try:
            return super()._step(batch, t0)
        except RuntimeError as exc:
            worker = self.worker_state()
            if worker is None:
                raise
            if not worker["alive"]:
                # The worker is gone: DeepSpeed's "timeout after 60 s" (or "Worker process is not alive") is
                # a consequence; the row's status is an error with the worker's exit code as its cause.
                said = " ".join(str(exc).split()).replace("timeout after", "no result after")[:300]
                raise RuntimeError(f"SuperOffload's CPU Adam worker (pid {worker['pid']}) exited with code "
                                   f"{worker['exitcode']} (see its traceback in the log); DeepSpeed: {said}") from None
            raise RuntimeError(f"{' '.join(str(exc).split())[:400]} [SuperOffload worker pid {worker['pid']} alive, "
                               f"{worker['cores']} core(s); training process on {worker['pt_cores']} core(s)]") from exc

    def _release(self) -> None:
        """Also stop the CPU Adam worker: DeepSpeed never does (a daemon that would otherwise keep its
        m, v and buffers until this process exits)."""
        cpu_opt = getattr(getattr(self.engine, "optimizer", None), "superoffload_cpu_optimizer", None)
        try:
            super()._release()
        finally:
            if cpu_opt is not None:
                cpu_opt.close()  # bounded: join 5 s, terminate, kill

    def worker_state(self) -> dict | None:
        """The SuperOffload CPU Adam worker process: pid, alive, exit code, cores (None if there is none)."""
        cpu_opt = getattr(getattr(self.engine, "optimizer", None), "superoffload_cpu_optimizer", None)
        proc = getattr(cpu_opt, "cpuadam_process", None)
        if proc is None:
            return None
        import psutil

        def cores(pid):
            try:
                return len(psutil.Process(pid).cpu_affinity())
            except Exception:  # noqa: BLE001 - gone, or no affinity on this platform
                return None

        return {"pid": proc.pid, "alive": proc.is_alive(), "exitcode": proc.exitcode,
                "cores": cores(proc.pid), "pt_cores": cores(os.getpid())}


class SuperOffloadNoClipSystem(SuperOffloadSystem):
    """SuperOffload with gradient clipping off, whatever the run's ``max_grad_norm``: since DeepSpeed #7906
    its speculation (CPU Adam per sub-group during backward) runs only without clipping. A separate
    system so that one sweep holds both rows; its settings say ``gradient_clipping: 0``."""

    name = "superoffload_noclip"
    variant = "superoffload"

    def __init__(self, *, optim: OptimConfig, **kwargs):
        self.run_max_grad_norm = optim.max_grad_norm
        super().__init__(optim=dataclasses.replace(optim, max_grad_norm=0.0), **kwargs)
        self.info["settings"]["run_max_grad_norm_ignored"] = self.run_max_grad_norm


def build(**kwargs) -> Zero3System:
    return build_guarded(Zero3System, Zero3System.name, **kwargs)


def build_zero2(**kwargs) -> Zero2System:
    return build_guarded(Zero2System, Zero2System.name, **kwargs)


def build_superoffload(**kwargs) -> SuperOffloadSystem:
    return build_guarded(SuperOffloadSystem, SuperOffloadSystem.name, **kwargs)


def build_superoffload_noclip(**kwargs) -> SuperOffloadNoClipSystem:
    return build_guarded(SuperOffloadNoClipSystem, SuperOffloadNoClipSystem.name, **kwargs)
