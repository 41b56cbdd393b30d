"""Kept blocks: a block's autograd graph made in the forward and kept for its backward (no recompute).

A kept layer runs its forward with autograd on a slot's weights, and its graph saves what the backward needs:
activations, and views of the weights (e.g. ``weight`` for ``dX = dY @ W``). The slot is released as usual
after the layer, and the next layer loads into it, so the graph must not hold the slot's memory. It holds
the weights by *position* instead: a saved-tensor hook packs every tensor that lives in the slot's buffer
as (layer, offset, shape, stride), and unpacks it, during the backward, as the same view of whichever slot
holds that layer then. Every layer is loaded again for its backward (the pool's order already does so:
forward 0..L-1, then each block), so a kept block costs what a recomputed one costs on the host link and
in slots, and its recompute is saved. All slots share one layout, so the offsets are valid in any of them.

With hooks on, autograd does not check saved tensors' version counters; what makes the unpacked view right
is the pool: the backward slot holds the layer's current weights (acquired, its load waited for), and the
weights do not change between forward and backward (the step's update comes after the backward).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (never a slot's weight)
        return None


@dataclass
class _WeightRef:
    """A weight view saved by a kept layer's graph, by position in the layer's slot."""

    layer: int
    offset: int
    size: tuple
    stride: tuple


@dataclass
class KeptGraph:
    """One kept layer's graph for one micro-batch: the detached input that requires grad, the output, and
    the forward slot's parameters (the graph's leaves: gradients are taken with respect to them)."""

    input: torch.Tensor
    output: torch.Tensor
    params: list


@dataclass
class KeptBlocks:
    """The step's kept graphs and the slots the backward reads their weights from."""

    graphs: dict = field(default_factory=dict)  # (micro-batch, layer) -> KeptGraph
    _backward_slots: dict = field(default_factory=dict)  # layer -> slot holding it in the backward

    def recording(self, layer: int, slot):
        """Context for a kept layer's forward in ``slot``: weights are saved by position, not by memory."""
        storage = slot.buf.untyped_storage().data_ptr()
        base = slot.buf.storage_offset()

        def pack(t: torch.Tensor):
            if t.device == slot.buf.device and t.layout == torch.strided and _storage_ptr(t) == storage:
                return _WeightRef(layer, t.storage_offset() - base, tuple(t.size()), tuple(t.stride()))
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    def _unpack(self, saved):
        if not isinstance(saved, _WeightRef):
            return saved
        slot = self._backward_slots.get(saved.layer)
        if slot is None:  # a bug, not a user error: the backward must bind the layer's slot first
            raise RuntimeError(f"kept layer {saved.layer}: its weights are not loaded for the backward")
        return slot.buf.as_strided(saved.size, saved.stride, slot.buf.storage_offset() + saved.offset)

    def bind(self, layer: int, slot) -> None:
        """``layer``'s weights are in ``slot`` for its backward."""
        self._backward_slots[layer] = slot

    def take(self, mb: int, layer: int) -> KeptGraph:
        return self.graphs.pop((mb, layer))

    def clear(self) -> None:
        self.graphs.clear()
        self._backward_slots.clear()
