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


# -- real text, generated locally -----------------------------------------------------------------
def stdlib_text_bytes(limit: int = 4 << 20) -> bytes:
    """Up to ``limit`` bytes of the Python standard library's own source files (sorted, so the same on
    every machine with the same Python): real text that ships with Python, nothing downloaded."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    text = b"".join(out)[:limit]
    if len(text) < 4096:
        raise RuntimeError(f"found only {len(text)} bytes of Python source under {root}")
    return text


def text_batch(text: bytes, batch_size: int, seq_len: int, seed: int, step: int = 0) -> dict:
    """One batch of byte-level tokens (ids 0..255; labels = input_ids) cut from ``text`` at positions
    drawn reproducibly from (seed, step)."""
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} x {seq_len}")
    if len(text) <= seq_len:
        raise ValueError(f"text of {len(text)} bytes is too short for seq_len {seq_len}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(text) - seq_len, (batch_size,), generator=gen).tolist()
    buf = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    ids = torch.stack([buf[s:s + seq_len] for s in starts]).long()
    return {"input_ids": ids, "labels": ids.clone()}
