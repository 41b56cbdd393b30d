"""The step-time model: one step's predicted time, and its parts, from measured rates.

One model for every choice the planner makes (megatrain/planner.py): which groups live on the GPU tier,
which checkpoint blocks keep their activations instead of recomputing them, where the host tier's gradients
wait for the norm (``grad_placement``) and whether host-tier groups are updated through the GPU too
(``update_path``). The plan predicts a step for each candidate and keeps the fastest that fits; the engine
prints the prediction and reports it beside the measured step (``MegaTrain.info``), so the model stays honest.

    rates = Rates()                                   # H200 defaults; measured values override them
    p = predict(StepLoad(...), rates)                 # -> Prediction(step_s, parts)
    print(p.describe())                               # "step 0.82 s = forward 0.21 + loss 0.05 + ..."

The model (clipping firing every step, the regime every sweep row measures; see DESIGN.md):

    forward    sum over layers of max(F, load)          F: a layer's forward at the step's tokens,
                                                        load: its weights over the host link (host tier)
                                                        or a cast into its slot (GPU tier); with n passes
                                                        (micro_batch_schedule="sequential") n max(F/n, load)
    loss       6 V h T / rate                           final norm + head + cross-entropy, fwd + bwd
    backward   sum over layers of max(B + R, load)      B: backward, R: recompute (0 where the block is kept);
                                                        every layer is loaded again for its backward, kept
                                                        ones too (their weights are not held from the forward);
                                                        a GPU-path layer whose updated master the GPU keeps
                                                        (update_path="hybrid") loads by a cast on the device
    host update  P_host / cpu rate                      the host AdamW after the norm, overlapping the next
                                                        forward: what the forward does not cover is exposed,
                                                        max(0, host update - forward); never faster than its
                                                        gradients come down (c B/param D2H, grad_placement gpu)
                 or the hybrid split's time               update_path="hybrid": the split the engine makes first
                                                        (host_tier.first_split: update_split.plan_split over the
                                                        CPU and the link each way) at the same UpdateRates; its
                                                        CPU-only time is the term above, and a split with no
                                                        GPU-path group is that term
    GPU update   P_gpu / device rate                    fused AdamW on the device, serial after the backward
    step = forward + exposed host update + loss + backward + GPU update

The host update's rates are ``Rates.update_rates()``: the ``UpdateRates`` the engine measured at build on a GPU
(before planning: ``Rates.update``), else the ``cpu_adamw_*`` / link fields here. The CPU rate is the engine's
(its update worker's busy time, calibrated on the H200 rows: see ``H200_CPU_ADAMW_GPARAMS``).

F, R, B come from FLOPs at ``gpu_tflops`` (forward 2 P T + 4 h s T, recompute the same, backward twice it)
unless measured per-layer times are given. With ``speculate`` (clipping not firing) the host update runs
during the backward instead: exposed = max(0, host update - backward).

grad_placement="host" (``grads_on_host``): each host-tier layer's gradient leaves during the backward (fp32,
4 B/param D2H) while the next layers' weights come in, both directions at ``link_both_ways`` of their rate
alone: a host layer's backward is max(B + R, load, gradient out); the CPU update then reads an fp32 gradient
from host RAM (28 B/param moved instead of 24 + c: its rate scales by that ratio) and waits for no D2H.

Adding a term: give ``StepLoad`` the field the plan decides, ``Rates`` the measured rate it runs at, and
``predict`` the term under its own name in ``parts`` and in the step's sum; the planner then weighs it with
the rest (the GPU update path above was added so: ``update_path``, ``host_group_params``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from . import update_split

GB = 1e9

# Measured on the H200 node (/work/shared/reference/h200_limits.json, 2026-11-30; DESIGN.md, 2026-12-02).
H200_H2D_GBPS = 55.3  # pinned host -> GPU, one direction alone
H200_D2H_GBPS = 55.2
# The host tier's CPU update in the engine (calibrated, docs/engine.md "The step-time model"): parameters over
# the worker's busy time (phases.host_update_busy_s) in the H200 update_path rows at a9736ef, clipping firing,
# cores bound (host_update_cores="auto", the default): 14B tiered 16x1024 4.24-4.56 Gparam/s (7.94B host-tier
# params, busy 1.74-1.87 s), 3B pure streaming 16x1024 3.82-4.03 (3.09B, 0.77-0.81 s); pooled 4.26. The next
# forward's weight loads run beside it (one direction, during the forward only) and barely slow it: the same
# as the kernel alone on that host (4.10-4.20, results/host_kernel), not its rate under saturated copies both
# ways (2.72), which the model used until a9736ef (predicting 14B 5.67 s for a measured 4.60).
H200_CPU_ADAMW_GPARAMS = 4.20
# The CPU kernel while the GPU update path's copies run both ways (46 GB/s each way): 2.72 alone on the node
# (DESIGN.md 2026-12-02); the engine's 3B hybrid row at a9736ef implies 2.3-2.8 (CPU-path params over its
# busy time, the GPU path busy for most of it). Used only by the hybrid split.
H200_CPU_ADAMW_UNDER_COPY_GPARAMS = 2.72
# A decoder layer's achieved bf16 rate grows with its width. Engine steps on the H200 (b765233, every block
# recomputed, clipping firing) reported 327 TFLOPS for the 3B shape (h 2048) at 16x1024 and 374 for 7B
# (h 3584) at 8x1024, 398 for 14B (h 5120) at 96x1024; x 8/6 for the recompute the reported figure does not
# count, less the loss and update: ~440, ~540, ~530 achieved. (A lone 7B layer at 16K tokens ran at 620.7,
# h200_limits.json.) Piecewise linear in h between the measurements, flat outside them.
H200_LAYER_TFLOPS = ((2048, 440.0), (3584, 540.0), (5120, 530.0))
# Fused AdamW on the device is memory bound: ~26 B/param (fp32 p, m, v read and written + the gradient) at
# ~2.6 TB/s of the H200's HBM (not measured on its own; milliseconds per billion parameters either way).
H200_GPU_ADAMW_GPARAMS = 100.0
# A GPU-tier layer's "load" is a cast of its fp32 master into a slot on the device: 4 B read + c written per
# parameter. Not measured; half the H200's 4.8 TB/s HBM peak.
H200_GPU_CAST_GBPS = 2400.0
# Each direction's rate while the other runs too (pinned copies both ways at once on the H200 node: 46 GB/s each
# way against 55.3 / 55.2 alone, DESIGN.md 2026-12-02).
H200_LINK_BOTH_WAYS = 46.0 / 55.3
# Bytes the CPU AdamW moves per parameter besides the gradient: fp32 p, m, v read and written.
CPU_STATE_BYTES = 24


def layer_tflops(hidden: int, table=H200_LAYER_TFLOPS) -> float:
    """Achieved TFLOPS of a decoder layer of width ``hidden`` (interpolated in the measured table)."""
    if hidden <= table[0][0]:
        return table[0][1]
    for (h0, r0), (h1, r1) in zip(table, table[1:]):
        if hidden <= h1:
            return r0 + (r1 - r0) * (hidden - h0) / (h1 - h0)
    return table[-1][1]


@dataclass
class Rates:
    """Measured rates the model runs on (defaults: the H200 node). ``None`` for a per-layer time means
    "from FLOPs at ``gpu_tflops``" (None there: ``layer_tflops`` of the model's width)."""

    gpu_tflops: float | None = None  # achieved rate of a decoder layer's forward/recompute/backward
    layer_forward_s: float | None = None  # measured GPU time of one layer's forward at the planned tokens
    layer_recompute_s: float | None = None  # ... its recompute (a forward with autograd)
    layer_backward_s: float | None = None  # ... its backward (weight and input gradients)
    h2d_gbps: float = H200_H2D_GBPS
    d2h_gbps: float = H200_D2H_GBPS
    cpu_adamw_gparams: float = H200_CPU_ADAMW_GPARAMS  # host AdamW in the engine (the next forward streaming)
    cpu_adamw_under_copy_gparams: float = H200_CPU_ADAMW_UNDER_COPY_GPARAMS  # beside the GPU path's copies
    gpu_adamw_gparams: float = H200_GPU_ADAMW_GPARAMS
    gpu_cast_gbps: float = H200_GPU_CAST_GBPS  # bytes read + written per second by a slot cast (GPU tier)
    link_both_ways: float = H200_LINK_BOTH_WAYS  # share of each direction's rate left while the other runs
    gpu_bytes: int | None = None  # GPU memory (for reports; the plan takes its budget from the device)
    host_bytes: int | None = None
    # The host update's rates (an update_split.UpdateRates), as the runtime split uses them: the engine
    # measures them at build on a GPU, before it plans. None: from the fields above (``update_rates``).
    update: "update_split.UpdateRates | None" = None

    def update_rates(self) -> "update_split.UpdateRates":
        """The rates both host update terms run at (the CPU kernel alone, and the hybrid split)."""
        return self.update if self.update is not None else update_split.UpdateRates.from_cost_model(self)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepLoad:
    """What a plan makes one step do, as the model needs it (built by ``placement.step_load``)."""

    tokens: int  # tokens per step (all micro-batches)
    seq_len: int  # tokens per sequence (attention FLOPs)
    hidden: int
    vocab: int
    layer_params: list[int]  # per decoder layer
    layer_on_gpu: list[bool]  # GPU tier (no host link traffic, device update)
    layer_kept: list[bool]  # activations kept from forward to backward: no recompute
    other_params_gpu: int = 0  # embedding / final norm + head on the GPU tier
    other_params_host: int = 0  # ... on the host tier
    stream_bytes: int = 4  # bytes per parameter a host-tier layer's load moves (fp32 master 4, bf16 shadow 2)
    grad_bytes: int = 2  # bytes per parameter a host-tier gradient moves to the host
    speculate: bool = False  # clipping not expected: the host update runs during the backward
    passes: int = 1  # passes over the layers per step (micro_batch_schedule="sequential": one per micro-batch)
    compute_bytes: int = 2  # bytes of a slot's weights per parameter (a GPU-tier layer's cast writes them)
    grads_on_host: bool = False  # grad_placement="host": host-tier gradients go out (fp32) during the backward
    bf16_shadow: bool = False  # host-tier layers stream from a bf16 shadow (the GPU update path keeps no master)
    update_path: str = "cpu"  # the host tier's update: "cpu" (CPU kernel) or "hybrid" (+ the GPU update path)
    # Host-tier groups' parameters in the order the next forward needs them (embed, layers, final), for the
    # hybrid split; None: the embedding / head sum first, then the host layers.
    host_group_params: list[int] | None = None
    # Each host-tier group's decoder layer index (-1: embedding / final norm + head), in the same order; None:
    # as ``host_group_params``'s default order.
    host_group_layers: list[int] | None = None
    # GPU memory the GPU update path may hold (rotating buffers, then kept masters, 4 B/param); with all
    # masters kept, a GPU-path group's next load is a cast on the GPU (no bytes over the link)
    gpu_path_staging_bytes: float = math.inf

    @property
    def params_gpu(self) -> int:
        return self.other_params_gpu + sum(p for p, g in zip(self.layer_params, self.layer_on_gpu) if g)

    @property
    def params_host(self) -> int:
        return self.other_params_host + sum(p for p, g in zip(self.layer_params, self.layer_on_gpu) if not g)


@dataclass
class Prediction:
    """A predicted step: its time and the parts it is made of (seconds)."""

    step_s: float
    parts: dict[str, float] = field(default_factory=dict)
    split_reason: str = ""  # update_path "hybrid": why the split is what it is (update_split.Split.reason)

    def describe(self) -> str:
        p = self.parts
        return (f"predicted step {self.step_s:.3f} s = forward {p['forward_s']:.3f} + exposed host update "
                f"{p['host_update_exposed_s']:.3f} + loss {p['loss_s']:.3f} + backward {p['backward_s']:.3f} "
                f"(recompute {p['recompute_s']:.3f}) + GPU update {p['gpu_update_s']:.3f}; host update "
                f"{p['host_update_s']:.3f}{self._hybrid_text()}, weights in {p['h2d_s']:.3f}, gradients out "
                f"{p['d2h_s']:.3f}")

    def _hybrid_text(self) -> str:
        p = self.parts
        if "gpu_path_groups" not in p:
            return ""
        return (f" (update_path hybrid: {p['gpu_path_groups']:.0f} groups on the GPU path; CPU kernel alone "
                f"{p['host_update_cpu_only_s']:.3f})")


def layer_times(load: StepLoad, rates: Rates, params: int) -> tuple[float, float, float]:
    """(forward, recompute, backward) GPU seconds of one layer with ``params`` parameters."""
    tflops = rates.gpu_tflops or layer_tflops(load.hidden)
    fwd_flops = 2 * params * load.tokens + 4 * load.hidden * load.seq_len * load.tokens
    f = rates.layer_forward_s if rates.layer_forward_s is not None else fwd_flops / (tflops * 1e12)
    r = rates.layer_recompute_s if rates.layer_recompute_s is not None else f
    b = rates.layer_backward_s if rates.layer_backward_s is not None else 2 * fwd_flops / (tflops * 1e12)
    return f, r, b


def predict(load: StepLoad, rates: Rates | None = None) -> Prediction:
    """The step time of ``load`` at ``rates`` (the model in the module doc)."""
    rates = rates or Rates()
    fwd = bwd = recompute = h2d = 0.0
    n = max(1, load.passes)
    both = rates.link_both_ways
    # host layer -> (its backward term, the same with its load a cast of a kept master, its link seconds)
    host_bwd: dict[int, tuple[float, float, float]] = {}
    for i, (params, on_gpu, kept) in enumerate(zip(load.layer_params, load.layer_on_gpu, load.layer_kept)):
        f, r, b = layer_times(load, rates, params)
        out = 0.0
        cast = params * (4 + load.compute_bytes) / (rates.gpu_cast_gbps * GB)
        if on_gpu:  # a cast on the device
            move = move_bwd = cast
        else:
            move = move_bwd = params * load.stream_bytes / (rates.h2d_gbps * GB)
            h2d += 2 * n * move  # forward and backward: a kept layer is loaded again for its backward
            if load.grads_on_host:  # its gradient goes out during the backward, beside the loads coming in
                move_bwd = move / both
                out = params * 4 / (rates.d2h_gbps * both * GB)
        r = 0.0 if kept else r
        recompute += r
        # each pass computes 1/n of the tokens; its loads are prefetched behind the layer before
        fwd += n * max(f / n, move)
        term = max(n * max((b + r) / n, move_bwd), out)
        bwd += term
        if not on_gpu:
            host_bwd[i] = (term, max(n * max((b + r) / n, cast), out), n * move)
    # embedding / head on the host tier: one load per step (resident compute copies)
    h2d += load.other_params_host * 4 / (rates.h2d_gbps * GB)
    grad_bytes = 4 if load.grads_on_host else load.grad_bytes
    d2h = load.params_host * grad_bytes / (rates.d2h_gbps * GB)
    loss = 6 * load.vocab * load.hidden * load.tokens / ((rates.gpu_tflops or layer_tflops(load.hidden)) * 1e12)
    urates = rates.update_rates()
    host_rate = urates.cpu_gps  # the CPU kernel without the GPU path's copies (the forward's loads may run)
    if load.grads_on_host:  # it reads an fp32 gradient from host RAM: 28 B/param instead of 24 + c
        host_rate *= (CPU_STATE_BYTES + load.compute_bytes) / (CPU_STATE_BYTES + 4)
    host_update = load.params_host / (host_rate * GB)
    if not load.grads_on_host and not load.speculate:  # after the norm it pulls its gradients down as it goes
        host_update = max(host_update, load.params_host * load.grad_bytes / (rates.d2h_gbps * both * GB))
    gpu_update = load.params_gpu / (rates.gpu_adamw_gparams * GB)
    parts = dict(forward_s=fwd, loss_s=loss, backward_s=bwd, recompute_s=recompute, host_update_s=host_update,
                 host_update_exposed_s=0.0, gpu_update_s=gpu_update, h2d_s=h2d, d2h_s=d2h)
    reason = ""
    if load.update_path == "hybrid" and load.params_host:
        split, on_gpu_path, candidates, contested = hybrid_split(load, rates, backward_s=bwd)
        reason = split.reason
        parts.update(host_update_cpu_only_s=host_update, gpu_path_groups=float(len(split.gpu)),
                     gpu_path_candidates=float(candidates), gpu_path_contested=float(contested),
                     gpu_path_params=float(sum(p for p, on in zip(_host_groups(load), on_gpu_path) if on)))
        if split.gpu:
            if _masters_kept(load):  # a GPU-path layer's backward load casts its kept master: off the link
                for layer, on in zip(_host_group_layers(load), on_gpu_path):
                    if on and layer in host_bwd:
                        term, cast_term, link_s = host_bwd[layer]
                        bwd, h2d = bwd - term + cast_term, h2d - link_s
                parts.update(backward_s=bwd, h2d_s=h2d)
            # plan_split's time runs from the norm (a speculative CPU path's head start already spent)
            host_update = split.predicted_s + (bwd if load.speculate else 0.0)
        parts["host_update_s"] = host_update  # no GPU-path group: the CPU kernel alone, the term above
    covered = bwd if load.speculate else fwd
    exposed = max(0.0, host_update - covered)
    parts["host_update_exposed_s"] = exposed
    return Prediction(step_s=fwd + exposed + loss + bwd + gpu_update, parts=parts, split_reason=reason)


def _host_groups(load: StepLoad) -> list[int]:
    if load.host_group_params is not None:
        return list(load.host_group_params)
    layers = [p for p, g in zip(load.layer_params, load.layer_on_gpu) if not g]
    return ([load.other_params_host] if load.other_params_host else []) + layers


def _host_group_layers(load: StepLoad) -> list[int]:
    if load.host_group_layers is not None:
        return list(load.host_group_layers)
    layers = [i for i, g in enumerate(load.layer_on_gpu) if not g]
    return ([-1] if load.other_params_host else []) + layers


def _masters_kept(load: StepLoad) -> bool:
    """Whether the GPU update path keeps every updated master on the GPU (``host_tier.split_args``' rule), so
    that a GPU-path layer's loads until its next update are casts on the device."""
    from .host_tier import split_args  # imports torch: not at module load

    groups = _host_groups(load)
    args = split_args(groups, staging_bytes=load.gpu_path_staging_bytes, grads_on_host=load.grads_on_host,
                      stream_bytes=load.stream_bytes, grad_bytes=load.grad_bytes, shadow=load.bf16_shadow)
    return bool(groups) and args is not None and args["kept_bytes"] >= args["kept_per_param"] * sum(groups)


def hybrid_split(load: StepLoad, rates: Rates, backward_s: float) -> tuple["update_split.Split", list[bool], int]:
    """The host tier's update split between the CPU kernel and the GPU update path at ``rates.update_rates()``:
    for a step that waits for the norm, the split the runtime makes first (``megatrain.host_tier.first_split``,
    the same function at the same rates and staging, so the plan and the engine agree on the groups); for a
    speculative one, ``plan_split``'s prefix with the CPU path's head start ``backward_s``. Returns the split,
    per host group (forward order) whether it takes the GPU path, how many groups the runtime's GPU path
    would hold (``first_split``'s candidates; 0: the engine builds no GPU path), and how many of them the first
    after-norm split leaves to the CPU path (``Split.beyond_plan``: a contested split within MODEL_DOUBT, and
    the hedge at CPU rates CPU_DOUBT slower), for the runtime to try once its calibrated rates propose them."""
    from .host_tier import first_split, split_args  # the runtime's split (imports torch: not at module load)

    groups = _host_groups(load)
    names = [f"g{i}" for i in range(len(groups))]
    order = list(zip(names, groups))
    kw = dict(staging_bytes=load.gpu_path_staging_bytes, grads_on_host=load.grads_on_host,
              stream_bytes=load.stream_bytes, grad_bytes=load.grad_bytes, shadow=load.bf16_shadow)
    urates = rates.update_rates()
    split, candidates = first_split(order, urates, **kw)
    contested = len(split.beyond_plan)  # built as candidates by first_split, the first split leaves them to the CPU
    if load.speculate:
        args = split_args(groups, **kw)
        split = (update_split.plan_split(order, urates, speculative=True, backward_s=backward_s, **args) if args
                 else update_split.Split([], names, reason="the GPU staging holds no chunk"))
    chosen = set(split.gpu)
    return split, [x in chosen for x in names], len(candidates), contested
