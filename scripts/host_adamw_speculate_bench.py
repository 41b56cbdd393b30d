"""The host AdamW kernel's speculative paths on this machine's CPU, against its plain update.

    python scripts/host_adamw_speculate_bench.py --params 5e8 --out DIR    # appends DIR/speculate.jsonl

Cases (bf16 gradient, one chunk of --params elements, all threads): ``step`` (the plain one-pass update,
26 B/param), ``speculate`` (the same update plus the fragility check and the saved moments, megatrain/
csrc/adamw.cpp; the state is a steady one, v an average of earlier squared gradients, so few elements are
fragile, as in training after its first steps), ``undo+redo`` and ``undo`` (a rollback when clipping fires
or the norm is not finite: one pass). The speculative update must cost about what the plain one does: the
no-clip path's overlap is what it buys.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain import cpu_adamw  # noqa: E402
from megatrain.system import OptimConfig  # noqa: E402
from scripts.adamw_bench import bench_args, timeit  # noqa: E402  (one timing loop for the host AdamW benches)


def main():
    args = bench_args(__doc__)
    n = int(args.params)
    cfg = OptimConfig(lr=1e-4, weight_decay=0.1)
    kernel = cpu_adamw.HostKernel(cfg)
    if kernel.ext is None:
        sys.exit("the extension is not built here (python -m megatrain.kernels build)")
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    m = torch.randn(n, generator=gen) * 1e-3
    v = (torch.randn(n, generator=gen) * 1e-2) ** 2 * 0.5 + (torch.randn(n, generator=gen) * 1e-2) ** 2 * 0.5
    step = torch.tensor(50.0)
    state = [t.clone() for t in (p, m, v)]

    def restore():
        for t, s in zip((p, m, v), state):
            t.copy_(s)

    cases = {
        "step": (lambda: kernel.step(p, g, m, v, step, 1e-4, 1.0), restore),
        "speculate": (lambda: kernel.step(p, g, m, v, step, 1e-4, 1.0, speculative=True),
                      lambda: (restore(), kernel._pending.clear())),
        "undo+redo": (lambda: kernel.undo(p, g, m, v, step, 1e-4, 0.5),
                      lambda: (restore(), kernel.step(p, g, m, v, step, 1e-4, 1.0, speculative=True))),
        "undo": (lambda: kernel.undo(p, g, m, v, step, 1e-4, None),
                 lambda: (restore(), kernel.step(p, g, m, v, step, 1e-4, 1.0, speculative=True))),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "speculate.jsonl", "a") as f:
        for name, (fn, before) in cases.items():
            dt = min(timeit(fn, args.reps, before))
            row = dict(case=name, params=n, threads=kernel.threads, seconds=dt, gparam_per_s=n / dt / 1e9,
                       saved_elements=kernel.saved_elements, deferred_blocks=kernel.deferred_blocks)
            f.write(json.dumps(row) + "\n")
            print(f"{name:10s} {n / dt / 1e9:6.2f} Gparam/s  ({dt * 1e3:.1f} ms)", flush=True)
    print(f"fragile elements saved per speculative update: {kernel.saved_elements / (args.reps + 1) / 3:.0f} "
          f"of {n:,}; blocks deferred: {kernel.deferred_blocks}")


if __name__ == "__main__":
    main()
