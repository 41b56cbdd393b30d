"""MegaTrain: full-precision LLM training on one GPU with host RAM as the home of the model.

``megatrain.config`` / ``megatrain.system`` / ``megatrain.spec`` import without torch (the runner uses
their dataclasses as its config schemas); the engine, and torch with it, is imported on first use of
``megatrain.MegaTrain``.
"""
from .config import EngineConfig
from .spec import PRESETS, ModelSpec, get_preset
from .system import MemoryStats, OptimConfig, StepResult, TrainSystem, step_flops

__all__ = ["DoesNotFit", "EngineConfig", "MegaTrain", "MemoryStats", "ModelSpec", "OptimConfig", "PRESETS", "StepResult",
           "TrainSystem", "get_preset", "step_flops"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "MegaTrain":  # lazy: importing the engine imports torch
        from .engine import MegaTrain

        return MegaTrain
    if name == "DoesNotFit":  # the plan's one-line refusal (a MemoryError)
        from .placement import DoesNotFit

        return DoesNotFit
    raise AttributeError(f"module 'megatrain' has no attribute {name!r}")
