"""A short training run of a model preset on whatever device is present.

    python -m megatrain.demo                       # tiny Qwen2 on CPU/GPU, 10 steps
    python -m megatrain.demo --model qwen2.5-3b --batch 16 --seq 1024 --steps 5
"""
from __future__ import annotations

import argparse
import time

import torch

from .config import EngineConfig
from .engine import MegaTrain
from .spec import PRESETS, get_preset
from .system import OptimConfig, step_flops
from .data import synthetic_batch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen2", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--checkpoint-interval", type=int, default=1)
    p.add_argument("--num-slots", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)

    spec = get_preset(args.model).scaled(depth=args.layers)
    cfg = EngineConfig(device=args.device, micro_batches=args.micro_batches,
                       checkpoint_interval=args.checkpoint_interval, num_slots=args.num_slots,
                       optim=OptimConfig(lr=args.lr, warmup_steps=2, total_steps=args.steps))
    t0 = time.perf_counter()
    engine = MegaTrain.from_config(spec.to_hf_config(), cfg)
    print(f"built {spec.name or spec.family}: {engine.num_params() / 1e6:.2f}M params on {engine.device} "
          f"({engine.dtype}) in {time.perf_counter() - t0:.1f}s")
    tokens = args.batch * args.seq
    flops = step_flops(engine.num_params(), spec.num_layers, spec.hidden_size, args.seq, tokens)
    try:
        for s in range(args.steps):
            r = engine.step(synthetic_batch(spec.vocab_size, args.batch, args.seq, seed=0, step=s))
            print(f"step {s:3d}  loss {r.loss:8.4f}  grad_norm {r.grad_norm:8.3f}  lr {r.lr:.2e}  "
                  f"step {r.step_time_s * 1e3:8.1f} ms  {tokens / r.step_time_s:10.0f} tok/s  "
                  f"{flops / r.step_time_s / 1e12:7.2f} TFLOPS", flush=True)
        engine.synchronize()
        m = engine.memory()
        gib = 2**30
        gpu = (f"GPU peak {m.gpu_peak_allocated / gib:.2f} GiB allocated, {m.gpu_peak_reserved / gib:.2f} reserved; "
               if m.gpu_peak_allocated >= 0 else "")
        print(f"memory: {gpu}host peak RSS {m.host_rss / gib:.2f} GiB, pinned {m.host_pinned / gib:.2f} GiB "
              f"(estimate {engine.host_estimate['bytes_per_param']:.1f} bytes/param)")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
