"""Tiered-memory and host-optimizer measurements on the GPU machine (results/engine/tiered.md, optimizer.md).

    python scripts/tier_bench.py --model qwen2.5-3b --batch 16 --seq 1024 --systems native,auto,0 \
        --max-grad-norm 1.0 --out DIR --name tiered

Every system runs in this one process on the same batches, one after the other (engines first, then
all-on-GPU HF training), so ratios compare like with like. One JSON object per system is appended to
DIR/<name>.jsonl with the keys of results/engine/tiered.jsonl: system, model, num_params, tokens, seq,
gpu_resident, step_time_s, tflops, gpu_peak_gib, host_peak_rss_gib, status, git_sha (+ max_grad_norm,
clipped_steps, rollbacks, optimizer_exposed_s, the plan and per-step phase timers).

TFLOPS = (6·P·T + 12·L·h·s·T) / median step time (megatrain.system.step_flops; recompute not counted).
A system that runs out of memory or is refused by the plan gets a row with its status and reason.
A run where no system measured anything exits non-zero.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_bench import env_info, native_train  # noqa: E402
from megatrain import EngineConfig, MegaTrain, OptimConfig, get_preset, step_flops  # noqa: E402
from megatrain.data import stdlib_text_bytes, synthetic_batch, text_batch  # noqa: E402

GIB = 2**30


def batches(spec, args, n):
    if args.data == "text":  # Python standard-library sources as byte tokens: real text, nothing downloaded
        text = stdlib_text_bytes(64 << 20)
        return [text_batch(text, args.batch, args.seq, 0, s % args.distinct) for s in range(n)]
    return [synthetic_batch(spec.vocab_size, args.batch, args.seq, 0, s % args.distinct) for s in range(n)]


def base_row(spec, args, system, gpu_resident, update_path="cpu"):
    return dict(system=system, update_path=update_path, model=spec.name, num_params=spec.num_params(), tokens=args.batch * args.seq,
                data=args.data, lr=args.lr, steps_measured=args.steps, warmup_steps=args.warmup,
                seq=args.seq, batch=args.batch, micro_batches=args.micro_batches, gpu_resident=gpu_resident,
                max_grad_norm=args.max_grad_norm, git_sha=ENV["git_sha"], gpu=ENV.get("gpu"), date=ENV["date"])


def finish_row(row, spec, args, times, gpu_peak, host_peak):
    med = statistics.median(times)
    row.update(step_time_s=med, step_times=times, tflops=step_flops(spec.num_params(), spec.num_layers,
               spec.hidden_size, args.seq, args.batch * args.seq) / med / 1e12,
               gpu_peak_gib=gpu_peak / GIB, host_peak_rss_gib=host_peak / GIB,
               host_bytes_per_param=host_peak / spec.num_params(), status="ok")
    return row


def run_engine(spec, args, setting: str, update_path: str = "cpu") -> dict:
    row = base_row(spec, args, "megatrain", setting, update_path)
    optim = OptimConfig(lr=args.lr, max_grad_norm=args.max_grad_norm)
    cfg = EngineConfig(device=args.device, optim=optim, micro_batches=args.micro_batches, gpu_resident=setting,
                       checkpoint_interval=args.checkpoint_interval, speculate=args.speculate,
                       gpu_margin_gib=args.gpu_margin_gib, num_slots=args.num_slots,
                       update_path=update_path.split("+")[0], gpu_path_prefetch=update_path.endswith("+prefetch"))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        engine = MegaTrain.from_config(spec.to_hf_config("sdpa"), cfg, tokens_per_step=args.batch * args.seq,
                                       seq_len=args.seq)
    except MemoryError as exc:
        row.update(status="refused", reason=str(exc))
        print("REFUSED", str(exc).splitlines()[0], flush=True)
        return row
    row.update(build_s=time.perf_counter() - t0, plan=engine.placement.summary(), host_update=engine.host_tier.summary(),
               gpu_resident=engine.placement.gpu_layers, gpu_resident_setting=setting)
    steps, host_peak = [], 0
    try:
        for s, b in enumerate(batches(spec, args, args.warmup + args.steps)):
            r = engine.step(b)
            host_peak = max(host_peak, psutil.Process().memory_info().rss)
            steps.append(dict(r.to_dict(), stats=dict(engine.stats)))
            st = engine.stats
            print(f"  [megatrain {setting} {update_path}] cpu/gpu-path groups {int(st['cpu_groups'])}/"
                  f"{int(st['gpu_path_groups'])} gpu_path busy {st['gpu_path_busy_s']:.3f} wait {st['gpu_path_wait_s']:.3f}",
                  flush=True)
            print(f"  [megatrain {setting} {update_path}] step {s} loss {r.loss:.4f} norm {r.grad_norm:.2f} {r.step_time_s:.3f}s "
                  f"spec={int(st['speculated'])} clip={int(st['clipped'])} exposed={st['optimizer_exposed_s']:.3f} "
                  f"fwd={st['forward_s']:.3f} bwd={st['backward_s']:.3f} norm_s={st['grad_norm_s']:.3f} "
                  f"host_busy={st['host_update_busy_s']:.3f}", flush=True)
        engine.synchronize()
        mem = engine.memory()
    except torch.OutOfMemoryError as exc:
        row.update(status="oom_gpu", reason=str(exc).splitlines()[0], steps_done=len(steps))
        print("OOM", row["reason"], flush=True)
        return row
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    timed = steps[args.warmup:]
    finish_row(row, spec, args, [s["step_time_s"] for s in timed], mem.gpu_peak_allocated,
               max(host_peak, mem.host_rss))
    row.update(clipped_steps=sum(int(s["stats"]["clipped"]) for s in timed),
               speculated_steps=sum(int(s["stats"]["speculated"]) for s in timed),
               rollbacks=sum(int(s["stats"]["rollbacks"]) for s in timed),
               optimizer_exposed_s=statistics.median(s["stats"]["optimizer_exposed_s"] for s in timed),
               host_update_busy_s=statistics.median(s["stats"]["host_update_busy_s"] for s in timed),
               **{k: statistics.median(s["stats"][k] for s in timed)
                  for k in ("cpu_groups", "gpu_path_groups", "gpu_path_busy_s", "gpu_path_wait_s")},
               losses=[s["loss"] for s in steps], grad_norms=[s["grad_norm"] for s in steps],
               gpu_reserved_gib=mem.gpu_peak_reserved / GIB, pinned_gib=mem.host_pinned / GIB,
               plan_gpu_gib=mem.extra["gpu_estimate_bytes"] / GIB, plan_host_gib=mem.extra["host_estimate_bytes"] / GIB,
               per_step=[s["stats"] for s in steps])
    return row


def run_native(spec, args) -> dict:
    row = base_row(spec, args, "native", "native")
    optim = OptimConfig(lr=args.lr, max_grad_norm=args.max_grad_norm)
    try:
        out, peak = native_train(spec.to_hf_config("sdpa"), None, batches(spec, args, args.warmup + args.steps),
                                 optim, checkpointing=True)
    except torch.OutOfMemoryError as exc:
        row.update(status="oom_gpu", reason=str(exc).splitlines()[0])
        print("native OOM", row["reason"], flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        return row
    timed = out[args.warmup:]
    finish_row(row, spec, args, [s["step_time_s"] for s in timed], peak, psutil.Process().memory_info().rss)
    row.update(losses=[s["loss"] for s in out], grad_norms=[s["grad_norm"] for s in out],
               clipped_steps=sum(1 for s in timed if s["grad_norm"] > (args.max_grad_norm or float("inf"))))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-3b")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--distinct", type=int, default=1000, help="distinct batches (1: one repeated batch)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--data", choices=["random", "text"], default="random")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--speculate", default="auto")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--checkpoint-interval", type=int, default=1)
    p.add_argument("--num-slots", type=int, default=2)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    p.add_argument("--gpu-margin-gib", type=float, default=4.0)
    p.add_argument("--systems", default="native,auto,0", help="comma list of native and gpu_resident settings")
    p.add_argument("--update-paths", default="cpu", help="comma list of EngineConfig.update_path values; each engine "
                   "system runs once per value (cpu,hybrid: the CPU kernel alone, then with the GPU update path; "
                   "hybrid+prefetch: with gpu_path_prefetch)")
    p.add_argument("--name", default="tiered")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    spec = get_preset(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "env.json").write_text(json.dumps(ENV, indent=2))
    rows = []
    systems = args.systems.split(",")
    runs = [(s, u) for s in systems if s != "native" for u in args.update_paths.split(",")]
    runs += [(s, "cpu") for s in systems if s == "native"]
    for system, update_path in runs:
        try:
            row = run_native(spec, args) if system == "native" else run_engine(spec, args, system, update_path)
        except Exception as exc:  # one failing system must not lose the others
            row = dict(base_row(spec, args, system, system, update_path), status="error",
                       reason=f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
        rows.append(row)
        with open(out / f"{args.name}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    print(f"\n{'system':10s} {'update':>15s} {'resident':>8s} {'s/step':>7s} {'TFLOPS':>7s} {'GPU GiB':>8s} {'host GiB':>8s} "
          f"{'clip':>4s} {'rollb':>5s} {'exposed':>7s} status")
    for r in rows:
        print(f"{r['system']:10s} {r.get('update_path', 'cpu'):>15s} {str(r.get('gpu_resident')):>8s} {r.get('step_time_s', float('nan')):7.3f} "
              f"{r.get('tflops', float('nan')):7.1f} {r.get('gpu_peak_gib', float('nan')):8.1f} "
              f"{r.get('host_peak_rss_gib', float('nan')):8.1f} {r.get('clipped_steps', '-')!s:>4s} "
              f"{r.get('rollbacks', '-')!s:>5s} {r.get('optimizer_exposed_s', float('nan')):7.3f} {r['status']} "
              f"{r.get('reason', '')[:100]}")
    if not any(r["status"] == "ok" for r in rows):
        sys.exit("no system measured anything")


ENV = env_info()

if __name__ == "__main__":
    main()
