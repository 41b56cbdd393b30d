"""AdamW for both tiers behind one interface, and the math they share.

A step's optimizer work is driven by the engine through ``Optimizers``:

    begin_step(step)                        the speculation decision for this step
    grad_ready(name, flat, sqnorm, ready)   a group's final gradient exists on the GPU (backward order)
    finish(step, grad_norm)                 the global norm is known: clip coefficient, or skip if not finite
    wait_group(name)                        before a group's weights are read again (next forward)
    observe_step(stats)                     after the step: its time to the speculation chooser

Each group belongs to one implementation (its tier): ``DeviceAdamW`` (GPU tier, megatrain/device_adamw.py)
updates after the norm with a fused kernel on the device; ``HostAdamW`` (host tier, megatrain/host_adamw.py)
updates in a worker thread, speculatively during the backward when the policy allows.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .system import OptimConfig


class GroupOptimizer(Protocol):
    names: list[str]

    def begin_step(self, step: int, speculate: bool) -> None: ...

    def grad_ready(self, name: str, flat: torch.Tensor, sqnorm: torch.Tensor, ready) -> None: ...

    def finish(self, step: int, coef: float | None) -> None: ...

    def wait_group(self, name: str): ...  # returns a device event the next load must wait on, or None

    # Optional: ``device_source(name)`` -> the group's updated master already on the GPU (the next load casts
    # it instead of copying from host RAM), or None. Implementations without it have none.

    def wait_all(self) -> None: ...

    def close(self) -> None: ...


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), clamped to 1."""
    if max_norm is None or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def adamw_(p, g, m, v, step_t, lr: float, cfg: OptimConfig, grad_scale=None) -> None:
    """One fused AdamW update of flat fp32 ``p, m, v`` with fp32 gradient ``g`` (all on one device).
    ``step_t`` is the already-incremented step count (as torch.optim passes it); ``grad_scale`` divides
    the gradient inside the kernel (clipping folded in, no extra pass)."""
    b1, b2 = cfg.betas
    torch._fused_adamw_([p], [g], [m], [v], [], [step_t], lr=lr, beta1=b1, beta2=b2,
                        weight_decay=cfg.weight_decay, eps=cfg.eps, amsgrad=False, maximize=False,
                        grad_scale=grad_scale, found_inf=None)


def adamw_undo_(p, g, m, v, step: float, lr: float, cfg: OptimConfig) -> None:
    """Invert ``adamw_`` (unscaled gradient ``g``, step count ``step`` after the increment), in float64.

    AdamW is invertible given the gradient: p_mid = p + lr/bc1 · m/(sqrt(v)/sqrt(bc2) + eps) undoes the
    step, p_mid / (1 - lr·wd) the decoupled decay, (m - (1-b1)·g)/b1 and (v - (1-b2)·g²)/b2 the moments.
    At step 1 the moments were zeros, restored exactly. float64 keeps the rounding of the round trip far
    below fp32's; the result is the previous state to within fp32 rounding, not bit for bit."""
    b1, b2 = cfg.betas
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    pd, md, vd = p.double(), m.double(), v.double()
    denom = vd.sqrt().div_(math.sqrt(bc2)).add_(cfg.eps)
    pd.addcdiv_(md, denom, value=lr / bc1)
    if cfg.weight_decay:
        pd.div_(1 - lr * cfg.weight_decay)
    p.copy_(pd)
    if step <= 1:
        m.zero_()
        v.zero_()
        return
    gd = g.double()
    m_old = (md - gd * (1 - b1)).div_(b1)
    v_old = vd.addcmul(gd, gd, value=-(1 - b2)).div_(b2)
    # Elements whose moments were zero (e.g. embedding rows never seen before) come back as rounding
    # residue of the fp32 update; a residue in m over a ~0 v would turn into an lr-sized step later, so
    # moments indistinguishable from zero at fp32 precision (both below 2^-18 of the new ones) are zero.
    zero = (v_old.abs() <= vd * 2.0**-18) & (m_old.abs() <= md.abs() * 2.0**-18)
    m.copy_(m_old.masked_fill_(zero, 0.0))
    v.copy_(v_old.masked_fill_(zero, 0.0).clamp_(min=0))


# Why speculate="auto" speculates or not (``SpeculationChooser``; also a number in each step's phases,
# ``speculation_decision``). The precondition (the previous step did not clip) gates every code.
SPEC_MEASURING_ON, SPEC_MEASURING_OFF, SPEC_KEPT_FASTER, SPEC_KEPT_WITHIN_MARGIN, SPEC_OFF_FASTER, SPEC_FIXED = range(6)
SPEC_DECISIONS = {SPEC_MEASURING_ON: "speculating: measuring it", SPEC_MEASURING_OFF: "measuring steps without speculation",
                  SPEC_KEPT_FASTER: "kept speculating: measured faster",
                  SPEC_KEPT_WITHIN_MARGIN: "kept speculating: not speculating is within the margin",
                  SPEC_OFF_FASTER: "stopped speculating: measured faster without", SPEC_FIXED: "fixed by the setting"}


@dataclass
class SpecStep:
    """What one step did, for the chooser: ``want`` the chooser's mode (speculate where possible),
    ``possible`` the precondition (the previous step did not clip), ``speculated`` both, ``clipped`` the
    step's clip coefficient was < 1 or its norm not finite (None: ``finish`` not reached, e.g. aborted)."""

    want: bool
    possible: bool
    speculated: bool
    clipped: bool | None = None


@dataclass
class SpeculationChooser:
    """Whether speculate="auto" speculates where it may, decided from measured step times.

    Where the time of one update lands: a step that waits for the norm runs its host update after the norm,
    during the NEXT step's forward (the loads wait for it there); a speculative step runs it during its own
    backward, and its rollback when clipping fires (undo + redo) after the norm, during the next forward.
    So step k's time holds step k-1's update (not speculated) or rollback (speculated, clipped), plus step
    k's own update if it speculates. ``record(prev, cur, step_s)`` classifies step k's time (``cur``; the
    step before it ``prev``) as a sample of one mode or of none:

    * none: one of the first ``warmup`` steps (the first has nothing before it; the second holds the first's
      update and its own: start-up), a step after one whose time or norm was not seen, and the first step
      after the mode changed (it holds both updates, or neither: it measures the switch, not a mode);
    * speculation's: the mode is "speculate" and this step or the one before speculated. That includes the
      step after a speculative step that clipped (its forward runs the undo + redo: speculation's cost) and
      the step that speculates again after it (it also holds the update of the step the clip held back);
    * not speculating's: the mode is "do not", and the precondition held (speculation was possible here;
      a step after a clipped one measures nothing the choice could change).

    The schedule (bounded): speculate (the mode before this chooser existed) until ``samples`` speculation
    samples are in; then ``samples`` steps without; then keep the faster (mean step time, the rollbacks'
    cost included), speculation staying unless not speculating is faster by more than ``margin`` of its
    time (hysteresis). Decided once, never re-checked. With clipping firing every step speculation never
    runs: no sample, the mode stays (nothing speculates either way)."""

    samples: int = 3
    margin: float = 0.02  # of a step's time (step-to-step noise ~1 % on the H200)
    warmup: int = 2
    mode: bool = True  # speculate where the precondition allows
    times: dict = field(default_factory=lambda: {True: [], False: []})  # mode -> sample step times (trials)
    decided: bool = False
    last_decision: int = SPEC_MEASURING_ON
    steps: int = 0  # step times seen (records)
    history: list = field(default_factory=list)  # (step index, decision code, reason) when the mode changed
    reason: str = "speculating first"

    def record(self, prev: SpecStep | None, cur: SpecStep, step_s: float | None) -> bool | None:
        """Step ``cur``'s time ``step_s`` (None: unknown); returns the mode it was a sample of (None: of none),
        then moves the schedule on (``mode``, ``last_decision``, ``reason``)."""
        index = self.steps
        self.steps += 1
        kind = self.classify(prev, cur, index, step_s)
        if kind is not None and not self.decided:
            self.times[kind].append(float(step_s))
        if not self.decided:
            self._advance(index)
        return kind

    def classify(self, prev: SpecStep | None, cur: SpecStep, index: int, step_s: float | None) -> bool | None:
        if step_s is None or not math.isfinite(step_s) or step_s <= 0 or index < self.warmup:
            return None
        if prev is None or prev.clipped is None or cur.clipped is None or prev.want != cur.want:
            return None
        if cur.want:
            return True if (prev.speculated or cur.speculated) else None
        return False if cur.possible else None

    def _advance(self, index: int) -> None:
        on, off = self.times[True], self.times[False]
        if self.mode and len(on) >= self.samples and len(off) < self.samples:
            self._set(index, False, SPEC_MEASURING_OFF, f"speculation measured {statistics.fmean(on):.3f} s a step "
                                                           f"({len(on)} steps)")
        elif not self.mode and len(off) >= self.samples:
            t_on, t_off = statistics.fmean(on), statistics.fmean(off)
            times = f"{t_off:.3f} s a step without vs {t_on:.3f} s speculating"
            if t_off < t_on * (1 - self.margin):
                self._set(index, False, SPEC_OFF_FASTER, times)
            elif t_on <= t_off:
                self._set(index, True, SPEC_KEPT_FASTER, times)
            else:
                self._set(index, True, SPEC_KEPT_WITHIN_MARGIN, f"{times} (margin {self.margin:.0%})")
            self.decided = True

    def _set(self, index: int, mode: bool, decision: int, why: str) -> None:
        if mode != self.mode:
            self.history.append((index, decision, why))
        self.mode, self.last_decision, self.reason = mode, decision, why

    def describe(self) -> str:
        times = ", ".join(f"{label} {statistics.fmean(self.times[k]):.3f} s a step ({len(self.times[k])} steps)"
                          for k, label in ((True, "speculating"), (False, "not speculating")) if self.times[k])
        changes = "; ".join(f"after step {s}: {SPEC_DECISIONS[d]} ({why})" for s, d, why in self.history)
        return (f"{SPEC_DECISIONS[self.last_decision]} ({self.reason}); measured: {times or 'nothing yet'}; "
                f"changes: {changes or 'none'}")


class SpeculationPolicy:
    """Whether the host tier updates early (clip coefficient 1) this step. Speculation pays only when
    clipping does not fire, and not always then: the precondition is that the previous step did not clip
    (never on the first step, whose norm is unknown; with clipping off, always met: only a non-finite norm
    can undo it). Where it holds, "auto" speculates as ``SpeculationChooser`` decides from measured step
    times (H200, Qwen2.5-7B, every layer streamed, no clipping: 2.72 s a step speculating against 2.44 after
    the norm, 1.98 with the hybrid split: the update competes with the backward's copies for host memory
    bandwidth; 14B tiered: speculating is faster). "always" speculates every step (rolled back where
    clipping fires), "never" never.

    Per step: ``decide`` (begin_step), ``observe(grad_norm)`` (finish), ``observe_step(stats)`` (after the
    step, with the engine's phases: ``step_s`` feeds the chooser; its decision goes back into ``stats``)."""

    def __init__(self, mode: str, max_norm: float | None, chooser: SpeculationChooser | None = None):
        self.mode, self.max_norm = mode, max_norm
        self.prev_clipped: bool | None = None
        self.chooser = (chooser or SpeculationChooser()) if mode == "auto" else None
        self._cur: SpecStep | None = None  # this step (decided, not yet timed)
        self._prev: SpecStep | None = None  # the step before it (timed)

    def decide(self) -> bool:
        if self.mode != "auto":
            return self.mode == "always"
        possible = self.max_norm is None or self.max_norm <= 0 or self.prev_clipped is False
        if self._cur is not None:  # the last step was never timed (aborted, or no observe_step): no chain
            self._prev = None
        self._cur = SpecStep(self.chooser.mode, possible, possible and self.chooser.mode)
        return self._cur.speculated

    def observe(self, grad_norm: float) -> None:
        self.prev_clipped = not math.isfinite(grad_norm) or clip_coefficient(grad_norm, self.max_norm) < 1.0
        if self._cur is not None:
            self._cur.clipped = self.prev_clipped

    def observe_step(self, stats: dict) -> None:
        """After a step: its time (``stats["step_s"]``) to the chooser; into ``stats``: ``speculation_measured``
        (1 the step's time was a speculation sample, 0 a no-speculation one; absent: neither),
        ``speculation_decision`` (a ``SPEC_*`` code) and ``speculation_next`` (1: the next step speculates
        where the precondition allows)."""
        if self.chooser is None:
            stats["speculation_decision"] = float(SPEC_FIXED)
            stats["speculation_next"] = float(self.mode == "always")
            return
        if self._cur is None:
            return
        kind = self.chooser.record(self._prev, self._cur, stats.get("step_s"))
        self._prev, self._cur = self._cur, None
        if kind is not None:
            stats["speculation_measured"] = float(kind)
        stats["speculation_decision"] = float(self.chooser.last_decision)
        stats["speculation_next"] = float(self.chooser.mode)

    def choosing(self) -> str:
        """Why speculate="auto" is still choosing ("" when it is not): undecided while the next step may
        speculate (the precondition holds). While clipping fires nothing can be measured: not choosing."""
        if self.chooser is None or self.chooser.decided:
            return ""
        possible = self.max_norm is None or self.max_norm <= 0 or self.prev_clipped is False
        return f"speculation: {SPEC_DECISIONS[self.chooser.last_decision]}" if possible else ""

    def describe(self) -> str:
        """One line for the summary: the mode, the measured step times and the decision with its reason."""
        if self.chooser is None:
            return f"speculate={self.mode!r}: fixed by the setting"
        return f"speculate='auto': {self.chooser.describe()}"


class Optimizers:
    """Routes each group's gradient to its tier's optimizer and turns the global norm into one clip
    coefficient for all of them (or a skipped step when it is not finite)."""

    def __init__(self, impls: list[GroupOptimizer], cfg: OptimConfig, speculate: str):
        self.impls = impls
        self.cfg = cfg
        self.by_group = {name: impl for impl in impls for name in impl.names}
        self.policy = SpeculationPolicy(speculate, cfg.max_grad_norm)
        self.speculating = False

    def begin_step(self, step: int) -> None:
        self.speculating = self.policy.decide()
        for impl in self.impls:
            impl.begin_step(step, self.speculating)

    def grad_ready(self, name: str, flat: torch.Tensor, sqnorm: torch.Tensor, ready) -> None:
        self.by_group[name].grad_ready(name, flat, sqnorm, ready)

    def observe_step(self, stats: dict) -> None:
        """After a step, with its phases (``step_s``): the speculation chooser's measurement and decision
        (``SpeculationPolicy.observe_step``), written into ``stats``."""
        self.policy.observe_step(stats)

    def choosing(self) -> str:
        """Why the steps are still tuning themselves ("" when they are not): the speculation chooser, then each
        tier's own (``choosing`` where an implementation has one: the host tier's runtime split)."""
        return _first_said((self.policy, *self.impls), "choosing")

    def transient(self) -> str:
        """Why the last step's time is not a steady one ("" when it is): a tier's own (``transient`` where an
        implementation has one: the host tier's cold updates)."""
        return _first_said(self.impls, "transient")

    def finish(self, step: int, grad_norm: float) -> float | None:
        """Apply the step's update everywhere; returns the clip coefficient, None if the step is skipped."""
        coef = clip_coefficient(grad_norm, self.cfg.max_grad_norm) if math.isfinite(grad_norm) else None
        self.policy.observe(grad_norm)
        for impl in self.impls:
            impl.finish(step, coef)
        return coef

    def abort(self, step: int) -> None:
        """A step failed part-way: undo whatever was applied early, as for a skipped step."""
        for impl in self.impls:
            impl.finish(step, None)

    def wait_group(self, name: str):
        return self.by_group[name].wait_group(name)

    def device_source(self, name: str):
        """``name``'s updated master on the GPU for its next load, or None (load from its store)."""
        source = getattr(self.by_group[name], "device_source", None)
        return source(name) if source is not None else None

    def wait_all(self) -> None:
        for impl in self.impls:
            impl.wait_all()

    def close(self) -> None:
        for impl in self.impls:
            impl.close()


def _first_said(sources, hook: str) -> str:
    """The first non-empty answer of ``source.hook()`` among ``sources`` that have the hook ("" if none)."""
    for source in sources:
        why = getattr(source, hook, lambda: "")()
        if why:
            return why
    return ""
