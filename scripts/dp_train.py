"""Data-parallel training with the engine: one process per GPU, one host store per node (docs/distributed.md).

    torchrun --nproc-per-node 2 scripts/dp_train.py --model qwen2.5-7b --batch 158 --seq 1024 \
        --gpu-resident 0 --steps 3 --warmup 2 --out runs/multigpu --name multigpu
    torchrun --nproc-per-node 2 scripts/dp_train.py --model tiny-llama --device cpu --batch 2 --seq 32 --out /tmp/dp

Every rank trains on its own rows of a global synthetic batch (``--batch`` rows of ``--seq`` tokens per
rank). Rank 0 appends one JSON object to OUT/<name>.jsonl (system, model, tokens, step_time_s, tflops, ...)
plus ``gpus`` (ranks), ``nodes``, ``tokens`` (all ranks' tokens per step), ``tokens_per_gpu``,
``tokens_per_s`` and ``node_host_pss_gib`` (sum of the node's ranks' PSS: the shared store counted once).
TFLOPS counts every rank's tokens: (6·P·T + 12·L·h·s·T) / median step time with T = all ranks' tokens.

Threads: torchrun sets OMP_NUM_THREADS=1; each rank gets physical cores / local ranks (``--threads``),
which its host AdamW slice needs.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import psutil
import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from experiments.envinfo import collect as env_info  # noqa: E402  (the runner's one environment capture)
from megatrain import EngineConfig, MegaTrain, OptimConfig, get_preset, step_flops  # noqa: E402
from megatrain.data import synthetic_batch  # noqa: E402
from megatrain.distributed import DataParallel  # noqa: E402

GIB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=0, help="override the preset's decoder layers (capacity runs)")
    p.add_argument("--batch", type=int, default=158, help="rows per rank")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--checkpoint-interval", type=int, default=1)
    p.add_argument("--gpu-resident", default="auto", help="'auto', or N layers on the GPU tier (0 = pure streaming)")
    p.add_argument("--speculate", default="auto")
    p.add_argument("--gpu-margin-gib", type=float, default=4.0)
    p.add_argument("--device", default="cuda", help="cpu: gloo on CPU (a smoke test)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: physical cores / local ranks)")
    p.add_argument("--timeout-s", type=float, default=600, help="bound on collectives and shared-memory waits")
    p.add_argument("--name", default="multigpu")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    torch.set_num_threads(args.threads or max(1, (psutil.cpu_count(logical=False) or os.cpu_count()) // local_world))
    tdist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout_s),
                             device_id=torch.device("cuda", local_rank) if cuda else None)
    dp = DataParallel(timeout_s=args.timeout_s)
    rank, world = dp.rank, dp.world_size
    spec = get_preset(args.model)
    if args.layers:
        spec = dataclasses.replace(spec, num_layers=args.layers, name=f"{spec.name}-L{args.layers}")
    tokens_rank = args.batch * args.seq
    cfg = EngineConfig(device=f"cuda:{local_rank}" if cuda else "cpu", micro_batches=args.micro_batches,
                       checkpoint_interval=args.checkpoint_interval, gpu_resident=args.gpu_resident,
                       speculate=args.speculate, gpu_margin_gib=args.gpu_margin_gib,
                       optim=OptimConfig(lr=args.lr, max_grad_norm=args.max_grad_norm))
    env = env_info()
    row = dict(system="megatrain", model=spec.name, num_params=spec.num_params(), gpus=world,
               nodes=world // dp.local_size, tokens=tokens_rank * world, tokens_per_gpu=tokens_rank, seq=args.seq,
               batch=args.batch, micro_batches=args.micro_batches, gpu_resident_setting=args.gpu_resident,
               max_grad_norm=args.max_grad_norm, git_sha=env["git_sha"], gpu=env.get("gpu"), date=env["date"],
               torch_threads=torch.get_num_threads())
    t0 = time.perf_counter()
    engine = MegaTrain.from_config(spec.to_hf_config("sdpa"), cfg, tokens_per_step=tokens_rank, seq_len=args.seq,
                                   dist=dp, verbose=rank == 0)
    row.update(build_s=time.perf_counter() - t0, plan=engine.placement.summary(),
               gpu_resident=engine.placement.gpu_layers)
    steps, rss_peak = [], 0
    try:
        for s in range(args.warmup + args.steps):
            full = synthetic_batch(spec.vocab_size, args.batch * world, args.seq, 0, s)
            r = engine.step({k: v[rank * args.batch:(rank + 1) * args.batch] for k, v in full.items()})
            rss_peak = max(rss_peak, psutil.Process().memory_info().rss)
            steps.append(dict(r.to_dict(), stats=dict(engine.stats)))
            if rank == 0:
                st = engine.stats
                print(f"[dp x{world}] step {s} loss {r.loss:.4f} norm {r.grad_norm:.2f} {r.step_time_s:.3f}s "
                      f"{tokens_rank * world / r.step_time_s:,.0f} tok/s fwd={st['forward_s']:.3f} "
                      f"bwd={st['backward_s']:.3f} exposed={st['optimizer_exposed_s']:.3f} "
                      f"peer_wait={engine.host_opt.peer_wait_s:.3f}", flush=True)
        engine.synchronize()
        mem = engine.memory()
        status = "ok"
    except torch.OutOfMemoryError as exc:
        status, mem = "oom_gpu", None
        row.update(reason=str(exc).splitlines()[0])
    except Exception as exc:
        status, mem = "error", None
        row.update(reason=f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    # Node memory: the sum of the node's ranks' PSS counts the shared host store once.
    mine = dict(pss=psutil.Process().memory_full_info().pss, rss_peak=rss_peak,
                gpu_peak=mem.gpu_peak_allocated if mem and cuda else 0, node=dp.node_key)
    everyone = [None] * world
    tdist.all_gather_object(everyone, mine, group=dp.ctrl)
    timed = steps[args.warmup:]
    if status == "ok" and timed:
        med = statistics.median(s["step_time_s"] for s in timed)
        row.update(step_time_s=med, step_times=[s["step_time_s"] for s in timed],
                   tokens_per_s=tokens_rank * world / med,
                   tflops=step_flops(spec.num_params(), spec.num_layers, spec.hidden_size, args.seq,
                                     tokens_rank * world) / med / 1e12,
                   gpu_peak_gib=max(e["gpu_peak"] for e in everyone) / GIB,
                   host_peak_rss_gib=rss_peak / GIB,
                   node_host_pss_gib=sum(e["pss"] for e in everyone if e["node"] == dp.node_key) / GIB,
                   host_store_gib=getattr(dp, "arena_bytes", 0) / GIB,
                   clipped_steps=sum(int(s["stats"]["clipped"]) for s in timed),
                   rollbacks=sum(int(s["stats"]["rollbacks"]) for s in timed),
                   optimizer_exposed_s=statistics.median(s["stats"]["optimizer_exposed_s"] for s in timed),
                   losses=[s["loss"] for s in steps], grad_norms=[s["grad_norm"] for s in steps],
                   per_step=[s["stats"] for s in steps])
    row["status"] = status
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{args.name}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"gpus={world} tokens/step={tokens_rank * world} s/step={row.get('step_time_s', float('nan')):.3f} "
              f"tokens/s={row.get('tokens_per_s', float('nan')):,.0f} TFLOPS={row.get('tflops', float('nan')):.1f} "
              f"node host PSS={row.get('node_host_pss_gib', float('nan')):.1f} GiB status={status}", flush=True)
    engine.close()
    dp.barrier("done")  # nobody tears down its connections while a peer still uses them
    tdist.destroy_process_group()
    if status != "ok":
        sys.exit(1)


if __name__ == "__main__":
    main()
