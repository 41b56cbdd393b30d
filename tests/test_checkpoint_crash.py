"""Saving is crash-proof: a process killed (SIGKILL) at any moment of a save leaves ``path`` holding a
loadable checkpoint (the previous or the new one). And the host-memory plan matches measured RSS."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from megatrain import MegaTrain, ModelSpec

from test_engine_parity import batches, engine_cfg

TESTS = str(Path(__file__).resolve().parent)
SAVER = f"""
import sys
sys.path.insert(0, {TESTS!r})
from megatrain import MegaTrain, PRESETS
from test_engine_parity import batches, engine_cfg
spec = PRESETS["tiny-llama"]
engine = MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(), verbose=False)
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


def test_save_killed_at_random_moments_always_leaves_a_loadable_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    rng = random.Random(0)
    for attempt in range(5):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(path)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "READY"
            time.sleep(rng.uniform(0.0, 0.6))  # somewhere inside the save loop: mid-write, mid-switch, ...
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        engine = MegaTrain.load(path, verbose=False)
        assert engine.step_count >= 1
        r = engine.step(batches(engine_spec(), steps=1)[0])  # resumes and trains
        assert r.loss == r.loss
        engine.close()
        # at most the current version and one left-over of the killed save
        leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.v")]
        assert len(leftovers) <= 2, leftovers


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
