"""Saving is crash-proof: a process killed (SIGKILL) at any moment of a save leaves ``path`` holding a
loadable checkpoint (the previous or the new one). And the host-memory plan matches measured RSS."""
from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from megatrain import MegaTrain, ModelSpec
from megatrain import checkpoint_layout

from test_engine_parity import batches, engine_cfg

TESTS = str(Path(__file__).resolve().parent)
SAVER = f"""
import sys
sys.path.insert(0, {TESTS!r})
from megatrain import MegaTrain, PRESETS
from test_engine_parity import batches, engine_cfg
spec = PRESETS["tiny-llama"]
engine = MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(keep_checkpoints=2), verbose=False)
data = batches(spec, steps=2)
engine.step(data[0])
engine.save(sys.argv[1])
print("READY", flush=True)
i = 0
while True:  # save after save, until killed
    engine.step(data[i % 2])
    engine.save(sys.argv[1])
    i += 1
"""
CHILD_START_S = 300  # import torch + build a tiny engine + one step and save, on 2 busy cores


def read_line(proc, timeout: float, log: Path) -> str:
    """The child's first stdout line, waiting at most ``timeout`` s (a child stuck anywhere fails the test,
    never hangs it); its stderr is in ``log``."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline, buf = time.monotonic() + timeout, b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
            raise AssertionError(f"no line from the saver within {timeout:.0f} s; its stderr: {log.read_text()[-2000:]}")
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            raise AssertionError(f"the saver exited ({proc.wait(timeout=30)}) before READY: {log.read_text()[-2000:]}")
        buf += chunk
    return buf.decode().splitlines()[0]


@pytest.mark.timeout(CHILD_START_S * 5 + 300)
def test_save_killed_at_random_moments_always_leaves_a_loadable_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    (tmp_path / "notes.txt").write_text("beside the checkpoint")
    rng = random.Random(0)
    env = {**os.environ, "MEGATRAIN_HOST_ADAMW": "torch"}  # the saving is under test, not the kernel build
    for attempt in range(5):
        log = tmp_path / f"saver-{attempt}.log"
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-c", SAVER, str(path)], stdout=subprocess.PIPE, stderr=err,
                                    env=env)
        try:
            assert read_line(proc, CHILD_START_S, log) == "READY"
            time.sleep(rng.uniform(0.0, 0.6))  # somewhere inside the save loop: mid-write, mid-switch, ...
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            proc.stdout.close()
        engine = MegaTrain.load(path, verbose=False)
        assert engine.step_count >= 1
        r = engine.step(batches(engine_spec(), steps=1)[0])  # resumes and trains
        assert r.loss == r.loss
        engine.close()
        # The checkpoint is a real folder; nothing was written beside it; inside it: the kept saves (2, plus
        # one more when the kill fell between a step folder's rename and the switch of latest), the pointer,
        # the marker and at most one left-over of the killed save (swept by the next save).
        assert path.is_dir() and not path.is_symlink()
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("saver-")) == ["ckpt", "notes.txt"]
        done = checkpoint_layout.steps(path)
        assert 1 <= len(done) <= 3 and checkpoint_layout.resolve(path) in done
        others = [p.name for p in path.iterdir()
                  if p not in done and p.name not in ("latest", checkpoint_layout.ROOT_MARKER)]
        assert len(others) <= 1 and all(".tmp-" in n or ".del-" in n for n in others), others


def engine_spec():
    from megatrain import PRESETS

    return PRESETS["tiny-llama"]


def test_host_plan_matches_measured_rss():
    """Pure streaming on CPU: RSS growth when the engine is built = the plan's host tier (12 B/param and
    the init staging of one group) plus the parts of its device working set allocated at build (slots, embedding/head compute copies; on a
    CPU run the "device" is host memory), within 5 %."""
    spec = ModelSpec("qwen2", 1024, 8, 8, 2, 4096, 32000, tie_embeddings=False, name="rss-check")
    tiny = MegaTrain.from_config(ModelSpec(name="warm").to_hf_config("eager"), engine_cfg(), verbose=False)
    tiny.close()  # imports and one-time allocations happen here, not in the measurement
    del tiny
    proc = psutil.Process()
    before = proc.memory_info().rss
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(micro_batches=1), verbose=False)
    grown = proc.memory_info().rss - before
    plan = engine.placement
    assert plan.host_parts["host_tier_state"] == 12 * sum(g.numel for g in engine.groups)
    predicted = plan.host_parts["host_tier_state"] + plan.host_parts["io_staging"] + sum(plan.gpu_parts[k] for k in ("slots", "resident_compute", "staging"))
    assert abs(grown - predicted) <= 0.05 * predicted, (grown / 2**30, predicted / 2**30)
    engine.close()
