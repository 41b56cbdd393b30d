"""Host-memory model of the engine (see README "Formulas"), checked before anything is allocated.

host bytes = 12·P                      fp32 master + AdamW m + v
           + g·P_layers + 4·P_other    gradient buffers (g = 2 for bf16 layer grads with one
                                       micro-batch, else 4; embed/final grads are always fp32)
           + 2·P   (bf16 stream only)  pinned bf16 shadow of the master
           + slabs · max_layer · s     pinned gradient slabs (s = compute dtype size)
           + overhead                  Python, torch, CUDA context (~1.5 GiB measured order)
"""
from __future__ import annotations

import psutil

OVERHEAD_BYTES = int(1.5 * 2**30)


def available_host_bytes() -> int:
    """RAM that can be allocated now (psutil's ``available``: free + reclaimable cache)."""
    return int(psutil.virtual_memory().available)


def estimate_bytes(layer_numels: list[int], other_numel: int, *, layer_grad_bytes: int, compute_bytes: int,
                   grad_slabs: int, bf16_shadow: bool) -> dict:
    p_layers = sum(layer_numels)
    p = p_layers + other_numel
    parts = {
        "master_fp32": 4 * p,
        "adam_m_v_fp32": 8 * p,
        "grads": layer_grad_bytes * p_layers + 4 * other_numel,
        "bf16_shadow": 2 * p if bf16_shadow else 0,
        "grad_slabs": grad_slabs * max(layer_numels, default=0) * compute_bytes,
        "overhead": OVERHEAD_BYTES,
    }
    total = sum(parts.values())
    return {"total_bytes": total, "num_params": p, "bytes_per_param": total / max(p, 1), "parts": parts}


def host_estimate(spec, *, micro_batches: int = 1, options: dict | None = None, on_gpu: bool = True) -> dict:
    """Engine host footprint for a ``ModelSpec`` without building anything (used to skip sweep points)."""
    opts = dict(options or {})
    p_total = spec.num_params()
    embed = spec.vocab_size * spec.hidden_size
    other = embed + spec.hidden_size + (0 if spec.tie_embeddings else embed)
    per_layer = (p_total - other) // spec.num_layers
    compute_bytes = 2 if on_gpu else 4
    grad_bytes = 2 if (on_gpu and micro_batches == 1) else 4
    return estimate_bytes([per_layer] * spec.num_layers, other, layer_grad_bytes=grad_bytes,
                          compute_bytes=compute_bytes, grad_slabs=int(opts.get("grad_slabs", 4)),
                          bf16_shadow=opts.get("stream_dtype", "fp32") == "bf16")


def format_estimate(est: dict) -> str:
    gib = 2**30
    parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in est["parts"].items() if v)
    return (f"host memory estimate: {est['total_bytes'] / gib:.2f} GiB for {est['num_params'] / 1e9:.3f}B params "
            f"({est['bytes_per_param']:.2f} bytes/param; GiB: {parts})")


def check_fits(est: dict, margin_gib: float, available: int | None = None) -> None:
    """Refuse, with the numbers, a model that does not fit in available RAM minus a margin."""
    available = available_host_bytes() if available is None else available
    budget = available - int(margin_gib * 2**30)
    if est["total_bytes"] > budget:
        gib = 2**30
        raise MemoryError(
            f"model does not fit in host RAM: needs {est['total_bytes'] / gib:.2f} GiB "
            f"({est['bytes_per_param']:.2f} bytes/param x {est['num_params'] / 1e9:.3f}B params) but only "
            f"{available / gib:.2f} GiB is available (minus a {margin_gib:.1f} GiB margin = {budget / gib:.2f} GiB)"
        )
