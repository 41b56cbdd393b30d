"""Is a row's median step time a steady-state number?

A point that times only a few steps can still be speeding up: DeepSpeed ZeRO-3's first steps run 1.5-2×
slower than its steady state (results/size: 4.11 s then 2.51 s at the 3B shape). Its median then overstates
the step time, and a ratio against it overstates the other system's lead. This reads the timed steps of each
ok row from its own point folder (``<results>/<sweep>/<point>/metrics.jsonl``, ``warmup`` false; ``row_folder``
says whether the folder is the row's own) and flags the
row when its step times are still falling:

    unsteady  <=>  at least 2 timed steps  and  last timed step < (1 - FALL_TOL) x first timed step

The flag is a column (``steady_note``: "" or e.g. "4.11 -> 2.51 s over 2 timed steps") that the report
marks with a dagger; no number is changed.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pandas as pd

from experiments.step_records import folder_is_rows

FALL_TOL = 0.15   # a fall of more than 15 % from the first to the last timed step is not noise
DAGGER = "†"


def timed_records(point_dir: Path) -> list[dict]:
    """The timed (non-warm-up) lines of ``point_dir/metrics.jsonl``, in order; [] when the file is missing
    or unreadable. Read once per version of the file (the report asks twice: here and analysis.phases)."""
    path = Path(point_dir) / "metrics.jsonl"
    try:
        st = path.stat()
    except OSError:
        return []
    return _read_timed(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4096)
def _read_timed(path: str, mtime_ns: int, size: int) -> list[dict]:  # (mtime, size): a rewritten file is re-read
    try:
        recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
    return [r for r in recs if isinstance(r, dict) and not r.get("warmup")]


def timed_step_times(point_dir: Path) -> list[float]:
    """Step times (s) of the timed steps in ``point_dir/metrics.jsonl``, in order."""
    return [float(r["step_time_s"]) for r in timed_records(point_dir) if r.get("step_time_s") is not None]



def row_folder(results_dir, sweep: str, row) -> Path | None:
    """The point folder of ``row`` when its timed steps are the ones the row was computed from, else None.

    A row merged from a device call whose point folder did not come back (at most 8 files return) sits beside
    the folder of an older run of the same point; that folder's steps belong to the older row, so readers
    (the steady check, the phase table) must not attach them to the newer one. The row's
    ``step_time_median_s`` is the median of its folder's timed steps, so a mismatch shows the folder is stale."""
    point_dir = Path(results_dir) / sweep / str(row["point"])
    return point_dir if folder_is_rows(timed_step_times(point_dir), row.get("step_time_median_s")) else None


def falling_note(times: list[float], tol: float = FALL_TOL) -> str:
    """"" when ``times`` look steady (or are too few to tell), else "first -> last s over n timed steps"."""
    if len(times) < 2 or times[0] <= 0 or times[-1] >= (1.0 - tol) * times[0]:
        return ""
    return f"{times[0]:.2f} -> {times[-1]:.2f} s over {len(times)} timed steps"


def mark_unsteady(results_dir, sweep: str, df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with a ``steady_note`` column (see module docstring) for each ok row of ``sweep``."""
    df = df.copy()
    notes = []
    for _, r in df.iterrows():
        folder = row_folder(results_dir, sweep, r) if r["status"] == "ok" else None
        notes.append(falling_note(timed_step_times(folder)) if folder is not None else "")
    df["steady_note"] = notes
    return df


def unsteady_rows(frames: dict) -> list[tuple[str, pd.Series]]:
    """(sweep, row) of every flagged row in ``frames`` (frames already passed through ``mark_unsteady``)."""
    out = []
    for sweep, df in frames.items():
        if "steady_note" not in df:
            continue
        out += [(sweep, r) for _, r in df[df["steady_note"].astype(bool)].iterrows()]
    return out
