"""The baselines2026 figure: the REPORT's same-run table drawn, one panel per shape, every system a bar.

Each panel is one (model, tokens per step) of the sweep: horizontal bars fastest first, each system in its
registry colour, its compared TFLOPS and its ratio to MegaTrain tiered written at the bar's end (the numbers
of ``analysis.same_run``'s table: § = not exact AdamW, by its mean step; ◊ = partial; ‡ = another call than
MegaTrain's row), a failed point as its reason in grey where its bar would be. A shape without a MegaTrain
row still gets its panel, values without ratios.

    ratio = system TFLOPS / MegaTrain TFLOPS     (TFLOPS = (6·P·T + 12·L·h·s·T) / step time / 1e12)
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import same_run
from .style import FORMULA_NOTE, PARTIAL, SECTION, _finish, _new_figure, hbar_panel, record, short_sha, status_short


def fig_same_run(df: pd.DataFrame, out: Path, formats, name: str) -> list[Path]:
    panels = list(same_run.shapes(df, need_reference=False))
    n_bars = [len(g) for *_, g in panels] or [1]
    fig, axes = _new_figure(nrows=max(1, len(panels)), width=10.0,
                            height=1.2 + sum(0.42 * n + 0.9 for n in n_bars),
                            gridspec_kw=dict(height_ratios=n_bars))
    for ax, (model, tokens, seq, ref, g) in zip(axes, panels):
        ref_t = same_run._compared_tflops(ref) if ref is not None else None
        bars = []
        for _, r in g.iterrows():
            t = r["_t"] if r["status"] == "ok" and pd.notna(r["_t"]) else None
            if t is None:
                bars.append((same_run.system_name(r), None, f"× {status_short(r)}", None))
                continue
            text = f"{t:.1f}{same_run.marks(r)}" + (f"   {t / ref_t:.2f}×" if ref_t else "")
            if ref is not None and not same_run._same_call(r, ref):
                text += f"  {same_run.OTHER_CALL} {short_sha(r)}"
            bars.append((same_run.system_name(r), t, text, record(r["system"]).colour))
        where = (f"÷ MegaTrain tiered's {ref_t:.1f} ({short_sha(ref)})" if ref_t
                 else "no MegaTrain row at this shape: no ratios")
        hbar_panel(ax, bars, title=f"{model}, {tokens // seq}×{seq} tokens per step — {where}")
    note = (FORMULA_NOTE + f"\n{SECTION} not exact AdamW, by its mean step (its periodic waits included). "
            f"{PARTIAL} timed out after most of its timed steps (those steps'). {same_run.OTHER_CALL} another call "
            "than MegaTrain's row (other commit or more than an hour apart): that ratio spans runs. "
            "× a point that measured nothing, with the reason.")
    return _finish(fig, df, f"Every system against MegaTrain, one shape per panel ({name})", note, out, name, formats)
