"""DeepSpeed ZenFlow: ZeRO-2 with the optimizer offloaded, the important gradient columns updated on the
GPU at once and the rest applied on the CPU later (``zero_optimization.zenflow``, DeepSpeed >= 0.17.5).

**Not exact AdamW.** Every step, ZenFlow picks the ``topk_ratio`` columns of each 2-D weight with the
largest gradient magnitude (re-picked every ``select_interval`` steps) and updates them on the GPU with
its own AdamW; the other columns' gradients are summed on the host and applied by DeepSpeed's CPU Adam
every ``update_interval`` steps (with ``overlap_step`` in a separate process, while the GPU runs the
next steps: their result reaches the GPU one interval later). So most weights see one update per
interval, from the interval's mean gradient, up to two intervals late: bounded staleness. Each row says
so (``settings``: ``exact_adamw: false`` and the staleness knobs; ``info["notes"]``).

The configuration is DeepSpeed's ZenFlow tutorial's (deepspeed.ai/tutorials/zenflow): stage 2,
``offload_optimizer: {device: cpu, pin_memory: true}``, ``zenflow: {topk_ratio: 0.05, select_strategy:
auto, select_interval: auto, update_interval: 4, full_warm_up_rounds: 0, overlap_step: true}``, plus the
tuned ZeRO-2 buckets of the other DeepSpeed systems and ``pt_reserved_cores_perc`` 0.5 (DeepSpeed's
default: half the cores train, half run the optimizer process). ``options["zenflow"]`` overrides any knob;
``options["pin_memory"]`` the offload's pinning. The optimizer is the one DeepSpeed builds for ZenFlow from
the config's ``optimizer`` section (``ZenFlowCPUAdam``, AdamW mode): a client optimizer cannot be used
(ZenFlow's GPU-side AdamW takes its hyper-parameters from that section).

One backward per step: ZenFlow sets DeepSpeed's ``gradient_accumulation_steps`` to its
``update_interval`` (every ``engine.step()`` is one ZenFlow step), so a step cannot be split into
micro-batches (``micro_batches`` must be 1). The loss goes through ``engine.backward`` as a ZenFlow user's
does: DeepSpeed divides it by ``update_interval``, so the CPU side applies the interval's mean gradient.
With ``select_strategy: auto`` and no training dataloader given to DeepSpeed (the harness feeds batches
itself), DeepSpeed picks the columns once, at the first step, and never again (``select_interval`` 0);
the row records the effective value.

Spawn: with ``overlap_step`` DeepSpeed starts its optimizer process with the "spawn" method at the first
CPU update, which re-imports the launching script as ``__mp_main__``: the entry point must keep its work
under ``if __name__ == "__main__":`` (``experiments.point`` does; tests/test_baselines_zenflow.py checks
that importing it that way does nothing). Host memory: see ``host_bytes_per_param`` (about 44 B/param
with the tutorial's settings: the Qwen2.5-3B shape does not fit a 126 GiB host, 1.5B does).
"""
from __future__ import annotations

import math

from megatrain.system import StepResult

from .common import build_guarded, clip_norm, prepare_step
from .zero3 import OPTIONS as ZERO_OPTIONS
from .zero3 import TUNED_ZERO, DeepSpeedSystem, _merge

# DeepSpeed's ZenFlow tutorial, plus DeepSpeed's default core split (written out so the row shows it).
ZENFLOW_DEFAULTS = {
    "topk_ratio": 0.05,
    "select_strategy": "auto",
    "select_interval": "auto",
    "update_interval": 4,
    "overlap_step": True,
    "offload": False,  # the GPU-side AdamW's state for the selected columns stays on the GPU
    "full_warm_up_rounds": 0,
    "pt_reserved_cores_perc": 0.5,
}

OPTIONS = dict(
    ZERO_OPTIONS,
    optimizer="auto",  # only "auto": DeepSpeed's ZenFlowCPUAdam, built from the config's optimizer section
    zenflow=None,  # dict merged over ZENFLOW_DEFAULTS
    pin_memory=True,  # offload_optimizer.pin_memory (False: pageable host buffers, ~8 B/param less)
    fix_layout=True,  # undo DeepSpeed 0.19.8's scrambled 2-D weights under ZenFlow (fix_transposed_views)
)

EXACT_ADAMW_NOTE = ("not exact AdamW: top-k gradient columns updated on the GPU every step, the rest applied "
                    "on the CPU every update_interval steps from the interval's mean gradient (bounded staleness)")


def zenflow_config(overrides: dict | None = None) -> dict:
    """The ``zero_optimization.zenflow`` section: the defaults with ``overrides``; unknown keys raise."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(ZENFLOW_DEFAULTS) - {"auto_ratio"})
    if unknown:
        raise ValueError(f"unknown zenflow options {unknown}; valid: {', '.join(sorted(ZENFLOW_DEFAULTS))}, auto_ratio")
    return dict(ZENFLOW_DEFAULTS, **overrides)


def make_zenflow_ds_config(optim, *, bf16: bool, zenflow: dict, pin_memory: bool = True,
                           zero_overrides: dict | None = None, config_overrides: dict | None = None) -> dict:
    """The whole DeepSpeed config of the ZenFlow system (no "auto" values)."""
    zero = {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": bool(pin_memory)},
        "overlap_comm": True,  # ZenFlow's selective-optimizer offload asserts it; the tutorial's ZeRO-2 default
        "contiguous_gradients": True,
        "reduce_bucket_size": TUNED_ZERO["reduce_bucket_size"],
        "allgather_bucket_size": TUNED_ZERO["allgather_bucket_size"],
        "allgather_partitions": True,
        "reduce_scatter": True,
        "zenflow": dict(zenflow),
    }
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # ZenFlow replaces it by its update_interval
        "gradient_clipping": clip_norm(optim),
        "bf16": {"enabled": bool(bf16)},
        "fp16": {"enabled": False},
        # ZenFlow's CPU Adam and its GPU-side selective AdamW are both built from this section.
        "optimizer": {"type": "AdamW", "params": {"lr": float(optim.lr), "betas": [float(b) for b in optim.betas],
                                                  "eps": float(optim.eps),
                                                  "weight_decay": float(optim.weight_decay)}},
        "zero_optimization": _merge(zero, zero_overrides),
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return _merge(cfg, config_overrides)


def fix_transposed_views(zero_optimizer) -> bool:
    """Make every 2-D parameter a correct view of ZenFlow's flat buffer again; True if it was needed.

    ZenFlow flattens each 2-D parameter *transposed* into ZeRO-2's flat bf16 buffer (its
    ``_flatten_dense_tensors``), and its gradients and fp32 masters follow that layout. DeepSpeed 0.19.8's
    ``_update_model_bit16_weights`` (called by ``deepspeed.initialize`` and after every update) re-points
    each parameter at its segment with ``narrow(...).view(shape)``, without transposing back: every 2-D
    weight of an (r, c) matrix W then holds ``W.T.contiguous().view(r, c)``, a scrambled matrix (seen
    on the CPU: step-0 loss 5.593 instead of the shared weights' 5.560 on the tiny model), and each
    update lands on the wrong elements. This replaces that method on the optimizer instance by one that
    views a 2-D segment as (c, r) and transposes it (what ZenFlow's ``_unflatten_dense_tensors`` does),
    then re-points every parameter once. Only when the optimizer flattens the ZenFlow way."""
    import types

    from deepspeed.runtime.zenflow import zenflow_utils

    if getattr(zero_optimizer, "flatten", None) is not zenflow_utils._flatten_dense_tensors:
        return False

    def update_model_bit16_weights(self, group_index):
        flat_group = self.bit16_groups_flat[group_index]
        for p, meta, offset in zip(self.round_robin_bit16_groups[group_index],
                                   self.round_robin_bit16_meta[group_index],
                                   self.round_robin_bit16_offsets[group_index]):
            segment = flat_group.narrow(0, offset, meta.numel())
            view = segment.view(meta.shape[1], meta.shape[0]).t() if meta.dim() == 2 else segment.view(meta.shape)
            p.data = view.data
        for param_index, param in enumerate(self.bit16_groups[group_index]):
            new_index = self.round_robin_bit16_indices[group_index][param_index]
            param.data = self.round_robin_bit16_groups[group_index][new_index].data

    zero_optimizer._update_model_bit16_weights = types.MethodType(update_model_bit16_weights, zero_optimizer)
    for i in range(len(zero_optimizer.bit16_groups)):
        zero_optimizer._update_model_bit16_weights(i)
    return True


def host_bytes_per_param(*, overlap_step: bool = True, pin_memory: bool = True, bf16: bool = True) -> dict:
    """Host bytes per parameter ZenFlow holds once its CPU optimizer runs, part by part, as read off
    DeepSpeed 0.19.8 (``runtime/zero/stage_1_and_2.py``, ``runtime/zenflow/zenflow_stage_1_and_2.py``,
    ``runtime/zenflow/zenflow_utils.py``); world size 1. An estimate to check against the measured
    host peak (the row's host_bytes_per_param), not a measurement.

    With ``overlap_step`` the optimizer process (spawned at the first CPU update) allocates two copies of
    m and v of its own; the parent's fp32 master and its two fp32 gradient buffers are moved into shared
    memory there (``share_memory_``: a fresh copy), and with ``pin_memory`` the pinned originals of the
    master and of the first gradient buffer stay in torch's caching host allocator (DeepSpeed does not
    empty it), so they are counted too."""
    lp = 2 if bf16 else 4
    parts = {
        "fp32 master partition": 4,
        "low-precision staging buffer (param_buffer_of_bit16_for_cpu_offload_groups)": lp,
        "gradient accumulation buffers (accumulated_grads_in_cpu, param dtype)": lp,
    }
    if overlap_step:
        parts["two fp32 gradient buffers (overlap_grad)"] = 8
        parts["stale fp32 parameters (stale_param)"] = 4
        parts["optimizer process: m and v, two copies each"] = 16
        if pin_memory:
            parts["pinned originals left in torch's host cache by share_memory_ (master, overlap_grad[0])"] = 8
    else:
        parts["fp32 gradient partition"] = 4
        parts["CPU Adam m and v"] = 8
    parts["total"] = sum(parts.values())
    return parts


class ZenFlowSystem(DeepSpeedSystem):
    """ZenFlow behind the shared interface (``DeepSpeedSystem`` with its own config, optimizer and step)."""

    name = variant = "zenflow"
    OPTIONS = OPTIONS
    CHOICES = {"optimizer": ("auto",), "buckets": ("tuned", "hf_auto")}

    def __init__(self, *, micro_batches: int = 1, **kwargs):
        if int(micro_batches) != 1:
            raise ValueError(f"zenflow: micro_batches must be 1, got {micro_batches} (ZenFlow uses DeepSpeed's "
                             f"gradient accumulation as its update_interval: one backward per step)")
        self.cpu_updates = 0
        super().__init__(micro_batches=micro_batches, **kwargs)

    def _make_config(self, hf_config, opts: dict, bf16: bool, choice: str) -> dict:
        self.zenflow = zenflow_config(opts["zenflow"])
        return make_zenflow_ds_config(self.optim, bf16=bf16, zenflow=self.zenflow, pin_memory=opts["pin_memory"],
                                      zero_overrides=opts["zero_optimization"], config_overrides=opts["ds_config"])

    def _initialize(self, ds, ds_config: dict, choice: str, opts: dict) -> str:
        self.engine, _, _, _ = ds.initialize(model=self.module, model_parameters=list(self.module.parameters()),
                                             config=ds_config)
        layout_fixed = bool(opts["fix_layout"]) and fix_transposed_views(self.engine.optimizer)
        inner = getattr(self.engine.optimizer, "optimizer", None)
        zf = ds_config["zero_optimization"]["zenflow"]
        bf16 = bool(ds_config["bf16"]["enabled"])
        estimate = host_bytes_per_param(overlap_step=bool(zf["overlap_step"]),
                                        pin_memory=bool(ds_config["zero_optimization"]["offload_optimizer"]["pin_memory"]),
                                        bf16=bf16)
        # What the engine made of the knobs (e.g. select_interval "auto" without a dataloader -> 0: select once).
        effective = {k: getattr(self.engine, k, None) for k in ("select_interval", "update_interval", "auto_update",
                                                                 "overlap_step", "full_warm_up_rounds")}
        self._scale_wrt_gas = self.engine.gradient_accumulation_steps() >= 1  # "auto" update_interval sets it to 0
        self._zenflow_facts = dict(zenflow=zf, effective=effective, host_estimate_bytes_per_param=estimate,
                                   notes=EXACT_ADAMW_NOTE, layout_fixed=layout_fixed)
        return type(inner).__name__ if inner is not None else type(self.engine.optimizer).__name__

    def _finish_build(self) -> None:
        super()._finish_build()
        facts = getattr(self, "_zenflow_facts", None)
        if not facts:
            return
        zf, eff = facts["zenflow"], facts["effective"]
        self.info.update(zenflow=zf, zenflow_effective=eff, notes=facts["notes"],
                         host_estimate_bytes_per_param=facts["host_estimate_bytes_per_param"])
        self.info["settings"].update(
            exact_adamw=False, note=facts["notes"], topk_ratio=zf["topk_ratio"],
            select_strategy=zf["select_strategy"], select_interval=zf["select_interval"],
            select_interval_effective=eff["select_interval"], update_interval=zf["update_interval"],
            overlap_step=zf["overlap_step"], zenflow_offload=zf["offload"],
            full_warm_up_rounds=zf["full_warm_up_rounds"], pt_reserved_cores_perc=zf["pt_reserved_cores_perc"],
            # with overlap_step the CPU update of interval k is applied at the end of interval k+1
            max_staleness_steps=(2 if zf["overlap_step"] else 1) * int(eff["update_interval"] or 1),
            host_estimate_bytes_per_param=facts["host_estimate_bytes_per_param"]["total"],
            pin_memory=self.info["ds_config"]["zero_optimization"]["offload_optimizer"]["pin_memory"],
            layout_fix=facts["layout_fixed"])

    def _step(self, batch, t0) -> StepResult:
        engine = self.engine
        mbs, denom, tokens = prepare_step(batch, 1, self.device)
        lr = self.lr_for_step(self.steps_done)
        for group in engine.optimizer.param_groups:  # ZenFlow copies it to its GPU-side AdamW in step()
            group["lr"] = lr
        start = engine.global_steps
        loss = engine(**mbs[0].inputs, denom=denom)
        engine.backward(loss, scale_wrt_gas=self._scale_wrt_gas)
        engine.step()
        cpu_update = engine.global_steps != start  # an update_interval boundary: the CPU side stepped
        self.cpu_updates += int(cpu_update)
        norm = engine.get_global_grad_norm() if cpu_update else None
        norm_value = float(norm) if norm is not None else math.nan  # only boundaries compute a norm
        return StepResult(loss=float(loss.detach().float()), tokens=tokens, step_time_s=self.elapsed(t0), lr=lr,
                          grad_norm=norm_value)

    def state_dict(self) -> dict:
        """HF-named weights as ZenFlow trains them: its working parameters (on the GPU with CUDA), in fp32.
        Not the host fp32 masters: those miss the GPU-side updates of the selected columns until the next
        selection re-syncs them (``sync_fp32_param_from_gpu``), so they are not the model being trained."""
        return {name: p.detach().float().cpu().clone()
                for name, p in self.module.lm.named_parameters(remove_duplicate=False)}

    def memory(self):
        stats = super().memory()
        stats.extra["zenflow_cpu_updates"] = self.cpu_updates
        return stats

    def _release(self) -> None:
        """Stop ZenFlow's optimizer process too (a daemon, but a sweep's next point should not share the
        host with it)."""
        opt = getattr(self.engine, "optimizer", None) if self.engine is not None else None
        proc = getattr(opt, "process", None)
        try:
            super()._release()
        finally:
            if proc is not None and proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5)


def build(**kwargs) -> ZenFlowSystem:
    return build_guarded(ZenFlowSystem, ZenFlowSystem.name, **kwargs)


