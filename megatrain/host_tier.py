"""The host tier's optimizer: the CPU kernel and the GPU update path sharing the host-tier groups.

``HybridHostAdamW`` sits behind the ``GroupOptimizer`` interface (megatrain/optim.py): it routes each group,
per step, to the CPU kernel (megatrain/host_adamw.py, which runs in its worker thread meanwhile) or to the
GPU update path (``StreamedAdamW``, megatrain/streamed_update.py), by a split from megatrain/update_split.py
(one for steps that speculate, one for steps that wait for the norm), and sends each group's next load to
the path that last updated it. With ``update_path="cpu"`` every group goes to the CPU kernel, as before.
``build_host_tier`` makes it from an EngineConfig.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from . import update_split
from .store import ModelStore
from .streamed_update import GIB, MIN_CHUNK_ELEMS, StreamedAdamW, rotating_bytes, staging_chunk
from .streams import StreamSet
from .split_chooser import SplitChooser
from .update_split import Split, UpdateRates, forced_split, measure_rates, plan_split


class HybridHostAdamW:
    """The host tier's optimizer: the CPU kernel (``cpu``, a HostAdamW) and, when given, the GPU update path
    (``gpu``, a StreamedAdamW) sharing the host-tier groups per ``splits`` ({speculating: Split})."""

    def __init__(self, cpu, gpu: StreamedAdamW | None = None, splits: dict[bool, Split] | None = None,
                 rates: UpdateRates | None = None, replan=None, choose_prefetch=None, evaluate=None):
        """``replan(backward_s, prefetched)``: both splits ({speculating: Split}) for a measured backward time
        (a speculative CPU path's head start) and the prefetched groups; until a backward is observed,
        ``splits``. For a step that waits for the norm, replan's split is only a proposal: a ``SplitChooser``
        decides from measured step times (``observe_step``). ``evaluate(gpu_names, prefetched)``: the model's
        Split for those GPU-path groups at the current rates (predictions and calibration of splits that
        ran). ``choose_prefetch(backward_s)``: the groups to prefetch (gpu_path_prefetch), decided once,
        after the first step."""
        self.cpu, self.gpu = cpu, gpu
        self.names = list(cpu.names)
        self.splits = dict(splits or {})
        self.rates = rates
        self._replan, self._choose_prefetch, self._evaluate = replan, choose_prefetch, evaluate
        # The after-norm split is decided from measured step times once it can change (gpu_path_groups="auto").
        self.chooser = SplitChooser(self.names) if gpu is not None and replan is not None else None
        self.steps_observed = 0  # engine steps seen by observe_step (the metrics' step index + 1)
        self.last_measured_cold = False  # the last step's time measured a cold update (``transient``)
        self._split_now = Split([], self.names)  # the split this step routes with
        self._base_rates = dataclasses.replace(rates) if rates is not None else None  # as measured at build
        self.prefetched: list[str] | None = None  # decided after the first step (None: not yet / not asked)
        # Online calibration (``observe_step``): parameters each path updated per finished step, newest last.
        # (CPU params, GPU-path params, speculated or skipped, the Split routed)
        self._params: list[tuple[int, int, bool, Split]] = []
        self._step_params = [0, 0]
        self.calibrated = 0  # steps whose measured busy times corrected the rates
        self._cpu_seen: set[str] = set()  # the CPU rates ("cpu_gps", "cpu_loaded_gps") this run has measured
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

    @property
    def pinned_bytes(self) -> int:
        """Host memory the GPU path page-locked (its groups' m, v; the master under a bf16 shadow)."""
        return self.gpu.pinned_bytes if self.gpu is not None else 0

    def choosing(self) -> str:
        """Why the runtime split is still being chosen ("" when it is not, or when nothing is chosen)."""
        return self.chooser.choosing() if self.chooser is not None else ""

    def transient(self) -> str:
        """Why the last step's time is not this split's steady one ("" when it is): it measured an update that
        uploaded kept masters again (12 B/param where a warm one moves 8: rule 0's cold start)."""
        return ("runtime split: the step measured a cold update (kept masters uploaded again)"
                if self.last_measured_cold else "")

    def counters(self) -> dict[str, float]:
        busy, wait = self.gpu.settle() if self.gpu is not None else (0.0, 0.0)
        return dict(cpu_groups=self.cpu_groups, gpu_path_groups=self.gpu_path_groups, gpu_path_busy_s=busy,
                    gpu_path_wait_s=wait, gpu_path_h2d_bytes=self.gpu.h2d_bytes if self.gpu is not None else 0,
                    gpu_path_d2h_bytes=self.gpu.d2h_bytes if self.gpu is not None else 0,
                    gpu_path_cold_bytes=self.gpu.cold_bytes if self.gpu is not None else 0)

    def observe_step(self, stats: dict) -> None:
        """After a step: its backward time sets how long a speculative CPU path runs before the norm (and,
        once, how much state to prefetch), and the busy times of the update that ran during it (the previous
        step's, after its norm) correct the rates; both splits are then planned again. The after-norm split
        is then the chooser's (``SplitChooser``: measured step times decide), and its decision goes into
        ``stats`` (the engine's per-step phases): ``split_measured_gpu_groups`` (GPU-path groups of the update
        this step's time measured, the previous step's; absent when not comparable), ``split_decision`` (an
        ``update_split`` decision code) and ``split_next_gpu_groups`` (what the next such step routes)."""
        self.steps_observed += 1
        self.last_measured_cold = False
        bwd = stats.get("backward_s")
        if self.gpu is None or bwd is None or not math.isfinite(bwd):
            return
        self.backward_s = bwd if self.backward_s is None else 0.5 * (self.backward_s + bwd)
        if self._choose_prefetch is not None and self.prefetched is None:
            # Once: the backward's length bounds how much state can go up during it (buffers are allocated now).
            self.prefetched = self.gpu.set_prefetch(self._choose_prefetch(self.backward_s))
        if self._replan is None:
            return
        self._calibrate(stats)
        prefetched = frozenset(self.prefetched or ())
        planned = self._replan(self.backward_s, prefetched)
        if self.chooser is not None:
            planned[False] = self._choose(stats, planned[False], prefetched)
        self.splits.update(planned)

    def _choose(self, stats: dict, proposal: Split, prefetched: frozenset) -> Split:
        """The next after-norm split: this step's time measured the update routed in the step before (it ran
        during this step's forward); the chooser weighs it against the other splits measured so far."""
        comparable = len(self._params) >= 2 and not self._params[-2][2]
        if comparable:  # the update measured here ran after its norm and was not skipped
            measured = self._params[-2][3]
            # This step's own speculation would put its CPU path in its time: then the trial is dropped. An
            # update that uploaded kept masters (counted in this step: it ran during its forward) is a cold one.
            cold = stats.get("gpu_path_cold_bytes", 0) > 0
            self.chooser.record(measured.key, None if self._params[-1][2] else stats.get("step_s"), cold=cold)
            if not self._params[-1][2]:
                stats["split_measured_gpu_groups"] = float(len(measured.gpu))
                stats["split_measured_cold"] = float(cold)
                self.last_measured_cold = cold

        def predict(split: Split) -> float:  # at the current, calibrated rates
            if self._evaluate is None:
                return split.predicted_s
            return self._evaluate(split.gpu, prefetched & frozenset(split.gpu)).predicted_s

        current = self.splits.get(False) or Split([], self.names)
        chosen = self.chooser.choose(self.steps_observed - 1, current, proposal, predict,
                                     cold=self.gpu.cold if self.gpu is not None else None)
        stats["split_decision"] = float(self.chooser.last_decision)
        stats["split_next_gpu_groups"] = float(len(chosen.gpu))
        return chosen

    def _calibrate(self, stats: dict) -> None:
        """Rates from this run, for an update that ran after the norm beside a whole step (neither that step
        nor this one speculated or was skipped); kept within 4x of the measured ones:

        * the CPU path's parameters over its worker's busy time: the rate under the GPU path's copies when
          the split had GPU-path groups, the rate alone when it had none. Averaged with the current rate when
          the two agree within MODEL_DOUBT; beyond it the build's probe was wrong (on the H100 node it said
          5.97 Gparam/s, the step's kernel ran at 3.6-4.0), so the seen rate replaces it at once. Until the
          run has seen the other rate (alone or loaded) that one moves by the same factor (the probe's ratio
          of the two stands; its scale was what erred);
        * the link rates scaled by the model's GPU-path span for that split over the measured one
          (``gpu_path_busy_s``, first upload to last download). That span is a wall time on a link shared
          with the next forward's loads and the CPU path's gradients, which the model schedules too; it is
          not the GPU path's bytes over a link rate. (Until this, 12 B/param over the span was taken as the
          link rate: on the H200, 14B, 11 groups, 3.03B params in 1.754 s gave 20.7 GB/s against the 42.5
          measured at build, the model then put every group on the CPU, and the step got 9 % slower.)"""
        if self.rates is None or len(self._params) < 2 or self._params[0][2] or self._params[1][2]:
            return
        cpu_params, gpu_params, _, split = self._params[0]  # the update this step's busy times measured
        cpu_busy, gpu_busy = stats.get("host_update_busy_s", 0.0), stats.get("gpu_path_busy_s", 0.0)
        r, base = self.rates, self._base_rates
        if cpu_params and cpu_busy > 0:
            seen = cpu_params / cpu_busy / 1e9
            field, other = ("cpu_loaded_gps", "cpu_gps") if gpu_params else ("cpu_gps", "cpu_loaded_gps")
            now = getattr(r, field)
            new = seen if abs(seen / now - 1) > update_split.MODEL_DOUBT else 0.5 * (now + seen)
            new = _clamp(new, getattr(base, field))
            if other not in self._cpu_seen:  # the other rate was never seen in this run: the same correction
                setattr(r, other, _clamp(getattr(r, other) * new / now, getattr(base, other)))
            setattr(r, field, new)
            self._cpu_seen.add(field)
        # Not from a cold update (its kept masters went up again: 12 B/param where the model has 8, a one-off).
        cold = stats.get("gpu_path_cold_bytes", 0) > 0
        if gpu_params and gpu_busy > 0 and self._evaluate is not None and not cold:
            predicted = self._evaluate(split.gpu, frozenset(self.prefetched or ()) & frozenset(split.gpu))
            if predicted.predicted_gpu_path_s > 0:
                scale = predicted.predicted_gpu_path_s / gpu_busy  # > 1: the path ran faster than modelled
                r.h2d_gbs = _clamp(0.5 * r.h2d_gbs * (1 + scale), base.h2d_gbs)
                r.d2h_gbs = _clamp(0.5 * r.d2h_gbs * (1 + scale), base.d2h_gbs)
        self.calibrated += 1

    def split_for(self, speculate: bool) -> Split:
        return self.splits.get(speculate) or Split([], list(self.names))

    # -- GroupOptimizer -------------------------------------------------------------------------------
    def begin_step(self, step: int, speculate: bool) -> None:
        split = self.split_for(speculate) if self.gpu is not None else Split([], list(self.names))
        self._gpu_set, self._split_now = set(split.gpu), split
        self._step_params, self._speculating = [0, 0], speculate
        self.cpu.begin_step(step, speculate)  # the CPU path speculates on its own groups only
        if self.gpu is not None:
            self.gpu.begin_step(step, False)

    def grad_ready(self, name: str, flat: torch.Tensor, sqnorm: torch.Tensor, ready) -> None:
        self._step_params[0 if name not in self._gpu_set else 1] += flat.numel()
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
        comparable = not (self._speculating or coef is None)
        self._params = (self._params + [(*self._step_params, not comparable, self._split_now)])[-2:]
        if comparable and self.chooser is not None:
            self.chooser.ran(self._split_now)  # its step time arrives with the next step's

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
            if self.rates is None or not self.splits:
                return "host update: CPU kernel only"
            # update_path="hybrid" asked, but the split at the rates measured here gives the GPU path no group
            # (the plan, at the cost model's rates, may have predicted some): say so, with those rates.
            sp = self.split_for(False)
            return (f"host update: CPU kernel only (the GPU path takes no group at the rates measured here"
                    + (f": predicted {sp.predicted_s:.3f} s vs CPU only {sp.predicted_cpu_only_s:.3f} s"
                       if sp.predicted_cpu_only_s else "") + (f", {sp.reason}" if sp.reason else "")
                    + f"); rates {self.rates.to_dict()}")
        parts = []
        for spec, label in ((False, "after the norm"), (True, "speculative")):
            sp = self.split_for(spec)
            parts.append(f"{label}: {len(sp.gpu)} of {len(self.names)} groups on the GPU path"
                         + (f", predicted {sp.predicted_s:.3f} s vs CPU only {sp.predicted_cpu_only_s:.3f} s"
                            if sp.predicted_cpu_only_s else "") + (f" ({sp.reason})" if sp.reason else ""))
        rates = f"; rates {self.rates.to_dict()}" if self.rates is not None else ""
        if self.chooser is not None:
            rates += f"; runtime split: {self.chooser.describe()}"
        pre = "" if self.prefetched is None else f", {len(self.prefetched)} prefetched during the backward"
        return (f"host update: CPU kernel + GPU path (staging {self.gpu.staging_bytes / GIB:.2f} GiB, "
                f"{len(self.gpu.names)} candidate groups, {len(self.gpu.kept)} kept masters{pre}); "
                + "; ".join(parts) + rates)


def grad_bytes(cfg) -> int:
    """Bytes per parameter of a host-tier layer gradient the CPU path pulls down (the buffer dtype's)."""
    return torch.finfo(cfg.resolved_buffer_dtype()).bits // 8


def _clamp(value: float, measured: float) -> float:
    return min(4 * measured, max(measured / 4, value))


def split_args(numels: list[int], *, staging_bytes: float, grads_on_host: bool, stream_bytes: int,
               grad_bytes: int, shadow: bool) -> dict | None:
    """``plan_split``'s keyword arguments for the host-tier groups of ``numels`` (their bytes per parameter
    each way) when the GPU path may hold ``staging_bytes``; None when that holds not even one chunk. Updated
    weights are kept on the GPU (every load until the next update reads them there: no second load) in what
    the chunks leave: fp32 masters (4 B/param; masters of record, so only m and v cross the link), or with a
    bf16 shadow the shadow (2 B/param, ``stream_bytes``); the model gives that room to GPU-path groups in
    forward order and counts the load of those without one."""
    chunk = staging_chunk(max(numels), staging_bytes, grads_on_host)
    if chunk == 0:
        return None
    return dict(stream_bytes=stream_bytes, grad_bytes=0 if grads_on_host else grad_bytes,
                grad_up_bytes=4 if grads_on_host else 0, gpu_load_bytes=stream_bytes, kept_master=not shadow,
                kept_bytes=max(0.0, staging_bytes - rotating_bytes(chunk, grads_on_host)),
                kept_per_param=stream_bytes if shadow else 4)


def first_split(order: list[tuple[str, int]], rates: UpdateRates, **kw) -> tuple[Split, list[str]]:
    """What ``build_host_tier`` decides first (gpu_path_groups "auto", no prefetch) at ``rates`` for the
    host-tier groups ``order`` ((name, numel), forward order); ``kw``: ``split_args``'s. Returns the split for a
    step that waits for the global norm, and the GPU path's candidates: those groups, the longest prefix a
    speculative step may take (no head start), a contested split's groups (one the model predicted no faster
    than the CPU path alone, but within ``update_split.MODEL_DOUBT`` of it), and the hedge (``Split.hedged``:
    the split at CPU rates ``update_split.CPU_DOUBT`` slower than measured, as the step's kernel has run).
    Groups beyond the first split (``Split.beyond_plan``) wait on the CPU path until the runtime's
    calibrated rates propose them and its SplitChooser measures them; no candidate: no GPU path is built. The
    planner's step-time model predicts the hybrid host update with this same function (one set of rates)."""
    names = [x for x, _ in order]
    args = split_args([n for _, n in order], **kw) if order else None
    if args is None:
        only = sum(n for _, n in order) / (rates.cpu_gps * update_split.GB)
        return Split([], names, only, only, "the GPU staging holds no chunk"), []
    split = plan_split(order, rates, **args)
    split.hedged = plan_split(order, rates.doubted(), **args).gpu
    # Speculative steps: the GPU path's prefix shrinks as the CPU's head start (the backward) grows; the
    # longest one (no head start) bounds which groups it may ever take.
    longest = len(plan_split(order, rates, speculative=True, backward_s=0.0, **args).gpu)
    chosen = set(split.gpu) | set(names[:longest]) | set(split.beyond_plan)
    return split, [x for x in names if x in chosen]


def build_host_tier(cpu_opt, *, store: ModelStore, cfg, streams: StreamSet, host_names: list[str],
                    grads_on_host: bool, staging_bytes: float, dist=None,
                    update_path: str | None = None, rates: UpdateRates | None = None) -> HybridHostAdamW:
    """The host tier's optimizer for ``cfg`` (an EngineConfig): ``cpu_opt`` alone (update path "cpu"), or with
    the GPU path, its split forced (``gpu_path_groups`` names) or planned from measured rates ("auto").
    ``update_path``: the path the plan resolved ("cpu" | "hybrid"; default ``cfg.update_path``, which must
    not be "auto" then). ``staging_bytes``: GPU memory the path may hold (rotating buffers + kept masters).
    ``rates``: the update rates the plan used (the engine measures them before planning); None: measured
    here on a GPU, the defaults on the CPU. Kept (and reported) even when the path resolved to "cpu"."""
    update_path = update_path or cfg.update_path
    if update_path not in ("cpu", "hybrid"):
        raise ValueError(f"build_host_tier needs a resolved update path ('cpu' or 'hybrid'), got {update_path!r}")
    rates = dataclasses.replace(rates) if rates is not None else None  # the run calibrates its own copy
    if update_path == "cpu" or not host_names:
        return HybridHostAdamW(cpu_opt, rates=rates)
    if dist is not None:
        raise ValueError("update_path='hybrid' is not supported with data parallel training (use 'cpu')")
    numels = {x: store.by_name[x].numel for x in host_names}
    chunk = staging_chunk(max(numels.values()), staging_bytes, grads_on_host)
    if chunk == 0:
        raise ValueError(f"update_path='hybrid': {staging_bytes / GIB:.2f} GiB of GPU staging is less than the GPU "
                         f"path needs ({rotating_bytes(MIN_CHUNK_ELEMS, grads_on_host) / GIB:.2f} GiB): raise "
                         f"update_staging_gib")
    replan, choose, evaluate = None, None, None
    order = [(x, numels[x]) for x in host_names]
    c = 4 if store.shadow is None else 2
    if cfg.gpu_path_groups != "auto":
        forced = [x.strip() for x in cfg.gpu_path_groups.split(",") if x.strip()]
        split = forced_split(host_names, forced)
        splits = {False: split, True: split}
        candidates = split.gpu
        if cfg.gpu_path_prefetch:  # the forced groups only, the model's amount
            rates = rates or UpdateRates()
            forced_order = [(x, numels[x]) for x in split.gpu]
            choose = lambda bwd: update_split.prefetch_set(  # noqa: E731
                forced_order, rates, backward_s=bwd, load_bytes=c * sum(numels.values()),
                budget_bytes=staging_bytes - rotating_bytes(chunk, grads_on_host))
    else:
        if rates is None:
            rates = (measure_rates(streams.device, cpu_opt.kernel, shadow=store.shadow is not None,
                                   pinned=cfg.pins_all_host_state) if streams.cuda
                     else UpdateRates())
        # The plan predicted its hybrid term with this same split (first_split) at these rates.
        args = dict(staging_bytes=staging_bytes, grads_on_host=grads_on_host, stream_bytes=c,
                    grad_bytes=grad_bytes(cfg), shadow=store.shadow is not None)
        kw = split_args(list(numels.values()), **args)
        first, candidates = first_split(order, rates, **args)
        # Until a backward is measured, a speculative step keeps the CPU path alone (it is what ran before:
        # never slower); then its prefix, at most the longest one (no head start: the candidates' prefix).
        longest = len(plan_split(order, rates, speculative=True, backward_s=0.0, **kw).gpu)
        splits = {False: first, True: Split([], list(host_names), reason="no backward measured yet")}
        if cfg.gpu_path_prefetch:
            candidates = list(host_names)  # any group may be prefetched (its m, v are pinned for it)
        eligible = frozenset(candidates)  # pinned and (maybe) kept for the path: replanning stays within them

        def evaluate(gpu_names, prefetched: frozenset) -> Split:
            return plan_split(order, rates, prefetched=prefetched, assign=frozenset(gpu_names), **kw)

        def replan(backward_s: float, prefetched: frozenset) -> dict:
            return {False: plan_split(order, rates, prefetched=prefetched, eligible=eligible, **kw),
                    True: plan_split(order, rates, speculative=True, backward_s=backward_s, max_gpu_groups=longest,
                                     prefetched=prefetched, eligible=eligible, **kw)}

        if cfg.gpu_path_prefetch:
            choose = lambda bwd: update_split.prefetch_set(  # noqa: E731
                order, rates, backward_s=bwd, load_bytes=c * sum(numels.values()),
                budget_bytes=staging_bytes - rotating_bytes(chunk, grads_on_host))
    kept_budget = max(0.0, staging_bytes - rotating_bytes(chunk, grads_on_host))
    if not candidates:
        return HybridHostAdamW(cpu_opt, None, splits, rates)
    gpu = StreamedAdamW(store, cfg.optim, candidates, streams, chunk=chunk, kept_budget=kept_budget,
                        pin=streams.cuda and cfg.pin_memory, prefetch=cfg.gpu_path_prefetch,
                        kept_first=splits[False].gpu)
    return HybridHostAdamW(cpu_opt, gpu, splits, rates, replan, choose, evaluate)
