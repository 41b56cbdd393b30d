"""scripts/busy_by_path.py on committed H100 rows (814484a, 7B pure streaming 8x1024, clipping firing): the
hybrid's steps with no GPU-path group against its split steps and the CPU path's process, the comparison that
led to EngineConfig.pin_host_state (results/update_path_pinning_h100_2026-12-07.md)."""
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
    assert cpu["cpu"][0] == pytest.approx(1.978, abs=0.01) and hybrid["cpu"][0] == pytest.approx(1.59, abs=0.01)
    assert hybrid["cpu"][2] == 1 and hybrid["split"][2] == 8
    assert hybrid["split"][1] == pytest.approx(2.24, abs=0.01) and hybrid["tflops"] == pytest.approx(171.6, abs=0.1)
    assert cpu["locked_gib"] == pytest.approx(28.6, abs=0.1)


def test_speculative_and_first_steps_are_left_out(tmp_path):
    point = tmp_path / "megatrain__m__L1__w1__s8__b1__v__cpu"
    point.mkdir()
    steps = [dict(step=0, step_time_s=9.0, phases=dict(host_update_busy_s=0.0, gpu_path_groups=0)),
             dict(step=1, step_time_s=2.0, phases=dict(host_update_busy_s=1.0, gpu_path_groups=0, speculated=1)),
             dict(step=2, step_time_s=3.0, phases=dict(host_update_busy_s=1.5, gpu_path_groups=2))]
    (point / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    r = busy_by_path.summarise(point)
    assert r["cpu"] is None and r["split"] == (1.5, 3.0, 1) and r["point"] == "m v" and r["tflops"] is None


def test_cli_prints_a_table_and_exits_nonzero_with_nothing(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts/busy_by_path.py"), str(SWEEP)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "qwen2.5-7b streaming_hybrid" in run.stdout and "locked GiB" in run.stdout
    empty = subprocess.run([sys.executable, str(ROOT / "scripts/busy_by_path.py"), str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 1 and "no point with steps" in empty.stderr
