"""The MegaTrain engine behind the shared TrainSystem interface (what the runner and baselines see)."""
from __future__ import annotations

import torch

from megatrain.config import EngineConfig
from megatrain.engine import MegaTrain
from megatrain.system import MemoryStats, OptimConfig, StepResult

# Keys of ``options`` that map onto EngineConfig fields (the ablation switches among them).
ENGINE_OPTIONS = ("num_slots", "checkpoint_interval", "grad_slabs", "overlap_optimizer", "stream_dtype",
                  "loss_chunk_tokens", "pin_memory", "host_margin_gib", "seed")


class MegaTrainSystem:
    name = "megatrain"

    def __init__(self, *, init_dir, optim: OptimConfig, micro_batches: int = 1, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16, activation_checkpointing: bool = True,
                 options: dict | None = None):
        options = dict(options or {})
        unknown = sorted(set(options) - set(ENGINE_OPTIONS))
        if unknown:
            raise ValueError(f"unknown megatrain options {unknown}; valid: {', '.join(ENGINE_OPTIONS)}")
        # Activation checkpointing is intrinsic to the engine (block recompute); the flag is accepted for
        # interface symmetry and K comes from options["checkpoint_interval"].
        compute = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]
        cfg = EngineConfig(device=device, compute_dtype=compute if device != "cpu" else "fp32",
                           micro_batches=micro_batches, optim=optim, **options)
        self.engine = MegaTrain.from_pretrained(str(init_dir), cfg)
        self.info = {"host_estimate_bytes": self.engine.host_estimate["total_bytes"],
                     "pool_slots": self.engine.num_pool_slots, "config": cfg.to_dict()}

    def step(self, batch: dict[str, torch.Tensor]) -> StepResult:
        return self.engine.step(batch)

    def memory(self) -> MemoryStats:
        return self.engine.memory()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def build(**kwargs) -> MegaTrainSystem:
    return MegaTrainSystem(**kwargs)
