"""A fake training system for tests/test_baselines_zenflow.py that starts a "spawn" child at build time, as
ZenFlow's optimizer process and SuperOffload's worker do. The point process loads it as a system
``factory``; it imports nothing from the tests (the point process cannot)."""
from __future__ import annotations

import os
import signal
from pathlib import Path


class SpawningSystem:
    """Starts a child with the "spawn" method at build (as ZenFlow's optimizer process and SuperOffload's
    worker do). The child touches ``<point_dir>/child_ran`` (target: a stdlib method, importable in any
    child). ``options.kill_at``: SIGKILL itself at that step (a host OOM kill, after the build)."""

    def __init__(self, name, init_dir, optim, micro_batches=1, device="cpu", dtype=None,
                 activation_checkpointing=True, options=None):
        import multiprocessing as mp

        opts = options or {}
        self.name, self.kill_at, self.steps = name, opts.get("kill_at"), 0
        flag = Path(opts["flag_dir"]) / f"child_ran_{os.getpid()}"
        child = mp.get_context("spawn").Process(target=Path.touch, args=(flag,), daemon=True)
        child.start()
        child.join(timeout=120)
        assert child.exitcode == 0, f"spawned child failed with exit code {child.exitcode}"
        self.info = {"optimizer": "fake", "settings": {"exact_adamw": False, "update_interval": 4}}

    def step(self, batch):
        from megatrain.system import StepResult

        if self.kill_at is not None and self.steps >= self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.steps += 1
        return StepResult(loss=5.0, tokens=int(batch["input_ids"].numel()), step_time_s=0.01)

    def memory(self):
        from megatrain.system import MemoryStats

        return MemoryStats()

    def close(self):
        pass


def spawning_system(name, **kwargs):
    return SpawningSystem(name, **kwargs)
