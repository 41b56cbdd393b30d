"""Which host-tier groups the GPU update path takes: a bandwidth model of the two update paths.

The host tier's AdamW has two paths that run at the same time (megatrain/host_tier.py):

* **CPU**: the CPU kernel updates the group in host RAM (megatrain/host_adamw.py). Memory-bound: ``cpu_gps``
  Gparam/s alone, ``cpu_loaded_gps`` while the GPU path's copies load host memory too (H200 node: 4.20 and
  2.72; together with 46 GB/s each way of copies, ~170 GB/s of host traffic against 117 for the CPU alone).
  Its gradient crosses PCIe to the host (D2H, ``grad_bytes``/param) and the next forward loads the updated
  master (H2D, ``stream_bytes``/param).
* **GPU**: fp32 master, m and v go up (12 B/param H2D), the fused CUDA AdamW updates them, and they come
  back (12 B/param D2H); the updated master feeds the next forward's cast on the GPU, so that group's load
  costs nothing more. PCIe-bound: ~3.8 Gparam/s at 46 GB/s each way.

``plan_split`` is a pure function of these rates: it walks the groups in the order the next forward needs
them and gives each to the path that would finish it first (list scheduling over three clocks: the CPU,
and the link each way, which the CPU path's gradient and load bytes share with the GPU path's state), so
that both paths finish together and the groups finish roughly in the forward's order. A speculative step
(the CPU path starts during the backward, in gradient-arrival order L-1 .. 0, embedding last) gives the
GPU path a prefix of the forward order instead: the groups the CPU would update last and the forward
needs first. Rates come from ``measure_rates`` on the GPU machine (build time, ~1 s) or the defaults.

The planner's step-time model (megatrain/cost_model.py) predicts the hybrid host update with the very split
the runtime makes first (``megatrain.host_tier.first_split``) at the same ``UpdateRates``, so the plan
reserves GPU staging only where the runtime will use the GPU path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

GB = 1e9
STATE_BYTES = 12  # fp32 master + m + v, each way


@dataclass
class UpdateRates:
    """Rates of the two update paths: ONE set for the plan (megatrain/cost_model.py's host update terms) and
    the runtime split (megatrain/host_tier.py). On a GPU the engine measures them (``measure_rates``) before it
    plans; defaults: the H200 node (``cpu_gps``: the engine's CPU update busy time, see cost_model)."""

    cpu_gps: float = 4.20  # CPU AdamW, Gparam/s, without the GPU path's copies (the next forward's loads may run)
    cpu_loaded_gps: float = 2.72  # CPU AdamW, Gparam/s, while pinned copies run both ways
    h2d_gbs: float = 46.0  # PCIe host -> GPU, GB/s, with D2H running at the same time
    d2h_gbs: float = 46.0  # PCIe GPU -> host, GB/s, with H2D running at the same time
    gpu_gps: float = 100.0  # fused CUDA AdamW, Gparam/s (HBM-bound; ~28 B/param at ~3 TB/s)
    measured: bool = False  # True when ``measure_rates`` filled them on this machine

    @classmethod
    def from_cost_model(cls, rates) -> "UpdateRates":
        """From the planner's ``megatrain.cost_model.Rates`` (duck-typed: its field names). Its link rates are
        one direction alone; the GPU path runs both directions at once: ``link_both_ways`` of each."""
        both_ways = rates.link_both_ways
        return cls(cpu_gps=rates.cpu_adamw_gparams, cpu_loaded_gps=rates.cpu_adamw_under_copy_gparams,
                   h2d_gbs=rates.h2d_gbps * both_ways, d2h_gbs=rates.d2h_gbps * both_ways,
                   gpu_gps=rates.gpu_adamw_gparams)

    def describe(self) -> str:
        """One line for the printed plan: "CPU 4.20 Gparam/s (2.72 under copies), link 46.0 / 46.0 GB/s (defaults)"."""
        return (f"CPU {self.cpu_gps:.2f} Gparam/s ({self.cpu_loaded_gps:.2f} under copies), link "
                f"{self.h2d_gbs:.1f} / {self.d2h_gbs:.1f} GB/s, {'measured here' if self.measured else 'defaults'}")

    def to_dict(self) -> dict:
        return dict(cpu_gps=self.cpu_gps, cpu_loaded_gps=self.cpu_loaded_gps, h2d_gbs=self.h2d_gbs,
                    d2h_gbs=self.d2h_gbs, gpu_gps=self.gpu_gps, measured=self.measured)


@dataclass
class Split:
    """One step's assignment of host-tier groups to the two update paths."""

    gpu: list[str] = field(default_factory=list)  # GPU-path groups, forward order
    cpu: list[str] = field(default_factory=list)  # CPU-path groups, forward order
    predicted_s: float = 0.0  # predicted time from the global norm until both paths are done
    predicted_cpu_only_s: float = 0.0  # the same with every group on the CPU path
    reason: str = ""


def _cpu_finish_s(params: float, head_s: float, gpu_s: float, rates: UpdateRates) -> float:
    """Seconds after the norm until the CPU path has updated ``params`` parameters, when it started ``head_s``
    before the norm (speculation, at its rate alone) and the GPU path's copies load host memory for the
    first ``gpu_s`` seconds after it (the loaded rate then, the rate alone after)."""
    left = max(0.0, params - rates.cpu_gps * GB * head_s)
    loaded = rates.cpu_loaded_gps * GB * gpu_s
    if left <= loaded:
        return left / (rates.cpu_loaded_gps * GB)
    return gpu_s + (left - loaded) / (rates.cpu_gps * GB)


def _cpu_only_s(numels: list[tuple[str, int]], rates: UpdateRates, head_start_s: float) -> float:
    return max(0.0, sum(n for _, n in numels) / (rates.cpu_gps * GB) - head_start_s)


def plan_split(numels: list[tuple[str, int]], rates: UpdateRates, *, speculative: bool = False,
               backward_s: float = 0.0, stream_bytes: int = 4, grad_bytes: int = 2, grad_up_bytes: int = 0,
               gpu_load_bytes: int = 0, max_numel: int | None = None, max_gpu_groups: int | None = None,
               prefetched: frozenset = frozenset(), eligible: frozenset | None = None) -> Split:
    """Split ``numels`` ((group, numel) in the next forward's order) between the CPU and GPU update paths.

    ``stream_bytes``: per-param bytes the forward loads for a CPU-path group (4 fp32 master, 2 bf16 shadow);
    ``grad_bytes``: per-param bytes of the gradient the CPU path pulls to the host (2 bf16, 4 fp32; 0 when
    it is already there); ``grad_up_bytes``: per-param bytes of gradient the GPU path must upload (0 when
    the gradient waits on the GPU; 4 with grad_placement="host"); ``gpu_load_bytes``: per-param bytes the
    forward still loads for a GPU-path group (0 when its updated master is kept on the GPU). ``max_numel``: groups larger than this do
    not fit the staging buffers and stay on the CPU path. ``max_gpu_groups``: a cap on the GPU path's size.
    ``prefetched``: groups whose state went up during the backward (``prefetch_set``): on the GPU path, only
    their download (12 B/param D2H) is left after the norm.
    ``speculative``: the CPU path started ``backward_s`` earlier (see module doc)."""
    cpu_loaded = rates.cpu_loaded_gps * GB
    h2d, d2h, gpu_rate = rates.h2d_gbs * GB, rates.d2h_gbs * GB, rates.gpu_gps * GB
    pre = [x for x, _ in numels if x in prefetched]
    pre_d2h = STATE_BYTES * sum(n for x, n in numels if x in prefetched) / d2h
    if pre:  # the rest is split as usual; the prefetched groups' downloads share the D2H link
        rest = plan_split([(x, n) for x, n in numels if x not in prefetched], rates, speculative=speculative,
                          backward_s=backward_s, stream_bytes=stream_bytes, grad_bytes=grad_bytes,
                          grad_up_bytes=grad_up_bytes, gpu_load_bytes=gpu_load_bytes, max_numel=max_numel,
                          max_gpu_groups=max_gpu_groups, eligible=eligible)
        gpu = [x for x, _ in numels if x in prefetched or x in set(rest.gpu)]
        return Split(gpu, rest.cpu, max(rest.predicted_s, pre_d2h), _cpu_only_s(numels, rates, backward_s if speculative else 0.0),
                     f"{len(pre)} prefetched during the backward; " + rest.reason)
    def allowed(x: str, n: int) -> bool:
        return (max_numel is None or n <= max_numel) and (eligible is None or x in eligible)

    can = [(x, n) for x, n in numels if allowed(x, n)]
    head = backward_s if speculative else 0.0
    only = _cpu_only_s(numels, rates, head)
    if not can or max_gpu_groups == 0:
        return Split([], [x for x, _ in numels], only, only, "no group fits the staging buffers")
    up_b, down_b = STATE_BYTES + grad_up_bytes + gpu_load_bytes, STATE_BYTES  # (the load shares the H2D link)

    def gpu_time(gpu_numels: list[int]) -> float:
        # Uploads and downloads pipeline (the download of one group under the upload of the next): the
        # slower direction bounds the path; the last group's download and the kernels add once.
        total = sum(gpu_numels)
        if not total:
            return 0.0
        return max(up_b * total / h2d, down_b * total / d2h) + down_b * gpu_numels[-1] / d2h + total / gpu_rate

    if speculative:
        # The GPU path takes a prefix of the forward order (the CPU would update those last); the longest
        # prefix whose GPU time stays within the CPU path's remaining time after the norm.
        best = Split([], [x for x, _ in numels], only, only, "speculative: CPU path only")
        taken: list[int] = []
        for k, (x, n) in enumerate(numels):
            if not allowed(x, n) or (max_gpu_groups is not None and k >= max_gpu_groups):
                break
            taken.append(n)
            gpu_s = gpu_time(taken)
            t = max(_cpu_finish_s(sum(m for _, m in numels[k + 1:]), head, gpu_s, rates), gpu_s)
            if t >= best.predicted_s:
                break
            best = Split([y for y, _ in numels[:k + 1]], [y for y, _ in numels[k + 1:]], t, only,
                         f"speculative: prefix of {k + 1} groups")
        return best

    # After the norm: list scheduling in forward order over the CPU and the two link directions.
    t_cpu = t_h2d = t_d2h = 0.0
    gpu, cpu, gpu_numels = [], [], []
    for x, n in numels:
        fits = allowed(x, n) and (max_gpu_groups is None or len(gpu) < max_gpu_groups)
        cpu_done = t_cpu + n / cpu_loaded
        # Ready for the forward once up and updated (its master stays on the GPU for the forward's cast).
        gpu_done = t_h2d + up_b * n / h2d + n / gpu_rate if fits else float("inf")
        if gpu_done < cpu_done:
            gpu.append(x)
            gpu_numels.append(n)
            t_h2d += up_b * n / h2d
            t_d2h = max(t_d2h, gpu_done) + down_b * n / d2h
        else:
            cpu.append(x)
            t_cpu = cpu_done
            t_h2d += stream_bytes * n / h2d  # the next forward's load of it shares the link
            t_d2h += grad_bytes * n / d2h  # its gradient went down to the host
    if not gpu:
        return Split([], cpu, only, only, "after the norm: the CPU path is faster for every group")
    t = max(t_cpu, t_h2d, t_d2h)
    if t >= only:  # never plan a split the model predicts slower than the CPU path alone
        return Split([], [x for x, _ in numels], only, only,
                     f"after the norm: CPU only (the split would take {t:.3f} s)")
    return Split(gpu, cpu, t, only, f"after the norm: list scheduling, {len(gpu)} of {len(numels)} groups on the GPU")


def prefetch_set(numels: list[tuple[str, int]], rates: UpdateRates, *, backward_s: float, load_bytes: int,
                 budget_bytes: float, share: float = 0.7) -> list[str]:
    """Groups whose master, m and v can go up during the backward (before the norm; only the update needs
    the clip coefficient): the last groups of the forward order first (their gradients arrive first), while
    their 12 B/param fit ``share`` of the H2D link the backward's own weight loads (``load_bytes`` in all)
    leave free, and ``budget_bytes`` of GPU memory (12 B/param held until the norm)."""
    spare = max(0.0, share * (backward_s * rates.h2d_gbs * GB - load_bytes))
    out, used = [], 0.0
    for x, n in reversed(numels):
        if STATE_BYTES * n > min(spare, budget_bytes) - used:
            break
        out.append(x)
        used += STATE_BYTES * n
    return out[::-1]


def forced_split(names: list[str], gpu_names: list[str]) -> Split:
    """A fixed assignment (tests, ablations): ``gpu_names`` on the GPU path, the rest on the CPU."""
    unknown = [x for x in gpu_names if x not in names]
    if unknown:
        raise ValueError(f"gpu_path_groups names groups that are not on the host tier: {unknown} "
                         f"(host tier: {', '.join(names) or 'nothing'})")
    chosen = set(gpu_names)
    return Split([x for x in names if x in chosen], [x for x in names if x not in chosen], reason="forced")


def measure_rates(device, kernel, numel: int = 1 << 26, copy_bytes: int = 256 << 20) -> UpdateRates:
    """Measure the rates on this machine (CUDA only; about a second): pinned copies each way with the other
    direction running, and ``kernel`` (a megatrain.cpu_adamw.HostKernel) on ``numel`` fp32 parameters with a
    bf16 gradient, alone and while those copies run."""
    import torch

    from .pinning import pin_in_place, unpin

    rates = UpdateRates(measured=True)
    p, m, v = (torch.zeros(numel) for _ in range(3))
    g = torch.full((numel,), 1e-3, dtype=torch.bfloat16)
    step_t = torch.ones(())

    def cpu_run() -> float:
        t0 = time.perf_counter()
        kernel.step(p, g, m, v, step_t, 1e-6, 1.0)
        return time.perf_counter() - t0

    cpu_run()  # warm-up (page faults, extension load)
    rates.cpu_gps = numel / min(cpu_run() for _ in range(5)) / GB  # the best of 5 (one ran ~25 ms at 2.7 GB/s)
    host_up, host_down = torch.empty(copy_bytes, dtype=torch.uint8), torch.empty(copy_bytes, dtype=torch.uint8)
    pin_in_place(host_up, "the update-rate measurement buffer")
    pin_in_place(host_down, "the update-rate measurement buffer")
    try:
        dev_up = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
        dev_down = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
        s_up, s_down = torch.cuda.Stream(device), torch.cuda.Stream(device)
        reps = 40  # 10 GiB each way, ~230 ms at 46 GB/s: longer than the five CPU runs below
        events = []
        for s, dst, src in ((s_up, dev_up, host_up), (s_down, host_down, dev_down)):
            with torch.cuda.stream(s):
                start = torch.cuda.Event(enable_timing=True)
                start.record(s)
                for _ in range(reps):
                    dst.copy_(src, non_blocking=True)
                end = torch.cuda.Event(enable_timing=True)
                end.record(s)
            events.append((start, end))
        cpu_loaded = [cpu_run() for _ in range(5)]  # while both copy streams run
        torch.cuda.synchronize(device)
        up_s, down_s = (a.elapsed_time(b) / 1e3 for a, b in events)
        rates.h2d_gbs = reps * copy_bytes / up_s / GB
        rates.d2h_gbs = reps * copy_bytes / down_s / GB
        rates.cpu_loaded_gps = numel / sorted(cpu_loaded)[2] / GB  # the median run
        del dev_up, dev_down
    finally:
        torch.cuda.synchronize(device)
        unpin(host_up)
        unpin(host_down)
    torch.cuda.empty_cache()
    return rates
