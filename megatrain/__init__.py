"""MegaTrain: full-precision LLM training on one GPU with host RAM as the home of the model."""
from .config import EngineConfig
from .engine import MegaTrain
from .spec import PRESETS, ModelSpec, get_preset
from .system import MemoryStats, OptimConfig, StepResult, TrainSystem, step_flops

__all__ = ["EngineConfig", "MegaTrain", "MemoryStats", "ModelSpec", "OptimConfig", "PRESETS", "StepResult",
           "TrainSystem", "get_preset", "step_flops"]
__version__ = "0.1.0"
