"""Host-memory model of the engine's host tier (see README "Formulas"); the full two-tier plan, checked
before anything is allocated, is megatrain/planner.py (its records megatrain/placement.py).

host bytes = 12·P_host                  fp32 master + AdamW m + v of the host-tier groups
           + 2·P_host (bf16 stream)     pinned bf16 shadow of the master
           + slabs · chunk · 4          pinned gradient slabs (gradients wait on the GPU, no host buffer)
                                        or, with grad_placement="host", 4·P_host pinned host gradients
           + overhead                   Python, torch, CUDA context (~1.5 GiB measured order)

With pure streaming (gpu_resident=0) P_host = P: 12 B/param + a fixed ~1.8 GiB, whatever the micro-batch
count.
"""
from __future__ import annotations

import os
from dataclasses import fields

import psutil

from . import placement, planner
from .placement import OVERHEAD_HOST_BYTES

SLAB_BYTES = (1 << 24) * 4  # megatrain.grad_offload.CHUNK_ELEMS fp32 elements per slab
# The emulated machine's total host RAM in GiB (the sweep runner's host_ram_gib profiles set it in the point
# process); unset or empty: the real machine.
HOST_RAM_ENV = "MEGATRAIN_HOST_RAM_GIB"


def host_ram_cap_bytes() -> int | None:
    """The host-RAM cap from ``$MEGATRAIN_HOST_RAM_GIB`` in bytes, None when unset or empty."""
    value = os.environ.get(HOST_RAM_ENV, "").strip()
    if not value:
        return None
    gib = float(value)  # a typo raises here: it must not silently mean "no cap"
    if gib <= 0:
        raise ValueError(f"{HOST_RAM_ENV}={value!r}: the emulated host RAM must be > 0 GiB")
    return int(gib * 2**30)


def capped_available_bytes(cap_bytes: int | None) -> int:
    """RAM this process may still allocate on a machine whose total RAM is ``cap_bytes`` (None: the real
    machine): ``cap - this process's RSS``, never more than the real available.

    Why ``cap - RSS``: the real ``available`` is the total minus everything resident, this process's own
    pages included; on the emulated machine this process is the only tenant we account for, so its RSS is
    what the cap already holds. The real available still bounds it (a cap above the machine's free RAM
    must not promise memory that is not there)."""
    real = int(psutil.virtual_memory().available)
    if cap_bytes is None:
        return real
    return max(0, min(real, int(cap_bytes) - psutil.Process().memory_info().rss))


def available_host_bytes() -> int:
    """RAM that can be allocated now: psutil's ``available`` (free + reclaimable cache), or, when
    ``$MEGATRAIN_HOST_RAM_GIB`` is set, what is left of that emulated total (``capped_available_bytes``).

    The cap is a *planning* cap: the placement plan (and the sweep runner's skip rule, which uses the same
    rule) refuses what would not fit before anything is allocated; nothing stops an allocation beyond it.
    An enforced limit (RLIMIT_AS) is not used because CUDA reserves far more virtual address space than
    it touches, so any such limit breaks CUDA initialisation long before RAM runs out."""
    return capped_available_bytes(host_ram_cap_bytes())


def estimate_bytes(layer_numels: list[int], other_numel: int, *, grad_slabs: int, bf16_shadow: bool,
                   on_gpu: bool = True) -> dict:
    """Pure-streaming host footprint (every group on the host tier)."""
    p = sum(layer_numels) + other_numel
    parts = {
        "master_fp32": 4 * p,
        "adam_m_v_fp32": 8 * p,
        "bf16_shadow": 2 * p if bf16_shadow else 0,
        "grad_slabs": grad_slabs * SLAB_BYTES if on_gpu else 0,
        "overhead": OVERHEAD_HOST_BYTES,
    }
    total = sum(parts.values())
    return {"total_bytes": total, "num_params": p, "bytes_per_param": total / max(p, 1),
            "variable_bytes_per_param": (parts["master_fp32"] + parts["adam_m_v_fp32"] + parts["bf16_shadow"]) / max(p, 1),
            "parts": parts}


def host_estimate(spec, *, micro_batches: int = 1, options: dict | None = None, on_gpu: bool = True) -> dict:
    """Engine host footprint with pure streaming for a ``ModelSpec``, without building anything (used to
    skip sweep points). ``micro_batches`` no longer changes it (gradients accumulate on the GPU)."""
    opts = dict(options or {})
    p_total = spec.num_params()
    embed = spec.vocab_size * spec.hidden_size
    other = embed + spec.hidden_size + (0 if spec.tie_embeddings else embed)
    per_layer = (p_total - other) // spec.num_layers
    return estimate_bytes([per_layer] * spec.num_layers, other, grad_slabs=int(opts.get("grad_slabs", 4)),
                          bf16_shadow=opts.get("stream_dtype", "fp32") == "bf16", on_gpu=on_gpu)


def gpu_free_bytes(device) -> int:
    """Free GPU bytes as the plan may use them: the driver's free memory, and no more than what the
    process's memory fraction leaves (``torch.cuda.set_per_process_memory_fraction``, e.g. the runner's
    emulated 80 GB GPU) minus what torch has already reserved."""
    import torch

    device = torch.device(device)
    if device.index is None:  # the per-process fraction is per device index
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction < 1.0:
        free = min(free, int(fraction * total) - torch.cuda.memory_reserved(device))
    return max(0, int(free))


def step_shape(cfg, *, num_layers: int, hidden: int, ffn: int, vocab: int, tokens_per_micro_batch: int,
               compute_bytes: int, on_gpu: bool, seq_len: int = 0) -> "placement.StepShape":
    """The plan's view of a step for an ``EngineConfig`` (one definition for the engine and for
    ``plan_for_spec``): K and the slot pool from ``placement.block_and_slots``."""
    block, slots = placement.block_and_slots(cfg.checkpoint_interval, cfg.num_slots, num_layers)
    return placement.StepShape(
        num_layers=num_layers, hidden=hidden, ffn=ffn, vocab=vocab, micro_batches=cfg.micro_batches,
        tokens_per_micro_batch=tokens_per_micro_batch, block=block, num_pool_slots=slots,
        compute_bytes=compute_bytes, stream_fp32=cfg.stream_dtype == "fp32", bf16_shadow=cfg.stream_dtype == "bf16",
        slab_bytes_total=cfg.grad_slabs * SLAB_BYTES if on_gpu else 0,
        loss_chunk_tokens=cfg.loss_chunk_tokens, mlp_chunk_tokens=cfg.mlp_chunk_tokens,
        boundaries_on_gpu=0 if cfg.boundary_offload == "host" else None, recompute=cfg.recompute,
        schedule=cfg.micro_batch_schedule if cfg.micro_batches > 1 else "layers",
        seq_len=seq_len, stream_bytes=2 if cfg.stream_dtype == "bf16" else 4,
        autocast_casts=_autocasts(cfg, on_gpu))


def _autocasts(cfg, on_gpu: bool) -> bool:
    """Does the step run under autocast (mixed_precision "autocast" with a bf16/fp16 compute dtype; "auto" is
    bf16 on a GPU, fp32 on the CPU)?"""
    if cfg.mixed_precision != "autocast":
        return False
    return on_gpu if cfg.compute_dtype == "auto" else cfg.compute_dtype not in ("fp32", "float32")


def spec_group_numels(spec) -> dict[str, int]:
    """Group sizes (embed, layer.i, final) of a ``ModelSpec`` without building the model (the engine's
    groups add no padding beyond this; see megatrain.store.make_groups)."""
    embed = spec.vocab_size * spec.hidden_size
    final = spec.hidden_size + (0 if spec.tie_embeddings else embed)
    per_layer = (spec.num_params() - embed - final) // spec.num_layers
    return {"embed": embed, **{f"layer.{i}": per_layer for i in range(spec.num_layers)}, "final": final}


def plan_for_spec(spec, options=None, *, micro_batches: int = 1, tokens_per_step: int,
                  gpu_free: int, host_available: int, seq_len: int | None = None) -> "placement.Placement":
    """The engine's two-tier placement plan for a ``ModelSpec`` on a GPU with ``gpu_free`` bytes, without
    building anything (the runner uses it to skip points that cannot fit). Raises ``placement.DoesNotFit``
    (a MemoryError) with the numbers as the engine would. ``host_available``: the host RAM the engine will
    see (the step-time model chooses the tiers within it; an unlimited host could make it choose a plan the
    real host cannot hold); ``seq_len``: tokens per sequence (attention FLOPs in the model; default one
    sequence per micro-batch). ``options``: an ``EngineConfig`` (the runner's, as the engine will get it:
    its ``micro_batches`` win) or a dict of its fields."""
    from .config import EngineConfig

    if isinstance(options, EngineConfig):
        cfg = options
        micro_batches = cfg.micro_batches
    else:
        opts = {k: v for k, v in dict(options or {}).items() if k in {f.name for f in fields(EngineConfig)}}
        cfg = EngineConfig(micro_batches=micro_batches, **opts)
    shape = step_shape(cfg, num_layers=spec.num_layers, hidden=spec.hidden_size, ffn=spec.intermediate_size,
                       vocab=spec.vocab_size, tokens_per_micro_batch=max(1, tokens_per_step // micro_batches),
                       compute_bytes=4 if cfg.mixed_precision == "autocast" else 2, on_gpu=True,
                       seq_len=seq_len or min(spec.max_position_embeddings, max(1, tokens_per_step // micro_batches)))
    return planner.plan(spec_group_numels(spec), shape, setting=str(cfg.gpu_resident), on_gpu=True,
                        gpu_free=gpu_free, host_available=host_available,
                        gpu_margin=int(cfg.gpu_margin_gib * placement.GIB),
                        host_margin=int(cfg.host_margin_gib * placement.GIB), grads=cfg.grad_placement,
                        update_path=cfg.update_path, staging_reserve=planner.staging_bytes(cfg.update_staging_gib))
