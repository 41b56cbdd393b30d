"""Deterministic synthetic batches: the same token ids for every system that asks with the same seed.

Throughput runs only need realistic shapes; parity runs need every system to see identical data.
"""
from __future__ import annotations

import torch


def synthetic_batch(vocab_size: int, batch_size: int, seq_len: int, seed: int, step: int = 0) -> dict[str, torch.Tensor]:
    """One batch of uniform random token ids (labels = input_ids), reproducible from (seed, step)."""
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} x {seq_len}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def synthetic_batches(vocab_size: int, batch_size: int, seq_len: int, seed: int, steps: int):
    """``steps`` batches; batch i is ``synthetic_batch(..., step=i)``."""
    for i in range(steps):
        yield synthetic_batch(vocab_size, batch_size, seq_len, seed, i)
