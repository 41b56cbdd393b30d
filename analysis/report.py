"""Markdown report: our results next to the paper's claims.

    python -m analysis.report [--results results] [--out results/REPORT.md]
                                 [--claims analysis/data/paper_claims.yaml] [--plots plots]

Reads ``<results>/<sweep>/results.csv`` (whichever exist) and the claims file, and writes one
Markdown file: environment, formulas, a claims table (paper value, ours, hardware difference,
verdict; ``analysis.claims``), a table per sweep (systems as rows; a sweep without an axis of its
own gets one column per setup) and the list of failed points. No torch, no matplotlib.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pandas as pd

from baselines.registry import SYSTEMS, record

from .claims import (CLAIMS_PATH, ClaimsError, _all_rows, _hw_long, _hw_short, _pct, _short, evaluate_claim,
                     load_claims, summary_lines)
from . import accuracy, phases, same_run, sft_report, update_path
from .style import H200_PEAK_TFLOPS, HARDWARE_ORDER
from .figures import figures_for
from .steady import DAGGER, FALL_TOL, mark_unsteady, unsteady_rows
from experiments.schema import (known_sweeps, SAMPLE_GPU, SAMPLE_SHA, fill_x_from_point, formula_tflops,
                     load_results, report_errors)
from .style import (PARTIAL, SECTION, TFLOPS_FORMULA, as_compared, fmt_params, fmt_tokens, on_cpu,
                    partial_mark, status_short)

SECTION_TITLES = {
    "size": "Model size (headline numbers)",
    "depth": "Depth (hidden 3584, FFN 18944)",
    "width": "Width",
    "context": "Context length (7B)",
    "hardware": "Other GPUs (our runs: emulated profiles on the H200)",
    "ablation": "Ablation (14B)",
}


def _md_table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in row) + " |" for row in body]
    return lines


def _uniq(series: pd.Series, n: int = 3) -> str:
    vals = [str(v) for v in dict.fromkeys(series.dropna().astype(str)) if v and v != "nan"]
    return ", ".join(vals[:n]) + (f" (+{len(vals) - n} more)" if len(vals) > n else "") if vals else "—"


def _environment(frames: dict, rows: pd.DataFrame) -> list[str]:
    lines = ["## Environment", ""]
    body = []
    for sweep, df in frames.items():
        ok = int((df["status"] == "ok").sum())
        dates = sorted(d for d in df["date"] if d)
        span = (dates[0][:10] + (f" … {dates[-1][:10]}" if dates[-1][:10] != dates[0][:10] else "")) if dates else "—"
        device = "CPU (no GPU)" if on_cpu(df) else _uniq(df["gpu_name"])
        body.append([sweep, str(len(df)), str(ok), str(len(df) - ok), device,
                     _uniq(df["driver"]), _uniq(df["torch_version"]), _uniq(df["transformers_version"]),
                     _uniq(df["deepspeed_version"]), _uniq(df["git_sha"]), _uniq(df["host_ram_gib"].map(
                         lambda v: f"{v:,.0f}" if pd.notna(v) else None)), span])
    lines += _md_table(["sweep", "rows", "ok", "failed", "device", "driver", "torch", "transformers", "deepspeed",
                        "git SHA", "host RAM (GiB)", "date"], body)
    return lines + [""]


def _mixed_runs(rows: pd.DataFrame) -> list[str]:
    shas = rows["git_sha"].replace("", "(empty)")
    counts = shas.value_counts()
    lines = ["## Mixed runs check", ""]
    if len(counts) <= 1:
        lines.append(f"All {len(rows)} rows come from one git SHA ({counts.index[0] if len(counts) else '—'}).")
        return lines + [""]
    main_sha = counts.index[0]
    lines.append(f"**Warning: rows come from {len(counts)} different git SHAs** "
                 f"({', '.join(f'{s}: {n} rows' for s, n in counts.items())}); numbers from different code "
                 f"versions may not be comparable. Rows whose SHA differs from the most common one ({main_sha}):")
    lines.append("")
    diff = rows[shas != main_sha]
    body = [[r["_sweep"], r["point"], r["system"], r["variant"], r["status"], r["git_sha"] or "(empty)",
             r["date"] or "—"] for _, r in diff.head(60).iterrows()]
    lines += _md_table(["sweep", "point", "system", "variant", "status", "git SHA", "date"], body)
    if len(diff) > 60:
        lines.append(f"\n… and {len(diff) - 60} more.")
    return lines + [""]


def _formulas(rows: pd.DataFrame) -> list[str]:
    lines = [
        "## Formulas", "",
        f"- **{TFLOPS_FORMULA}** — P parameters, T tokens per optimizer step, L layers, h hidden size, "
        "s sequence length. Activation recomputation is *not* counted (useful model FLOPs only).",
        f"- **MFU = TFLOPS / peak**, peak = `peak_tflops` column, else the GPU's measured peak (H200: dense bf16 "
        f"{H200_PEAK_TFLOPS} TFLOPS); a GPU without a measured peak (the H100) gets no MFU, never another GPU's.",
        "- tokens/s = tokens per step / median step time (after warm-up steps).",
        "- Host memory = peak RSS of the training process; 12 bytes/param = fp32 master weights + Adam m + v "
        "(the floor for any fp32-Adam offload); the engine's estimate adds gradients, slabs and overhead.",
        "- Ratios (MegaTrain ÷ ZeRO-3, or a point ÷ its reference point) are taken within one sweep on one "
        "machine, so they transfer across hardware better than absolute TFLOPS do.",
    ]
    ok = rows[(rows["status"] == "ok") & rows["tflops"].notna() & rows["step_time_median_s"].notna()]
    if not ok.empty:
        f = formula_tflops(ok)
        rel = ((ok["tflops"] - f).abs() / f).fillna(0)
        bad = ok[rel > 0.01]
        if bad.empty:
            lines.append(f"- Check: the `tflops` column agrees with the formula (±1 %) on all {len(ok)} ok rows.")
        else:
            lines.append(f"- **Check: `tflops` differs from the formula by >1 % on {len(bad)} of {len(ok)} ok rows** "
                         f"(e.g. {', '.join(f'{r[0]}/{r[1]}/{r[2]}' for r in bad[['_sweep', 'point', 'system']].head(5).values)}); "
                         "the harness may count FLOPs differently.")
    return lines + [""]


AXES = {  # sweep -> (column of its x axis, label of a value); a sweep not listed: one column per setup
    "size": ("num_params", fmt_params),
    "depth": ("num_layers", lambda v: f"L{int(v)}"),
    "width": ("width_mult", lambda v: f"{v:g}×"),
    "context": ("seq_len", fmt_tokens),
    "tokens": ("tokens_per_step", fmt_tokens),
}


def _setup(df: pd.DataFrame) -> pd.Series:
    """'model B×S hardware' of each row: what a system's row is compared within."""
    if df.empty:
        return df["point"]
    return df.apply(lambda r: f"{r['model']} {int(float(r['batch_size']))}×{int(float(r['seq_len']))} "
                    f"{r['hardware']}", axis=1)


def _columns(sweep: str, df: pd.DataFrame) -> tuple[pd.Series, list, callable]:
    """(column key of each row, column order, header label of a key) of a sweep's table."""
    if sweep in AXES:
        col, fmt = AXES[sweep]
        key = fill_x_from_point(df, col)
        return key, sorted(key.dropna().unique()), lambda v: fmt(v) if pd.notna(v) else "?"
    if sweep == "hardware":
        p = fill_x_from_point(df, "num_params")
        key = df["hardware"] + " · " + p.map(lambda v: fmt_params(v) if pd.notna(v) else "?")
        order = list(dict.fromkeys(key.iloc[sorted(range(len(df)), key=lambda i: (p.iloc[i], _hw_order(df["hardware"].iloc[i])))]))
        return key, order, str
    key = _setup(df)
    return key, list(dict.fromkeys(key)), str


def _dagger(r: pd.Series) -> str:
    return DAGGER if r.get("steady_note") else ""


def _fmt_value(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def metric_range(r, metric: str) -> tuple[float, float] | None:
    """(low, high) of ``metric`` over the row's timed steps (slowest, fastest step); None under 2 steps."""
    v, med = r.get(metric), r.get("step_time_median_s")
    slow, fast, n = r.get("step_time_max_s"), r.get("step_time_min_s"), r.get("timed_steps")
    if any(x is None or pd.isna(x) for x in (v, med, slow, fast, n)) or n < 2 or not fast:
        return None
    return float(v) * float(med) / float(slow), float(v) * float(med) / float(fast)


def _overlap(a, b, metric: str) -> bool | None:
    ra, rb = metric_range(a, metric), metric_range(b, metric)
    if ra is None or rb is None:
        return None
    return ra[0] <= rb[1] and rb[0] <= ra[1]


def _cell(r: pd.Series, metric: str, spread: bool = False) -> str:
    if r["status"] == "ok" and pd.notna(r[metric]):
        text = _fmt_value(float(r[metric])) + _dagger(r) + partial_mark(r)
        rng = metric_range(r, metric) if spread else None
        return text + (f" ({_fmt_value(rng[0])}–{_fmt_value(rng[1])})" if rng else "")
    return f"*{status_short(r)}*"


def _ratio_cell(a, b, metric: str) -> str:
    """a ÷ b, or "within noise" when their timed steps' ranges overlap (no ratio the spread cannot support)."""
    over = _overlap(a, b, metric)
    if over:
        return "within noise"
    mark = _dagger(a) or _dagger(b)
    text = f"{float(a[metric]) / float(b[metric]):.2f}×{mark}"
    return text if over is not None else text + " (no spread)"


def _sweep_table(sweep: str, df: pd.DataFrame) -> list[str]:
    """Systems (· variant) as rows, the sweep's axis (or its setups) as columns; the MegaTrain ÷ ZeRO-3
    row where both ran; in a sweep with a "full" variant every other variant's difference to it."""
    cpu = on_cpu(df)
    metric, unit = ("tokens_per_s", "tokens/s") if cpu else ("tflops", "TFLOPS")
    lines = [f"### {sweep}", ""]
    if sweep == "smoke" or cpu:
        lines += ["**Smoke test**: a tiny model on a CPU checks that every system runs end to end; its speeds say "
                  "nothing about the systems at scale. Each cell gives the median and, in brackets, the range over "
                  "the timed steps; a ratio is given only where those ranges do not overlap.", ""]
    df = df.copy()
    df["_sys"] = df["system"].map(lambda s: record(s).label_for("cpu" if cpu else "gpu", short=True))
    df["_r"] = df.apply(lambda r: r["_sys"] + ("" if r["variant"] in ("default", "") else f" · {r['variant']}"), axis=1)
    cols, order_cols, lab = _columns(sweep, df)
    df["_c"] = cols.values
    sys_rank = {s: i for i, s in enumerate(SYSTEMS)}
    variants = list(dict.fromkeys(df["variant"]))
    var_rank = {v: (0 if v == "full" else 1 + i) for i, v in enumerate(variants)}
    row_keys = list(dict.fromkeys(df.sort_values(
        by=["system", "variant"], key=lambda c: c.map(sys_rank) if c.name == "system" else c.map(var_rank),
        kind="stable")["_r"]))
    full = df[(df["variant"] == "full") & (df["status"] == "ok")]
    body = []
    for rk in row_keys:
        line = [rk]
        for ck in order_cols:
            m = df[(df["_r"] == rk) & (df["_c"] == ck)]
            cell = _cell(as_compared(m.iloc[-1], metric), metric, spread=cpu) if not m.empty else ""
            if not m.empty and not record(m.iloc[-1]["system"]).exact_adamw and m.iloc[-1]["status"] == "ok":
                cell += SECTION
            fv = full[full["_c"] == ck]
            if not m.empty and m.iloc[-1]["status"] == "ok" and m.iloc[-1]["variant"] not in ("full", "default") \
                    and len(fv) and fv[metric].iloc[-1] > 0:
                a, f = m.iloc[-1], fv.iloc[-1]
                noise = ", within noise" if _overlap(a, f, metric) else ""
                cell += f" ({_pct(float(a[metric]) / float(f[metric]) - 1)}{noise})"
            line.append(cell)
        body.append(line)
    mt, z3 = (df[(df["system"] == s) & df["variant"].isin(["default", "full"])] for s in ("megatrain", "zero3"))
    if not mt.empty and not z3.empty:
        line = ["**MegaTrain ÷ ZeRO-3**"]
        for ck in order_cols:
            a = mt[(mt["_c"] == ck) & (mt["status"] == "ok")]
            b = z3[(z3["_c"] == ck) & (z3["status"] == "ok")]
            if len(a) and len(b) and b[metric].iloc[-1] > 0:
                line.append(_ratio_cell(a.iloc[-1], b.iloc[-1], metric))
            else:
                line.append("—")
        body.append(line)
    header = ["system" + (" · variant" if any(" · " in k for k in row_keys) else "")] + [lab(c) for c in order_cols]
    lines += _md_table(header, body)
    lines += ["", f"Values: {unit}; *italic* = failed / not run (OOM = GPU out of memory, host OOM = host RAM "
              "exhausted, skip = not attempted, e.g. predicted not to fit)." +
              (" Percentages: difference to the full system." if not full.empty else "") +
              (f" {DAGGER} = not at steady state (step times still falling: see 'Rows not at steady state')."
               if df.get("steady_note", pd.Series(dtype=str)).astype(bool).any() else "") +
              (f" {SECTION} = not exact AdamW (bounded staleness; settings in the row), by its mean step time "
               "(its periodic waits for deferred CPU work fall outside the median)."
               if any(not record(s).exact_adamw for s in df["system"]) else "") +
              (f" {PARTIAL} = the point timed out after finishing most of its timed steps: the value is those "
               "steps' (how many: the row's error)." if (df.get("reason", pd.Series(dtype=str)) == "partial").any()
               else "") +
              (" Measured on a CPU: tokens/s, not TFLOPS." if cpu else "") +
              (" Hardware columns marked with an emulated profile run on the H200 with a capped GPU memory."
               if sweep == "hardware" else ""), ""]
    return lines


def _hw_order(h: str) -> int:
    return HARDWARE_ORDER.index(h) if h in HARDWARE_ORDER else len(HARDWARE_ORDER)


def _unsteady(frames: dict) -> list[str]:
    """The rows whose timed steps were still speeding up (``analysis.steady``)."""
    found = unsteady_rows(frames)
    if not found:
        return []
    lines = ["## Rows not at steady state", "",
             f"Their step times fell by more than {FALL_TOL:.0%} from the first to the last timed step, so the "
             "median overstates the step time (and understates TFLOPS); ratios against them overstate the other "
             f"system's lead. Marked {DAGGER} in the tables; rerun with more `steps` to measure them.", ""]
    body = [[sweep, r["point"], record(r["system"]).label_for(r["hardware"], short=True), r["steady_note"],
             _cell({**r, "steady_note": ""}, "tflops")] for sweep, r in found]
    return lines + _md_table(["sweep", "point", "system", "timed steps", "TFLOPS (median)"], body) + [""]


def _failures(rows: pd.DataFrame) -> list[str]:
    f = rows[rows["status"] != "ok"]
    lines = ["## Failed or skipped points", ""]
    if f.empty:
        return lines + ["None.", ""]
    body = [[r["_sweep"], r["point"], record(r["system"]).label_for(r["hardware"], short=True), r["variant"], r["hardware"],
             r["status"], _short(r["error"] or "", 110) or "—"] for _, r in f.iterrows()]
    return lines + _md_table(["sweep", "point", "system", "variant", "hardware", "status", "error"], body) + [""]


def _figures(plots_dir: Path | None, out: Path, frames: dict) -> list[str]:
    if plots_dir is None:
        return []
    names = [n for s in frames for n, _ in figures_for(s)]
    found = [(n, plots_dir / f"{n}.png") for n in names if (plots_dir / f"{n}.png").exists()]
    if not found:
        return ["## Figures", "", f"No figures under `{plots_dir}` yet; run `python -m analysis.plots`.", ""]
    lines = ["## Figures", ""]
    for n, p in found:
        rel = os.path.relpath(p, out.parent)
        lines.append(f"- [{n}]({rel})")
    return lines + [""]


def _claims_section(claims: dict, rows: pd.DataFrame, tol: float, hw_names: dict) -> list[str]:
    """The paper's claims against these rows. Only GPU rows can speak to a claim: a report whose rows all
    come from a CPU judges none (it says so in one line)."""
    lines = ["## Paper claims vs our results", ""]
    gpu_rows = rows[rows["hardware"].astype(str).str.lower() != "cpu"] if not rows.empty else rows
    if gpu_rows.empty:
        return lines + ["No claim is judged: every row of this report was measured on a CPU (or there are none), "
                        "and the paper's claims are about GPUs. Run a GPU sweep to judge them.", ""]
    lines += [f"Paper values: {claims.get('source', '?')}. Every verdict is read from the rows' fields "
              "(`experiments/claims.py`): *matched* when a measured value (or ratio) is within "
              f"±{tol * 100:.0f}% of the paper's, else *missed* / *exceeded* by that much, or *within noise* when "
              "the difference lies inside the timed steps' spread; *differs*: a system the paper says runs out of "
              "memory ran here; *predicted*: the paper says a system runs out of memory and ours was never launched "
              "because the memory rule predicts it does not fit; *not reproducible here*: the point needs more "
              "memory than this machine has (never launched); *not comparable*: the setups differ too much (an "
              "emulated GPU's absolute TFLOPS, rows of two machines); *not measured*: no row. A ratio of rows from "
              "two commits is marked ‡. Each verdict on a MegaTrain row names its placement and how often "
              "clipping fired. The paper's absolute TFLOPS mostly come from a GH200, whose ~900 GB/s NVLink-C2C "
              "host link is much faster than an H200's PCIe link; the ratio rows are the fairer comparison.", "",
              "Hardware names: " + "; ".join(f"**{_hw_short(hw_names, k)}**: {_hw_long(hw_names, k)}"
                                             for k in hw_names) + ".", ""]
    judged = [evaluate_claim(c, gpu_rows, tol, hw_names) for c in claims["claims"]]
    for sec in dict.fromkeys(j.section for j in judged):
        lines += [f"### {SECTION_TITLES.get(sec, sec)}", ""]
        body = []
        for j in (x for x in judged if x.section == sec):
            ours = j.ours + (" *(sample)*" if j.sample else "") + (f" — note: {j.note}" if j.note else "")
            paper = j.paper + (f" — {j.source}" if j.source else "")
            body.append([f"{j.claim} `{j.id}`", paper, ours, j.hardware, f"**{j.verdict.kind}**"
                         + (f" ({j.verdict.detail})" if j.verdict.detail else "")])
        lines += _md_table(["claim", "paper", "ours", "hardware", "verdict"], body) + [""]
    return lines + summary_lines(judged)


def build_report(results_dir, claims_path=CLAIMS_PATH, plots_dir: str | Path | None = None,
                 out_path=None, log=print) -> tuple[str, list[str]]:
    """Return (markdown text, errors)."""
    frames, errors = load_results(results_dir, log=log)
    frames = {sweep: mark_unsteady(results_dir, sweep, df) for sweep, df in frames.items()}
    claims = load_claims(claims_path)
    tol = float(claims.get("tolerance_pct", 10)) / 100
    hw_names = claims.get("hardware", {}) or {}
    rows = _all_rows(frames)
    out_path = Path(out_path) if out_path else Path(results_dir) / "REPORT.md"
    lines = ["# MegaTrain benchmark report", ""]
    n_sample = int(((rows["git_sha"] == SAMPLE_SHA) | (rows["gpu_name"] == SAMPLE_GPU)).sum()) if not rows.empty else 0
    if n_sample:
        lines += ["> ## ⚠️ SAMPLE DATA — not a measurement",
                  f"> {n_sample} of {len(rows)} rows are synthetic sample/test-fixture rows "
                  f"(git_sha `{SAMPLE_SHA}` / gpu_name `{SAMPLE_GPU}`). Every number derived from them below is "
                  "made up and marked *(sample)*; do not cite it.", ""]
    lines.append(f"Results: `{Path(results_dir).resolve().name}/` — sweeps found: "
                 f"{', '.join(frames) if frames else 'none'}; missing: "
                 f"{', '.join(s for s in known_sweeps() if s not in frames) or 'none'}.")
    lines.append("")
    if errors:
        lines += ["**Unreadable results files:**", ""] + [f"- {e}" for e in errors] + [""]
    if not rows.empty:
        lines += _environment(frames, rows)
        lines += _mixed_runs(rows)
    lines += _formulas(rows if not rows.empty else pd.DataFrame(columns=["status", "tflops", "step_time_median_s"]))

    lines += _claims_section(claims, rows, tol, hw_names)
    # accuracy parity: results/accuracy_parity (the main machine), accuracy_parity_<machine> beside it
    for acc in sorted(Path(results_dir).glob("accuracy_parity*/accuracy_parity.jsonl"),
                      key=lambda p: (p.parent.name != "accuracy_parity", p.parent.name)):
        fig = Path(plots_dir) / f"{acc.parent.name}.png" if plots_dir else None
        lines += accuracy.report_lines(acc, os.path.relpath(fig, out_path.parent) if fig and fig.exists() else None,
                                       machine_in_title=acc.parent.name != "accuracy_parity")
    for sweep in sft_report.sweeps(results_dir):  # Table 3 on a pretrained model, one section per machine
        fig = Path(plots_dir) / f"{sweep}.png" if plots_dir else None
        lines += sft_report.report_lines(results_dir, os.path.relpath(fig, out_path.parent)
                                         if fig and fig.exists() else None, sweep=sweep)
    if frames:
        lines += ["## Per-sweep results", ""]
        for sweep, df in frames.items():
            lines += _sweep_table(sweep, df)
            lines += same_run.table_lines(sweep, df)  # every system against MegaTrain, with its costs
        lines += update_path.table_lines(frames)  # the host update: CPU kernel vs the GPU update path, per shape
        lines += _unsteady(frames)
        lines += phases.report_lines(results_dir, frames)
        lines += _failures(rows)
    lines += _figures(Path(plots_dir) if plots_dir else None, out_path, frames)
    lines += ["---", "Generated by `python -m analysis.report` from the results CSVs and "
              "`analysis/data/paper_claims.yaml`."]
    return "\n".join(lines) + "\n", errors


def _empty_rows() -> pd.DataFrame:
    from experiments.schema import COLUMNS  # noqa: PLC0415
    return pd.DataFrame(columns=list(COLUMNS) + ["_sweep", "_params"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", required=True,
                    help="results root holding <sweep>/results.csv (runs/<machine>, or results for the committed ones)")
    ap.add_argument("--out", default=None, help="output Markdown file (default <results>/REPORT.md)")
    ap.add_argument("--claims", default=str(CLAIMS_PATH), help="paper claims YAML")
    ap.add_argument("--plots", default=None, help="figure folder to link (default <results>/plots; plots/ for results/)")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.results) / "REPORT.md"
    if args.plots is None:
        from .plots import plots_dir_for

        args.plots = str(plots_dir_for(Path(args.results)))
    try:
        text, errors = build_report(args.results, args.claims, args.plots, out)
    except ClaimsError as e:
        print(f"[error] {e}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"[ok] wrote {out}")
    return report_errors(errors)


if __name__ == "__main__":
    sys.exit(main())
