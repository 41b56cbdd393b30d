"""The training systems compared against the engine, behind the shared ``TrainSystem`` interface.

Importing this package imports neither DeepSpeed nor ColossalAI: each system's module is imported when
``build_system`` is asked for it.
"""
from .common import OutOfMemory, classify_oom, oom_guard
from .registry import SYSTEMS, build_system

__all__ = ["SYSTEMS", "build_system", "OutOfMemory", "classify_oom", "oom_guard"]
