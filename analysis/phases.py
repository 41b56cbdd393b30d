"""Where MegaTrain's step time went, from the engine's phase timers.

The point process writes ``MegaTrain.stats`` into every ``metrics.jsonl`` line as ``phases``
(experiments/point.py). The phases are host wall time between the marks in ``MegaTrain.step``
(megatrain/engine.py, ``_Timer``): on CUDA each is its launches plus whatever blocked the host inside it
(a slot load waiting for the host AdamW, slab back-pressure), and the last one, ``optimizer_launch_s``,
ends at the step's only full sync, so

    forward_s + loss_s + backward_s + grad_norm_s + optimizer_launch_s = step time (host side)

``optimizer_exposed_s`` is the part of the step spent waiting for the host-tier AdamW (not hidden under
the backward); ``host_update_busy_s`` is the AdamW worker's own busy time in the step;
``gpu_load_wait_s`` is GPU time, not host time: how long the compute stream stalled waiting for layer
loads (timing events around each wait, megatrain/streams.py ``WaitTimer``). A phase much longer than its
compute with a small GPU wait means the GPU waited for the host's launches instead. This module takes
the median of each over a row's timed steps; the report prints them for every ok row whose own point
folder has them (not an older run's folder left beside a row merged without one: ``steady.row_folder``).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from .steady import row_folder, timed_records

SPLIT = ("forward_s", "loss_s", "backward_s", "grad_norm_s", "optimizer_launch_s")  # sums to the step
EXTRA = ("optimizer_exposed_s", "host_update_busy_s", "gpu_load_wait_s")              # inside the split
LABELS = {"forward_s": "forward", "loss_s": "loss", "backward_s": "backward", "grad_norm_s": "grad norm",
          "optimizer_launch_s": "optimizer tail", "optimizer_exposed_s": "host AdamW exposed",
          "host_update_busy_s": "host AdamW busy", "gpu_load_wait_s": "GPU waited for loads"}


def phase_medians(point_dir: Path) -> dict[str, float]:
    """{phase: median seconds over the timed steps} for the phases of SPLIT + EXTRA that every timed step
    recorded, plus ``step_s`` (median step time); {} when the steps carry no phases."""
    recs = [r for r in timed_records(point_dir) if isinstance(r.get("phases"), dict)]
    if not recs:
        return {}
    out = {"step_s": float(pd.Series([r["step_time_s"] for r in recs]).median())}
    for k in SPLIT + EXTRA:
        vals = [r["phases"].get(k) for r in recs]
        if all(v is not None for v in vals):
            out[k] = float(pd.Series(vals).median())
    return out


def report_lines(results_dir, frames: dict) -> list[str]:
    """A "Where the step time went" section: one line per ok row with phase timers, seconds and % of the
    step; [] when no row has them (rows measured before the timers were recorded)."""
    body = []
    for sweep, df in frames.items():
        for _, r in df[df["status"] == "ok"].iterrows():
            folder = row_folder(results_dir, sweep, r)  # None: the folder holds another run's steps
            ph = phase_medians(folder) if folder is not None else {}
            if not ph:
                continue
            step = ph["step_s"]
            cells = [f"{ph[k]:.2f} ({ph[k] / step:.0%})" if k in ph and step > 0 else "—" for k in SPLIT + EXTRA]
            body.append([sweep, str(r["point"]), f"{step:.2f}"] + cells)
    if not body:
        return []
    header = ["sweep", "point", "step (s)"] + [LABELS[k] + " (s)" for k in SPLIT + EXTRA]
    lines = ["## Where MegaTrain's step time went", "",
             "Medians over the timed steps of the engine's phase timers (host wall time between the marks in "
             "`MegaTrain.step`; the five phases from forward to optimizer tail add up to the step). *host AdamW "
             "exposed* is the time the step waited for the host-tier optimizer, i.e. what the backward did not "
             "hide; *host AdamW busy* is the optimizer worker's own time in the step; *GPU waited for loads* is GPU "
             "time the compute stream stalled on layer loads (— in rows measured before this timer) "
             "(`experiments/phases.py`).",
             "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return lines + [""]
