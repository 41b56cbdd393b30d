"""The run's time budget (``time_budget_s``): how long the next point may run, and which points not to start.

A point started with too little of the budget left is killed before its timed steps: its device time is
spent and nothing is measured (on node H, 2026-12-07j, a 7B point started with 46 s left after its shape's
other point had taken 68 s). So a point is not started when what is left is less than the shortest point of
the same shape (model, batch, sequence length) that finished in this run took: a smaller shape later in
the sweep may still fit, and a rerun picks the point up (no row is written for it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Budget:
    total_s: float | None  # None: no budget, every point starts with its own timeout
    clock: Callable[[], float] = time.time
    start: float = field(default=0.0)
    took: dict[tuple, float] = field(default_factory=dict)  # shape -> the shortest finished point's seconds

    def __post_init__(self) -> None:
        self.start = self.start or self.clock()

    @staticmethod
    def shape(job) -> tuple:
        return (job.model, job.batch_size, job.seq_len)

    def left(self) -> float | None:
        return None if self.total_s is None else self.total_s - (self.clock() - self.start)

    def why_not_start(self, job) -> str:
        """"" to start the point; else one line why not (the budget is spent, or less of it is left than a
        finished point of its shape took)."""
        left = self.left()
        if left is None:
            return ""
        if left <= 0:
            return f"time_budget_s={self.total_s:g} reached"
        need = self.took.get(self.shape(job))
        if need is not None and left < need:
            return (f"{left:.0f} s of time_budget_s={self.total_s:g} left, less than the {need:.0f} s a finished "
                    f"point of its shape took")
        return ""

    def record(self, job, row: dict) -> None:
        """A finished point's wall time: only a whole ok row counts (a partial row's point was cut short)."""
        try:  # a CSV cell (schema.make_row) or a number
            took = float(row.get("duration_s") or "nan")
        except (TypeError, ValueError):
            return
        if row.get("status") == "ok" and row.get("reason") != "partial" and took == took:  # not NaN
            key = self.shape(job)
            self.took[key] = min(took, self.took.get(key, took))
