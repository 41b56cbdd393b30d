"""scripts/busy_by_path.py on committed H100 rows (814484a, 7B pure streaming 8x1024, clipping firing): the
hybrid's steps whose update had no GPU-path group against its split steps and the CPU path's process. A step's
busy time measures the update routed in the step before; paired with the step's own routing (before
2026-12-07d) a lone CPU-only trial showed a split update's busy, which led to EngineConfig.pin_host_state
(results/update_path_pinning_h100_2026-12-07.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import busy_by_path  # noqa: E402

SWEEP = ROOT / "results/update_path_814484a_h100_d"


def test_the_hybrids_cpu_only_steps_against_the_cpu_paths_process():
    rows = {r["point"]: r for r in map(busy_by_path.summarise, busy_by_path.points([SWEEP])) if r}
    cpu, hybrid = rows["qwen2.5-7b streaming_cpu_pinned"], rows["qwen2.5-7b streaming_hybrid"]
    assert cpu["split"] is None and cpu["cpu"][2] == 9  # steps 1-9: the CPU kernel alone in every one
    # The hybrid's one all-CPU update (routed in step 1, run in step 2) took the CPU path's time; its split
    # updates 20 % less busy (the GPU path took 12 of 30 groups) and a 14 % shorter step.
    assert cpu["cpu"][0] == pytest.approx(1.978, abs=0.01) and hybrid["cpu"][0] == pytest.approx(1.95, abs=0.01)
    assert hybrid["cpu"][2] == 1 and hybrid["split"][2] == 8
    assert hybrid["split"][0] == pytest.approx(1.58, abs=0.01) and hybrid["split"][1] == pytest.approx(2.23, abs=0.01)
    assert hybrid["tflops"] == pytest.approx(171.6, abs=0.1) and cpu["locked_gib"] == pytest.approx(28.6, abs=0.1)


def test_a_steps_busy_goes_with_the_routing_of_the_step_before(tmp_path):
    point = tmp_path / "megatrain__m__L1__w1__s8__b1__v__cpu"
    point.mkdir()
    routed = [0, 5, 0, 5, 5]  # GPU-path groups routed in steps 0-4
    busy = [0.0, 2.0, 1.0, 2.0, 1.0]  # step N ran step N-1's update: all-CPU ones take 2.0, split ones 1.0
    steps = [dict(step=i, step_time_s=1.0 + b, phases=dict(host_update_busy_s=b, gpu_path_groups=g))
             for i, (g, b) in enumerate(zip(routed, busy))]
    (point / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    r = busy_by_path.summarise(point)
    assert r["cpu"] == (2.0, 3.0, 2) and r["split"] == (1.0, 2.0, 2)


def test_speculative_and_first_steps_are_left_out(tmp_path):
    point = tmp_path / "megatrain__m__L1__w1__s8__b1__v__cpu"
    point.mkdir()
    steps = [dict(step=0, step_time_s=9.0, phases=dict(host_update_busy_s=0.0, gpu_path_groups=0)),
             dict(step=1, step_time_s=2.0, phases=dict(host_update_busy_s=1.0, gpu_path_groups=0, speculated=1)),
             dict(step=2, step_time_s=3.0, phases=dict(host_update_busy_s=1.5, gpu_path_groups=2)),
             dict(step=3, step_time_s=4.0, phases=dict(host_update_busy_s=2.5, gpu_path_groups=0)),
             dict(step=5, step_time_s=5.0, phases=dict(host_update_busy_s=3.5, gpu_path_groups=0))]  # 4 missing
    (point / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    r = busy_by_path.summarise(point)
    # step 1 speculated, step 2 ran a speculative step's update: only step 3 (step 2's split update) counts
    assert r["cpu"] is None and r["split"] == (2.5, 4.0, 1) and r["point"] == "m v" and r["tflops"] is None


def test_cli_prints_a_table_and_exits_nonzero_with_nothing(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts/busy_by_path.py"), str(SWEEP)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "qwen2.5-7b streaming_hybrid" in run.stdout and "locked GiB" in run.stdout
    empty = subprocess.run([sys.executable, str(ROOT / "scripts/busy_by_path.py"), str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 1 and "no point with steps" in empty.stderr
