"""A short training run of a model preset on whatever device is present, on real text.

    python -m megatrain.demo                       # tiny Qwen2 on CPU/GPU, 20 steps
    python -m megatrain.demo --model qwen2.5-3b --batch 16 --seq 1024 --steps 5

It trains on the Python standard library's own source files as bytes (one token per byte, ids 0..255;
the text ships with Python, nothing is downloaded), so the loss falls visibly within a few steps: from
about ln(vocab size) towards a few nats per byte.
"""
from __future__ import annotations

import argparse
import sys
import time

from .config import EngineConfig
from .spec import PRESETS, get_preset
from .system import OptimConfig, step_flops


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen2", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--checkpoint-interval", type=int, default=1)
    p.add_argument("--num-slots", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    checks = [("--batch", args.batch, 1), ("--seq", args.seq, 2), ("--steps", args.steps, 1),
              ("--micro-batches", args.micro_batches, 1), ("--num-slots", args.num_slots, 1),
              ("--checkpoint-interval", args.checkpoint_interval, 0)]
    for flag, value, least in checks:
        if value < least:
            fail(f"{flag} must be >= {least}, got {value}")
    if args.layers is not None and args.layers < 1:
        fail(f"--layers must be >= 1, got {args.layers}")
    if not args.lr > 0:
        fail(f"--lr must be > 0, got {args.lr}")
    if args.micro_batches > args.batch:
        fail(f"--micro-batches ({args.micro_batches}) must not exceed --batch ({args.batch})")
    return args


def fail(message: str) -> None:
    """One line on stderr and exit status 2 (no traceback, no usage block)."""
    print(f"megatrain.demo: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> None:
    args = parse_args(argv)
    from .data import stdlib_text_bytes, text_batch
    from .engine import MegaTrain

    spec = get_preset(args.model).scaled(depth=args.layers)
    if args.seq > spec.max_position_embeddings:
        fail(f"--seq {args.seq} exceeds the model's {spec.max_position_embeddings} positions")
    cfg = EngineConfig(device=args.device, micro_batches=args.micro_batches,
                       checkpoint_interval=args.checkpoint_interval, num_slots=args.num_slots,
                       optim=OptimConfig(lr=args.lr, warmup_steps=2, total_steps=args.steps))
    text = stdlib_text_bytes()
    t0 = time.perf_counter()
    try:
        engine = MegaTrain.from_config(spec.to_hf_config(), cfg)
    except (ValueError, RuntimeError, MemoryError) as e:
        fail(f"{type(e).__name__}: {e}")
    print(f"built {spec.name or spec.family}: {engine.num_params() / 1e6:.2f}M params on {engine.device} "
          f"({engine.dtype}) in {time.perf_counter() - t0:.1f}s")
    print(f"training on {len(text) / 2**20:.1f} MiB of the Python standard library's source, byte-level "
          f"tokens (256 of the model's {spec.vocab_size} ids); batch {args.batch} x {args.seq} bytes")
    tokens = args.batch * args.seq
    flops = step_flops(engine.num_params(), spec.num_layers, spec.hidden_size, args.seq, tokens)
    on_gpu = engine.device.type == "cuda"
    losses = []
    try:
        for s in range(args.steps):
            r = engine.step(text_batch(text, args.batch, args.seq, seed=0, step=s))
            losses.append(r.loss)
            speed = f"{flops / r.step_time_s / 1e12:7.2f} TFLOPS" if on_gpu else f"{tokens / r.step_time_s:10.0f} tok/s"
            print(f"step {s:3d}  loss {r.loss:8.4f}  grad_norm {r.grad_norm:8.3f}  lr {r.lr:.2e}  "
                  f"step {r.step_time_s * 1e3:8.1f} ms  {speed}", flush=True)
        engine.synchronize()
        m = engine.memory()
        gib = 2**30
        gpu = (f"GPU peak {m.gpu_peak_allocated / gib:.2f} GiB allocated, {m.gpu_peak_reserved / gib:.2f} reserved; "
               if m.gpu_peak_allocated >= 0 else "")
        print(f"memory: {gpu}host peak RSS {m.host_rss / gib:.2f} GiB, pinned {m.host_pinned / gib:.2f} GiB")
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
