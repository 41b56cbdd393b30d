"""Block-boundary activations: the only activations the forward keeps for the backward.

The forward hands the hidden state entering each checkpoint block to ``keep``; the backward asks for it
with ``take`` (blocks in reverse order). ``GpuBoundaries`` keeps them on the GPU. Other homes (pinned host
memory for long sequences) implement the same three methods.
"""
from __future__ import annotations

import torch


class GpuBoundaries:
    """Boundary activations kept where they were made (on the compute device)."""

    def __init__(self, num_micro_batches: int):
        self._kept: list[dict[int, torch.Tensor]] = [{} for _ in range(num_micro_batches)]

    def keep(self, mb: int, layer: int, hidden: torch.Tensor) -> None:
        """``hidden`` enters layer ``layer`` (a block start) for micro-batch ``mb``."""
        self._kept[mb][layer] = hidden

    def take(self, mb: int, layer: int) -> torch.Tensor:
        """The kept activation, handed over (the store forgets it)."""
        return self._kept[mb].pop(layer)

    def clear(self) -> None:
        for d in self._kept:
            d.clear()
