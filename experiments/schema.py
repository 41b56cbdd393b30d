"""The results CSV: one row per sweep point, the same columns in every sweep.

``results/<sweep>/results.csv`` is the only thing the plots and the report read. Its columns, in this
order, are ``COLUMNS``; ``make_row`` builds a row (missing fields empty), ``append_row`` appends one and
flushes it to disk at once (so a crash loses nothing that finished), ``read_results`` loads a CSV as a
DataFrame with numeric columns converted. A re-run appends new rows for the points it re-did; readers
keep the last row of each point (``latest``).

No torch import here: the plotting/report side uses this module on machines without it.
"""
from __future__ import annotations

import csv
import math
import os
import re
from pathlib import Path

COLUMNS: list[str] = [
    "sweep", "point", "system", "variant", "status", "error", "model", "family", "num_params",
    "num_layers", "hidden_size", "intermediate_size", "width_mult", "seq_len", "batch_size",
    "micro_batches", "tokens_per_step", "hardware", "emulated", "gpu_mem_cap_gib", "steps",
    "warmup_steps", "step_time_median_s", "step_time_mean_s", "tokens_per_s", "tflops", "mfu",
    "peak_tflops", "gpu_peak_allocated_gib", "gpu_peak_reserved_gib", "gpu_peak_nvml_gib",
    "host_peak_rss_gib", "host_pinned_gib", "host_bytes_per_param", "host_estimate_gib",
    "loss_first", "loss_last", "gpu_name", "driver", "torch_version", "transformers_version",
    "deepspeed_version", "git_sha", "host_ram_gib", "date", "duration_s", "optimizer", "settings",
]
# Headers of earlier versions, still readable (missing columns come back empty); appending needs COLUMNS.
READABLE_HEADERS: list[list[str]] = [COLUMNS, COLUMNS[:-2]]

KNOWN_SWEEPS = ("smoke", "baselines", "size", "depth", "width", "context", "hardware", "ablation", "tokens")
SAMPLE_SHA = "sample"  # rows of test fixtures / sample data (git_sha or gpu_name)
SAMPLE_GPU = "sample-data"
STATUSES = ("ok", "skipped", "gpu_oom", "host_oom", "timeout", "error")
DONE_STATUSES = ("ok", "skipped")  # not re-run on a rerun unless redo=true
# Appended by experiments/run.py to the error of a timeout that the run's time_budget_s cut short (the point's
# own timeout_s was not reached): figures and the report call such a row "budget cut", not a timeout.
BUDGET_CUT = "clipped by time_budget_s"

STRING_COLUMNS = frozenset({
    "sweep", "point", "system", "variant", "status", "error", "model", "family", "hardware", "emulated",
    "gpu_name", "driver", "torch_version", "transformers_version", "deepspeed_version", "git_sha", "date",
    "optimizer", "settings",
})
NUMERIC_COLUMNS = tuple(c for c in COLUMNS if c not in STRING_COLUMNS)

DESCRIPTIONS: dict[str, str] = {
    "sweep": "sweep name (smoke, size, depth, width, context, hardware, ablation, tokens)",
    "point": "point id: <system>__<model>__L<layers>__w<width>__s<seq>__b<batch>__<variant>__<hardware>",
    "system": "training system (baselines.registry.SYSTEM_RECORDS): megatrain, zero3, zero2, superoffload, fsdp, gemini, native",
    "variant": "option variant (ablation sweep), else 'default'",
    "status": "ok | skipped | gpu_oom | host_oom | timeout | error",
    "error": "last line of the error, or why the point was skipped",
    "model": "model preset name (megatrain.spec.PRESETS)",
    "family": "HF model family",
    "num_params": "P, parameters of the model actually built (depth/width applied)",
    "num_layers": "L, decoder layers",
    "hidden_size": "h, hidden size",
    "intermediate_size": "FFN size",
    "width_mult": "width multiplier applied to hidden and FFN size",
    "seq_len": "s, sequence length",
    "batch_size": "sequences per optimizer step (all micro-batches together)",
    "micro_batches": "gradient-accumulation micro-batches per step",
    "tokens_per_step": "T = batch_size x seq_len",
    "hardware": "GPU short name (real run), 'cpu', or the emulated profile name",
    "emulated": "True for an emulated profile: GPU memory, CPU cores, host RAM and/or the host link capped "
                "(compute is still the real GPU's; a slower host link is emulated only by MegaTrain)",
    "gpu_mem_cap_gib": "GPU memory cap of the emulated profile (GiB), empty when not capped",
    "steps": "measured steps",
    "warmup_steps": "warmup steps run before the measured ones (excluded from the statistics)",
    "step_time_median_s": "median wall time of the measured steps (synchronised)",
    "step_time_mean_s": "mean wall time of the measured steps",
    "tokens_per_s": "T / median step time",
    "tflops": "(6*P*T + 12*L*h*s*T) / median step time / 1e12 (activation recompute not counted)",
    "mfu": "tflops / peak_tflops",
    "peak_tflops": "peak dense bf16 TFLOPS of the (emulated) hardware used for MFU",
    "gpu_peak_allocated_gib": "torch.cuda.max_memory_allocated (GiB)",
    "gpu_peak_reserved_gib": "torch.cuda.max_memory_reserved (GiB)",
    "gpu_peak_nvml_gib": "max device used memory sampled by NVML (whole device, GiB)",
    "host_peak_rss_gib": "max RSS of the point process and its children, sampled in the background (GiB); "
                         "empty when unknown (the sampler failed: result.json host_peak_rss_error)",
    "host_pinned_gib": "page-locked host memory reported by the system (GiB)",
    "host_bytes_per_param": "host peak RSS / P",
    "host_estimate_gib": "MegaTrain's host-memory model for this model (a lower bound for any offloading system)",
    "loss_first": "loss of the first step (warmup included)",
    "loss_last": "loss of the last step",
    "gpu_name": "GPU name (or 'cpu')",
    "driver": "NVIDIA driver version",
    "torch_version": "torch version",
    "transformers_version": "transformers version",
    "deepspeed_version": "deepspeed version (empty if not installed)",
    "git_sha": "git commit of the code that ran ('+dirty' with uncommitted changes)",
    "host_ram_gib": "total host RAM (GiB): the node's, or the emulated total of a host-RAM-capped profile "
                    "(a planning cap, not enforced)",
    "date": "when the row was written (local time, ISO 8601)",
    "duration_s": "wall time of the point's process, start-up included",
    "optimizer": "the optimizer the system actually ran (e.g. DeepSpeedCPUAdam, torch.AdamW(fused|foreach))",
    "settings": "the system's effective settings that matter for speed (JSON; e.g. ZeRO bucket sizes), plus "
                "the point process's cpu_cores (CPUs it could run on) and torch_threads",
}

CSV_README = """\
# {sweep}: results.csv

One row per point of the `{sweep}` sweep, written by `python -m experiments.run sweep={sweep}` as soon as
the point ends (a re-run appends rows for the points it re-did; readers keep the last row per point).
Per-point folders `<point>/` hold `config.yaml` (resolved), `metrics.jsonl` (one line per step, warmup
steps flagged; MegaTrain's lines carry the engine's phase timers under `phases`), `log.txt` (the point process's stdout/stderr) and `result.json`.

## Formulas

* step FLOPs = 6·P·T + 12·L·h·s·T  (P params, T tokens per optimizer step, L layers, h hidden size,
  s sequence length; forward + backward matmuls plus causal attention; activation recompute is *not*
  counted, so TFLOPS is useful throughput)
* TFLOPS = step FLOPs / median step time / 1e12, over the measured steps (warmup steps excluded)
* MFU = TFLOPS / peak_tflops (H200: 797.5, measured dense bf16; A100 312; RTX A6000 154.8; RTX 3090 142).
  Emulated profiles cap GPU memory, CPU cores, host RAM or the host link: the compute is still the real
  GPU's (so an emulated smaller GPU's MFU can exceed 1), and only the link-* profiles (MegaTrain only)
  slow the host link (PCIe).
* host bytes/param = host peak RSS (process + children) / P

## Columns

{columns}
"""


class SchemaError(ValueError):
    """A results CSV whose header is not ``COLUMNS`` or a row with unknown fields."""


def csv_readme(sweep: str) -> str:
    cols = "\n".join(f"| `{c}` | {DESCRIPTIONS.get(c, '')} |" for c in COLUMNS)
    return CSV_README.format(sweep=sweep, columns="| column | meaning |\n|---|---|\n" + cols)


# -- point ids ------------------------------------------------------------------------------------
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def sanitize(text: str) -> str:
    """A file-name-safe token: runs of anything but letters, digits, ``. _ + -`` become ``-``."""
    return _UNSAFE.sub("-", str(text)).strip("-") or "x"


def fmt_width(width: float) -> str:
    """1.0 -> '1', 1.5 -> '1.5'."""
    w = float(width)
    return str(int(w)) if w.is_integer() else f"{w:g}"


def point_id(system: str, model: str, layers: int, width: float, seq: int, batch: int, variant: str,
             hardware: str) -> str:
    """``<system>__<model>__L<layers>__w<width>__s<seq>__b<batch>__<variant>__<hardware>``, each part
    sanitized (so also a folder name)."""
    parts = [system, model, f"L{int(layers)}", f"w{fmt_width(width)}", f"s{int(seq)}", f"b{int(batch)}",
             variant, hardware]
    return "__".join(sanitize(p).replace("__", "_") for p in parts)


# -- rows -----------------------------------------------------------------------------------------
def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "" if math.isnan(value) else str(value)
        return f"{value:.6g}" if abs(value) < 1e15 else repr(value)
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars
        try:
            return _fmt(value.item())
        except Exception:
            pass
    text = str(value)
    return " ".join(text.split()) if ("\n" in text or "\r" in text) else text


def make_row(**kw) -> dict[str, str]:
    """A row with every column of ``COLUMNS`` (missing ones empty); unknown keys are an error."""
    unknown = sorted(set(kw) - set(COLUMNS))
    if unknown:
        raise SchemaError(f"unknown result column(s) {unknown}; the columns are: {', '.join(COLUMNS)}")
    status = kw.get("status")
    if status not in (None, "") and status not in STATUSES:
        raise SchemaError(f"unknown status {status!r}; valid: {', '.join(STATUSES)}")
    return {c: _fmt(kw.get(c)) for c in COLUMNS}


def read_header(path) -> list[str] | None:
    """The header of an existing CSV, ``None`` if the file is missing or empty."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def check_header(path, readable: bool = False) -> None:
    """Refuse, with the difference spelled out, a CSV whose header is not ``COLUMNS`` (``readable``:
    nor one of the earlier ``READABLE_HEADERS``)."""
    header = read_header(path)
    if header is None or header == COLUMNS or (readable and header in READABLE_HEADERS):
        return
    missing = [c for c in COLUMNS if c not in header]
    extra = [c for c in header if c not in COLUMNS]
    detail = []
    if missing:
        detail.append(f"missing: {', '.join(missing)}")
    if extra:
        detail.append(f"unexpected: {', '.join(extra)}")
    if not detail:
        detail.append("same columns in a different order")
    raise SchemaError(
        f"{path} has a different header than the results schema ({'; '.join(detail)}). It was written by "
        f"another version of the runner; move it away (or pick another results_dir) to start a new file."
    )


def append_row(path, row: dict) -> None:
    """Append one row (``make_row`` output or keyword dict) and flush it to disk. Writes the header if
    the file is new; refuses (``SchemaError``) if the existing header differs."""
    path = Path(path)
    row = make_row(**row)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_header(path)
    new = read_header(path) is None
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="raise")
        if new:
            writer.writeheader()
        writer.writerow(row)
        f.flush()
        os.fsync(f.fileno())


def read_results(path):
    """The CSV as a DataFrame: every column present, strings as ``str``, numeric columns as floats
    (empty -> NaN), ``emulated`` as bool, an empty variant as "default"; ``tflops``/``mfu`` filled
    from the formula where a row has the inputs but not the value. Raises ``SchemaError`` on a header
    that is neither ``COLUMNS`` nor an earlier readable one. The one reader of results CSVs."""
    import pandas as pd

    path = Path(path)
    if read_header(path) is None:
        return pd.DataFrame({c: pd.Series(dtype=str if c in STRING_COLUMNS else float) for c in COLUMNS})
    check_header(path, readable=True)
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    for c in COLUMNS:
        if c not in df.columns:
            df[c] = ""
    for c in STRING_COLUMNS:
        df[c] = df[c].astype(str).str.strip()
    df.loc[df["variant"] == "", "variant"] = "default"
    for c in NUMERIC_COLUMNS:
        df[c] = pd.to_numeric(df[c].where(df[c] != ""), errors="coerce")
    df["emulated"] = df["emulated"].astype(str).str.lower().isin(("true", "1", "yes"))
    df = df[COLUMNS].copy()
    fill_derived(df)
    return df


def formula_tflops(df):
    """``megatrain.system.step_flops`` of each row / its median step time, in TFLOPS."""
    from megatrain.system import step_flops

    flops = step_flops(df["num_params"], df["num_layers"], df["hidden_size"], df["seq_len"], df["tokens_per_step"])
    return flops / df["step_time_median_s"] / 1e12


def fill_derived(df) -> None:
    """Fill ``tflops``/``mfu`` from the formula where an ok row has the inputs but not the value."""
    from .config import H200_PEAK_TFLOPS

    need = df["tflops"].isna() & df["step_time_median_s"].notna() & (df["status"] == "ok")
    if need.any():
        df.loc[need, "tflops"] = formula_tflops(df[need])
    # rows without a peak: H200 rows of old CSVs (the peak column came later); never a CPU row
    peak = df["peak_tflops"].where(df["peak_tflops"].notna() | (df["hardware"] == "cpu"), H200_PEAK_TFLOPS)
    need = df["mfu"].isna() & df["tflops"].notna() & peak.notna()
    df.loc[need, "mfu"] = df.loc[need, "tflops"] / peak[need]


def latest(df):
    """The last row of each point (a re-run appends; the last one counts)."""
    return df.drop_duplicates(subset=["point"], keep="last").reset_index(drop=True)


def point_status(path) -> dict[str, str]:
    """``{point: status}`` of the last row of each point in the CSV (empty if there is none)."""
    status: dict[str, str] = {}
    path = Path(path)
    if read_header(path) is None:
        return status
    check_header(path)
    with path.open(newline="") as f:
        for rec in csv.DictReader(f):
            status[rec["point"]] = rec["status"]
    return status


def load_results(results_dir, sweeps=None, log=print) -> tuple[dict, list[str]]:
    """``{sweep: DataFrame}`` for every ``<results_dir>/<sweep>/results.csv`` that exists (``sweeps``:
    only these names, in this order; None: every folder with a results.csv, known sweeps first).

    Returns ``(frames, errors)``; a malformed CSV is reported in ``errors`` (and logged) rather than
    stopping the other sweeps. Rows repeated for the same (point, system, variant, hardware) keep
    the last one (a re-run appended to the file).
    """
    results_dir = Path(results_dir)
    frames, errors = {}, []
    if sweeps is None:
        found = sorted(p.parent.name for p in results_dir.glob("*/results.csv"))
        sweeps = [s for s in KNOWN_SWEEPS if s in found] + [s for s in found if s not in KNOWN_SWEEPS]
    for sweep in sweeps:
        path = results_dir / sweep / "results.csv"
        if not path.exists():
            log(f"[skip] sweep '{sweep}': {path} not found")
            continue
        try:
            df = read_results(path)
        except SchemaError as e:
            log(f"[error] {e}")
            errors.append(str(e))
            continue
        if df.empty:
            log(f"[skip] sweep '{sweep}': {path} has no rows")
            continue
        key = ["point", "system", "variant", "hardware"]
        n = len(df)
        df = df.drop_duplicates(subset=key, keep="last").reset_index(drop=True)
        if len(df) < n:
            log(f"[note] sweep '{sweep}': {n - len(df)} repeated row(s); kept the last of each")
        frames[sweep] = df
    return frames, errors


def is_sample(df) -> bool:
    return bool(((df["git_sha"] == SAMPLE_SHA) | (df["gpu_name"] == SAMPLE_GPU)).any())


def fill_x_from_point(df, col: str):
    """``col`` with gaps filled from other rows of the same point (a skipped run may lack shape data)."""
    by_point = df.dropna(subset=[col]).groupby("point")[col].first()
    return df[col].fillna(df["point"].map(by_point))


def report_errors(errors: list[str]) -> int:
    """Print a command's collected errors on stderr; its exit status (2 if any, else 0)."""
    import sys

    if errors:
        print(f"{len(errors)} error(s):", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        return 2
    return 0
