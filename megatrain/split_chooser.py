"""The runtime split: which host-tier groups a step that waits for the norm gives the GPU update path,
decided from measured step times (``SplitChooser``). The bandwidth model (megatrain/update_split.py) proposes
splits; the steps' measured times decide between them, and each decision is a number in the step's phases
(``split_decision``, named in ``DECISIONS``; scripts/split_trace.py prints them).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field

from .update_split import Split

# Why the runtime split is what it is (``SplitChooser``; also a number in each step's phases, ``split_decision``).
(KEEP_FASTEST, KEEP_MEASURING, TRY_CPU_ONLY, TRY_PROPOSAL, SWITCH_FASTER, KEEP_WITHIN_MARGIN, RETRY_CLOSE,
 WARM_UP) = range(8)
DECISIONS = {KEEP_FASTEST: "kept: measured fastest", KEEP_MEASURING: "kept: nothing measured yet",
             TRY_CPU_ONLY: "measuring the CPU path alone once", TRY_PROPOSAL: "trying the model's proposal once",
             SWITCH_FASTER: "switched: measured faster", KEEP_WITHIN_MARGIN: "kept: the fastest is within the margin",
             RETRY_CLOSE: "measuring a close runner-up again",
             WARM_UP: "kept one more step: its first uploads kept masters (measured warm next)"}


@dataclass
class SplitChooser:
    """The split a step that waits for the norm uses, decided from measured step times, not from the model
    alone (the model proposes; measurements decide).

    ``record(split, step_s)`` after each step whose time measures one update (the update of the step before,
    which runs during this one's forward: its waits for the CPU path and its loads behind the GPU path's
    copies are in this step's time); ``choose(current, proposal, predict)`` then gives the next step's split.
    The rules, in order (each chosen split carries its rule in ``reason``; ``history`` keeps the changes):

    0. First: a split that ran once and whose update uploads kept fp32 masters (``cold``: groups whose
       kept master is not the master of record yet, its first step on the GPU path or its first after leaving
       it) runs one more step, and the chooser is given its time from that warm step: a cold step's time
       (``record(..., cold=True)``, kept in ``cold`` apart) is not the split's (H100, 7B pure streaming,
       16 GiB staging, 2026-12-07f: cold split steps 2.37-2.40 s, warm ones 2.03-2.06; on another node the
       only split steps measured were cold, 2.07-2.11 s against the CPU path alone's 2.01-2.04, and the
       chooser kept the CPU path alone).
    1. Nothing measured yet: keep the current split.
    2. While no split that ran is still waiting for its measurement (one trial at a time):
       a. the CPU path alone, once, if it was never measured (the model may be wrong about either path);
       b. a split that lost on fewer than ``window`` steps by less than ``doubt`` of the fastest's time, once
          more (at most ``retrials`` in all): one slow step (a host-update busy 20 % over its median is seen
          from time to time on the H100 hosts) must not rule out a path for the rest of the run; but not a
          split that lost by more than ``margin`` on two steps already (a steady loss, not one slow step: on
          the H100 at 7B each re-measurement of a runner-up also made the return to the fastest a cold step,
          two steps lost each time, 2026-12-07g);
       c. the model's proposal (planned at rates calibrated on the splits that ran), once, when it differs from
          every measured split and the model, at those same rates, predicts it faster than the fastest
          measured split by more than ``margin`` of that split's step time (at most ``trials`` of them), and
          no measured split between the fastest and it lost (``beyond_a_loss``).
    3. Otherwise the fastest measured split (median of its last ``window`` times), but the current one stays
       while it is within ``margin`` of that (hysteresis: noise does not move the split back and forth).

    So the step is never kept on a split slower than one measured faster, and each trial costs at most one
    step (two where its first is cold). (Found on the H200, 14B 16x1024, clipping firing: the rates re-fitted
    from the GPU path's busy time moved all 11 GPU-path groups back to the CPU kernel and the step went from
    4.73 to 5.16 s.)"""

    names: list[str]
    margin: float = 0.02  # of a step's time: the 14B H200 gap was 8 %, step-to-step noise ~1 %
    window: int = 3
    trials: int = 3  # model proposals tried at most (the CPU-only trial is not counted)
    doubt: float = 0.08  # a loss by less than this, on fewer than `window` steps, is measured again (rule 2b).
    # H100, 3B pure streaming (ac36502): the CPU path alone's one trial step took 1.432 s (host update busy 0.82 s)
    # against the split's 1.352; CPU-only runs of that shape took 1.27-1.35 s. The H200 14B loss (8.2 %) is beyond.
    retrials: int = 4  # re-measurements at most (rule 2b), so a close pair costs at most this many steps
    warmups: int = 8  # rule 0 at most this many times (a split that stays cold is then measured as it is)
    measured: dict = field(default_factory=dict)  # split key -> step times measured with it
    cold: dict = field(default_factory=dict)  # split key -> times of its cold steps (not compared, rule 0)
    splits: dict = field(default_factory=dict)  # split key -> the Split
    pending: list = field(default_factory=list)  # keys of splits that ran, in order, whose time is not in yet
    history: list = field(default_factory=list)  # (step, GPU-path groups, decision, reason) when the split changed
    last_decision: int = KEEP_MEASURING

    def cpu_only(self) -> Split:
        return Split([], list(self.names), reason="CPU path alone")

    def ran(self, split: Split) -> None:
        """``split`` was routed in a step: its time arrives with the next step's (``record``)."""
        self.splits.setdefault(split.key, split)
        self.pending.append(split.key)

    def record(self, key: tuple, step_s: float | None, cold: bool = False) -> None:
        """The step time that measured the update routed with ``key`` (None: not comparable, e.g. a speculative
        or skipped step: the trial is dropped, not counted; ``cold``: that update uploaded kept masters, rule 0:
        kept apart)."""
        if key in self.pending:
            self.pending.remove(key)
        if step_s is not None and math.isfinite(step_s) and step_s > 0:
            (self.cold if cold else self.measured).setdefault(key, []).append(step_s)

    def time(self, key: tuple) -> float:
        return statistics.median(self.measured[key][-self.window:])

    def choose(self, step: int, current: Split, proposal: Split, predict, cold=None) -> Split:
        """The next step's split. ``predict(split)``: the model's update time of a split at the current
        (calibrated) rates; ``cold(split)``: whether its update, routed now, uploads kept masters (rule 0)."""
        self.splits.setdefault(proposal.key, proposal)
        if (cold is not None and self.warmups > 0 and self.pending.count(current.key) == 1
                and current.key not in self.measured and cold(current)):
            # (0) This step's routing is a cold start: one more step with it, so its next time is a warm one.
            self.warmups -= 1
            decision, chosen, why = WARM_UP, current, f"{len(current.gpu)} GPU-path groups"
        else:
            decision, chosen, why = self._decide(current, proposal, predict)
        self.last_decision = decision
        chosen = dataclasses.replace(chosen, reason=f"{DECISIONS[decision]}: {why}")
        if chosen.key != current.key:
            self.history.append((step, len(chosen.gpu), decision, why))
        return chosen

    def _decide(self, current: Split, proposal: Split, predict) -> tuple[int, Split, str]:
        if not self.measured:
            # (1) Nothing to compare yet: the first update's time arrives with the step after it.
            return KEEP_MEASURING, current, "no step time measured yet"
        unmeasured_pending = [k for k in self.pending if k not in self.measured]
        best = min(self.measured, key=self.time)
        t_best = self.time(best)
        if not unmeasured_pending:
            cpu = self.cpu_only()
            if cpu.key not in self.measured and current.key != cpu.key:
                # (2a) The CPU path alone is always a candidate: measure it once rather than trust the model.
                return TRY_CPU_ONLY, cpu, (f"{len(self.splits[best].gpu)} GPU-path groups measured "
                                           f"{t_best:.3f} s a step")
            key = self._close_runner_up(best, current.key)
            if key is not None:
                # (2b) A close loss on few steps may be one slow step: measure that split once more.
                self.retrials -= 1
                return RETRY_CLOSE, self.splits[key], (
                    f"{len(key)} GPU-path groups measured {self.time(key):.3f} s in {len(self.measured[key])} "
                    f"step(s), within {self.doubt:.0%} of {len(self.splits[best].gpu)} at {t_best:.3f} s")
            gain = predict(self.splits[best]) - predict(proposal)
            if (proposal.key not in self.measured and self.trials > 0
                    and gain > self.margin * t_best and self.beyond_a_loss(proposal, best) is None):
                # (2c) The model, calibrated on what ran, predicts a clear gain over the fastest measured split.
                self.trials -= 1
                return TRY_PROPOSAL, proposal, (f"{len(proposal.gpu)} GPU-path groups predicted {gain:.3f} s "
                                                f"faster than {len(self.splits[best].gpu)} measured "
                                                f"{t_best:.3f} s")
        if best == current.key:
            return KEEP_FASTEST, current, f"{len(current.gpu)} GPU-path groups, {t_best:.3f} s a step"
        if current.key in self.measured and t_best >= self.time(current.key) * (1 - self.margin):
            # (3) Within the margin of the fastest: stay (a switch costs nothing, but chasing noise would).
            return KEEP_WITHIN_MARGIN, current, (f"{len(current.gpu)} GPU-path groups {self.time(current.key):.3f} "
                                                 f"s vs {len(self.splits[best].gpu)} {t_best:.3f} s")
        # (3) The fastest measured split (also when the current one was a trial whose time is not in yet).
        was = f"{self.time(current.key):.3f} s" if current.key in self.measured else "not measured yet"
        return SWITCH_FASTER, self.splits[best], (f"{len(self.splits[best].gpu)} GPU-path groups "
                                                  f"{t_best:.3f} s vs {len(current.gpu)} {was}")

    def _close_runner_up(self, best: tuple, current: tuple, ahead: bool = False) -> tuple | None:
        """A split to measure again by rule 2b (neither the fastest ``best`` nor the ``current`` one), or None.
        ``ahead``: whether one may be, once the times still to come are in (each pending run counts as one more
        measured step, whatever its time)."""
        if self.retrials <= 0:
            return None
        t_best = self.time(best)
        for key, times in self.measured.items():
            n = len(times) + (self.pending.count(key) if ahead else 0)
            losses = sum(t > t_best * (1 + self.margin) for t in times)
            if (key != best and key != current and (ahead or key not in self.pending) and n < self.window
                    and losses < 2 and self.time(key) <= t_best * (1 + self.doubt)):
                return key
        return None

    def beyond_a_loss(self, proposal: Split, best: tuple) -> tuple | None:
        """A measured split that lost to the fastest ``best`` by more than ``margin`` and lies between it and
        ``proposal`` in GPU-path groups (its count on the proposal's side of best's, up to the proposal's own),
        or None. The step time over the number of GPU-path groups has one minimum (the CPU path shrinks as the
        GPU path grows), so a proposal past a clear loss is slower still: it is not tried, whatever the model
        predicts (a loss within the margin is a tie, no evidence of a slope). (H100,
        Qwen2.5-7B streaming, bf16 link, clipping firing: CPU alone 3.14-3.32 s a step, 13 GPU-path groups 3.22-
        3.36, then the calibrated model proposed 18, 22 and 24, measured 3.52, 3.58 and 3.69 s, one trial step
        each inside the timed window.)"""
        g_best, g_new = len(best), len(proposal.gpu)
        t_best = self.time(best)
        for key in self.measured:
            g = len(key)
            if (key != best and (g_best < g <= g_new or g_new <= g < g_best)
                    and self.time(key) > t_best * (1 + self.margin)):
                return key
        return None

    def choosing(self) -> str:
        """Why the split is still being chosen ("" when it is not): the next step runs a trial, a split's
        time is still to come, or a switch back to the fastest comes between re-measurements of a close
        runner-up (rule 2b). A benchmark's warm-up can wait for this (experiments' ``settle_steps``); a later
        proposal (rule 2c, at most ``trials``) can still start a trial."""
        if self.pending and not self.measured:
            return "runtime split: no step time measured yet"
        if any(k not in self.measured for k in self.pending):
            return "runtime split: a trial's step time is still to come"
        if self.last_decision in (TRY_CPU_ONLY, TRY_PROPOSAL, RETRY_CLOSE, WARM_UP):
            return f"runtime split: the next step is a trial ({DECISIONS[self.last_decision]})"
        if self.measured and self.last_decision == SWITCH_FASTER:
            best = min(self.measured, key=self.time)
            if self._close_runner_up(best, best, ahead=True) is not None:
                # A switch back to the fastest between two re-measurements of a close runner-up (rule 2b): the
                # next decision may measure it again. (H100, 7B pure streaming 8x1024, 2026-12-07g: 20 GPU-path
                # groups 1.91-1.93 s warm, 17 groups re-measured twice and the returns to 20 cold; the warm-up
                # ended at such a switch, so four of the timed steps alternated: median 2.015 s.)
                return "runtime split: a close runner-up may be measured again after this switch"
        return ""

    def describe(self) -> str:
        """The measured splits and the changes, for the summary line."""
        times = ", ".join(f"{len(k)} GPU-path groups {self.time(k):.3f} s ({len(v)} steps)"
                          for k, v in self.measured.items())
        changes = "; ".join(f"after step {s}: {g} GPU-path groups ({DECISIONS[d]}: {why})"
                            for s, g, d, why in self.history)
        return f"measured step times: {times or 'none yet'}; changes: {changes or 'none'}"
