"""Figures for the benchmark sweeps, regenerated from ``results/<sweep>/results.csv`` alone.

    python -m experiments.plots [--results results] [--out plots]

Writes ``<out>/<figure>.png`` and ``.pdf`` for every sweep whose CSV exists; a missing sweep is
skipped with a message. A CSV whose header does not match the results schema is an error (exit 2).
Failed or skipped points (OOM, skipped, timeout, error) are drawn as a coloured "×" with a short
reason in a shaded band under the zero line at their x position, never dropped.

This module also holds the CSV loading/validation shared with ``experiments.report``. It does not
import torch; matplotlib is imported lazily (Agg backend) only when figures are drawn.
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
import warnings
from pathlib import Path

import pandas as pd

# ----------------------------------------------------------------------------------------------
# schema
# ----------------------------------------------------------------------------------------------

from experiments.schema import COLUMNS  # noqa: E402 - the one column list (no torch import)

COLUMNS_SOURCE = "experiments.schema.COLUMNS"


SWEEPS = ("smoke", "baselines", "size", "depth", "width", "context", "hardware", "ablation", "tokens")
SYSTEMS = ("megatrain", "zero3", "fsdp", "gemini", "native")
STATUSES = ("ok", "skipped", "gpu_oom", "host_oom", "timeout", "error")
FAILED = ("skipped", "gpu_oom", "host_oom", "timeout", "error")
ABLATION_VARIANTS = ("full", "no_double_buffer", "no_slab_pool", "ckpt_interval_1", "no_opt_overlap")
HARDWARE_ORDER = ("H200", "A100-80GB", "RTX-A6000-48GB", "RTX-3090-24GB")

SYSTEM_LABEL = {
    "megatrain": "MegaTrain",
    "zero3": "DeepSpeed ZeRO-3 offload",
    "fsdp": "FSDP2 CPU offload",
    "gemini": "ColossalAI Gemini",
    "native": "All-on-GPU (no offload)",
}
SYSTEM_SHORT = {"megatrain": "MegaTrain", "zero3": "ZeRO-3", "fsdp": "FSDP2", "gemini": "Gemini",
                "native": "All-on-GPU"}
# colour-blind-safe (Okabe-Ito) and fixed across every figure
SYSTEM_COLOR = {
    "megatrain": "#D55E00",  # vermillion
    "zero3": "#0072B2",      # blue
    "fsdp": "#009E73",       # green
    "gemini": "#CC79A7",     # purple-pink
    "native": "#555555",     # dark grey
}
SYSTEM_MARKER = {"megatrain": "o", "zero3": "s", "fsdp": "^", "gemini": "D", "native": "v"}
STATUS_SHORT = {"skipped": "skip", "gpu_oom": "OOM", "host_oom": "host OOM", "timeout": "timeout",
                "error": "error"}
VARIANT_LABEL = {
    "full": "full",
    "no_double_buffer": "no double\nbuffering",
    "no_slab_pool": "no grad\nslab pool",
    "ckpt_interval_1": "checkpoint\ninterval 1",
    "no_opt_overlap": "no optimizer\noverlap",
}

H200_PEAK_TFLOPS = 797.5  # measured dense bf16 on our H200
TB_1_5_GIB = 1.5e12 / 2**30  # "1.5 TB" host of the paper, decimal TB -> GiB (1397 GiB)
ADAM_BYTES_PER_PARAM = 12  # fp32 master + Adam m + v

TFLOPS_FORMULA = "TFLOPS = (6·P·T + 12·L·h·s·T) / step time / 1e12"
FORMULA_NOTE = (
    TFLOPS_FORMULA + "   (P params, T tokens/step, L layers, h hidden, s seq len; "
    "activation recompute not counted).   MFU = TFLOPS / peak (H200 measured dense bf16 "
    f"{H200_PEAK_TFLOPS} TFLOPS)."
)

_STR_COLUMNS = {"sweep", "point", "system", "variant", "status", "error", "model", "family", "hardware",
                "emulated", "gpu_name", "driver", "torch_version", "transformers_version",
                "deepspeed_version", "git_sha", "date"}

SAMPLE_SHA = "sample"
SAMPLE_GPU = "sample-data"


class ResultsSchemaError(ValueError):
    """A results CSV does not have the expected header (or is otherwise unreadable)."""


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------

def _to_bool(v) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes", "y", "t")


def read_results_csv(path: str | Path) -> pd.DataFrame:
    """Read and validate one ``results.csv``; numeric columns become floats, ``emulated`` a bool."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            header = next(csv.reader(f), None)
    except OSError as e:
        raise ResultsSchemaError(f"{path}: cannot read results CSV: {e}") from e
    if not header:
        raise ResultsSchemaError(f"{path}: empty file, expected a header row with {len(COLUMNS)} columns "
                                 f"({', '.join(COLUMNS[:5])}, ...)")
    header = [h.strip() for h in header]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        extra = [c for c in header if c not in COLUMNS]
        raise ResultsSchemaError(
            f"{path}: header does not match the results schema ({COLUMNS_SOURCE} column list): "
            f"missing {len(missing)} column(s): {', '.join(missing)}"
            + (f"; unexpected column(s): {', '.join(extra)}" if extra else "")
            + f". Expected header starts: {','.join(COLUMNS[:6])},..."
        )
    dups = sorted({h for h in header if header.count(h) > 1})
    if dups:
        raise ResultsSchemaError(f"{path}: duplicated column(s) in header: {', '.join(dups)}")
    df = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
    df.columns = [c.strip() for c in df.columns]
    for c in COLUMNS:
        if c not in df.columns:
            df[c] = pd.NA
    for c in df.columns:
        if c in _STR_COLUMNS:
            df[c] = df[c].fillna("").astype(str).str.strip()
        elif c in COLUMNS:
            df[c] = pd.to_numeric(df[c], errors="coerce")
    df["emulated"] = df["emulated"].map(_to_bool)
    df.loc[df["variant"] == "", "variant"] = "default"
    bad = sorted(set(df["status"]) - set(STATUSES))
    if bad:
        warnings.warn(f"{path}: unknown status value(s) {bad}; treated as failures", stacklevel=2)
    fill_derived(df)
    return df


def fill_derived(df: pd.DataFrame) -> None:
    """Fill ``tflops``/``mfu`` from the formula where a row has the inputs but not the value."""
    need = df["tflops"].isna() & df["step_time_median_s"].notna() & (df["status"] == "ok")
    if need.any():
        df.loc[need, "tflops"] = formula_tflops(df[need])
    peak = df["peak_tflops"].fillna(H200_PEAK_TFLOPS)
    need = df["mfu"].isna() & df["tflops"].notna()
    df.loc[need, "mfu"] = df.loc[need, "tflops"] / peak[need]


def formula_tflops(df: pd.DataFrame) -> pd.Series:
    """(6·P·T + 12·L·h·s·T) / step time, in TFLOPS."""
    p, t = df["num_params"], df["tokens_per_step"]
    flops = 6 * p * t + 12 * df["num_layers"] * df["hidden_size"] * df["seq_len"] * t
    return flops / df["step_time_median_s"] / 1e12


def load_results(results_dir: str | Path, sweeps=SWEEPS, log=print) -> tuple[dict[str, pd.DataFrame], list[str]]:
    """``{sweep: DataFrame}`` for every ``<results_dir>/<sweep>/results.csv`` that exists.

    Returns ``(frames, errors)``; a malformed CSV is reported in ``errors`` (and logged) rather than
    stopping the other sweeps. Rows repeated for the same (point, system, variant, hardware) keep
    the last one (a re-run appended to the file).
    """
    results_dir = Path(results_dir)
    frames, errors = {}, []
    for sweep in sweeps:
        path = results_dir / sweep / "results.csv"
        if not path.exists():
            log(f"[skip] sweep '{sweep}': {path} not found")
            continue
        try:
            df = read_results_csv(path)
        except ResultsSchemaError as e:
            log(f"[error] {e}")
            errors.append(str(e))
            continue
        if df.empty:
            log(f"[skip] sweep '{sweep}': {path} has no rows")
            continue
        key = ["point", "system", "variant", "hardware"]
        n = len(df)
        df = df.drop_duplicates(subset=key, keep="last").reset_index(drop=True)
        if len(df) < n:
            log(f"[note] sweep '{sweep}': {n - len(df)} repeated row(s); kept the last of each")
        frames[sweep] = df
    return frames, errors


def is_sample(df: pd.DataFrame) -> bool:
    return bool(((df["git_sha"] == SAMPLE_SHA) | (df["gpu_name"] == SAMPLE_GPU)).any())


def fill_x_from_point(df: pd.DataFrame, col: str) -> pd.Series:
    """``col`` with gaps filled from other rows of the same point (a skipped run may lack shape data)."""
    by_point = df.dropna(subset=[col]).groupby("point")[col].first()
    return df[col].fillna(df["point"].map(by_point))


def fmt_tokens(n: float) -> str:
    n = float(n)
    if n >= 2**20 and n % 2**20 == 0:
        return f"{int(n // 2**20)}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{int(n // 1024)}K"
    return f"{int(n)}"


def fmt_params(p: float) -> str:
    b = p / 1e9
    if b >= 100:
        return f"{b:.0f}B"
    if b >= 1:
        return f"{b:.1f}B"
    return f"{p / 1e6:.0f}M"


def _safe_max(values: pd.Series, default: float = 1.0) -> float:
    v = pd.to_numeric(values, errors="coerce").max()
    return float(v) if pd.notna(v) and v > 0 else default


def _ordered_systems(df: pd.DataFrame) -> list[str]:
    present = list(dict.fromkeys(df["system"]))
    return [s for s in SYSTEMS if s in present] + [s for s in present if s not in SYSTEMS]


def _style(system: str) -> tuple[str, str, str]:
    return (SYSTEM_LABEL.get(system, system), SYSTEM_COLOR.get(system, "#000000"),
            SYSTEM_MARKER.get(system, "o"))


# ----------------------------------------------------------------------------------------------
# drawing helpers
# ----------------------------------------------------------------------------------------------

_plt = None


def _pyplot():
    global _plt
    if _plt is None:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        plt.rcParams.update({
            "figure.dpi": 110, "savefig.dpi": 150, "font.size": 10, "axes.titlesize": 11,
            "axes.labelsize": 10, "legend.fontsize": 8.5, "xtick.labelsize": 9, "ytick.labelsize": 9,
            "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
            "pdf.fonttype": 42,
        })
        _plt = plt
    return _plt


def _env_line(df: pd.DataFrame) -> str:
    def uniq(col):
        vals = [v for v in dict.fromkeys(df[col]) if v]
        return ", ".join(vals[:3]) + (" …" if len(vals) > 3 else "") if vals else "?"
    return (f"GPU: {uniq('gpu_name')}  ·  torch {uniq('torch_version')}  ·  git {uniq('git_sha')}  ·  "
            f"{uniq('date')}")


def _new_figure(ncols=1, nrows=1, width=7.2, height=4.6, **kw):
    plt = _pyplot()
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False, **kw)
    return fig, axes.ravel()


def _finish(fig, df: pd.DataFrame, title: str, note: str, out: Path, name: str, formats,
            fig_legend: tuple | None = None) -> list[Path]:
    """Title, footnote (environment + formula), sample watermark; save every format.

    ``fig_legend=(handles, ncol)`` puts one legend for all panels under the title."""
    plt = _pyplot()
    sample = is_sample(df)
    fig.suptitle(title + ("  [SAMPLE DATA]" if sample else ""), fontsize=12.5, fontweight="bold",
                 color="#B00020" if sample else "black")
    import textwrap  # noqa: PLC0415
    width_chars = int(fig.get_size_inches()[0] * 17)
    foot = "\n".join(textwrap.fill(line, width_chars) for line in (_env_line(df) + "\n" + (note or "")).strip().split("\n"))
    nlines = foot.count("\n") + 1
    h = fig.get_size_inches()[1]
    bottom = min(0.35, (0.16 * nlines + 0.12) / h)
    top = 1.0
    if fig_legend:
        handles, ncol = fig_legend
        rows = math.ceil(len(handles) / ncol)
        top = 1 - (0.42 + 0.2 * rows) / h
        fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.38 / h), ncol=ncol,
                   fontsize=8.5, framealpha=0.9)
    fig.tight_layout(rect=(0, bottom, 1, top))
    fig.text(0.012, 0.012, foot, fontsize=7.2, ha="left", va="bottom", color="#333333")
    if sample:
        fig.text(0.5, 0.5, "SAMPLE DATA — not a measurement", fontsize=30, color="#B00020", alpha=0.08,
                 ha="center", va="center", rotation=20, fontweight="bold", zorder=0)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in formats:
        p = out / f"{name}.{ext}"
        fig.savefig(p)
        paths.append(p)
    plt.close(fig)
    return paths


def _fail_handle():
    from matplotlib.lines import Line2D  # noqa: PLC0415
    return Line2D([], [], ls="none", marker="x", color="#333333", markersize=7, mew=2,
                  label="× failed / not run (reason in the grey band)")


def _set_band_ylim(ax, top: float, n_rows: int, bottom_data: float = 0.0):
    """Linear y axis from a shaded band (for failure marks) up to ``top``; only ticks >= 0 kept."""
    top = top if top and math.isfinite(top) and top > bottom_data else bottom_data + 1.0
    top *= 1.12
    if n_rows:
        frac = min(0.055 * n_rows + 0.02, 0.32)
        lo = bottom_data - (top - bottom_data) * frac / (1 - frac)
        ax.set_ylim(lo, top)
        ax.axhspan(lo, bottom_data, color="#f0f0f0", zorder=0, lw=0)
        ax.axhline(bottom_data, color="#999999", lw=0.8, zorder=1)
    else:
        ax.set_ylim(bottom_data, top)
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415
    ticks = [t for t in MaxNLocator(nbins=6).tick_values(bottom_data, top) if bottom_data <= t <= top]
    ax.set_yticks(ticks)


def _band_positions(n_rows: int, log_y: bool = False) -> list[float]:
    """Axes-fraction heights of the failure rows inside the band (one row per system)."""
    frac = min(0.055 * n_rows + 0.02, 0.32)
    step = (frac - 0.02) / max(n_rows, 1)
    return [0.015 + step * (i + 0.5) for i in range(n_rows)]


def _mark_failures(ax, fails: dict[str, pd.DataFrame], xcol: str, systems: list[str]) -> int:
    """Draw each failed row as "× reason" at its x, one band row per system with failures."""
    import matplotlib.transforms as mtransforms  # noqa: PLC0415
    rows = [s for s in systems if s in fails and not fails[s].empty]
    ys = _band_positions(len(rows))
    trans = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    unplaced = []
    for y, system in zip(ys, rows):
        _, color, _ = _style(system)
        for _, r in fails[system].iterrows():
            x = r[xcol]
            if pd.isna(x):  # no x value anywhere for this point: list it rather than drop it
                unplaced.append(f"{SYSTEM_SHORT.get(system, system)} {r['point']} "
                                f"({STATUS_SHORT.get(r['status'], r['status'])})")
                continue
            ax.plot([x], [y], transform=trans, marker="x", color=color, markersize=7, mew=2, ls="none",
                    clip_on=False, zorder=5)
            ax.annotate(STATUS_SHORT.get(r["status"], r["status"]), (x, y), xycoords=trans,
                        xytext=(4, 0), textcoords="offset points", fontsize=7, color=color,
                        va="center", ha="left", zorder=5)
    if unplaced:
        import textwrap  # noqa: PLC0415
        ax.text(0.01, 0.98, textwrap.fill("× without an x value: " + ", ".join(unplaced), 90), transform=ax.transAxes,
                fontsize=7, va="top", ha="left", color="#B00020",
                bbox=dict(fc="white", ec="#B00020", alpha=0.9, lw=0.6))
    return len(unplaced)


def _series_key(r) -> str:
    v = r["variant"]
    return r["system"] if v in ("default", "full", "") else f"{r['system']}:{v}"


def _line_panel(ax, df: pd.DataFrame, xcol: str, ycol: str, ylabel: str, *, band=True, logy=False,
                extra_top: float = 0.0) -> dict:
    """One line per system over ``xcol``; failures marked in the band. Returns what was drawn."""
    df = df.copy()
    df[xcol] = fill_x_from_point(df, xcol)
    ok = df[(df["status"] == "ok") & df[ycol].notna()]
    fails = {}
    systems = _ordered_systems(df)
    for key in dict.fromkeys(df.apply(_series_key, axis=1)):
        system, _, variant = key.partition(":")
        label, color, marker = _style(system)
        if variant:
            label += f" ({variant})"
        part = ok[ok.apply(_series_key, axis=1) == key].sort_values(xcol)
        if not part.empty:
            ax.plot(part[xcol], part[ycol], marker=marker, color=color, label=label, lw=1.8, ms=6,
                    zorder=3, ls="-" if not variant else "--")
        f = df[(df.apply(_series_key, axis=1) == key) & (df["status"] != "ok")]
        if not f.empty:
            fails[system] = pd.concat([fails.get(system, f.iloc[:0]), f])
    if not logy:
        top = max(float(ok[ycol].max()) if not ok.empty else 0.0, extra_top)
        _set_band_ylim(ax, top, len(fails) if band else 0)
    unplaced = _mark_failures(ax, fails, xcol, systems) if band else 0
    if ok.empty and not unplaced:
        ax.text(0.5, 0.6, "no successful runs in this sweep", transform=ax.transAxes, ha="center", va="center",
                fontsize=11, color="#777777")
    ax.set_ylabel(ylabel)
    return {"ok": ok, "fails": fails, "systems": systems}


def _mfu_axis(ax, df: pd.DataFrame):
    """Right-hand MFU axis (percent of the peak in the CSV, default H200 797.5)."""
    peak = float(df["peak_tflops"].dropna().median()) if df["peak_tflops"].notna().any() else H200_PEAK_TFLOPS
    sec = ax.secondary_yaxis("right", functions=(lambda t: t / peak * 100, lambda m: m * peak / 100))
    lo, hi = ax.get_ylim()
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415
    ticks = [t for t in MaxNLocator(nbins=6).tick_values(0, hi / peak * 100) if 0 <= t <= hi / peak * 100]
    sec.set_yticks(ticks)
    sec.set_ylabel(f"MFU (% of {peak:g} TFLOPS peak)", color="#555555", fontsize=9)
    sec.spines["right"].set_visible(True)
    return sec


def _legend(ax, extra=(), loc="above", ncol=2, **kw):
    """Legend above the axes (default, never hides data) or at ``loc`` inside."""
    handles, labels = ax.get_legend_handles_labels()
    handles = list(handles) + list(extra)
    labels = list(labels) + [h.get_label() for h in extra]
    if not handles:
        return
    if loc == "above":
        ax.legend(handles, labels, loc="lower left", bbox_to_anchor=(0.0, 1.02, 1.0, 0.0), mode="expand",
                  ncol=ncol, framealpha=0.9, borderaxespad=0.0, **kw)
    else:
        ax.legend(handles, labels, loc=loc, framealpha=0.9, **kw)


def _log2_ticks(ax, values, fmt=fmt_tokens):
    vals = sorted({float(v) for v in values if pd.notna(v) and v > 0})
    ax.set_xscale("log", base=2)
    if vals:
        ax.set_xticks(vals)
        ax.set_xticklabels([fmt(v) for v in vals])
        ax.minorticks_off()
        ax.set_xlim(vals[0] / 1.35, vals[-1] * 1.6)


# ----------------------------------------------------------------------------------------------
# figures
# ----------------------------------------------------------------------------------------------

def _system_bars(ax, df, ycol: str, ylabel: str, fmt: str = "{:,.0f}"):
    """One bar per system (value of ``ycol`` of its ok row); failed systems get an × and their status."""
    systems = _ordered_systems(df)
    top = _safe_max(df.loc[df["status"] == "ok", ycol])
    for i, s in enumerate(systems):
        label, color, _ = _style(s)
        rows = df[df["system"] == s]
        r = rows[rows["status"] == "ok"]
        if not r.empty and pd.notna(r[ycol].iloc[0]):
            v = float(r[ycol].iloc[0])
            ax.bar(i, v, color=color, width=0.65, zorder=3)
            ax.annotate(fmt.format(v), (i, v), xytext=(0, 3), textcoords="offset points", ha="center",
                        fontsize=8)
        else:
            st = rows["status"].iloc[0] if not rows.empty else "?"
            ax.plot([i], [top * 0.04], marker="x", color=color, ms=10, mew=2.5, zorder=4)
            ax.annotate(STATUS_SHORT.get(st, st), (i, top * 0.04), xytext=(0, 8), textcoords="offset points",
                        ha="center", fontsize=8, color=color, fontweight="bold")
    ax.set_xticks(list(range(len(systems))))
    ax.set_xticklabels([SYSTEM_SHORT.get(s, s) for s in systems])
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("system")
    ax.grid(axis="x", visible=False)


def fig_smoke(df, out, formats):
    fig, (ax,) = _new_figure(width=6.4, height=4.2)
    _system_bars(ax, df, "tokens_per_s", "throughput (tokens/s)")
    models = ", ".join(dict.fromkeys(df["model"].astype(str)))
    ax.set_title(f"model {models}; × = failed / not run", fontsize=9.5)
    return _finish(fig, df, "Smoke test: training throughput per system",
                   "tokens/s = tokens per step / median step time (after warm-up).", out, "smoke_tokens_per_s",
                   formats)


def fig_baselines(df, out, formats):
    """The five systems side by side on one model and batch (issue: baselines table)."""
    fig, axes = _new_figure(ncols=3, width=13.5, height=4.4)
    _system_bars(axes[0], df, "tflops", "training throughput (TFLOPS)", "{:.0f}")
    _system_bars(axes[1], df, "gpu_peak_allocated_gib", "GPU peak allocated (GiB)", "{:.1f}")
    _system_bars(axes[2], df, "host_peak_rss_gib", "host peak RSS (GiB)", "{:.1f}")
    models = ", ".join(dict.fromkeys(df["model"].astype(str)))
    shape = ", ".join(dict.fromkeys(f"{int(b)}×{int(s)}" for b, s in zip(df["batch_size"], df["seq_len"])))
    axes[0].set_title(f"model {models}, batch {shape}", fontsize=9.5)
    return _finish(fig, df, "All systems side by side", FORMULA_NOTE, out, "baselines", formats)


def fig_size_throughput(df, out, formats):
    df = df.copy()
    df["params_b"] = fill_x_from_point(df, "num_params") / 1e9
    fig, (ax,) = _new_figure(width=7.6, height=5.0)
    _line_panel(ax, df, "params_b", "tflops", "training throughput (TFLOPS)")
    ax.set_xscale("log")
    _params_ticks(ax, df["params_b"])
    ax.set_xlabel("model size (billion parameters, log scale)")
    _mfu_axis(ax, df)
    _legend(ax, [_fail_handle()])
    return _finish(fig, df, "Throughput vs model size (size sweep)", FORMULA_NOTE, out, "size_throughput", formats)


def _params_ticks(ax, params_b):
    vals = sorted({float(v) for v in params_b.dropna()})
    if vals:
        ax.set_xticks(vals)
        ax.set_xticklabels([fmt_params(v * 1e9) for v in vals], rotation=0)
        ax.minorticks_off()
        ax.set_xlim(vals[0] / 1.3, vals[-1] * 1.45)


def _engine_bytes_per_param(df) -> float | None:
    m = df[df["system"] == "megatrain"]
    bpp = m["host_bytes_per_param"].dropna()
    if bpp.empty:
        ratio = (m["host_estimate_gib"] * 2**30 / m["num_params"]).dropna()
        bpp = ratio
    return float(bpp.median()) if not bpp.empty else None


def _host_memory_panel(ax, df, xcol, *, show_12=True, show_lines=True):
    """Host peak RSS per system (log y), engine estimates, 12 B/param, host RAM and 1.5 TB lines."""
    df = df.copy()
    df[xcol] = fill_x_from_point(df, xcol)
    ok = df[(df["status"] == "ok") & df["host_peak_rss_gib"].notna()]
    systems = _ordered_systems(df)
    ymax = [float(ok["host_peak_rss_gib"].max()) if not ok.empty else 1.0]
    ymin = [float(ok["host_peak_rss_gib"].min()) if not ok.empty else 1.0]
    for s in systems:
        label, color, marker = _style(s)
        part = ok[ok["system"] == s].sort_values(xcol)
        if not part.empty:
            ax.plot(part[xcol], part["host_peak_rss_gib"], marker=marker, color=color, lw=1.8, ms=6,
                    label=f"{SYSTEM_SHORT.get(s, s)}: peak RSS (measured)", zorder=3)
        est = df[(df["system"] == s) & df["host_estimate_gib"].notna()].sort_values(xcol)
        if not est.empty:
            ax.plot(est[xcol], est["host_estimate_gib"], marker=marker, mfc="white", color=color, lw=1,
                    ls=":", ms=7, label=f"{SYSTEM_SHORT.get(s, s)}: engine estimate",
                    zorder=2)
            ymax.append(float(est["host_estimate_gib"].max()))
            ymin.append(float(est["host_estimate_gib"].min()))
    pcol = fill_x_from_point(df, "num_params")
    if show_12 and pcol.notna().any():
        line = df.assign(_p=pcol).dropna(subset=["_p"]).groupby(xcol)["_p"].first().sort_index()
        y12 = line * ADAM_BYTES_PER_PARAM / 2**30
        ax.plot(line.index, y12, color="black", ls="--", lw=1.2, zorder=2,
                label="12 B/param (fp32 master + Adam m, v)")
        ymin.append(float(y12.min()))
        ymax.append(float(y12.max()))
    host_ram = df["host_ram_gib"].dropna()
    ax.set_yscale("log")
    if show_lines:
        if not host_ram.empty:
            hr = float(host_ram.max())
            ax.axhline(hr, color="#E69F00", lw=1.5, ls="-.", label=f"this host's RAM ({hr:,.0f} GiB)")
            ymax.append(hr)
        ax.axhline(TB_1_5_GIB, color="#56B4E9", lw=1.5, ls="-.",
                   label=f"a 1.5 TB host, as in the paper ({TB_1_5_GIB:,.0f} GiB)")
        ymax.append(TB_1_5_GIB)
    lo, hi = min(ymin), max(ymax)
    fails = {s: df[(df["system"] == s) & (df["status"] != "ok")] for s in systems}
    fails = {s: f for s, f in fails.items() if not f.empty}
    n = len(fails)
    # leave the bottom fraction of the log axis free for the failure marks
    frac = min(0.055 * n + 0.02, 0.32) if n else 0.0
    span = math.log10(hi * 1.6) - math.log10(lo / 1.3)
    lo_ax = 10 ** (math.log10(lo / 1.3) - span * frac / max(1 - frac, 0.1))
    ax.set_ylim(lo_ax, hi * 1.6)
    if n:
        ax.axhspan(lo_ax, 10 ** (math.log10(lo_ax) + (math.log10(hi * 1.6) - math.log10(lo_ax)) * frac),
                   color="#f0f0f0", zorder=0, lw=0)
        _mark_failures(ax, fails, xcol, systems)
    ax.set_ylabel("host memory (GiB, log scale)")
    return host_ram


def fig_size_host_memory(df, out, formats):
    df = df.copy()
    df["params_b"] = fill_x_from_point(df, "num_params") / 1e9
    fig, (ax,) = _new_figure(width=8.4, height=5.8)
    host_ram = _host_memory_panel(ax, df, "params_b")
    ax.set_xscale("log")
    _params_ticks(ax, df["params_b"])
    ax.set_xlabel("model size (billion parameters, log scale)")
    bpp = _engine_bytes_per_param(df)
    notes = []
    if bpp:
        import matplotlib.transforms as mtransforms  # noqa: PLC0415
        trans = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
        for cap, name, color in ((TB_1_5_GIB, "1.5 TB host", "#56B4E9"),
                                 (float(host_ram.max()) if not host_ram.empty else None, "this host", "#E69F00")):
            if not cap:
                continue
            pmax = cap * 2**30 / bpp / 1e9
            lo, hi = ax.get_xlim()
            if lo < pmax < hi:
                ax.axvline(pmax, color=color, lw=1, ls=":")
                ax.annotate(f"{name}: ≤{pmax:,.0f}B", (pmax, 0.97), xycoords=trans, xytext=(-3, 0),
                            textcoords="offset points", rotation=90, ha="right", va="top", fontsize=7.5,
                            color=color, bbox=dict(fc="white", ec="none", alpha=0.85, pad=1))
            notes.append(f"{name} ({cap:,.0f} GiB) fits MegaTrain models up to ≈{pmax:,.0f}B params")
        floor = TB_1_5_GIB * 2**30 / ADAM_BYTES_PER_PARAM / 1e9
        notes = [f"At the engine's median {bpp:.1f} host bytes/param: " + "; ".join(notes) +
                 f". The 12 B/param floor alone would allow ≈{floor:,.0f}B in 1.5 TB."]
    _legend(ax, [_fail_handle()], fontsize=7.5)
    note = "\n".join(notes + ["Host memory = peak resident set size of the training process "
                              "(pinned buffers included); hollow markers = engine's own estimate, drawn for "
                              "skipped points too."])
    return _finish(fig, df, "Host memory vs model size (size sweep)", note, out, "size_host_memory", formats)


def fig_depth(df, out, formats):
    fig, (ax1, ax2) = _new_figure(ncols=2, width=11.5, height=5.0)
    _line_panel(ax1, df, "num_layers", "tflops", "training throughput (TFLOPS)")
    _mfu_axis(ax1, df)
    _legend(ax1, [_fail_handle()], fontsize=7.5)
    _host_memory_panel(ax2, df, "num_layers")
    _legend(ax2, fontsize=7)
    for ax in (ax1, ax2):
        _layer_ticks(ax, df)
        ax.set_xlabel("number of layers (model size)")
    h = ", ".join(str(int(v)) for v in df["hidden_size"].dropna().unique()[:2])
    f = ", ".join(str(int(v)) for v in df["intermediate_size"].dropna().unique()[:2])
    return _finish(fig, df, f"Depth sweep: hidden {h}, FFN {f}", FORMULA_NOTE, out, "depth", formats)


def _layer_ticks(ax, df):
    d = df.assign(_p=fill_x_from_point(df, "num_params"))
    per = d.dropna(subset=["num_layers"]).groupby("num_layers")["_p"].first().sort_index()
    if per.empty:
        return
    ax.set_xticks(list(per.index))
    ax.set_xticklabels([f"{int(l)}\n{fmt_params(p) if pd.notna(p) else ''}" for l, p in per.items()], fontsize=8)
    span = per.index.max() - per.index.min()
    ax.set_xlim(per.index.min() - 0.05 * span - 1, per.index.max() + 0.12 * span + 1)


def fig_width(df, out, formats):
    fig, (ax,) = _new_figure(width=7.6, height=5.0)
    _line_panel(ax, df, "width_mult", "tflops", "training throughput (TFLOPS)")
    d = df.assign(_p=fill_x_from_point(df, "num_params"))
    per = d.dropna(subset=["width_mult"]).groupby("width_mult")["_p"].first().sort_index()
    ax.set_xticks(list(per.index))
    ax.set_xticklabels([f"{w:g}×\n{fmt_params(p) if pd.notna(p) else ''}" for w, p in per.items()], fontsize=8.5)
    if len(per):
        span = per.index.max() - per.index.min()
        ax.set_xlim(per.index.min() - 0.06 * span - 0.1, per.index.max() + 0.15 * span + 0.1)
    ax.set_xlabel("width multiplier (hidden and FFN size × m; model size below)")
    _mfu_axis(ax, df)
    _legend(ax, [_fail_handle()])
    return _finish(fig, df, "Throughput vs width (width sweep)", FORMULA_NOTE, out, "width", formats)


def fig_context(df, out, formats):
    fig, (ax1, ax2) = _new_figure(ncols=2, width=11.5, height=5.0)
    _line_panel(ax1, df, "seq_len", "tflops", "training throughput (TFLOPS)")
    _mfu_axis(ax1, df)
    _legend(ax1, [_fail_handle()], fontsize=7.5)
    cap = df["gpu_mem_cap_gib"].dropna()
    _line_panel(ax2, df, "seq_len", "gpu_peak_allocated_gib", "GPU peak allocated memory (GiB)",
                band=True, extra_top=float(cap.max()) if not cap.empty else 0.0)
    if not cap.empty:
        ax2.axhline(float(cap.max()), color="#B00020", ls="--", lw=1.2,
                    label=f"GPU memory cap {float(cap.max()):g} GiB")
    _legend(ax2, fontsize=7.5)
    for ax in (ax1, ax2):
        _log2_ticks(ax, fill_x_from_point(df, "seq_len"))
        ax.set_xlabel("sequence length (tokens, log2 scale)")
    models = ", ".join(dict.fromkeys(m for m in df["model"] if m))
    return _finish(fig, df, f"Context length sweep ({models})",
                   FORMULA_NOTE + "\nGPU memory: gpu_peak_allocated_gib (peak memory allocated by PyTorch during the run).", out, "context", formats)


def fig_tokens(df, out, formats):
    fig, (ax,) = _new_figure(width=7.8, height=5.0)
    info = _line_panel(ax, df, "tokens_per_step", "tflops", "training throughput (TFLOPS)")
    ok = info["ok"]
    for s in info["systems"]:
        part = ok[ok["system"] == s].sort_values("tokens_per_step")
        if part.empty:
            continue
        _, color, marker = _style(s)
        mx = float(part["tflops"].max())
        knee = part[part["tflops"] >= 0.9 * mx].iloc[0]
        ax.plot([knee["tokens_per_step"]], [knee["tflops"]], marker="*", ms=17, color=color, mec="black",
                mew=0.8, ls="none", zorder=6)
        ax.annotate(f"knee: {fmt_tokens(knee['tokens_per_step'])} tokens\n(≥90% of max {mx:.0f})",
                    (knee["tokens_per_step"], knee["tflops"]), xytext=(10, -22), textcoords="offset points",
                    fontsize=7.5, color=color, arrowprops=dict(arrowstyle="-", color=color, lw=0.6))
    _log2_ticks(ax, fill_x_from_point(df, "tokens_per_step"))
    ax.set_xlabel("tokens per optimizer step (batch × seq len, log2 scale)")
    _mfu_axis(ax, df)
    from matplotlib.lines import Line2D  # noqa: PLC0415
    knee_h = Line2D([], [], marker="*", ms=12, color="white", mec="black", ls="none",
                    label="knee: first point reaching 90% of the system's max")
    _legend(ax, [knee_h, _fail_handle()])
    models = ", ".join(dict.fromkeys(m for m in df["model"] if m))
    return _finish(fig, df, f"Throughput vs tokens per step ({models})", FORMULA_NOTE, out, "tokens", formats)


def _bar_fail(ax, x, top, status, color):
    ax.plot([x], [top * 0.03], marker="x", color=color, ms=9, mew=2.2, zorder=4)
    ax.annotate(STATUS_SHORT.get(status, status), (x, top * 0.03), xytext=(0, 6), textcoords="offset points",
                ha="center", va="bottom", fontsize=7, color=color, fontweight="bold", rotation=90)


def fig_hardware(df, out, formats):
    df = df.copy()
    df["_p"] = fill_x_from_point(df, "num_params")
    models = list(df.sort_values("_p")["point"].drop_duplicates()) if df["_p"].notna().any() else \
        list(dict.fromkeys(df["point"]))
    # one panel per model size
    groups = []
    for pt in models:
        g = df[df["point"] == pt]
        p = g["_p"].dropna()
        name = next((m for m in g["model"] if m), pt)
        groups.append((pt, g, f"{name} ({float(p.iloc[0]) / 1e9:.1f}B params)" if not p.empty else name))
    # merge points of the same model (point names may encode hardware)
    merged = {}
    for pt, g, label in groups:
        merged.setdefault(label, []).append(g)
    panels = [(label, pd.concat(gs)) for label, gs in merged.items()]
    fig, axes = _new_figure(ncols=len(panels), width=max(6.5, 4.6 * len(panels)), height=5.0, sharey=True)
    top = _safe_max(df.loc[df["status"] == "ok", "tflops"])
    systems = _ordered_systems(df)
    for ax, (label, g) in zip(axes, panels):
        hws = [h for h in HARDWARE_ORDER if h in set(g["hardware"])] + \
              [h for h in dict.fromkeys(g["hardware"]) if h not in HARDWARE_ORDER]
        width = 0.8 / max(len(systems), 1)
        for j, s in enumerate(systems):
            _, color, _ = _style(s)
            for i, hw in enumerate(hws):
                x = i - 0.4 + width * (j + 0.5)
                r = g[(g["system"] == s) & (g["hardware"] == hw)]
                if r.empty:
                    continue
                r = r.iloc[-1]
                if r["status"] == "ok" and pd.notna(r["tflops"]):
                    ax.bar(x, r["tflops"], width=width * 0.92, color=color, zorder=3,
                           hatch="//" if r["emulated"] else None, edgecolor="white", lw=0.5)
                    ax.annotate(f"{r['tflops']:.0f}", (x, r["tflops"]), xytext=(0, 2), textcoords="offset points",
                                ha="center", fontsize=6.5)
                else:
                    _bar_fail(ax, x, top, r["status"], color)
        ax.set_xticks(range(len(hws)))
        emu = {h: bool(g.loc[g["hardware"] == h, "emulated"].any()) for h in hws}
        ax.set_xticklabels([f"{h}\n(emulated)" if emu[h] else f"{h}\n(real)" for h in hws], fontsize=8)
        ax.text(0.02, 0.98, label, transform=ax.transAxes, fontweight="bold", va="top", ha="left", fontsize=10)
        ax.grid(axis="x", visible=False)
        ax.set_ylim(0, top * 1.2)
        ax.set_xlabel("hardware profile")
    axes[0].set_ylabel("training throughput (TFLOPS)")
    from matplotlib.patches import Patch  # noqa: PLC0415
    handles = [Patch(color=_style(s)[1], label=SYSTEM_LABEL.get(s, s)) for s in systems]
    handles += [Patch(facecolor="#bbbbbb", hatch="//", edgecolor="white", label="emulated profile"),
                _fail_handle()]
    handles[-1].set_label("× failed / not run (reason above the mark)")

    note = (FORMULA_NOTE + "\nEmulated profiles run on the H200 with the GPU memory capped to the profile's size "
            "(and host-link limits where configured); compute is still the H200's, so absolute TFLOPS overstate "
            "the real card.")
    return _finish(fig, df, "Throughput per hardware profile", note, out, "hardware", formats,
                   fig_legend=(handles, min(len(handles), 4)))


def fig_ablation(df, out, formats):
    df = df.copy()
    points = list(dict.fromkeys(df["point"]))
    fig, axes = _new_figure(ncols=len(points), width=max(7.0, 6.0 * len(points)), height=5.0, sharey=True)
    top = _safe_max(df.loc[df["status"] == "ok", "tflops"])
    for ax, pt in zip(axes, points):
        g = df[df["point"] == pt]
        variants = [v for v in ABLATION_VARIANTS if v in set(g["variant"])] + \
                   [v for v in dict.fromkeys(g["variant"]) if v not in ABLATION_VARIANTS]
        full = g[(g["variant"] == "full") & (g["status"] == "ok")]["tflops"]
        full_v = float(full.iloc[0]) if not full.empty and pd.notna(full.iloc[0]) else None
        for i, v in enumerate(variants):
            r = g[g["variant"] == v].iloc[-1]
            system = r["system"]
            _, color, _ = _style(system)
            if r["status"] == "ok" and pd.notna(r["tflops"]):
                val = float(r["tflops"])
                ax.bar(i, val, color=color, alpha=1.0 if v == "full" else 0.6, width=0.65, zorder=3,
                       edgecolor=color, lw=1.2)
                txt = f"{val:.1f}"
                if full_v and v != "full":
                    txt += f"\n{(val / full_v - 1) * 100:+.1f}% vs full"
                ax.annotate(txt, (i, val), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
            else:
                _bar_fail(ax, i, top, r["status"], color)
        ax.set_xticks(range(len(variants)))
        ax.set_xticklabels([VARIANT_LABEL.get(v, v) for v in variants], fontsize=8.5)
        p = g["num_params"].dropna()
        ax.set_title(f"{g['model'].iloc[0] or pt}" + (f" ({float(p.iloc[0]) / 1e9:.1f}B params)" if not p.empty else ""))
        ax.set_ylim(0, top * 1.22)
        ax.grid(axis="x", visible=False)
        ax.set_xlabel("MegaTrain variant (one optimisation switched off)")
    axes[0].set_ylabel("training throughput (TFLOPS)")
    return _finish(fig, df, "Ablation: MegaTrain optimisations", FORMULA_NOTE, out, "ablation", formats)


FIGURES = {
    "smoke": [("smoke_tokens_per_s", fig_smoke)],
    "baselines": [("baselines", fig_baselines)],
    "size": [("size_throughput", fig_size_throughput), ("size_host_memory", fig_size_host_memory)],
    "depth": [("depth", fig_depth)],
    "width": [("width", fig_width)],
    "context": [("context", fig_context)],
    "hardware": [("hardware", fig_hardware)],
    "ablation": [("ablation", fig_ablation)],
    "tokens": [("tokens", fig_tokens)],
}


def expected_figures(sweeps=SWEEPS) -> list[str]:
    return [name for s in sweeps for name, _ in FIGURES[s]]


def make_plots(results_dir="results", out_dir="plots", formats=("png", "pdf"), log=print) -> tuple[list[Path], list[str]]:
    """Draw every figure whose sweep CSV exists. Returns (written paths, errors)."""
    frames, errors = load_results(results_dir, log=log)
    out_dir = Path(out_dir)
    written = []
    for sweep, figs in FIGURES.items():
        if sweep not in frames:
            continue
        for name, fn in figs:
            try:
                paths = fn(frames[sweep], out_dir, formats)
            except Exception as e:  # one broken figure should not hide the others
                msg = f"figure '{name}' ({sweep}) failed: {type(e).__name__}: {e}"
                log(f"[error] {msg}")
                errors.append(msg)
                continue
            written += paths
            log(f"[ok] {', '.join(str(p) for p in paths)}")
    if not frames and not errors:
        log(f"[warn] no results CSVs under {results_dir}/<sweep>/results.csv; nothing plotted")
    return written, errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.plots", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="results", help="results root holding <sweep>/results.csv")
    ap.add_argument("--out", default="plots", help="output folder for PNG and PDF figures")
    ap.add_argument("--formats", default="png,pdf", help="comma-separated file formats (default png,pdf)")
    args = ap.parse_args(argv)
    _, errors = make_plots(args.results, args.out, tuple(f for f in args.formats.split(",") if f))
    if errors:
        print(f"{len(errors)} error(s):", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
