"""Fake training systems for the runner tests, plus the config files that expose them to the runner.

The runner's point process loads ``fake_system`` from this file through a system config's ``factory``
("/path/to/this/file.py:fake_system"); ``options.behavior`` picks what it does. ``write_test_conf``
writes ``system/_test_<behavior>.yaml`` and a ``sweep/_test.yaml`` into a folder that the tests add to
hydra's search path (``hydra.searchpath=[file://...]``): the fakes exist only in tests.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

BEHAVIORS = ("ok", "crash", "gpu_oom", "host_oom", "sigkill", "hang")
# configs written, but not in the default _test sweep: "hang_late" hangs at its 5th step; "settle" says it is
# still choosing how to run (``choosing``) until it has run 4 steps; "cold" says after its 2nd to 4th steps that the
# step just run was a transient (``transient``)
EXTRA_BEHAVIORS = ("hang_late", "settle", "cold")


class OutOfMemory(RuntimeError):
    """Same name and ``kind`` attribute as ``baselines.common.OutOfMemory``."""

    def __init__(self, msg: str, kind: str):
        super().__init__(msg)
        self.kind = kind


class FakeSystem:
    def __init__(self, name, init_dir, optim, micro_batches=1, device="cpu", dtype=None,
                 activation_checkpointing=True, options=None):
        self.name = name
        self.behavior = (options or {}).get("behavior", "ok")
        assert Path(init_dir, "config.json").is_file(), "the runner must hand over the initial weights"
        self.steps = 0

    def step(self, batch):
        import torch

        from megatrain.system import StepResult

        b = self.behavior
        if b == "crash":
            raise RuntimeError("injected failure\nwith a second line")
        if b == "gpu_oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
        if b == "host_oom":
            raise OutOfMemory("host RAM exhausted (injected)", kind="host")
        if b == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if (b == "hang" and self.steps >= 1) or (b == "hang_late" and self.steps >= 4):
            time.sleep(3600)
        self.steps += 1
        time.sleep(0.01)
        ids = batch["input_ids"]
        return StepResult(loss=5.0 - 0.1 * self.steps, tokens=int(ids.numel()), step_time_s=0.01)

    def choosing(self) -> str:
        return "fake: measuring a trial" if self.behavior == "settle" and self.steps < 4 else ""

    def transient(self) -> str:
        return "fake: a cold update" if self.behavior == "cold" and 2 <= self.steps <= 4 else ""

    def memory(self):
        from megatrain.system import MemoryStats

        return MemoryStats(host_pinned=1 << 20)

    def close(self):
        pass


def fake_system(name, **kwargs):
    return FakeSystem(name, **kwargs)


def write_test_conf(root: Path, *, systems=BEHAVIORS, timeout_s: float = 20) -> Path:
    """A conf folder with ``system/_test_<b>.yaml`` for each behavior and ``sweep/_test.yaml``."""
    conf = Path(root)
    (conf / "system").mkdir(parents=True, exist_ok=True)
    (conf / "sweep").mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve()
    for b in BEHAVIORS + EXTRA_BEHAVIORS:
        (conf / "system" / f"_test_{b}.yaml").write_text(
            f"name: _test_{b}\nfactory: '{here}:fake_system'\noptions:\n  behavior: {b}\n")
    names = ", ".join(f"_test_{b}" for b in systems)
    (conf / "sweep" / "_test.yaml").write_text(f"""# @package _global_
defaults:
  - override /model: tiny-qwen2
sweep:
  name: _test
  systems: [{names}]
device: cpu
steps: 2
warmup_steps: 1
seq_len: 16
batch_size: 2
timeout_s: {timeout_s}
""")
    return conf


def test_fake_behaviors_are_classified_as_the_runner_expects():
    import torch

    from baselines.oom import failure_status as classify
    from experiments.point_frame import error_text

    assert classify(RuntimeError("x")) == "error"
    assert classify(torch.OutOfMemoryError("CUDA out of memory.")) == "gpu_oom"
    assert classify(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")) == "gpu_oom"
    assert classify(OutOfMemory("no", kind="gpu")) == "gpu_oom"
    assert classify(OutOfMemory("no", kind="host")) == "host_oom"
    assert classify(MemoryError("model does not fit in host RAM")) == "host_oom"
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except Exception as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as wrapped:
        assert classify(wrapped) == "gpu_oom"
    assert error_text(RuntimeError("a\nb")) == "RuntimeError: a b"
