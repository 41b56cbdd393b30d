"""The all-on-GPU system's best configuration that fits: measured by a short probe, not guessed.

A user comparing against "everything on the GPU" would not keep HF activation checkpointing on where
the activations fit without it, nor split the step into more micro-batches than memory needs: at 3B,
16×1024 on the H200, HF *without* checkpointing in 2 micro-batches ran 381 TFLOPS against 321 with
checkpointing in one. ``choose_config`` tries, on the real step shape:

1. no checkpointing with 1, 2, 4, ... micro-batches, from the run's own ``micro_batches`` up (a run that
   asks for a split keeps at least that split), the largest micro-batch first; the first that fits is
   kept: more micro-batches only add launches and smaller matmuls;
2. checkpointing with 1, 2, 4, ... micro-batches the same way (skipped when no-checkpointing fitted in
   one micro-batch: recompute could only add time then);

each candidate running ``probe_steps`` whole steps (forward, backward, clipping, AdamW; the last one
timed). A CUDA out-of-memory error ends that candidate cleanly (the exception and its frames are
dropped, gradients and optimizer state freed, the allocator's cache emptied) and the next one runs.
The fastest candidate that fitted wins.

Probing does not change training: the probe steps run with learning rate 0 (AdamW's update and its
decoupled weight decay are both multiplied by it, so every weight stays bit-identical), then the
optimizer's state (m, v, step count) is cleared and the gradients dropped, so the first real step starts
exactly where a run without probing would. The candidates, their step times and their failures go to
the system's ``info`` (``settings["auto_config"]``), so the row says which configuration won and why.
"""
from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass

import torch

from .oom import classify_oom


@dataclass
class Candidate:
    """One configuration tried: its result is ``status`` ok (``step_s`` measured), gpu_oom, or skipped."""

    activation_checkpointing: bool
    micro_batches: int
    status: str = "untried"
    step_s: float | None = None
    detail: str = ""

    @property
    def key(self) -> str:
        return f"{'ckpt' if self.activation_checkpointing else 'no_ckpt'}/mb{self.micro_batches}"


def micro_batch_choices(rows: int, limit: int = 64, least: int = 1) -> list[int]:
    """``least``, 2×``least``, 4×``least``, ... up to the batch's row count (each micro-batch keeps at least
    one row). ``least`` is the run's own split: a run that asks for 2 micro-batches (micro-batches of at most
    half the rows, e.g. to measure another summation order) is never probed into one."""
    out, m = [], max(1, int(least))
    while m <= min(rows, limit):
        out.append(m)
        m *= 2
    return out


def probe_batch(rows: int, seq: int, vocab: int, device: torch.device, seed: int = 1234) -> dict:
    """Random tokens of the step's shape (the probe's values do not matter: lr is 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    return {"input_ids": ids.to(device)}


class _LearningRateZero:
    """Every param group's lr set to 0.0 inside the block, restored after (even on an exception)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.saved: list = []

    def __enter__(self):
        self.saved = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0 if not torch.is_tensor(g["lr"]) else torch.zeros_like(g["lr"])
        return self

    def __exit__(self, *exc):
        for g, lr in zip(self.optimizer.param_groups, self.saved):
            g["lr"] = lr
        return False


def _recover(system) -> None:
    """After an out-of-memory error: drop gradients and optimizer state, collect the exception's frames,
    give the allocator's cache back (so the next candidate starts from a clean GPU)."""
    system.optimizer.zero_grad(set_to_none=True)
    system.optimizer.state.clear()
    gc.collect()
    if system.device.type == "cuda":
        torch.cuda.synchronize(system.device)
        torch.cuda.empty_cache()


def _try(system, cand: Candidate, batch: dict, steps: int) -> None:
    """Run ``steps`` probe steps of ``cand`` on ``batch``; fills cand.status / step_s / detail."""
    system.set_activation_checkpointing(cand.activation_checkpointing)
    system.micro_batches = cand.micro_batches
    oom = ""
    try:
        with _LearningRateZero(system.optimizer):
            for _ in range(steps):
                if system.device.type == "cuda":
                    torch.cuda.synchronize(system.device)
                t0 = time.perf_counter()
                system.train_step(batch, probe=True)
                if system.device.type == "cuda":
                    torch.cuda.synchronize(system.device)
                cand.step_s = time.perf_counter() - t0
        cand.status = "ok"
    except Exception as exc:  # noqa: BLE001 - only out-of-memory is a result; anything else re-raises
        if classify_oom(exc) != "gpu":
            raise
        oom = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    # Out of the except block: the exception (and the activations its frames hold) is gone now.
    if oom:
        cand.status, cand.step_s, cand.detail = "gpu_oom", None, oom
        _recover(system)


def choose_config(system, rows: int, seq: int, vocab: int, *, steps: int = 2,
                  micro_batches: list[int] | None = None, least: int = 1) -> dict:
    """Probe the candidates on a (rows x seq) batch, leave ``system`` set to the winner, return the record
    for ``info`` (winner, every candidate tried, the probe's wall time). Raises the system's OutOfMemory
    (kind gpu) when no candidate fits."""
    from .oom import OutOfMemory

    if steps < 1:
        raise ValueError(f"auto_config probe_steps must be >= 1, got {steps}")
    choices = [m for m in (micro_batches or micro_batch_choices(rows, least=least)) if 1 <= m <= rows]
    if not choices:
        raise ValueError(f"no micro-batch count in {micro_batches} fits a batch of {rows} rows")
    batch = probe_batch(rows, seq, vocab, system.device)
    tried: list[Candidate] = []
    t_start = time.perf_counter()
    for ckpt in (False, True):
        if ckpt and tried and tried[-1].status == "ok" and tried[-1].micro_batches == choices[0] \
                and not tried[-1].activation_checkpointing:
            tried.append(Candidate(True, choices[0], "skipped",
                                   detail=f"no checkpointing fitted in {choices[0]} micro-batch(es), the fewest "
                                          "tried; recompute can only add time"))
            break
        for mb in choices:
            cand = Candidate(ckpt, mb)
            tried.append(cand)
            _try(system, cand, batch, steps)
            if cand.status == "ok":
                break  # the largest micro-batch that fits: more micro-batches only cost launches
    # The probe leaves no trace in training: no optimizer state, no gradients, a clean allocator.
    _recover(system)
    fitted = [c for c in tried if c.status == "ok"]
    record = {"winner": None, "candidates": [asdict(c) | {"key": c.key} for c in tried],
              "probe_s": round(time.perf_counter() - t_start, 3), "probe_steps": steps,
              "probe_shape": [rows, seq]}
    if not fitted:
        raise OutOfMemory("gpu", "no configuration fits: " + "; ".join(f"{c.key} {c.detail}" for c in tried),
                          system=system.name, phase="auto_config")
    best = min(fitted, key=lambda c: c.step_s)
    system.set_activation_checkpointing(best.activation_checkpointing)
    system.micro_batches = best.micro_batches
    record["winner"] = best.key
    return record
