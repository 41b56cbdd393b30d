"""Placement plan: which groups live on the GPU tier and which on the host tier, decided before anything
is allocated.

A group on the **GPU tier** keeps its fp32 master and AdamW m, v on the GPU (12 B/param) and is updated
there by a fused AdamW after the step's global norm is known; its weights never cross PCIe. A group on
the **host tier** keeps them in host RAM (12 B/param) and streams as in the paper. Both tiers' gradients
wait on the GPU until their optimizer consumes them (see megatrain/host_adamw.py), so the GPU always
holds: the streaming working set (slots, staging, resident embedding/head compute copies), the step's
activations (megatrain/activations.py), every group's gradient (compute-dtype bytes per layer parameter,
fp32 for embedding/head), the GPU tier's state and a margin.

Preference order for the GPU tier: embedding, layer 0, layer 1, ..., layer L-1, final norm + head. The
next step's forward needs the embedding and the first layers first, and with the speculative host update
their gradients arrive last (the backward runs L-1 .. 0, the embedding gradient is made at the very end),
so those are the host updates that would otherwise be exposed; the head's gradient arrives first and its
host update hides behind the whole backward. ``gpu_resident``: "auto" fills the GPU in that order;
N puts the embedding and layers 0..N-1 there (and the head when N = L); "0" is pure streaming.

MLP chunking (``mlp_chunk_tokens`` = 0, "auto", see megatrain/chunked_mlp.py) is decided here too: where
the threshold rule would chunk a micro-batch, the GPU is planned both ways and the unchunked plan is kept
when it fits and places everything as the chunked one does (same tiers, same gradient placement, same
block boundaries on the GPU). Chunking costs one more MLP forward per layer in the backward; it pays only
when it changes what fits. The resolved value is ``Placement.mlp_chunk_tokens``; the engine runs it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from . import activations
from .chunked_mlp import AUTO_MIN_TOKENS, resolve_chunk

GIB = 2**30
OVERHEAD_HOST_BYTES = int(1.5 * GIB)  # Python, torch, CUDA context on the host (measured order)
GPU_TIER_BYTES_PER_PARAM = 12  # fp32 master + m + v
HOST_TIER_BYTES_PER_PARAM = 12


@dataclass
class StepShape:
    """What the plan needs to know about a step and the model beyond the group sizes."""

    num_layers: int
    hidden: int
    ffn: int
    vocab: int
    micro_batches: int
    tokens_per_micro_batch: int
    block: int  # checkpoint interval K
    num_pool_slots: int
    compute_bytes: int  # 2 for bf16, 4 for fp32
    stream_fp32: bool  # fp32 master crosses PCIe and is cast on the GPU (needs a staging buffer)
    bf16_shadow: bool
    slab_bytes_total: int
    loss_chunk_tokens: int
    mlp_chunk_tokens: int = -1  # as EngineConfig.mlp_chunk_tokens
    boundaries_on_gpu: int | None = None  # None: all block boundaries on the GPU; g: g of them (rest on host)
    grads: str = "gpu"  # where host-tier gradients wait for the norm: "gpu" | "host" (see module doc)


@dataclass
class Placement:
    tiers: dict[str, str]  # group name -> "gpu" | "host", in group order
    numels: dict[str, int]
    gpu_parts: dict[str, int] = field(default_factory=dict)
    host_parts: dict[str, int] = field(default_factory=dict)
    gpu_budget: int | None = None  # bytes usable on the GPU (free - margin); None on CPU
    host_budget: int | None = None
    setting: str = ""
    grads: str = "gpu"  # where the host tier's gradients wait: "gpu" | "host" (the resolved grad_placement)
    grad_setting: str = "gpu"  # grad_placement as asked ("gpu" | "host" | "auto")
    boundaries_on_gpu: int | None = None  # as StepShape after boundary offload: None = all on the GPU
    mlp_chunk_tokens: int = -1  # the MLP chunk the plan sized the step for: -1 none, N tokens (never 0 = auto)
    mlp_chunk_reason: str = ""  # why that chunk (summary)

    @property
    def gpu_names(self) -> list[str]:
        return [n for n, t in self.tiers.items() if t == "gpu"]

    @property
    def host_names(self) -> list[str]:
        return [n for n, t in self.tiers.items() if t == "host"]

    @property
    def gpu_layers(self) -> int:
        return sum(1 for n in self.gpu_names if n.startswith("layer."))

    def params_on(self, tier: str) -> int:
        return sum(self.numels[n] for n, t in self.tiers.items() if t == tier)

    def state_bytes(self, tier: str) -> int:
        """fp32 master + m + v bytes the store allocates for ``tier`` (excluding any bf16 shadow)."""
        return 12 * self.params_on(tier)

    def summary(self) -> str:
        def names(tier):
            items = [n for n, t in self.tiers.items() if t == tier]
            layers = [int(n.split(".")[1]) for n in items if n.startswith("layer.")]
            parts = [n for n in items if not n.startswith("layer.")]
            if layers:
                parts.insert(min(1, len(parts)), f"layers {_ranges(layers)} ({len(layers)})")
            return " + ".join(parts) or "nothing"

        def gib(parts):
            return ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items() if v)

        grads = self.grads if self.grad_setting == self.grads else f"{self.grad_setting} -> {self.grads}"
        lines = [f"placement (gpu_resident={self.setting}, grad_placement={grads}): GPU tier: {names('gpu')} = "
                 f"{_count(self.params_on('gpu'))} params; host tier: {names('host')} = "
                 f"{_count(self.params_on('host'))} params"]
        chunk = "none" if self.mlp_chunk_tokens < 0 else f"{self.mlp_chunk_tokens} tokens"
        lines.append(f"  MLP chunk: {chunk} ({self.mlp_chunk_reason})")
        if self.gpu_parts:
            budget = f" of {self.gpu_budget / GIB:.1f} usable" if self.gpu_budget is not None else ""
            lines.append(f"  GPU predicted {sum(self.gpu_parts.values()) / GIB:.2f} GiB{budget} (GiB: {gib(self.gpu_parts)})")
        if self.host_parts:
            budget = f" of {self.host_budget / GIB:.1f} usable" if self.host_budget is not None else ""
            lines.append(f"  host predicted {sum(self.host_parts.values()) / GIB:.2f} GiB{budget} (GiB: {gib(self.host_parts)})")
        return "\n".join(lines)


def grad_bytes(numels: dict[str, int], tiers: dict[str, str], shape: StepShape) -> int:
    """GPU bytes of gradients waiting for the global norm (exact clipping), see module doc."""
    c = shape.compute_bytes

    def waiting(names):  # compute dtype per layer parameter, fp32 for embedding/head
        return sum((c if x.startswith("layer.") else 4) * numels[x] for x in names)

    if shape.grads == "gpu":
        return waiting(numels)
    # "host": the GPU tier's gradients wait; a host-tier one only until its D2H copy has read it. In flight
    # at most (megatrain/grad_placement.py back-pressure): the new layer gradient, the previous one whose
    # copy may still run, one fp32 widening (2c + 4 per layer parameter; 4 with fp32 compute); and an
    # embedding/head gradient (fp32) with its flat copy, or a tied head's gradient kept through the
    # backward for the embedding to add into (8 per parameter of the largest such group).
    host_layers = [numels[x] for x, t in tiers.items() if t == "host" and x.startswith("layer.")]
    host_other = [numels[x] for x, t in tiers.items() if t == "host" and not x.startswith("layer.")]
    per_layer = 2 * c + 4 if c != 4 else 4
    in_flight = per_layer * max(host_layers, default=0) + 8 * max(host_other, default=0)
    return waiting([x for x, t in tiers.items() if t == "gpu"]) + in_flight


def gpu_fixed_parts(numels: dict[str, int], shape: StepShape, any_gpu_tier: bool, any_host_layer: bool) -> dict[str, int]:
    """GPU bytes that do not depend on how many groups are resident (beyond whether any are); gradients
    are ``grad_bytes``."""
    layer_numels = [n for name, n in numels.items() if name.startswith("layer.")]
    other = sum(n for name, n in numels.items() if not name.startswith("layer."))
    max_layer = max(layer_numels)
    c = shape.compute_bytes
    parts = {
        "slots": shape.num_pool_slots * max_layer * c,
        "staging": max_layer * 4 if (any_host_layer and shape.stream_fp32 and c != 4) else 0,
        "resident_compute": other * c,
        "grad_accumulators": shape.block * max_layer * 4 if shape.micro_batches > 1 else 0,
        "update_scratch": max(numels.values()) * 4 if (any_gpu_tier and c != 4) else 0,
    }
    parts.update(activations.gpu_working_set(
        num_layers=shape.num_layers, hidden=shape.hidden, ffn=shape.ffn, vocab=shape.vocab,
        micro_batches=shape.micro_batches, tokens_per_micro_batch=shape.tokens_per_micro_batch, block=shape.block,
        compute_bytes=c, loss_chunk_tokens=shape.loss_chunk_tokens, mlp_chunk_tokens=shape.mlp_chunk_tokens,
        boundaries_on_gpu=shape.boundaries_on_gpu))
    return parts


def offload_boundaries_if_needed(numels: dict[str, int], tiers: dict[str, str], shape: StepShape,
                                 gpu_budget: int) -> StepShape:
    """boundary_offload="auto" (``boundaries_on_gpu`` None) when the GPU side does not fit with every block
    boundary on the GPU: keep as many as fit there and plan the rest in host memory, as
    megatrain.boundaries decides at step time. Any other shape is returned as it is."""
    if shape.boundaries_on_gpu is not None or _gpu_total(numels, tiers, shape) <= gpu_budget:
        return shape
    per = shape.tokens_per_micro_batch * shape.hidden * shape.compute_bytes
    rest = _gpu_total(numels, tiers, replace(shape, boundaries_on_gpu=0))  # includes the 2 in flight
    return replace(shape, boundaries_on_gpu=int(max(0, (gpu_budget - rest) // per)))


def host_boundaries(shape: StepShape) -> int:
    """Host bytes of the block boundaries the shape does not keep on the GPU (pinned on CUDA)."""
    if shape.boundaries_on_gpu is None:
        return 0
    return activations.host_boundary_bytes(
        num_layers=shape.num_layers, hidden=shape.hidden, micro_batches=shape.micro_batches,
        tokens_per_micro_batch=shape.tokens_per_micro_batch, block=shape.block, compute_bytes=shape.compute_bytes,
        boundaries_on_gpu=shape.boundaries_on_gpu)


def host_parts_for(numels: dict[str, int], tiers: dict[str, str], shape: StepShape) -> dict[str, int]:
    p_host = sum(n for name, n in numels.items() if tiers[name] == "host")
    return {
        "offloaded_boundaries": host_boundaries(shape),
        "host_tier_state": HOST_TIER_BYTES_PER_PARAM * p_host,
        "bf16_shadow": 2 * p_host if shape.bf16_shadow else 0,
        # grad_placement="host": the host tier's gradients in pinned fp32 buffers, read straight by the
        # host AdamW, so no slabs; "gpu": they stream through the slabs.
        "host_grads": 4 * p_host if shape.grads == "host" else 0,
        "grad_slabs": shape.slab_bytes_total if (p_host and shape.grads == "gpu") else 0,
        # one group materialised in fp32 on the host while weights are initialised or read from disk (the
        # allocator keeps it mapped afterwards; measured on CPU)
        "io_staging": 4 * max(numels.values()),
        "overhead": OVERHEAD_HOST_BYTES,
    }


def preference_order(names: list[str]) -> list[str]:
    """embed, layer 0 .. L-1, final (see module doc for why)."""
    layers = [n for n in names if n.startswith("layer.")]
    return [n for n in names if n == "embed"] + layers + [n for n in names if n == "final"]


def tiers_for_layers(names: list[str], n: int) -> dict[str, str]:
    """``gpu_resident = n``: embedding + layers 0..n-1 on the GPU (and the head when every layer is)."""
    layers = [x for x in names if x.startswith("layer.")]
    if n > len(layers):
        raise ValueError(f"gpu_resident={n} but the model has only {len(layers)} decoder layers")
    gpu = set(layers[:n])
    if n > 0:
        gpu.add("embed")
    if n == len(layers):
        gpu.add("final")
    return {x: ("gpu" if x in gpu else "host") for x in names}


def plan(numels: dict[str, int], shape: StepShape, *, setting: str, on_gpu: bool, gpu_free: int, host_available: int,
         gpu_margin: int, host_margin: int, tiers: dict[str, str] | None = None, grads: str = "auto") -> Placement:
    """Decide the tiers (or check the given ``tiers``), where the host tier's gradients wait (``grads``:
    "gpu" | "host" | "auto") and, for ``shape.mlp_chunk_tokens`` = 0, whether to chunk the MLP (see module
    doc), and predict both memories. Raises MemoryError with the numbers when the configuration fits
    neither; nothing has been allocated at that point."""
    if grads not in ("gpu", "host", "auto"):
        raise ValueError(f"grads must be 'gpu', 'host' or 'auto', got {grads!r}")
    args = dict(setting=setting, on_gpu=on_gpu, gpu_free=gpu_free, host_available=host_available,
                gpu_margin=gpu_margin, host_margin=host_margin, tiers=tiers)
    placement, problems = _plan_grads(numels, shape, grads, args)
    reason = _chunk_rule(shape, placement.mlp_chunk_tokens)
    # Only "auto" is the plan's to decide (an explicit N or -1 is the user's), only on a GPU (on the CPU
    # both "memories" are host RAM and nothing is gained by planning twice), and only where the threshold
    # rule chunks (below it the plan is unchunked already).
    if shape.mlp_chunk_tokens == 0 and on_gpu and placement.mlp_chunk_tokens > 0:
        unchunked, its_problems = _plan_grads(numels, replace(shape, mlp_chunk_tokens=-1), grads, args)
        lost = _what_unchunked_loses(unchunked, its_problems, placement)
        if not lost:
            placement, problems, reason = unchunked, its_problems, "auto: fits unchunked"
        else:
            reason = f"auto: unchunked would {lost}"
    placement.grad_setting, placement.mlp_chunk_reason = grads, reason
    if problems:
        raise MemoryError("model does not fit: " + "; ".join(problems.values()) + "\n" + placement.summary())
    return placement


def _plan_grads(numels, shape, grads, args) -> tuple[Placement, dict[str, str]]:
    """One plan for ``grads`` ("auto": "gpu", or "host" when the gradients do not fit the GPU beside the
    rest) and ``shape``'s MLP chunk; the placement and what does not fit."""
    placement, problems = _plan_with(numels, replace(shape, grads="gpu" if grads == "auto" else grads), **args)
    if grads == "auto" and args["on_gpu"] and problems.get("gpu"):
        # The gradients do not fit the GPU beside the rest: give the host tier's a host home instead.
        placement, problems = _plan_with(numels, replace(shape, grads="host"), **args)
    return placement, problems


def _what_unchunked_loses(unchunked: Placement, problems: dict[str, str], chunked: Placement) -> str:
    """Empty when the unchunked plan fits and places everything as the chunked one does; otherwise what it
    would give up (for the summary). Chunking's extra MLP recompute is costly (H200, commit 34edccb: the 3B
    shape ran at 291.6 TFLOPS chunked at 158x1024 tokens, 347.6 unchunked at 128K), but a layer, a gradient
    or a boundary moved off the GPU costs too (PCIe traffic, exposed host updates), and weighing one against
    the other needs measurements this plan does not have: so unchunked must be no worse on every one."""
    if problems:
        return "not fit (" + "; ".join(problems.values()) + ")"
    if unchunked.tiers != chunked.tiers:
        fewer, more = _count(unchunked.params_on("gpu")), _count(chunked.params_on("gpu"))
        return f"put {fewer} params on the GPU tier, not {more}"
    if unchunked.grads != chunked.grads:
        return f"move the host tier's gradients to the {unchunked.grads}"
    if unchunked.boundaries_on_gpu != chunked.boundaries_on_gpu:
        return "offload more block boundaries to the host"
    return ""


def _chunk_rule(shape: StepShape, resolved: int) -> str:
    """Why ``resolved`` follows from the asked value alone (the summary's reason)."""
    asked, t = shape.mlp_chunk_tokens, shape.tokens_per_micro_batch
    if asked < 0:
        return "asked: never"
    if asked > 0:
        return "asked" if resolved > 0 else f"asked {asked}: one chunk holds all {t} tokens per micro-batch"
    side = ">" if resolved > 0 else "<="
    return f"auto: {side} {AUTO_MIN_TOKENS} tokens per micro-batch"


def resolved_chunk(shape: StepShape) -> int:
    """``shape.mlp_chunk_tokens`` resolved for its tokens per micro-batch as megatrain.arch.run_layer would
    resolve it: -1 no chunking, N chunks of N tokens."""
    return resolve_chunk(shape.mlp_chunk_tokens, shape.tokens_per_micro_batch) or -1


def _plan_with(numels, shape, *, setting, on_gpu, gpu_free, host_available, gpu_margin, host_margin,
               tiers) -> tuple[Placement, dict[str, str]]:
    """One plan for ``shape.grads``: the placement and what does not fit ({"gpu" | "host": message})."""
    names = list(numels)
    host_budget = host_available - host_margin
    gpu_budget = gpu_free - gpu_margin if on_gpu else None
    if tiers is None:
        if setting == "auto":
            tiers = {x: "host" for x in names}
            if on_gpu:  # greedy in preference order while the GPU budget holds
                for name in preference_order(names):
                    trial = dict(tiers, **{name: "gpu"})
                    if _gpu_total(numels, trial, shape) > gpu_budget:
                        break
                    tiers = trial
        else:
            tiers = tiers_for_layers(names, int(setting))
    if on_gpu:
        shape = offload_boundaries_if_needed(numels, tiers, shape, gpu_budget)
    placement = Placement(tiers=dict(tiers), numels=dict(numels), setting=setting,
                          gpu_budget=gpu_budget, host_budget=host_budget, grads=shape.grads, grad_setting=shape.grads,
                          boundaries_on_gpu=shape.boundaries_on_gpu, mlp_chunk_tokens=resolved_chunk(shape))
    placement.gpu_parts = _gpu_parts(numels, tiers, shape)
    placement.host_parts = host_parts_for(numels, tiers, shape)
    gpu_total, host_total = sum(placement.gpu_parts.values()), sum(placement.host_parts.values())
    if not on_gpu:  # both "tiers" share host memory (CPU runs, tests)
        host_total += gpu_total
    problems = {}
    if on_gpu and gpu_total > gpu_budget:
        problems["gpu"] = (f"GPU needs {gpu_total / GIB:.2f} GiB but {gpu_free / GIB:.2f} GiB is free "
                           f"(minus a {gpu_margin / GIB:.1f} GiB margin = {gpu_budget / GIB:.2f} GiB)")
    if host_total > host_budget:
        problems["host"] = (f"host needs {host_total / GIB:.2f} GiB but {host_available / GIB:.2f} GiB is available "
                            f"(minus a {host_margin / GIB:.1f} GiB margin = {host_budget / GIB:.2f} GiB)")
    return placement, problems


def _gpu_parts(numels, tiers, shape) -> dict[str, int]:
    any_gpu = any(t == "gpu" for t in tiers.values())
    any_host_layer = any(t == "host" for n, t in tiers.items() if n.startswith("layer."))
    parts = {"gpu_tier_state": GPU_TIER_BYTES_PER_PARAM * sum(n for x, n in numels.items() if tiers[x] == "gpu"),
             "grads": grad_bytes(numels, tiers, shape)}
    parts.update(gpu_fixed_parts(numels, shape, any_gpu, any_host_layer))
    return parts


def _gpu_total(numels, tiers, shape) -> int:
    return sum(_gpu_parts(numels, tiers, shape).values())


def _count(n: int) -> str:
    """12_345_678 -> "12.35M", 7_615_616_512 -> "7.616B" (tiny models stay readable)."""
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    runs, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(runs)
