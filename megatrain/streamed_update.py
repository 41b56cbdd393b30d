"""The host tier's second update path: state streamed through the GPU, beside the CPU kernel.

``StreamedAdamW`` updates a host-tier group on the GPU once the step's global norm is known: its fp32
master, m and v go up on an upload stream, the fused AdamW (the GPU tier's kernel, ``optim.adamw_``) runs
on an update stream with the step's clip coefficient, and master, m, v go back on a download stream into
the (pinned) host store. The updated master stays on the GPU in a *kept* buffer when the staging budget
allows, and the next forward casts it into its slot from there (``device_source``: no second load);
otherwise the forward loads the group from host RAM once the download has landed. The gradient is used
where it waits (on the GPU; uploaded first with grad_placement="host").

``HybridHostAdamW`` is the host tier's optimizer behind the ``GroupOptimizer`` interface
(megatrain/optim.py): it routes each group, per step, to the CPU kernel (megatrain/host_adamw.py, which
runs in its worker thread meanwhile) or to ``StreamedAdamW``, by a split from megatrain/update_split.py
(one for steps that speculate, one for steps that wait for the norm), and sends each group's next load
to the path that last updated it. With ``update_path="cpu"`` every group goes to the CPU kernel, as before.

Streams (CUDA): the copies and the update run on three streams of their own, so they queue neither behind
the next forward's weight loads (engine H2D stream), nor the CPU path's gradient copies (engine D2H stream),
nor its compute. Ordering, per group: upload waits for the rotating buffer's previous download and for
the group's own previous download; update waits for the upload and the gradient; download waits for the
update. A load of the group waits (on the engine's H2D stream) for the update when it reads the kept
master, for the download otherwise. On a CPU run every stream is a no-op and the same code runs in order.
"""
from __future__ import annotations

import math

import torch

from .optim import adamw_
from .pinning import pin_in_place, unpin
from .store import ModelStore
from .streams import StreamSet, WaitTimer
from .system import OptimConfig
from . import update_split
from .update_split import Split, UpdateRates, forced_split, measure_rates, plan_split

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
    (4 B/param), given to groups in forward order."""

    def __init__(self, store: ModelStore, cfg: OptimConfig, names: list[str], streams: StreamSet, *,
                 chunk: int, kept_budget: float, pin: bool, prefetch: bool = False):
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
        self._allocate(())
        self.dev_steps = {name: torch.zeros((), dtype=torch.float32, device=dev) for name in self.names}
        # Host state crosses PCIe asynchronously only from page-locked memory: m, v (and the master when a
        # bf16 shadow is what the store pins for streaming) are registered here.
        self._pinned: list[torch.Tensor] = []
        if pin and cuda:
            for name in self.names:
                tables = [store.m, store.v] + ([store.master] if store.shadow is not None else [])
                for t in tables:
                    self._pinned.append(pin_in_place(t[name], f"host-tier state of {name} (GPU update path)"))
        self._grads: dict[str, tuple] = {}
        self._updated: dict[str, object] = {}  # name -> event after its last update (kept master valid)
        self._down: dict[str, object] = {}  # name -> event after its last download (host state valid)
        self._fresh: set[str] = set()  # kept masters holding the last update, not yet read by a load
        self._prefetched: dict[str, object] = {}  # this step's prefetched groups -> event after their upload
        self.wait_timer = WaitTimer(streams)  # loads' GPU waits for this path
        self._spans: list[tuple] = []  # (first upload start, last download end) timing events per step
        self.busy_s = 0.0  # GPU time from a step's first upload to its last download (settled)
        self.updates = 0  # groups updated on this path

    def _allocate(self, full_names) -> None:
        """Full buffers (12 B/param) for ``full_names``, then kept masters (4 B/param) for the other groups in
        forward order, within ``kept_budget``."""
        self.kept, self.full = {}, {}
        # With a bf16 shadow the forward computes with the rounded master: loads read the shadow (written back
        # with the master), so nothing is kept (a kept fp32 master would give different weights).
        left = self.kept_budget if self.store.shadow is None else 0.0
        for name in self.names:
            n = self.store.by_name[name].numel
            if name in full_names and 12 * n <= left:
                self.full[name] = torch.empty(3 * n, dtype=torch.float32, device=self.device)
                left -= 12 * n
                if self.store.shadow is None:
                    self.kept[name] = self.full[name][:n]
        for name in self.names:
            n = self.store.by_name[name].numel
            if name not in self.full and 4 * n <= left:
                self.kept[name] = torch.empty(n, dtype=torch.float32, device=self.device)
                left -= 4 * n

    def set_prefetch(self, names) -> list[str]:
        """From now on, upload ``names``' state during the backward (as each gradient arrives); returns the
        ones the budget holds. Called between steps (nothing of this path is in flight on its buffers then,
        after ``wait_all``)."""
        self.wait_all()
        if self.streams.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.up)  # old buffers are freed after their use
        self._fresh.clear()
        self._allocate(set(names))
        return [x for x in self.names if x in self.full]

    @property
    def staging_bytes(self) -> int:
        return (sum(t.numel() * 4 for t in self.rot) + sum(t.numel() * 4 for t in self.full.values())
                + sum(t.numel() * 4 for x, t in self.kept.items() if x not in self.full))

    # -- GroupOptimizer -------------------------------------------------------------------------------
    def begin_step(self, step: int, speculate: bool) -> None:
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
            buf[:n].copy_(st.master[name], non_blocking=True)
            buf[n:2 * n].copy_(st.m[name], non_blocking=True)
            buf[2 * n:].copy_(st.v[name], non_blocking=True)
            self._prefetched[name] = s.record(self.up)

    def finish(self, step: int, coef: float | None) -> None:
        grads, self._grads = self._grads, {}
        prefetched, self._prefetched = self._prefetched, {}
        self._fresh.clear()  # kept masters of the last step are either read already or stale now
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
                self._update_prefetched(name, flat, ready, prefetched[name], lr, scale)
                continue
            n, kept = st.by_name[name].numel, self.kept.get(name)
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
                p = kept[a:e] if kept is not None else buf[:k]
                m, v = buf[self.chunk:self.chunk + k], buf[2 * self.chunk:2 * self.chunk + k]
                with s.use(self.up):
                    if self.rot_free[b] is not None:  # the buffer's previous chunk has been downloaded
                        self.up.wait_event(self.rot_free[b])
                    p.copy_(st.master[name][a:e], non_blocking=True)
                    m.copy_(st.m[name][a:e], non_blocking=True)
                    v.copy_(st.v[name][a:e], non_blocking=True)
                    g = flat[a:e]
                    if g.device != self.device:
                        g = g.to(self.device, non_blocking=True)
                        s.keep_alive(g, self.upd)  # read by the update stream
                    uploaded = s.record(self.up)
                with s.use(self.upd):
                    self.upd.wait_event(uploaded)
                    # fp32 gradients are divided by ``scale`` in place by the fused kernel (ours to consume).
                    g32 = g if g.dtype == torch.float32 else g.float()
                    adamw_(p, g32, m, v, self.dev_steps[name], lr, self.cfg, scale)
                    shadow = p.to(st.shadow[name].dtype) if (st.shadow is not None and name in st.shadow) else None
                    updated = s.record(self.upd)
                with s.use(self.down):
                    self.down.wait_event(updated)
                    st.master[name][a:e].copy_(p, non_blocking=True)
                    st.m[name][a:e].copy_(m, non_blocking=True)
                    st.v[name][a:e].copy_(v, non_blocking=True)
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
            self.updates += 1
        if cuda and done is not None:
            self._spans.append((start, done))

    def _update_prefetched(self, name: str, flat, ready, uploaded, lr: float, scale) -> None:
        """Update a group whose state is already on the GPU (``full``), then download it on its own stream."""
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
            for a in range(0, n, self.chunk):  # chunk by chunk: one chunk's fp32 gradient at a time
                e = min(n, a + self.chunk)
                g = flat[a:e]
                g = g.to(self.device, dtype=torch.float32, non_blocking=True) if g.device != self.device else g
                adamw_(p[a:e], g if g.dtype == torch.float32 else g.float(), m[a:e], v[a:e], self.dev_steps[name],
                       lr, self.cfg, scale)
            shadow = p.to(st.shadow[name].dtype) if (st.shadow is not None and name in st.shadow) else None
            updated = s.record(self.upd)
        with s.use(self.down_full):
            self.down_full.wait_event(updated)
            st.master[name].copy_(p, non_blocking=True)
            st.m[name].copy_(m, non_blocking=True)
            st.v[name].copy_(v, non_blocking=True)
            if shadow is not None:
                s.keep_alive(shadow, self.down_full)
                st.shadow[name].copy_(shadow, non_blocking=True)
            done = s.record(self.down_full)
        self._down[name], self._updated[name] = done, updated
        if name in self.kept:
            self._fresh.add(name)
        self.updates += 1

    def wait_group(self, name: str):
        """The event a load of ``name`` must wait for: its update when it reads the kept master
        (``device_source``), its download when it reads host RAM; None before any update."""
        ev = self._updated.get(name) if name in self._fresh else self._down.get(name)
        return None if ev is None else _TimedWait(ev, self.wait_timer)

    def device_source(self, name: str) -> torch.Tensor | None:
        """The updated fp32 master of ``name`` on the GPU, once per update (the next forward's cast reads it;
        later loads read host RAM)."""
        if name in self._fresh:
            self._fresh.discard(name)
            return self.kept[name]
        return None

    def host_ready(self, name: str) -> None:
        """Block until ``name``'s host state is written back (before the CPU path reads it)."""
        ev = self._down.get(name)
        if ev is not None:
            ev.synchronize()

    def settle(self) -> tuple[float, float]:
        """(busy_s, wait_s) cumulative, adding the spans and waits whose events are complete (the engine calls
        this after a step's sync, when the previous step's path has long finished)."""
        pending = []
        for start, end in self._spans:
            if end.query():
                self.busy_s += start.elapsed_time(end) / 1e3
            else:
                pending.append((start, end))
        self._spans = pending
        return self.busy_s, self.wait_timer.settle()

    def wait_all(self) -> None:
        for ev in self._down.values():
            if ev is not None:
                ev.synchronize()

    def close(self) -> None:
        self._grads = {}
        if self.streams.cuda:
            self.wait_all()  # no copy may still read or write a buffer we unpin
        for t in self._pinned:
            unpin(t)
        self._pinned.clear()


class HybridHostAdamW:
    """The host tier's optimizer: the CPU kernel (``cpu``, a HostAdamW) and, when given, the GPU update path
    (``gpu``, a StreamedAdamW) sharing the host-tier groups per ``splits`` ({speculating: Split})."""

    def __init__(self, cpu, gpu: StreamedAdamW | None = None, splits: dict[bool, Split] | None = None,
                 rates: UpdateRates | None = None, replan=None, choose_prefetch=None):
        """``replan(backward_s, prefetched)``: both splits ({speculating: Split}) for a measured backward time
        (a speculative CPU path's head start) and the prefetched groups; until a backward is observed,
        ``splits``. ``choose_prefetch(backward_s)``: the groups to prefetch (gpu_path_prefetch), decided
        once, after the first step."""
        self.cpu, self.gpu = cpu, gpu
        self.names = list(cpu.names)
        self.splits = dict(splits or {})
        self.rates = rates
        self._replan, self._choose_prefetch = replan, choose_prefetch
        self.prefetched: list[str] | None = None  # decided after the first step (None: not yet / not asked)
        self.backward_s: float | None = None  # running estimate of the backward's time (observe_step)
        self._gpu_set: set[str] = set()  # this step's GPU-path groups
        self._last_gpu: set[str] = set()  # GPU-path groups of the last finished step (their loads wait there)
        self.cpu_groups = 0  # cumulative counts of routed groups (the engine reports per-step differences)
        self.gpu_path_groups = 0

    # Counters the engine reads (the CPU path's, as before).
    @property
    def wait_s(self) -> float:
        return self.cpu.wait_s

    @property
    def busy_s(self) -> float:
        return self.cpu.busy_s

    @property
    def early_groups(self) -> int:
        return self.cpu.early_groups

    @property
    def rollbacks(self) -> int:
        return self.cpu.rollbacks

    def counters(self) -> dict[str, float]:
        busy, wait = self.gpu.settle() if self.gpu is not None else (0.0, 0.0)
        return dict(cpu_groups=self.cpu_groups, gpu_path_groups=self.gpu_path_groups, gpu_path_busy_s=busy,
                    gpu_path_wait_s=wait)

    def observe_step(self, stats: dict) -> None:
        """After a step: its backward time sets how long a speculative CPU path runs before the norm, so the
        speculative split is planned again from it (an average over steps)."""
        bwd = stats.get("backward_s")
        if self.gpu is None or bwd is None or not math.isfinite(bwd):
            return
        self.backward_s = bwd if self.backward_s is None else 0.5 * (self.backward_s + bwd)
        if self._choose_prefetch is not None and self.prefetched is None:
            # Once: the backward's length bounds how much state can go up during it (buffers are allocated now).
            self.prefetched = self.gpu.set_prefetch(self._choose_prefetch(self.backward_s))
        if self._replan is not None:
            self.splits.update(self._replan(self.backward_s, frozenset(self.prefetched or ())))

    def split_for(self, speculate: bool) -> Split:
        return self.splits.get(speculate) or Split([], list(self.names))

    # -- GroupOptimizer -------------------------------------------------------------------------------
    def begin_step(self, step: int, speculate: bool) -> None:
        split = self.split_for(speculate) if self.gpu is not None else Split([], list(self.names))
        self._gpu_set = set(split.gpu)
        self.cpu.begin_step(step, speculate)  # the CPU path speculates on its own groups only
        if self.gpu is not None:
            self.gpu.begin_step(step, False)

    def grad_ready(self, name: str, flat: torch.Tensor, sqnorm: torch.Tensor, ready) -> None:
        if name in self._gpu_set:
            self.gpu_path_groups += 1
            self.gpu.grad_ready(name, flat, sqnorm, ready)
            return
        self.cpu_groups += 1
        if name in self._last_gpu:
            # Last updated on the GPU path: its download must have landed before the CPU reads host state
            # (long done by now, during this step's backward; a host wait only as a guarantee).
            self.gpu.host_ready(name)
        self.cpu.grad_ready(name, flat, sqnorm, ready)

    def finish(self, step: int, coef: float | None) -> None:
        if self.gpu is not None:
            self.gpu.finish(step, coef)  # queued on the GPU first: its copies start at once
        self.cpu.finish(step, coef)
        if coef is not None:  # a skipped step changed nothing: each group's last path stays as it was
            self._last_gpu = set(self._gpu_set)

    def wait_group(self, name: str):
        if name in self._last_gpu:
            return self.gpu.wait_group(name)
        return self.cpu.wait_group(name)

    def device_source(self, name: str) -> torch.Tensor | None:
        if self.gpu is not None and name in self._last_gpu:
            return self.gpu.device_source(name)
        return None

    def wait_all(self) -> None:
        self.cpu.wait_all()
        if self.gpu is not None:
            self.gpu.wait_all()

    def close(self) -> None:
        try:
            if self.gpu is not None:
                self.gpu.close()
        finally:
            self.cpu.close()

    def summary(self) -> str:
        if self.gpu is None:
            return "host update: CPU kernel only"
        parts = []
        for spec, label in ((False, "after the norm"), (True, "speculative")):
            sp = self.split_for(spec)
            parts.append(f"{label}: {len(sp.gpu)} of {len(self.names)} groups on the GPU path"
                         + (f", predicted {sp.predicted_s:.3f} s vs CPU only {sp.predicted_cpu_only_s:.3f} s"
                            if sp.predicted_cpu_only_s else "") + (f" ({sp.reason})" if sp.reason else ""))
        rates = f"; rates {self.rates.to_dict()}" if self.rates is not None else ""
        pre = "" if self.prefetched is None else f", {len(self.prefetched)} prefetched during the backward"
        return (f"host update: CPU kernel + GPU path (staging {self.gpu.staging_bytes / GIB:.2f} GiB, "
                f"{len(self.gpu.kept)} kept masters{pre}); " + "; ".join(parts) + rates)


def build_host_tier(cpu_opt, *, store: ModelStore, cfg, streams: StreamSet, host_names: list[str],
                    grads_on_host: bool, staging_bytes: float, dist=None) -> HybridHostAdamW:
    """The host tier's optimizer for ``cfg`` (an EngineConfig): ``cpu_opt`` alone (update_path="cpu"), or with
    the GPU path, its split forced (``gpu_path_groups`` names) or planned from measured rates ("auto").
    ``staging_bytes``: GPU memory the path may hold (rotating buffers + kept masters)."""
    if cfg.update_path == "cpu" or not host_names:
        return HybridHostAdamW(cpu_opt)
    if dist is not None:
        raise ValueError("update_path='hybrid' is not supported with data parallel training (use 'cpu')")
    numels = {x: store.by_name[x].numel for x in host_names}
    chunk = staging_chunk(max(numels.values()), staging_bytes, grads_on_host)
    if chunk == 0:
        raise ValueError(f"update_path='hybrid': {staging_bytes / GIB:.2f} GiB of GPU staging is less than the GPU "
                         f"path needs ({rotating_bytes(MIN_CHUNK_ELEMS, grads_on_host) / GIB:.2f} GiB): raise "
                         f"update_staging_gib")
    rates, replan, choose = None, None, None
    order = [(x, numels[x]) for x in host_names]
    c = 4 if store.shadow is None else 2
    if cfg.gpu_path_groups != "auto":
        forced = [x.strip() for x in cfg.gpu_path_groups.split(",") if x.strip()]
        split = forced_split(host_names, forced)
        splits = {False: split, True: split}
        candidates = split.gpu
        if cfg.gpu_path_prefetch:  # the forced groups only, the model's amount
            rates = UpdateRates()
            forced_order = [(x, numels[x]) for x in split.gpu]
            choose = lambda bwd: update_split.prefetch_set(  # noqa: E731
                forced_order, rates, backward_s=bwd, load_bytes=c * sum(numels.values()),
                budget_bytes=staging_bytes - rotating_bytes(chunk, grads_on_host))
    else:
        rates = measure_rates(streams.device, cpu_opt.kernel) if streams.cuda else UpdateRates()
        # Kept masters (no second load) when the staging left after the chunks holds them all; otherwise
        # the model counts the forward's load of a GPU-path group too.
        kept_all = staging_bytes - rotating_bytes(chunk, grads_on_host) >= 4 * sum(numels.values())
        kw = dict(stream_bytes=c, grad_bytes=0 if grads_on_host else 2, grad_up_bytes=4 if grads_on_host else 0,
                  gpu_load_bytes=0 if (kept_all and store.shadow is None) else c)
        # Speculative steps: the GPU path's prefix shrinks as the CPU's head start (the backward) grows; the
        # longest one (no head start) bounds which groups it may ever take. Until a backward is measured,
        # a speculative step keeps the CPU path alone (it is what ran before: never slower).
        longest = len(plan_split(order, rates, speculative=True, backward_s=0.0, **kw).gpu)
        splits = {False: plan_split(order, rates, **kw), True: Split([], list(host_names), reason="no backward measured yet")}

        def replan(backward_s: float, prefetched: frozenset) -> dict:
            return {False: plan_split(order, rates, prefetched=prefetched, **kw),
                    True: plan_split(order, rates, speculative=True, backward_s=backward_s, max_gpu_groups=longest,
                                     prefetched=prefetched, **kw)}

        candidates = [x for x in host_names if x in set(splits[False].gpu) | set(host_names[:longest])]
        if cfg.gpu_path_prefetch:
            candidates = list(host_names)  # any group may be prefetched (its m, v are pinned for it)
            choose = lambda bwd: update_split.prefetch_set(  # noqa: E731
                order, rates, backward_s=bwd, load_bytes=c * sum(numels.values()),
                budget_bytes=staging_bytes - rotating_bytes(chunk, grads_on_host))
    kept_budget = max(0.0, staging_bytes - rotating_bytes(chunk, grads_on_host))
    if not candidates:
        return HybridHostAdamW(cpu_opt, None, splits, rates)
    gpu = StreamedAdamW(store, cfg.optim, candidates, streams, chunk=chunk, kept_budget=kept_budget,
                        pin=streams.cuda and cfg.pin_memory, prefetch=cfg.gpu_path_prefetch)
    return HybridHostAdamW(cpu_opt, gpu, splits, rates, replan, choose)
