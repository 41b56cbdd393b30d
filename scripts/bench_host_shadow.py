"""The host AdamW update with the bf16 shadow (stream_dtype="bf16"): written by the kernel in its update pass
(``HostKernel.step(..., shadow=)``, since d11dddf) against the update followed by ``shadow.copy_(master)``
(the second pass every update made before), and the update alone, on this machine's CPU.

Chunks of ``megatrain.grad_offload.CHUNK_ELEMS`` elements as the engine's worker feeds them; each way's time
is the median of ``--runs`` passes over ``--params`` parameters (fp32 p, m, v, a bf16 gradient, a bf16
shadow). Prints one JSON line per way, and writes them to ``--out`` (JSON lines) when given; exits 1 when the
kernel is not the C++ extension (the torch fallback is not what the engine runs on a GPU node).

    python scripts/bench_host_shadow.py --params 1e9 --runs 5 --out $OUT/shadow.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from megatrain import cpu_adamw
from megatrain.grad_offload import CHUNK_ELEMS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1e9, help="parameters updated per pass")
    ap.add_argument("--runs", type=int, default=5, help="passes per way (median)")
    ap.add_argument("--chunk", type=int, default=CHUNK_ELEMS, help="elements per kernel call")
    ap.add_argument("--out", default="", help="also append the JSON lines here")
    ap.add_argument("--allow-fallback", action="store_true", help="time the torch fallback too (tests)")
    a = ap.parse_args(argv)
    n, chunk = int(a.params), int(a.chunk)
    if n < 1 or a.runs < 1 or chunk < 1:
        print("--params, --runs and --chunk must be >= 1", file=sys.stderr)
        return 2
    setup = cpu_adamw.bench_setup(n, a.allow_fallback)
    if isinstance(setup, str):
        print(setup, file=sys.stderr)
        return 1
    kernel, (p, m, v, g) = setup
    shadow = torch.empty(n, dtype=torch.bfloat16)
    step = torch.ones(())

    def update(way: str) -> float:
        t0 = time.perf_counter()
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            if way == "fused":
                kernel.step(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], step, 1e-4, 0.5, shadow=shadow[lo:hi])
            else:
                kernel.step(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], step, 1e-4, 0.5)
        if way == "second_pass":
            for lo in range(0, n, chunk):  # as ModelStore.refresh_shadow did, after the group's update
                shadow[lo:lo + chunk].copy_(p[lo:lo + chunk])
        return time.perf_counter() - t0

    rows = []
    for way in ("update_only", "fused", "second_pass"):
        update(way)  # warm: pages touched, threads up
        times = [update(way) for _ in range(a.runs)]
        med = statistics.median(times)
        rows.append({"way": way, "params": n, "runs": a.runs, "median_s": med, "gparam_per_s": n / med / 1e9,
                     "min_s": min(times), "max_s": max(times), "kernel": cpu_adamw.name(),
                     "threads": torch.get_num_threads(), "torch": torch.__version__})
    base = rows[0]["median_s"]
    for r in rows:
        r["vs_update_only"] = r["median_s"] / base
        print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
