"""The systems of one shape side by side: what each costs and how it compares with MegaTrain.

Issue 24 asks for one table per shape of the ``baselines2026`` sweep: every system's TFLOPS (with the
spread of its timed steps), GPU and host peak, host bytes per parameter, and its ratio to MegaTrain
tiered (``megatrain``, variant ``default``) of the same shape. A ratio is only as good as the runs behind
it, so each line names its commit and says when it came from another call than the MegaTrain row (‡: a
different git SHA, or a date more than ``SAME_CALL_S`` away), when it is not exact AdamW (§, compared by
its mean step), when its point timed out and the value is of the steps it finished (◊), and what
configuration won for all-on-GPU (its ``auto_config`` probe) and for MegaTrain (placement, kept blocks).

    ratio = system TFLOPS / MegaTrain TFLOPS          (TFLOPS = (6·P·T + 12·L·h·s·T) / step time / 1e12)
    host bytes/param = host peak RSS / P
"""
from __future__ import annotations

import pandas as pd

from baselines.registry import SYSTEMS, record

from .style import PARTIAL, SECTION as NOT_EXACT, as_compared, partial_mark, row_settings, short_sha, status_short

SWEEPS = ("baselines2026",)          # sweeps that get the table (and their machine folders, baselines2026_h100)
REFERENCE = ("megatrain", "default")  # the row every ratio divides by
SAME_CALL_S = 3600                    # rows written within an hour of the reference (and same SHA): one call
OTHER_CALL = "‡"


def _num(v) -> float | None:
    v = pd.to_numeric(v, errors="coerce")
    return None if pd.isna(v) else float(v)


def _compared_tflops(r: pd.Series) -> float | None:
    """TFLOPS as the system is compared (``style.as_compared``: by the mean step for ZenFlow)."""
    return _num(as_compared(r, "tflops").get("tflops"))


def _close_in_time(r: pd.Series, ref: pd.Series) -> bool:
    """Both rows written within ``SAME_CALL_S`` of each other."""
    a, b = pd.to_datetime(r.get("date"), errors="coerce"), pd.to_datetime(ref.get("date"), errors="coerce")
    return pd.notna(a) and pd.notna(b) and abs((a - b).total_seconds()) <= SAME_CALL_S


def _same_call(r: pd.Series, ref: pd.Series) -> bool:
    return short_sha(r) == short_sha(ref) and _close_in_time(r, ref)


def _config(r: pd.Series) -> str:
    """What configuration the row ran: the probe's winner (all-on-GPU), the placement (MegaTrain)."""
    s = row_settings(r.get("settings"))
    if r["system"] == "native" and isinstance(s.get("auto_config"), dict):
        return f"best of probe: {s['auto_config'].get('winner', '?')}"
    if r["system"] == "megatrain":
        layers, gpu = _num(r.get("num_layers")), _num(r.get("gpu_tier_layers"))
        kept, blocks = _num(r.get("blocks_kept")), _num(r.get("blocks"))
        parts = []
        if layers is not None and gpu is not None:
            parts.append(f"{gpu:.0f}/{layers:.0f} layers on the GPU tier")
        if kept is not None and blocks:
            parts.append(f"{kept:.0f}/{blocks:.0f} blocks kept")
        return ", ".join(parts)
    if not record(r["system"]).exact_adamw:
        keys = ("topk_ratio", "update_interval", "overlap_step", "pin_memory")
        return "not exact AdamW: " + ", ".join(f"{k} {s[k]}" for k in keys if k in s)
    return ""


def _gib(v) -> str:
    v = _num(v)
    return f"{v:.1f}" if v is not None else "—"


def is_sweep(sweep: str) -> bool:
    """A sweep that gets the table: one of ``SWEEPS`` or its machine folder (baselines2026_h100)."""
    return any(sweep == s or sweep.startswith(s + "_") for s in SWEEPS)


def shapes(df: pd.DataFrame, need_reference: bool = True):
    """(model, tokens per step, seq len, reference row or None, rows) per shape of ``df`` (latest rows), the rows
    fastest first as compared (column ``_t``: ``style.as_compared`` TFLOPS; failures last). ``need_reference``:
    only shapes with an ok MegaTrain tiered row (what a ratio divides by)."""
    rank = {s: i for i, s in enumerate(SYSTEMS)}
    for (model, tokens), g in df.groupby(["model", "tokens_per_step"], sort=False):
        refs = g[(g["system"] == REFERENCE[0]) & (g["variant"] == REFERENCE[1]) & (g["status"] == "ok")]
        if refs.empty and need_reference:
            continue
        ref = refs.iloc[-1] if not refs.empty else None
        g = g.assign(_t=g.apply(_compared_tflops, axis=1), _rank=g["system"].map(rank))
        g = g.sort_values(["_t", "_rank"], ascending=[False, True], na_position="last")
        yield model, int(tokens), int(g["seq_len"].iloc[0]), ref, g


def system_name(r: pd.Series) -> str:
    """"ZenFlow · unpinned": the system's short name, and its variant unless it is the default."""
    return record(r["system"]).short + ("" if r["variant"] in ("default", "") else f" · {r['variant']}")


def marks(r: pd.Series) -> str:
    """§ (not exact AdamW, compared by its mean step) and ◊ (partial) of a row."""
    return (NOT_EXACT if not record(r["system"]).exact_adamw else "") + partial_mark(r)


def table_lines(sweep: str, df: pd.DataFrame) -> list[str]:
    """One table per (model, tokens per step) of ``df`` (latest rows) that has an ok reference row."""
    if not is_sweep(sweep) or df.empty:
        return []
    out = []
    for model, tokens, seq, ref, g in shapes(df):
        ref_t = _compared_tflops(ref)
        out += [f"#### {sweep}: {model}, {tokens // seq}×{seq} tokens per step, every system against MegaTrain", "",
                "| system | TFLOPS (range) | ÷ MegaTrain | GPU peak (GiB) | host peak (GiB) | host B/param | commit | "
                "configuration |", "|---|---|---|---|---|---|---|---|"]
        for _, r in g.iterrows():
            name, marks_ = system_name(r), marks(r)
            if r["status"] == "ok" and r["_t"] is not None and pd.notna(r["_t"]):
                c = as_compared(r, "tflops")  # a by-mean system has no range: it would span its waits
                lo, hi = _num(c.get("step_time_min_s")), _num(c.get("step_time_max_s"))
                med = _num(r.get("step_time_median_s"))
                rng = f" ({r['_t'] * med / hi:.0f}–{r['_t'] * med / lo:.0f})" if lo and hi and med else ""
                value, ratio = f"{r['_t']:.1f}{marks_}{rng}", f"{r['_t'] / ref_t:.2f}×"
            else:
                value, ratio = f"*{status_short(r)}*", "—"
            commit = short_sha(r) + ("" if _same_call(r, ref) else f" {OTHER_CALL}")
            gpu = r.get("gpu_peak_reserved_gib")
            out.append(f"| {name} | {value} | {ratio} | {_gib(gpu)} | {_gib(r.get('host_peak_rss_gib'))} | "
                       f"{_gib(r.get('host_bytes_per_param'))} | {commit} | {_config(r)} |")
        out += ["", f"Ratios divide by MegaTrain tiered's {ref_t:.1f} TFLOPS ({short_sha(ref)}, {str(ref['date'])[:16]}). "
                f"{OTHER_CALL} = another call than that row (other commit or time): its ratio spans two machines' "
                f"runs. {NOT_EXACT} = not exact AdamW, compared by its mean step time (no range: it spans its "
                f"periodic waits). {PARTIAL} = timed out after most of its timed steps; the value is those steps'. "
                "Host B/param = host peak RSS / parameters (12 = fp32 master + m + v).", ""]
    return out
