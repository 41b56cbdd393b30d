"""The one interface every training system in this repo implements (the engine and each baseline).

Siblings behind a protocol, not a class hierarchy: a system is built from the same model spec, the same
initial weights (a ``save_pretrained``-style directory materialised once), the same optimizer settings
and the same batches; it exposes ``step`` (returns the loss), ``memory`` (peaks) and ``close``.

Loss convention shared by all systems: mean token cross-entropy over the labelled (``!= -100``),
shifted targets of the whole step, summed over micro-batches and divided by the step's total labelled
token count (the same as one big batch, whatever the micro-batch split).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is imported by the functions that use it: the dataclasses here are the
    import torch   # runner's hydra schemas and must import without it

IGNORE_INDEX = -100


@dataclass
class OptimConfig:
    """AdamW with decoupled weight decay, global grad-norm clipping and warmup + cosine LR."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0  # None or <= 0: no clipping
    warmup_steps: int = 0
    total_steps: int | None = None  # None: constant LR after warmup
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio at total_steps

    def lr_at(self, step: int) -> float:
        """LR for optimizer step ``step`` (0-based): linear warmup, then cosine to ``min_lr_ratio``."""
        return self.lr * lr_multiplier(step, self.warmup_steps, self.total_steps, self.min_lr_ratio)


def lr_multiplier(step: int, warmup_steps: int, total_steps: int | None, min_lr_ratio: float) -> float:
    """Multiplier of the base LR at 0-based ``step``; usable as a ``LambdaLR`` lambda for references."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps is None or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class StepResult:
    """What one optimizer step reports. ``loss`` is the step's mean token loss (see module doc)."""

    loss: float
    tokens: int  # tokens processed in the step (batch x seq over all micro-batches, padding included)
    step_time_s: float
    lr: float = float("nan")
    grad_norm: float = float("nan")  # pre-clipping global L2 norm, where the system exposes it

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class MemoryStats:
    """Memory peaks since the system was built (bytes). Fields a system cannot measure stay -1."""

    gpu_peak_allocated: int = -1
    gpu_peak_reserved: int = -1
    host_rss: int = -1
    host_pinned: int = -1
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@runtime_checkable
class TrainSystem(Protocol):
    """setup happens in the constructor/factory; then step, memory, close."""

    name: str

    def step(self, batch: dict[str, torch.Tensor]) -> StepResult: ...

    def memory(self) -> MemoryStats: ...

    def close(self) -> None: ...


def step_flops(num_params: int, num_layers: int, hidden: int, seq_len: int, tokens: int) -> float:
    """Model FLOPs of one training step, the paper's convention: 6·P·T + 12·L·h·s·T.

    6·P·T counts forward (2PT) and backward (4PT) matmuls over all parameters; 12·L·h·s·T the causal
    attention score/value matmuls. Recompute is *not* counted, so TFLOPS is "useful" throughput.
    """
    return 6.0 * num_params * tokens + 12.0 * num_layers * hidden * seq_len * tokens


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets aligned with positions: position t predicts labels[t+1]; the last position is ignored."""
    import torch

    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def labels_from_batch(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Explicit labels if given, else input_ids with padded positions (attention_mask == 0) ignored."""
    labels = batch.get("labels")
    if labels is None:
        labels = batch["input_ids"].clone()
        mask = batch.get("attention_mask")
        if mask is not None:
            labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    return labels


def split_micro_batches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Split a batch along dim 0 into ``n`` micro-batches (each must get at least one row)."""
    import torch

    bsz = batch["input_ids"].shape[0]
    if n < 1 or n > bsz:
        raise ValueError(f"cannot split a batch of {bsz} rows into {n} micro-batches")
    out = [{} for _ in range(n)]
    for key, value in batch.items():
        if value is None:
            continue
        for i, chunk in enumerate(torch.tensor_split(value, n, dim=0)):
            out[i][key] = chunk
    return out
