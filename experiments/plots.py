"""Figures for the benchmark sweeps, regenerated from ``<results>/<sweep>/results.csv`` alone.

    python -m experiments.plots [--results runs/<machine>] [--out <results>/plots]
    python -m experiments.plots --results results --out plots     # the committed H200 figures, on purpose

Writes ``<out>/<figure>.png`` and ``.pdf`` for every sweep whose CSV exists (a sweep without a figure
of its own gets the generic one); a CSV whose header does not match the results schema is an error
(exit 2). Failed or skipped points are drawn as a coloured "×" with a short reason, never dropped.
Pieces: ``experiments.schema`` (reading), ``experiments.style`` (look), ``experiments.figures``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .figures import FIGURES, expected_figures, figures_for  # noqa: F401
from .schema import SchemaError as ResultsSchemaError  # noqa: F401
from .schema import load_results, read_results as read_results_csv, report_errors  # noqa: F401
from .style import SWEEPS  # noqa: F401


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
    try:  # the SFT sweep's figure reads its point folders, not only the CSV (experiments/sft_report.py)
        from .sft_report import plot as plot_sft

        paths = plot_sft(results_dir, out_dir, formats)
        written += paths
        if paths:
            log(f"[ok] {', '.join(str(p) for p in paths)}")
    except Exception as e:
        errors.append(f"figure 'accuracy_sft' failed: {type(e).__name__}: {e}")
        log(f"[error] {errors[-1]}")
    if not frames and not errors:
        log(f"[warn] no results CSVs under {results_dir}/<sweep>/results.csv; nothing plotted")
    return written, errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.plots", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", required=True,
                    help="results root holding <sweep>/results.csv (runs/<machine>, or results for the committed ones)")
    ap.add_argument("--out", default=None, help="output folder for PNG and PDF figures (default <results>/plots; "
                    "plots/ for the committed results/)")
    ap.add_argument("--formats", default="png,pdf", help="comma-separated file formats (default png,pdf)")
    args = ap.parse_args(argv)
    out = args.out
    if out is None:
        from .run import plots_dir_for

        out = plots_dir_for(Path(args.results))
    _, errors = make_plots(args.results, out, tuple(f for f in args.formats.split(",") if f))
    return report_errors(errors)


if __name__ == "__main__":
    sys.exit(main())
