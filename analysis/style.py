"""The look of every figure: system labels/colours (from ``baselines.registry``), pyplot setup, footers
with the environment, failure marks and legends. No torch; matplotlib imported lazily (Agg)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from baselines.registry import SYSTEM_RECORDS, SYSTEMS as REGISTERED_SYSTEMS, record

from experiments.schema import H200_PEAK_TFLOPS, fill_x_from_point, is_sample, known_sweeps, row_peaks

SWEEPS = known_sweeps()  # experiments/conf/sweep/*.yaml, in their order
HARDWARE_ORDER = ("H200", "A100-80GB", "RTX-A6000-48GB", "RTX-3090-24GB")  # figure/table order of the profiles
FAILED = ("skipped", "gpu_oom", "host_oom", "timeout", "error")
SYSTEMS = REGISTERED_SYSTEMS
# Labels, colours and markers come from baselines.registry.SYSTEM_RECORDS (one record per system).
SYSTEM_LABEL = {n: r.label for n, r in SYSTEM_RECORDS.items()}
SYSTEM_SHORT = {n: r.short for n, r in SYSTEM_RECORDS.items()}
SYSTEM_COLOR = {n: r.colour for n, r in SYSTEM_RECORDS.items()}
SYSTEM_MARKER = {n: r.marker for n, r in SYSTEM_RECORDS.items()}
STATUS_SHORT = {"skipped": "skip", "gpu_oom": "OOM", "host_oom": "host OOM", "timeout": "timeout",
                "error": "error"}
TB_1_5_GIB = 1.5e12 / 2**30  # "1.5 TB" host of the paper, decimal TB -> GiB (1397 GiB)
ADAM_BYTES_PER_PARAM = 12  # fp32 master + Adam m + v

TFLOPS_FORMULA = "TFLOPS = (6·P·T + 12·L·h·s·T) / step time / 1e12"
FORMULA_NOTE = (
    TFLOPS_FORMULA + "   (P params, T tokens/step, L layers, h hidden, s seq len; "
    "activation recompute not counted).   MFU = TFLOPS / the GPU's measured peak (H200: dense bf16 "
    f"{H200_PEAK_TFLOPS} TFLOPS; a GPU without a measured peak, e.g. the H100, gets no MFU)."
)


def on_cpu(df: pd.DataFrame) -> bool:
    """Every row of ``df`` ran on a CPU (labels then say what ran: no "GPU", no TFLOPS)."""
    hw = [h for h in df["hardware"] if h] if "hardware" in df else []
    return bool(hw) and all(str(h).lower() == "cpu" for h in hw)


def system_label(system: str, df: pd.DataFrame | None = None, short: bool = False) -> str:
    return record(system).label_for("cpu" if df is not None and on_cpu(df) else "gpu", short=short)


def variant_label(variant: str) -> str:
    """'no_double_buffer' -> 'no double\nbuffer' (any variant name, no table of them)."""
    import textwrap

    return "\n".join(textwrap.wrap(variant.replace("_", " "), 12)) or variant


def status_short(r) -> str:
    """A failed row's status for tables, figures and verdicts. A timeout that the run's ``time_budget_s``
    cut short (not the point's own ``timeout_s``) is "budget cut": the system never got its full time, so
    it is not a timeout of that system."""
    st = r.get("status")
    if st == "timeout" and r.get("reason") == "budget_cut":
        return "budget cut"
    return STATUS_SHORT.get(st, st or "?")


SECTION = "§"  # a system that is not exact AdamW, compared by its mean step (registry: exact_adamw, compare_by)
PARTIAL = "◊"  # an ok row of a point that timed out: statistics of the timed steps it finished (reason "partial")


def partial_mark(r) -> str:
    return PARTIAL if r.get("reason") == "partial" else ""


def as_compared(r: pd.Series, metric: str) -> pd.Series:
    """The row as its system is compared: by the mean step time where its record says so (the metric,
    computed on the median step, scaled by median / mean; the range is left out: it spans the waits)."""
    rec = record(r["system"])
    if rec.compare_by != "mean" or r["status"] != "ok":
        return r
    med, mean = pd.to_numeric(r.get("step_time_median_s"), errors="coerce"), pd.to_numeric(
        r.get("step_time_mean_s"), errors="coerce")
    out = r.copy()
    if pd.notna(med) and pd.notna(mean) and mean > 0 and pd.notna(r[metric]):
        out[metric] = float(r[metric]) * float(med) / float(mean)
    out["step_time_min_s"] = out["step_time_max_s"] = float("nan")  # no spread: the range spans the waits
    return out


def short_sha(r) -> str:
    """The first 7 characters of a row's ``git_sha``; "" where the row has none (empty or NaN)."""
    sha = r.get("git_sha")
    return sha.strip()[:7] if isinstance(sha, str) and sha.strip() and sha != "nan" else ""


def row_settings(settings) -> dict:
    """A row's ``settings`` column (the system's options as JSON) as a dict; {} when empty or unreadable."""
    try:
        s = json.loads(settings or "{}")
    except (TypeError, ValueError):
        return {}
    return s if isinstance(s, dict) else {}


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


def _style(system: str, df: pd.DataFrame | None = None) -> tuple[str, str, str]:
    """(label, colour, marker); the label says what ran when ``df``'s rows are all from a CPU."""
    r = record(system)
    return system_label(system, df), r.colour, r.marker


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
    def uniq(col, drop=()):
        vals = [v for v in dict.fromkeys(df[col]) if v and v not in drop]
        return ", ".join(vals[:3]) + (" …" if len(vals) > 3 else "") if vals else "?"
    gpus = uniq("gpu_name", drop=("cpu",))
    device = "CPU (no GPU)" if on_cpu(df) else f"GPU: {gpus}" + (" and CPU" if (df["hardware"] == "cpu").any() else "")
    return f"{device}  ·  torch {uniq('torch_version')}  ·  git {uniq('git_sha')}  ·  {uniq('date')}"


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
        save(fig, p)
        paths.append(p)
    plt.close(fig)
    return paths


def save(fig, path, **kw) -> None:
    """``fig.savefig`` without a creation date in PDFs: an unchanged figure regenerates byte for byte (no
    churn in git)."""
    fig.savefig(path, metadata={"CreationDate": None} if str(path).endswith(".pdf") else None, **kw)


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
                unplaced.append(f"{record(system).short} {r['point']} "
                                f"({status_short(r)})")
                continue
            ax.plot([x], [y], transform=trans, marker="x", color=color, markersize=7, mew=2, ls="none",
                    clip_on=False, zorder=5)
            ax.annotate(status_short(r), (x, y), xycoords=trans,
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
        label, color, marker = _style(system, df)
        if variant:
            label += f" ({variant})"
        part = ok[ok.apply(_series_key, axis=1) == key].sort_values(xcol)
        f = df[(df.apply(_series_key, axis=1) == key) & (df["status"] != "ok")]
        if not part.empty:
            ax.plot(part[xcol], part[ycol], marker=marker, color=color, label=label, lw=1.8, ms=6,
                    zorder=3, ls="-" if not variant else "--")
        elif not f.empty and band:  # only failures: still named in the legend, so its band row says whose
            ax.plot([], [], marker="x", color=color, ls="none", mew=2, ms=7,
                    label=f"{record(system).short}{f' ({variant})' if variant else ''}: did not run (×)")
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


def hbar_panel(ax, bars: list[tuple], *, title: str, mark: float | None = None) -> None:
    """One panel of horizontal bars, the first on top (the REPORT's tables drawn: analysis/fig_same_run.py,
    fig_update_path.py). ``bars``: (label, value or None, text, colour); ``text`` goes at the bar's end, or in
    grey where the bar would be when ``value`` is None (a point that measured nothing). ``mark``: a value the
    axis must also show (a dashed target line)."""
    top = max([b[1] for b in bars if b[1] is not None] + ([mark] if mark else []) or [1.0])
    for i, (_, value, text, colour) in enumerate(bars):
        if value is not None:
            ax.barh(i, value, color=colour, height=0.72, zorder=3)
            ax.text(value + top * 0.01, i, text, va="center", ha="left", fontsize=8.5)
        else:
            ax.text(top * 0.01, i, text, va="center", ha="left", fontsize=8.5, color="#777777")
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([b[0] for b in bars], fontsize=9)
    ax.invert_yaxis()  # the first bar (the fastest) on top
    ax.set_xlim(0, top * 1.35)
    ax.grid(axis="x", color="#DDDDDD", zorder=0)
    ax.set_xlabel("training throughput (TFLOPS)")
    ax.set_title(title, fontsize=10, loc="left")


def _mfu_axis(ax, df: pd.DataFrame):
    """Right-hand MFU axis (percent of the rows' peak: the CSV's, else their GPU's measured one); none when
    the rows' GPU has no measured peak (an H100 figure gets no MFU borrowed from the H200)."""
    peaks = row_peaks(df)
    if not peaks.notna().any():
        return None
    peak = float(peaks.dropna().median())
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
