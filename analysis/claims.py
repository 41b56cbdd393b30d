"""The paper's claims (``data/paper_claims.yaml``) against our rows: selecting the row a claim is about
and judging it (``evaluate_claim`` -> a ``Verdict``), and the verdict summary (``summary_lines``).

Every judgement reads row fields (``experiments.schema.Row``): ``status``, ``reason`` with the bytes
needed and available, the placement (GPU-/host-tier layers), the clipping (steps clipped / timed
steps), the spread of the timed steps, the git SHA and the machine. No prose is parsed. The rules:

* *matched* / *missed* / *exceeded* only for a measured comparison with the paper (an ok row);
* a point never launched because the memory rule predicts it does not fit is *predicted* (a claim that
  a system runs out of memory) or *not reproducible here* (a claim about its number); the engine's own
  plan refusing the GPU side, or needing more host RAM than the paper's host had, is *missed*: a limit
  of the engine, not of this node;
* a ratio whose two rows' step-time spreads overlap is *within noise* unless it matches the paper;
* a ratio across two commits is marked (``CROSS_COMMIT``), and rows of two machines are never compared;
* each verdict on a MegaTrain row says its placement and its clipping regime.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from baselines.registry import record

from experiments.schema import SAMPLE_GPU, SAMPLE_SHA, fill_x_from_point, known_sweeps
from .style import STATUS_SHORT, TB_1_5_GIB, short_sha, status_short

CLAIMS_PATH = Path(__file__).parent / "data" / "paper_claims.yaml"
PARAMS_TOL = 0.15  # params_b matches the nearest size within 15 %
OOM = ("gpu_oom", "host_oom")
COMPARES = ("absolute", "ratio", "relative", "status", "trains")


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
        if c["compare"] not in COMPARES:
            raise ClaimsError(f"{path}: claim {c['id']}: unknown compare {c['compare']!r}")
        _check_optional_fields(path, c)
    return data


def _check_optional_fields(path: Path, c: dict) -> None:
    """``note`` and ``shape_differs`` are strings; ``evidence`` (a side channel of benchmark files) is gone: rows only."""
    for key in ("note", "shape_differs"):
        if key in c and not isinstance(c[key], str):
            raise ClaimsError(f"{path}: claim {c['id']}: '{key}' must be a string")
    if "evidence" in c:
        raise ClaimsError(f"{path}: claim {c['id']}: 'evidence' files are no longer read; every number comes "
                          f"from a sweep row (add a sweep or bench entry that measures it)")


# ----------------------------------------------------------------------------------------------
# the paper's own curve for a figure
# ----------------------------------------------------------------------------------------------

PAPER_CURVES = {"depth": "num_layers", "context": "seq_len", "width": "width_mult",  # sweep -> x column
                "size": "params_b"}


def paper_points(sweep: str, data: dict | None = None, system: str = "megatrain") -> tuple[dict[float, float], str]:
    """The paper's TFLOPS of ``system`` along ``sweep``'s x axis, from the claims of that section whose filter
    names the x column (absolute and relative claims both carry the paper's absolute value), and the
    paper's hardware name. ``({}, "")`` for a sweep without such a curve."""
    xcol = PAPER_CURVES.get(sweep)
    if xcol is None:
        return {}, ""
    data = data or load_claims()
    pts, hw = {}, ""
    for c in data["claims"]:
        where = c.get("where") or {}
        if c["section"] == sweep and c["system"] == system and c["compare"] in ("absolute", "relative") \
                and xcol in where and "hardware" not in where and "variant" not in where:
            pts[float(where[xcol])] = float(c["paper"])
            hw = _hw_short(data.get("hardware", {}) or {}, c.get("paper_hardware", ""))
    return pts, hw


def paper_ablation_points(data: dict | None = None) -> dict[str, float]:
    """The paper's 14B ablation TFLOPS per variant ("full" included), from the ablation section's claims
    (each variant once, whichever of our shapes its claims are judged on)."""
    data = data or load_claims()
    out = {}
    for c in data["claims"]:
        v = (c.get("where") or {}).get("variant")
        if c["section"] == "ablation" and v and c["compare"] in ("absolute", "relative"):
            out.setdefault(v, float(c["paper"]))
    return out


def paper_hardware_points(data: dict | None = None) -> dict[tuple[float, str, str], float]:
    """The paper's TFLOPS per (params_b, our hardware profile, system) from the hardware section: MegaTrain's
    absolute claims, and each baseline's value derived from a ratio claim as MegaTrain's value / ratio (the
    paper's "128 / 36" gives ZeRO-3 36 at 7B on the A100)."""
    data = data or load_claims()
    hw_claims = [c for c in data["claims"] if c["section"] == "hardware" and c["compare"] in ("absolute", "ratio")
                 and {"params_b", "hardware"} <= set(c.get("where") or {})]
    out = {}
    for c in hw_claims:
        if c["compare"] == "absolute" and c["system"] == "megatrain":
            out[(float(c["where"]["params_b"]), c["where"]["hardware"], "megatrain")] = float(c["paper"])
    for c in hw_claims:
        key = (float(c["where"]["params_b"]), c["where"]["hardware"])
        if c["compare"] == "ratio" and (*key, "megatrain") in out and float(c["paper"]) > 0:
            out[(*key, c["baseline"])] = out[(*key, "megatrain")] / float(c["paper"])
    return out


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
    sweeps = claim.get("sweeps") or list(known_sweeps())
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


def _point_key(point: str, system: str) -> str:
    """A point id without its system (ids read ``<system>__<model>__L..__<variant>__<hardware>``)."""
    point = str(point)
    return point[len(system) + 2:] if point.startswith(f"{system}__") else point


def _same_point(rows: pd.DataFrame, r: pd.Series, system: str) -> pd.Series | None:
    key = _point_key(r["point"], r["system"])
    same = rows["point"].astype(str).combine(rows["system"].astype(str), _point_key) == key
    c = rows[(rows["_sweep"] == r["_sweep"]) & same & (rows["system"] == system)
             & (rows["hardware"] == r["hardware"]) & rows["variant"].isin(["default", "full", ""])]
    if c.empty:
        return None
    ok = c[c["status"] == "ok"]
    return (ok if not ok.empty else c).iloc[0]


# ----------------------------------------------------------------------------------------------
# verdicts
# ----------------------------------------------------------------------------------------------

KINDS = ("matched", "within noise", "missed", "exceeded", "differs", "predicted", "not reproducible here",
         "not comparable", "not measured")
MEASURED_KINDS = ("matched", "within noise", "missed", "exceeded", "differs")
CROSS_COMMIT = "‡"  # a ratio of two rows measured by different commits


@dataclass(frozen=True)
class Verdict:
    """What a claim's rows say about it: ``kind`` (one of ``KINDS``) and a ``detail`` for people."""

    kind: str
    detail: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown verdict kind {self.kind!r}; valid: {', '.join(KINDS)}")

    def __str__(self) -> str:
        return f"{self.kind} ({self.detail})" if self.detail else self.kind

    def plus(self, more: str) -> "Verdict":
        """The same kind with ``more`` added to the detail."""
        if not more:
            return self
        return Verdict(self.kind, f"{self.detail}; {more}" if self.detail else more)


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _gib(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _short(s: str, n: int) -> str:
    s = " ".join(str(s).split()).replace("|", "/")
    return s if len(s) <= n else s[: n - 1] + "…"


def _hw_short(hw_names: dict, key: str) -> str:
    v = hw_names.get(key, key)
    return v[0] if isinstance(v, (list, tuple)) else str(v)


def _hw_long(hw_names: dict, key: str) -> str:
    v = hw_names.get(key, key)
    return v[1] if isinstance(v, (list, tuple)) and len(v) > 1 else str(v)


# -- what a row says about itself ---------------------------------------------------------------

def regime(r) -> str:
    """The row's placement and clipping regime in words ("" where the row has neither)."""
    parts = []
    g, h = _num(r.get("gpu_tier_layers")), _num(r.get("host_tier_layers"))
    if r.get("system") == "megatrain":
        if g is None or h is None:
            parts.append("placement unknown")
        elif h == 0:
            parts.append(f"all {int(g)} layers on the GPU tier, nothing streamed")
        elif g == 0:
            parts.append(f"pure streaming, all {int(h)} layers from the host")
        else:
            parts.append(f"tiered, {int(g)} of {int(g + h)} layers on the GPU tier")
    clipped, timed, mgn = _num(r.get("steps_clipped")), _num(r.get("timed_steps")), _num(r.get("max_grad_norm"))
    if mgn is not None and mgn <= 0:
        parts.append("no clipping")
    elif clipped is not None and timed:
        parts.append(f"clipping fired {int(clipped)} of {int(timed)} timed steps")
    elif r.get("status") == "ok":
        parts.append("clipping unknown")
    return ", ".join(parts)


def streams_like_the_paper(r) -> bool | None:
    """Whether a MegaTrain row streams layers from the host, as the paper's engine always does (None: unknown)."""
    h = _num(r.get("host_tier_layers"))
    return None if h is None else h > 0


def tflops_range(r) -> tuple[float, float] | None:
    """(low, high) TFLOPS of the row's slowest and fastest timed step; None without a spread."""
    t, med = _num(r.get("tflops")), _num(r.get("step_time_median_s"))
    lo, hi = _num(r.get("step_time_max_s")), _num(r.get("step_time_min_s"))
    if None in (t, med, lo, hi) or not med or (_num(r.get("timed_steps")) or 0) < 2:
        return None
    return t * med / lo, t * med / hi


def spreads_overlap(a, b) -> bool | None:
    """Whether the TFLOPS ranges of two rows' timed steps (``tflops_range``) overlap: their difference is
    then inside the noise of the measurement. None when either has fewer than two timed steps."""
    ra, rb = tflops_range(a), tflops_range(b)
    if ra is None or rb is None:
        return None
    return ra[0] <= rb[1] and rb[0] <= ra[1]


def _same_machine(a, b) -> bool:
    return str(a.get("gpu_name") or "") == str(b.get("gpu_name") or "")


def _commit_mark(a, b) -> str:
    """"" when both rows come from one commit, else the mark and both commits."""
    sa, sb = short_sha(a), short_sha(b)
    if sa == sb:
        return ""
    return f"{CROSS_COMMIT} across commits: git {sa or '?'} vs {sb or '?'}"


def memory_text(r) -> str:
    """'needs ~X GiB host RAM (this host: Y GiB)' from the row's need/have fields ("" for other rows)."""
    reason = r.get("reason")
    if reason == "host_memory":
        need, have = _num(r.get("need_host_gib")), _num(r.get("have_host_gib"))
        mem = "host RAM"
    elif reason in ("gpu_memory", "plan_gpu"):
        need, have = _num(r.get("need_gpu_gib")), _num(r.get("have_gpu_gib"))
        mem = "GPU memory"
    else:
        return ""
    if need is None:
        return f"needs more {mem} than this machine has"
    return f"needs ~{_gib(need)} GiB {mem}" + (f", {_gib(have)} GiB available" if have is not None else "")


def is_memory_skip(r) -> bool:
    return r is not None and r.get("status") == "skipped" and r.get("reason") in ("host_memory", "gpu_memory")


def _status_text(r) -> str:
    st = status_short(r)
    mem = memory_text(r)
    return f"{st} ({mem})" if mem else st


def _failed(r, who: str = "") -> Verdict:
    """The row gave no number: why, as a verdict."""
    who_ = f"{who} " if who else ""
    reason = r.get("reason")
    if reason == "plan_gpu":
        return Verdict("missed", f"{who_}the engine's plan refuses the GPU side: {memory_text(r)}; a limit of "
                                 f"the engine")
    if reason in ("host_memory", "gpu_memory"):
        return Verdict("not reproducible here", f"{who_}not launched: {memory_text(r)}")
    if reason == "needs_gpu":
        return Verdict("not measured", f"{who_}needs a GPU")
    if reason == "budget_cut":
        return Verdict("not measured", "budget cut: the run's time_budget_s stopped the point; a rerun retries it")
    if r.get("status") == "skipped":
        return Verdict("not measured", "skipped")
    return Verdict("missed", f"{who_}{status_short(r)}")


def _value_verdict(ours: float, paper: float, tol: float, lower_bound: bool = False,
                   noise: tuple[float, float] | None = None) -> Verdict:
    d = ours / paper - 1
    if lower_bound and ours >= paper:
        return Verdict("matched", f"≥ {paper:g}; {_pct(d)}")
    if abs(d) <= tol:
        return Verdict("matched", _pct(d))
    if noise is not None and noise[0] <= paper <= noise[1]:
        return Verdict("within noise", f"{_pct(d)}, but the paper's value lies inside our timed steps' spread")
    if d < 0:
        return Verdict("missed", f"by {abs(d) * 100:.0f}%")
    return Verdict("exceeded", f"by {d * 100:.0f}%")


# -- judging ------------------------------------------------------------------------------------

@dataclass
class Judged:
    """One claim's line in the report."""
    id: str
    claim: str
    section: str
    paper: str
    ours: str
    hardware: str
    verdict: Verdict
    sample: bool = False
    source: str | None = None
    note: str | None = None


def _is_sample_row(r) -> bool:
    return r is not None and (r.get("git_sha") == SAMPLE_SHA or r.get("gpu_name") == SAMPLE_GPU)


def _where_text(r) -> str:
    bits = [f"{r['_sweep']}/{r['point']}"]
    if r["variant"] not in ("default", ""):
        bits.append(r["variant"])
    return ", ".join(bits)


def _ours_hw(r, rows: pd.DataFrame) -> str:
    if r is None:
        gpus = [g for g in dict.fromkeys(rows.get("gpu_name", pd.Series(dtype=str))) if g] if not rows.empty else []
        return ", ".join(gpus[:2]) or "?"
    gpu = r.get("gpu_name") or "?"
    if r.get("emulated"):
        return f"{r['hardware']} emulated on {gpu}"
    hw = r.get("hardware") or ""
    return gpu if not hw or hw in gpu else f"{hw} ({gpu})"


def _fmt(v: float, unit: str) -> str:
    return f"{v:.1f} {unit}"


def _with_regime(v: Verdict, r) -> Verdict:
    """Add the row's placement/clipping, and say so where the paper streams and our row does not."""
    text = regime(r)
    if r.get("system") == "megatrain" and streams_like_the_paper(r) is False:
        text += " — the paper streams every layer, this row streams none"
    return v.plus(text)


def evaluate_claim(claim: dict, rows: pd.DataFrame, tol: float, hw_names: dict) -> Judged:
    """One claim judged on ``rows`` (every sweep's rows, ``_all_rows``)."""
    metric = claim.get("metric", "tflops")
    unit = "TFLOPS" if metric == "tflops" else metric
    paper_hw = _hw_short(hw_names, claim.get("paper_hardware", "?"))
    systems = claim["system"] if isinstance(claim["system"], list) else [claim["system"]]
    r, _ = _find(rows, claim, systems[0], dict(claim.get("where") or {}))
    j = Judged(id=claim["id"], claim=claim["claim"], section=claim["section"], paper="", ours="not measured",
               hardware=f"paper: {paper_hw} → ours: {_ours_hw(r, rows)}", verdict=Verdict("not measured"),
               sample=_is_sample_row(r), source=claim.get("source"), note=claim.get("note"))
    judge = {"absolute": _absolute, "ratio": _ratio, "relative": _relative, "status": _status,
             "trains": _trains}.get(claim["compare"])
    if judge is None:
        raise ClaimsError(f"claim {claim['id']}: unknown compare {claim['compare']!r}")
    judge(j, claim, rows, r, tol, metric, unit, paper_hw, hw_names)
    if claim.get("shape_differs") and j.verdict.kind != "not measured":
        # our row is another model than the paper's: whatever it shows, it is no verdict on the paper's
        j.verdict = Verdict("not comparable", f"{claim['shape_differs']}; the row alone: {j.verdict}")
    return j


def _absolute(j, claim, rows, r, tol, metric, unit, paper_hw, hw_names):
    j.paper = f"{claim.get('paper_text', claim['paper'])} {unit}"
    if r is None:
        return
    if r["status"] != "ok" or _num(r[metric]) is None:
        j.ours, j.verdict = f"{_status_text(r)} [{_where_text(r)}]", _failed(r)
        return
    ours = float(r[metric])
    j.ours = f"{_fmt(ours, unit)} [{_where_text(r)}]"
    v = _value_verdict(ours, float(claim["paper"]), tol, bool(claim.get("paper_min")),
                       tflops_range(r) if metric == "tflops" else None)
    if r.get("emulated"):
        v = Verdict("not comparable", f"emulated profile, the real GPU's compute; {v}")
    j.verdict = _with_regime(v, r)


def _pair_ratio(r, b, metric) -> tuple[float, str, str]:
    """(ratio r/b, cross-commit mark or "", noise note or "")."""
    ratio = float(r[metric]) / float(b[metric])
    noise = "within the timed steps' spread" if spreads_overlap(r, b) else ""
    return ratio, _commit_mark(r, b), noise


def _ratio_verdict(ratio: float, paper_ratio: float, tol: float, noise: str) -> Verdict:
    v = _value_verdict(ratio, paper_ratio, tol)
    if noise and v.kind != "matched":
        return Verdict("within noise", f"{_pct(ratio - 1)} between the two rows, {noise}; paper {paper_ratio:.2f}×")
    return v


def _ratio(j, claim, rows, r, tol, metric, unit, paper_hw, hw_names):
    base = claim["baseline"]
    bname = record(base).short
    j.paper = f"{float(claim['paper']):.2f}×"
    if r is None:
        return
    if r["status"] != "ok" or _num(r[metric]) is None:
        j.ours, j.verdict = f"MegaTrain {_status_text(r)} [{_where_text(r)}]", _failed(r, "MegaTrain")
        return
    b = _same_point(rows, r, base)
    if b is None:
        j.ours = f"{_fmt(float(r[metric]), unit)}; {bname} not in this sweep [{_where_text(r)}]"
        return
    j.sample = j.sample or _is_sample_row(b)
    if not _same_machine(r, b):
        j.ours = f"MegaTrain on {r['gpu_name']}, {bname} on {b['gpu_name']} [{_where_text(r)}]"
        j.verdict = Verdict("not comparable", "rows of two machines")
        return
    if b["status"] != "ok" or _num(b[metric]) is None or float(b[metric]) <= 0:
        j.ours = f"{_fmt(float(r[metric]), unit)} vs {bname} {_status_text(b)} [{_where_text(r)}]"
        if b["status"] == "gpu_oom":
            v = Verdict("exceeded", f"{bname} ran out of GPU memory, MegaTrain ran")
        elif b["status"] == "host_oom":
            rss = _num(b.get("host_peak_rss_gib"))
            v = Verdict("not reproducible here", f"{bname} ran out of this host's RAM"
                        + (f" at ~{_gib(rss)} GiB" if rss else "") + "; MegaTrain ran")
        elif b["status"] == "skipped":
            v = _failed(b, bname)
        else:
            v = Verdict("not comparable", f"{bname} {status_short(b)}")
        j.verdict = _with_regime(v, r)
        return
    ratio, mark, noise = _pair_ratio(r, b, metric)
    j.ours = (f"{ratio:.2f}×{CROSS_COMMIT if mark else ''} ({float(r[metric]):.1f} / {float(b[metric]):.1f} {unit}) "
              f"[{_where_text(r)}]")
    v = _ratio_verdict(ratio, float(claim["paper"]), tol, noise).plus(mark)
    if r.get("emulated"):
        v = v.plus("emulated profile")
    j.verdict = _with_regime(v, r)


def _relative(j, claim, rows, r, tol, metric, unit, paper_hw, hw_names):
    pref = float(claim["paper_reference"])
    pr = float(claim["paper"]) / pref
    ref_label = ", ".join(f"{k}={v}" for k, v in (claim.get("reference") or {}).items())
    j.paper = f"{claim.get('paper_text', claim['paper'])} {unit} ({pr:.3f}× of {pref:g}, {_pct(pr - 1)})"
    if r is None:
        return
    if r["status"] != "ok" or _num(r[metric]) is None:
        j.ours, j.verdict = f"{_status_text(r)} [{_where_text(r)}]", _failed(r)
        return
    ref_where = {**(claim.get("where") or {}), **(claim.get("reference") or {})}
    ref, _ = _find(rows, {**claim, "sweeps": [r["_sweep"]]}, r["system"], ref_where)
    if ref is None or ref["status"] != "ok" or _num(ref[metric]) is None or float(ref[metric]) <= 0:
        j.ours = (f"{_fmt(float(r[metric]), unit)}; reference ({ref_label}) "
                  f"{'absent' if ref is None else _status_text(ref)} [{_where_text(r)}]")
        j.verdict = _failed(ref, f"the reference ({ref_label})") if ref is not None and ref["status"] != "ok" \
            else Verdict("not comparable", "no reference point")
        return
    j.sample = j.sample or _is_sample_row(ref)
    if not _same_machine(r, ref):
        j.verdict = Verdict("not comparable", "the point and its reference come from two machines")
        return
    ratio, mark, noise = _pair_ratio(r, ref, metric)
    j.ours = (f"{_fmt(float(r[metric]), unit)} ({ratio:.3f}×{CROSS_COMMIT if mark else ''} of "
              f"{float(ref[metric]):.1f}, {_pct(ratio - 1)}) [{_where_text(r)}]")
    j.verdict = _with_regime(_ratio_verdict(ratio, pr, tol, noise).plus("on the ratio").plus(mark), r)


def _status(j, claim, rows, r, tol, metric, unit, paper_hw, hw_names):
    """The paper says each system runs out of memory here: matched when each of ours ran out of memory;
    predicted when some were never launched because the memory rule says they do not fit."""
    systems = claim["system"] if isinstance(claim["system"], list) else [claim["system"]]
    j.paper = "OOM" if len(systems) == 1 else "all OOM"
    parts, n = [], {"ok": 0, "oom": 0, "predicted": 0, "missing": 0, "other": 0}
    hw_row = None
    for s in systems:
        rs, _ = _find(rows, claim, s, dict(claim.get("where") or {}))
        name = record(s).short
        if rs is None:
            parts.append(f"{name}: not measured")
            n["missing"] += 1
            continue
        hw_row = hw_row if hw_row is not None else rs
        j.sample = j.sample or _is_sample_row(rs)
        if rs["status"] == "ok":
            parts.append(f"{name}: ran, {float(rs[metric]):.1f} {unit}")
            n["ok"] += 1
        elif rs["status"] in OOM:
            parts.append(f"{name}: {STATUS_SHORT[rs['status']]}")
            n["oom"] += 1
        elif is_memory_skip(rs):
            parts.append(f"{name}: not launched ({memory_text(rs)})")
            n["predicted"] += 1
        else:
            parts.append(f"{name}: {_status_text(rs)}")
            n["other"] += 1
    if hw_row is not None:
        j.hardware = f"paper: {paper_hw} → ours: {_ours_hw(hw_row, rows)}"
    j.ours = "; ".join(parts) + (f" [{hw_row['_sweep']}/{hw_row['point']}]" if hw_row is not None else "")
    total = len(systems)
    if n["ok"]:
        j.verdict = Verdict("differs", f"{n['ok']} of {total} ran")
    elif n["oom"] == total:
        j.verdict = Verdict("matched", "each ran out of memory")
    elif n["oom"] + n["predicted"] == total:
        j.verdict = Verdict("predicted", f"{n['predicted']} of {total} not launched: the memory rule predicts "
                                         f"they do not fit" + (f"; {n['oom']} ran out of memory" if n["oom"] else ""))
    else:
        j.verdict = Verdict("not measured", "" if n["missing"] == total else "some rows missing or failed otherwise")


def _trains(j, claim, rows, r, tol, metric, unit, paper_hw, hw_names):
    j.paper = "trains"
    if r is None:
        return
    est = _num(r.get("host_estimate_gib"))
    est_txt = f"; engine host estimate {est:,.0f} GiB" if est is not None else ""
    if r["status"] == "ok":
        j.ours = f"trained, {float(r[metric]):.1f} {unit}{est_txt} [{_where_text(r)}]"
        j.verdict = _with_regime(Verdict("matched").plus("emulated profile" if r.get("emulated") else ""), r)
        return
    j.ours = f"{_status_text(r)}{est_txt} [{_where_text(r)}]"
    need = _num(r.get("need_host_gib"))
    if r.get("reason") == "host_memory" and need is not None and claim.get("paper_host_gib") is not None \
            and need > float(claim["paper_host_gib"]):
        j.verdict = Verdict("missed", f"the engine's plan needs ~{_gib(need)} GiB of host RAM, more than the "
                                      f"paper's {_gib(float(claim['paper_host_gib']))} GiB host: a limit of the engine")
    elif r.get("reason") == "host_memory" and need is not None:
        fits = "fits" if need <= TB_1_5_GIB else "would not fit"
        j.verdict = _failed(r).plus(f"{fits} in 1.5 TB")
    else:
        j.verdict = _failed(r)


# -- the summary --------------------------------------------------------------------------------

def verdict_counts(judged: list[Judged]) -> dict[str, int]:
    """Claims per verdict kind, in ``KINDS`` order (kinds with none left out)."""
    kinds = [j.verdict.kind for j in judged]
    return {k: kinds.count(k) for k in KINDS if k in kinds}


def summary_lines(judged: list[Judged]) -> list[str]:
    """The verdict summary: each kind counted apart, measured verdicts first."""
    counts = verdict_counts(judged)
    measured = sum(v for k, v in counts.items() if k in MEASURED_KINDS)
    unmeasured = [j.id for j in judged if j.verdict.kind == "not measured"]
    lines = [f"Verdict summary ({len(judged)} claims): {measured} measured — "
             + (", ".join(f"{k}: {counts[k]}" for k in MEASURED_KINDS if k in counts) or "none")
             + "; not measured against the paper — "
             + (", ".join(f"{k}: {v}" for k, v in counts.items() if k not in MEASURED_KINDS) or "none") + "."]
    if unmeasured:
        lines += ["", f"Without any row: {_id_list(unmeasured)}."]
    return lines + [""]


def _id_list(ids: list[str], n: int = 12) -> str:
    return ", ".join(ids[:n]) + (f", … +{len(ids) - n} more" if len(ids) > n else "")
