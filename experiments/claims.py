"""The paper's claims (``experiments/data/paper_claims.yaml``) against our rows: selecting the row a
claim is about and judging it (``evaluate_claim``), and the verdict summary (``summary_lines``). Used by
``experiments.report``; no torch.

A row that was not launched because the memory rule predicts it does not fit (``experiments.sweeps.
skip_reason``) gives the verdict "not reproducible here: needs ~X GiB host RAM (this host: Y GiB)" for a
claim about its number, and "matched (predicted: ...)" for a claim that the paper's system runs out of
memory there. A claim with no matching sweep row can take its number from an engine benchmark file
(``evidence``)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from baselines.registry import record

from .schema import KNOWN_SWEEPS as SWEEPS, SAMPLE_GPU, SAMPLE_SHA, fill_x_from_point
from .style import STATUS_SHORT, TB_1_5_GIB, short_sha, status_short

CLAIMS_PATH = Path(__file__).parent / "data" / "paper_claims.yaml"
ROOT = Path(__file__).resolve().parents[1]  # evidence files are relative to the repository root
PARAMS_TOL = 0.15  # params_b matches the nearest size within 15 %
OOM = ("gpu_oom", "host_oom")
COMPARES = ("absolute", "ratio", "relative", "status", "trains")
UNMEASURED_TARGET = 3  # the reproduction's goal: at most this many claims without a measured verdict


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
    """``note`` is a string; ``evidence`` is {file, where[, reference][, metric]}, absolute/relative only."""
    if "note" in c and not isinstance(c["note"], str):
        raise ClaimsError(f"{path}: claim {c['id']}: 'note' must be a string")
    ev = c.get("evidence")
    if ev is None:
        return
    if c["compare"] not in ("absolute", "relative"):
        raise ClaimsError(f"{path}: claim {c['id']}: 'evidence' works with compare absolute or relative only")
    if not isinstance(ev, dict) or not ev.get("file") or not isinstance(ev.get("where"), dict):
        raise ClaimsError(f"{path}: claim {c['id']}: 'evidence' needs 'file' and a 'where' mapping")
    if c["compare"] == "relative" and not isinstance(ev.get("reference"), dict):
        raise ClaimsError(f"{path}: claim {c['id']}: relative 'evidence' needs a 'reference' mapping")


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


def _run_of(r) -> tuple[str, str]:
    """(git SHA, day) of a row: rows of one run share both."""
    return short_sha(r), str(r.get("date") or "")[:10]


def _other_run(a, b) -> str:
    """"" when rows ``a`` and ``b`` come from one run (same git SHA and day), else ", another run (git X,
    day)" naming ``b``'s run: a comparison across runs is not a same-run comparison."""
    if _run_of(a) == _run_of(b):
        return ""
    sha, day = _run_of(b)
    return f", another run (git {sha or '?'}, {day or '?'})"


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
    st = status_short(r)
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


VERDICT_KINDS = ("matched", "missed", "exceeded", "differs", "not comparable", "not reproducible here",
                 "not measured")


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




def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if pd.isna(f) else f


def _gib(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


# ----------------------------------------------------------------------------------------------
# rows not launched because they would not fit
# ----------------------------------------------------------------------------------------------

_MEMORY_WORDS = re.compile(r"\bRAM\b|memory|estimate|host needs|\bfit\b", re.I)
_GIB_NUM = r"(\d[\d,]*(?:\.\d+)?)\s*GiB"


@dataclass(frozen=True)
class MemoryLimit:
    """A point this machine cannot hold: which memory, and the GiB it needs / has (None: unknown).
    ``available`` is the skip text's "available" figure, shown only when it, not ``have``, explains it."""
    memory: str  # "host RAM" | "GPU memory"
    need: float | None
    have: float | None
    available: float | None = None

    @property
    def _machine(self) -> str:
        return "host" if self.memory == "host RAM" else "GPU"

    @property
    def _by_available(self) -> bool:
        """It fits the machine's total but not what was free then: the skip text's 'available' explains it."""
        return None not in (self.need, self.have, self.available) and self.need <= self.have

    def _have_text(self) -> str:
        if self.have is None:
            return ""
        avail = f", {_gib(self.available)} GiB available" if self._by_available else ""
        return f" (this {self._machine}: {_gib(self.have)} GiB{avail})"

    def _more_than(self) -> str:
        have = f"'s {_gib(self.have)} GiB" if self.have is not None else " has"
        return f"needs more {self.memory} than this {self._machine}{have}"

    def needs(self) -> str:
        """'needs ~X GiB host RAM (this host: Y GiB)'."""
        if self.need is None:
            return self._more_than()
        return f"needs ~{_gib(self.need)} GiB {self.memory}{self._have_text()}"

    def predicted(self) -> str:
        """'needs ~X GiB host RAM > Y GiB'."""
        if self.need is None:
            return self._more_than()
        limit = self.available if self._by_available else self.have
        return f"needs ~{_gib(self.need)} GiB {self.memory}" + (f" > {_gib(limit)} GiB" if limit is not None else "")

    def verdict(self, who: str = "") -> str:
        return f"not reproducible here: {who + ' ' if who else ''}{self.needs()}"


def _skip_text_gib(err: str) -> tuple[float | None, float | None]:
    """(needed, available) GiB in a skip text such as 'skipped: engine plan: host needs 812.3 GiB (...) >
    available host RAM 120.1 GiB': the first 'needs X GiB', else the last 'X GiB' before ' > '; and the
    first 'Y GiB' after ' > '."""
    head, _, tail = err.partition(" > ")
    m = re.search(r"needs\s+~?" + _GIB_NUM, err)
    before = re.findall(_GIB_NUM, head)
    need = m.group(1) if m else (before[-1] if before else None)
    after = re.search(_GIB_NUM, tail)
    return (_num(need.replace(",", "")) if need else None,
            _num(after.group(1).replace(",", "")) if after else None)


def memory_limit(r) -> MemoryLimit | None:
    """Why a skipped row was not launched, when it was for memory: its error text ("skipped: ...") speaks
    of host RAM / GPU memory, or it has no reason and its host estimate exceeds the host's RAM. The host
    estimate and RAM come from the row's columns (``host_estimate_gib``, ``host_ram_gib``), else from
    the text. None for any other row."""
    if r is None or r.get("status") != "skipped":
        return None
    err = " ".join(str(r.get("error") or "").split())
    est, ram = _num(r.get("host_estimate_gib")), _host_ram(r)
    over = est is not None and ram is not None and est > ram
    reason = err.split(":", 1)[1] if err.lower().startswith("skipped:") else err
    if not (_MEMORY_WORDS.search(reason) or (over and not reason.strip())):
        return None
    text_need, text_avail = _skip_text_gib(err)
    if re.search(r"gpu memory", err, re.I) and not re.search(r"\bRAM\b", err):
        return MemoryLimit("GPU memory", text_need, text_avail if text_avail is not None
                           else _num(r.get("gpu_mem_cap_gib")))
    need = est if est is not None and (over or text_need is None) else text_need
    return MemoryLimit("host RAM", need, ram if ram is not None else text_avail, text_avail)


def _host_oom_limit(r) -> MemoryLimit | None:
    """A row that ran out of host RAM where the engine's estimate said it would."""
    est, ram = _num(r.get("host_estimate_gib")), _host_ram(r)
    if r.get("status") == "host_oom" and est is not None and ram is not None and est > ram:
        return MemoryLimit("host RAM", est, ram)
    return None


# The row's point was stopped by the run's time budget, not by its own timeout: nothing to judge yet.
BUDGET_CUT_VERDICT = "not measured (budget cut: the run's time_budget_s stopped the point; a rerun retries it)"


def _host_oom_verdict(r, who: str) -> str:
    """A baseline killed for host RAM: the paper's host had more, so its ratio cannot be judged here.
    With the engine's estimate over the host's RAM the estimate is the need; otherwise (a system that uses
    more than the estimate's 12 B/param) the RSS it was killed at says how far it got."""
    lim = _host_oom_limit(r)
    if lim is not None:
        return lim.verdict(who)
    rss, ram = _num(r.get("host_peak_rss_gib")), _host_ram(r)
    at = f" (killed at ~{_gib(rss)} GiB RSS" + (f" of this host's {_gib(ram)} GiB)" if ram is not None else ")") \
        if rss is not None else ""
    return f"not reproducible here: {who} ran out of host RAM{at}; MegaTrain ran"


# ----------------------------------------------------------------------------------------------
# evidence: engine benchmark rows (JSONL) for a claim no sweep row covers
# ----------------------------------------------------------------------------------------------

def _evidence_rows(path: Path) -> list[dict]:
    if not path.exists():
        raise ClaimsError(f"evidence file {path} does not exist")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _row_matches(row: dict, where: dict) -> bool:
    for key, val in where.items():
        if key not in row:
            return False
        if isinstance(val, str) or isinstance(row[key], str):
            if str(row[key]) != str(val):
                return False
        elif _num(row[key]) is None or abs(float(row[key]) - float(val)) > 1e-6 * max(1.0, abs(float(val))):
            return False
    return True


def _evidence_value(ev: dict, where: dict, metric: str) -> tuple[float | None, str]:
    """(best value of ``metric`` among the file's rows matching ``where``, or None; what the file says
    when no row has a value: 'no matching row' or the failed row's error)."""
    rows = [r for r in _evidence_rows(ROOT / ev["file"]) if _row_matches(r, where)]
    vals = [float(r[metric]) for r in rows if _num(r.get(metric)) is not None]
    if vals:
        return max(vals), ""
    errors = [str(r["error"]) for r in rows if r.get("error")]
    return None, (f"failed: {_short(errors[0], 60)}" if errors else "no matching row")


def _evaluate_evidence(claim: dict, out: dict, unit: str, tol: float) -> dict:
    """A claim with no sweep row, judged on its evidence file (absolute, or relative to a reference row)."""
    ev = claim["evidence"]
    metric = ev.get("metric", claim.get("metric", "tflops"))
    src = f"[{ev['file']}]"
    value, why = _evidence_value(ev, ev["where"], metric)
    if value is None:
        out.update(ours=f"{why} {src}", verdict="missed (evidence row failed)" if why.startswith("failed")
                   else "not measured")
        return out
    if claim["compare"] == "absolute":
        out.update(ours=f"{value:.1f} {unit} {src}",
                   verdict=_value_verdict(value, float(claim["paper"]), tol, bool(claim.get("paper_min"))))
        return out
    ref, why = _evidence_value(ev, {**ev["where"], **ev["reference"]}, metric)
    if ref is None or ref <= 0:
        out.update(ours=f"{value:.1f} {unit}; reference {why} {src}", verdict="not comparable (no reference point)")
        return out
    ratio, pr = value / ref, float(claim["paper"]) / float(claim["paper_reference"])
    out.update(ours=f"{value:.1f} {unit} ({ratio:.3f}× of {ref:.1f}, {_pct(ratio - 1)}) {src}",
               verdict=_value_verdict(ratio, pr, tol) + " (on the ratio)")
    return out


# ----------------------------------------------------------------------------------------------
# evaluating claims
# ----------------------------------------------------------------------------------------------

@dataclass
class _Ctx:
    """What every compare kind needs: the claim, all rows, the first system's row (or None)."""
    claim: dict
    rows: pd.DataFrame
    r: pd.Series | None
    out: dict
    tol: float
    metric: str
    unit: str
    emulated: bool


def evaluate_claim(claim: dict, rows: pd.DataFrame, tol: float, hw_names: dict) -> dict:
    """One report row: {'id', 'claim', 'section', 'paper', 'ours', 'hardware', 'verdict', 'sample',
    'source', 'note'}."""
    metric = claim.get("metric", "tflops")
    paper_hw = _hw_short(hw_names, claim.get("paper_hardware", "?"))
    systems = claim["system"] if isinstance(claim["system"], list) else [claim["system"]]
    r, _ = _find(rows, claim, systems[0], dict(claim.get("where") or {}))
    out = {"id": claim["id"], "claim": claim["claim"], "section": claim["section"], "sample": _is_sample_row(r),
           "source": claim.get("source"), "note": claim.get("note"),
           "hardware": f"paper: {paper_hw} → ours: {_ours_hw(r, rows)}"}
    ctx = _Ctx(claim, rows, r, out, tol, metric, "TFLOPS" if metric == "tflops" else metric,
               bool(r is not None and r.get("emulated")))
    evaluate = {"absolute": _absolute, "ratio": _ratio, "relative": _relative, "status": _status,
                "trains": _trains}.get(claim["compare"])
    if evaluate is None:
        raise ClaimsError(f"claim {claim['id']}: unknown compare {claim['compare']!r}")
    return evaluate(ctx, paper_hw)


def _not_measured(out: dict) -> dict:
    out.update(ours="not measured", verdict="not measured")
    return out


_PLAN_GPU = re.compile(r"engine plan: GPU needs\s+" + _GIB_NUM + r".*?=\s*" + _GIB_NUM + r"\)")


def plan_gpu_refusal(r) -> str | None:
    """MegaTrain skipped because its own placement plan does not fit the GPU side (the streaming working set,
    the gradients that wait for the step's norm and the margin; since grad_placement=auto the host tier's
    gradients wait on the host when that helps, so a row after it is refused with them there): a limit of
    the engine, which more host RAM would not lift, so the verdict is "missed", with the plan's numbers.
    None for any other row."""
    if r is None or r.get("status") != "skipped" or r.get("system") != "megatrain":
        return None
    m = _PLAN_GPU.search(" ".join(str(r.get("error") or "").split()))
    if not m:
        return None
    return f"missed (the engine's plan refuses the GPU side: needs {m.group(1)} GiB > {m.group(2)} GiB usable)"


def _failed(out: dict, r: pd.Series, who: str = "") -> dict:
    """The selected row gave no number: missed (the engine's plan refuses the GPU side, or it ran and
    failed), not reproducible here (skipped for host memory) or not measured (skipped otherwise)."""
    lim = memory_limit(r)
    out["ours"] = f"{who + ' ' if who else ''}{_status_text(r)} [{_where_text(r)}]"
    if plan_gpu_refusal(r):
        out["verdict"] = plan_gpu_refusal(r)
    elif lim is not None:
        out["verdict"] = lim.verdict()
    elif r["status"] == "skipped":
        out["verdict"] = "not measured (skipped)"
    else:
        st = status_short(r)
        out["verdict"] = (BUDGET_CUT_VERDICT if st == "budget cut" else
                          f"missed ({who} did not run)" if who else f"missed ({st})")
    return out


def _no_number(r: pd.Series, metric: str) -> bool:
    return r["status"] != "ok" or pd.isna(r[metric])


def _absolute(c: _Ctx, paper_hw: str) -> dict:
    claim, out, r, metric, unit = c.claim, c.out, c.r, c.metric, c.unit
    out["paper"] = f"{claim.get('paper_text', claim['paper'])} {unit}"
    if r is None:
        return _evaluate_evidence(claim, out, unit, c.tol) if claim.get("evidence") else _not_measured(out)
    if _no_number(r, metric):
        return _failed(out, r)
    ours = float(r[metric])
    txt = f"{ours:.1f} {unit}"
    z = _same_point(c.rows, r, "zero3") if r["system"] == "megatrain" else None
    if z is not None:
        other = _other_run(r, z)
        where = f" at this point{other}" if other else " in the same run"
        if z["status"] == "ok" and pd.notna(z[metric]) and z[metric] > 0:
            txt += f" (= {ours / float(z[metric]):.2f}× ZeRO-3{where})"
        else:
            txt += f" (ZeRO-3{where}: {status_short(z)})"
    out["ours"] = f"{txt} [{_where_text(r)}]"
    v = _value_verdict(ours, float(claim["paper"]), c.tol, bool(claim.get("paper_min")))
    out["verdict"] = f"not comparable (emulated profile, H200 compute; {v})" if c.emulated else v
    return out


def _ratio(c: _Ctx, paper_hw: str) -> dict:
    claim, out, r, metric, unit = c.claim, c.out, c.r, c.metric, c.unit
    base = claim["baseline"]
    out["paper"] = f"{float(claim['paper']):.2f}×"
    if r is None:
        return _not_measured(out)
    if _no_number(r, metric):
        return _failed(out, r, "MegaTrain")
    b = _same_point(c.rows, r, base)
    bname = record(base).short
    if b is None:
        out.update(ours=f"{r[metric]:.1f} {unit}; {bname} not in this sweep [{_where_text(r)}]", verdict="not measured")
        return out
    other = _other_run(r, b)
    if b["status"] != "ok" or pd.isna(b[metric]) or b[metric] <= 0:
        st = status_short(b)
        lim = memory_limit(b)
        out["ours"] = f"{r[metric]:.1f} {unit} vs {bname} {st}{other} → ∞ [{_where_text(r)}]"
        if lim is not None:
            out["verdict"] = lim.verdict(bname)
        elif b["status"] == "host_oom":  # this host's RAM, not the paper's: no ratio to judge
            out["verdict"] = _host_oom_verdict(b, bname)
        else:
            out["verdict"] = (f"exceeded ({bname} {st}, MegaTrain ran)" if b["status"] in OOM
                              else f"not comparable ({bname} {st})")
        if c.emulated:
            out["verdict"] += "; emulated profile"
        return out
    ratio = float(r[metric]) / float(b[metric])
    out["ours"] = f"{ratio:.2f}× ({r[metric]:.1f} / {b[metric]:.1f} {unit}{other}) [{_where_text(r)}]"
    out["verdict"] = _value_verdict(ratio, float(claim["paper"]), c.tol) + ("; emulated profile" if c.emulated else "")
    if other:
        out["verdict"] += f"; {bname} from another run"
    slow_start = [f"{who} not at steady state ({x.get('steady_note')})" for who, x in (("MegaTrain", r), (bname, b))
                  if x.get("steady_note")]  # experiments.steady: its median overstates its step time
    if slow_start:
        out["verdict"] += "; " + "; ".join(slow_start)
    out["sample"] = out["sample"] or _is_sample_row(b)
    return out


def _relative(c: _Ctx, paper_hw: str) -> dict:
    claim, out, r, metric, unit = c.claim, c.out, c.r, c.metric, c.unit
    pref = float(claim["paper_reference"])
    pr = float(claim["paper"]) / pref
    ref_label = ", ".join(f"{k}={v}" for k, v in (claim.get("reference") or {}).items())
    out["paper"] = f"{claim.get('paper_text', claim['paper'])} {unit} ({pr:.3f}× of {pref:g}, {_pct(pr - 1)})"
    if r is None:
        return _evaluate_evidence(claim, out, unit, c.tol) if claim.get("evidence") else _not_measured(out)
    if _no_number(r, metric):
        return _failed(out, r)
    ref_where = {**(claim.get("where") or {}), **(claim.get("reference") or {})}
    ref, _ = _find(c.rows, {**claim, "sweeps": [r["_sweep"]]}, r["system"], ref_where)
    if ref is None or ref["status"] != "ok" or pd.isna(ref[metric]) or ref[metric] <= 0:
        lim = memory_limit(ref)
        out["ours"] = (f"{r[metric]:.1f} {unit}; reference ({ref_label}) "
                       f"{'absent' if ref is None else _status_text(ref)} [{_where_text(r)}]")
        out["verdict"] = lim.verdict(f"the reference ({ref_label})") if lim else "not comparable (no reference point)"
        return out
    ratio = float(r[metric]) / float(ref[metric])
    out["ours"] = f"{r[metric]:.1f} {unit} ({ratio:.3f}× of {ref[metric]:.1f}, {_pct(ratio - 1)}) [{_where_text(r)}]"
    out["verdict"] = _value_verdict(ratio, pr, c.tol) + " (on the ratio)"
    out["sample"] = out["sample"] or _is_sample_row(ref)
    return out


def _status(c: _Ctx, paper_hw: str) -> dict:
    """The paper says each system runs out of memory here: matched when each of ours did (OOM) or was not
    launched because the memory rule predicts it does not fit."""
    claim, out, metric, unit = c.claim, c.out, c.metric, c.unit
    systems = claim["system"] if isinstance(claim["system"], list) else [claim["system"]]
    out["paper"] = "OOM" if len(systems) == 1 else "all OOM"
    parts, n = [], {"ok": 0, "oom": 0, "predicted": 0, "missing": 0, "other": 0}
    hw_row, predicted = None, []
    for s in systems:
        rs, _ = _find(c.rows, claim, s, dict(claim.get("where") or {}))
        name = record(s).short
        if rs is None:
            parts.append(f"{name}: not measured")
            n["missing"] += 1
            continue
        hw_row = hw_row if hw_row is not None else rs
        out["sample"] = out["sample"] or _is_sample_row(rs)
        lim = memory_limit(rs)
        if rs["status"] == "ok":
            parts.append(f"{name}: ran, {rs[metric]:.1f} {unit}")
            n["ok"] += 1
        elif rs["status"] in OOM:
            parts.append(f"{name}: {STATUS_SHORT[rs['status']]}")
            n["oom"] += 1
        elif lim is not None:
            parts.append(f"{name}: not launched ({lim.predicted()})")
            predicted.append(lim)
            n["predicted"] += 1
        else:
            parts.append(f"{name}: {_status_text(rs)}")
            n["other"] += 1
    if hw_row is not None:
        out["hardware"] = f"paper: {paper_hw} → ours: {_ours_hw(hw_row, c.rows)}"
    out["ours"] = "; ".join(parts) + (f" [{hw_row['_sweep']}/{hw_row['point']}]" if hw_row is not None else "")
    out["verdict"] = _status_verdict(n, len(systems), predicted)
    return out


def _status_verdict(n: dict, total: int, predicted: list[MemoryLimit]) -> str:
    matched = n["oom"] + n["predicted"]
    if matched == total:
        if not predicted:
            return "matched"
        if not n["oom"]:
            return f"matched (predicted: {predicted[0].predicted()}; not launched)"
        return f"matched ({n['oom']} OOM, {n['predicted']} predicted)"
    if n["ok"]:
        return f"differs ({n['ok']} of {total} ran)"
    if n["missing"] == total:
        return "not measured"
    return f"matched for {matched} of {total}; rest not measured" if matched else "not measured (skipped/error)"


def _trains(c: _Ctx, paper_hw: str) -> dict:
    out, r, metric, unit = c.out, c.r, c.metric, c.unit
    out["paper"] = "trains"
    if r is None:
        return _not_measured(out)
    est = _num(r.get("host_estimate_gib"))
    est_txt = f"; engine host estimate {est:,.0f} GiB" if est is not None else ""
    if r["status"] == "ok":
        out["ours"] = f"trained, {r[metric]:.1f} {unit}{est_txt} [{_where_text(r)}]"
        out["verdict"] = "matched" + ("; emulated profile" if c.emulated else "")
        return out
    out["ours"] = f"{_status_text(r)}{est_txt} [{_where_text(r)}]"
    lim = memory_limit(r) or _host_oom_limit(r)
    if plan_gpu_refusal(r):
        out["verdict"] = plan_gpu_refusal(r) + (f"; host side ~{est:,.0f} GiB" if est is not None else "")
    elif lim is not None:
        fits = ("fits" if lim.need <= TB_1_5_GIB else "would not fit") if lim.need is not None else None
        out["verdict"] = lim.verdict() + (f"; {fits} in 1.5 TB" if fits and lim.memory == "host RAM" else "")
    elif r["status"] == "skipped":
        out["verdict"] = "not measured (skipped)"
    else:
        out["verdict"] = BUDGET_CUT_VERDICT if status_short(r) == "budget cut" else f"missed ({status_short(r)})"
    return out


# ----------------------------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------------------------

def verdict_counts(evaluated: list[dict]) -> dict[str, int]:
    """Claims per verdict kind, in ``VERDICT_KINDS`` order (kinds with none left out)."""
    kinds = [_verdict_kind(e["verdict"]) for e in evaluated]
    order = list(VERDICT_KINDS) + [k for k in dict.fromkeys(kinds) if k not in VERDICT_KINDS]
    return {k: kinds.count(k) for k in order if k in kinds}


def summary_lines(evaluated: list[dict], target: int = UNMEASURED_TARGET) -> list[str]:
    """The verdict summary and the count of claims without a measured verdict against the target."""
    counts = verdict_counts(evaluated)
    unmeasured = [e["id"] for e in evaluated if _verdict_kind(e["verdict"]) == "not measured"]
    return ["Verdict summary: " + ", ".join(f"{k}: {v}" for k, v in counts.items()) + ".", "",
            f"Claims without a measured verdict: {len(unmeasured)} (not measured) — target ≤ {target}"
            + (f" ({_id_list(unmeasured)})" if unmeasured else "") + ".", ""]


def _id_list(ids: list[str], n: int = 12) -> str:
    return ", ".join(ids[:n]) + (f", … +{len(ids) - n} more" if len(ids) > n else "")
