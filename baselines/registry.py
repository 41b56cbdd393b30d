"""``build_system(name, ...)``: one entry point for the engine and every baseline, imported lazily."""
from __future__ import annotations

import importlib

import torch

from megatrain.system import OptimConfig, TrainSystem

from .common import oom_guard

SYSTEMS = ("megatrain", "zero3", "fsdp", "gemini", "native")

_MODULES = {
    "megatrain": "baselines.megatrain_system",
    "zero3": "baselines.zero3",
    "fsdp": "baselines.fsdp",
    "gemini": "baselines.gemini",
    "native": "baselines.native",
}


def build_system(name: str, *, init_dir, optim: OptimConfig, micro_batches: int = 1, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16, activation_checkpointing: bool = True,
                 options: dict | None = None) -> TrainSystem:
    """Build system ``name`` from the ``save_pretrained`` folder ``init_dir``.

    ``options`` holds the system's own knobs (each module's ``OPTIONS`` lists them; unknown keys raise).
    Running out of GPU or host memory while building raises ``baselines.OutOfMemory`` (``.kind`` is
    "gpu" or "host"); the baselines raise it from ``step`` too.
    """
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; choose one of: {', '.join(SYSTEMS)}")
    module = importlib.import_module(_MODULES[name])
    with oom_guard(name, "build"):
        return module.build(init_dir=init_dir, optim=optim, micro_batches=micro_batches, device=device,
                            dtype=dtype, activation_checkpointing=activation_checkpointing, options=options)
