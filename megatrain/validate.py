"""Batch checks with clear messages, run before a step touches any state."""
from __future__ import annotations

import torch

from .system import IGNORE_INDEX


def validate_batch(batch, config, micro_batches: int) -> None:
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError("batch must be a dict with at least 'input_ids' (and optionally labels, attention_mask, "
                         "position_ids)")
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D tensor [batch, seq], got {getattr(ids, 'shape', type(ids))}")
    if ids.numel() == 0:
        raise ValueError(f"empty batch: input_ids has shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be int64/int32 token ids, got {ids.dtype}")
    bsz, seq = ids.shape
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and seq > max_pos:
        raise ValueError(f"sequence length {seq} exceeds the model's max_position_embeddings ({max_pos}); to train "
                         f"longer sequences deliberately, set EngineConfig(max_position_embeddings={seq}) (runner: "
                         f"engine.max_position_embeddings={seq}) or use megatrain.spec.with_positions(config, {seq})")
    vocab = config.vocab_size
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}) (vocab_size), got min {lo}, max {hi}")
    for key in ("labels", "attention_mask", "position_ids"):
        value = batch.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (bsz, seq):
            raise ValueError(f"{key} must have the shape of input_ids {(bsz, seq)}, got "
                             f"{tuple(getattr(value, 'shape', ()))}")
    labels = batch.get("labels")
    if labels is not None:
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
        if bool(bad.any()):
            raise ValueError(f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX}")
    if micro_batches > bsz:
        raise ValueError(f"cannot split a batch of {bsz} rows into {micro_batches} micro-batches")
