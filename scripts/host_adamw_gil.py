"""How fast the main thread runs Python + torch calls while the host AdamW kernel updates in a worker thread.

The engine's main thread issues the GPU's work (hundreds of torch calls per layer) while the host optimizer's
worker updates the host tier chunk by chunk. A kernel that holds the GIL for a chunk's whole update lets the
main thread run only between chunks: each torch call releases the GIL and the waiting worker takes it.

    python scripts/host_adamw_gil.py [--elems 64000000] [--seconds 2] [--threads 1]

Prints the main thread's calls per second alone and during updates, and the worker's chunks per second.
On the 2-core dev machine (2026-12-01, torch 2.13 CPU, defaults, three runs each of this script at 13a21ed /
16fb65f): with 6d94272's GIL-holding adamw.cpp the main thread made 153-738 calls/s during updates (226,020-
274,785 alone); with b2e807a's, which releases the GIL, 242,898-264,478 (267,644-275,570 alone).
Exits non-zero when the worker completed no chunk (nothing was measured).
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatrain import cpu_adamw  # noqa: E402
from megatrain.grad_offload import CHUNK_ELEMS  # noqa: E402
from megatrain.system import OptimConfig  # noqa: E402


def calls_per_s(x: torch.Tensor, seconds: float) -> float:
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        x.add_(1.0)  # ~5 us inside the GIL-released part of the call
        n += 1
    return n / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elems", type=int, default=64_000_000, help="parameters updated per pass")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1, help="kernel threads (the engine: cores - 1)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the main thread's calls run on one core, as the engine's do
    kernel = cpu_adamw.HostKernel(OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
                                  threads=args.threads)
    p, m, v, g = (torch.rand(args.elems) for _ in range(4))
    x = torch.zeros(20_000)
    alone = calls_per_s(x, 1.0)
    stop, chunks = threading.Event(), [0]

    def worker():
        while not stop.is_set():
            for s in range(0, args.elems, CHUNK_ELEMS):
                e = s + CHUNK_ELEMS
                kernel.step(p[s:e], g[s:e], m[s:e], v[s:e], torch.tensor(1.0), 1e-3, 1.0)
                chunks[0] += 1

    w = threading.Thread(target=worker, daemon=True)
    w.start()
    time.sleep(0.3)
    c0, t0 = chunks[0], time.perf_counter()
    during = calls_per_s(x, args.seconds)
    rate = (chunks[0] - c0) / (time.perf_counter() - t0)
    stop.set()
    w.join()
    print(f"kernel {cpu_adamw.name()}, {args.threads} thread(s): main thread {alone:,.0f} calls/s alone, {during:,.0f} calls/s during "
          f"updates; worker {rate:.1f} chunks/s of {CHUNK_ELEMS:,} elements meanwhile")
    return 0 if rate > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
