"""GPU activation memory of one step: what the placement plan reserves before it gives the rest of the GPU
to resident layers. Bytes, per part, from the model shape and the step's token layout.

Let t = tokens per micro-batch (rows x seq), M micro-batches, c = compute-dtype bytes, h hidden, f FFN
size, kv the key/value width (heads_kv x head_dim; default h), K the checkpoint interval, V the vocabulary,
n = ceil(L / K) boundaries per micro-batch, g = boundaries kept on the GPU (all unless offloaded):

  boundaries      n · M · t · h · c                  hidden state entering each block, every micro-batch;
                  offloaded (g < n·M):  g · t · h · c + 2 · t · h · c    (the rest is in host memory, see
                                                     host_boundary_bytes; 2 = the one in use + the one prefetched)
  hidden          2 · M · t · h · c                  forward output + d(hidden) of every micro-batch
  block_recompute one block recomputed with autograd + one layer's backward transients:
    unchunked     K · t · (12·h + 4·f) · c           (q/k/v/o, norms in fp32, MLP gate/up/act/product)
                  + t · 3·f · c
    chunked MLP   K · t · (7·h + 2·kv) · c           (layer input, normed input, q/k/v, SDPA out, o_proj
                                                     input, post-attention residual: attention terms only)
                  + t · 6·h · c                      (attention backward: dq/dk/dv, d normed, dx)
                  + m · (7·f + 6·h) · c              (one MLP chunk of m tokens: recompute + its gradients)
  mlp_grad_accum  4 · (3·h·f + h)                    fp32 sums of the chunked MLP's weight gradients (only
                                                     when chunked and c < 4)
  loss            chunk · V · 10                     one loss chunk: bf16 logits, fp32 copy, fp32 grad
  kept            k · M · t · (12·h + 4·f) · c       the autograd graphs of the k layers whose blocks keep
                                                     their activations (no recompute, unchunked only): what
                                                     one layer saves for its backward (measured with a
                                                     saved-tensors hook on the 3B shape in bf16: 67364·c per
                                                     token against 12·h + 4·f = 68608; 7B 116540 vs 118784)

Kept blocks have no boundary (n counts only the recomputed blocks); with no block recomputed the recompute
term is one layer's backward transients only (t · 3·f · c).

With chunking the only terms that grow with t are attention terms (multiples of t·h); the MLP's t·f
terms are bounded by the chunk. A coarse upper bound, not a tracer: the plan adds a margin
(EngineConfig.gpu_margin_gib) on top.
"""
from __future__ import annotations

import math

from .chunked_mlp import resolve_chunk


def gpu_working_set(*, num_layers: int, hidden: int, ffn: int, vocab: int, micro_batches: int,
                    tokens_per_micro_batch: int, block: int, compute_bytes: int, loss_chunk_tokens: int,
                    mlp_chunk_tokens: int = -1, boundaries_on_gpu: int | None = None,
                    kv_hidden: int | None = None, kept_layers: int = 0,
                    recomputed_blocks: int | None = None) -> dict[str, int]:
    """Activation bytes on the GPU, by part (see module doc).

    ``mlp_chunk_tokens``: -1 never, 0 auto, N tokens, resolved for t by megatrain.chunked_mlp.resolve_chunk
    (0: the threshold rule). The placement plan passes the value it decided (-1 where "auto" fits
    unchunked, megatrain/planner.py) and the engine runs the plan's resolved value, so the prediction is
    made for what runs. ``boundaries_on_gpu``: None keeps every boundary on the GPU
    (boundary_offload="gpu"); g >= 0 keeps g of them there and offloads the rest (0: "host").
    ``kept_layers``: layers whose blocks keep their activations; ``recomputed_blocks``: blocks recomputed
    (None: every block, ceil(L / K))."""
    t, c, m, h = tokens_per_micro_batch, compute_bytes, micro_batches, hidden
    kv = h if kv_hidden is None else kv_hidden
    blocks = math.ceil(num_layers / block) if recomputed_blocks is None else recomputed_blocks
    n = blocks * m
    if boundaries_on_gpu is None or boundaries_on_gpu >= n:
        bounds = n * t * h * c
    else:
        bounds = (boundaries_on_gpu + 2) * t * h * c
    chunk = resolve_chunk(mlp_chunk_tokens, t)
    if chunk == 0:
        recompute = (block * kept_layer_bytes(hidden=h, ffn=ffn, tokens=t, compute_bytes=c) if blocks else 0) \
            + t * 3 * ffn * c
        accum = 0
    else:
        recompute = block * t * (7 * h + 2 * kv) * c + t * 6 * h * c + chunk * (7 * ffn + 6 * h) * c
        accum = 4 * (3 * h * ffn + h) if c < 4 else 0
    return {
        "boundaries": bounds,
        "hidden": 2 * m * t * h * c,
        "block_recompute": recompute,
        "mlp_grad_accum": accum,
        "loss": min(loss_chunk_tokens, t) * vocab * 10,
        "kept_activations": kept_layers * m * kept_layer_bytes(hidden=h, ffn=ffn, tokens=t, compute_bytes=c),
    }


def kept_layer_bytes(*, hidden: int, ffn: int, tokens: int, compute_bytes: int) -> int:
    """What one unchunked layer's autograd graph holds for its backward at ``tokens`` tokens (module doc)."""
    return tokens * (12 * hidden + 4 * ffn) * compute_bytes


def host_boundary_bytes(*, num_layers: int, hidden: int, micro_batches: int, tokens_per_micro_batch: int,
                        block: int, compute_bytes: int, boundaries_on_gpu: int = 0,
                        gpu_budget_bytes: int | None = None) -> int:
    """Host bytes (pinned on CUDA) of offloaded block boundaries: every boundary not kept on the GPU.
    Give either ``boundaries_on_gpu`` (a count) or ``gpu_budget_bytes`` (the store keeps as many as fit)."""
    per = tokens_per_micro_batch * hidden * compute_bytes
    n = math.ceil(num_layers / block) * micro_batches
    on_gpu = boundaries_on_gpu if gpu_budget_bytes is None else gpu_budget_bytes // per
    return max(0, n - on_gpu) * per


def choose_block(*, gpu_bytes: int, host_bytes: int, num_layers: int, hidden: int, micro_batches: int,
                 tokens_per_micro_batch: int, compute_bytes: int, **shape) -> tuple[int, int] | None:
    """The smallest checkpoint interval K (least recompute memory) whose activations fit: ``gpu_bytes`` of
    GPU memory for the working set plus the boundaries kept there, ``host_bytes`` of host memory for the
    ones offloaded. Returns (K, boundaries kept on the GPU), or None when no K fits. A larger K trades
    boundaries (fewer, n = ceil(L/K)) for a larger block recompute (K layers' attention terms).
    ``shape``: the rest of gpu_working_set's keyword arguments (ffn, vocab, loss_chunk_tokens, ...).

    Not used by the engine or the placement plan (they take K from EngineConfig.checkpoint_interval): a
    what-if tool. Its ``mlp_chunk_tokens`` follows the threshold rule for 0 ("auto") and does not re-decide
    it per K as the plan would; to size the step the engine will run, pass the plan's resolved value
    (Placement.mlp_chunk_tokens)."""
    common = dict(num_layers=num_layers, hidden=hidden, micro_batches=micro_batches,
                  tokens_per_micro_batch=tokens_per_micro_batch, compute_bytes=compute_bytes)
    per = tokens_per_micro_batch * hidden * compute_bytes
    for k in range(1, num_layers + 1):
        n = math.ceil(num_layers / k) * micro_batches
        rest = sum(v for p, v in gpu_working_set(block=k, **common, **shape).items() if p != "boundaries")
        if rest + n * per <= gpu_bytes:
            return k, n  # all on the GPU
        on_gpu = max(0, (gpu_bytes - rest) // per - 2)  # less the one in use and the one prefetched
        if rest + 2 * per <= gpu_bytes and host_boundary_bytes(block=k, boundaries_on_gpu=on_gpu, **common) <= host_bytes:
            return k, on_gpu
    return None
