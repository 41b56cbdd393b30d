"""The update_path figures: the REPORT's "host tier's update" tables drawn, one panel per shape.

One figure per ``update_path*`` sweep folder. Each panel is one (clipping threshold, machine, shape): a
horizontal bar per variant (the CPU kernel alone, the GPU update path beside it, ...) fastest first, its
TFLOPS, its ratio to the shape's CPU path and its commit written at the bar's end (‡ = another call than the
CPU path's row), and issue 23's target as a dashed line where it applies (clipping firing, H200 rows).

    ratio = row TFLOPS / CPU path TFLOPS          (TFLOPS = (6·P·T + 12·L·h·s·T) / median step / 1e12)
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import update_path as U
from .style import FORMULA_NOTE, _finish, _new_figure, hbar_panel, short_sha, status_short

CPU_COLOUR, GPU_COLOUR, OTHER_COLOUR = "#0072B2", "#D55E00", "#999999"


def _colour(variant: str) -> str:
    return CPU_COLOUR if "_cpu" in variant else GPU_COLOUR if "hybrid" in variant else OTHER_COLOUR


def panels(df: pd.DataFrame, sweep: str):
    """(title, reference row or None, target TFLOPS or None, rows fastest first) per (clipping, machine, shape)."""
    rows = df.assign(_sweep=sweep)
    rows = rows.assign(_clip=rows.apply(U._clipping, axis=1), _t=pd.to_numeric(rows["tflops"], errors="coerce"))
    for (clipping, hw, model, tokens), g in rows.groupby(["_clip", "hardware", "model", "tokens_per_step"], sort=False):
        seq = int(g["seq_len"].iloc[0])
        target = U.TARGETS.get((model, int(tokens))) if clipping != "off" and hw == "H200" else None
        title = f"{model}, {int(tokens) // seq}×{seq} tokens per step, {hw}, clipping {clipping}"
        yield title, U._reference(g), target, g.sort_values("_t", ascending=False, na_position="last")


def fig_update_path(df: pd.DataFrame, out: Path, formats, name: str) -> list[Path]:
    found = list(panels(df, name))
    sizes = [len(g) for *_, g in found] or [1]
    fig, axes = _new_figure(nrows=max(1, len(found)), width=10.0, height=1.2 + sum(0.42 * n + 1.1 for n in sizes),
                            gridspec_kw=dict(height_ratios=sizes))
    for ax, (title, ref, target, g) in zip(axes, found):
        ref_t = float(ref["tflops"]) if ref is not None else None
        bars = []
        for _, r in g.iterrows():
            t = r["_t"] if r["status"] == "ok" and pd.notna(r["_t"]) else None
            if t is None:
                bars.append((str(r["variant"]), None, f"× {status_short(r)}  {short_sha(r)}", None))
                continue
            text = f"{t:.1f}" + (f"   {t / ref_t:.2f}×" if ref_t else "") + f"   {short_sha(r)}"
            if ref is not None and not U._same_call_here(r, ref):
                text += f" {U.OTHER_CALL}"
            bars.append((str(r["variant"]), t, text, _colour(str(r["variant"]))))
        where = f"÷ the CPU path ({ref['variant']}, {ref_t:.1f})" if ref_t else "no CPU-path row: no ratios"
        if target:
            ax.axvline(target, color="#333333", ls="--", lw=1, zorder=4)
            where += f"; issue 23's target ≥ {target:.0f} (dashed)"
        hbar_panel(ax, bars, title=f"{title}\n{where}", mark=target)
    note = (FORMULA_NOTE + "\nBlue: the CPU kernel alone (variant *_cpu, *_cpu_pinned = cores bound); orange: the GPU "
            f"update path beside it (*_hybrid*). {U.OTHER_CALL} another call than the CPU path's row. Dashed: issue "
            "23's target (clipping firing, H200).")
    return _finish(fig, df, f"The host tier's update: CPU kernel alone vs the GPU path ({name})", note, out, name,
                   formats)
