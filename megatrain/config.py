"""Engine configuration (mirrored by the hydra YAML under experiments/conf/system/megatrain.yaml)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .system import OptimConfig

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[value]
    except KeyError:
        raise ValueError(f"unknown dtype {value!r}; use one of {sorted(_DTYPES)}") from None


@dataclass
class EngineConfig:
    """Knobs of the streaming engine. Defaults are the "full" system of the paper's ablation."""

    device: str = "auto"  # "auto" (cuda if available), "cuda", "cuda:N" or "cpu"
    compute_dtype: str = "auto"  # "auto": bf16 on CUDA, fp32 on CPU; weights are cast on the GPU
    # Weight slots on the GPU. 2 = double buffering (load layer i+1 while i computes); 1 = the
    # synchronous ablation: no prefetch at all, each load issued when compute needs it and serialised
    # after queued compute. With checkpoint interval K the pool holds K + num_slots - 1 slots, because a
    # block's K layers must stay resident from recompute through backward (loaded once, not twice).
    num_slots: int = 2
    # Layers per activation-checkpoint block (K). Boundaries are kept every K layers; 0 = all layers.
    checkpoint_interval: int = 1
    # Pinned host slabs receiving weight gradients on the D2H stream. 0 = no pool: each layer's gradient
    # is copied synchronously to fresh pageable memory (the "no slab pool" ablation).
    grad_slabs: int = 4
    # Run the CPU AdamW of step n in a background thread, overlapping the next step's forward: layer i's
    # next load waits only for layer i's update. False: the update finishes inside step().
    overlap_optimizer: bool = True
    # What crosses PCIe for weights: "fp32" master (cast to compute dtype on the GPU; 4 B/param) or a
    # pinned "bf16" shadow refreshed by the optimizer (2 B/param over PCIe, +2 B/param host).
    stream_dtype: str = "fp32"
    # Gradient accumulation: the batch given to step() is split into this many micro-batches.
    micro_batches: int = 1
    # Tokens per chunk of the final norm + LM head + cross-entropy (full logits never exist at once).
    loss_chunk_tokens: int = 4096
    # Pin the fp32 master buffers (page-locked H2D source). Only on CUDA.
    pin_memory: bool = True
    # Refuse to build unless estimate <= available host RAM - margin.
    host_margin_gib: float = 2.0
    attn_implementation: str = "sdpa"
    seed: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        if isinstance(self.optim, dict):
            self.optim = OptimConfig(**self.optim)
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval must be >= 0 (0 = all layers), got {self.checkpoint_interval}")
        if self.grad_slabs < 0:
            raise ValueError(f"grad_slabs must be >= 0, got {self.grad_slabs}")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.stream_dtype not in ("fp32", "bf16"):
            raise ValueError(f"stream_dtype must be 'fp32' or 'bf16', got {self.stream_dtype!r}")
        if self.loss_chunk_tokens < 1:
            raise ValueError("loss_chunk_tokens must be >= 1")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {self.device!r} requested but CUDA is not available")
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be cuda or cpu, got {self.device!r}")
        return dev

    def resolved_compute_dtype(self) -> torch.dtype:
        if self.compute_dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return parse_dtype(self.compute_dtype)

    def to_dict(self) -> dict:
        return asdict(self)
