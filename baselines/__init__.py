"""The training systems compared against the engine, behind the shared ``TrainSystem`` interface.

Importing this package imports neither torch, DeepSpeed nor ColossalAI: each system's module is
imported when ``build_system`` is asked for it (``baselines.registry`` holds one record per system).
"""
from .oom import OutOfMemory, classify_oom, failure_status, oom_guard
from .registry import SYSTEM_RECORDS, SYSTEMS, build_system, record

__all__ = ["SYSTEMS", "SYSTEM_RECORDS", "build_system", "record", "OutOfMemory", "classify_oom",
           "failure_status", "oom_guard"]
