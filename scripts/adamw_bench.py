"""Host AdamW kernels on this machine's CPU: Gparam/s and the memory bandwidth each reaches.

    python scripts/adamw_bench.py --params 5e8 --out DIR      # appends DIR/adamw.jsonl

Bytes moved per parameter (each tensor read once, written once): fp32 p, m, v read + written = 24 B, plus
the gradient read: 2 B (bf16) or 4 B (fp32). GB/s = bytes/param x Gparam/s. Kernels: the one-pass C++/
OpenMP extension (megatrain/csrc/adamw.cpp), torch's fused CPU AdamW on fp32 gradients (reused buffers),
and the fallback path (bf16 gradient widened in 1M-element chunks, then torch's fused kernel).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain import cpu_adamw  # noqa: E402
from megatrain.optim import adamw_  # noqa: E402
from megatrain.system import OptimConfig  # noqa: E402


def timeit(fn, reps: int, before=None) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn``, after one untimed warm-up call; ``before``, if given, runs
    untimed ahead of every call (e.g. restoring the state the call changes). The host AdamW benches share it."""
    times = []
    for _ in range(reps + 1):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times[1:]


def bench_args(doc: str) -> argparse.Namespace:
    """The host AdamW benches' command line: ``--params`` (elements of one update), ``--reps``, ``--out``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=5e8, help="elements updated per call")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per case (after one untimed)")
    ap.add_argument("--out", required=True, help="folder the JSONL lines are appended to")
    return ap.parse_args()


def main():
    args = bench_args(__doc__)
    n = int(args.params)
    cfg = OptimConfig(lr=1e-4, weight_decay=0.1)
    p, m, v = torch.randn(n), torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
    g32 = torch.randn(n) * 1e-2
    g16 = g32.bfloat16()
    step = torch.tensor(5.0)
    rows = []
    ext = cpu_adamw.extension()
    threads = torch.get_num_threads()
    cases = []
    if ext is not None:
        for th in sorted({threads, max(1, threads - 1)}):
            cases.append((f"cpp bf16 grad ({th} threads)", 26, lambda th=th: ext.adamw_step(
                p, g16, m, v, 1.0, 1e-4, 0.9, 0.95, 1e-8, 0.1, 5.0, th)))
        cases.append((f"cpp fp32 grad ({threads} threads)", 28, lambda: ext.adamw_step(
            p, g32, m, v, 1.0, 1e-4, 0.9, 0.95, 1e-8, 0.1, 5.0, threads)))
    cases.append((f"torch fused fp32 grad ({threads} threads)", 28, lambda: adamw_(p, g32, m, v, step, 1e-4, cfg)))
    os_env = dict(cpu_adamw.os.environ)
    cpu_adamw.os.environ["MEGATRAIN_HOST_ADAMW"] = "torch"
    fallback = cpu_adamw.HostKernel(cfg)
    cpu_adamw.os.environ.clear()
    cpu_adamw.os.environ.update(os_env)
    cases.append((f"fallback: bf16 widened + torch fused ({threads} threads)", 26,
                  lambda: fallback.step(p, g16, m, v, step, 1e-4, 1.0)))
    for name, bpp, fn in cases:
        dt = statistics.mean(timeit(fn, args.reps))
        gps = n / dt / 1e9
        row = dict(kernel=name, params=n, seconds=dt, gparam_per_s=gps, bytes_per_param=bpp, gb_per_s=gps * bpp)
        rows.append(row)
        print(f"{name:50s} {gps:6.2f} Gparam/s  {gps * bpp:6.1f} GB/s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "adamw.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
