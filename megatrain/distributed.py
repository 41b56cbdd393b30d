"""Data parallelism of the engine over ``torch.distributed``, with one host store per node.

    torch.distributed.init_process_group("nccl" | "gloo", timeout=timedelta(minutes=5))
    engine = MegaTrain.from_config(hf_config, cfg, dist=DataParallel())   # every rank, same cfg and seed
    engine.step(my_share_of_the_batch)                                     # losses are global

What the engine does with it (see docs/distributed.md for the design and the capacity):

* the step's labelled-token count is summed over ranks before the loss (each rank divides by the
  global count), the loss is summed for reporting, and each group's final gradient is all-reduced (SUM)
  before its squared norm: every rank holds the exact global gradient and the same global norm, so
  clipping is exact and identical everywhere;
* the host tier's fp32 master, m, v (and bf16 shadow) live in ONE shared-memory file per node, created
  by the node's first rank and mapped by the others; each local rank updates a contiguous 1/N slice of
  every host group from its own copy of the reduced gradient, and publishes "group g final for finish
  #k" in a per-rank progress word in the same shared memory; a group's next load waits until every
  local rank's word has reached k (a bounded wait that notices dead peers);
* GPU-tier groups are replicated: every rank applies the identical update to its own copy.

Failure: collectives run under the process group's timeout (and gloo fails at once when a peer's
connection drops); every shared-memory wait is bounded by ``timeout_s`` and checks that the node's
other ranks are alive. Either way the error is a ``RankFailure`` naming what was being waited for.
"""
from __future__ import annotations

import os
import socket
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as tdist

from .host_adamw import HostAdamW

ALIGN = 1 << 16  # bytes: every shared tensor starts on its own pages (cudaHostRegister per range)
SLICE_ALIGN = 1024  # elements: local ranks' slices of a group never share a cache line (or a page)


class RankFailure(RuntimeError):
    """Another rank died, or a collective/shared-memory wait ran past its timeout."""


class DataParallel:
    """The process group an engine trains over, and the node-local facts the shared host store needs.

    ``group``: the group for gradients and the loss (NCCL on GPUs, gloo on CPU); None = the default
    group. ``timeout_s`` bounds every wait this class makes itself (shared-memory waits, barriers); the
    collectives in ``group`` are bounded by the timeout given to ``init_process_group``.
    ``node_key``: ranks with the same key share one host store (default: hostname, plus torchrun's
    GROUP_RANK so that several "nodes" on one machine stay apart). ``shm_dir``: where the store's file
    lives while the ranks map it (unlinked once all have: nothing is left behind, even after a crash
    later on)."""

    def __init__(self, group=None, *, timeout_s: float = 300.0, node_key: str | None = None,
                 shm_dir: str = "/dev/shm"):
        if not tdist.is_available() or not tdist.is_initialized():
            raise RuntimeError("DataParallel needs torch.distributed.init_process_group(...) first")
        self.group = group if group is not None else tdist.group.WORLD
        self.timeout_s = float(timeout_s)
        self.shm_dir = shm_dir
        self.failed: str | None = None  # set on the first collective/wait failure: later waits fail at once
        self.rank = tdist.get_rank(self.group)
        self.world_size = tdist.get_world_size(self.group)
        # Control plane (counts, barriers, setup) on gloo: CPU tensors, no device sync, monitored barriers.
        if tdist.get_backend(self.group) == "gloo":
            self.ctrl = self.group
        else:
            self.ctrl = tdist.new_group(tdist.get_process_group_ranks(self.group), backend="gloo",
                                        timeout=timedelta(seconds=self.timeout_s))
        self.node_key = key = node_key or f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}"
        mine = (key, os.getpid(), uuid.uuid4().hex[:12])
        everyone: list = [None] * self.world_size
        self._guard("setup (all_gather_object)", lambda: tdist.all_gather_object(everyone, mine, group=self.ctrl))
        local = [r for r, (k, _, _) in enumerate(everyone) if k == key]
        self.local_rank, self.local_size = local.index(self.rank), len(local)
        self.peer_pids = [everyone[r][1] for r in local]
        self.token = everyone[local[0]][2]  # the node leader's: names this node's shared file
        self.leader = self.local_rank == 0
        self.progress: torch.Tensor | None = None  # int64 [local_size, host groups], in shared memory
        self._col: dict[str, int] = {}

    # -- collectives ----------------------------------------------------------------------------------
    def all_reduce_count(self, n: int, what: str = "labelled-token count") -> int:
        """Sum of an integer over ranks (the loss denominator)."""
        t = torch.tensor([n], dtype=torch.int64)
        self._guard(f"all_reduce of the {what}", lambda: tdist.all_reduce(t, group=self.ctrl))
        return int(t[0])

    def all_reduce_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """In-place SUM over ranks on the data group (NCCL on GPUs: queued on the current stream)."""
        self._guard(f"all_reduce of {what}", lambda: tdist.all_reduce(t, group=self.group))
        return t

    def barrier(self, what: str) -> None:
        def run():
            if tdist.get_backend(self.ctrl) == "gloo":  # names the ranks that did not arrive
                tdist.monitored_barrier(self.ctrl, timeout=timedelta(seconds=self.timeout_s))
            else:
                tdist.barrier(self.ctrl)
        self._guard(f"barrier ({what})", run)

    def _guard(self, what: str, fn):
        if self.failed:
            raise RankFailure(f"rank {self.rank}: {what} not attempted: data parallel already failed ({self.failed})")
        try:
            return fn()
        except Exception as exc:
            self.failed = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise RankFailure(f"rank {self.rank}/{self.world_size}: {what} failed: another rank died or stopped "
                              f"responding (or timed out); this rank gives up. Cause: {exc}") from exc

    # -- the node's shared host store -----------------------------------------------------------------
    def host_arena(self, groups, host_names: list[str], shadow_dtype: torch.dtype | None) -> dict:
        """Map (and on the node leader, create) the node's host-tier store: returns (group, what) -> tensor
        for ``ModelStore(shared=...)``. Zero-filled (a fresh tmpfs file): m and v need no init, and pages
        are allocated on first touch. Also maps the per-rank progress words."""
        by_name = {g.name: g for g in groups}
        layout, off = [], 0

        def place(key, numel, dtype):
            nonlocal off
            layout.append((key, off, numel, dtype))
            off += -(-numel * dtype.itemsize // ALIGN) * ALIGN

        self._col = {name: i for i, name in enumerate(host_names)}
        place(("_progress", ""), self.local_size * max(1, len(host_names)), torch.int64)
        for name in host_names:
            n = by_name[name].numel
            for what in ("master", "m", "v"):
                place((name, what), n, torch.float32)
            if shadow_dtype is not None:
                place((name, "shadow"), n, shadow_dtype)
        path = os.path.join(self.shm_dir, f"megatrain-{self.token}.store")
        if self.leader:
            fs = os.statvfs(self.shm_dir)
            if off > fs.f_bavail * fs.f_frsize:  # a sparse file past the tmpfs limit would SIGBUS on first touch
                self.failed = "no room for the host store"
                raise MemoryError(f"the node's host store needs {off / 2**30:.2f} GiB but {self.shm_dir} has "
                                  f"{fs.f_bavail * fs.f_frsize / 2**30:.2f} GiB free (tmpfs size limit?)")
            buf = torch.from_file(path, shared=True, size=off, dtype=torch.uint8)  # created, zero-filled
        self.barrier("host store created")
        if not self.leader:
            if os.path.getsize(path) != off:
                raise RuntimeError(f"{path}: size {os.path.getsize(path)} != expected {off}: the node's ranks "
                                   f"disagree on the model or placement")
            buf = torch.from_file(path, shared=True, size=off, dtype=torch.uint8)
        self.barrier("host store mapped")
        if self.leader:
            os.unlink(path)  # every rank has it mapped; the memory goes when the last one unmaps
        self.arena_bytes = off
        out = {}
        for key, start, numel, dtype in layout:
            out[key] = buf[start:start + numel * dtype.itemsize].view(dtype)
        self.progress = out.pop(("_progress", "")).view(self.local_size, -1)
        return out

    def writer(self, store):
        """The store as the weight init/load should write it: the node's host tier is written by the
        leader only; the other ranks compute the same values (same RNG sequence for the GPU tier) into a
        scratch buffer."""
        return _LeaderWrites(store, set(self._col), self.leader)

    def slice_of(self, numel: int) -> tuple[int, int]:
        """This local rank's contiguous part of a host group: [lo, hi)."""
        per = -(-numel // self.local_size)
        per = -(-per // SLICE_ALIGN) * SLICE_ALIGN
        lo = min(numel, self.local_rank * per)
        return lo, min(numel, lo + per)

    def publish(self, name: str, seq: int) -> None:
        """This rank's slice of ``name`` is final for finish number ``seq``."""
        # One writer per word; an aligned 8-byte store is atomic, and on x86 (TSO) the slice's stores,
        # made before this one (the kernel's threads joined), are visible to a reader that sees it.
        self.progress[self.local_rank, self._col[name]] = seq

    def wait_published(self, name: str, seq: int) -> float:
        """Block until every local rank published ``name`` for ``seq``; returns the seconds waited."""
        row = self.progress[:, self._col[name]]
        if int(row.min()) >= seq:
            return 0.0
        t0 = last_check = time.perf_counter()
        pause = 20e-6
        while int(row.min()) < seq:
            if self.failed:
                raise RankFailure(f"rank {self.rank}: waiting for the host update of {name}: data parallel "
                                  f"already failed ({self.failed})")
            now = time.perf_counter()
            if now - last_check > 0.2:
                last_check = now
                self._check_peers(f"the host update of {name}")
                if now - t0 > self.timeout_s:
                    late = [r for r in range(self.local_size) if int(row[r]) < seq]
                    self.failed = f"timeout waiting for {name}"
                    raise RankFailure(f"rank {self.rank}: local ranks {late} did not finish their slice of {name} "
                                      f"(update #{seq}) within {self.timeout_s:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return time.perf_counter() - t0

    def _check_peers(self, what: str) -> None:
        import psutil

        for r, pid in enumerate(self.peer_pids):
            try:
                alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                self.failed = f"local rank {r} (pid {pid}) died"
                raise RankFailure(f"rank {self.rank}: local rank {r} (pid {pid}) died while this rank waited "
                                  f"for {what}")

    # -- the engine's pieces ----------------------------------------------------------------------------
    def host_adamw(self, store, cfg, names, grads, background: bool = True):
        return ShardedHostAdamW(store, cfg, names, grads, background=background, dp=self)

    def __repr__(self) -> str:
        return (f"DataParallel(rank {self.rank}/{self.world_size}, local {self.local_rank}/{self.local_size}, "
                f"backend {tdist.get_backend(self.group)})")


class _LeaderWrites:
    """A ModelStore seen by weight init/load: host-tier tables redirected to scratch on non-leaders."""

    def __init__(self, store, host: set[str], leader: bool):
        self.store = store
        self.steps = store.steps  # private per rank: every rank sets its own
        skip = set() if leader else host
        scratch = {}

        def table(real):
            return _Redirect(real, skip, scratch, store)

        self.master, self.m, self.v = table(store.master), table(store.m), table(store.v)
        self._skip = skip

    def refresh_shadow(self, name: str) -> None:
        if name not in self._skip:
            self.store.refresh_shadow(name)


class _Redirect:
    def __init__(self, real, skip, scratch, store):
        self.real, self.skip, self.scratch, self.store = real, skip, scratch, store

    def __getitem__(self, name):
        if name not in self.skip:
            return self.real[name]
        n = self.store.by_name[name].numel
        buf = self.scratch.get("buf")
        if buf is None or buf.numel() < n:
            buf = self.scratch["buf"] = torch.empty(n, dtype=torch.float32)
        return buf[:n]


class ShardedHostAdamW(HostAdamW):
    """HostAdamW over this local rank's slice of every host group; a group's next load waits until all
    local ranks have published their slice for the same finish (see DataParallel.wait_published)."""

    def __init__(self, store, cfg, names, grads, background: bool = True, *, dp: DataParallel):
        self.dp = dp
        self._ranges = {name: dp.slice_of(store.by_name[name].numel) for name in names}
        self._issued = 0  # finish() calls made by this rank (every rank makes the same ones)
        self.peer_wait_s = 0.0  # main thread blocked on other ranks' slices
        super().__init__(store, cfg, names, grads, background=background)

    def _range(self, name: str) -> tuple[int, int]:
        return self._ranges[name]

    def finish(self, step: int, coef) -> None:
        self._issued += 1
        self._cur.seq = self._issued
        super().finish(step, coef)

    def _group_final(self, st, name: str) -> None:
        self.dp.publish(name, st.seq)  # worker thread: after this rank's slice is written
        super()._group_final(st, name)

    def wait_group(self, name: str):
        super().wait_group(name)  # this rank's slice
        self.peer_wait_s += self.dp.wait_published(name, self._issued)  # every other local rank's
        return None

    def wait_all(self) -> None:
        super().wait_all()
        for name in self.names:
            self.peer_wait_s += self.dp.wait_published(name, self._issued)
