"""AdamW of the host tier: a worker thread updates the fp32 master, m and v in host RAM, reading each
gradient chunk straight from a pinned slab (megatrain/grad_offload.py), or from the group's pinned host
gradient buffer with grad_placement="host" (megatrain/grad_placement.py).

Exact clipping needs the global norm, known only after the backward. Two schedules, chosen per step by
``SpeculationPolicy`` (megatrain/optim.py):

* **speculative**: a group is updated with clip coefficient 1 as soon as its gradient exists (during the
  backward, groups arrive final, L-1 .. 0, embed). At ``finish`` the norm is known: no clipping -> done;
  clipping -> each early update is undone (AdamW is invertible given the gradient, which still waits on
  the GPU, or in its host buffer with grad_placement="host") and redone with the true coefficient; a
  non-finite norm -> undone, the step is skipped.
  A group whose own norm is not finite is never updated early (NaN could not be undone).
* **after the norm**: all updates run in ``finish``, in the order the next forward needs the groups.

Either way the work runs in the worker thread and the next step's load of a group waits only for that
group (``wait_group``), so the update overlaps the next forward (and, speculatively, this backward).

Core binding (``bind_cores``, EngineConfig.host_update_cores, "auto" by default: on a one-process GPU run): the worker thread restricts
itself to a set of cores before it runs any kernel, so the OpenMP teams it starts (the C++ kernel's and
torch's, one pool per thread that starts a parallel region) inherit that set, and the main thread, which
keeps the GPU fed, gets the cores left out; then the kernel's team threads and the worker are bound to one
core each (``_bind_worker``). Linux gives a new thread its creator's affinity mask, and a team is created by
its first parallel region: binding must come first, hence a task queued ahead of any update.
"""
from __future__ import annotations

import math
import os
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch

from .config import parse_all_but
from .cpu_adamw import HostKernel
from .grad_offload import GradStream
from .store import ModelStore
from .system import OptimConfig


@dataclass
class _StepState:
    """One step's gradients and what the worker did with them (each step gets its own)."""

    step: int
    speculate: bool
    grads: dict = field(default_factory=dict)  # name -> (flat on GPU, sqnorm on GPU, ready event)
    early: set = field(default_factory=set)  # groups updated with coefficient 1 (worker-owned)
    declined: set = field(default_factory=set)  # groups whose own norm was not finite


class HostAdamW:
    def __init__(self, store: ModelStore, cfg: OptimConfig, names: list[str], grads: GradStream,
                 background: bool = True):
        self.store, self.cfg, self.names, self.grad_stream = store, cfg, list(names), grads
        self.background = background
        self._done = {name: threading.Event() for name in self.names}
        for ev in self._done.values():
            ev.set()
        # One-pass C++/OpenMP kernel when it builds here, else torch's fused kernel (megatrain/cpu_adamw.py).
        # One core is left to the main thread, which keeps the GPU fed while the worker updates.
        threads = max(1, torch.get_num_threads() - 1) if grads.streams.cuda else torch.get_num_threads()
        self.kernel = HostKernel(cfg, threads)
        self._tasks: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._cur: _StepState | None = None
        # Cumulative counters (the engine reports per-step differences).
        self.wait_s = 0.0  # main thread blocked waiting for an update (exposed optimizer time)
        self.busy_s = 0.0  # worker time spent updating (incl. waiting for D2H chunks)
        self.early_groups = 0  # groups queued for an early (speculative) update
        self.rollbacks = 0  # steps whose early updates are undone (clipping fired or the norm was not finite)
        self.bound: tuple[list[int], list[int]] | None = None  # (worker cores, main-thread cores) when bound
        self.bound_each = False  # the worker and its kernel team threads bound one core each
        self._main_restore: tuple[int, set[int]] | None = None  # (main thread id, its mask before binding)
        self._thread = threading.Thread(target=self._worker, name="megatrain-host-adamw", daemon=True)
        self._thread.start()

    def bind_cores(self, setting: str, cuda: bool, ranks: int = 1) -> None:
        """Bind the worker (and the OpenMP teams it starts) and the calling (main) thread to disjoint cores,
        per ``setting`` (EngineConfig.host_update_cores, see ``update_cores``); the kernel then runs one
        thread per worker core. Call before the first update; ``close`` gives the main thread its mask back."""
        if str(setting).strip().lower() == "none":
            return
        if not hasattr(os, "sched_setaffinity"):  # Linux only
            warnings.warn(f"host_update_cores={setting!r}: this OS cannot bind threads to cores; not bound",
                          RuntimeWarning, stacklevel=2)
            return
        cores = update_cores(setting, cuda, os.sched_getaffinity(0), ranks)
        if cores is not None:
            self.bind(*cores)

    def bind(self, worker: list[int], main: list[int] | None) -> None:
        """Bind the worker thread to ``worker`` cores and the kernel's OpenMP team to one of them each (see
        ``_bind_worker``), and the calling thread to ``main`` (None: left as it is)."""
        self.kernel.threads = len(worker)
        self._tasks.put(("bind", list(worker)))  # ahead of any update: its teams are created after this
        self.wait_all()
        if main is not None:
            self._main_restore = (threading.get_native_id(), os.sched_getaffinity(0))
            os.sched_setaffinity(0, main)  # this thread only (Linux: the mask is per thread)
        self.bound = (list(worker), list(main or []))

    @property
    def worker_native_id(self) -> int | None:
        """The worker thread's OS thread id (its affinity: ``os.sched_getaffinity(id)``)."""
        return self._thread.native_id

    # -- called by the engine (main thread) ------------------------------------------------------------
    def begin_step(self, step: int, speculate: bool) -> None:
        self._raise_if_failed()
        self._cur = _StepState(step, speculate and bool(self.names))

    def grad_ready(self, name: str, flat: torch.Tensor, sqnorm: torch.Tensor, ready) -> None:
        st = self._cur
        st.grads[name] = (flat, sqnorm, ready)
        if st.speculate:
            self._done[name].clear()  # the next load of this group must wait for its update
            self.early_groups += 1  # queued now; applied by the worker unless its own norm is not finite
            self._tasks.put(("early", st, name))

    def finish(self, step: int, coef: float | None) -> None:
        st = self._cur
        # Each group's event is set by the finish task once the group is final for this step (early
        # updates never set it: a rollback may still rewrite the group).
        for name in self.names:
            self._done[name].clear()
        if st.speculate and st.grads and coef != 1.0:
            self.rollbacks += 1  # every early update of this step will be undone (and redone if coef)
        self._tasks.put(("finish", st, coef))
        if not self.background:
            self.wait_all()

    def wait_group(self, name: str):
        """Block until ``name``'s update of the last step is done (host-side: nothing for the device)."""
        if not self._done[name].is_set():
            t0 = time.perf_counter()
            self._done[name].wait()
            self.wait_s += time.perf_counter() - t0
        self._raise_if_failed()
        return None

    def wait_all(self) -> None:
        t0 = time.perf_counter()
        self._tasks.join()
        self.wait_s += time.perf_counter() - t0
        self._raise_if_failed()

    def close(self) -> None:
        if self._thread.is_alive():
            self._tasks.put(None)
            self._thread.join(timeout=60)
        self.grad_stream.close()
        if self._main_restore is not None:  # the main thread gets every core it had back
            tid, mask = self._main_restore
            self._main_restore = None
            try:
                os.sched_setaffinity(tid, mask)
            except OSError:  # that thread has ended: nothing to give back
                pass

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("host optimizer failed") from err

    # -- worker thread ----------------------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                self._tasks.task_done()
                return
            t0 = time.perf_counter()
            try:
                if task[0] == "early":
                    self._early(task[1], task[2])
                elif task[0] == "bind":
                    self._bind_worker(task[1])
                else:
                    self._finish(task[1], task[2])
            except BaseException as exc:  # surfaced on the main thread at the next call
                self._error = exc
                for ev in self._done.values():  # never leave a waiter hanging
                    ev.set()
            finally:
                dt = time.perf_counter() - t0
                self.busy_s += dt
                self._tasks.task_done()

    def _bind_worker(self, cores: list[int]) -> None:
        """In the worker, before it runs any update: restrict it to ``cores`` (every OpenMP team it starts
        inherits the set), then start the C++ kernel's team once (one thread per core) and bind the worker
        and each team thread to a core of its own (libgomp keeps a master's team threads for its later
        regions of that size), as DeepSpeed binds its CPU Adam. The team's threads are the threads that
        appear during that first region (the main thread waits meanwhile); if they cannot be told apart
        (another count, or no C++ kernel) the set binding stands. ``bound_each``: whether each is bound."""
        os.sched_setaffinity(0, set(cores))
        if self.kernel.ext is None or len(cores) < 2:
            return
        before = set(_thread_ids())
        self.kernel.warm_up()
        team = sorted(set(_thread_ids()) - before)
        if len(team) != len(cores) - 1:
            return
        try:
            for tid, core in zip(team, cores[1:]):
                os.sched_setaffinity(tid, {core})
        except OSError:  # a thread that was not the team's and has ended: keep the set binding
            for tid in team:
                try:
                    os.sched_setaffinity(tid, set(cores))
                except OSError:
                    pass
            return
        # torch's own team for this thread (its CPU ops here, e.g. a bf16 shadow's refresh; another OpenMP
        # runtime than the extension's, or the same one's larger team) is created now, over every worker
        # core: a team created after the next line would inherit the worker's one core.
        torch.ones(1 << 22).mul_(2.0)
        os.sched_setaffinity(0, {cores[0]})
        self.bound_each = True

    def _early(self, st: _StepState, name: str) -> None:
        flat, sqnorm, ready = st.grads[name]
        if not math.isfinite(self.grad_stream.scalar(sqnorm, ready)):
            st.declined.add(name)  # never applied: a NaN update could not be undone
            return
        self._apply(name, flat, ready, self.cfg.lr_at(st.step), coef=1.0, undo=False, new_step=True,
                    speculative=True)
        st.early.add(name)

    def _finish(self, st: _StepState, coef: float | None) -> None:
        lr = self.cfg.lr_at(st.step)
        for name in self.names:  # the order the next forward needs them
            flat, _, ready = st.grads.pop(name, (None, None, None))
            if flat is None:  # an aborted step never produced this gradient
                self._group_final(st, name)
                continue
            if coef is None:  # skipped step: undo what was applied early, leave the rest untouched
                if name in st.early:
                    self._apply(name, flat, ready, lr, coef=None, undo=True, new_step=False)
                    self.store.steps[name].sub_(1)
            elif name in st.early:
                if coef != 1.0:  # undo the coefficient-1 update and redo it clipped, in one pass
                    self._apply(name, flat, ready, lr, coef=coef, undo=True, new_step=False)
                elif self.kernel.kept(self.store.master[name]):  # it stands; blocks it deferred: now
                    self._apply(name, flat, ready, lr, coef=coef, undo=False, new_step=False, commit=True)
            else:
                self._apply(name, flat, ready, lr, coef=coef, undo=False, new_step=True)
            del flat  # every copy from it has completed: the GPU gradient can be freed
            self._group_final(st, name)

    def _group_final(self, st: _StepState, name: str) -> None:
        """``name`` is final for step ``st``: its next load may proceed."""
        self._done[name].set()

    def _range(self, name: str) -> tuple[int, int]:
        """The elements of ``name`` this process updates (all of them; data parallel splits them)."""
        return 0, self.store.by_name[name].numel

    def _apply(self, name: str, flat, ready, lr: float, coef: float | None, undo: bool, new_step: bool,
               speculative: bool = False, commit: bool = False) -> None:
        """Stream ``name``'s gradient through the slabs and, per chunk: optionally undo the coefficient-1
        update, then (unless ``coef`` is None) apply the update with ``coef``. ``speculative``: a
        coefficient-1 update to be resolved in ``_finish`` (the kernel keeps what an exact undo needs);
        ``commit``: it stands, apply the blocks it deferred (megatrain/cpu_adamw.py)."""
        st = self.store
        if new_step:
            st.steps[name].add_(1)  # the kernels expect the already-incremented count
        p, m, v = st.master[name], st.m[name], st.v[name]
        shadow = (getattr(st, "shadow", None) or {}).get(name)  # bf16 over the link: written with the update
        lo, hi = self._range(name)
        fused = True  # every chunk's shadow written by the kernel in its update pass
        for a, g in self.grad_stream.chunks(flat[lo:hi], ready):
            a += lo
            b = a + g.numel()
            if undo:  # rollback: undo in float64, redo with the true coefficient, in one pass
                self.kernel.undo(p[a:b], g, m[a:b], v[a:b], st.steps[name], lr, coef)
                fused = False
            elif commit:
                self.kernel.commit(p[a:b], g, m[a:b], v[a:b], st.steps[name], lr)
                fused = False
            elif coef is not None:
                fused &= self.kernel.step(p[a:b], g, m[a:b], v[a:b], st.steps[name], lr, coef,
                                          speculative=speculative, shadow=None if shadow is None else shadow[a:b])
        if shadow is not None and not fused:
            # A second pass over the master (undo, commit, a speculative update whose blocks may change yet).
            # It was every update's until the kernel wrote the shadow: on the H100 node (86bb81e, 7B streaming,
            # clipping firing) the CPU path's update with the shadow took 2.43 s a step against 1.66 without.
            st.refresh_shadow(name, lo, hi)


def update_cores(setting: str, cuda: bool, allowed: set[int], ranks: int = 1) -> tuple[list[int], list[int]] | None:
    """EngineConfig.host_update_cores -> (cores for the update worker and its OpenMP teams, cores left to the
    main thread), from the cores this process may use (``allowed``), or None (no binding).

    "none": no binding. "all-but-N": the main thread gets the N lowest-numbered allowed cores, the worker the
    rest. "auto": "all-but-1" on a one-process GPU run (the main thread keeps the GPU fed while the worker
    updates); none on a CPU run (the main thread computes there: it needs every core) and none with several
    ranks (``ranks`` > 1: their main threads would share the lowest core). Fewer than N + 1 cores: no binding."""
    setting = str(setting).strip().lower()
    if setting == "none" or (setting == "auto" and (not cuda or ranks > 1)):
        return None
    n = 1 if setting == "auto" else parse_all_but(setting)
    cores = sorted(allowed)
    if len(cores) <= n:
        warnings.warn(f"host_update_cores={setting!r}: this process may use {len(cores)} cores, not more than "
                      f"{n}; the host update is not bound", RuntimeWarning, stacklevel=3)
        return None
    return cores[n:], cores[:n]



def _thread_ids() -> list[int]:
    """OS ids of this process's threads."""
    return [int(t) for t in os.listdir("/proc/self/task")]
