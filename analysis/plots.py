"""Figures for the benchmark sweeps, regenerated from ``<results>/<sweep>/results.csv`` alone.

    python -m analysis.plots [--results runs/<machine>] [--out <results>/plots]
    python -m analysis.plots --results results --out plots     # the committed H200 figures, on purpose

Writes ``<out>/<figure>.png`` and ``.pdf`` for every sweep whose CSV exists (a sweep without a figure
of its own gets the generic one); a CSV whose header does not match the results schema is an error
(exit 2). Failed or skipped points are drawn as a coloured "×" with a short reason, never dropped.
Pieces: ``experiments.schema`` (reading), ``analysis.style`` (look), ``analysis.figures``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .figures import FIGURES, expected_figures, figures_for  # noqa: F401
from experiments.schema import SchemaError as ResultsSchemaError  # noqa: F401
from experiments.schema import load_results, read_results as read_results_csv, report_errors  # noqa: F401
from .style import SWEEPS  # noqa: F401


REPO_ROOT = Path(__file__).resolve().parents[1]


def plots_dir_for(results: Path) -> Path:
    """Figures of a results folder: the committed results/ -> plots/ (beside it); any other -> inside."""
    results = Path(results).resolve()
    return results.parent / "plots" if results == (REPO_ROOT / "results").resolve() else results / "plots"


def make_plots(results_dir, out_dir, formats=("png", "pdf"), log=print) -> tuple[list[Path], list[str]]:
    """Draw every figure whose sweep CSV exists. Returns (written paths, errors)."""
    frames, errors = load_results(results_dir, log=log)
    out_dir = Path(out_dir)
    written = []
    for sweep in frames:
        for name, fn in figures_for(sweep):
            try:
                paths = fn(frames[sweep], out_dir, formats)
            except Exception as e:  # one broken figure should not hide the others
                msg = f"figure '{name}' ({sweep}) failed: {type(e).__name__}: {e}"
                log(f"[error] {msg}")
                errors.append(msg)
                continue
            written += paths
            log(f"[ok] {', '.join(str(p) for p in paths)}")
    try:  # the SFT sweep's figure reads its point folders, not only the CSV (analysis/sft_report.py)
        from .sft_report import plot as plot_sft, sweeps as sft_sweeps

        for sweep in sft_sweeps(results_dir):  # one figure per machine's SFT rows
            paths = plot_sft(results_dir, out_dir, formats, sweep=sweep)
            written += paths
            if paths:
                log(f"[ok] {', '.join(str(p) for p in paths)}")
    except Exception as e:
        errors.append(f"figure 'accuracy_sft' failed: {type(e).__name__}: {e}")
        log(f"[error] {errors[-1]}")
    for jsonl in sorted(Path(results_dir).glob("accuracy_parity*/accuracy_parity.jsonl")):  # one per machine
        try:
            from .accuracy import plot_accuracy

            paths = plot_accuracy(jsonl, out_dir / f"{jsonl.parent.name}.png")
            written += paths
            log(f"[ok] {', '.join(str(p) for p in paths)}")
        except Exception as e:
            errors.append(f"figure '{jsonl.parent.name}' failed: {type(e).__name__}: {e}")
            log(f"[error] {errors[-1]}")
    if not frames and not errors:
        log(f"[warn] no results CSVs under {results_dir}/<sweep>/results.csv; nothing plotted")
    return written, errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.plots", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", required=True,
                    help="results root holding <sweep>/results.csv (runs/<machine>, or results for the committed ones)")
    ap.add_argument("--out", default=None, help="output folder for PNG and PDF figures (default <results>/plots; "
                    "plots/ for the committed results/)")
    ap.add_argument("--formats", default="png,pdf", help="comma-separated file formats (default png,pdf)")
    args = ap.parse_args(argv)
    out = args.out
    if out is None:
        out = plots_dir_for(Path(args.results))
    _, errors = make_plots(args.results, out, tuple(f for f in args.formats.split(",") if f))
    return report_errors(errors)


if __name__ == "__main__":
    sys.exit(main())
