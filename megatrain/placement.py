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

Activations (``recompute``, EngineConfig): per checkpoint block, keep its activations from the forward to
the backward (no recompute) or recompute the block from its boundary. "all" recomputes every block (the
paper); "none" keeps every block (refused when that does not fit); "auto" lets the step-time model
(megatrain/cost_model.py) choose where GPU memory is contested: for each GPU-tier prefix in preference order
(from the most that fits down to none) the plan keeps as many blocks as fit in what is left (the blocks
whose recompute costs most first), predicts the step, and keeps the fastest; a plan with fewer GPU-tier
groups must be predicted more than ``CONTESTED_GAIN`` faster to win (the model is least sure where it trades
host-side work for GPU work). Blocks are kept only with every block boundary on the GPU and the MLP
unchunked (a chunked layer recomputes in its backward by construction). On a CPU run there is no GPU memory
to plan: "auto" recomputes as "all" does. ``block_and_slots`` is the one formula for K and the slot pool.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from . import activations, cost_model, update_split
from .chunked_mlp import AUTO_MIN_TOKENS, resolve_chunk

GIB = 2**30
CONTESTED_GAIN = 0.05  # a plan with fewer GPU-tier groups must be predicted this much faster to be chosen
# An explicit "hybrid" whose first split is the CPU path alone but whose contested or hedged split takes groups
# keeps its GPU path (candidates the runtime's measured step times try) where the staging costs no GPU-tier
# layer and at most this fraction of the CPU plan's predicted step (kept activation blocks given up for it: on
# pure streaming one block of ~26, ~0.5 %). Measured (H100, 5bbd259, 3B 16x1024 pure streaming, clipping
# fires): planned as cpu for one kept block, the hybrid ran 0.95x the CPU path; built, 1.09x (two calls).
HEDGE_COST = 0.01
# update_staging_gib=None ("auto"): the GPU update path's reserve is DEFAULT_STAGING_GIB unless a larger one of
# STAGING_CANDIDATES_GIB is predicted RESERVE_GAIN faster than the hybrid plan at the default. A larger reserve
# keeps more fp32 masters on the GPU (masters of record: 8 B/param each way instead of 12 + the forward's load)
# and pays with kept activation blocks (pure streaming) or GPU-tier layers: a certain cost, against a gain from
# the model's hybrid term, which has run optimistic. Measured on three H100 nodes (pure streaming, clipping
# fires, 2026-12-07f; results/update_path_masters_h100_2026-12-07f.md), predicted gain of the best larger
# reserve over 1 GiB -> measured gain of a 16 GiB reserve over the 1 GiB hybrid:
#   node A 7B (CPU kernel 4.1 Gparam/s, 2.5 under copies): 21 % (20 GiB; 16 % at 16) -> 17 % (2.483 -> 2.056 s)
#   node C 3B (4.2 / 2.5): 13 % (8 GiB) -> 9 % (1.30 -> 1.18 s)
#   node B 7B (6.4 / 5.2): 10 % (12 GiB) -> none: its split ran no faster than its CPU path alone, and the 10
#   kept blocks given up cost ~3 % (2.04 s against the CPU path's 1.98)
# so the margin sits between node B's 10 % and node C's 13 % (three points: revisit with more).
DEFAULT_STAGING_GIB = 1.0
STAGING_CANDIDATES_GIB = (2.0, 4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 32.0)
RESERVE_GAIN = 0.11
# micro_batch_schedule="auto" considers "sequential" only from this many tokens per micro-batch: below it a
# layer's GEMMs run less efficiently, which the step-time model does not know (the best all-on-GPU 3B runs
# on the H200 used micro-batches of 8 x 1024 tokens).
SEQUENTIAL_MIN_TOKENS = 4096
OVERHEAD_HOST_BYTES = int(1.5 * GIB)  # Python, torch, CUDA context on the host (measured order)
GPU_TIER_BYTES_PER_PARAM = 12  # fp32 master + m + v
HOST_TIER_BYTES_PER_PARAM = 12


class DoesNotFit(MemoryError):
    """The plan refuses a configuration before anything is allocated: one line saying which memory, by how
    much, and what to change. ``placement``: the plan it tried (``placement.summary()`` has its parts)."""

    def __init__(self, message: str, placement: "Placement | None" = None):
        super().__init__(message)
        self.placement = placement


def block_and_slots(checkpoint_interval: int, num_slots: int, num_layers: int) -> tuple[int, int]:
    """(K, pool slots): K = checkpoint_interval layers per block (0 = every layer in one block), and the pool
    holds one block resident through recompute + backward plus ``num_slots - 1`` prefetch slots."""
    block = min(checkpoint_interval or num_layers, num_layers)
    return block, block + num_slots - 1


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
    recompute: str = "all"  # as EngineConfig.recompute: "auto" | "all" | "none"
    kept_blocks: tuple[int, ...] = ()  # blocks (index b: layers b*K ..) whose activations are kept
    seq_len: int = 0  # tokens per sequence (attention FLOPs in the step-time model); 0: tokens_per_micro_batch
    stream_bytes: int = 4  # bytes per parameter a host-tier layer load moves (4 fp32 master, 2 bf16 shadow)
    schedule: str = "layers"  # as EngineConfig.micro_batch_schedule ("layers" with one micro-batch)
    update_path: str = "cpu"  # the host tier's update: "cpu" | "hybrid" (resolved; the step-time model's term)
    update_staging: int = 0  # bytes the plan keeps free for the GPU update path (update_path="hybrid")
    # EngineConfig.mixed_precision == "autocast" (with a bf16/fp16 compute dtype): autograd graphs save
    # autocast's 2-byte casts of the Linear weights, which are not views of the slots (docs/autocast_mode.md)
    autocast_casts: bool = False

    @property
    def sequential(self) -> bool:
        return self.schedule == "sequential" and self.micro_batches > 1

    @property
    def held_micro_batches(self) -> int:
        """Micro-batches whose activations the GPU holds at once (one at a time when sequential)."""
        return 1 if self.sequential else self.micro_batches

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.num_layers / self.block)

    def block_layers(self, b: int) -> range:
        return range(b * self.block, min((b + 1) * self.block, self.num_layers))

    @property
    def kept_layers(self) -> int:
        return sum(len(self.block_layers(b)) for b in self.kept_blocks)


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
    grads_reason: str = ""  # why the plan chose ``grads`` ("auto": fit, or the predicted step of each)
    update_path: str = "cpu"  # the host tier's update: "cpu" | "hybrid" (the resolved EngineConfig.update_path)
    update_path_setting: str = "cpu"  # as asked ("cpu" | "hybrid" | "auto")
    update_path_reason: str = ""  # why ("auto": the predicted step of each)
    staging_reserve: int = 0  # bytes kept free for the GPU update path (0 unless update_path is "hybrid" on a GPU)
    staging_reason: str = ""  # why that reserve (update_staging_gib None: the predicted step at each)
    boundaries_on_gpu: int | None = None  # as StepShape after boundary offload: None = all on the GPU
    mlp_chunk_tokens: int = -1  # the MLP chunk the plan sized the step for: -1 none, N tokens (never 0 = auto)
    mlp_chunk_reason: str = ""  # why that chunk (summary)
    block: int = 1  # checkpoint interval K (block_and_slots)
    num_pool_slots: int = 2
    num_blocks: int = 1
    kept_blocks: tuple[int, ...] = ()  # blocks whose activations are kept (no recompute); the engine runs these
    recompute: str = "all"  # EngineConfig.recompute as asked
    recompute_reason: str = ""  # why these blocks (summary)
    prediction: "cost_model.Prediction | None" = None  # the step-time model's step for this plan (GPU runs)
    on_gpu: bool = True  # False: a CPU run, both "tiers" in host RAM
    sequential: bool = False  # forward + backward one micro-batch at a time (micro_batch_schedule)
    schedule_reason: str = ""

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

    @property
    def kept_text(self) -> str:
        """"kept 3/18": blocks whose activations are kept / blocks (the rows' ``recompute`` column)."""
        return f"kept {len(self.kept_blocks)}/{self.num_blocks}"

    def info(self) -> dict:
        """The plan's decisions and prediction as flat keys (``MegaTrain.info``; the runner's rows)."""
        out = {"recompute_setting": self.recompute, "blocks": self.num_blocks, "blocks_kept": len(self.kept_blocks),
               "micro_batch_schedule": "sequential" if self.sequential else "layers",
               "recompute_blocks": self.kept_text, "gpu_resident_layers": self.gpu_layers,
               "predicted_step_s": self.prediction.step_s if self.prediction else None,
               "update_path": self.update_path, "update_path_setting": self.update_path_setting,
               "update_staging_gib": self.staging_reserve / GIB}
        if self.prediction:
            out.update({f"predicted_{k}": v for k, v in self.prediction.parts.items()})
        return out

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
        if self.on_gpu:
            lines = [f"placement (gpu_resident={self.setting}, grad_placement={grads}): GPU tier: {names('gpu')} = "
                     f"{_count(self.params_on('gpu'))} params; host tier: {names('host')} = "
                     f"{_count(self.params_on('host'))} params"]
        else:  # a CPU run: one memory, no GPU tier to speak of
            lines = [f"placement (CPU run: every group and every activation in host RAM; grad_placement={grads}): "
                     f"{_count(sum(self.numels.values()))} params"]
        chunk = "none" if self.mlp_chunk_tokens < 0 else f"{self.mlp_chunk_tokens} tokens"
        lines.append(f"  MLP chunk: {chunk} ({self.mlp_chunk_reason})")
        lines.append(f"  activations: {self.kept_text} blocks (K = {self.block}), the rest recomputed "
                     f"(recompute={self.recompute}: {self.recompute_reason})")
        if self.grads_reason:
            lines.append(f"  gradients: {self.grads} ({self.grads_reason})")
        if self.update_path_reason:
            lines.append(f"  host update: {self.update_path} ({self.update_path_reason})")
        if self.staging_reason and self.update_path == "hybrid":
            lines.append(f"  GPU path staging: {self.staging_reserve / GIB:.0f} GiB kept free ({self.staging_reason})")
        if self.schedule_reason:
            lines.append(f"  micro-batches: {'sequential' if self.sequential else 'layers'} ({self.schedule_reason})")
        if self.prediction is not None:
            lines.append(f"  {self.prediction.describe()}")
        if not self.on_gpu:
            parts = {**self.host_parts, **{k: v for k, v in self.gpu_parts.items() if k != "gpu_tier_state"}}
            parts["host_tier_state"] = parts.get("host_tier_state", 0) + self.gpu_parts.get("gpu_tier_state", 0)
            budget = f" of {self.host_budget / GIB:.1f} usable" if self.host_budget is not None else ""
            lines.append(f"  host RAM predicted {sum(parts.values()) / GIB:.2f} GiB{budget} (GiB: {gib(parts)})")
            return "\n".join(lines)
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
        # fp32 sums across micro-batches: one block's at a time, or every layer's through a sequential step
        "grad_accumulators": (shape.num_layers if shape.sequential else shape.block) * max_layer * 4
        if shape.micro_batches > 1 else 0,
        "update_scratch": max(numels.values()) * 4 if (any_gpu_tier and c != 4) else 0,
        # autocast mode: the bf16 weight casts the graphs hold, a recomputed block's K layers (one micro-batch
        # at a time) and every kept layer per held micro-batch, to their backward (the forward's transient
        # cast of one layer fits inside the block's)
        "autocast_casts": (shape.block + shape.kept_layers * shape.held_micro_batches) * max_layer * 2
        if shape.autocast_casts else 0,
    }
    parts.update(activations.gpu_working_set(
        num_layers=shape.num_layers, hidden=shape.hidden, ffn=shape.ffn, vocab=shape.vocab,
        micro_batches=shape.held_micro_batches, tokens_per_micro_batch=shape.tokens_per_micro_batch,
        block=shape.block, compute_bytes=c, loss_chunk_tokens=shape.loss_chunk_tokens, mlp_chunk_tokens=shape.mlp_chunk_tokens,
        boundaries_on_gpu=shape.boundaries_on_gpu, kept_layers=shape.kept_layers,
        recomputed_blocks=shape.num_blocks - len(shape.kept_blocks)))
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
        num_layers=shape.num_layers, hidden=shape.hidden, micro_batches=shape.held_micro_batches,
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
         gpu_margin: int, host_margin: int, tiers: dict[str, str] | None = None, grads: str = "auto",
         kept: set[int] | None = None, rates: "cost_model.Rates | None" = None, update_path: str = "cpu",
         staging_reserve: int | None = 0, gpu_path_forced: bool = False) -> Placement:
    """Decide the tiers (or check the given ``tiers``), where the host tier's gradients wait (``grads``:
    "gpu" | "host" | "auto"), for ``shape.mlp_chunk_tokens`` = 0 whether to chunk the MLP, which blocks
    keep their activations (``shape.recompute``, or the given ``kept`` block indices), and the host tier's
    update path (``update_path``: "cpu" | "hybrid" | "auto"; "hybrid" keeps ``staging_reserve`` bytes of the
    GPU free for it, None: the reserve of the candidates the model predicts fastest, see RESERVE_GAIN), and
    predict both memories and (on a GPU) the step time at ``rates`` (see module doc).
    The hybrid prediction's split is the engine's own (``host_tier.first_split`` at ``rates.update_rates()``,
    which the engine measures before planning): where it gives the GPU path no group in a step that waits for
    the norm (the regime the model predicts), "hybrid" is planned as "cpu" (no staging kept free) and "auto"
    resolves to "cpu", unless ``gpu_path_forced`` (the engine's
    ``gpu_path_groups`` names the groups, so the split is not the model's; ``gpu_path_prefetch``, whose
    groups the model does not predict; or data parallel, which refuses "hybrid" when it builds the host tier).
    Raises ``DoesNotFit`` (a MemoryError) with one line of numbers when the configuration fits neither;
    nothing has been allocated at that point."""
    if grads not in ("gpu", "host", "auto"):
        raise ValueError(f"grads must be 'gpu', 'host' or 'auto', got {grads!r}")
    if update_path not in ("cpu", "hybrid", "auto"):
        raise ValueError(f"update_path must be 'cpu', 'hybrid' or 'auto', got {update_path!r}")
    args = dict(setting=setting, on_gpu=on_gpu, gpu_free=gpu_free, host_available=host_available,
                gpu_margin=gpu_margin, host_margin=host_margin, tiers=tiers, kept=kept, rates=rates)
    if update_path != "auto" or not on_gpu:  # on a CPU run nothing is predicted: "auto" is "cpu"
        path = "hybrid" if update_path == "hybrid" else "cpu"
        out = (_plan_hybrid(numels, shape, grads, args, staging_reserve) if path == "hybrid" else
               _plan_path(numels, shape, grads, args, path, 0))
        out.update_path_setting = update_path
        if update_path == "auto":
            out.update_path_reason = "auto: CPU run (nothing predicted)"
        if path == "hybrid" and on_gpu and not gpu_path_forced and out.host_names and not _gpu_path_groups(out):
            # The engine's split at these rates gives the GPU path nothing in the steps the plan models (clipping
            # firing): keep no staging for it (a speculative step's prefix alone does not pay for a GPU-tier layer)
            # -- unless the runtime builds candidates all the same (a contested split within MODEL_DOUBT, or the
            # hedge at CPU rates CPU_DOUBT slower: ``Split.beyond_plan``) and the staging costs no GPU-tier layer
            # and at most HEDGE_COST of the CPU plan's predicted step (a kept block or so, e.g. pure streaming):
            # then the runtime starts on the CPU path alone and its measured step times decide.
            cpu = _plan_path(numels, shape, grads, args, "cpu", 0)
            contested = int(out.prediction.parts.get("gpu_path_contested", 0)) if out.prediction else 0
            if contested and cpu.tiers == out.tiers and _staging_cost(out, cpu) <= HEDGE_COST:
                out.update_path_setting = "hybrid"
                out.update_path_reason = (f"hybrid: the split at the update rates ({_rates_text(rates)}) gives the "
                                          f"GPU path no group first ({out.prediction.split_reason}), but a split "
                                          f"within {update_split.MODEL_DOUBT:.0%} of the CPU path alone, or one at CPU "
                                          f"rates {1 + update_split.CPU_DOUBT:.1f}x slower than measured, takes some and "
                                          f"its staging costs no GPU-tier layer"
                                          f"{_cost_text(out, cpu)}: {contested} contested groups built "
                                          f"as candidates, the runtime's measured step times decide")
                return out
            cpu.update_path_setting = "hybrid"
            cost = ""
            if contested:  # a split to try exists: say what its staging would have cost
                cost = ("; the contested split's staging would cost a GPU-tier layer" if cpu.tiers != out.tiers else
                        f"; keeping staging for the contested split would cost {_staging_cost(out, cpu):+.1%} of the "
                        f"predicted step (more than {HEDGE_COST:.0%})")
            cpu.update_path_reason = (f"hybrid asked, but the split at the update rates ({_rates_text(rates)}) gives "
                                      f"the GPU path none of the {len(out.host_names)} host-tier groups "
                                      f"({out.prediction.split_reason}{cost}): planned as cpu, no GPU staging kept")
            return cpu
        return out
    # "auto": the plan for each path (the hybrid one keeps its staging free), the faster by the model; the
    # GPU path must be predicted CONTESTED_GAIN faster (its split and rates are the least measured part).
    cpu = _plan_path(numels, shape, grads, args, "cpu", 0)
    cpu.update_path_setting = "auto"
    if not cpu.host_names:
        cpu.update_path_reason = "auto: no host-tier group"
        return cpu
    try:
        hybrid = _plan_hybrid(numels, shape, grads, args, staging_reserve)
    except DoesNotFit as exc:
        cpu.update_path_reason = f"auto: hybrid does not fit ({exc})"
        return cpu
    a, b = cpu.prediction.step_s, hybrid.prediction.step_s
    gpu_groups = _gpu_path_groups(hybrid)
    won = b < a * (1 - CONTESTED_GAIN) and (gpu_groups > 0 or gpu_path_forced)
    chosen = hybrid if won else cpu
    chosen.update_path_setting = "auto"
    chosen.update_path_reason = (f"auto: predicted {a:.3f} s with the CPU kernel alone vs {b:.3f} s with the GPU "
                                 f"update path beside it ({gpu_groups} of {len(hybrid.host_names)} host-tier groups"
                                 f"{'' if gpu_groups else ': ' + hybrid.prediction.split_reason}; update rates "
                                 f"{_rates_text(rates)})")
    return chosen


def _staging_cost(hybrid: Placement, cpu: Placement) -> float:
    """What keeping the GPU path's staging free costs against the CPU plan: the hybrid placement's predicted
    step with the CPU path alone (its first split) over the CPU plan's, minus 1 (kept blocks or a gradient
    home given up for the staging)."""
    if not (hybrid.prediction and cpu.prediction and cpu.prediction.step_s > 0):
        return math.inf
    return hybrid.prediction.step_s / cpu.prediction.step_s - 1


def _cost_text(hybrid: Placement, cpu: Placement) -> str:
    fewer = len(cpu.kept_blocks) - len(hybrid.kept_blocks)
    return (f" and {_staging_cost(hybrid, cpu):+.1%} of the CPU plan's predicted step (within {HEDGE_COST:.0%}"
            f"{f'; {fewer} kept block(s) fewer' if fewer > 0 else ''})")


def _gpu_path_groups(placement: Placement) -> int:
    """Host-tier groups the hybrid plan's split gives the GPU path in a step that waits for the norm (its
    prediction's: the engine's first split at the same rates)."""
    return int(placement.prediction.parts.get("gpu_path_groups", 0)) if placement.prediction else 0


def _rates_text(rates) -> str:
    return (rates or cost_model.Rates()).update_rates().describe()


def staging_bytes(gib: float | None) -> int | None:
    """EngineConfig.update_staging_gib as ``plan``'s ``staging_reserve``: bytes, or None (the plan chooses)."""
    return None if gib is None else int(gib * GIB)


def _plan_hybrid(numels, shape: StepShape, grads: str, args: dict, staging_reserve: int | None) -> Placement:
    """The "hybrid" plan: with the given reserve; for None, at DEFAULT_STAGING_GIB unless a larger candidate
    (STAGING_CANDIDATES_GIB, those that fit) is predicted RESERVE_GAIN faster, then the fastest of them."""
    if staging_reserve is not None:
        return _plan_path(numels, shape, grads, args, "hybrid", staging_reserve)
    base = _plan_path(numels, shape, grads, args, "hybrid", staging_bytes(DEFAULT_STAGING_GIB))
    if base.prediction is None:  # a CPU run: nothing to predict, nothing kept free
        return base
    best = base
    for gib in STAGING_CANDIDATES_GIB:
        try:
            plan = _plan_path(numels, shape, grads, args, "hybrid", staging_bytes(gib))
        except DoesNotFit:
            break  # a larger reserve fits no better
        if plan.prediction is not None and plan.prediction.step_s < best.prediction.step_s:
            best = plan
    a, b = base.prediction.step_s, best.prediction.step_s
    at = f"predicted {b:.3f} s at {best.staging_reserve / GIB:.0f} GiB"
    if best is not base and b < a * (1 - RESERVE_GAIN):
        best.staging_reason = (f"auto: {at} ({_gpu_path_groups(best)} GPU-path groups, {len(best.kept_blocks)} kept "
                               f"blocks, {best.gpu_layers} GPU-tier layers) vs {a:.3f} s at {DEFAULT_STAGING_GIB:.0f} "
                               f"GiB, more than {RESERVE_GAIN:.0%} faster")
        return best
    base.staging_reason = (f"auto: {DEFAULT_STAGING_GIB:.0f} GiB, predicted {a:.3f} s" +
                           (f"; the best larger reserve, {at}, is not {RESERVE_GAIN:.0%} faster" if best is not base
                            else "; no larger reserve predicted faster"))
    return base


def _plan_path(numels, shape: StepShape, grads: str, args: dict, update_path: str, staging_reserve: int) -> Placement:
    """``plan`` for one host update path ("cpu" | "hybrid"; the hybrid one keeps ``staging_reserve`` free)."""
    reserve = staging_reserve if (update_path == "hybrid" and args["on_gpu"]) else 0
    shape = replace(shape, update_path=update_path, update_staging=reserve)
    args = dict(args, gpu_margin=args["gpu_margin"] + reserve)
    on_gpu, kept = args["on_gpu"], args["kept"]
    asked = shape.recompute
    if asked == "none" and shape.mlp_chunk_tokens == 0:
        shape = replace(shape, mlp_chunk_tokens=-1)  # a kept layer is never chunked (its backward would recompute)
    # The MLP chunk is decided with every block recomputed (as before kept blocks existed): keeping blocks
    # must not be what makes the unchunked plan lose (then it would chunk, and keep nothing).
    probe = replace(shape, recompute="all") if asked == "auto" and kept is None else shape
    placement, problems = _plan_grads(numels, probe, grads, args)
    reason = _chunk_rule(shape, placement.mlp_chunk_tokens)
    # Only "auto" is the plan's to decide (an explicit N or -1 is the user's), only on a GPU (on the CPU
    # both "memories" are host RAM and nothing is gained by planning twice), and only where the threshold
    # rule chunks (below it the plan is unchunked already).
    if shape.mlp_chunk_tokens == 0 and on_gpu and placement.mlp_chunk_tokens > 0:
        unchunked, its_problems = _plan_grads(numels, replace(probe, mlp_chunk_tokens=-1), grads, args)
        lost = _what_unchunked_loses(unchunked, its_problems, placement)
        if not lost:
            placement, problems, reason = unchunked, its_problems, "auto: fits unchunked"
        else:
            reason = f"auto: unchunked would {lost}"
    if probe is not shape and on_gpu and not problems and placement.mlp_chunk_tokens < 0:
        # recompute="auto": now the activation plan, with the MLP chunk decided above (unchunked)
        placement, problems = _plan_grads(numels, replace(shape, mlp_chunk_tokens=-1), grads, args)
    elif probe is not shape:  # "auto" that keeps nothing, and why
        placement.recompute_reason = ("CPU run: recompute every block (no GPU memory to plan)" if not on_gpu else
                                      "auto: nothing kept (the MLP is chunked)" if placement.mlp_chunk_tokens > 0
                                      else "auto: nothing kept (the plan does not fit)")
    if shape.schedule == "auto" and shape.micro_batches > 1 and on_gpu and not problems:
        placement = _schedule(numels, shape, placement, grads, args)
    placement.grad_setting, placement.mlp_chunk_reason, placement.recompute = grads, reason, asked
    placement.update_path = placement.update_path_setting = update_path
    placement.staging_reserve = reserve
    if problems:
        raise DoesNotFit(_refusal(problems, placement, asked), placement)
    return placement


def _schedule(numels, shape: StepShape, layers: Placement, grads, args) -> Placement:
    """micro_batch_schedule="auto": the "layers" plan, or the "sequential" one where it fits and the model
    predicts it CONTESTED_GAIN faster (it holds one micro-batch's activations, so it can keep more blocks,
    but loads every layer once more per micro-batch). Not below SEQUENTIAL_MIN_TOKENS tokens per
    micro-batch, nor with a chunked MLP (nothing is kept then)."""
    if shape.tokens_per_micro_batch < SEQUENTIAL_MIN_TOKENS:
        layers.schedule_reason = f"auto: micro-batches of {shape.tokens_per_micro_batch} tokens, < {SEQUENTIAL_MIN_TOKENS}"
        return layers
    if layers.mlp_chunk_tokens > 0:
        layers.schedule_reason = "auto: the MLP is chunked"
        return layers
    seq, problems = _plan_grads(numels, replace(shape, schedule="sequential", mlp_chunk_tokens=-1), grads, args)
    a, b = layers.prediction.step_s, (seq.prediction.step_s if seq.prediction else float("inf"))
    if not problems and b < a * (1 - CONTESTED_GAIN):
        seq.mlp_chunk_tokens, seq.mlp_chunk_reason = layers.mlp_chunk_tokens, layers.mlp_chunk_reason
        seq.schedule_reason = f"auto: predicted {b:.3f} s keeping {len(seq.kept_blocks)}/{seq.num_blocks} blocks, vs {a:.3f} s over all micro-batches at once"
        return seq
    why = "does not fit" if problems else f"predicted {b:.3f} s vs {a:.3f} s"
    layers.schedule_reason = f"auto: sequential {why}"
    return layers


def _refusal(problems: dict[str, str], placement: Placement, recompute: str) -> str:
    """One line: which memory does not hold what, and what a user can change."""
    hints = []
    if "gpu" in problems:
        if recompute == "none" and placement.kept_blocks:
            hints.append("recompute='auto' keeps only the activations that fit")
        if placement.setting != "auto" and placement.gpu_layers:
            hints.append("fewer GPU-resident layers (gpu_resident=auto)")
        hints.append("fewer tokens per micro-batch (micro_batches=)")
    if "host" in problems:
        hints.append("a smaller model or a machine with more RAM" + ("" if placement.on_gpu else " (or a GPU)"))
    return "model does not fit: " + "; ".join(problems.values()) + " - try " + " or ".join(hints)


def _plan_grads(numels, shape, grads, args) -> tuple[Placement, dict[str, str]]:
    """One plan for ``grads`` and ``shape``'s MLP chunk; the placement and what does not fit. "auto": "gpu",
    or "host" when the gradients do not fit the GPU beside the rest, or when both fit and the step-time
    model predicts "host" CONTESTED_GAIN faster (it frees GPU memory for GPU-tier groups or kept blocks, at
    4 B/param of D2H during the backward and of host RAM; the model is least sure where it trades host-side
    work for GPU work, and "gpu" measured 1.21x faster where both placed the same tiers: docs/engine.md)."""
    placement, problems = _plan_with(numels, replace(shape, grads="gpu" if grads == "auto" else grads), **args)
    if grads != "auto" or not args["on_gpu"]:
        return placement, problems
    if problems.get("gpu"):
        # The gradients do not fit the GPU beside the rest: give the host tier's a host home instead.
        host, host_problems = _plan_with(numels, replace(shape, grads="host"), **args)
        host.grads_reason = "auto: the gradients do not fit on the GPU beside the rest"
        return host, host_problems
    if not placement.host_names:  # nothing on the host tier: nothing to move
        placement.grads_reason = "auto: no host-tier group"
        return placement, problems
    host, host_problems = _plan_with(numels, replace(shape, grads="host"), **args)
    a = placement.prediction.step_s
    if host_problems or host.prediction is None:
        placement.grads_reason = f"auto: on the host would not fit ({'; '.join(host_problems.values())})"
        return placement, problems
    b = host.prediction.step_s
    if b < a * (1 - CONTESTED_GAIN):
        host.grads_reason = (f"auto: predicted {b:.3f} s with the host tier's gradients on the host "
                             f"({host.gpu_layers} GPU-tier layers) vs {a:.3f} s on the GPU ({placement.gpu_layers})")
        return host, host_problems
    placement.grads_reason = (f"auto: predicted {a:.3f} s with gradients on the GPU ({placement.gpu_layers} GPU-tier "
                              f"layers) vs {b:.3f} s on the host ({host.gpu_layers})")
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
               tiers, kept=None, rates=None) -> tuple[Placement, dict[str, str]]:
    """One plan for ``shape.grads``: the placement and what does not fit ({"gpu" | "host": message})."""
    names = list(numels)
    host_budget = host_available - host_margin
    gpu_budget = gpu_free - gpu_margin if on_gpu else None
    if kept is not None:
        shape, reason = replace(shape, kept_blocks=_check_kept(kept, shape)), "asked: the given blocks"
    elif shape.recompute == "none":
        shape, reason = replace(shape, kept_blocks=tuple(range(shape.num_blocks))), "asked: keep every block"
    else:
        reason = "asked: recompute every block"
        shape = replace(shape, kept_blocks=())
    if tiers is None and setting != "auto":
        tiers = tiers_for_layers(names, int(setting))
    if tiers is None and not on_gpu:
        tiers = {x: "host" for x in names}
    choose = on_gpu and kept is None and shape.recompute == "auto"
    options = [tiers] if tiers is not None else _gpu_prefixes(numels, shape, gpu_budget, every=choose)
    if choose:  # the step-time model picks the GPU-tier prefix and the kept blocks together
        tiers, shape, prediction, reason = _choose(numels, options, shape, gpu_budget, host_budget, rates)
    else:
        tiers = options[0]
        if on_gpu:
            shape = offload_boundaries_if_needed(numels, tiers, shape, gpu_budget)
        prediction = cost_model.predict(step_load(numels, tiers, shape), rates) if on_gpu else None
    placement = Placement(tiers=dict(tiers), numels=dict(numels), setting=setting,
                          gpu_budget=gpu_budget, host_budget=host_budget, grads=shape.grads, grad_setting=shape.grads,
                          boundaries_on_gpu=shape.boundaries_on_gpu, mlp_chunk_tokens=resolved_chunk(shape),
                          block=shape.block, num_pool_slots=shape.num_pool_slots, num_blocks=shape.num_blocks,
                          kept_blocks=shape.kept_blocks, recompute=shape.recompute, recompute_reason=reason,
                          prediction=prediction, on_gpu=on_gpu, sequential=shape.sequential)
    placement.gpu_parts = _gpu_parts(numels, tiers, shape)
    placement.host_parts = host_parts_for(numels, tiers, shape)
    if on_gpu and shape.update_path == "hybrid":  # its staging: the reserve and what the plan leaves unused
        placement.prediction = cost_model.predict(
            step_load(numels, tiers, shape, gpu_path_staging(placement, shape.update_staging)), rates)
    gpu_total, host_total = sum(placement.gpu_parts.values()), sum(placement.host_parts.values())
    problems = {}
    if on_gpu and gpu_total > gpu_budget:
        problems["gpu"] = (f"GPU needs {gpu_total / GIB:.2f} GiB but {gpu_free / GIB:.2f} GiB is free "
                           f"(minus a {gpu_margin / GIB:.1f} GiB margin = {gpu_budget / GIB:.2f} GiB)")
    if not on_gpu:  # both "tiers" and the activations share host memory (CPU runs, tests): one number
        if host_total + gpu_total > host_budget:
            problems["host"] = (f"host needs {(host_total + gpu_total) / GIB:.2f} GiB of RAM (CPU run: weights, "
                                f"optimizer state and activations) but {host_available / GIB:.2f} GiB is available "
                                f"(minus a {host_margin / GIB:.1f} GiB margin = {host_budget / GIB:.2f} GiB)")
    elif host_total > host_budget:
        problems["host"] = (f"host needs {host_total / GIB:.2f} GiB but {host_available / GIB:.2f} GiB is available "
                            f"(minus a {host_margin / GIB:.1f} GiB margin = {host_budget / GIB:.2f} GiB)")
    return placement, problems


def _check_kept(kept, shape: StepShape) -> tuple[int, ...]:
    out = tuple(sorted(set(int(b) for b in kept)))
    if any(not 0 <= b < shape.num_blocks for b in out):
        raise ValueError(f"kept blocks {list(out)}: the model has blocks 0..{shape.num_blocks - 1} "
                         f"({shape.num_layers} layers, {shape.block} per block)")
    if out and resolved_chunk(shape) > 0:
        raise ValueError("kept blocks need an unchunked MLP (mlp_chunk_tokens=-1): a chunked layer recomputes "
                         "its MLP in the backward by construction")
    return out


def _gpu_prefixes(numels, shape, gpu_budget, every: bool) -> list[dict[str, str]]:
    """GPU-tier choices in preference order: the longest prefix that fits the GPU budget (greedy), then, with
    ``every``, each shorter one down to none (the step-time model chooses among them)."""
    names = list(numels)
    tiers = {x: "host" for x in names}
    prefix = []
    for name in preference_order(names):
        trial = dict(tiers, **{name: "gpu"})
        if _gpu_total(numels, trial, shape) > gpu_budget:
            break
        tiers = trial
        prefix.append(name)
    if not every:
        return [tiers]
    return [{x: ("gpu" if x in prefix[:n] else "host") for x in names} for n in range(len(prefix), -1, -1)]


def _choose(numels, options, shape, gpu_budget, host_budget, rates):
    """recompute="auto": for each GPU-tier choice (most GPU tier first) whose host side fits, the boundaries
    and the blocks that fit, predicted; the fastest wins, and one with fewer GPU-tier groups only by more
    than CONTESTED_GAIN. Returns (tiers, shape, prediction, reason)."""
    best = baseline = None
    for n, tiers in enumerate(options):
        cand = offload_boundaries_if_needed(numels, tiers, shape, gpu_budget)
        if n and sum(host_parts_for(numels, tiers, cand).values()) > host_budget:
            break  # fewer GPU-tier groups only put more on the host from here on
        if cand.boundaries_on_gpu is None and resolved_chunk(cand) < 0:
            cand = _keep_what_fits(numels, tiers, cand, gpu_budget, rates)
        pred = cost_model.predict(step_load(numels, tiers, cand), rates)
        if baseline is None:
            baseline = (tiers, cost_model.predict(step_load(numels, tiers, replace(cand, kept_blocks=())), rates))
        if best is None or pred.step_s < best[2].step_s * (1 - CONTESTED_GAIN):
            best = (tiers, cand, pred)
    tiers, cand, pred = best
    gpu = sum(1 for t in tiers.values() if t == "gpu")
    most = sum(1 for t in baseline[0].values() if t == "gpu")
    if not cand.kept_blocks:
        why = "no block fits beside the rest" if cand.boundaries_on_gpu is None else "block boundaries offloaded"
        reason = f"auto: nothing kept ({why})"
    else:
        reason = f"auto: {len(cand.kept_blocks)} blocks fit beside the rest"
    reason += (f"; predicted {pred.step_s:.3f} s with {gpu} GPU-tier groups vs {baseline[1].step_s:.3f} s "
               f"recomputing every block with {most}")
    return tiers, cand, pred, reason


def _keep_what_fits(numels, tiers, shape: StepShape, gpu_budget: int, rates) -> StepShape:
    """``shape`` keeping the most blocks that fit ``gpu_budget``, those whose recompute the model says costs
    most first (a block whose backward waits for its weights' load anyway saves nothing and is not kept)."""
    load = step_load(numels, tiers, shape)
    saving = []
    for b in range(shape.num_blocks):
        s = 0.0
        for i in shape.block_layers(b):
            f, r, bwd = cost_model.layer_times(load, rates or cost_model.Rates(), load.layer_params[i])
            move = 0.0 if load.layer_on_gpu[i] else \
                load.layer_params[i] * load.stream_bytes / ((rates or cost_model.Rates()).h2d_gbps * cost_model.GB)
            s += max(bwd + r, move) - max(bwd, move)
        saving.append(s)
    order = [b for b in sorted(range(shape.num_blocks), key=lambda b: -saving[b]) if saving[b] > 0]

    def fits(k):
        return _gpu_total(numels, tiers, replace(shape, kept_blocks=tuple(sorted(order[:k])))) <= gpu_budget

    if order and len(order) == shape.num_blocks and fits(len(order)):  # all kept: no recompute working set
        return replace(shape, kept_blocks=tuple(range(shape.num_blocks)))
    lo, hi = 0, max(0, len(order) - 1)
    while lo < hi:  # the largest k that fits (memory grows with k below "all")
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return replace(shape, kept_blocks=tuple(sorted(order[:lo])))


def step_load(numels: dict[str, int], tiers: dict[str, str], shape: StepShape,
              gpu_path_staging: float | None = None) -> "cost_model.StepLoad":
    """What the plan makes one step do, for the step-time model. ``gpu_path_staging``: GPU bytes for the GPU
    update path (default: the reserve alone, ``shape.update_staging``)."""
    if gpu_path_staging is None:
        gpu_path_staging = float(shape.update_staging)
    layers = [x for x in numels if x.startswith("layer.")]
    kept = {i for b in shape.kept_blocks for i in shape.block_layers(b)}
    other = [x for x in numels if not x.startswith("layer.")]
    return cost_model.StepLoad(
        tokens=shape.tokens_per_micro_batch * shape.micro_batches,
        seq_len=shape.seq_len or shape.tokens_per_micro_batch, hidden=shape.hidden, vocab=shape.vocab,
        layer_params=[numels[x] for x in layers], layer_on_gpu=[tiers[x] == "gpu" for x in layers],
        layer_kept=[i in kept for i in range(len(layers))],
        other_params_gpu=sum(numels[x] for x in other if tiers[x] == "gpu"),
        other_params_host=sum(numels[x] for x in other if tiers[x] == "host"),
        stream_bytes=shape.stream_bytes, grad_bytes=4 if shape.grads == "host" else shape.compute_bytes,
        passes=shape.micro_batches if shape.sequential else 1, compute_bytes=shape.compute_bytes,
        grads_on_host=shape.grads == "host", bf16_shadow=shape.bf16_shadow, update_path=shape.update_path,
        host_group_params=[numels[x] for x in numels if tiers[x] == "host"],  # group order = forward order
        host_group_layers=[layers.index(x) if x in layers else -1 for x in numels if tiers[x] == "host"],
        gpu_path_staging_bytes=gpu_path_staging)


def gpu_path_staging(placement: Placement, reserve: int) -> float:
    """GPU bytes the GPU update path may hold under ``placement``: the ``reserve`` the plan kept free plus 90 %
    of what it leaves unused (its parts are estimates), as the engine gives it (``MegaTrain._staging_bytes``)."""
    if placement.gpu_budget is None:
        return float("inf")
    return reserve + 0.9 * max(0, placement.gpu_budget - sum(placement.gpu_parts.values()))


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
