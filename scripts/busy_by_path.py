"""The host update's speed per process: for each MegaTrain point, the CPU kernel's busy time and the step time
in the steps where the GPU update path took no group, and in those where it took some, beside the page-locked
host memory of that process (the question of EngineConfig.pin_host_state: is the CPU kernel faster where more
of the host state is page-locked?).

    python scripts/busy_by_path.py results/update_path_814484a_h100_d [results/... | <point folder> ...]

Columns: point (model, variant), TFLOPS of the row, page-locked GiB (the row's host_pinned: the store's, the
gradient buffers' and, since 2026-12-07c, the GPU path's own), then for "CPU only" and "split" steps the median
CPU-kernel busy seconds, the median step seconds and how many steps, classed by the routing of the update that
ran in the step (the step before's: see ``summarise``; speculative steps, whose CPU path runs inside the step,
are left out, as is the step after one). Exits 1 when no folder holds a point with steps."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HEADER = (f"{'point':52} {'TFLOPS':>7} {'locked GiB':>10}   {'CPU only: busy / step (n)':>26}   "
          f"{'split: busy / step (n)':>23}")


def points(paths: list[Path]) -> list[Path]:
    """Point folders (holding metrics.jsonl) given or inside the given sweep folders, sorted."""
    out = []
    for p in paths:
        out += [p] if (p / "metrics.jsonl").exists() else sorted(q.parent for q in p.glob("*/metrics.jsonl"))
    return out


def summarise(point: Path) -> dict | None:
    """One point's numbers (None when it has no step after the first).

    A step's ``host_update_busy_s`` measures the update routed in the step before: the host tier's update runs
    after its step's norm, during the next step's forward (``cpu_groups`` / ``gpu_path_groups`` count the groups
    routed in the step's own backward). So step N's busy and step time go with step N-1's routing, as the
    engine's own calibration pairs them (megatrain/host_tier.py ``_calibrate``). Until 2026-12-07d this script
    paired them with step N's routing: a lone CPU-only trial step then showed the busy of a split update (the
    "CPU-only steps as fast as split ones" of results/update_path_pinning_h100_2026-12-07.md, an artefact)."""
    steps = [json.loads(x) for x in (point / "metrics.jsonl").read_text().splitlines() if x.strip()]
    kinds: dict[str, list[tuple[float, float]]] = {"cpu": [], "split": []}
    for before, r in zip(steps, steps[1:]):
        ph, routed = r.get("phases", {}), before.get("phases", {})
        if r.get("step") != before.get("step", -2) + 1 or "host_update_busy_s" not in ph:
            continue  # a gap in the record: the step before is not the one whose update ran here
        if ph.get("speculated") or routed.get("speculated"):
            continue  # a speculative step's CPU path runs inside that step, not after its norm
        kind = "split" if routed.get("gpu_path_groups", 0) > 0 else "cpu"
        kinds[kind].append((ph["host_update_busy_s"], r["step_time_s"]))
    if not any(kinds.values()):
        return None
    result = json.loads((point / "result.json").read_text()) if (point / "result.json").exists() else {}
    tflops = (result.get("metrics") or {}).get("tflops")
    pinned = result.get("host_pinned_bytes")
    name = point.name.split("__")
    return {"point": f"{name[1]} {name[6]}" if len(name) > 6 else point.name, "tflops": tflops,
            "locked_gib": pinned / 2**30 if pinned else None,
            **{k: (statistics.median(b for b, _ in v), statistics.median(s for _, s in v), len(v)) if v else None
               for k, v in kinds.items()}}


def _cell(x) -> str:
    return "-" if x is None else f"{x[0]:.2f} / {x[1]:.2f} ({x[2]})"


def main(argv=None) -> int:
    args = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    rows = [r for r in (summarise(p) for p in points(args)) if r is not None]
    if not rows:
        print("no point with steps in " + ", ".join(map(str, args)), file=sys.stderr)
        return 1
    print(HEADER)
    for r in rows:
        tf = "-" if r["tflops"] is None else f"{r['tflops']:.1f}"
        locked = "-" if r["locked_gib"] is None else f"{r['locked_gib']:.1f}"
        print(f"{r['point']:52} {tf:>7} {locked:>10}   {_cell(r['cpu']):>26}   {_cell(r['split']):>23}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
