"""Which host-tier groups the GPU update path takes: a bandwidth model of the two update paths.

The host tier's AdamW has two paths that run at the same time (megatrain/host_tier.py):

* **CPU**: the CPU kernel updates the group in host RAM (megatrain/host_adamw.py). Memory-bound: ``cpu_gps``
  Gparam/s alone, ``cpu_loaded_gps`` while the GPU path's copies load host memory too (H200 node: 4.20 and
  2.72; together with 46 GB/s each way of copies, ~170 GB/s of host traffic against 117 for the CPU alone).
  Its gradient crosses PCIe to the host (D2H, ``grad_bytes``/param) and the next forward loads the updated
  master (H2D, ``stream_bytes``/param).
* **GPU**: fp32 master, m and v go up (12 B/param H2D), the fused CUDA AdamW updates them, and they come
  back (12 B/param D2H); the updated master feeds the next forward's cast on the GPU, so that group's load
  costs nothing more. Where that kept master is fp32 it is the group's master of record: not downloaded
  (written back only when host RAM needs it) and not uploaded at the group's next update, so a group that
  stays on the GPU path moves only m and v, 8 B/param each way (``kept_master``). PCIe-bound: ~3.8 Gparam/s
  at 46 GB/s each way with 12 B, ~5.8 with 8.

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

import dataclasses
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field

GB = 1e9
STATE_BYTES = 12  # fp32 master + m + v, each way
# How far the model's CPU-path time may be off: a split predicted up to this much slower than the CPU path
# alone is still built as candidates, and the step times decide (SplitChooser). On the H100 node, 7B pure
# streaming 8x1024: the CPU kernel measured 4.33 Gparam/s alone at build, 3.3 in the step (2.29 s busy
# against 1.76 predicted: 30 % slower), and the split was predicted 1.7 % slower than the CPU path alone.
MODEL_DOUBT = 0.15
# How much slower than the build's probe the CPU kernel may run in the step (the probe runs ~1 s on a quiet
# host; the step's kernel shares the host with the forward's loads, the data and the Python thread). Seen:
# H100 node, 7B pure streaming 8x1024: 4.33 Gparam/s at build, 3.3 in the step (1.31x, 978fc53); H100, 06d:
# the probe 5.97, the step's CPU path 3.6-4.0 (1.5-1.7x), and two probes minutes apart 5.97 vs 3.70 (1.61x).
# ``first_split`` builds the groups a split at CPU rates this much slower would move as GPU-path candidates
# (``Split.hedged``): the runtime calibrates the CPU rate on its first steps and may then propose them.
CPU_DOUBT = 0.6


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
    # The probe's CPU runs alone: (slowest - fastest) / median (0: not measured). Reported with the rates so a
    # row shows how steady the host was at build.
    cpu_spread: float = 0.0

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
                    d2h_gbs=self.d2h_gbs, gpu_gps=self.gpu_gps, measured=self.measured, cpu_spread=self.cpu_spread)

    def doubted(self, factor: float = CPU_DOUBT) -> "UpdateRates":
        """These rates with the CPU kernel ``1 + factor`` times slower, alone and under copies (the link as is)."""
        return dataclasses.replace(self, cpu_gps=self.cpu_gps / (1 + factor),
                                   cpu_loaded_gps=self.cpu_loaded_gps / (1 + factor))


@dataclass
class Split:
    """One step's assignment of host-tier groups to the two update paths."""

    gpu: list[str] = field(default_factory=list)  # GPU-path groups, forward order
    cpu: list[str] = field(default_factory=list)  # CPU-path groups, forward order
    predicted_s: float = 0.0  # predicted time from the global norm until both paths are done
    predicted_cpu_only_s: float = 0.0  # the same with every group on the CPU path
    reason: str = ""
    # The model's time from the norm until the GPU path's last download (its busy span, which the runtime
    # measures as gpu_path_busy_s; 0: no GPU-path group, or not modelled): what calibration compares.
    predicted_gpu_path_s: float = 0.0
    # A split the list schedule found but did not plan, because at these rates it was predicted no faster
    # than the CPU path alone: its GPU-path groups and its predicted time (``host_tier.first_split`` keeps
    # them as candidates when that time is within MODEL_DOUBT of the CPU path's: measurements decide).
    contested: list[str] = field(default_factory=list)
    contested_s: float = 0.0
    # The GPU-path groups of the after-norm split at CPU rates ``CPU_DOUBT`` slower (``UpdateRates.doubted``;
    # set by ``host_tier.first_split``): built as candidates, so that the runtime can move them once its
    # first steps show the CPU kernel slower than the probe said.
    hedged: list[str] = field(default_factory=list)

    @property
    def contested_to_try(self) -> list[str]:
        """The contested split's groups when its predicted time is within ``MODEL_DOUBT`` of the CPU path
        alone (worth building as candidates and measuring), else none."""
        if self.contested and self.contested_s <= self.predicted_cpu_only_s * (1 + MODEL_DOUBT):
            return list(self.contested)
        return []

    @property
    def beyond_plan(self) -> list[str]:
        """Groups built as GPU-path candidates though this split leaves them to the CPU path (a contested split
        within the doubt, and the hedge), in forward order."""
        extra = set(self.contested_to_try) | set(self.hedged)
        return [x for x in self.cpu if x in extra]

    @property
    def key(self) -> tuple[str, ...]:
        """The split's identity for measurements: its GPU-path groups (the rest is the CPU path)."""
        return tuple(self.gpu)


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
               gpu_load_bytes: int = 0, kept_master: bool = False, kept_bytes: float | None = None,
               kept_per_param: int = 4, max_numel: int | None = None,
               max_gpu_groups: int | None = None, prefetched: frozenset = frozenset(),
               eligible: frozenset | None = None, assign: frozenset | None = None) -> Split:
    """Split ``numels`` ((group, numel) in the next forward's order) between the CPU and GPU update paths.

    ``stream_bytes``: per-param bytes the forward loads for a CPU-path group (4 fp32 master, 2 bf16 shadow);
    ``grad_bytes``: per-param bytes of the gradient the CPU path pulls to the host (2 bf16, 4 fp32; 0 when
    it is already there); ``grad_up_bytes``: per-param bytes of gradient the GPU path must upload (0 when
    the gradient waits on the GPU; 4 with grad_placement="host"); ``gpu_load_bytes``: per-param bytes the
    forward still loads for a GPU-path group (0 when its updated master is kept on the GPU); ``kept_master``: that
    kept copy is the fp32 master, so a group the GPU path keeps updating moves only m and v, 8 B/param each way
    (the model predicts the steady state of a split: its first step after the CPU path uploads 12, and a
    routing change writes 4 back). ``kept_bytes``: GPU bytes for kept copies (``kept_per_param`` B/param),
    given to GPU-path groups in forward order as the engine gives them (``StreamedAdamW.kept_first``): a
    group that gets one moves ``kept_master`` bytes and loads nothing, one that does not moves 12 B/param
    each way and the forward loads it (``gpu_load_bytes``); None: every GPU-path group alike, as given.
    ``max_numel``: groups larger than this do
    not fit the staging buffers and stay on the CPU path. ``max_gpu_groups``: a cap on the GPU path's size.
    ``prefetched``: groups whose state went up during the backward (``prefetch_set``): on the GPU path, only
    their download (12 B/param D2H) is left after the norm.
    ``speculative``: the CPU path started ``backward_s`` earlier (see module doc).
    ``assign``: evaluate this fixed set of GPU-path groups (after the norm only) instead of choosing: the
    same list schedule, so a split that ran and a new proposal are predicted at the same rates."""
    if assign is not None and speculative:
        raise ValueError("plan_split(assign=...) evaluates a split after the norm only")
    cpu_loaded = rates.cpu_loaded_gps * GB
    h2d, d2h, gpu_rate = rates.h2d_gbs * GB, rates.d2h_gbs * GB, rates.gpu_gps * GB
    pre = [x for x, _ in numels if x in prefetched]
    pre_d2h = STATE_BYTES * sum(n for x, n in numels if x in prefetched) / d2h
    if pre:  # the rest is split as usual; the prefetched groups' downloads share the D2H link
        rest = plan_split([(x, n) for x, n in numels if x not in prefetched], rates, speculative=speculative,
                          backward_s=backward_s, stream_bytes=stream_bytes, grad_bytes=grad_bytes,
                          grad_up_bytes=grad_up_bytes, gpu_load_bytes=gpu_load_bytes, kept_master=kept_master,
                          kept_bytes=kept_bytes, kept_per_param=kept_per_param,
                          max_numel=max_numel, max_gpu_groups=max_gpu_groups, eligible=eligible,
                          assign=None if assign is None else assign - prefetched)
        gpu = [x for x, _ in numels if x in prefetched or x in set(rest.gpu)]
        return Split(gpu, rest.cpu, max(rest.predicted_s, pre_d2h), _cpu_only_s(numels, rates, backward_s if speculative else 0.0),
                     f"{len(pre)} prefetched during the backward; " + rest.reason,
                     predicted_gpu_path_s=max(rest.predicted_gpu_path_s, pre_d2h))
    def allowed(x: str, n: int) -> bool:
        return (max_numel is None or n <= max_numel) and (eligible is None or x in eligible)

    can = [(x, n) for x, n in numels if allowed(x, n)]
    head = backward_s if speculative else 0.0
    only = _cpu_only_s(numels, rates, head)
    if (not can or max_gpu_groups == 0) and not assign:
        return Split([], [x for x, _ in numels], only, only, "no group fits the staging buffers")
    def link_bytes(n: int, budget: float) -> tuple[int, int, float]:
        """(up, down) bytes per param of a GPU-path group of ``n`` params with ``budget`` kept bytes left, and
        the budget after it. Kept: no load (the forward casts the kept copy), and a kept fp32 master goes
        neither up nor down again; not kept: p, m, v each way and the forward's load (it shares H2D)."""
        kept_state = STATE_BYTES - (4 if kept_master else 0)
        if kept_bytes is None:  # every GPU-path group alike
            return kept_state + grad_up_bytes + gpu_load_bytes, kept_state, budget
        if kept_per_param * n <= budget:
            return kept_state + grad_up_bytes, kept_state, budget - kept_per_param * n
        return STATE_BYTES + grad_up_bytes + gpu_load_bytes, STATE_BYTES, budget

    kept0 = math.inf if kept_bytes is None else kept_bytes

    def gpu_time(gpu_numels: list[int]) -> float:
        # Uploads and downloads pipeline (the download of one group under the upload of the next): the
        # slower direction bounds the path; the last group's download and the kernels add once.
        total = sum(gpu_numels)
        if not total:
            return 0.0
        up = down = 0.0
        budget, last_down = kept0, 0
        for n in gpu_numels:
            u, d, budget = link_bytes(n, budget)
            up, down, last_down = up + u * n, down + d * n, d * n
        return max(up / h2d, down / d2h) + last_down / d2h + total / gpu_rate

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
    t_cpu = t_h2d = t_d2h = gpu_end = 0.0
    gpu, cpu, gpu_numels = [], [], []
    budget = kept0
    for x, n in numels:
        fits = allowed(x, n) and (max_gpu_groups is None or len(gpu) < max_gpu_groups)
        cpu_done = t_cpu + n / cpu_loaded
        up_b, down_b, after = link_bytes(n, budget)
        # Ready for the forward once up and updated (its master stays on the GPU for the forward's cast). The
        # chunks rotate through two buffers that downloads free: a group's update also waits for the downloads
        # queued before it (binding where D2H carries more: a group without a kept master's 12 B/param beside
        # the CPU path's gradients).
        gpu_done = max(t_h2d + up_b * n / h2d, t_d2h) + n / gpu_rate if fits or assign else float("inf")
        if (x in assign) if assign is not None else gpu_done < cpu_done:
            gpu.append(x)
            gpu_numels.append(n)
            budget = after
            t_h2d += up_b * n / h2d
            t_d2h = gpu_end = max(t_d2h, gpu_done) + down_b * n / d2h
        else:
            cpu.append(x)
            t_cpu = cpu_done
            t_h2d += stream_bytes * n / h2d  # the next forward's load of it shares the link
            t_d2h += grad_bytes * n / d2h  # its gradient went down to the host
    if not gpu:
        return Split([], cpu, only, only, "after the norm: the CPU path is faster for every group")
    t = max(t_cpu, t_h2d, t_d2h)
    if assign is not None:
        return Split(gpu, cpu, t, only, f"after the norm: {len(gpu)} of {len(numels)} groups on the GPU (given)",
                     predicted_gpu_path_s=gpu_end)
    if t >= only:  # never plan a split the model predicts slower than the CPU path alone
        return Split([], [x for x, _ in numels], only, only,
                     f"after the norm: CPU only (the split would take {t:.3f} s)", contested=gpu, contested_s=t)
    return Split(gpu, cpu, t, only, f"after the norm: list scheduling, {len(gpu)} of {len(numels)} groups on the GPU",
                 predicted_gpu_path_s=gpu_end)


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


def measure_rates(device, kernel, numel: int = 1 << 27, copy_bytes: int = 256 << 20, runs: int = 7,
                  shadow: bool = False, pinned: bool = False) -> UpdateRates:
    """Measure the rates on this machine (CUDA only; one to two seconds): pinned copies each way with the other
    direction running, and ``kernel`` (a megatrain.cpu_adamw.HostKernel) on ``numel`` fp32 parameters with a
    bf16 gradient, alone and while those copies run; each CPU rate is the median of ``runs`` runs (a fastest
    run flattered the CPU: on the H100 node two processes minutes apart measured 5.97 and 3.70 Gparam/s as the
    best of five 15 ms runs, while the step's kernel ran at 3.6-4.0). 128M parameters (1.8 GB of p, m, v, g)
    make each run ~30-60 ms, long beside a thread pool's wake-up. Only loaded runs that ended while both copy
    streams still ran count as loaded (the copies are queued to outlast them, and checked). ``shadow``
    (stream_dtype="bf16"): the kernel also writes a bf16 shadow, as the CPU path's updates then do. ``pinned``
    (EngineConfig.pin_host_state="all"): p, m, v, the gradient and the shadow are page-locked, as the store's
    and the gradient slabs then are (the rate may depend on it: megatrain/config.py)."""
    import torch

    from .pinning import PinError, pin_in_place, unpin

    rates = UpdateRates(measured=True)
    p, m, v = (torch.zeros(numel) for _ in range(3))
    g = torch.full((numel,), 1e-3, dtype=torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16) if shadow else None
    step_t = torch.ones(())

    def cpu_run() -> float:
        t0 = time.perf_counter()
        kernel.step(p, g, m, v, step_t, 1e-6, 1.0, shadow=out)
        return time.perf_counter() - t0

    locked: list = []  # page-locked here, unlocked in the finally

    def lock(t):
        locked.append(pin_in_place(t, "the update-rate measurement buffer"))
        return t

    try:
        for t in (p, m, v, g, out) if pinned else ():
            if t is None:
                continue
            try:
                lock(t)
            except PinError as exc:  # as the store under the same setting: measured on pageable memory
                warnings.warn(f"update-rate probe: {exc}; the CPU kernel is timed on pageable memory",
                              RuntimeWarning)
                break
        cpu_run()  # warm-up (page faults, extension load)
        alone = sorted(cpu_run() for _ in range(runs))
        rates.cpu_gps = numel / statistics.median(alone) / GB
        rates.cpu_spread = (alone[-1] - alone[0]) / statistics.median(alone)
        host_up = lock(torch.empty(copy_bytes, dtype=torch.uint8))
        host_down = lock(torch.empty(copy_bytes, dtype=torch.uint8))
        dev_up = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
        dev_down = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
        s_up, s_down = torch.cuda.Stream(device), torch.cuda.Stream(device)
        # Copies to outlast the loaded runs: each ~3x a median run alone at most, at up to 64 GB/s a direction;
        # at most 400 (~2 s at 50 GB/s: a very slow host keeps the probe short, its late runs not counted).
        reps = min(400, max(40, math.ceil(3 * runs * statistics.median(alone) * 64 * GB / copy_bytes)))
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
        loaded = []
        for _ in range(runs):  # while both copy streams run
            t = cpu_run()
            if not any(end.query() for _, end in events):  # both still copying when this run ended
                loaded.append(t)
        torch.cuda.synchronize(device)
        up_s, down_s = (a.elapsed_time(b) / 1e3 for a, b in events)
        rates.h2d_gbs = reps * copy_bytes / up_s / GB
        rates.d2h_gbs = reps * copy_bytes / down_s / GB
        if loaded:
            rates.cpu_loaded_gps = numel / statistics.median(loaded) / GB
        else:  # the copies ended first (a far faster link than planned for): the default ratio to the rate alone
            rates.cpu_loaded_gps = rates.cpu_gps * UpdateRates.cpu_loaded_gps / UpdateRates.cpu_gps
        del dev_up, dev_down
    finally:
        torch.cuda.synchronize(device)
        for t in locked:
            unpin(t)
    torch.cuda.empty_cache()
    return rates
