"""The results row: one typed record per sweep point, the same columns in every sweep (schema v4).

``results/<sweep>/results.csv`` is what every reader reads (claims, figures, the report). A row is a
``Row``; its fields, in order, are ``COLUMNS``. What used to ride in prose is a field: why a point has
no number (``reason``, with the bytes needed and available per memory), where the engine put the model
(GPU-tier and host-tier layers and params), how many timed steps clipped, the spread of the timed steps,
and the settings that matter for speed. ``error`` is a line for people; no reader parses it.

* ``make_row`` builds a row (missing fields empty), ``append_row`` appends one and flushes it at once;
* ``read_results`` loads a CSV of any readable version as a DataFrame (older rows are upgraded by
  ``experiments.schema_legacy``); ``upgrade_csv`` rewrites an older file in the current version.

This module imports nothing of the runner (no hydra, no torch; pandas only inside the readers), so the
analysis side (``analysis/``) can import it alone.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import functools
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .schema_legacy import upgrade
from .step_records import PHASE_COLUMNS

SCHEMA_VERSION = 4

# Peak dense bf16 TFLOPS used for MFU, by substring of the GPU name (first match wins). The one copy.
PEAK_TFLOPS: dict[str, float] = {
    "H200": 797.5,  # measured on our H200 (dense bf16 matmul), not the datasheet's 989
    "A100": 312.0,
    "A6000": 154.8,
    "3090": 142.0,
}
H200_PEAK_TFLOPS = PEAK_TFLOPS["H200"]


def peak_tflops_for(gpu_name: str | None) -> float | None:
    """The measured peak of a GPU (``PEAK_TFLOPS`` key found in its name, case-insensitive); None when none
    was measured (e.g. the H100: its rows get no MFU rather than another GPU's peak)."""
    if not isinstance(gpu_name, str) or not gpu_name:
        return None
    for key, value in PEAK_TFLOPS.items():
        if key.lower() in gpu_name.lower():
            return value
    return None

STATUSES = ("ok", "skipped", "gpu_oom", "host_oom", "timeout", "error")
DONE_STATUSES = ("ok", "skipped")  # not re-run on a rerun unless redo=true
# Why a row has no number (or only part of one), as a field (``reason``); "" for a complete ok row and for
# failures without a typed cause.
REASONS = {
    "host_memory": "not launched: the memory rule predicts the host RAM is too small (need/have_host_gib)",
    "gpu_memory": "not launched: the GPU memory is too small for an all-on-GPU system (need/have_gpu_gib)",
    "plan_gpu": "not launched: the engine's own placement plan refuses the GPU side (need/have_gpu_gib): "
                "a limit of the engine, which more host RAM would not lift",
    "needs_gpu": "not launched: the system needs a GPU and this run is on the CPU",
    "budget_cut": "stopped by the run's time_budget_s before the point's own timeout (a rerun retries it)",
    "partial": "an ok row of a point that timed out after finishing most of its timed steps: its statistics "
               "are those steps' (timed_steps < steps; a rerun retries it)",
}
# a timed-out point keeps its statistics when it finished at least this many timed steps and half of them
PARTIAL_MIN_STEPS = 3
MEMORY_REASONS = ("host_memory", "gpu_memory", "plan_gpu")  # a memory verdict, not a failure
SAMPLE_SHA = "sample"  # rows of test fixtures / sample data (git_sha or gpu_name)
SAMPLE_GPU = "sample-data"


def _col(doc: str, default=None):
    return field(default=default, metadata={"doc": doc})


@dataclass
class Row:
    """One point's result. Every field is a CSV column (``COLUMNS``, in this order); None = empty cell."""

    sweep: str = _col("sweep name (a conf/sweep/<name>.yaml)", "")
    point: str = _col("point id: <system>__<model>__L<layers>__w<width>__s<seq>__b<batch>__<variant>__<hardware>", "")
    system: str = _col("training system (baselines.registry.SYSTEM_RECORDS)", "")
    variant: str = _col("option variant of the sweep, else 'default'", "default")
    status: str = _col("ok | skipped | gpu_oom | host_oom | timeout | error", "")
    error: str = _col("one line for people: the error, or why the point was skipped (never parsed; see reason)", "")
    model: str = _col("model preset name (megatrain.spec.PRESETS)", "")
    family: str = _col("HF model family", "")
    num_params: int | None = _col("P, parameters of the model actually built (depth/width applied)")
    num_layers: int | None = _col("L, decoder layers")
    hidden_size: int | None = _col("h, hidden size")
    intermediate_size: int | None = _col("FFN size")
    width_mult: float | None = _col("width multiplier applied to hidden and FFN size")
    seq_len: int | None = _col("s, sequence length")
    batch_size: int | None = _col("sequences per optimizer step (all micro-batches together, per GPU)")
    micro_batches: int | None = _col("gradient-accumulation micro-batches per step")
    tokens_per_step: int | None = _col("T = batch_size x seq_len x GPUs")
    hardware: str = _col("GPU short name (real run), 'cpu', or the emulated profile name", "")
    emulated: bool | None = _col("True for an emulated profile (GPU memory, CPU cores, host RAM and/or host link "
                                 "capped; compute is the real GPU's)")
    gpu_mem_cap_gib: float | None = _col("GPU memory cap of the emulated profile (GiB), empty when not capped")
    steps: int | None = _col("timed steps asked for")
    warmup_steps: int | None = _col("warm-up steps run before the timed ones (excluded from the statistics): "
                                    "warmup_steps, plus at most settle_steps while the system was still choosing")
    step_time_median_s: float | None = _col("median wall time of the timed steps (synchronised)")
    step_time_mean_s: float | None = _col("mean wall time of the timed steps")
    tokens_per_s: float | None = _col("T / median step time")
    tflops: float | None = _col("(6*P*T + 12*L*h*s*T) / median step time / 1e12 (activation recompute not counted)")
    mfu: float | None = _col("tflops / peak_tflops")
    peak_tflops: float | None = _col("peak dense bf16 TFLOPS of the (emulated) hardware used for MFU")
    gpu_peak_allocated_gib: float | None = _col("torch.cuda.max_memory_allocated (GiB)")
    gpu_peak_reserved_gib: float | None = _col("torch.cuda.max_memory_reserved (GiB)")
    gpu_peak_nvml_gib: float | None = _col("max device used memory sampled by NVML (whole device, GiB)")
    host_peak_rss_gib: float | None = _col("max RSS of the point process and its children, sampled (GiB); empty when unknown (the sampler failed: result.json host_peak_rss_error)")
    host_pinned_gib: float | None = _col("page-locked host memory reported by the system (GiB)")
    host_bytes_per_param: float | None = _col("host peak RSS / P")
    host_estimate_gib: float | None = _col("the engine's host-memory model for this point (GiB)")
    loss_first: float | None = _col("loss of the first step (warmup included)")
    loss_last: float | None = _col("loss of the last step")
    gpu_name: str = _col("GPU name (or 'cpu')", "")
    driver: str = _col("NVIDIA driver version", "")
    torch_version: str = _col("torch version", "")
    transformers_version: str = _col("transformers version", "")
    deepspeed_version: str = _col("deepspeed version (empty if not installed)", "")
    git_sha: str = _col("git commit of the code that ran ('+dirty' with uncommitted changes)", "")
    host_ram_gib: float | None = _col("total host RAM (GiB): the node's, or a host-RAM profile's cap")
    date: str = _col("when the row was written (local time, ISO 8601)", "")
    duration_s: float | None = _col("wall time of the point's process, start-up included")
    optimizer: str = _col("the optimizer the system actually ran", "")
    settings: str = _col("the system's own settings that matter for speed (JSON), beyond the columns below", "")
    # -- v3: typed fields -------------------------------------------------------------------------
    reason: str = _col("why the row has no number (or a partial one), typed: " + ", ".join(REASONS)
                       + "; '' otherwise", "")
    need_host_gib: float | None = _col("host RAM the point needs by the memory rule (GiB); set for memory skips")
    have_host_gib: float | None = _col("host RAM available to the point when it was judged (GiB)")
    need_gpu_gib: float | None = _col("GPU memory the point needs by the memory rule / the engine's plan (GiB)")
    have_gpu_gib: float | None = _col("GPU memory usable by the point when it was judged (GiB)")
    gpu_tier_layers: int | None = _col("decoder layers on the engine's GPU tier (resident; MegaTrain only)")
    host_tier_layers: int | None = _col("decoder layers on the host tier (streamed every step; MegaTrain only)")
    gpu_tier_params: int | None = _col("parameters on the GPU tier (embedding/head included)")
    host_tier_params: int | None = _col("parameters on the host tier")
    blocks: int | None = _col("checkpoint blocks of the step (recompute units)")
    blocks_kept: int | None = _col("blocks whose activations are kept (not recomputed)")
    timed_steps: int | None = _col("timed steps actually measured")
    step_time_min_s: float | None = _col("fastest timed step")
    step_time_max_s: float | None = _col("slowest timed step")
    step_time_stdev_s: float | None = _col("standard deviation of the timed steps (empty under 2)")
    steps_clipped: int | None = _col("timed steps whose gradient norm exceeded max_grad_norm (clipping fired)")
    max_grad_norm: float | None = _col("the clipping threshold (0 = no clipping)")
    predicted_step_s: float | None = _col("the engine's predicted step time, when its planner gives one")
    dtype: str = _col("compute dtype (bf16, fp32, ...)", "")
    data: str = _col("the batches: synthetic (random tokens) or text (real text, byte-level)", "")
    cpu_cores: int | None = _col("CPU cores the point process could run on")
    torch_threads: int | None = _col("torch threads of the point process")
    host_link_gbps: float | None = _col("emulated host link, GB/s each way (empty: the real link)")
    gpu_resident: str = _col("MegaTrain's gpu_resident setting (auto | N | 0)", "")
    checkpoint_interval: int | None = _col("MegaTrain's checkpoint interval K (layers per block)")
    schema: int | None = _col("row schema version", SCHEMA_VERSION)
    # -- v4: the host tier's update per timed step (MegaTrain; medians of its per-step phases) ------------
    cpu_groups: float | None = _col("host-tier groups the CPU kernel updated per timed step (median; MegaTrain)")
    gpu_path_groups: float | None = _col("host-tier groups the GPU update path updated per timed step (median; "
                                         "MegaTrain update_path hybrid)")
    host_update_busy_s: float | None = _col("the host AdamW worker's busy time per timed step (median, s; MegaTrain)")
    optimizer_exposed_s: float | None = _col("time per timed step the next forward waited for the host tier's "
                                             "update (median, s; MegaTrain)")


FIELDS = {f.name: f for f in dataclasses.fields(Row)}
COLUMNS: list[str] = list(FIELDS)
DESCRIPTIONS: dict[str, str] = {n: f.metadata["doc"] for n, f in FIELDS.items()}
# Headers by version: v1 (before optimizer/settings), v2 (before the typed fields), v3 (before the host
# update's phases), v4 (COLUMNS).
HEADERS: dict[int, list[str]] = {4: COLUMNS, 3: COLUMNS[:COLUMNS.index(PHASE_COLUMNS[0])],
                                 2: COLUMNS[:COLUMNS.index("reason")], 1: COLUMNS[:COLUMNS.index("optimizer")]}
READABLE_HEADERS: list[list[str]] = list(HEADERS.values())

STRING_COLUMNS = frozenset(n for n, f in FIELDS.items() if f.type == "str")
BOOL_COLUMNS = frozenset(n for n, f in FIELDS.items() if f.type.startswith("bool"))
NUMERIC_COLUMNS = tuple(c for c in COLUMNS if c not in STRING_COLUMNS and c not in BOOL_COLUMNS)

CSV_README = """\
# {sweep}: results.csv

One row per point of the `{sweep}` sweep (row schema v{version}, `experiments/schema.py`), written by
`python -m experiments.run sweep={sweep}` as soon as the point ends (a re-run appends rows for the points
it re-did; readers keep the last row per point). Per-point folders `<point>/` hold `config.yaml`,
`metrics.jsonl` (one line per step, warmup steps flagged), `log.txt` and `result.json`.

* step FLOPs = 6·P·T + 12·L·h·s·T (recompute not counted); TFLOPS = step FLOPs / median step time / 1e12
* MFU = TFLOPS / peak_tflops; host bytes/param = host peak RSS / P

## Columns

{columns}
"""


class SchemaError(ValueError):
    """A results CSV whose header is no known version, or a row with unknown fields."""


def csv_readme(sweep: str) -> str:
    cols = "\n".join(f"| `{c}` | {DESCRIPTIONS.get(c, '')} |" for c in COLUMNS)
    return CSV_README.format(sweep=sweep, version=SCHEMA_VERSION, columns="| column | meaning |\n|---|---|\n" + cols)


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


def check_fields(kw: dict) -> None:
    """Refuse unknown columns, an unknown status or an unknown reason."""
    unknown = sorted(set(kw) - set(COLUMNS))
    if unknown:
        raise SchemaError(f"unknown result column(s) {unknown}; the columns are: {', '.join(COLUMNS)}")
    status = kw.get("status")
    if status not in (None, "") and status not in STATUSES:
        raise SchemaError(f"unknown status {status!r}; valid: {', '.join(STATUSES)}")
    reason = kw.get("reason")
    if reason not in (None, "") and reason not in REASONS:
        raise SchemaError(f"unknown reason {reason!r}; valid: {', '.join(REASONS)}")


def make_row(**kw) -> dict[str, str]:
    """A row as CSV cells, every column of ``COLUMNS`` (missing ones empty, ``schema`` = this version);
    unknown keys, statuses or reasons are an error."""
    if isinstance(kw.get("row"), Row):
        kw = dataclasses.asdict(kw.pop("row")) | kw
    check_fields(kw)
    kw.setdefault("schema", SCHEMA_VERSION)
    return {c: _fmt(kw.get(c)) for c in COLUMNS}


def read_header(path) -> list[str] | None:
    """The header of an existing CSV, ``None`` if the file is missing or empty."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def header_version(header: list[str] | None) -> int | None:
    """The schema version of a header (None: no known version)."""
    return next((v for v, h in HEADERS.items() if h == header), None)


def check_header(path, readable: bool = False) -> None:
    """Refuse, with the difference spelled out, a CSV whose header is not the current one (``readable``:
    nor an earlier version's)."""
    header = read_header(path)
    if header is None or header == COLUMNS or (readable and header_version(header)):
        return
    version = header_version(header)
    if version:
        raise SchemaError(f"{path} has a row schema v{version} header; upgrade it in place first: "
                          f"python -m experiments.schema --upgrade {path}")
    near, cols = min(HEADERS.items(), key=lambda kv: len(set(kv[1]) ^ set(header)))  # the closest version
    missing = [c for c in cols if c not in header]
    extra = [c for c in header if c not in cols]
    detail = ([f"missing: {', '.join(missing)}"] if missing else []) + \
             ([f"unexpected: {', '.join(extra)}"] if extra else []) or ["same columns in a different order"]
    raise SchemaError(f"{path} has a different header than any row schema version (closest, v{near}: "
                      f"{'; '.join(detail)}); move it away (or pick another results_dir) to start a new file.")


def append_row(path, row) -> None:
    """Append one row (a ``Row``, ``make_row`` output or keyword dict) and flush it to disk. Writes the
    header if the file is new; refuses (``SchemaError``) a file with another header."""
    path = Path(path)
    row = make_row(row=row) if isinstance(row, Row) else make_row(**row)
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
    write_jsonl(path)


JSONL_NAME = "rows.jsonl"  # beside results.csv: the same rows as typed JSON, one object per line


def _typed(column: str, cell: str):
    """A CSV cell as the JSON value of its column's type: str, bool, int or float (empty -> null); the
    ``settings`` column as the object it holds."""
    kind = FIELDS[column].type
    if column == "settings":
        try:
            return json.loads(cell) if cell else None
        except ValueError:
            return cell
    if kind == "str":
        return cell
    if cell == "":
        return None
    if kind.startswith("bool"):
        return cell.strip().lower() in ("true", "1", "yes")
    try:
        v = float(cell)
    except ValueError:
        return cell
    if kind.startswith("int") and v.is_integer():
        return int(v)
    return v if math.isfinite(v) else None


def jsonl_records(path) -> list[dict]:
    """Every row of the results CSV at ``path`` (history included, in order), typed (``_typed``)."""
    return [{c: _typed(c, r[c]) for c in COLUMNS} for r in read_records(path)]


def write_jsonl(path) -> Path:
    """(Re)write ``rows.jsonl`` beside the results CSV at ``path`` from it (atomically); returns its path.
    The CSV stays the record; this is its machine-readable twin, with the issue's keys as typed values."""
    path = Path(path)
    out = path.with_name(JSONL_NAME)
    tmp = out.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=False, ensure_ascii=False) + "\n" for r in jsonl_records(path)))
    os.replace(tmp, out)
    return out


def read_records(path) -> list[dict[str, str]]:
    """The CSV's rows as dicts of cells in the current schema; rows of an older version are upgraded
    (``experiments.schema_legacy``, reading the point folders beside the CSV)."""
    path = Path(path)
    header = read_header(path)
    if header is None:
        return []
    check_header(path, readable=True)
    with path.open(newline="") as f:
        recs = list(csv.DictReader(f))
    version = header_version(header)
    if version < SCHEMA_VERSION:
        recs = [dict(upgrade(r, version, path.parent / r.get("point", "")), schema=str(SCHEMA_VERSION)) for r in recs]
    return [{c: r.get(c, "") or "" for c in COLUMNS} for r in recs]


def upgrade_csv(path) -> int:
    """Rewrite an older CSV in the current schema (atomically; values kept, typed fields derived). Returns
    the version it had."""
    path = Path(path)
    version = header_version(read_header(path))
    if version is None:
        check_header(path, readable=True)
    if version == SCHEMA_VERSION:
        return version
    recs = read_records(path)
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(recs)
    tmp.replace(path)
    return version


def read_results(path):
    """The CSV as a DataFrame in the current schema: strings as ``str``, numbers as floats (empty ->
    NaN), ``emulated`` as bool, an empty variant as "default". Older versions are upgraded on the fly.
    Raises ``SchemaError`` on a header of no known version. The one reader of results CSVs."""
    import pandas as pd

    recs = read_records(path)
    if not recs:
        return pd.DataFrame({c: pd.Series(dtype=str if c in STRING_COLUMNS else float) for c in COLUMNS})
    df = pd.DataFrame(recs, columns=COLUMNS)
    for c in STRING_COLUMNS:
        df[c] = df[c].astype(str).str.strip()
    df.loc[df["variant"] == "", "variant"] = "default"
    for c in NUMERIC_COLUMNS:
        df[c] = pd.to_numeric(df[c].where(df[c] != ""), errors="coerce")
    for c in BOOL_COLUMNS:
        df[c] = df[c].astype(str).str.lower().isin(("true", "1", "yes"))
    fill_derived(df)
    return df


def formula_tflops(df):
    """``megatrain.system.step_flops`` of each row / its median step time, in TFLOPS."""
    from megatrain.system import step_flops

    flops = step_flops(df["num_params"], df["num_layers"], df["hidden_size"], df["seq_len"], df["tokens_per_step"])
    return flops / df["step_time_median_s"] / 1e12


def row_peaks(df):
    """Each row's peak for MFU: its ``peak_tflops``, else its GPU's measured one (``peak_tflops_for``: H200 rows of
    old CSVs, whose peak column came later); NaN for a GPU without a measured peak (the H100) and for a CPU row
    -- never another GPU's."""
    import pandas as pd

    peak = df["peak_tflops"] if "peak_tflops" in df else pd.Series(float("nan"), index=df.index)
    if "gpu_name" in df:
        peak = peak.fillna(df["gpu_name"].map(peak_tflops_for).astype(float))
    return peak.where(df["hardware"] != "cpu") if "hardware" in df else peak


def fill_derived(df) -> None:
    """Fill ``tflops``/``mfu`` from the formula where an ok row has the inputs but not the value."""
    need = df["tflops"].isna() & df["step_time_median_s"].notna() & (df["status"] == "ok")
    if need.any():
        df.loc[need, "tflops"] = formula_tflops(df[need])
    peak = row_peaks(df)
    need = df["mfu"].isna() & df["tflops"].notna() & peak.notna()
    df.loc[need, "mfu"] = df.loc[need, "tflops"] / peak[need]


def latest(df, key=("point",)):
    """The last row of each point (a re-run appends; the last one counts), except that a budget cut
    (``reason`` "budget_cut": the run's time budget stopped the point, which measured nothing) does not hide
    an earlier ok row of the point: that measurement, with its own commit and date, stays the point's row
    (the runner still retries the point: ``point_status`` reads the last row)."""
    key = list(key)
    cut = (df["reason"] == "budget_cut") & (df["status"] != "ok")
    measured = df[df["status"] == "ok"].drop_duplicates(subset=key, keep="last")
    hidden = cut & df.set_index(key).index.isin(measured.set_index(key).index)
    return df[~hidden].drop_duplicates(subset=key, keep="last").reset_index(drop=True)


def point_status(path) -> dict[str, str]:
    """``{point: status}`` of the last row of each point in the CSV (empty if there is none); "partial" for an
    ok row whose point timed out (``REASONS``): not done, so a rerun retries it."""
    status: dict[str, str] = {}
    path = Path(path)
    if read_header(path) is None:
        return status
    check_header(path, readable=True)
    with path.open(newline="") as f:
        for rec in csv.DictReader(f):
            status[rec["point"]] = "partial" if rec.get("reason") == "partial" else rec["status"]
    return status


def sweep_names(results_dir) -> list[str]:
    """Sweeps with a ``results.csv`` under ``results_dir``, in ``known_sweeps`` order, then the rest."""
    found = sorted(p.parent.name for p in Path(results_dir).glob("*/results.csv"))
    return [s for s in known_sweeps() if s in found] + [s for s in found if s not in known_sweeps()]


SWEEP_CONF = Path(__file__).resolve().parent / "conf" / "sweep"


@functools.lru_cache(maxsize=1)
def known_sweeps() -> tuple[str, ...]:
    """The sweeps: one per ``experiments/conf/sweep/*.yaml`` (read as data, no hydra), in their ``order``."""
    import yaml

    found = []
    for p in SWEEP_CONF.glob("*.yaml"):
        sw = (yaml.safe_load(p.read_text()) or {}).get("sweep") or {}
        found.append((int(sw.get("order", 100)), sw.get("name", p.stem)))
    return tuple(name for _, name in sorted(found))


def load_results(results_dir, sweeps=None, log=print) -> tuple[dict, list[str]]:
    """``{sweep: DataFrame}`` for every ``<results_dir>/<sweep>/results.csv`` that exists (``sweeps``:
    only these names, in this order). Returns ``(frames, errors)``; a malformed CSV is reported in
    ``errors`` rather than stopping the other sweeps. Repeated (point, system, variant, hardware) keep
    the last row."""
    results_dir = Path(results_dir)
    frames, errors = {}, []
    for sweep in sweeps if sweeps is not None else sweep_names(results_dir):
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
        n = len(df)
        df = latest(df, key=("point", "system", "variant", "hardware"))
        if len(df) < n:
            log(f"[note] sweep '{sweep}': {n - len(df)} repeated row(s); kept the last of each (a budget cut "
                "not over an earlier measurement)")
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
    if errors:
        print(f"{len(errors)} error(s):", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m experiments.schema", description="Row schema tools.")
    ap.add_argument("--upgrade", nargs="+", metavar="CSV", help="rewrite older results CSVs in the current version")
    ap.add_argument("--jsonl", nargs="+", metavar="CSV", help=f"(re)write {JSONL_NAME} beside each results CSV")
    args = ap.parse_args(argv)
    for p in args.jsonl or []:
        try:
            print(write_jsonl(p))
        except SchemaError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    for p in args.upgrade or []:
        try:
            v = upgrade_csv(p)
        except SchemaError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{p}: v{v} -> v{SCHEMA_VERSION}" if v != SCHEMA_VERSION else f"{p}: already v{SCHEMA_VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
