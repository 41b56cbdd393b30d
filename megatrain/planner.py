"""The planner: one plan for the GPU's bytes, decided before anything is allocated (``plan``) by one
step-time model (megatrain/cost_model.py) -- which groups go to the GPU tier (``gpu_resident``), where the host
tier's gradients wait (``grad_placement``), whether the MLP is chunked, which blocks keep their activations,
the micro-batch schedule, and the host tier's update path and its GPU staging. The records it returns and
their byte accounting are megatrain/placement.py's.

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
to plan: "auto" recomputes as "all" does.

The host tier's update (``update_path``): "cpu" updates every host-tier group with the CPU kernel; "hybrid"
keeps GPU staging free for a second path (megatrain/streamed_update.py) and the engine's split
(megatrain/update_split.py) gives it groups; "auto" plans both and keeps the one predicted CONTESTED_GAIN
faster. The staging reserve (``update_staging_gib`` None) is chosen here too: see RESERVE_GAIN.
"""
from __future__ import annotations

import math
from dataclasses import replace

from . import cost_model, update_split
from .chunked_mlp import AUTO_MIN_TOKENS, resolve_chunk
from .placement import (GIB, DoesNotFit, Placement, StepShape, gpu_parts_for, gpu_path_staging, gpu_total,
                        host_parts_for, offload_boundaries_if_needed, params_text, preference_order, step_load,
                        tiers_for_layers)

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
        fewer, more = params_text(unchunked.params_on("gpu")), params_text(chunked.params_on("gpu"))
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
    placement.gpu_parts = gpu_parts_for(numels, tiers, shape)
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
        if gpu_total(numels, trial, shape) > gpu_budget:
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
        return gpu_total(numels, tiers, replace(shape, kept_blocks=tuple(sorted(order[:k])))) <= gpu_budget

    if order and len(order) == shape.num_blocks and fits(len(order)):  # all kept: no recompute working set
        return replace(shape, kept_blocks=tuple(range(shape.num_blocks)))
    lo, hi = 0, max(0, len(order) - 1)
    while lo < hi:  # the largest k that fits (memory grows with k below "all")
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return replace(shape, kept_blocks=tuple(sorted(order[:lo])))
