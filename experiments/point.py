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
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from baselines.oom import failure_status
from megatrain.system import step_flops

from . import emulation
from .cache import ensure_init_dir
from .point_frame import (GIB, build_measured, close_point, error_text, finite, open_point, rank, record_failure,
                          record_memory, start_point, timed_step, world_size)
from .sweeps import Job


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
        transient = getattr(system, "transient", None)  # MegaTrain: the step that just ran was not a steady one
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
                can_settle = not warm and not timed and settle < job.settle_steps and world_size() == 1
                why = choosing() if can_settle and choosing is not None else ""
                if why:
                    warm, settle = True, settle + 1
                    bar.total += 1
                    bar.write(f"[point] step {i}: warm-up extended ({settle} of at most {job.settle_steps}): {why}",
                              file=sys.stderr)
                # data parallel: rank r's batch of step i is its own (batch_size rows per GPU)
                rec = timed_step(system, make_batch(i * world_size() + rank()), i, job, mon, sync, warm)
                if cuda:
                    rec["gpu_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
                phases = getattr(system, "phase_times", None)  # optional: where the step's time went
                if phases is not None:
                    rec["phases"] = {k: finite(v) for k, v in phases().items()}
                late = transient() if can_settle and not warm and transient is not None else ""
                if late:
                    # Known only once it ran: the first step that would be timed was a transient (a cold update
                    # after the runtime split moved groups), by the system's own flag, never by its time: it is
                    # warm-up too, within the same settle_steps.
                    rec["warmup"] = warm = True
                    settle += 1
                    bar.total += 1
                    bar.write(f"[point] step {i}: warm-up extended ({settle} of at most {job.settle_steps}): {late}",
                              file=sys.stderr)
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
    if world_size() == 1:
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
        if rank() != 0:  # the other ranks train the same steps but write nothing
            job = dataclasses.replace(job, point_dir=str(Path(job.point_dir) / f".rank{rank()}"))
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
