"""Per step of a MegaTrain point with update_path="hybrid": which split ran, how busy each path was, and what
the runtime chooser (megatrain/split_chooser.py ``SplitChooser``) decided next.

    python scripts/split_trace.py results/update_path_hedge/<point>/metrics.jsonl [...]

Columns: step (w = warm-up), step time, CPU-path and GPU-path groups routed, the CPU kernel's and the GPU path's
busy seconds (of the update that ran during this step: the previous step's), the exposed optimizer, the GPU-path
groups of the split this step's time measured (c: its update was a cold start, kept apart by the chooser),
the decision and the GPU-path groups the next step routes.
Exits 1 when a file holds no step (nothing measured)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.split_chooser import DECISIONS  # noqa: E402

HEADER = "step  time_s  cpu gpu  cpu_busy gpu_busy exposed  measured  decision -> next  (c: a cold start)"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def trace(lines) -> list[str]:
    """The table's rows for the metrics.jsonl lines ``lines``."""
    out = []
    for line in lines:
        if not line.strip():
            continue
        r = json.loads(line)
        p = r.get("phases", {})
        decision = p.get("split_decision")
        what = "-" if decision is None else DECISIONS.get(int(decision), f"decision {int(decision)}")
        measured = p.get("split_measured_gpu_groups")
        cold = "c" if p.get("split_measured_cold") else " "  # a cold start: kept apart by the chooser (rule 0)
        out.append(f"{r['step']:>3}{'w' if r.get('warmup') else ' '} {_num(r.get('step_time_s'), '7.3f')} "
                   f"{_num(p.get('cpu_groups'), '3.0f')} {_num(p.get('gpu_path_groups'), '3.0f')}  "
                   f"{_num(p.get('host_update_busy_s'), '8.3f')} {_num(p.get('gpu_path_busy_s'), '8.3f')} "
                   f"{_num(p.get('optimizer_exposed_s'), '7.3f')}  {_num(measured, '8.0f')}{cold} {what} -> "
                   f"{_num(p.get('split_next_gpu_groups'), '.0f')}")
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    status = 0
    for name in argv:
        rows = trace(Path(name).read_text().splitlines())
        print(f"{name}\n{HEADER}")
        print("\n".join(rows) if rows else "(no step)")
        status |= not rows
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
