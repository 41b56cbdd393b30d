"""Markdown report: our results next to the paper's claims.

    python -m experiments.report [--results results] [--out results/REPORT.md]
                                 [--claims experiments/data/paper_claims.yaml] [--plots plots]

Reads ``<results>/<sweep>/results.csv`` (whichever exist) and the claims file, and writes one
Markdown file: environment, formulas, a claims table (paper value, ours, hardware difference,
verdict), a compact table per sweep and the list of failed points. No torch, no matplotlib.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pandas as pd
import yaml

from experiments.plots import (
    ABLATION_VARIANTS, FIGURES, H200_PEAK_TFLOPS, HARDWARE_ORDER, SAMPLE_GPU, SAMPLE_SHA, STATUS_SHORT, SWEEPS,
    SYSTEM_SHORT, SYSTEMS, TB_1_5_GIB, TFLOPS_FORMULA, fill_x_from_point, fmt_params, fmt_tokens, formula_tflops,
    load_results,
)

CLAIMS_PATH = Path(__file__).parent / "data" / "paper_claims.yaml"
PARAMS_TOL = 0.15  # params_b matches the nearest size within 15 %
OOM = ("gpu_oom", "host_oom")
SECTION_TITLES = {
    "size": "Model size (headline numbers)",
    "depth": "Depth (hidden 3584, FFN 18944)",
    "width": "Width",
    "context": "Context length (7B)",
    "hardware": "Other GPUs (our runs: emulated profiles on the H200)",
    "ablation": "Ablation (14B)",
    "reference": "Reference baselines on our machine",
}


class ClaimsError(ValueError):
    """The claims file is malformed."""


def load_claims(path: str | Path = CLAIMS_PATH) -> dict:
    path = Path(path)
    with path.open() as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict) or not isinstance(data.get("claims"), list):
        raise ClaimsError(f"{path}: expected a mapping with a 'claims' list")
    for c in data["claims"]:
        for key in ("id", "section", "claim", "paper", "compare", "system"):
            if key not in c:
                raise ClaimsError(f"{path}: claim {c.get('id', c)!r} lacks '{key}'")
        if c["compare"] not in ("absolute", "ratio", "relative", "status", "trains"):
            raise ClaimsError(f"{path}: claim {c['id']}: unknown compare {c['compare']!r}")
    return data


# ----------------------------------------------------------------------------------------------
# selecting rows
# ----------------------------------------------------------------------------------------------

def _all_rows(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    if not frames:
        return pd.DataFrame()
    parts = []
    for sweep, df in frames.items():
        d = df.copy()
        d["_sweep"] = sweep
        d["_params"] = fill_x_from_point(d, "num_params")
        parts.append(d)
    return pd.concat(parts, ignore_index=True)


def _match(df: pd.DataFrame, where: dict) -> pd.DataFrame:
    m = pd.Series(True, index=df.index)
    where = dict(where or {})
    if "hardware" not in where:
        m &= ~df["emulated"].astype(bool)
    if "variant" not in where:
        m &= df["variant"].isin(["default", "full", ""])
    for key, val in where.items():
        if key == "params_b":
            continue
        if key not in df.columns:
            raise ClaimsError(f"unknown filter column {key!r}")
        if isinstance(val, str):
            m &= df[key].astype(str) == val
        else:
            m &= (pd.to_numeric(df[key], errors="coerce") - float(val)).abs() <= 1e-6 * max(1.0, abs(float(val)))
    out = df[m]
    if "params_b" in where and not out.empty:
        target = float(where["params_b"]) * 1e9
        rel = (out["_params"] - target).abs() / target
        out = out[rel <= PARAMS_TOL]
        if not out.empty:  # nearest size only
            rel = rel[out.index]
            out = out[rel <= rel.min() + 1e-9]
    return out


def _find(rows: pd.DataFrame, claim: dict, system: str, where: dict) -> tuple[pd.Series | None, int]:
    """Best row for ``system`` under ``where`` (first sweep with a match; ok rows first, then max
    metric). Returns (row or None, number of candidate rows)."""
    if rows.empty:
        return None, 0
    metric = claim.get("metric", "tflops")
    sweeps = claim.get("sweeps") or list(SWEEPS)
    for sweep in sweeps:
        cand = rows[(rows["_sweep"] == sweep) & (rows["system"] == system)]
        cand = _match(cand, where)
        if cand.empty:
            continue
        ok = cand[(cand["status"] == "ok") & cand[metric].notna()]
        if not ok.empty:
            return ok.loc[ok[metric].idxmax()], len(cand)
        return cand.iloc[0], len(cand)
    return None, 0


def _same_point(rows: pd.DataFrame, r: pd.Series, system: str) -> pd.Series | None:
    c = rows[(rows["_sweep"] == r["_sweep"]) & (rows["point"] == r["point"]) & (rows["system"] == system)
             & (rows["hardware"] == r["hardware"]) & rows["variant"].isin(["default", "full", ""])]
    if c.empty:
        return None
    ok = c[c["status"] == "ok"]
    return (ok if not ok.empty else c).iloc[0]


# ----------------------------------------------------------------------------------------------
# formatting
# ----------------------------------------------------------------------------------------------

def _is_sample_row(r) -> bool:
    return r is not None and (r.get("git_sha") == SAMPLE_SHA or r.get("gpu_name") == SAMPLE_GPU)


def _where_text(r: pd.Series) -> str:
    bits = [f"{r['_sweep']}/{r['point']}"]
    if r["variant"] not in ("default", ""):
        bits.append(r["variant"])
    return ", ".join(bits)


def _status_text(r: pd.Series) -> str:
    st = STATUS_SHORT.get(r["status"], r["status"])
    err = str(r.get("error") or "").strip()
    return f"{st}" + (f" ({_short(err, 70)})" if err else "")


def _short(s: str, n: int) -> str:
    s = " ".join(str(s).split()).replace("|", "/")
    return s if len(s) <= n else s[: n - 1] + "…"


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _value_verdict(ours: float, paper: float, tol: float, lower_bound: bool = False) -> str:
    d = ours / paper - 1
    if lower_bound and ours >= paper:
        return f"matched (≥ {paper:g}; {_pct(d)})"
    if abs(d) <= tol:
        return f"matched ({_pct(d)})"
    if d < 0:
        return f"missed by {abs(d) * 100:.0f}%"
    return f"exceeded by {d * 100:.0f}%"


def _ours_hw(r: pd.Series | None, rows: pd.DataFrame) -> str:
    if r is None:
        gpus = [g for g in dict.fromkeys(rows.get("gpu_name", pd.Series(dtype=str))) if g] if not rows.empty else []
        return ", ".join(gpus[:2]) or "?"
    gpu = r.get("gpu_name") or "?"
    if r.get("emulated"):
        return f"{r['hardware']} emulated on {gpu}"
    hw = r.get("hardware") or ""
    return gpu if not hw or hw in gpu else f"{hw} ({gpu})"


VERDICT_KINDS = ("matched", "missed", "exceeded", "not measured", "not comparable", "differs")


def _verdict_kind(v: str) -> str:
    return next((k for k in VERDICT_KINDS if v.startswith(k)), v)


def _hw_short(hw_names: dict, key: str) -> str:
    v = hw_names.get(key, key)
    return v[0] if isinstance(v, (list, tuple)) else str(v)


def _hw_long(hw_names: dict, key: str) -> str:
    v = hw_names.get(key, key)
    return v[1] if isinstance(v, (list, tuple)) and len(v) > 1 else str(v)


def _host_ram(r) -> float | None:
    v = r.get("host_ram_gib") if r is not None else None
    return float(v) if v is not None and pd.notna(v) else None


# ----------------------------------------------------------------------------------------------
# evaluating claims
# ----------------------------------------------------------------------------------------------

def evaluate_claim(claim: dict, rows: pd.DataFrame, tol: float, hw_names: dict) -> dict:
    """One report row: {'claim', 'paper', 'ours', 'hardware', 'verdict', 'sample'}."""
    metric = claim.get("metric", "tflops")
    unit = "TFLOPS" if metric == "tflops" else metric
    paper = claim["paper"]
    paper_hw = _hw_short(hw_names, claim.get("paper_hardware", "?"))
    compare = claim["compare"]
    where = dict(claim.get("where") or {})
    out = {"id": claim["id"], "claim": claim["claim"], "section": claim["section"], "sample": False,
           "source": claim.get("source")}
    paper_text = str(claim.get("paper_text", paper))
    systems = claim["system"] if isinstance(claim["system"], list) else [claim["system"]]
    r, _ = _find(rows, claim, systems[0], where)
    out["hardware"] = f"paper: {paper_hw} → ours: {_ours_hw(r, rows)}"
    emulated = bool(r is not None and r.get("emulated"))
    out["sample"] = _is_sample_row(r)

    if compare == "absolute":
        out["paper"] = f"{paper_text} {unit}"
        if r is None:
            out.update(ours="not measured", verdict="not measured")
            return out
        if r["status"] != "ok" or pd.isna(r[metric]):
            out.update(ours=f"{_status_text(r)} [{_where_text(r)}]",
                       verdict=f"missed ({STATUS_SHORT.get(r['status'], r['status'])})"
                       if r["status"] in OOM + ("error", "timeout") else "not measured (skipped)")
            return out
        ours = float(r[metric])
        txt = f"{ours:.1f} {unit}"
        z = _same_point(rows, r, "zero3") if r["system"] == "megatrain" else None
        if z is not None:
            if z["status"] == "ok" and pd.notna(z[metric]) and z[metric] > 0:
                txt += f" (= {ours / float(z[metric]):.2f}× ZeRO-3 in the same run)"
            else:
                txt += f" (ZeRO-3 in the same run: {STATUS_SHORT.get(z['status'], z['status'])})"
        out["ours"] = f"{txt} [{_where_text(r)}]"
        v = _value_verdict(ours, float(paper), tol, bool(claim.get("paper_min")))
        if emulated:
            v = f"not comparable (emulated profile, H200 compute; {v})"
        out["verdict"] = v
        return out

    if compare == "ratio":
        base = claim["baseline"]
        out["paper"] = f"{float(paper):.2f}×"
        if r is None:
            out.update(ours="not measured", verdict="not measured")
            return out
        b = _same_point(rows, r, base)
        bname = SYSTEM_SHORT.get(base, base)
        if r["status"] != "ok" or pd.isna(r[metric]):
            out.update(ours=f"MegaTrain {_status_text(r)} [{_where_text(r)}]",
                       verdict="missed (MegaTrain did not run)" if r["status"] != "skipped" else
                       "not measured (skipped)")
            return out
        if b is None:
            out.update(ours=f"{r[metric]:.1f} {unit}; {bname} not in this sweep [{_where_text(r)}]",
                       verdict="not measured")
            return out
        if b["status"] != "ok" or pd.isna(b[metric]) or b[metric] <= 0:
            st = STATUS_SHORT.get(b["status"], b["status"])
            out["ours"] = f"{r[metric]:.1f} {unit} vs {bname} {st} → ∞ [{_where_text(r)}]"
            out["verdict"] = (f"exceeded ({bname} {st}, MegaTrain ran)" if b["status"] in OOM
                              else f"not comparable ({bname} {st})")
            if emulated:
                out["verdict"] += "; emulated profile"
            return out
        ratio = float(r[metric]) / float(b[metric])
        out["ours"] = f"{ratio:.2f}× ({r[metric]:.1f} / {b[metric]:.1f} {unit}) [{_where_text(r)}]"
        v = _value_verdict(ratio, float(paper), tol)
        out["verdict"] = v + ("; emulated profile" if emulated else "")
        out["sample"] = out["sample"] or _is_sample_row(b)
        return out

    if compare == "relative":
        ref_where = {**where, **(claim.get("reference") or {})}
        pref = float(claim["paper_reference"])
        pr = float(paper) / pref
        ref_label = ", ".join(f"{k}={v}" for k, v in (claim.get("reference") or {}).items())
        out["paper"] = f"{paper_text} {unit} ({pr:.3f}× of {pref:g}, {_pct(pr - 1)})"
        if r is None:
            out.update(ours="not measured", verdict="not measured")
            return out
        claim_same_sweep = {**claim, "sweeps": [r["_sweep"]]}
        ref, _ = _find(rows, claim_same_sweep, r["system"], ref_where)
        if r["status"] != "ok" or pd.isna(r[metric]):
            out.update(ours=f"{_status_text(r)} [{_where_text(r)}]",
                       verdict=f"missed ({STATUS_SHORT.get(r['status'], r['status'])})"
                       if r["status"] in OOM + ("error", "timeout") else "not measured (skipped)")
            return out
        if ref is None or ref["status"] != "ok" or pd.isna(ref[metric]) or ref[metric] <= 0:
            out.update(ours=f"{r[metric]:.1f} {unit}; reference ({ref_label}) "
                            f"{'absent' if ref is None else _status_text(ref)} [{_where_text(r)}]",
                       verdict="not comparable (no reference point)")
            return out
        ratio = float(r[metric]) / float(ref[metric])
        out["ours"] = (f"{r[metric]:.1f} {unit} ({ratio:.3f}× of {ref[metric]:.1f}, {_pct(ratio - 1)}) "
                       f"[{_where_text(r)}]")
        out["verdict"] = _value_verdict(ratio, pr, tol) + " (on the ratio)"
        out["sample"] = out["sample"] or _is_sample_row(ref)
        return out

    if compare == "status":
        out["paper"] = "OOM" if len(systems) == 1 else "all OOM"
        parts, oks, ooms, missing, other = [], 0, 0, 0, 0
        hw_row = None
        for s in systems:
            rs, _ = _find(rows, claim, s, where)
            name = SYSTEM_SHORT.get(s, s)
            if rs is None:
                parts.append(f"{name}: not measured")
                missing += 1
                continue
            hw_row = hw_row if hw_row is not None else rs
            out["sample"] = out["sample"] or _is_sample_row(rs)
            if rs["status"] == "ok":
                parts.append(f"{name}: ran, {rs[metric]:.1f} {unit}")
                oks += 1
            elif rs["status"] in OOM:
                parts.append(f"{name}: {STATUS_SHORT[rs['status']]}")
                ooms += 1
            else:
                parts.append(f"{name}: {_status_text(rs)}")
                other += 1
        if hw_row is not None:
            out["hardware"] = f"paper: {paper_hw} → ours: {_ours_hw(hw_row, rows)}"
        out["ours"] = "; ".join(parts) + (f" [{hw_row['_sweep']}/{hw_row['point']}]" if hw_row is not None else "")
        if ooms == len(systems):
            out["verdict"] = "matched"
        elif oks:
            out["verdict"] = f"differs ({oks} of {len(systems)} ran)"
        elif missing == len(systems):
            out["verdict"] = "not measured"
        else:
            out["verdict"] = (f"matched for {ooms} of {len(systems)}; rest not measured" if ooms
                              else "not measured (skipped/error)")
        return out

    if compare == "trains":
        out["paper"] = "trains"
        if r is None:
            out.update(ours="not measured", verdict="not measured")
            return out
        est = r.get("host_estimate_gib")
        est_txt = f"; engine host estimate {est:,.0f} GiB" if pd.notna(est) else ""
        if r["status"] == "ok":
            out["ours"] = f"trained, {r[metric]:.1f} {unit}{est_txt} [{_where_text(r)}]"
            out["verdict"] = "matched" + ("; emulated profile" if emulated else "")
            return out
        ram = _host_ram(r)
        out["ours"] = f"{_status_text(r)}{est_txt} [{_where_text(r)}]"
        if r["status"] in ("host_oom", "skipped") and ram is not None and pd.notna(est) and est > ram:
            fits = "fits" if est <= TB_1_5_GIB else "would not fit"
            out["verdict"] = (f"not comparable (needs ~{est:,.0f} GiB host RAM, this host has {ram:,.0f} GiB; "
                              f"{fits} in 1.5 TB)")
        elif r["status"] == "skipped":
            out["verdict"] = "not measured (skipped)"
        else:
            out["verdict"] = f"missed ({STATUS_SHORT.get(r['status'], r['status'])})"
        return out
    raise ClaimsError(f"claim {claim['id']}: unknown compare {compare!r}")


# ----------------------------------------------------------------------------------------------
# sections
# ----------------------------------------------------------------------------------------------

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
        body.append([sweep, str(len(df)), str(ok), str(len(df) - ok), _uniq(df["gpu_name"]),
                     _uniq(df["driver"]), _uniq(df["torch_version"]), _uniq(df["transformers_version"]),
                     _uniq(df["deepspeed_version"]), _uniq(df["git_sha"]), _uniq(df["host_ram_gib"].map(
                         lambda v: f"{v:,.0f}" if pd.notna(v) else None)), span])
    lines += _md_table(["sweep", "rows", "ok", "failed", "GPU", "driver", "torch", "transformers", "deepspeed",
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
        f"- **MFU = TFLOPS / peak**, peak = `peak_tflops` column (H200: measured dense bf16 {H200_PEAK_TFLOPS} "
        "TFLOPS).",
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
                         f"(e.g. {', '.join(f'{r._sweep}/{r.point}/{r.system}' for r in bad.head(5).itertuples())}); "
                         "the harness may count FLOPs differently.")
    return lines + [""]


def _axis(sweep: str, df: pd.DataFrame) -> tuple[pd.Series, callable]:
    """(column-key series, label function) for the sweep's x axis."""
    if sweep == "size":
        return fill_x_from_point(df, "num_params"), lambda v: fmt_params(v) if pd.notna(v) else "?"
    if sweep == "depth":
        return fill_x_from_point(df, "num_layers"), lambda v: f"L{int(v)}" if pd.notna(v) else "?"
    if sweep == "width":
        return fill_x_from_point(df, "width_mult"), lambda v: f"{v:g}×" if pd.notna(v) else "?"
    if sweep == "context":
        return fill_x_from_point(df, "seq_len"), lambda v: fmt_tokens(v) if pd.notna(v) else "?"
    if sweep == "tokens":
        return fill_x_from_point(df, "tokens_per_step"), lambda v: fmt_tokens(v) if pd.notna(v) else "?"
    if sweep == "hardware":
        p = fill_x_from_point(df, "num_params")
        key = df["hardware"] + " · " + p.map(lambda v: fmt_params(v) if pd.notna(v) else "?")
        return key, str
    return df["point"], str


def _cell(r: pd.Series, metric: str) -> str:
    if r["status"] == "ok" and pd.notna(r[metric]):
        v = float(r[metric])
        return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    return f"*{STATUS_SHORT.get(r['status'], r['status'])}*"


def _sweep_table(sweep: str, df: pd.DataFrame) -> list[str]:
    metric = "tokens_per_s" if sweep == "smoke" else "tflops"
    unit = "tokens/s" if sweep == "smoke" else "TFLOPS"
    lines = [f"### {sweep}", ""]
    df = df.copy()
    # one column per setup (model, batch, hardware): variants / systems are compared within it
    setup = df.apply(lambda r: f"{r['model']} {int(float(r['batch_size']))}×{int(float(r['seq_len']))} "
                     f"{r['hardware']}", axis=1) if len(df) else df["point"]
    if sweep == "ablation":
        rows_key = df["system"].map(lambda s: SYSTEM_SHORT.get(s, s)) + " · " + df["variant"]
        cols_key, lab = setup, str
        order_cols = list(dict.fromkeys(cols_key))
    elif sweep == "baselines":
        rows_key = df["system"].map(lambda s: SYSTEM_SHORT.get(s, s))
        cols_key, lab = setup, str
        order_cols = list(dict.fromkeys(cols_key))
    else:
        rows_key = df.apply(lambda r: SYSTEM_SHORT.get(r["system"], r["system"]) +
                            ("" if r["variant"] in ("default", "full", "") else f" · {r['variant']}"), axis=1)
        cols_key, lab = _axis(sweep, df)
        if sweep == "hardware":
            order_cols = list(dict.fromkeys(cols_key.iloc[
                sorted(range(len(df)), key=lambda i: (fill_x_from_point(df, "num_params").iloc[i],
                                                      _hw_order(df["hardware"].iloc[i])))]))
        else:
            order_cols = sorted(cols_key.dropna().unique())
    df["_r"], df["_c"] = rows_key.values, cols_key.values
    sys_order = {SYSTEM_SHORT[s]: i for i, s in enumerate(SYSTEMS)}
    var_order = {v: i for i, v in enumerate(ABLATION_VARIANTS)}
    row_keys = sorted(dict.fromkeys(df["_r"]), key=lambda k: (
        sys_order.get(k.split(" · ")[0], 99), var_order.get(k.split(" · ")[-1], 99) if " · " in k else -1, k))
    body = []
    for rk in row_keys:
        line = [rk]
        for ck in order_cols:
            m = df[(df["_r"] == rk) & (df["_c"] == ck)]
            line.append(_cell(m.iloc[-1], metric) if not m.empty else "")
        body.append(line)
    # MegaTrain ÷ ZeRO-3 at each column, the hardware-robust number
    if sweep not in ("ablation",) and "MegaTrain" in row_keys and "ZeRO-3" in row_keys:
        line = ["**MegaTrain ÷ ZeRO-3**"]
        for ck in order_cols:
            a = df[(df["_r"] == "MegaTrain") & (df["_c"] == ck) & (df["status"] == "ok")][metric]
            b = df[(df["_r"] == "ZeRO-3") & (df["_c"] == ck) & (df["status"] == "ok")][metric]
            line.append(f"{float(a.iloc[0]) / float(b.iloc[0]):.2f}×" if len(a) and len(b) and b.iloc[0] > 0 else "")
        body.append(line)
    if sweep == "ablation":
        full = df[(df["variant"] == "full") & (df["status"] == "ok")]
        for ck in order_cols:
            fv = full[full["_c"] == ck][metric]
            if fv.empty:
                continue
            for line, rk in zip(body, row_keys):
                i = order_cols.index(ck) + 1
                m = df[(df["_r"] == rk) & (df["_c"] == ck) & (df["status"] == "ok")][metric]
                if len(m) and not rk.endswith("· full"):
                    line[i] += f" ({_pct(float(m.iloc[0]) / float(fv.iloc[0]) - 1)})"
    header = ["system" if sweep != "ablation" else "system · variant"] + [lab(c) for c in order_cols]
    lines += _md_table(header, body)
    lines += ["", f"Values: {unit}; *italic* = failed / not run (OOM = GPU out of memory, host OOM = host RAM "
              "exhausted, skip = not attempted, e.g. predicted not to fit)." +
              (" Hardware columns marked with an emulated profile run on the H200 with a capped GPU memory."
               if sweep == "hardware" else ""), ""]
    return lines


def _hw_order(h: str) -> int:
    return HARDWARE_ORDER.index(h) if h in HARDWARE_ORDER else len(HARDWARE_ORDER)


def _failures(rows: pd.DataFrame) -> list[str]:
    f = rows[rows["status"] != "ok"]
    lines = ["## Failed or skipped points", ""]
    if f.empty:
        return lines + ["None.", ""]
    body = [[r["_sweep"], r["point"], SYSTEM_SHORT.get(r["system"], r["system"]), r["variant"], r["hardware"],
             r["status"], _short(r["error"] or "", 110) or "—"] for _, r in f.iterrows()]
    return lines + _md_table(["sweep", "point", "system", "variant", "hardware", "status", "error"], body) + [""]


def _figures(plots_dir: Path | None, out: Path, frames: dict) -> list[str]:
    if plots_dir is None:
        return []
    names = [n for s in frames for n, _ in FIGURES.get(s, [])]
    found = [(n, plots_dir / f"{n}.png") for n in names if (plots_dir / f"{n}.png").exists()]
    if not found:
        return ["## Figures", "", f"No figures under `{plots_dir}` yet; run `python -m experiments.plots`.", ""]
    lines = ["## Figures", ""]
    for n, p in found:
        rel = os.path.relpath(p, out.parent)
        lines.append(f"- [{n}]({rel})")
    return lines + [""]


def build_report(results_dir="results", claims_path=CLAIMS_PATH, plots_dir: str | Path | None = "plots",
                 out_path="results/REPORT.md", log=print) -> tuple[str, list[str]]:
    """Return (markdown text, errors)."""
    frames, errors = load_results(results_dir, log=log)
    claims = load_claims(claims_path)
    tol = float(claims.get("tolerance_pct", 10)) / 100
    hw_names = claims.get("hardware", {}) or {}
    rows = _all_rows(frames)
    out_path = Path(out_path)
    lines = ["# MegaTrain benchmark report", ""]
    n_sample = int(((rows["git_sha"] == SAMPLE_SHA) | (rows["gpu_name"] == SAMPLE_GPU)).sum()) if not rows.empty else 0
    if n_sample:
        lines += ["> ## ⚠️ SAMPLE DATA — not a measurement",
                  f"> {n_sample} of {len(rows)} rows are synthetic sample/test-fixture rows "
                  f"(git_sha `{SAMPLE_SHA}` / gpu_name `{SAMPLE_GPU}`). Every number derived from them below is "
                  "made up and marked *(sample)*; do not cite it.", ""]
    lines.append(f"Results: `{results_dir}` — sweeps found: "
                 f"{', '.join(frames) if frames else 'none'}; missing: "
                 f"{', '.join(s for s in SWEEPS if s not in frames) or 'none'}.")
    lines.append("")
    if errors:
        lines += ["**Unreadable results files:**", ""] + [f"- {e}" for e in errors] + [""]
    if not rows.empty:
        lines += _environment(frames, rows)
        lines += _mixed_runs(rows)
    lines += _formulas(rows if not rows.empty else pd.DataFrame(columns=["status", "tflops", "step_time_median_s"]))

    lines += ["## Paper claims vs our results", "",
              f"Paper values: {claims.get('source', '?')}. Verdict: *matched* when within "
              f"±{tol * 100:.0f}% of the paper's value (or ratio), else *missed by* / *exceeded by* that much; "
              "*not comparable* when the setups differ too much to judge (e.g. an emulated GPU's absolute "
              "TFLOPS, or a model that needs more host RAM than this machine has); *not measured* when no "
              "matching row exists. The paper's absolute TFLOPS mostly come from a GH200, whose ~900 GB/s "
              "NVLink-C2C host link is much faster than an H200's PCIe host link, so absolute numbers are "
              "expected to differ; the ratio and trend rows are the fairer comparison.", "",
              "Hardware names: " + "; ".join(f"**{_hw_short(hw_names, k)}**: {_hw_long(hw_names, k)}"
                                             for k in hw_names) + ".", ""]
    evaluated = [evaluate_claim(c, rows if not rows.empty else _empty_rows(), tol, hw_names)
                 for c in claims["claims"]]
    sections = list(dict.fromkeys(e["section"] for e in evaluated))
    for sec in sections:
        lines += [f"### {SECTION_TITLES.get(sec, sec)}", ""]
        if sec == "reference":
            lines += ["Our own earlier measurements on this project's H200 (2026-11-30, Qwen2.5-3B shape, batch "
                      "16 × 1024 tokens), compared with the baseline rows of these results: a large gap points "
                      "at a setup change rather than at the paper.", ""]
        body = []
        for e in (x for x in evaluated if x["section"] == sec):
            ours = e["ours"] + (" *(sample)*" if e["sample"] else "")
            paper = e["paper"] + (f" — {e['source']}" if e.get("source") else "")
            body.append([f"{e['claim']} `{e['id']}`", paper, ours, e["hardware"], f"**{e['verdict']}**"])
        lines += _md_table(["claim", "paper" if sec != "reference" else "reference", "ours", "hardware",
                            "verdict"], body)
        lines.append("")
    counts = pd.Series([_verdict_kind(e["verdict"]) for e in evaluated]).value_counts()
    lines += ["Verdict summary: " + ", ".join(f"{k}: {v}" for k, v in counts.items()) + ".", ""]

    if frames:
        lines += ["## Per-sweep results", ""]
        for sweep, df in frames.items():
            lines += _sweep_table(sweep, df)
        lines += _failures(rows)
    lines += _figures(Path(plots_dir) if plots_dir else None, out_path, frames)
    lines += ["---", "Generated by `python -m experiments.report` from the results CSVs and "
              "`experiments/data/paper_claims.yaml`."]
    return "\n".join(lines) + "\n", errors


def _empty_rows() -> pd.DataFrame:
    from experiments.schema import COLUMNS  # noqa: PLC0415
    return pd.DataFrame(columns=list(COLUMNS) + ["_sweep", "_params"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="results", help="results root holding <sweep>/results.csv")
    ap.add_argument("--out", default=None, help="output Markdown file (default <results>/REPORT.md)")
    ap.add_argument("--claims", default=str(CLAIMS_PATH), help="paper claims YAML")
    ap.add_argument("--plots", default="plots", help="figure folder to link (if it has figures)")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.results) / "REPORT.md"
    try:
        text, errors = build_report(args.results, args.claims, args.plots, out)
    except ClaimsError as e:
        print(f"[error] {e}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"[ok] wrote {out}")
    if errors:
        print(f"{len(errors)} error(s):", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
