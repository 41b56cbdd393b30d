"""GPU activation memory of one step: what the placement plan reserves before it gives the rest of the GPU
to resident layers. Bytes, per part, from the model shape and the step's token layout.

Let t = tokens per micro-batch (rows x seq), M micro-batches, c = compute-dtype bytes, h hidden, f FFN
size, K the checkpoint interval, V the vocabulary:

  boundaries      ceil(L / K) · M · t · h · c        hidden state entering each block, every micro-batch
  hidden          2 · M · t · h · c                  forward output + d(hidden) of every micro-batch
  block_recompute K · t · (12·h + 4·f) · c           one block recomputed with autograd (q/k/v/o, norms in
                  + t · 3·f · c                       fp32, MLP gate/up/act/product) + its backward transients
  loss            chunk · V · 10                     one loss chunk: bf16 logits, fp32 copy, fp32 grad

A coarse upper bound, not a tracer: the plan adds a margin (EngineConfig.gpu_margin_gib) on top.
"""
from __future__ import annotations

import math


def gpu_working_set(*, num_layers: int, hidden: int, ffn: int, vocab: int, micro_batches: int,
                    tokens_per_micro_batch: int, block: int, compute_bytes: int, loss_chunk_tokens: int,
                    mlp_chunk_tokens: int = -1) -> dict[str, int]:
    """Activation bytes on the GPU, by part (see module doc)."""
    t, c, m = tokens_per_micro_batch, compute_bytes, micro_batches
    mlp_t = t if mlp_chunk_tokens <= 0 else min(t, mlp_chunk_tokens)
    return {
        "boundaries": math.ceil(num_layers / block) * m * t * hidden * c,
        "hidden": 2 * m * t * hidden * c,
        "block_recompute": block * t * 12 * hidden * c + block * mlp_t * 4 * ffn * c + mlp_t * 3 * ffn * c,
        "loss": min(loss_chunk_tokens, t) * vocab * 10,
    }
