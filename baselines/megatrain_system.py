"""The MegaTrain engine behind the shared TrainSystem interface (what the runner and baselines see).

``options`` is the engine's ``megatrain.config.EngineConfig``: the runner's hydra schema of this system
*is* EngineConfig, and the runner builds the point's one EngineConfig at expansion
(``experiments.sweeps.merge_options``), so an option goes from the command line
(``system.options.gpu_resident=0``) through ``job.json`` to ``MegaTrain`` as that object, untouched. The
run-level fields every system gets as arguments (device, compute dtype, micro-batches, optim) must agree
with it. A caller may pass a dict of the other fields instead (tests, scripts): it becomes the
EngineConfig here, with the arguments' run-level fields.
"""
from __future__ import annotations

import dataclasses

from megatrain.config import EngineConfig
from megatrain.system import MemoryStats, OptimConfig, StepResult

# EngineConfig fields that are run-level (the same for every system), not options of this system.
RUN_LEVEL = ("device", "compute_dtype", "micro_batches", "optim")
OPTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name not in RUN_LEVEL)


def engine_config(options: EngineConfig | dict | None, *, optim: OptimConfig, micro_batches: int, device: str,
                  compute_dtype: str = "auto") -> EngineConfig:
    """The engine's config: ``options`` itself when it is an ``EngineConfig`` (its run-level fields must be
    the arguments'), else the dict's fields plus the run-level arguments; unknown or run-level keys raise."""
    run_level = dict(device=device, compute_dtype=compute_dtype, micro_batches=micro_batches, optim=optim)
    if isinstance(options, EngineConfig):
        clash = [k for k, v in run_level.items() if getattr(options, k) != v]
        if clash:
            raise ValueError("megatrain options disagree with the run: " + ", ".join(
                f"{k}={getattr(options, k)!r} vs {run_level[k]!r}" for k in clash))
        return options
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown megatrain options {unknown}; valid: {', '.join(OPTIONS)}")
    return EngineConfig(**run_level, **options)


class MegaTrainSystem:
    name = "megatrain"

    def __init__(self, *, init_dir, optim: OptimConfig, micro_batches: int = 1, device: str = "cuda",
                 dtype=None, activation_checkpointing: bool = True, options: EngineConfig | dict | None = None,
                 step_shape: tuple[int, int] | None = None, dist=None, hf_config=None):
        import torch

        from megatrain.engine import MegaTrain

        # Activation checkpointing is intrinsic to the engine (block recompute); the flag is accepted for
        # interface symmetry and K comes from the options' checkpoint_interval.
        dtype = torch.bfloat16 if dtype is None else dtype
        compute = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]
        cfg = engine_config(options, optim=optim, micro_batches=micro_batches, device=device,
                            compute_dtype=compute if device != "cpu" else "fp32")
        shape = {} if step_shape is None else dict(tokens_per_step=step_shape[0] * step_shape[1],
                                                    seq_len=step_shape[1])
        if init_dir:  # the shared initial weights every system of the point loads
            self.engine = MegaTrain.from_pretrained(str(init_dir), cfg, dist=dist, **shape)
        else:  # no weights on disk (runner shared_init=false): HF's init from cfg.seed, inside the engine
            self.engine = MegaTrain.from_config(hf_config, cfg, dist=dist, **shape)
        from megatrain import cpu_adamw

        plan = self.engine.placement
        self.info = {"host_estimate_bytes": self.engine.host_estimate["total_bytes"],
                     "pool_slots": self.engine.num_pool_slots, "config": cfg.to_dict(),
                     "gpu_resident_layers": plan.gpu_layers, "placement": plan.summary(),
                     **self.engine.info,  # recompute, blocks_kept / blocks, predicted_step_s and its parts
                     # the placement as numbers, for the runner's row (experiments/schema.py)
                     "tiers": {"gpu_tier_layers": plan.gpu_layers,
                               "host_tier_layers": sum(n.startswith("layer.") for n in plan.host_names),
                               "gpu_tier_params": plan.params_on("gpu"), "host_tier_params": plan.params_on("host")},
                     "optimizer": (f"GPU tier: torch fused AdamW on {device}; host tier: "
                                   f"{cpu_adamw.name() if plan.host_names else 'unused'}"),
                     # the measured real link and the emulated one (None: the real link, not measured)
                     "host_link": self.engine.link.info,
                     # host_link_gbps is the hardware profile's; the runner records it with the CPU side
                     "settings": {k: v for k, v in cfg.to_dict().items()
                                  if k in OPTIONS and k not in ("seed", "host_link_gbps")}}

    def step(self, batch) -> StepResult:
        return self.engine.step(batch)

    def memory(self) -> MemoryStats:
        return self.engine.memory()

    def choosing(self) -> str:
        """Why the engine is still tuning itself ("" when it is not; ``MegaTrain.choosing``): the runner's
        warm-up goes on while it says so (``settle_steps``)."""
        return self.engine.choosing()

    def transient(self) -> str:
        """Why the step that just ran is not a steady one ("" when it is; ``MegaTrain.transient``): the runner
        counts such a would-be first timed step as warm-up (``settle_steps``)."""
        return self.engine.transient()

    def phase_times(self) -> dict[str, float]:
        """The last step's phase timings and counters (``MegaTrain.stats``: host wall time per phase,
        ``optimizer_exposed_s`` = time the step waited for the host AdamW, ``host_update_busy_s``,
        ``gpu_load_wait_s`` = GPU time the compute stream stalled on layer loads, ...)."""
        return dict(self.engine.stats)

    def state_dict(self):
        """HF-named fp32 master weights, as the baselines' ``state_dict`` (parity checks, evaluation)."""
        return self.engine.state_dict()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def build(**kwargs) -> MegaTrainSystem:  # takes MegaTrainSystem's keywords, step_shape and dist included
    return MegaTrainSystem(**kwargs)
