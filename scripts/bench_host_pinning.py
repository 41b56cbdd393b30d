"""The host AdamW update on pageable against page-locked (cudaHostRegister) state, on this machine's CPU.

Why: whether EngineConfig.pin_host_state="all" (master, m, v page-locked) speeds the CPU kernel. Measured on an
H100 node (2026-12-07d, results/update_path_pinning_h100_2026-12-07d.md): no (locked within 3 % of the second
pageable phase, alone and under copies). The lead that asked for it was an off-by-one in an analysis script.
This times the kernel alone on one set of buffers, in the order A-B-A so that a drift with time (page
placement, a warming machine) shows as A != A:

  pageable  -> page-locked (p, m, v, gradient registered in place) -> pageable again (unregistered)

Each phase runs passes over ``--params`` parameters (fp32 p, m, v, a bf16 gradient; chunks of
``megatrain.grad_offload.CHUNK_ELEMS`` as the engine's worker feeds them) for at least ``--seconds`` seconds;
its time is the median pass. With ``--copies`` pinned H2D and D2H copies run meanwhile (the step's weight and
gradient traffic), and each line also gives their rate each way (``h2d_gbs``, ``d2h_gbs``) and the host memory
traffic of the whole (``host_gbs``, see ``host_traffic_gbs``: the number that bounds a pure-streaming step when
the CPU kernel and the copies share the host's memory). Prints one JSON line per phase (and the node's NUMA / transparent-huge-page settings),
appends them to ``--out``; exits 1 without CUDA or without the C++ kernel (nothing the engine runs).

    python scripts/bench_host_pinning.py --params 2e9 --seconds 8 --out $OUT/pinning.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from megatrain import cpu_adamw
from megatrain.grad_offload import CHUNK_ELEMS
from megatrain.pinning import pin_in_place, unpin


def node_facts() -> dict:
    """What of the node may explain a pageable/page-locked difference: NUMA nodes, automatic NUMA balancing,
    transparent huge pages (None where this OS does not say)."""
    def read(path: str) -> str | None:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    return {"numa_nodes": len(nodes) or None, "numa_balancing": read("/proc/sys/kernel/numa_balancing"),
            "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag")}


# Host memory bytes the fused AdamW moves per parameter: p, m, v read and written in fp32 (24) + the bf16
# gradient read (2). Caches do not hold any of it (every pass streams 2e9-parameter buffers).
KERNEL_BYTES_PER_PARAM = 26


def host_traffic_gbs(gparam_per_s: float, h2d_gbs: float = 0.0, d2h_gbs: float = 0.0) -> float:
    """Host memory traffic (GB/s) of the kernel and the copies together: Gparam/s x KERNEL_BYTES_PER_PARAM
    + the H2D copies (read from host memory) + the D2H copies (written to it)."""
    return gparam_per_s * KERNEL_BYTES_PER_PARAM + h2d_gbs + d2h_gbs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=2e9, help="parameters updated per pass")
    ap.add_argument("--seconds", type=float, default=8.0, help="least time per phase")
    ap.add_argument("--copies", action="store_true", help="pinned H2D + D2H copies run meanwhile")
    ap.add_argument("--out", default="", help="also append the JSON lines here")
    ap.add_argument("--allow-fallback", action="store_true", help="time the torch fallback too (tests)")
    a = ap.parse_args(argv)
    n = int(a.params)
    if n < 1 or not a.seconds > 0:
        print("--params must be >= 1 and --seconds > 0", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("page-locking needs CUDA (cudaHostRegister): nothing to compare here", file=sys.stderr)
        return 1
    setup = cpu_adamw.bench_setup(n, a.allow_fallback)
    if isinstance(setup, str):
        print(setup, file=sys.stderr)
        return 1
    kernel, (p, m, v, g) = setup
    step = torch.ones(())
    state = (p, m, v, g)

    def one_pass() -> float:
        t0 = time.perf_counter()
        for lo in range(0, n, CHUNK_ELEMS):
            hi = min(n, lo + CHUNK_ELEMS)
            kernel.step(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], step, 1e-4, 0.5)
        return time.perf_counter() - t0

    copier = _Copies() if a.copies else None
    facts = dict(node_facts(), params=n, copies=a.copies, kernel=cpu_adamw.name(),
                 threads=torch.get_num_threads(), torch=torch.__version__, gpu=torch.cuda.get_device_name())
    rows = []
    for phase in ("pageable", "page_locked", "pageable_again"):
        if phase == "page_locked":
            for t in state:
                pin_in_place(t, "the pinning benchmark's state")
        one_pass()  # warm: threads up, pages touched
        if copier:
            copier.start()
        times, t_end = [], time.perf_counter() + a.seconds
        while time.perf_counter() < t_end or len(times) < 3:
            times.append(one_pass())
        rates = copier.stop() if copier else (0.0, 0.0)
        if phase == "page_locked":
            for t in state:
                unpin(t)
        med = statistics.median(times)
        rows.append(dict(facts, phase=phase, passes=len(times), median_s=med, gparam_per_s=n / med / 1e9,
                         min_s=min(times), max_s=max(times), h2d_gbs=rates[0], d2h_gbs=rates[1],
                         host_gbs=host_traffic_gbs(n / med / 1e9, *rates)))
    base = rows[0]["median_s"]
    for r in rows:
        r["vs_pageable"] = base / r["median_s"]  # > 1: faster than the first pageable phase
        print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


class _Copies:
    """Pinned H2D and D2H copies of 256 MiB, re-queued until ``stop`` (each direction on its own stream);
    ``stop`` returns the GB/s each way over the window (bytes of the copies completed / start-to-stop time)."""

    def __init__(self, nbytes: int = 256 << 20):
        self.nbytes = nbytes
        self.host = [pin_in_place(torch.empty(nbytes, dtype=torch.uint8), "a benchmark copy buffer")
                     for _ in range(2)]
        self.dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        self._run = False
        self._thread = None

    def start(self) -> None:
        import threading

        self._run, self._rounds, self._t0 = True, 0, time.perf_counter()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self._run:
            for s, (dst, src) in zip(self.streams, ((self.dev[0], self.host[0]), (self.host[1], self.dev[1]))):
                with torch.cuda.stream(s):
                    dst.copy_(src, non_blocking=True)
            for s in self.streams:
                s.synchronize()  # a bounded queue: the loop stops within one copy of stop()
            self._rounds += 1  # one copy each way done

    def stop(self) -> tuple[float, float]:
        self._run = False
        if self._thread is not None:
            self._thread.join()
        torch.cuda.synchronize()
        gbs = self._rounds * self.nbytes / (time.perf_counter() - self._t0) / 1e9
        return gbs, gbs  # the loop waits for both directions each round: equal counts


if __name__ == "__main__":
    sys.exit(main())
