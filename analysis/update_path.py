"""The host tier's update, CPU kernel alone against the GPU update path beside it: one table per shape.

Issue 23 asks for rows of the ``update_path`` sweeps (clipping firing: ``update_path``; not firing:
``update_path_noclip``; another commit's or machine's rows of the same points: ``update_path_<suffix>``; each
table says the clipping threshold its rows ran with) in one run with the
CPU-only path, with the host update's keys per timed step (schema v4 columns, medians over the timed steps of
the engine's phases): ``cpu_groups`` / ``gpu_path_groups`` (host-tier groups each path updated),
``host_update_busy_s`` (the CPU worker's busy time) and ``optimizer_exposed_s`` (what the next forward waited
for the update). Each table divides by the CPU path of its shape (variant ``*_cpu_pinned``: the CPU kernel
with its cores bound, the default; else ``*_cpu``) in the same sweep, marks rows of another call (‡) and says
whether issue 23's target for the shape is met (clipping on, H200 rows only: the targets are that machine's).

    ratio = row TFLOPS / CPU path TFLOPS          (TFLOPS = (6·P·T + 12·L·h·s·T) / median step / 1e12)
"""
from __future__ import annotations

import pandas as pd

from .same_run import OTHER_CALL, _close_in_time, _num, _same_call
from .style import short_sha

CLIP, NOCLIP = "update_path", "update_path_noclip"  # other update_path_* folders: another commit or machine
# Issue 23's targets with clipping firing: (model, tokens per step) -> TFLOPS
TARGETS = {("qwen2.5-14b", 16384): 370.0, ("qwen2.5-3b", 16384): 260.0, ("qwen2.5-7b", 8192): 200.0}
NO_CLIP_NORM = 1e8  # a max_grad_norm this large never clips: the no-clipping runs use 1e9


def _is_sweep(sweep: str) -> bool:
    return sweep == CLIP or sweep.startswith(CLIP + "_")


def _reference(g: pd.DataFrame) -> pd.Series | None:
    """The CPU path's latest ok row of a shape (cores bound first: the engine's default since a9736ef)."""
    ok = g[g["status"] == "ok"]
    for suffix in ("_cpu_pinned", "_cpu"):
        refs = ok[ok["variant"].str.endswith(suffix)]
        if not refs.empty:
            return refs.iloc[-1]
    return None


def _fmt(v, digits: int) -> str:
    v = _num(v)
    return "—" if v is None else f"{v:.{digits}f}"


def _same_call_here(r: pd.Series, ref: pd.Series) -> bool:
    """``same_run._same_call``; a row of another commit's folder (``update_path_<sha>``, run by that commit's own
    runner in the same device call, interleaved) counts by its time alone."""
    return _same_call(r, ref) if r["_sweep"] == ref["_sweep"] else _close_in_time(r, ref)


def _clipping(r: pd.Series) -> str:
    mgn = _num(r.get("max_grad_norm"))
    return f"at max_grad_norm {mgn:g}" if mgn and mgn < NO_CLIP_NORM else "off"


def table_lines(frames: dict[str, pd.DataFrame]) -> list[str]:
    """The section: one table per (clipping threshold, machine, shape) over every update_path* sweep in
    ``frames`` (latest rows), rows of other folders (another commit's, ``update_path_<sha>``) beside the
    CPU path of the main one."""
    order = sorted((s for s in frames if _is_sweep(s)), key=lambda s: (s != CLIP, s != NOCLIP, s))
    if not order:
        return []
    rows = pd.concat([frames[s].assign(_sweep=s) for s in order], ignore_index=True)
    rows = rows.assign(_clip=rows.apply(_clipping, axis=1), _t=pd.to_numeric(rows["tflops"], errors="coerce"))
    out = []
    for (clipping, hw, model, tokens), g in rows.groupby(["_clip", "hardware", "model", "tokens_per_step"], sort=False):
        ref = _reference(g)
        if ref is None:
            continue
        ref_t, seq = float(ref["tflops"]), int(ref["seq_len"])
        out += [f"#### {model}, {int(tokens) // seq}×{seq} tokens per step, {hw}, clipping {clipping} "
                f"({', '.join(f'`{x}`' for x in dict.fromkeys(g['_sweep']))})", "",
                "| variant | TFLOPS (range) | ÷ CPU path | clipped / timed | CPU groups | GPU-path groups | "
                "host update busy (s) | exposed (s) | predicted step (s) | measured step (s) | commit |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for _, r in g.sort_values("_t", ascending=False).iterrows():
            if r["status"] == "ok" and pd.notna(r["_t"]):
                lo, hi, med = (_num(r.get(k)) for k in ("step_time_min_s", "step_time_max_s", "step_time_median_s"))
                rng = f" ({r['_t'] * med / hi:.0f}–{r['_t'] * med / lo:.0f})" if lo and hi and med else ""
                value, ratio = f"{r['_t']:.1f}{rng}", f"{r['_t'] / ref_t:.2f}×"
            else:
                value, ratio = f"*{r['status']}*", "—"
            clipped = f"{_fmt(r.get('steps_clipped'), 0)} / {_fmt(r.get('timed_steps'), 0)}"
            commit = short_sha(r) + ("" if _same_call_here(r, ref) else f" {OTHER_CALL}")
            out.append(f"| {r['variant']} | {value} | {ratio} | {clipped} | {_fmt(r.get('cpu_groups'), 1)} | "
                       f"{_fmt(r.get('gpu_path_groups'), 1)} | {_fmt(r.get('host_update_busy_s'), 2)} | "
                       f"{_fmt(r.get('optimizer_exposed_s'), 2)} | {_fmt(r.get('predicted_step_s'), 2)} | "
                       f"{_fmt(r.get('step_time_median_s'), 2)} | {commit} |")
        out += [""] + (_target_line(model, int(tokens), g) if clipping != "off" and hw == "H200" else []) + [
            f"Ratios divide by the CPU path ({ref['variant']}, {ref_t:.1f} TFLOPS, {short_sha(ref)}); "
            f"{OTHER_CALL} = another call than that row. Groups, busy and exposed: medians over the timed steps "
            "(schema v4 columns; empty for rows measured before them whose point folder is gone).", ""]
    if out:
        out = ["### The host tier's update: CPU kernel alone vs the GPU update path beside it", ""] + out
    return out


def _target_line(model: str, tokens: int, g: pd.DataFrame) -> list[str]:
    """Issue 23's target for the shape (clipping on, H200 rows: the targets are that machine's)."""
    target = TARGETS.get((model, tokens))
    if target is None:
        return []
    best = g[(g["status"] == "ok") & g["_t"].notna()].sort_values("_t", ascending=False)
    if best.empty:
        return [f"Issue 23's target with clipping firing: ≥ {target:.0f} TFLOPS; no row measured.", ""]
    top = best.iloc[0]
    gap = top["_t"] / target - 1
    verdict = "met" if gap >= 0 else f"missed by {-gap:.1%}"
    return [f"Issue 23's target with clipping firing: ≥ {target:.0f} TFLOPS; best row {top['variant']} "
            f"{top['_t']:.1f} ({short_sha(top)}): {verdict}.", ""]
