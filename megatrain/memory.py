"""Host-memory model of the engine's host tier (see README "Formulas"); the full two-tier plan, checked
before anything is allocated, is megatrain/placement.py.

host bytes = 12·P_host                  fp32 master + AdamW m + v of the host-tier groups
           + 2·P_host (bf16 stream)     pinned bf16 shadow of the master
           + slabs · chunk · 4          pinned gradient slabs (gradients wait on the GPU, no host buffer)
           + overhead                   Python, torch, CUDA context (~1.5 GiB measured order)

With pure streaming (gpu_resident=0) P_host = P: 12 B/param + a fixed ~1.8 GiB, whatever the micro-batch
count.
"""
from __future__ import annotations

import psutil

from .placement import OVERHEAD_HOST_BYTES

SLAB_BYTES = (1 << 24) * 4  # megatrain.grad_offload.CHUNK_ELEMS fp32 elements per slab


def available_host_bytes() -> int:
    """RAM that can be allocated now (psutil's ``available``: free + reclaimable cache)."""
    return int(psutil.virtual_memory().available)


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
