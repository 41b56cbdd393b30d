"""The host tier's second update path: state streamed through the GPU, beside the CPU kernel.

``StreamedAdamW`` updates a host-tier group on the GPU once the step's global norm is known: its fp32
master, m and v go up on an upload stream, the fused AdamW (the GPU tier's kernel, ``optim.adamw_``) runs
on an update stream with the step's clip coefficient, and master, m, v go back on a download stream into
the (pinned) host store, in chunks through two rotating buffers. The updated master stays on the GPU in a
*kept* buffer when the staging budget allows (with a bf16 shadow, ``stream_dtype="bf16"``: the shadow, cast
from the updated master on the GPU, the very bits downloaded into the host shadow), and every load of the
group until its next update casts it into its slot from there (``device_source``): the next forward's and
the backward's (no load over the link, no wait for the download); otherwise a load reads host RAM once the
download has landed. A kept fp32 master is the group's master of record: it is not downloaded after the
update (m and v are) but written back to host RAM only when something there needs it (the CPU path taking
the group, a load from host RAM, ``wait_all``: a save, ``state_dict``, ``close``), and it is not uploaded
again at the group's next update: a group that stays on this path moves 8 B/param each way, not 12. The
gradient is
used where it waits (on the GPU; uploaded first with grad_placement="host"). With prefetch, a group's state
goes up during the backward instead.

The host tier's optimizer that shares the groups between this path and the CPU kernel is
``HybridHostAdamW`` (megatrain/host_tier.py).

Streams (CUDA): the copies and the update run on streams of their own, so they queue neither behind
the next forward's weight loads (engine H2D stream), nor the CPU path's gradient copies (engine D2H stream),
nor its compute. Ordering, per chunk: upload waits for the rotating buffer's previous download and for
the group's own previous download; update waits for the upload and the gradient; download waits for the
update. A load of the group waits (on the engine's H2D stream) for the update when it reads the kept
master, for the download otherwise. The next update's uploads overwrite a kept master only after every
cast queued on the H2D stream before it (the last step's forward and backward loads). On a CPU run every
stream is a no-op and the same code runs in order.
"""
from __future__ import annotations

import warnings

import torch

from .optim import adamw_
from .pinning import pin_in_place, unpin
from .store import ModelStore
from .streams import StreamSet, WaitTimer
from .system import OptimConfig

ROTATING = 2  # staging buffers (p, m, v chunks) in flight: one chunk uploads while the previous one downloads
CHUNK_ELEMS = 1 << 25  # 32M elements per chunk: 384 MiB of p, m, v per buffer; AdamW is elementwise
MIN_CHUNK_ELEMS = 1 << 20
GIB = 2**30


class _TimedWait:
    """An event whose ``wait(stream)`` is timed (torch's ``Stream.wait_event(e)`` calls ``e.wait(stream)``),
    so the GPU time a load spends waiting for this path is counted (``gpu_path_wait_s``)."""

    def __init__(self, event, timer: WaitTimer):
        self.event, self.timer = event, timer

    def wait(self, stream=None) -> None:
        self.timer.wait(stream, self.event)

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.query()


def rotating_bytes(chunk: int, grads_on_host: bool) -> int:
    """GPU bytes of the rotating buffers (p, m, v chunks) plus one chunk's fp32 gradient (widened, or
    uploaded from host RAM and widened)."""
    return (ROTATING * 12 + 4 + (4 if grads_on_host else 0)) * chunk


def staging_chunk(largest: int, budget_bytes: float, grads_on_host: bool, chunk: int | None = None) -> int:
    """The chunk (elements) the staging budget affords: ``chunk`` (default ``CHUNK_ELEMS``), or less by
    halves, never more than the largest group; 0 when not even ``MIN_CHUNK_ELEMS`` fits."""
    c = min(chunk or CHUNK_ELEMS, largest)
    while c > MIN_CHUNK_ELEMS and rotating_bytes(c, grads_on_host) > budget_bytes:
        c //= 2
    return c if rotating_bytes(c, grads_on_host) <= budget_bytes else 0


class StreamedAdamW:
    """GPU update path for host-tier groups (see module doc). ``names``: every group it may update (forward
    order); each group streams through the rotating buffers in chunks of ``chunk`` elements (AdamW is
    elementwise: the same arithmetic as one call); ``kept_budget``: bytes of GPU memory for kept masters
    (4 B/param), given to the ``kept_first`` groups, then the others, in forward order."""

    def __init__(self, store: ModelStore, cfg: OptimConfig, names: list[str], streams: StreamSet, *,
                 chunk: int, kept_budget: float, pin: bool, prefetch: bool = False, kept_first=()):
        self.store, self.cfg, self.names, self.streams = store, cfg, list(names), streams
        dev = self.device = streams.device
        cuda = streams.cuda
        self.up = torch.cuda.Stream(dev) if cuda else streams.compute
        self.upd = torch.cuda.Stream(dev) if cuda else streams.compute
        self.down = torch.cuda.Stream(dev) if cuda else streams.compute
        # Prefetched groups' downloads: their own stream, so they do not queue ahead of the chunks' downloads
        # (which free the rotating buffers the chunk pipeline waits for).
        self.down_full = torch.cuda.Stream(dev) if cuda else streams.compute
        self.chunk = chunk
        self.rot = [torch.empty(3 * chunk, dtype=torch.float32, device=dev) for _ in range(ROTATING if names else 0)]
        self.rot_free = [None] * len(self.rot)  # event after the download that last read each buffer
        self._next = 0  # the rotating buffer the next chunk takes
        self.kept: dict[str, torch.Tensor] = {}
        self.full: dict[str, torch.Tensor] = {}  # prefetched groups: p | m | v on the GPU (``set_prefetch``)
        self.kept_budget, self.prefetch = kept_budget, prefetch
        # Groups that take kept masters before the others (the first split's GPU-path groups: candidates the
        # runtime may never route must not hold the buffers the planned ones use).
        first = set(kept_first)
        self.kept_first = [x for x in self.names if x in first]
        self._allocate(())
        self.dev_steps = {name: torch.zeros((), dtype=torch.float32, device=dev) for name in self.names}
        # Host state crosses PCIe asynchronously only from page-locked memory: m, v (and the master when a
        # bf16 shadow is what the store pins for streaming) are registered here.
        self._pinned: list[torch.Tensor] = []
        if pin and cuda:
            for name in self.names:
                tables = [store.m, store.v] + ([store.master] if store.shadow is not None else [])
                for t in tables:
                    if store.is_pinned(t[name]):  # the store page-locked it (pin_host_state="all")
                        continue
                    try:
                        self._pinned.append(pin_in_place(t[name], f"host-tier state of {name} (GPU update path)"))
                    except RuntimeError as exc:  # still correct from pageable memory, only slower (synchronous)
                        warnings.warn(f"GPU update path: {exc}; its copies of {name} run from pageable memory",
                                      RuntimeWarning)
        self._grads: dict[str, tuple] = {}
        self._updated: dict[str, object] = {}  # name -> event after its last update (kept master valid)
        self._down: dict[str, object] = {}  # name -> event after its last download (host state valid)
        # Kept masters holding the group's current master (its last update's), which every load reads until the
        # group's next update (or a step routed to the CPU path) makes them stale.
        self._fresh: set[str] = set()
        # Kept fp32 masters that hold the group's master (its last update was this path's, into that buffer):
        # the next update of the group reads it in place, no upload. Unlike ``_fresh`` this survives ``finish``
        # for the groups routed here again (loads no longer read it then, but the bits are the master's); a
        # step routed elsewhere, or new buffers, drop it (after a write-back, see ``_dirty``).
        self._current: set[str] = set()
        # Of those, the ones whose host master is stale (not written back since the update): written back by
        # ``_write_back`` before anything reads host RAM (host_ready, a load from host, wait_all).
        self._dirty: set[str] = set()
        self.h2d_bytes = 0  # bytes this path queued host -> GPU (state and gradients), cumulative
        self.d2h_bytes = 0  # bytes this path queued GPU -> host (state), cumulative
        # Of h2d_bytes, fp32 masters uploaded into a kept buffer (the group was not current there: its first
        # update on this path, or its first after it left it): a split's cold start, not its steady state.
        self.cold_bytes = 0
        self._prefetched: dict[str, object] = {}  # this step's prefetched groups -> event after their upload
        self._pending: tuple | None = None  # (step, coef, grads, prefetched) of a finished step, not issued yet
        self.wait_timer = WaitTimer(streams)  # loads' GPU waits for this path
        self._spans: list[tuple] = []  # (first upload start, last download end) timing events per step
        self.busy_s = 0.0  # GPU time from a step's first upload to its last download (settled)
        self.updates = 0  # groups updated on this path

    def _allocate(self, full_names) -> None:
        """Full buffers (12 B/param) for ``full_names``, then kept weights for the other groups (``kept_first``
        first, then forward order) within ``kept_budget``: the fp32 master (4 B/param), or with a bf16 shadow
        the shadow (2 B/param: the forward computes with the rounded master, which is what loads read)."""
        self.kept, self.full = {}, {}
        left = self.kept_budget
        for name in self.names:
            n = self.store.by_name[name].numel
            if name in full_names and 12 * n <= left:
                self.full[name] = torch.empty(3 * n, dtype=torch.float32, device=self.device)
                left -= 12 * n
                if self.store.stream_source(name).dtype == torch.float32:  # loads read the master itself
                    self.kept[name] = self.full[name][:n]
        first = set(self.kept_first)
        for name in self.kept_first + [x for x in self.names if x not in first]:
            n, dtype = self.store.by_name[name].numel, self.store.stream_source(name).dtype  # what loads read
            per = torch.finfo(dtype).bits // 8
            if name not in self.full and per * n <= left:
                self.kept[name] = torch.empty(n, dtype=dtype, device=self.device)
                left -= per * n

    def cold(self, split) -> bool:
        """Whether ``split``'s update, routed in the step that just finished (not issued yet), uploads kept fp32
        masters: a GPU-path group with a kept master that is not its master of record (``_current``)."""
        shadow = self.store.shadow
        return any(x in self.kept and x not in self._current and (shadow is None or x not in shadow)
                   for x in split.gpu)

    def set_prefetch(self, names) -> list[str]:
        """From now on, upload ``names``' state during the backward (as each gradient arrives); returns the
        ones the budget holds. Called between steps (nothing of this path is in flight on its buffers then,
        after ``wait_all``)."""
        self.wait_all()
        if self.streams.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.up)  # old buffers are freed after their use
        self._fresh.clear()
        self._current.clear()  # new buffers (wait_all wrote every kept master back)
        self._allocate(set(names))
        return [x for x in self.names if x in self.full]

    @property
    def pinned_bytes(self) -> int:
        """Host state this path page-locked itself (what the store had locked is the store's)."""
        return sum(t.numel() * t.element_size() for t in self._pinned)

    @property
    def staging_bytes(self) -> int:
        return (sum(t.numel() * 4 for t in self.rot) + sum(t.numel() * 4 for t in self.full.values())
                + sum(t.numel() * t.element_size() for x, t in self.kept.items() if x not in self.full))

    # -- GroupOptimizer -------------------------------------------------------------------------------
    def begin_step(self, step: int, speculate: bool) -> None:
        self.flush()  # the last step's update starts now, overlapping this step's forward
        self._grads, self._prefetched = {}, {}

    def grad_ready(self, name: str, flat: torch.Tensor, sqnorm: torch.Tensor, ready) -> None:
        self._grads[name] = (flat, ready)  # consumed after the norm (this path never updates early)
        buf = self.full.get(name)
        if buf is None:
            return
        # Prefetch: the state goes up now, during the backward; only the update needs the clip coefficient.
        # Host state is final here: the last GPU-path download is waited for below, a CPU-path update was
        # waited for by this step's forward before it loaded the group.
        s, st, n = self.streams, self.store, self.store.by_name[name].numel
        self._fresh.discard(name)  # its kept master (the first third) is overwritten now
        with s.use(self.up):
            if s.cuda:
                self.up.wait_stream(s.h2d)  # the forward's cast of the kept master was queued on H2D before
            if self._down.get(name) is not None:
                self.up.wait_event(self._down[name])
            if name not in self._current:  # else the buffer holds the host master's bits already
                buf[:n].copy_(st.master[name], non_blocking=True)
                self.h2d_bytes += 4 * n
                if name in self.kept:  # a kept master going up again (see cold_bytes)
                    self.cold_bytes += 4 * n
            buf[n:2 * n].copy_(st.m[name], non_blocking=True)
            buf[2 * n:].copy_(st.v[name], non_blocking=True)
            self.h2d_bytes += 8 * n
            self._prefetched[name] = s.record(self.up)

    def finish(self, step: int, coef: float | None) -> None:
        """The norm is known: the update is issued at the next ``flush`` (the next step's ``begin_step``, or
        whatever needs the state first: a load, ``wait_all``, ``close``). In a training loop that is at once;
        a device synchronize between steps (a benchmark's per-step timing) then does not wait for the whole
        update, which overlaps the next forward as the CPU path's does."""
        grads, self._grads = self._grads, {}
        prefetched, self._prefetched = self._prefetched, {}
        # Kept masters are stale from here for groups this step's update does not reach (routed to the CPU path,
        # or a skipped step); ``_issue`` marks the ones it updates fresh again.
        self._fresh.clear()
        # The host master of a group not routed here may change now (the CPU path updates it, after its
        # ``host_ready`` wrote the kept master back): its kept buffer is no longer the master. (A skipped step
        # changes nothing, but is rare: dropped too.)
        if self._dirty - set(grads):  # HybridHostAdamW calls host_ready for such groups first
            raise RuntimeError(f"GPU update path: the CPU path took {sorted(self._dirty - set(grads))} before their "
                               f"kept masters were written back")
        self._current &= set(grads)
        self._pending = (step, coef, grads, prefetched)

    def flush(self) -> None:
        """Issue the pending update (see ``finish``); nothing when there is none."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._issue(*pending)

    def _issue(self, step: int, coef: float | None, grads: dict, prefetched: dict) -> None:
        if coef is None or not grads:  # (prefetched state is dropped: the host copy is unchanged)
            return  # skipped step (or nothing routed here): state untouched
        s, st, cuda = self.streams, self.store, self.streams.cuda
        lr = self.cfg.lr_at(step)
        if cuda:
            # The kept masters were read by casts on the engine's H2D stream during this step: the uploads
            # below overwrite them only after those.
            self.up.wait_stream(s.h2d)
        start = s.record(self.up, timing=True) if cuda else None
        with s.use(self.upd):
            scale = None if coef == 1.0 else torch.full((), 1.0 / coef, dtype=torch.float32, device=self.device)
        done = None
        for name in [x for x in self.names if x in grads]:  # the order the next forward needs them
            flat, ready = grads.pop(name)
            if name in prefetched:
                # its download event ends the step's busy span too (a step whose GPU-path groups were all
                # prefetched had no span at all: gpu_path_busy_s read 0, test_update_path_gpu's prefetch cases)
                done = self._update_prefetched(name, flat, ready, prefetched[name], lr, scale)
                continue
            n, kept = st.by_name[name].numel, self.kept.get(name)
            has_shadow = st.shadow is not None and name in st.shadow
            kept_master = kept if kept is not None and not has_shadow else None  # updated in place
            # The kept master holds the host master's bits (its last update was here): m and v go up alone.
            reuse = kept_master is not None and name in self._current
            st.steps[name].add_(1)  # host count (checkpoints read it); the kernel wants it on the device
            with s.use(self.up):
                if self._down.get(name) is not None:  # this group's host state is complete (last update)
                    self.up.wait_event(self._down[name])
                if flat.device != self.device:  # grad_placement="host": the gradient waits in host RAM
                    self.up.wait_event(ready)  # its D2H copy has landed
            with s.use(self.upd):
                self.dev_steps[name].fill_(float(st.steps[name]))
                if flat.device == self.device:
                    self.upd.wait_event(ready)  # the gradient's kernels (compute stream) are done
                    # Allocated on the compute stream: its memory must not be reused before this stream has
                    # read it.
                    s.keep_alive(flat, self.upd)
            for a in range(0, n, self.chunk):
                e = min(n, a + self.chunk)
                k, b = e - a, self._next % len(self.rot)
                self._next += 1
                buf = self.rot[b]
                p = kept_master[a:e] if kept_master is not None else buf[:k]
                m, v = buf[self.chunk:self.chunk + k], buf[2 * self.chunk:2 * self.chunk + k]
                with s.use(self.up):
                    if self.rot_free[b] is not None:  # the buffer's previous chunk has been downloaded
                        self.up.wait_event(self.rot_free[b])
                    if not reuse:
                        p.copy_(st.master[name][a:e], non_blocking=True)
                        self.h2d_bytes += 4 * k
                        if kept_master is not None:  # a kept master going up again (see cold_bytes)
                            self.cold_bytes += 4 * k
                    m.copy_(st.m[name][a:e], non_blocking=True)
                    v.copy_(st.v[name][a:e], non_blocking=True)
                    self.h2d_bytes += 8 * k
                    g = flat[a:e]
                    if g.device != self.device:
                        g = g.to(self.device, non_blocking=True)
                        self.h2d_bytes += g.numel() * g.element_size()
                        s.keep_alive(g, self.upd)  # read by the update stream
                    uploaded = s.record(self.up)
                with s.use(self.upd):
                    self.upd.wait_event(uploaded)
                    # fp32 gradients are divided by ``scale`` in place by the fused kernel (ours to consume).
                    g32 = g if g.dtype == torch.float32 else g.float()
                    adamw_(p, g32, m, v, self.dev_steps[name], lr, self.cfg, scale)
                    if has_shadow and kept is not None:  # the kept shadow: every load until the next update
                        shadow = kept[a:e]
                        shadow.copy_(p)  # the rounding the host shadow gets (the download below is this tensor)
                    else:
                        shadow = p.to(st.shadow[name].dtype) if has_shadow else None
                    updated = s.record(self.upd)
                with s.use(self.down):
                    self.down.wait_event(updated)
                    if kept_master is None:  # a kept master stays the master of record (``_write_back``)
                        st.master[name][a:e].copy_(p, non_blocking=True)
                        self.d2h_bytes += 4 * k
                    st.m[name][a:e].copy_(m, non_blocking=True)
                    st.v[name][a:e].copy_(v, non_blocking=True)
                    self.d2h_bytes += 8 * k
                    if shadow is not None:
                        s.keep_alive(shadow, self.down)
                        st.shadow[name][a:e].copy_(shadow, non_blocking=True)
                    done = s.record(self.down, timing=cuda)
                del g, g32, shadow
                self.rot_free[b] = done
            del flat
            # Each stream runs in order: the last chunk's events cover the whole group.
            self._down[name], self._updated[name] = done, updated
            if kept is not None:
                self._fresh.add(name)
            if kept_master is not None:  # the master of record now; host RAM gets it when it needs it
                self._current.add(name)
                self._dirty.add(name)
            self.updates += 1
        if cuda and done is not None:
            self._spans.append((start, done))

    def _update_prefetched(self, name: str, flat, ready, uploaded, lr: float, scale):
        """Update a group whose state is already on the GPU (``full``), then download it on its own stream;
        returns the download's event."""
        s, st, buf = self.streams, self.store, self.full[name]
        n = st.by_name[name].numel
        p, m, v = buf[:n], buf[n:2 * n], buf[2 * n:]
        st.steps[name].add_(1)
        with s.use(self.upd):
            self.upd.wait_event(uploaded)
            self.dev_steps[name].fill_(float(st.steps[name]))
            if flat.device == self.device:
                self.upd.wait_event(ready)
                s.keep_alive(flat, self.upd)
            else:
                self.upd.wait_event(ready)  # grad_placement="host": its D2H copy has landed
                self.h2d_bytes += flat.numel() * flat.element_size()  # uploaded chunk by chunk below
            for a in range(0, n, self.chunk):  # chunk by chunk: one chunk's fp32 gradient at a time
                e = min(n, a + self.chunk)
                g = flat[a:e]
                g = g.to(self.device, dtype=torch.float32, non_blocking=True) if g.device != self.device else g
                adamw_(p[a:e], g if g.dtype == torch.float32 else g.float(), m[a:e], v[a:e], self.dev_steps[name],
                       lr, self.cfg, scale)
            shadow = p.to(st.shadow[name].dtype) if (st.shadow is not None and name in st.shadow) else None
            updated = s.record(self.upd)
        lazy = name in self.kept and shadow is None  # the kept master is buf[:n]: written back when needed
        with s.use(self.down_full):
            self.down_full.wait_event(updated)
            if not lazy:
                st.master[name].copy_(p, non_blocking=True)
                self.d2h_bytes += 4 * n
            st.m[name].copy_(m, non_blocking=True)
            st.v[name].copy_(v, non_blocking=True)
            self.d2h_bytes += 8 * n
            if shadow is not None:
                s.keep_alive(shadow, self.down_full)
                st.shadow[name].copy_(shadow, non_blocking=True)
            done = s.record(self.down_full, timing=self.streams.cuda)  # may end the busy span
        self._down[name], self._updated[name] = done, updated
        if name in self.kept:
            self._fresh.add(name)
            if lazy:
                self._current.add(name)
                self._dirty.add(name)
        self.updates += 1
        return done

    def _write_back(self, names) -> None:
        """Copy the kept masters of ``names`` that host RAM lacks (``_dirty``) into the host master and wait
        for it: something is about to read host RAM. They stay current (the same bits on both sides)."""
        todo = [x for x in names if x in self._dirty]  # (a load's check: one set lookup)
        if not todo:
            return
        s, st = self.streams, self.store
        with s.use(self.down):
            for name in todo:
                # After its last update (and, stream order, after its m/v downloads queued on this stream).
                self.down.wait_event(self._updated[name])
                st.master[name].copy_(self.kept[name], non_blocking=True)
                self.d2h_bytes += 4 * self.kept[name].numel()
            done = s.record(self.down)
        if s.cuda:
            done.synchronize()  # rare (a routing change, a save): the caller reads host RAM next
        for name in todo:
            self._down[name] = done
        self._dirty -= set(todo)

    def wait_group(self, name: str):
        """The event a load of ``name`` must wait for: its update when it reads the kept master
        (``device_source``), its download when it reads host RAM; None before any update."""
        self.flush()
        if name not in self._fresh:
            self._write_back([name])  # the load reads host RAM
        ev = self._updated.get(name) if name in self._fresh else self._down.get(name)
        return None if ev is None else _TimedWait(ev, self.wait_timer)

    def device_source(self, name: str) -> torch.Tensor | None:
        """The updated fp32 master of ``name`` on the GPU (with a bf16 shadow: the shadow, the bits the host
        shadow gets), for every load until the group's next update (the next forward's cast and the
        backward's read it; a kept layer's backward load then neither crosses the link nor waits for the
        download); None where it is not kept or stale (a load reads host RAM)."""
        self.flush()
        if name not in self._fresh:
            self._write_back([name])  # the load reads host RAM
        return self.kept[name] if name in self._fresh else None

    def host_ready(self, name: str) -> None:
        """Block until ``name``'s host state is written back (before the CPU path reads it)."""
        self.flush()
        self._write_back([name])
        ev = self._down.get(name)
        if ev is not None:
            ev.synchronize()

    def settle(self) -> tuple[float, float]:
        """(busy_s, wait_s) cumulative, adding every span and wait issued so far. The engine calls this at the
        start of a step (the last update is not issued yet: nothing to add) and after its loss sync, when
        the update issued in this step is done (the backward reloaded every host layer after its download;
        a synchronize here would wait only for a late embedding/head download)."""
        for start, end in self._spans:
            end.synchronize()
            self.busy_s += start.elapsed_time(end) / 1e3
        self._spans = []
        return self.busy_s, self.wait_timer.settle()

    def wait_all(self) -> None:
        """Every update applied and host RAM complete (kept masters written back: a save, state_dict, new
        buffers, close read it next)."""
        self.flush()
        self._write_back(self._dirty)
        for ev in self._down.values():
            if ev is not None:
                ev.synchronize()

    def close(self) -> None:
        self._grads = {}
        self.wait_all()  # the pending update is applied; no copy may still read or write a buffer we unpin
        for t in self._pinned:
            unpin(t)
        self._pinned.clear()
