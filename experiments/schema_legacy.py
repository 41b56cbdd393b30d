"""Rows of schema v1/v2 (before the typed fields) and v3 (before the host update's phases) upgraded to the
current schema.

Before v3 a skip's kind and its numbers lived only in the ``error`` prose and the placement only in the
point's ``result.json``. This module is the one place that reads that prose, once, to fill the typed
fields of an old row (``python -m experiments.schema --upgrade`` rewrites a file with them); nothing
that judges rows parses text. It also fills what the point folder still holds: the spread and the
clipping of the timed steps (``metrics.jsonl``), the placement and the settings (``result.json``).
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from .step_records import folder_is_rows, row_phases

_GIB = r"(\d[\d,]*(?:\.\d+)?)\s*GiB"


def _num(text: str | None) -> float | None:
    return float(text.replace(",", "")) if text else None


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def skip_fields(status: str, error: str) -> dict:
    """``reason`` and need/have GiB from a v1/v2 error text (the texts ``experiments.sweeps`` wrote then)."""
    err = " ".join(str(error or "").split())
    if status == "timeout" and "clipped by time_budget_s" in err:
        return {"reason": "budget_cut"}
    if status != "skipped":
        return {}
    m = re.search(r"engine plan: GPU needs\s+" + _GIB + r".*?=\s*" + _GIB + r"\)", err)
    if m:
        return {"reason": "plan_gpu", "need_gpu_gib": _num(m.group(1)), "have_gpu_gib": _num(m.group(2))}
    m = re.search(r"all-on-GPU needs .*?=\s*" + _GIB + r"\s*>\s*" + _GIB, err)
    if m:
        return {"reason": "gpu_memory", "need_gpu_gib": _num(m.group(1)), "have_gpu_gib": _num(m.group(2))}
    if "needs a GPU" in err:
        return {"reason": "needs_gpu"}
    m = re.search(r"(?:host needs|host estimate|needs >=.*?=)\s*" + _GIB + r".*?>\s*available host RAM\s*" + _GIB, err)
    if m:
        return {"reason": "host_memory", "need_host_gib": _num(m.group(1)), "have_host_gib": _num(m.group(2))}
    if re.search(r"host estimate exceeds available RAM", err):  # the sample fixtures' wording
        return {"reason": "host_memory"}
    return {}


def _memory_numbers(rec: dict, new: dict) -> None:
    """A host-memory skip whose text gave no numbers: the row's own estimate and host RAM columns."""
    if new.get("reason") == "host_memory" and new.get("need_host_gib") is None:
        est, ram = rec.get("host_estimate_gib"), rec.get("host_ram_gib")
        new["need_host_gib"] = float(est) if est else None
        new["have_host_gib"] = float(ram) if ram else None


def placement_fields(summary: str) -> dict:
    """GPU/host tier layers and params from a ``Placement.summary()`` first line."""
    out = {}
    for tier, key in (("GPU tier", "gpu"), ("host tier", "host")):
        m = re.search(tier + r": (.*?) = ([\d.]+)([BM]) params", summary or "")
        if not m:
            continue
        layers = re.search(r"layers [\d,-]+ \((\d+)\)", m.group(1))
        out[f"{key}_tier_layers"] = int(layers.group(1)) if layers else 0
        out[f"{key}_tier_params"] = int(round(float(m.group(2)) * (1e9 if m.group(3) == "B" else 1e6)))
    return out


def step_fields(point_dir: Path, max_grad_norm: float | None) -> dict:
    """Timed-step spread and clipping from ``metrics.jsonl``."""
    try:
        recs = [json.loads(l) for l in (point_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    except (OSError, ValueError):
        return {}
    timed = [r for r in recs if isinstance(r, dict) and not r.get("warmup") and r.get("step_time_s") is not None]
    if not timed:
        return {}
    times = [float(r["step_time_s"]) for r in timed]
    out = {"timed_steps": len(times), "step_time_min_s": min(times), "step_time_max_s": max(times),
           "step_time_stdev_s": statistics.stdev(times) if len(times) > 1 else None}
    norms = [r.get("grad_norm") for r in timed]
    if max_grad_norm is not None and all(n is not None for n in norms):
        out["steps_clipped"] = sum(1 for n in norms if max_grad_norm > 0 and float(n) > max_grad_norm)
    return out


def phase_fields(point_dir: Path, median_s: float | None) -> dict:
    """The v4 columns (``experiments.step_records.PHASE_COLUMNS``: medians over the timed steps of MegaTrain's
    per-step phases) from ``metrics.jsonl``, only when that folder's timed-step median is the row's own
    (``median_s``): a folder left by another run of the point must not lend its phases."""
    try:
        recs = [json.loads(l) for l in (point_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    except (OSError, ValueError):
        return {}
    timed = [r for r in recs if isinstance(r, dict) and not r.get("warmup") and r.get("step_time_s") is not None]
    if not folder_is_rows([float(r["step_time_s"]) for r in timed], median_s):
        return {}
    return row_phases(timed)


def upgrade(rec: dict, version: int, point_dir: Path) -> dict:
    """An older CSV record (cells) as a current-schema record (cells): the old cells unchanged, the typed
    fields filled where the error text or the point folder tells them (v3: only the host update's phases); the
    caller (``experiments.schema.read_records``) stamps the current version."""
    out = dict(rec) if version >= 3 else _upgrade_to_v3(rec, point_dir)
    if out.get("status") == "ok":
        median = _num(out.get("step_time_median_s") or None)
        out.update({k: _cell(v) for k, v in phase_fields(point_dir, median).items()})
    return out


def _upgrade_to_v3(rec: dict, point_dir: Path) -> dict:
    """A v1/v2 record with the v3 typed fields filled."""
    out = dict(rec)
    new = skip_fields(rec.get("status", ""), rec.get("error", ""))
    _memory_numbers(rec, new)
    settings = {}
    try:
        settings = json.loads(rec.get("settings") or "{}") or {}
    except ValueError:
        pass
    result = {}
    try:
        result = json.loads((point_dir / "result.json").read_text())
    except (OSError, ValueError):
        pass
    info = result.get("system_info") or {}
    cfg = info.get("config") or {}
    mgn = (cfg.get("optim") or {}).get("max_grad_norm")
    if mgn is None:
        try:
            import yaml

            job = yaml.safe_load((point_dir / "config.yaml").read_text()) or {}
            mgn = (job.get("optim") or {}).get("max_grad_norm")
            new.setdefault("dtype", job.get("dtype"))
        except (OSError, ValueError, ImportError, AttributeError):
            pass
    if rec.get("status") == "ok":
        new.update(step_fields(point_dir, float(mgn) if mgn is not None else None))
        new.update(placement_fields(info.get("placement", "")))
        if "gpu_tier_layers" not in new and str(settings.get("gpu_resident")) == "0" and rec.get("num_layers"):
            new.update(gpu_tier_layers=0, host_tier_layers=int(float(rec["num_layers"])))  # pure streaming
    new["max_grad_norm"] = mgn
    new["data"] = "synthetic"  # the runner had no other batches then
    if cfg.get("compute_dtype"):
        new["dtype"] = cfg["compute_dtype"]
    for k in ("cpu_cores", "torch_threads", "host_link_gbps"):
        new[k] = settings.get(k, result.get(k))
    for k in ("gpu_resident", "checkpoint_interval"):
        new[k] = settings.get(k)
    out.update({k: _cell(v) for k, v in new.items() if v is not None})
    out["schema"] = "3"
    return out
