"""The frame every point process shares (``experiments/point.py``'s throughput points and
``experiments/sft_point.py``'s fine-tuning points): build the job's system, open the point folder, time a
step, record memory and failures, summarize the steps and write ``result.json`` whatever happened.

Nothing here imports torch at module level: ``python -m experiments.point`` re-imported as a spawn child's
``__mp_main__`` must stay light (tests/test_baselines_zenflow.py).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from baselines.oom import failure_status
from megatrain.system import step_flops

from .cache import _digest
from .schema import sanitize
from .sweeps import Job
from .step_records import row_phases

GIB = 2**30


# -- the system ---------------------------------------------------------------------------------------
def load_callable(ref: str):
    """``package.module:name`` or ``/path/to/file.py:name``."""
    mod, _, attr = ref.rpartition(":")
    if not mod or not attr:
        raise ValueError(f"factory must look like 'package.module:function' or '/path/file.py:function', got {ref!r}")
    if mod.endswith(".py") or os.sep in mod:
        path = Path(mod).resolve()
        name = f"_factory_{sanitize(path.stem)}_{_digest(str(path))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load factory module from {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod)
    return getattr(module, attr)


def resolve_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    from megatrain.config import parse_dtype

    return parse_dtype(dtype)


def build_system(job: Job):
    """The job's TrainSystem: its ``factory`` if set, else ``baselines.registry.build_system``. The job's
    options are handed on as they are (megatrain: the ``EngineConfig`` the engine is built with)."""
    kwargs = dict(init_dir=job.init_dir, optim=job.optim, micro_batches=job.micro_batches, device=job.device,
                  dtype=resolve_dtype(job.dtype, job.device),
                  activation_checkpointing=job.activation_checkpointing, options=job.options)
    if job.factory:
        factory = load_callable(job.factory)
        if _accepts(factory, "name"):
            kwargs["name"] = job.system
        return factory(**kwargs)
    from baselines.registry import build_system as registry_build

    # The step's shape, for systems that plan memory for it (the engine's placement plan); under torchrun
    # the engine trains data-parallel over the ranks (one host store per node).
    extra = {}
    if world_size() > 1:
        from megatrain.distributed import DataParallel

        extra["dist"] = DataParallel()
    if not job.init_dir:  # shared_init=false: the engine initialises from its options' seed (megatrain only)
        extra["hf_config"] = job.model_spec().to_hf_config()
    return registry_build(job.system, step_shape=(job.batch_size, job.seq_len), **kwargs, **extra)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _accepts(fn, param: str) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return param in params


# -- facts as text and JSON ----------------------------------------------------------------------
def one_line(text: str, limit: int = 500) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_text(exc: BaseException) -> str:
    """``Type: message`` on one line (what a traceback's last line says)."""
    msg = str(exc).strip()
    return one_line(f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__)


def summarize(records: list[dict], job: Job) -> dict:
    """Step statistics of the measured (non-warmup) steps, and first/last loss of all steps."""
    out = {"steps_done": len(records)}
    if records:
        out["loss_first"] = records[0].get("loss")
        out["loss_last"] = records[-1].get("loss")
    timed = [r for r in records if not r.get("warmup")]
    times = [r["step_time_s"] for r in timed]
    out["measured_steps_done"] = len(times)
    out["warmup_steps_run"] = len(records) - len(timed)  # warmup_steps, plus any the system asked to settle
    if not times:
        return out
    # the spread of the timed steps: a difference inside it is noise, not a result
    out.update(timed_steps=len(times), step_time_min_s=min(times), step_time_max_s=max(times),
               step_time_stdev_s=statistics.stdev(times) if len(times) > 1 else None)
    # clipping fired in a step whose global gradient norm exceeded the threshold (the same test for every
    # system: the norm each reports before clipping); unknown when a system reports no norm
    mgn = float(job.optim.max_grad_norm or 0)
    norms = [r.get("grad_norm") for r in timed]
    if all(n is not None for n in norms):
        out["steps_clipped"] = sum(1 for n in norms if mgn > 0 and float(n) > mgn)
    # the host tier's update per step (MegaTrain's phases): medians over the timed steps (schema v4 columns)
    out.update(row_phases(timed))
    med = statistics.median(times)
    tokens = job.tokens_per_step  # batch_size is per GPU: every GPU's tokens count
    flops = step_flops(job.num_params, job.spec["num_layers"], job.spec["hidden_size"], job.seq_len, tokens)
    tflops = flops / med / 1e12 if med > 0 else None
    peak = job.hardware.get("peak_tflops")
    out.update(step_time_median_s=med, step_time_mean_s=statistics.fmean(times),
               tokens_per_s=tokens / med if med > 0 else None, tflops=tflops,
               mfu=(tflops / (peak * job.gpus)) if (tflops is not None and peak) else None, step_flops=flops)
    return out


def read_metrics(path: Path) -> list[dict]:
    records = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    with contextlib.suppress(ValueError):
                        records.append(json.loads(line))
    except OSError:
        pass
    return records


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default))
    tmp.replace(path)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def finite(x):
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


# -- the point folder's life: open, start, build, step, memory, failure, close ---------------------
def open_point(job: Job, applied: dict | None):
    """The point folder (created), the result.json dict (status "error" until the body says ok) and a
    flushing ``log``."""
    pdir = Path(job.point_dir)
    pdir.mkdir(parents=True, exist_ok=True)
    result: dict = {"point": job.id, "status": "error", "error": "", "pid": os.getpid(), **(applied or {})}
    return pdir, result, lambda msg: print(msg, flush=True)


def start_point(job: Job, pdir: Path, result: dict):
    """Write the resolved ``config.yaml``, set torch's threads; returns torch."""
    import torch
    import yaml

    (pdir / "config.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(job.to_dict())), sort_keys=False))
    if job.torch_threads:
        torch.set_num_threads(int(job.torch_threads))
    result["torch_threads"] = torch.get_num_threads()  # what the engine's host AdamW sizes itself from
    return torch


def build_measured(job: Job, pdir: Path, result: dict, log, tag: str = "point"):
    """``build_system(job)``, timed; what the system chose at build time (e.g. which CPU Adam ran) goes into
    the result and, at once, into ``system_info.json`` (a point killed later, by a host OOM or a timeout,
    still has its settings in the row)."""
    t0 = time.time()
    system = build_system(job)
    result["build_s"] = time.time() - t0
    log(f"[{tag}] built {job.system} in {result['build_s']:.1f}s")
    result["system_info"] = json.loads(json.dumps(getattr(system, "info", {}) or {}, default=str))
    write_json(pdir / "system_info.json", result["system_info"])
    return system


def timed_step(system, batch, i: int, job: Job, mon, sync, warm: bool | None = None) -> dict:
    """Step ``i`` on ``batch``, timed between two ``sync()`` calls (CUDA synchronisations: the step's GPU work
    is inside the bracket, nothing queued before it), as its ``metrics.jsonl`` record (``warm``: a warm-up
    step, excluded from the statistics; None: one of the first ``warmup_steps``)."""
    sync()
    t = time.perf_counter()
    r = system.step(batch)
    sync()
    dt = time.perf_counter() - t
    return {"step": i, "warmup": (i < job.warmup_steps) if warm is None else warm, "loss": finite(r.loss), "step_time_s": dt,
            "system_step_time_s": finite(getattr(r, "step_time_s", None)),
            "lr": finite(getattr(r, "lr", None)), "grad_norm": finite(getattr(r, "grad_norm", None)),
            "tokens": getattr(r, "tokens", None), "host_rss_gib": mon.last_rss / GIB, "time": time.time()}


def record_memory(system, result: dict, cuda: bool) -> None:
    """The system's memory report and the GPU's peaks (torch's on CUDA, the system's own elsewhere)."""
    mem = system.memory()
    result["memory"] = mem.to_dict() if hasattr(mem, "to_dict") else dict(vars(mem))
    if cuda:
        import torch

        result["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        result["gpu_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    else:
        result["gpu_peak_allocated_bytes"] = mem.gpu_peak_allocated if mem.gpu_peak_allocated >= 0 else None
        result["gpu_peak_reserved_bytes"] = mem.gpu_peak_reserved if mem.gpu_peak_reserved >= 0 else None
    result["host_pinned_bytes"] = mem.host_pinned if getattr(mem, "host_pinned", -1) >= 0 else None


def record_failure(result: dict, exc: BaseException) -> None:
    """Every failure becomes a row: its status (``baselines.oom.failure_status``) and one-line error."""
    result["status"] = failure_status(exc)
    result["error"] = error_text(exc)
    traceback.print_exc()
    sys.stderr.flush()


def close_point(job: Job, pdir: Path, result: dict, system, mon, records: list[dict], t_start: float, log,
                tag: str = "point") -> None:
    """Close the system, stop the monitor (host and GPU peaks), summarize the steps and write result.json:
    always, whatever happened before."""
    if system is not None:
        try:
            system.close()
        except Exception as e:  # a failing close does not undo a measurement
            log(f"[{tag}] warning: close() failed: {error_text(e)}")
    if mon is not None:
        peaks = mon.stop()
        result["host_peak_rss_bytes"] = peaks["host_peak_rss_bytes"]  # None (unknown) if the sampler died
        result["gpu_peak_nvml_bytes"] = peaks["gpu_peak_nvml_bytes"]
        if peaks.get("error"):
            result["host_peak_rss_error"] = peaks["error"]
            log(f"[{tag}] warning: host peak unknown: {peaks['error']}")
    result["metrics"] = summarize(records, job)
    result["duration_s"] = time.time() - t_start
    write_json(pdir / "result.json", result)
    log(f"[{tag}] {result['status']}{': ' + result['error'] if result['error'] else ''}")
