"""Gradients out: a gradient waiting on the GPU -> pinned host slabs (D2H stream), chunk by chunk.

The host optimizer's worker thread pulls a group's gradient through a small pool of pinned slabs: it
issues the D2H copies of the next chunks while it updates the current one, so PCIe and the update
overlap and pinned memory stays bounded (``n_slabs`` x chunk). There is no full host gradient buffer:
the update reads each chunk straight from its slab.

With ``n_slabs == 0`` (the "no slab pool" ablation) each chunk is copied synchronously to fresh
pageable memory, which is what a naive implementation does. On a CPU run the gradient already is in
host memory and chunks are views; so is a host-tier gradient already copied to its host buffer during
the backward (grad_placement="host", megatrain/grad_placement.py), once its copy event has completed.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

import torch

from .link import NULL_LINK
from .pinning import pin_in_place, unpin
from .streams import StreamSet

CHUNK_ELEMS = 1 << 24  # 16M elements: 32 MiB of bf16, 64 MiB of fp32 per slab


class GradStream:
    """Used from one thread only (the host optimizer's worker)."""

    def __init__(self, streams: StreamSet, n_slabs: int, chunk_elems: int = CHUNK_ELEMS, pin: bool = True,
                 link=NULL_LINK):
        self.streams = streams
        self.link = link  # the host link the slab copies go over (megatrain/link.py)
        self.chunk_elems = chunk_elems
        self.slab_bytes = self.slab_bytes_for(chunk_elems)  # room for an fp32 chunk (embedding/head grads)
        self.slabs = [torch.empty(self.slab_bytes, dtype=torch.uint8) for _ in range(n_slabs if streams.cuda else 0)]
        self.n_slabs = n_slabs
        self._registered = []
        if pin and streams.cuda:
            for s in self.slabs:
                self._registered.append(pin_in_place(s, "a gradient slab"))
        self._scalar = torch.zeros(1, dtype=torch.float32)
        if pin and streams.cuda:
            self._scalar = self._scalar.pin_memory()
        self.bytes_d2h = 0

    @staticmethod
    def slab_bytes_for(chunk_elems: int = CHUNK_ELEMS) -> int:
        return chunk_elems * 4

    @property
    def pinned_bytes(self) -> int:
        return sum(s.numel() for s in self._registered)

    @property
    def host_bytes(self) -> int:
        return sum(s.numel() for s in self.slabs)

    def scalar(self, value: torch.Tensor, ready) -> float:
        """A 0-dim device tensor's value on the host, without waiting for unrelated compute work."""
        if not self.streams.cuda:
            return float(value)
        with self.streams.use(self.streams.d2h):
            # Only the kernels up to ``ready`` (the gradient and its norm) must be done; a plain .item()
            # would run on the default stream and wait for everything queued on compute since.
            self.streams.d2h.wait_event(ready)
            self._scalar.copy_(value.reshape(1), non_blocking=True)
            done = self.streams.record(self.streams.d2h)
        done.synchronize()  # this worker thread waits for the 4-byte copy, nobody else does
        return float(self._scalar[0])

    def chunks(self, flat: torch.Tensor, ready) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (start, host tensor) for consecutive chunks of ``flat``. A yielded tensor is valid until
        the next one is requested (its slab is then reused)."""
        n, step = flat.numel(), self.chunk_elems
        starts = range(0, n, step)
        if flat.device.type == "cpu":
            # A host gradient buffer (grad_placement="host") is filled by a D2H copy: read it only once that
            # copy has landed. (On a CPU run events are always complete.)
            ready.synchronize()
            for s in starts:
                yield s, flat[s:s + step]
            return
        if not self.slabs:  # ablation: synchronous, pageable
            ready.synchronize()
            for s in starts:
                piece = flat[s:s + step].to("cpu")
                self.bytes_d2h += piece.numel() * piece.element_size()
                yield s, piece
            return
        d2h = self.streams.d2h
        with self.streams.use(d2h):
            d2h.wait_event(ready)  # the gradient's kernels (queued on compute) must finish before any copy
        free = deque(self.slabs)
        pending: deque = deque()
        todo = deque(starts)

        def issue():
            s = todo.popleft()
            piece = flat[s:s + step]
            slab = free.popleft()
            view = slab[:piece.numel() * piece.element_size()].view(piece.dtype)
            with self.streams.use(d2h):
                view.copy_(piece, non_blocking=True)
                self.link.throttle(d2h, piece.numel() * piece.element_size(), "d2h")  # before ``copied``
                copied = self.streams.record(d2h)
            self.bytes_d2h += piece.numel() * piece.element_size()
            pending.append((s, view, copied, slab))

        while todo and free:
            issue()
        while pending:
            s, view, copied, slab = pending.popleft()
            copied.synchronize()  # this chunk has landed in its slab
            yield s, view
            free.append(slab)  # the consumer is done with it
            if todo:
                issue()
        # Every copy that read ``flat`` has completed: the caller may drop the GPU gradient now.

    def close(self) -> None:
        for s in self._registered:
            unpin(s)
        self._registered.clear()
