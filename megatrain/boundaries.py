"""Block-boundary activations: the only activations the forward keeps for the backward.

The forward hands the hidden state entering each checkpoint block to ``keep``; the backward asks for it
with ``take`` (blocks in reverse order, micro-batches in order within a block). Two homes:

- ``GpuBoundaries``: kept where they were made (the compute device).
- ``HostBoundaries``: the first boundaries the forward makes are copied to (pinned) host memory on the
  D2H stream while the forward goes on; the last ``on_gpu`` of them (needed first by the backward) stay
  on the GPU. The backward brings each offloaded one back on the H2D stream one ``take`` ahead, so a
  block's boundary is on the GPU when its recompute starts. GPU cost of the offloaded ones: the boundary
  in use plus the one prefetched. On CPU the streams are no-ops and the copies are plain, so CI runs the
  same keep/take/prefetch logic.

``make_boundaries`` makes the step's store as the placement plan decided (``Placement.boundaries_on_gpu``,
from EngineConfig.boundary_offload; megatrain/placement.py ``offload_boundaries_if_needed``): None ->
GpuBoundaries; g -> HostBoundaries keeping the last g on the GPU and offloading the rest ("host": g = 0;
"auto": only where the GPU cannot hold them all beside the rest of the plan, on CUDA). The decision is made
once, by the plan, for the tokens it was made for; a step with more tokens per micro-batch keeps the plan's
count (the engine warns that activations may not fit). Only the blocks that are recomputed have a
boundary: a kept block's graph holds its input (megatrain/keep.py).
"""
from __future__ import annotations


import torch

from . import activations, memory
from .link import NULL_LINK
from .pinning import pin_in_place, unpin


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


class HostBuffers:
    """Host memory for offloaded boundaries, kept across steps: pinning gigabytes costs seconds, so buffers
    are allocated once (grown when a longer sequence needs more) and reused by every step. Pinned as the
    host store is (plain allocation + cudaHostRegister): torch's pinned allocator would round each 3.7 GB
    boundary (7B shape, 512K tokens) up to 4 GiB."""

    def __init__(self, pin: bool, link=NULL_LINK):
        self.pin = pin
        self.link = link  # the host link the offload copies go over (megatrain/link.py)
        self._flat: list[torch.Tensor] = []
        self.read_done: list[object] = []  # per buffer: the event after the last H2D read of it (or None)
        self.plan: dict = {}  # what make_boundaries chose for the latest step (for reports)

    def get(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Buffer ``i`` viewed with ``like``'s shape and dtype."""
        nbytes = like.numel() * like.element_size()
        if i == len(self._flat):
            self._flat.append(None)
            self.read_done.append(None)
        if self._flat[i] is None or self._flat[i].numel() < nbytes:
            self._release(i)
            self._flat[i] = torch.empty(nbytes, dtype=torch.uint8)
            if self.pin:  # page-locked: the copies are DMA and can run asynchronously on their streams
                pin_in_place(self._flat[i], "a block boundary")
            self.read_done[i] = None
        return self._flat[i][:nbytes].view(like.dtype).view(like.shape)

    def nbytes(self) -> int:
        return sum(b.numel() for b in self._flat if b is not None)

    def _release(self, i: int) -> None:
        if self._flat[i] is not None and self.pin:
            if self.read_done[i] is not None:
                self.read_done[i].synchronize()  # host waits: the last H2D read must end before unpinning
            unpin(self._flat[i])
        self._flat[i] = None

    def close(self) -> None:
        """Unpin and free every buffer (the engine's close)."""
        for i in range(len(self._flat)):
            self._release(i)
        self._flat.clear()
        self.read_done.clear()


class HostBoundaries:
    """Of the ``total`` boundaries of a step, all but the last ``on_gpu`` live in host memory between
    forward and backward."""

    def __init__(self, streams, device: torch.device, buffers: HostBuffers, total: int, on_gpu: int = 0):
        self.streams, self.device, self.buffers = streams, device, buffers
        self._to_host = max(0, total - on_gpu)  # the first this many kept go to the host
        self._kept = 0
        self._on_gpu: dict[tuple[int, int], torch.Tensor] = {}
        self._on_host: dict[tuple[int, int], tuple[int, torch.Tensor, object]] = {}  # key -> (buffer, view, copied)
        self._loaded: dict[tuple[int, int], tuple[torch.Tensor, object]] = {}  # prefetched: key -> (tensor, landed)
        self._order: list[tuple[int, int]] | None = None
        self._next_buffer = 0
        self.offloaded_bytes = 0

    def keep(self, mb: int, layer: int, hidden: torch.Tensor) -> None:
        self._kept += 1
        if self._kept > self._to_host:
            self._on_gpu[(mb, layer)] = hidden
            return
        nbytes = hidden.numel() * hidden.element_size()
        s, i = self.streams, self._next_buffer
        self._next_buffer += 1
        host = self.buffers.get(i, hidden)
        produced = s.record(s.compute)
        with s.use(s.d2h):
            s.d2h.wait_event(produced)  # hidden is complete only once the compute work queued so far has run
            if self.buffers.read_done[i] is not None:
                s.d2h.wait_event(self.buffers.read_done[i])  # last step's H2D read of this buffer must finish
            host.copy_(hidden, non_blocking=True)
            self.buffers.link.throttle(s.d2h, nbytes, "d2h")  # before ``copied``
            # The engine drops ``hidden`` after the next layer; the allocator must not hand its memory to
            # new compute work before this copy has read it.
            s.keep_alive(hidden, s.d2h)
            copied = s.record(s.d2h)
        self._on_host[(mb, layer)] = (i, host, copied)
        self.offloaded_bytes += nbytes

    def take(self, mb: int, layer: int) -> torch.Tensor:
        key = (mb, layer)
        if self._order is None:  # the backward's order: blocks last first, micro-batches in order
            self._order = sorted([*self._on_gpu, *self._on_host], key=lambda k: (-k[1], k[0]))
        if key in self._on_host and key not in self._loaded:  # not prefetched: the backward starts with it
            self._load(key)
        pos = self._order.index(key)
        nxt = self._order[pos + 1] if pos + 1 < len(self._order) else None
        if nxt in self._on_host and nxt not in self._loaded:
            self._load(nxt)  # lands while this block recomputes and backpropagates
        if key in self._on_gpu:
            return self._on_gpu.pop(key)
        tensor, landed = self._loaded.pop(key)
        del self._on_host[key]
        self.streams.compute.wait_event(landed)  # the recompute reads the boundary only once it has landed
        return tensor

    def _load(self, key: tuple[int, int]) -> None:
        s = self.streams
        i, host, copied = self._on_host[key]
        with s.use(s.h2d):
            s.h2d.wait_event(copied)  # the host copy is complete only after its D2H copy ran
            # Allocated on the H2D stream, then used and freed on compute: keep_alive stops the allocator
            # from reusing it for the next prefetch while compute may still read it.
            tensor = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            tensor.copy_(host, non_blocking=True)
            self.buffers.link.throttle(s.h2d, host.numel() * host.element_size(), "h2d")  # before ``landed``
            landed = s.record(s.h2d)
        s.keep_alive(tensor, s.compute)
        self.buffers.read_done[i] = landed  # next step's D2H into this buffer waits for this read
        self._loaded[key] = (tensor, landed)

    def clear(self) -> None:
        self._on_gpu.clear()
        self._on_host.clear()
        self._loaded.clear()
        self._order = None


def make_boundaries(cfg, streams, *, model_config, block: int, dtype: torch.dtype, tokens: list[int],
                    host: HostBuffers, on_gpu: int | None, total: int):
    """The boundary store for one step (module doc). ``tokens``: tokens per micro-batch; ``host``: the
    engine's persistent host buffers; ``on_gpu``: the plan's ``boundaries_on_gpu``; ``total``: boundaries
    this step keeps (recomputed blocks x micro-batches)."""
    per = max(tokens) * model_config.hidden_size * (torch.finfo(dtype).bits // 8)  # bytes of the largest
    host.plan = dict(boundary_store="gpu", boundaries=total, boundaries_on_gpu=total, boundary_bytes=per)
    if on_gpu is None or on_gpu >= total:
        return GpuBoundaries(len(tokens))
    _check_host_room(cfg, model_config, block, dtype, tokens, on_gpu, host)
    host.plan.update(boundary_store="host", boundaries_on_gpu=on_gpu)
    return HostBoundaries(streams, streams.device, host, total, on_gpu)


def _check_host_room(cfg, model_config, block, dtype, tokens, on_gpu: int, host: HostBuffers) -> None:
    """Refuse before the forward allocates pinned buffers the host cannot give (numbers in the error)."""
    need = activations.host_boundary_bytes(
        num_layers=model_config.num_hidden_layers, hidden=model_config.hidden_size, micro_batches=len(tokens),
        tokens_per_micro_batch=max(tokens), block=block, compute_bytes=torch.finfo(dtype).bits // 8,
        boundaries_on_gpu=on_gpu)
    new = max(0, need - host.nbytes())
    # memory.available_host_bytes, not psutil directly: an emulated host-RAM cap must hold here too
    avail = memory.available_host_bytes() - cfg.host_margin_gib * 2**30
    if new > avail:
        raise MemoryError(f"offloaded block boundaries need {need / 2**30:.1f} GiB of host memory "
                          f"({new / 2**30:.1f} GiB new) but only {max(avail, 0) / 2**30:.1f} GiB is available after "
                          f"the {cfg.host_margin_gib} GiB margin; raise checkpoint_interval (fewer boundaries) or "
                          f"shorten the sequence")
