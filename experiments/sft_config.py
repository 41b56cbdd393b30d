"""The SFT task of a sweep (``sweep.sft``; null for the throughput sweeps): which pretrained model, which
generated task, how often to evaluate. Torch-free (the runner's hydra schema)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass
class SFTConfig:
    """A sweep with ``sft`` set fine-tunes a pretrained model on a generated arithmetic task instead of
    timing steps on random tokens (``experiments/sft_point.py``). Run-level ``steps`` = optimizer steps,
    ``batch_size`` = examples per step (one per row, right-padded to ``seq_len``), ``optim`` = AdamW and its
    schedule, ``seed`` = the order of the training examples; ``warmup_steps`` only leaves the first steps
    out of the step-time statistics (they are trained)."""

    # The model: a GGUF file (converted once into the init cache, megatrain/gguf_import.py) or an HF folder.
    gguf: Optional[str] = None
    model_dir: Optional[str] = None
    # The task (experiments/sft_task.py): "What is a <op> b?" -> the exact integer.
    op: str = "add"
    digits: int = 3
    digits2: Optional[int] = None
    n_train: int = 20000
    n_eval: int = 500
    task_seed: int = 0  # the problems (the same for every system); the run's seed orders the batches
    system_prompt: Optional[str] = "Answer with the number only."
    pack: bool = False  # several examples per row (position_ids restart per example) instead of padding
    # Evaluation (megatrain/sft.py Evaluator, one plain fp32 HF model for every system)
    eval_every: int = 25  # held-out loss every N steps (and at 0 and the end)
    accuracy_every: int = 50  # greedy accuracy every N steps (and at 0 and the end); 0 = only at 0 and the end
    max_new_tokens: int = 32
    gen_batch: int = 500
    eval_batch: int = 128


def problem(sft: dict | None) -> str | None:
    """Why a sweep's ``sft`` task cannot run (checked by the runner, ``experiments.sweeps.invalid_reason``,
    before anything starts); None if it can."""
    try:
        cfg = SFTConfig(**(sft or {}))
    except TypeError as e:
        return f"sweep.sft: {e}"
    if bool(cfg.gguf) == bool(cfg.model_dir):
        return "sweep.sft: set exactly one of gguf (a .gguf file) and model_dir (an HF folder)"
    src = Path(cfg.gguf or cfg.model_dir)
    if not src.exists():
        hint = " (bash scripts/ship_gguf.sh split, or join on the device)" if cfg.gguf else ""
        return f"sweep.sft: {src} does not exist{hint}"
    if cfg.eval_every < 1 or cfg.accuracy_every < 0 or cfg.n_eval < 1 or cfg.n_train < 1:
        return "sweep.sft: eval_every, n_eval and n_train must be >= 1, accuracy_every >= 0"
    return None
