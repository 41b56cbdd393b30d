"""GPU weight slots, the stateless layer templates bound to them, and the prefetch schedule.

A slot is one flat GPU buffer the size of a decoder layer. Each slot owns one template module per layer
kind whose parameters are *views into the slot*, bound once at start-up: loading layer i into a slot is
one bulk H2D copy and the template then computes with layer i's weights. No module holds weights of
its own and no autograd graph spans more than one block.

The pool is given the full sequence of layer uses of a step (forward 0..L-1, then each backward block
ascending, blocks in reverse) and issues loads in that order as slots become free, so prefetch depth
equals the number of free slots, in forward and in backward alike. A slot that still holds the requested
layer is reused without a copy (reference-counted), e.g. the last layers of the forward for the first
backward block.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch
from torch import nn

from .link import NULL_LINK
from .store import Group, ModelStore, views
from .streams import StreamSet, WaitTimer


class Slot:
    def __init__(self, index: int, numel: int, device: torch.device, dtype: torch.dtype, streams: StreamSet):
        self.index = index
        self.buf = torch.zeros(numel, device=device, dtype=dtype)
        self.templates: dict[str, nn.Module] = {}
        self.params: dict[str, list[nn.Parameter]] = {}
        self.layer: int | None = None  # layer whose weights the buffer holds (valid for this step)
        self.refcount = 0
        self.ready = streams.event()  # recorded on H2D after the load: compute waits on it
        self.free = streams.event()  # recorded on compute at release: H2D waits before overwriting

    def template(self, kind: str) -> nn.Module:
        return self.templates[kind]


def bind_template(template: nn.Module, group: Group, buf: torch.Tensor) -> list[nn.Parameter]:
    """Replace every parameter of ``template`` by a view into ``buf`` (once; never copied into again)."""
    params = []
    for span, view in zip(group.spans, views(buf, group)):
        owner_name, _, leaf = span.name.rpartition(".")
        owner = template.get_submodule(owner_name) if owner_name else template
        p = nn.Parameter(view, requires_grad=True)
        owner._parameters[leaf] = p
        params.append(p)
    return params


class SlotPool:
    def __init__(self, *, store: ModelStore, layer_groups: list[Group], make_template: Callable[[str], nn.Module],
                 kinds: list[str], num_slots: int, device: torch.device, dtype: torch.dtype, streams: StreamSet,
                 wait_for_update: Callable[[str], object], prefetch: bool = True, link=NULL_LINK,
                 host_tier: set[str] = frozenset(), device_source: Callable[[str], object] | None = None):
        self.store = store
        # prefetch=False is the "no double buffering" ablation: a layer is loaded only when compute asks
        # for it, and the copy waits for all queued compute, so transfer and compute never overlap.
        self.prefetch = prefetch
        self.groups = layer_groups
        self.kinds = kinds
        self.streams = streams
        self.dtype = dtype
        self.wait_for_update = wait_for_update
        # A host-tier group updated on the GPU (megatrain/streamed_update.py) may offer its updated master
        # there: the load is then a cast on the device, no copy from host RAM.
        self.device_source = device_source or (lambda name: None)
        # Loads of host-tier layers cross the host link (``link`` emulates a slower one, megatrain/link.py);
        # a GPU-tier layer's "load" is a cast on the device.
        self.link, self.host_tier = link, host_tier
        numel = max(g.numel for g in layer_groups)
        self.slots = [Slot(i, numel, device, dtype, streams) for i in range(num_slots)]
        # Templates are built per distinct kind; all layers share one parameter layout (checked here).
        layout = [(s.name, tuple(s.shape), s.offset) for s in layer_groups[0].spans]
        for g in layer_groups:
            if [(s.name, tuple(s.shape), s.offset) for s in g.spans] != layout:
                raise NotImplementedError("decoder layers with different parameter layouts are not supported")
        for slot in self.slots:
            for kind in sorted(set(kinds)):
                tmpl = make_template(kind)
                slot.params[kind] = bind_template(tmpl, layer_groups[0], slot.buf)
                slot.templates[kind] = tmpl
        # One staging buffer shared by all host-tier loads when the stream dtype differs from the compute
        # dtype: the copy and the cast are both on the H2D stream, so stream order makes reuse safe.
        # GPU-tier layers need none: their fp32 master is cast into the slot directly.
        host_srcs = [store.stream_source(g.name) for g in layer_groups if store.stream_source(g.name).device != device]
        src_dtype = host_srcs[0].dtype if host_srcs else dtype
        self.staging = torch.empty(numel, device=device, dtype=src_dtype) if src_dtype != dtype else None
        self.loads = 0  # bulk H2D copies issued (reused slots don't count)
        self.load_wait = WaitTimer(streams)  # GPU time compute spent waiting for slot loads (stats)
        self._queue: deque[int] = deque()
        self._issued: deque[tuple[int, Slot]] = deque()

    # -- schedule -----------------------------------------------------------------------------------
    def begin_step(self, order: list[int]) -> None:
        """Start a step with its sequence of layer uses. Weights changed since the last step (the
        optimizer ran), so no slot content is reusable across steps."""
        if self._issued or any(s.refcount for s in self.slots):
            raise RuntimeError("slot pool: previous step left layers acquired")
        for s in self.slots:
            s.layer = None
        self._queue = deque(order)

    def reset(self) -> None:
        """Forget the current step's schedule (after a failed step, once the device is drained)."""
        for s in self.slots:
            s.refcount = 0
            s.layer = None
        self._issued.clear()
        self._queue.clear()
        self.load_wait.discard()

    def acquire(self, layer: int) -> Slot:
        """The slot holding ``layer`` (the next use in the schedule). Compute waits for its load."""
        self._pump(need=1)
        if not self._issued:
            raise RuntimeError(f"slot pool deadlock: no free slot to load layer {layer} "
                               f"({len(self.slots)} slots is fewer than one checkpoint block needs)")
        expected, slot = self._issued.popleft()
        if expected != layer:
            raise RuntimeError(f"slot pool: schedule expected layer {expected}, got a request for {layer}")
        # Compute must not read the slot before its H2D copy (and cast) has landed; the timer measures how
        # long the compute stream stalls here (the link or the load's own waits, not compute, bound it then).
        self.load_wait.wait(self.streams.compute, slot.ready)
        return slot

    def release(self, slot: Slot) -> None:
        """Compute is done with the slot for now. Its free event guards the next overwrite."""
        slot.refcount -= 1
        if slot.refcount == 0:
            slot.free = self.streams.record(self.streams.compute)
        if self.prefetch:
            self._pump()

    # -- internals ----------------------------------------------------------------------------------
    def _pump(self, need: int = 0) -> None:
        """Issue loads for upcoming uses while a slot can take them (without prefetch: only until
        ``need`` uses are issued)."""
        while self._queue and (self.prefetch or len(self._issued) < need):
            layer = self._queue[0]
            slot = next((s for s in self.slots if s.layer == layer), None)
            if slot is None:
                slot = self._victim()
                if slot is None:
                    return
                self._load(slot, layer)
            self._queue.popleft()
            slot.refcount += 1
            self._issued.append((layer, slot))

    def _victim(self) -> Slot | None:
        """A free slot to overwrite: empty first, else the one whose layer is next used furthest ahead
        (Belady), so layers about to be reused stay resident."""
        free = [s for s in self.slots if s.refcount == 0]
        if not free:
            return None
        upcoming = list(self._queue)

        def next_use(s: Slot) -> float:
            if s.layer is None:
                return float("inf")
            try:
                return upcoming.index(s.layer)
            except ValueError:
                return float("inf")

        return max(free, key=next_use)

    def _load(self, slot: Slot, layer: int) -> None:
        group = self.groups[layer]
        # Host tier: with the overlapped optimizer, layer ``layer``'s update of the previous step may still
        # be running on the CPU; this blocks until its weights are final, before they cross PCIe.
        # GPU tier: the update is queued on the compute stream; we get its event to order the cast after it.
        updated = self.wait_for_update(group.name)
        kept = self.device_source(group.name)  # after wait_for_update: ``updated`` is the event it needs
        src = kept if kept is not None else self.store.stream_source(group.name)
        n = group.numel
        with self.streams.use(self.streams.h2d):
            # The slot's previous layer may still be in use by kernels queued on the compute stream.
            self.streams.h2d.wait_event(slot.free)
            if updated is not None:  # the GPU-tier master must be updated before it is cast into the slot
                self.streams.h2d.wait_event(updated)
            if not self.prefetch:  # ablation: serialise the copy after all compute queued so far
                self.streams.h2d.wait_stream(self.streams.compute)
            if self.staging is None or src.device == slot.buf.device:
                slot.buf[:n].copy_(src, non_blocking=True)  # H2D, or the GPU tier's cast on the device
            else:
                self.staging[:n].copy_(src, non_blocking=True)
                slot.buf[:n].copy_(self.staging[:n])  # cast on the GPU, ordered after the copy
            if group.name in self.host_tier and kept is None:  # before ``ready``: as over the emulated link
                self.link.throttle(self.streams.h2d, n * src.element_size(), "h2d")
            slot.ready = self.streams.record(self.streams.h2d)
        slot.layer = layer
        self.loads += 1
