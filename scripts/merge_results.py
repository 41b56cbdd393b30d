"""Bring a sweep folder measured elsewhere (a device call's /tmp/rN/<sweep>/) into results/<sweep>/.

    python scripts/merge_results.py /tmp/r2/update_path results/update_path [--replace]

Appends the new CSV rows (after upgrading an older committed CSV to the current row schema, so the header
matches), copies the point folders and appends runs.jsonl. A point folder that already exists is refused
(exit 2), unless ``--replace``: then the newer folder replaces it and both CSV rows stay (readers keep the
last row per point; the older row remains as history). Refuses rows measured on another hardware than the
committed ones (a run on one machine never overwrites another's results). A timeout row whose point folder
shows that most of its timed steps finished becomes the partial row the runner writes today
(``experiments.launch.salvage_partial``): nothing measured is lost. Only a point's last row is salvaged: its
folder holds the last run, so an earlier timeout row that a rerun then finished stays a timeout.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.launch import salvage_partial  # noqa: E402
from experiments.schema import COLUMNS, read_records, upgrade_csv, append_row  # noqa: E402


def merge(src: Path, dst: Path, replace: bool = False) -> int:
    """Merge ``src`` into ``dst``; returns the number of rows appended."""
    new = read_records(src / "results.csv")
    if not new:
        raise SystemExit(f"{src}/results.csv has no rows: nothing measured, nothing merged")
    old = read_records(dst / "results.csv") if (dst / "results.csv").exists() else []
    hw_old = {r["hardware"] for r in old}
    hw_new = {r["hardware"] for r in new}
    if old and not hw_new <= hw_old:
        raise SystemExit(f"{src} holds rows of {sorted(hw_new)}, {dst} of {sorted(hw_old)}: "
                         "results of another machine go to their own folder")
    points = [p for p in src.iterdir() if p.is_dir()]
    clash = [p.name for p in points if (dst / p.name).exists()]
    if clash and not replace:
        raise SystemExit(f"point folders already in {dst}: {', '.join(clash)} (--replace keeps the newer)")
    # --replace removes only what the runner wrote: a point folder (it holds job.json or result.json)
    foreign = [c for c in clash if not any((dst / c / f).is_file() for f in ("job.json", "result.json"))]
    if foreign:
        raise SystemExit(f"{dst}: {', '.join(foreign)} not a point folder (no job.json / result.json): not replaced")
    dst.mkdir(parents=True, exist_ok=True)
    if (dst / "results.csv").exists():
        upgrade_csv(dst / "results.csv")
    for p in points:
        if (dst / p.name).exists():
            shutil.rmtree(dst / p.name)
        shutil.copytree(p, dst / p.name)
    # a point folder holds the last run of its point: an earlier row of the same point (a timeout that a
    # rerun in the same folder then finished) is history, never salvaged from the rerun's steps
    last = {row["point"]: i for i, row in enumerate(new)}
    for i, row in enumerate(new):
        partial = salvage_partial(row, src / row["point"]) if last[row["point"]] == i else None
        if partial is not None:
            print(f"{row['point']}: {partial['error']}")
            row = partial
        append_row(dst / "results.csv", {c: row[c] for c in COLUMNS})
    if (src / "runs.jsonl").exists():
        with (dst / "runs.jsonl").open("a") as f:
            f.write((src / "runs.jsonl").read_text())
    if not (dst / "README.md").exists() and (src / "README.md").exists():
        shutil.copy(src / "README.md", dst / "README.md")
    return len(new)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--replace", action="store_true", help="a newer point folder replaces the committed one")
    args = ap.parse_args(argv)
    try:
        n = merge(args.src, args.dst, args.replace)
    except SystemExit as e:
        print(f"merge_results: {e}", file=sys.stderr)
        return 2
    print(f"{n} row(s) of {args.src} merged into {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
