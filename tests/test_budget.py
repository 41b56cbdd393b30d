"""experiments/budget.py: the run's time budget decides which points start, on a clock the test moves."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.budget import Budget  # noqa: E402


def _job(model="qwen2.5-7b", batch=8, seq=1024):
    return SimpleNamespace(model=model, batch_size=batch, seq_len=seq)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_no_budget_starts_everything():
    b = Budget(None)
    assert b.left() is None and b.why_not_start(_job()) == ""


def test_a_point_is_not_started_with_less_left_than_its_shape_took():
    clock = Clock()
    b = Budget(200.0, clock=clock)
    seven, three = _job(), _job("qwen2.5-3b", 16)
    assert b.why_not_start(seven) == ""  # nothing finished yet: no shape has a duration
    clock.t += 100
    b.record(seven, {"status": "ok", "reason": "", "duration_s": "68.2"})  # a CSV cell
    b.record(seven, {"status": "ok", "reason": "", "duration_s": 101.0})  # the shortest one counts
    assert b.took[Budget.shape(seven)] == 68.2
    clock.t += 60  # 40 s left
    why = b.why_not_start(seven)
    assert why.startswith("40 s of time_budget_s=200 left") and "68 s a finished" in why
    assert b.why_not_start(three) == ""  # another shape: no duration known, it may start
    assert b.why_not_start(_job(batch=16)) == ""  # batch is part of the shape
    clock.t += 40
    assert b.why_not_start(three) == "time_budget_s=200 reached" and b.left() == 0


def test_cut_or_failed_points_give_no_duration():
    b = Budget(100.0, clock=Clock())
    for row in ({"status": "ok", "reason": "partial", "duration_s": "5"},  # cut short: not what the shape needs
                {"status": "timeout", "reason": "budget_cut", "duration_s": "5"},
                {"status": "error", "reason": "", "duration_s": "5"},
                {"status": "ok", "reason": "", "duration_s": ""}):
        b.record(_job(), row)
    assert b.took == {}
