"""ColossalAI 0.5.0 Gemini (chunk-based ZeRO-3 with CPU offload) through its Booster API.

Configured as ColossalAI's docs describe the old "cpu" placement (everything offloaded): ``GeminiPlugin(
placement_policy="static", shard_param_frac=1.0, offload_optim_frac=1.0, offload_param_frac=1.0,
precision="bf16", pin_memory=True, max_norm=...)`` with ``HybridAdam`` (AdamW mode), ``Booster.boost``,
``booster.backward``; HF activation checkpointing (non-reentrant, as ColossalAI asks); gradient
accumulation through the plugin's ``enable_gradient_accumulation`` when there are several micro-batches.
Launched in-process with ``colossalai.launch(rank=0, world_size=1, ...)``.

Needs CUDA (chunks, streams and HybridAdam are CUDA-only): without it ``build`` raises RuntimeError.

Things this adapter does on purpose (see docs/baselines.md):

* ColossalAI 0.5.0 imports ``galore_torch`` and ``bitsandbytes`` from optimizer modules we never use;
  when they are missing, empty stand-ins go into ``sys.modules`` before the import (``stub_optional_imports``).
* ``GeminiDDP`` casts floating buffers to bf16, rotary ``inv_freq`` included; they are rebuilt in fp32.
* HybridAdam updates CPU parameters with bf16 gradients in a plain-torch path that ignores ``div_scale``,
  the factor through which GeminiOptimizer applies ``max_norm`` clipping: with bf16 no clipping would
  happen at all. ``fix_bf16_clipping`` (default on) passes ``div_scale`` into that path.
* HybridAdam's constructor loads (JIT-builds) the CPU Adam and fused CUDA Adam kernels. Neither runs here:
  with everything offloaded there are no CUDA-resident parameters, and bf16 gradients take the
  plain-torch path above. If the kernels cannot be built (no compiler / CUDA toolkit on the node),
  ``optimizer="auto"`` constructs HybridAdam without them and labels the system ``gemini[torch-adamw]``;
  its updates are then computed by the same torch code as they would have been anyway.
* GeminiDDP creates the fp32 master chunks from the parameters *after* casting them to bf16, so its
  masters start bf16-rounded (relative change <= 2^-9); step-0 losses are unaffected (the forward runs
  in bf16 everywhere).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types

import torch

from megatrain.system import OptimConfig, StepResult

from .common import (COMMON_OPTIONS, BaselineSystem, CausalLMLoss, build_guarded, clip_norm,
                     enable_activation_checkpointing, fp32_rotary_buffers, load_hf_model,
                     non_fp32_float_buffers, prepare_step, read_hf_config, set_single_process_env)

OPTIONS = dict(
    COMMON_OPTIONS,
    optimizer="auto",  # "auto" (HybridAdam, kernel-less HybridAdam if its kernels cannot be built),
                       # "hybrid_adam" (kernels required), "torch_adamw" (kernel-less HybridAdam)
    placement_policy="static",
    shard_param_frac=1.0,
    offload_optim_frac=1.0,
    offload_param_frac=1.0,
    pin_memory=True,
    fix_bf16_clipping=True,
    plugin_kwargs=None,  # dict of further GeminiPlugin arguments (e.g. max_prefetch, chunk_config_dict)
)

STUB_MODULES = ("galore_torch", "bitsandbytes")


# -- pieces that do not need colossalai (tested on CPU) -------------------------------------------
def _stub_galore() -> types.ModuleType:
    mod = types.ModuleType("galore_torch")
    mod.__doc__ = "stand-in installed by baselines.gemini: ColossalAI imports it, we never use GaLore"

    def _unavailable(*_a, **_k):
        raise ImportError("galore_torch is not installed (baselines.gemini put a stand-in in sys.modules)")

    mod.GaLoreAdamW = type("GaLoreAdamW", (torch.optim.Optimizer,), {"__init__": _unavailable})
    mod.GaLoreAdafactor = type("GaLoreAdafactor", (torch.optim.Optimizer,), {"__init__": _unavailable})
    return mod


def _stub_bitsandbytes() -> dict[str, types.ModuleType]:
    def _unavailable(*_a, **_k):
        raise ImportError("bitsandbytes is not installed (baselines.gemini put a stand-in in sys.modules)")

    root = types.ModuleType("bitsandbytes")
    root.__doc__ = "stand-in installed by baselines.gemini: ColossalAI imports it, we never use 8-bit optimizers"
    root.__version__ = "0.0.0"  # colossalai.quantization.bnb reads it; 0.0.0 disables its 4/8-bit paths
    optim = types.ModuleType("bitsandbytes.optim")
    optimizer = types.ModuleType("bitsandbytes.optim.optimizer")
    optimizer.Optimizer2State = type("Optimizer2State", (torch.optim.Optimizer,), {"__init__": _unavailable})
    root.optim, optim.optimizer = optim, optimizer
    return {"bitsandbytes": root, "bitsandbytes.optim": optim, "bitsandbytes.optim.optimizer": optimizer}


def stub_optional_imports() -> list[str]:
    """Put stand-ins for ``galore_torch`` and ``bitsandbytes`` into ``sys.modules`` where they are neither
    imported nor installed; returns the names stubbed (installed packages are left alone)."""
    stubbed = []
    for name in STUB_MODULES:
        if name in sys.modules:
            continue
        try:
            if importlib.util.find_spec(name) is not None:
                continue
        except (ImportError, ValueError):
            pass
        if name == "galore_torch":
            sys.modules[name] = _stub_galore()
        else:
            sys.modules.update(_stub_bitsandbytes())
        stubbed.append(name)
    return stubbed


def system_label(optimizer_kind: str) -> str:
    """``gemini`` with HybridAdam and its kernels; ``gemini[torch-adamw]`` with the kernel-less variant."""
    return "gemini" if optimizer_kind == "hybrid_adam" else "gemini[torch-adamw]"


def precision_name(dtype: torch.dtype) -> str:
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    if dtype not in names:
        raise ValueError(f"Gemini trains in bf16 or fp16 (fp32 master weights); got dtype={dtype}")
    return names[dtype]


def gemini_plugin_kwargs(opts: dict, optim: OptimConfig, micro_batches: int, dtype: torch.dtype,
                         hidden_size: int | None = None) -> dict:
    """Arguments of ``GeminiPlugin`` for this run."""
    kwargs = dict(
        placement_policy=opts["placement_policy"],
        shard_param_frac=float(opts["shard_param_frac"]),
        offload_optim_frac=float(opts["offload_optim_frac"]),
        offload_param_frac=float(opts["offload_param_frac"]),
        precision=precision_name(dtype),
        pin_memory=bool(opts["pin_memory"]),
        max_norm=clip_norm(optim),
        enable_gradient_accumulation=micro_batches > 1,
        verbose=False,
    )
    if hidden_size:
        kwargs["hidden_dim"] = int(hidden_size)  # speeds up the chunk-size search
    kwargs.update(opts.get("plugin_kwargs") or {})
    return kwargs


class _Kernelless:
    """Stands in for ColossalAI's kernel loaders: HybridAdam is built without CPU Adam / fused CUDA Adam."""

    class _Op:
        def __init__(self, *_a, **_k):
            pass

        def step(self, *_a, **_k):
            raise RuntimeError("gemini[torch-adamw]: the CPU Adam kernel is unavailable; this update needed it "
                               "(fp32/fp16 gradients on CPU parameters)")

    def load(self):
        def multi_tensor_adam(*_a, **_k):
            raise RuntimeError("gemini[torch-adamw]: the fused CUDA Adam kernel is unavailable; some parameters "
                               "are CUDA-resident (offload fractions < 1?)")

        return types.SimpleNamespace(CPUAdamOptimizer=self._Op, multi_tensor_adam=multi_tensor_adam)


@contextlib.contextmanager
def kernelless_hybrid_adam():
    """Within: constructing HybridAdam loads no kernel."""
    from colossalai.nn.optimizer import cpu_adam, hybrid_adam

    saved = cpu_adam.CPUAdamLoader, hybrid_adam.FusedOptimizerLoader
    cpu_adam.CPUAdamLoader = hybrid_adam.FusedOptimizerLoader = _Kernelless
    try:
        yield
    finally:
        cpu_adam.CPUAdamLoader, hybrid_adam.FusedOptimizerLoader = saved


def patch_bf16_clipping(adam) -> None:
    """Make HybridAdam's plain-torch update (the one bf16 gradients take) honour ``div_scale``, the
    divisor carrying GeminiOptimizer's clipping factor (and fp16 loss scale). Instance-level patch."""
    cls = type(adam)
    current = {"div_scale": -1.0}

    def step(closure=None, div_scale: float = -1):
        current["div_scale"] = div_scale
        try:
            return cls.step(adam, closure, div_scale)
        finally:
            current["div_scale"] = -1.0

    def torch_adam_update(data, grad, *args, **kwargs):
        div = current["div_scale"]
        if div is not None and div > 0:
            grad = grad.to(data.dtype) / div
        return cls.torch_adam_update(adam, data, grad, *args, **kwargs)

    adam.step = step
    adam.torch_adam_update = torch_adam_update


# -- the system ------------------------------------------------------------------------------------
class GeminiSystem(BaselineSystem):
    name = "gemini"

    OPTIONS = OPTIONS
    CHOICES = {"optimizer": ("auto", "hybrid_adam", "torch_adamw")}
    booster = plugin = None

    def _check_device(self, device, dtype) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError("Gemini needs CUDA: ColossalAI's chunk manager, its CUDA streams and HybridAdam "
                               f"run only on a GPU (device={str(device)!r}, CUDA available: {torch.cuda.is_available()})")
        precision_name(dtype)

    def _build(self, init_dir, opts, dtype, activation_checkpointing) -> None:
        import torch.distributed as dist

        stubbed = stub_optional_imports()
        import colossalai
        from colossalai.booster import Booster
        from colossalai.booster.plugin import GeminiPlugin
        from colossalai.nn.optimizer import HybridAdam

        if not dist.is_initialized():
            set_single_process_env(self.device.index or 0)
            colossalai.launch(rank=0, world_size=1, host=os.environ["MASTER_ADDR"],
                              port=int(os.environ["MASTER_PORT"]), backend="nccl",
                              local_rank=self.device.index or 0, verbose=False)
            self._owns_process_group = True

        hf_config = read_hf_config(init_dir, opts["attn_implementation"])
        lm = load_hf_model(init_dir, opts["attn_implementation"])  # fp32 on CPU; Gemini chunks it
        if activation_checkpointing:
            enable_activation_checkpointing(lm)
        module = CausalLMLoss(lm, opts["loss_chunk_tokens"])

        o = self.optim
        akw = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, adamw_mode=True)
        kind = opts["optimizer"]
        adam = None
        if kind in ("auto", "hybrid_adam"):
            try:
                adam = HybridAdam(module.parameters(), **akw)
                kind = "hybrid_adam"
            except Exception as exc:  # kernel build failed
                if kind == "hybrid_adam":
                    raise
                self.info["hybrid_adam_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
                kind = "torch_adamw"
        if adam is None:
            with kernelless_hybrid_adam():
                adam = HybridAdam(module.parameters(), **akw)
        if opts["fix_bf16_clipping"]:
            patch_bf16_clipping(adam)

        plugin_kwargs = gemini_plugin_kwargs(opts, o, self.micro_batches, dtype, hf_config.hidden_size)
        self.plugin = GeminiPlugin(**plugin_kwargs)
        self.booster = Booster(plugin=self.plugin)
        self.model, self.optimizer, _, _, _ = self.booster.boost(module, adam)
        inner = self.model.unwrap() if hasattr(self.model, "unwrap") else module
        fixed = fp32_rotary_buffers(inner)
        self.name = system_label(kind)
        self.info.update(system=self.name, optimizer="HybridAdam" if kind == "hybrid_adam" else
                         "HybridAdam without kernels (torch update path)", stubbed_modules=stubbed,
                         colossalai_version=getattr(colossalai, "__version__", "?"), plugin=plugin_kwargs,
                         settings=plugin_kwargs,
                         rotary_buffers_rebuilt_fp32=fixed, non_fp32_buffers=non_fp32_float_buffers(inner),
                         bf16_clipping_fixed=bool(opts["fix_bf16_clipping"]),
                         compute_dtype=str(dtype).replace("torch.", ""),
                         activation_checkpointing=bool(activation_checkpointing),
                         options={k: v for k, v in opts.items() if k != "plugin_kwargs"})

    def _step(self, batch, t0) -> StepResult:
        mbs, denom, tokens = prepare_step(batch, self.micro_batches, self.device)
        lr = self.lr_for_step(self.steps_done)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = None
        for mb in mbs:
            loss = self.model(**mb.inputs, denom=denom)
            self.booster.backward(loss, self.optimizer)
            total = loss.detach().float() if total is None else total + loss.detach().float()
        self.optimizer.step()
        self.optimizer.zero_grad()
        norm = self.optimizer.get_grad_norm() if hasattr(self.optimizer, "get_grad_norm") else None
        loss_value = float(total)
        norm_value = float(norm) if norm is not None else float("nan")
        return StepResult(loss=loss_value, tokens=tokens, step_time_s=self.elapsed(t0), lr=lr, grad_norm=norm_value)

    def _release(self) -> None:
        self.model = self.optimizer = self.booster = None
        plugin, self.plugin = self.plugin, None
        mesh = getattr(plugin, "pg_mesh", None)
        if mesh is not None:
            try:
                mesh.destroy_mesh_process_groups()  # what GeminiPlugin.__del__ does, but now, while
            except Exception:                     # the default group still exists
                pass
            groups = getattr(mesh, "_ranks_to_group", None)
            if isinstance(groups, dict):
                groups.clear()  # so the later __del__ has nothing left to destroy
        del plugin


def build(**kwargs) -> GeminiSystem:
    return build_guarded(GeminiSystem, GeminiSystem.name, **kwargs)
