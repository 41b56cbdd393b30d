"""Where a group's final gradient waits until the step's global norm is known (``EngineConfig.grad_placement``,
resolved by the placement plan, megatrain/planner.py).

The engine hands every final gradient to ``place(name, flat, ready)`` right after its squared norm was
computed on the GPU, and passes what comes back to the group's optimizer:

* ``GradsOnGpu`` ("gpu"): the gradient itself. Every group's gradient waits on the GPU (c B/param); the
  host AdamW pulls a host-tier group's gradient through the pinned slabs (megatrain/grad_offload.py).
* ``GradsOnHost`` ("host"): for a host-tier group, a pinned fp32 host buffer of its own (4 B/param of host
  RAM, reused every step) into which the gradient is copied on the D2H stream the moment it is final,
  with the copy's event; the GPU gradient is released at once (the allocator reuses it only after the copy
  read it). The host AdamW reads the buffer directly: no slabs. GPU-tier groups keep their gradient on
  the GPU (their update runs there).

The norm is computed before ``place`` on the GPU tensor in both cases, so the global norm and the clip
coefficient do not depend on the placement. Speculation and rollback work unchanged with "host": the
buffer holds the step's gradient until the group's ``finish`` has run, and the next step overwrites it
only after the next forward waited for that group (``wait_group``), which precedes its next gradient.
"""
from __future__ import annotations

import torch

from .link import NULL_LINK
from .pinning import pin_in_place, unpin
from .streams import StreamSet


class GradsOnGpu:
    """grad_placement="gpu": every gradient waits on the GPU where it was made."""

    pinned_bytes = 0
    host_bytes = 0
    bytes_d2h = 0

    def slabs(self, configured: int) -> int:
        """Gradient slabs the host AdamW needs: the configured pool (host-tier gradients stream through it)."""
        return configured

    def place(self, name: str, flat: torch.Tensor, ready):
        return flat, ready

    def close(self) -> None:
        pass


class GradsOnHost:
    """grad_placement="host": host-tier gradients leave the GPU during the backward into pinned fp32 buffers.

    ``host_numels``: host-tier group name -> numel (GPU-tier groups are passed through untouched)."""

    def __init__(self, streams: StreamSet, host_numels: dict[str, int], pin: bool = True, link=NULL_LINK):
        self.streams = streams
        self.link = link  # the host link the gradient copies go over (megatrain/link.py)
        # torch.empty, not zeros: every buffer is overwritten whole before any reader sees it. Plain
        # allocations + cudaHostRegister (as in ModelStore): the pinned caching allocator would round each
        # buffer up to a power of two.
        self.buffers = {name: torch.empty(n, dtype=torch.float32) for name, n in host_numels.items()}
        self._registered: list[torch.Tensor] = []
        if pin and streams.cuda:
            for buf in self.buffers.values():
                self._registered.append(pin_in_place(buf, "a host gradient buffer"))
        self.bytes_d2h = 0
        self._last_copy = None  # event after the previous place()'s copy (back-pressure, see place)

    @property
    def pinned_bytes(self) -> int:
        return sum(t.numel() * 4 for t in self._registered)

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * 4 for t in self.buffers.values())

    def slabs(self, configured: int) -> int:
        """No slabs: every host-tier gradient is already in host memory when the host AdamW reads it."""
        return 0

    def place(self, name: str, flat: torch.Tensor, ready):
        """Start ``flat``'s copy into ``name``'s host buffer; returns (buffer, event after the copy). A
        GPU-tier group's gradient is returned as it is."""
        buf = self.buffers.get(name)
        if buf is None:
            return flat, ready
        s = self.streams
        if self._last_copy is not None:
            # Back-pressure, host-side (the compute stream never waits): at most one earlier gradient copy
            # is in flight when this one starts, so when the backward outruns PCIe (small batches) the GPU
            # still holds at most two host-tier gradients and one fp32 widening, as the plan counts them
            # (placement.grad_bytes). Usually already complete: the copy of the previous layer's gradient
            # overlaps this layer's backward.
            self._last_copy.synchronize()
        with s.use(s.d2h):
            # The gradient and its norm are written by compute kernels queued before ``ready``; the compute
            # stream itself never waits for this copy.
            s.d2h.wait_event(ready)
            # Widened to fp32 on the D2H stream (one layer's fp32 in flight, allocated and freed in this
            # stream's order); an fp32 gradient (embedding/head, or fp32 compute) is copied as it is.
            src = flat if flat.dtype == torch.float32 else flat.float()
            buf.copy_(src, non_blocking=True)
            self.link.throttle(s.d2h, buf.numel() * 4, "d2h")  # before ``copied``: the host AdamW waits for it
            # ``flat`` was allocated on the compute stream: without this the caching allocator could hand
            # its memory out again (to the next layer's backward) before the D2H stream has read it.
            s.keep_alive(flat, s.d2h)
            # The host AdamW's worker synchronizes on this before it reads the buffer (GradStream.chunks).
            copied = s.record(s.d2h)
        self._last_copy = copied
        self.bytes_d2h += buf.numel() * 4 if s.cuda else 0
        return buf, copied

    def close(self) -> None:
        for t in self._registered:
            unpin(t)
        self._registered.clear()


def make_grad_home(grads: str, host_numels: dict[str, int], streams: StreamSet, pin: bool, link=NULL_LINK):
    """The object for a resolved placement (``Placement.grads``: "gpu" | "host")."""
    if grads == "host":
        return GradsOnHost(streams, host_numels, pin, link)
    if grads == "gpu":
        return GradsOnGpu()
    raise ValueError(f"unresolved gradient placement {grads!r} (the plan resolves 'auto' to 'gpu' or 'host')")
