"""One sweep point, in its own process.

    python -m experiments.point <point_dir>/job.json          # train and measure
    python -m experiments.point --init <point_dir>/job.json   # write the model's initial weights

The runner (``experiments.launch``) writes ``job.json`` (an ``experiments.sweeps.Job``) and starts this
module with a timeout; its stdout and stderr go to ``<point_dir>/log.txt``. Training builds the system
through ``baselines.registry.build_system`` (or the job's ``factory``) with the job's options as they
are, runs ``warmup_steps + steps`` steps on ``megatrain.data.synthetic_batch`` and appends one JSON line
per step to ``metrics.jsonl`` as it goes (nothing is lost if the process dies), then writes
``result.json``. Exceptions are classified by ``baselines.oom.failure_status``; deaths the process
cannot report (timeout, SIGKILL from the kernel's OOM killer) are classified by the runner.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

from baselines.oom import failure_status
from megatrain.system import step_flops

from . import emulation
from .cache import _digest, ensure_init_dir
from .schema import phase_medians, sanitize
from .sweeps import Job

GIB = 2**30


# ================================================================================================
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
    if _world() > 1:
        from megatrain.distributed import DataParallel

        extra["dist"] = DataParallel()
    if not job.init_dir:  # shared_init=false: the engine initialises from its options' seed (megatrain only)
        extra["hf_config"] = job.model_spec().to_hf_config()
    return registry_build(job.system, step_shape=(job.batch_size, job.seq_len), **kwargs, **extra)


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _accepts(fn, param: str) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return param in params


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
    out.update(phase_medians(timed))
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


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default))
    tmp.replace(path)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def _finite(x):
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _cap_gpu_memory(torch, job: Job, log) -> None:
    cap = job.hardware.get("gpu_mem_gib")
    if not cap:
        return
    dev = torch.device(job.device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    frac = min(1.0, float(cap) * GIB / total)
    torch.cuda.set_per_process_memory_fraction(frac, index)
    log(f"[point] emulating {job.hardware['label']}: GPU memory capped to {cap} GiB "
        f"(fraction {frac:.4f} of {total / GIB:.1f} GiB; caching allocator only, compute unchanged)")


def progress_line(i: int, rec: dict, job: Job) -> str:
    """One line per step: TFLOPS on a GPU, tokens/s on the CPU (where TFLOPS would read 0.00)."""
    dt = rec["step_time_s"]
    if job.device.startswith("cuda"):
        flops = step_flops(job.num_params, job.num_layers, job.spec["hidden_size"], job.seq_len, job.tokens_per_step)
        speed = f"{flops / dt / 1e12:.1f} TFLOPS"
    else:
        speed = f"{job.tokens_per_step / dt:,.0f} tokens/s"
    return (f"step {i:3d}{' (warmup)' if rec['warmup'] else '         '} loss {rec['loss']} "
            f"time {dt:.3f}s {speed} rss {rec['host_rss_gib']:.2f} GiB")


def _log_emulation(job: Job, applied: dict, threads: int, log) -> None:
    """One line saying what a CPU-side profile changed (nothing for the real machine)."""
    if not (job.hardware.get("cpu_cores") or applied.get("host_ram_cap_gib") or applied.get("host_link_gbps")):
        return
    parts = []
    if job.hardware.get("cpu_cores"):
        parts.append(f"pinned to {applied['cpu_cores']} CPU core(s) {applied.get('cpu_affinity')}, "
                     f"{threads} torch thread(s)")
    if applied.get("host_ram_cap_gib"):
        parts.append(f"host RAM planned as {applied['host_ram_cap_gib']:g} GiB (planning cap, not enforced)")
    if applied.get("host_link_gbps"):
        parts.append(f"host link {applied['host_link_gbps']:g} GB/s each way (a GPU sleep after each copy; "
                     f"the real bandwidths measured at build are in result.json's system_info.host_link)")
    log(f"[point] emulating {job.hardware['label']}: {'; '.join(parts)}")


def train(job: Job, applied: dict | None = None) -> int:
    """Body of the point process. Always writes result.json; exit status 0 only for ok. ``applied``: the
    CPU-side caps ``emulation.apply`` put in force (recorded in result.json)."""
    from tqdm import tqdm

    from baselines.monitor import Monitor

    pdir, result, log = open_point(job, applied)
    t_start, records, system, mon, cuda = time.time(), [], None, None, job.device.startswith("cuda")
    try:
        torch = start_point(job, pdir, result)

        from megatrain.data import synthetic_batch

        _log_emulation(job, applied or {}, result["torch_threads"], log)

        log(f"[point] {job.id}: {job.system} ({job.variant}) on {job.device}, model {job.model} "
            f"{job.num_params / 1e9:.3f}B params, batch {job.batch_size} x seq {job.seq_len}, "
            f"{job.warmup_steps} warmup + {job.steps} steps; torch {torch.__version__}")
        if cuda:
            _cap_gpu_memory(torch, job, log)
            result["gpu_name"] = torch.cuda.get_device_name(torch.device(job.device))
        mon = Monitor(interval=0.2, gpu=cuda).start()
        system = build_measured(job, pdir, result, log)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        choosing = getattr(system, "choosing", None)  # MegaTrain: still tuning itself (speculation, split)
        vocab = job.spec["vocab_size"]
        if job.data == "text":  # real text, byte-level token ids (< 256 <= every preset's vocabulary)
            from megatrain.data import stdlib_text_bytes, text_batch

            text = stdlib_text_bytes()
            make_batch = lambda step: text_batch(text, job.batch_size, job.seq_len, job.seed, step=step)  # noqa: E731
        else:
            make_batch = lambda step: synthetic_batch(vocab, job.batch_size, job.seq_len, job.seed, step=step)  # noqa: E731
        with open(pdir / "metrics.jsonl", "a") as mf, \
                tqdm(total=job.warmup_steps + job.steps, desc="steps", file=sys.stderr, mininterval=5,
                     dynamic_ncols=False) as bar:
            i = timed = settle = 0
            while timed < job.steps:
                # Warm-up: the first warmup_steps, then, before any timed step, at most settle_steps more while
                # the system says it is still choosing how to run (a trial step of its runtime split is not its
                # steady speed). One process only: ranks that decided apart would run different step counts.
                warm = i < job.warmup_steps
                can_settle = choosing is not None and not timed and settle < job.settle_steps and _world() == 1
                why = choosing() if can_settle and not warm else ""
                if why:
                    warm, settle = True, settle + 1
                    bar.total += 1
                    bar.write(f"[point] step {i}: warm-up extended ({settle} of at most {job.settle_steps}): {why}",
                              file=sys.stderr)
                # data parallel: rank r's batch of step i is its own (batch_size rows per GPU)
                rec = timed_step(system, make_batch(i * _world() + _rank()), i, job, mon, sync, warm)
                if cuda:
                    rec["gpu_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
                phases = getattr(system, "phase_times", None)  # optional: where the step's time went
                if phases is not None:
                    rec["phases"] = {k: _finite(v) for k, v in phases().items()}
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                records.append(rec)
                bar.update(1)
                bar.write(progress_line(i, rec, job), file=sys.stderr)
                timed += not warm
                i += 1
        record_memory(system, result, cuda)
        result["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - every failure becomes a row
        record_failure(result, e)
    finally:
        close_point(job, pdir, result, system, mon, records, t_start, log)
    return 0 if result["status"] == "ok" else 1


# -- the frame every point process shares (this module's train and experiments/sft_point.py) --------------
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
    _write_json(pdir / "system_info.json", result["system_info"])
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
    return {"step": i, "warmup": (i < job.warmup_steps) if warm is None else warm, "loss": _finite(r.loss), "step_time_s": dt,
            "system_step_time_s": _finite(getattr(r, "step_time_s", None)),
            "lr": _finite(getattr(r, "lr", None)), "grad_norm": _finite(getattr(r, "grad_norm", None)),
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
    _write_json(pdir / "result.json", result)
    log(f"[{tag}] {result['status']}{': ' + result['error'] if result['error'] else ''}")


def init_main(job: Job) -> int:
    try:
        ensure_init_dir(job.spec, job.seed, Path(job.cache_dir), log=lambda m: print(m, flush=True))
    except BaseException as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"[init] {failure_status(e)}: {error_text(e)}", flush=True)
        return 1
    return 0


def _die_with_runner() -> None:
    """Ask Linux to SIGKILL this process when the runner dies (the point runs in its own session, so
    a runner killed from outside would otherwise leave it holding the GPU)."""
    runner = os.environ.get("MEGATRAIN_RUNNER_PID")
    if not runner or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        return
    if os.getppid() != int(runner) and "LOCAL_RANK" not in os.environ:  # the runner died before prctl
        os._exit(1)  # (under torchrun the parent is torchrun's agent, itself the runner's child)


def main(argv=None) -> int:
    _die_with_runner()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job_json", help="job.json written by the runner")
    ap.add_argument("--init", action="store_true", help="only write the model's initial weights into the cache")
    args = ap.parse_args(argv)
    job = Job.load(args.job_json)
    if args.init:  # a cache fill shared by every profile, not measured: no emulation
        return init_main(job)
    # first, before torch is imported: its thread pools must start inside the emulated cores
    applied = emulation.apply(job.hardware)
    if job.sft:  # fine-tune a pretrained model and evaluate it (sweep=accuracy_sft)
        from .sft_point import train as sft_train

        return sft_train(job, applied)
    if _world() == 1:
        return train(job, applied)
    return train_rank(job, applied)


def train_rank(job: Job, applied: dict | None = None) -> int:
    """One rank of a data-parallel point (under torchrun, ``gpus`` > 1): its own GPU and share of the
    threads, its own batch of ``batch_size`` rows; rank 0 writes the point's files."""
    import dataclasses

    import torch
    import torch.distributed as tdist

    local, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cuda = job.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local)
        job = dataclasses.replace(job, device=f"cuda:{local}")
    threads = max(1, (job.torch_threads or psutil_cores()) // local_world)
    job = dataclasses.replace(job, torch_threads=threads)
    tdist.init_process_group(backend="nccl" if cuda else "gloo")
    try:
        if _rank() != 0:  # the other ranks train the same steps but write nothing
            job = dataclasses.replace(job, point_dir=str(Path(job.point_dir) / f".rank{_rank()}"))
        return train(job, applied)
    finally:
        try:
            tdist.barrier()  # nobody tears the group down while a peer still uses it
        finally:
            tdist.destroy_process_group()


def psutil_cores() -> int:
    """Physical cores this process may use: the machine's physical count, but no more than its affinity
    set (a cpu_cores profile, taskset, a cpuset), which os.cpu_count() and psutil know nothing of."""
    import psutil

    return max(1, min(psutil.cpu_count(logical=False) or os.cpu_count() or 1, emulation.usable_cores()))


if __name__ == "__main__":
    sys.exit(main())
