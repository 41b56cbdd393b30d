"""Issue 9's runner guards, through the command line: runs never write into committed results or
another machine's CSV, impossible points are refused before anything starts, a sweep where nothing
succeeded exits non-zero with a one-line reason, and --help explains the run-control keys."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from experiments import schema  # noqa: E402
from test_runner_fakes import write_test_conf  # noqa: E402


pytestmark = pytest.mark.timeout(600)  # above run_runner's own 300 s bound


def run_runner(*args, cwd=ROOT, timeout=300):
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_help_explains_dry_run_only_redo():
    proc = run_runner("--help", timeout=60)
    assert proc.returncode == 0
    for key in ("dry_run=true", "only=", "redo=true", "results_dir=", "runs/<machine>", "~1 min on 2 CPU cores"):
        assert key in proc.stdout, key


def test_default_results_dir_is_per_machine_and_not_the_committed_one():
    committed = {p: p.stat().st_mtime for p in (ROOT / "results").rglob("*.csv")}
    proc = run_runner("sweep=smoke", "dry_run=true", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "runs/cpu-" in proc.stdout and f"{ROOT / 'results'}/" not in proc.stdout
    assert {p: p.stat().st_mtime for p in (ROOT / "results").rglob("*.csv")} == committed


def test_refuses_to_append_to_another_machines_csv(tmp_path):
    csv = tmp_path / "results" / "smoke" / "results.csv"
    schema.append_row(csv, schema.make_row(sweep="smoke", point="megatrain__x", system="megatrain",
                                           status="ok", gpu_name="NVIDIA H200", hardware="H200"))
    before = csv.read_text()
    proc = run_runner("sweep=smoke", f"results_dir={tmp_path / 'results'}", timeout=120)
    assert proc.returncode == 2
    assert "holds rows measured on NVIDIA H200" in proc.stderr and "mix_machines=true" in proc.stderr
    assert csv.read_text() == before and not (tmp_path / "results" / "plots").exists()


@pytest.mark.parametrize("override, message", [
    ("steps=0", "steps=0"),
    ("seq_len=100000", "set max_position_embeddings=100000"),
    ("gpus=4", "gpus=4"),
    ("device=cuda", "no usable CUDA GPU"),
])
def test_impossible_points_are_refused_before_anything_runs(tmp_path, override, message):
    import torch

    if override == "device=cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_runner("sweep=smoke", override, f"results_dir={tmp_path}", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written, nothing launched


def test_exit_status_is_1_when_no_point_succeeded(tmp_path):
    conf = write_test_conf(tmp_path / "conf", timeout_s=15)
    proc = run_runner("sweep=_test", f"hydra.searchpath=[file://{conf}]", f"results_dir={tmp_path / 'r'}",
                      f"cache_dir={tmp_path / 'cache'}", "only=[_test_crash*,_test_gpu_oom*]", "post=false")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: sweep _test: 1 point(s) failed for a reason other than memory: _test_crash")
    assert "_test_gpu_oom" not in last  # running out of memory is a verdict, not a failure
    rows = schema.read_results(tmp_path / "r" / "_test" / "results.csv")
    assert sorted(rows["status"]) == ["error", "gpu_oom"]  # the rows are still written
    # no point succeeded, none crashed: still a failed sweep, in one line
    proc = run_runner("sweep=_test", f"hydra.searchpath=[file://{conf}]", f"results_dir={tmp_path / 'r2'}",
                      f"cache_dir={tmp_path / 'cache'}", "only=[_test_gpu_oom*]", "post=false")
    assert proc.returncode == 1 and "no point succeeded" in proc.stderr.strip().splitlines()[-1]
    # a selection that matches nothing measured nothing: exit 2, in one line, before anything is written
    proc = run_runner("sweep=_test", f"hydra.searchpath=[file://{conf}]", f"results_dir={tmp_path / 'r3'}",
                      f"cache_dir={tmp_path / 'cache'}", "only=[_test_typo*]", "post=false")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: only=['_test_typo*'] matches none of the sweep's")
    assert not (tmp_path / "r3").exists()


@pytest.mark.parametrize("args, message", [
    (["sweep=nope"], "error: sweep=nope does not exist; valid: ablation, accuracy_sft, activations, baselines"),
    (["model=bogus"], "error: model=bogus does not exist; valid: tiny-llama"),
    (["sweep=ablation", "system.options.gpu_resident=0"], "error: system.* overrides need the system they edit"),
    (["sweep=ablation", "system=megatrain", "system.options.checkpoint_interval=2", "dry_run=true"],
     "clashes with variant 'full' (checkpoint_interval=4)"),
])
def test_config_errors_exit_2_in_one_line(tmp_path, args, message):
    proc = run_runner(*args, f"results_dir={tmp_path}", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())
