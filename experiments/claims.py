"""The paper's claims (``experiments/data/paper_claims.yaml``) against our rows: selecting the row a
claim is about and judging it (``evaluate_claim``). Used by ``experiments.report``; no torch."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from baselines.registry import record

from .schema import KNOWN_SWEEPS as SWEEPS, SAMPLE_GPU, SAMPLE_SHA, fill_x_from_point
from .style import STATUS_SHORT, TB_1_5_GIB

CLAIMS_PATH = Path(__file__).parent / "data" / "paper_claims.yaml"
PARAMS_TOL = 0.15  # params_b matches the nearest size within 15 %
OOM = ("gpu_oom", "host_oom")
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
        bname = record(base).short
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
            name = record(s).short
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
