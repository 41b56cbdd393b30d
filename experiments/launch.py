"""The runner's side of a point: start its processes, classify how they ended, build the CSV row.

``launch(job)`` writes ``job.json`` into the point's folder, writes the initial weights in a first
process if the cache lacks them, then trains in a second (``python -m experiments.point``), each with a
timeout and its own session (the whole process group is terminated on timeout). ``to_row`` turns the
job and its result into a ``experiments.schema`` row.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .cache import init_complete
from .point_frame import one_line, read_metrics, summarize
from .schema import PARTIAL_MIN_STEPS, PHASE_COLUMNS, Row
from .sweeps import Job

GIB = 2**30
REPO_ROOT = Path(__file__).resolve().parents[1]
KILL_GRACE_S = 10.0


# ================================================================================================
def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(args: list[str], *, timeout: float, log_path: Path, monitor: bool = False,
              threads: int | None = None, nproc: int = 1) -> dict:
    """Run ``python -m experiments.point *args`` in a new session with its output appended to
    ``log_path``; on timeout the whole process group is terminated (then killed). ``nproc`` > 1: through
    torchrun, one process per GPU of this node (data parallel)."""
    env = os.environ.copy()
    env["PYTHONUNBUFFERED"] = "1"
    env["MEGATRAIN_RUNNER_PID"] = str(os.getpid())
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(int(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "experiments.point", *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "experiments.point", *args]
    t0 = time.time()
    timed_out = False
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        mon = None
        if monitor:
            from baselines.monitor import Monitor

            mon = Monitor(pid=proc.pid, interval=0.5, gpu=False).start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            peaks = mon.stop() if mon is not None else {}
    return {"rc": rc, "timed_out": timed_out, "duration_s": time.time() - t0,
            "outside_peak_rss_bytes": peaks.get("host_peak_rss_bytes")}


def last_log_line(path: Path, skip_prefixes=("[point]",)) -> str:
    try:
        lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if not line.startswith(skip_prefixes) and "\r" not in line:
            return one_line(line)
    return one_line(lines[-1]) if lines else ""


def _death(child: dict, what: str, timeout: float, log_path: Path) -> tuple[str, str]:
    rc = child["rc"]
    if child["timed_out"]:
        return "timeout", f"timeout: {what} exceeded {timeout:.0f}s and was terminated"
    if rc is not None and rc < 0:
        sig = -rc
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig == signal.SIGKILL:
            peak = child.get("outside_peak_rss_bytes")
            at = f" at ~{peak / GIB:.1f} GiB RSS" if peak else ""
            return "host_oom", f"host_oom_killed: {what} killed by SIGKILL{at} (likely the kernel OOM killer)"
        return "error", f"{what} killed by {name}"
    return "error", f"{what} exited with status {rc}: {last_log_line(log_path)}"


def launch(job: Job, *, timeout: float, init_timeout: float, log=print) -> dict:
    """Run one point: initial weights (if not cached), then training, each in a subprocess. Returns the
    point's result dict (``status``, ``error``, metrics; see ``train``) whatever happened."""
    pdir = Path(job.point_dir)
    if pdir.exists():
        shutil.rmtree(pdir)
    pdir.mkdir(parents=True)
    pjson = pdir / "job.json"
    job.save(pjson)
    log_path = pdir / "log.txt"
    result: dict = {"launched": True}
    if job.init_dir and not init_complete(Path(job.init_dir)):  # "": the system initialises itself
        child = run_child(["--init", str(pjson)], timeout=init_timeout, log_path=log_path, monitor=True,
                          threads=job.torch_threads)
        result["init_s"] = child["duration_s"]
        if child["rc"] != 0 or not init_complete(Path(job.init_dir)):
            status, error = _death(child, "writing the initial weights", init_timeout, log_path)
            if not child["timed_out"] and child["rc"] is not None and child["rc"] > 0:
                line = last_log_line(log_path)
                if line.startswith("[init] "):
                    status, _, error = line[len("[init] "):].partition(": ")
                    status = status if status in ("gpu_oom", "host_oom", "error") else "error"
                error = f"initial weights: {error}"
            result.update(status=status, error=error, duration_s=child["duration_s"], init_failed=True,
                          host_peak_rss_bytes=child.get("outside_peak_rss_bytes"))
            return result
    child = run_child([str(pjson)], timeout=timeout, log_path=log_path, monitor=True,
                      threads=job.torch_threads, nproc=job.gpus)
    rjson = pdir / "result.json"
    if rjson.exists() and not child["timed_out"]:
        try:
            result.update(json.loads(rjson.read_text()))
        except ValueError:
            result.update(status="error", error="unreadable result.json")
    else:
        status, error = _death(child, "the point process", timeout, log_path)
        records = read_metrics(pdir / "metrics.jsonl")
        result.update(status=status, error=error, metrics=summarize(records, job),
                      host_peak_rss_bytes=child.get("outside_peak_rss_bytes"))
        with contextlib.suppress(OSError, ValueError):  # what the system said at build (its settings)
            result["system_info"] = json.loads((pdir / "system_info.json").read_text())
        if status == "timeout":  # nothing measured is lost: enough finished timed steps make a partial row
            result.update(partial_fields(result["metrics"], job.steps, error))
        if result["status"] != "ok":
            for k in ("step_time_median_s", "step_time_mean_s", "tokens_per_s", "tflops", "mfu"):
                result["metrics"].pop(k, None)
    result["duration_s"] = child["duration_s"]
    result["returncode"] = child["rc"]
    return result


def rerun_note(clipped: bool) -> str:
    """What a row that a rerun retries adds to its error (clipped: the run's time_budget_s cut its timeout)."""
    return f" ({'clipped by time_budget_s; ' if clipped else ''}a rerun retries it)"


def partial_fields(metrics: dict, steps: int, error: str) -> dict:
    """What a timed-out point's result becomes when it finished at least ``PARTIAL_MIN_STEPS`` of its
    ``steps`` timed steps and half of them: an ok row with ``reason`` "partial", its statistics those steps'
    (``summarize`` counts them in ``timed_steps``) and the timeout kept in ``error``; {} otherwise (the row
    stays a timeout without numbers)."""
    done = int(metrics.get("measured_steps_done") or 0)
    if done < PARTIAL_MIN_STEPS or 2 * done < steps or not metrics.get("step_time_median_s"):
        return {}
    return {"status": "ok", "reason": "partial",
            "error": f"partial: {done} of {steps} timed steps finished before {error.removeprefix('timeout: ')}"}


# the row columns a partial result fills (from ``summarize``), beside status, reason and error
PARTIAL_COLUMNS = ("step_time_median_s", "step_time_mean_s", "tokens_per_s", "tflops", "mfu", "timed_steps",
                   "step_time_min_s", "step_time_max_s", "step_time_stdev_s", "steps_clipped", "loss_first",
                   "loss_last", *PHASE_COLUMNS)


def salvage_partial(row: dict, point_dir) -> dict | None:
    """A timeout row written before timed-out points kept their steps (or by a runner that did not), made
    the partial row the runner writes today from its point folder's ``job.json`` and ``metrics.jsonl``;
    None when the row is no timeout, the folder lacks them, or too few timed steps finished."""
    pdir = Path(point_dir)
    if row.get("status") != "timeout" or not (pdir / "job.json").is_file():
        return None
    try:
        job = Job.load(pdir / "job.json")
    except (OSError, ValueError, TypeError, KeyError):
        return None
    metrics = summarize(read_metrics(pdir / "metrics.jsonl"), job)
    error = row.get("error", "").removesuffix(rerun_note(True))
    fields = partial_fields(metrics, job.steps, error)
    if not fields:
        return None
    return {**row, **fields, "error": fields["error"] + rerun_note(row.get("reason") == "budget_cut"),
            **{k: metrics.get(k) for k in PARTIAL_COLUMNS}}


def to_row(job: Job, result: dict, env: dict) -> Row:
    """The typed row (``experiments.schema.Row``) of a job and its result. ``result`` may carry a
    ``skip`` (``skips.Skip``: why it was not launched) and ``reason`` (e.g. "budget_cut")."""
    spec = job.spec
    m = result.get("metrics") or {}
    gib = lambda b: (b / GIB) if isinstance(b, (int, float)) and b is not None and b >= 0 else None  # noqa: E731
    p = job.num_params
    rss = result.get("host_peak_rss_bytes")
    ok = result.get("status") == "ok"
    hw = job.hardware
    info = result.get("system_info") or {}
    engine = job.options if job.system == "megatrain" else None  # its EngineConfig
    timed = (lambda k: m.get(k) if ok else None)  # noqa: E731 - step statistics only from a finished point
    # placement: what the engine reported at build, else (not launched) what its plan predicted
    tiers = info.get("tiers") or (job.tiers or {})
    skip = result.get("skip")
    row = Row(
        sweep=job.sweep, point=job.id, system=job.system, variant=job.variant,
        status=result.get("status", "error"), error=result.get("error", ""), reason=result.get("reason", ""),
        model=job.model, family=spec["family"], num_params=p, num_layers=spec["num_layers"],
        hidden_size=spec["hidden_size"], intermediate_size=spec["intermediate_size"], width_mult=job.width,
        seq_len=job.seq_len, batch_size=job.batch_size, micro_batches=job.micro_batches,
        tokens_per_step=job.tokens_per_step, hardware=hw["label"], emulated=hw["emulated"],
        gpu_mem_cap_gib=hw.get("gpu_mem_gib"), steps=job.steps,
        warmup_steps=m.get("warmup_steps_run", job.warmup_steps) if ok else job.warmup_steps,
        step_time_median_s=timed("step_time_median_s"), step_time_mean_s=timed("step_time_mean_s"),
        tokens_per_s=timed("tokens_per_s"), tflops=timed("tflops"), mfu=timed("mfu"),
        peak_tflops=hw.get("peak_tflops"),
        timed_steps=timed("timed_steps"), step_time_min_s=timed("step_time_min_s"),
        step_time_max_s=timed("step_time_max_s"), step_time_stdev_s=timed("step_time_stdev_s"),
        steps_clipped=timed("steps_clipped"), max_grad_norm=float(job.optim.max_grad_norm or 0),
        gpu_peak_allocated_gib=gib(result.get("gpu_peak_allocated_bytes")),
        gpu_peak_reserved_gib=gib(result.get("gpu_peak_reserved_bytes")),
        gpu_peak_nvml_gib=gib(result.get("gpu_peak_nvml_bytes")),
        host_peak_rss_gib=gib(rss), host_pinned_gib=gib(result.get("host_pinned_bytes")),
        host_bytes_per_param=(rss / p) if rss and p else None,
        host_estimate_gib=gib(job.host_estimate_bytes), loss_first=m.get("loss_first"), loss_last=m.get("loss_last"),
        gpu_tier_layers=tiers.get("gpu_tier_layers"), host_tier_layers=tiers.get("host_tier_layers"),
        gpu_tier_params=tiers.get("gpu_tier_params"), host_tier_params=tiers.get("host_tier_params"),
        blocks=info.get("blocks"), blocks_kept=info.get("blocks_kept"),
        predicted_step_s=info.get("predicted_step_s"),
        **{k: timed(k) for k in PHASE_COLUMNS},
        gpu_name=result.get("gpu_name") or env.get("gpu_name", ""), driver=env.get("driver", ""),
        torch_version=env.get("torch_version", ""), transformers_version=env.get("transformers_version", ""),
        deepspeed_version=env.get("deepspeed_version", ""), git_sha=env.get("git_sha", ""),
        # a host-capped profile's row describes the emulated machine: its RAM is the cap the skip rule and
        # the engine's plan used (the node's own total stays in runs.jsonl's env)
        host_ram_gib=hw.get("host_ram_gib") or env.get("host_ram_gib"), date=_now(),
        duration_s=result.get("duration_s"), optimizer=info.get("optimizer", ""),
        dtype=engine.compute_dtype if engine is not None else resolved_dtype(job), data=job.data, cpu_cores=result.get("cpu_cores") or hw.get("cpu_cores"), torch_threads=result.get("torch_threads"),
        host_link_gbps=result.get("host_link_gbps") or hw.get("host_link_gbps"),
        gpu_resident=str(getattr(engine, "gpu_resident", "")),
        checkpoint_interval=getattr(engine, "checkpoint_interval", None),
        settings=json.dumps(info["settings"], sort_keys=True, separators=(",", ":"), default=str)
        if info.get("settings") else "",
    )
    if skip is not None:
        row = dataclasses.replace(row, **skip.row_fields())
    return row


def resolved_dtype(job: Job) -> str:
    """The compute dtype the point ran with, as a word (auto resolved as the point process does)."""
    if job.dtype != "auto":
        return job.dtype
    return "fp32" if job.device == "cpu" else "bf16"


def _now() -> str:
    from .envinfo import now

    return now()
