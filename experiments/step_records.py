"""A point's timed steps (its ``metrics.jsonl`` records) as row fields: whether a point folder is a row's
own, and the host update's phases (schema v4's ``PHASE_COLUMNS``) as medians over the timed steps.

Read by the point process (``experiments.point_frame.summarize``), by the upgrade of older rows
(``experiments.schema_legacy``) and by the report (``analysis.steady``); imports nothing of the project.
"""
from __future__ import annotations

import math
import statistics

# The v4 columns: the host tier's update per step (MegaTrain's phase timers; other systems have none).
PHASE_COLUMNS = ("cpu_groups", "gpu_path_groups", "host_update_busy_s", "optimizer_exposed_s")

# A point folder is a row's own when its timed steps' median is within this of the row's median (a merged row
# whose folder did not come back sits beside an older run's folder: its steps are not the row's).
FOLDER_MATCH_TOL = 0.005


def folder_is_rows(times: list[float], median_s) -> bool:
    """Whether timed step ``times`` (a point folder's) are the ones a row of median ``median_s`` came from."""
    try:
        want = float(median_s)
    except (TypeError, ValueError):
        return False
    if not times or not math.isfinite(want) or want <= 0:
        return False
    return abs(statistics.median(times) - want) <= FOLDER_MATCH_TOL * want


def row_phases(timed: list[dict]) -> dict:
    """The v4 columns (``PHASE_COLUMNS``) of a point: the median over its timed steps' records (metrics.jsonl
    lines) of each key in their ``phases``, where every timed step has it (MegaTrain's; other systems none)."""
    out = {}
    for k in PHASE_COLUMNS:
        vals = [(r.get("phases") or {}).get(k) for r in timed]
        if vals and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[k] = float(statistics.median(vals))
    return out
