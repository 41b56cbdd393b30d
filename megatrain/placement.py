"""Placement: what a plan is and what it costs. ``StepShape`` (one step's shape as the plan sees it),
``Placement`` (the tiers, where gradients wait, the kept blocks, the predicted memories and step), and the
byte accounting both tiers are checked against; the choices themselves are megatrain/planner.py's.

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

``block_and_slots`` is the one formula for K and the slot pool.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from . import activations, cost_model

GIB = 2**30
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
                     f"{params_text(self.params_on('gpu'))} params; host tier: {names('host')} = "
                     f"{params_text(self.params_on('host'))} params"]
        else:  # a CPU run: one memory, no GPU tier to speak of
            lines = [f"placement (CPU run: every group and every activation in host RAM; grad_placement={grads}): "
                     f"{params_text(sum(self.numels.values()))} params"]
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
    if shape.boundaries_on_gpu is not None or gpu_total(numels, tiers, shape) <= gpu_budget:
        return shape
    per = shape.tokens_per_micro_batch * shape.hidden * shape.compute_bytes
    rest = gpu_total(numels, tiers, replace(shape, boundaries_on_gpu=0))  # includes the 2 in flight
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


def gpu_parts_for(numels, tiers, shape) -> dict[str, int]:
    any_gpu = any(t == "gpu" for t in tiers.values())
    any_host_layer = any(t == "host" for n, t in tiers.items() if n.startswith("layer."))
    parts = {"gpu_tier_state": GPU_TIER_BYTES_PER_PARAM * sum(n for x, n in numels.items() if tiers[x] == "gpu"),
             "grads": grad_bytes(numels, tiers, shape)}
    parts.update(gpu_fixed_parts(numels, shape, any_gpu, any_host_layer))
    return parts


def gpu_total(numels, tiers, shape) -> int:
    return sum(gpu_parts_for(numels, tiers, shape).values())


def params_text(n: int) -> str:
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
