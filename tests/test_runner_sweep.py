"""The sweep runner end to end, as users call it: ``python -m experiments.run ...`` in a subprocess.

CPU only. Points run the tiny model; the failure modes use the fake systems of test_runner_fakes.py,
which exist only through a test conf folder on hydra's search path.
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from experiments import schema  # noqa: E402
from test_runner_fakes import write_test_conf  # noqa: E402

# Runner subprocesses: the smoke sweep took > 300 s on 2 cores shared with ~6x their load; one test runs
# the runner up to three times.
pytestmark = pytest.mark.timeout(1200)

SUMMARY = re.compile(r"(\d+) points: (\d+) launched, (\d+) skipped, (\d+) already done")


def run_runner(*args, cwd=ROOT, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    return proc


def summary(proc) -> dict:
    m = SUMMARY.search(proc.stdout)
    assert m, f"no summary line in:\n{proc.stdout}\n{proc.stderr}"
    total, launched, skipped, done = map(int, m.groups())
    return {"points": total, "launched": launched, "skipped": skipped, "done": done}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("init_cache")


@pytest.fixture(scope="module")
def test_conf(tmp_path_factory):
    return write_test_conf(tmp_path_factory.mktemp("conf"), timeout_s=15)


def _by_system(df):
    return {r["system"]: r for _, r in df.iterrows()}


def test_smoke_sweep_end_to_end(tmp_path, cache):
    results = tmp_path / "results"
    proc = run_runner("sweep=smoke", f"results_dir={results}", f"cache_dir={cache}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    csv = results / "smoke" / "results.csv"
    assert schema.read_header(csv) == schema.COLUMNS
    df = schema.read_results(csv)
    rows = _by_system(df)
    assert set(rows) == {"megatrain", "native", "zero3", "fsdp"}
    assert summary(proc)["launched"] == 4
    for name, r in rows.items():
        pdir = results / "smoke" / r["point"]
        assert (pdir / "log.txt").is_file() and (pdir / "result.json").is_file(), name
        assert (pdir / "config.yaml").is_file()
        assert r["status"] in schema.STATUSES
        assert r["hardware"] == "cpu" and r["torch_version"] and r["git_sha"] and r["date"]
    assert (results / "smoke" / "README.md").read_text().count("6·P·T + 12·L·h·s·T") >= 1
    # a figure and a report come out of the sweep, inside its results folder (never into the repo's plots/)
    assert (results / "plots" / "smoke_tokens_per_s.png").stat().st_size > 0
    # quiet: no fontTools subsetting logs (hydra's INFO root logger), progress in tokens/s, not "0.00 TFLOPS"
    out = proc.stdout + proc.stderr
    assert "fontTools" not in out and "subset" not in out.lower(), out[:2000]
    assert len(out.splitlines()) < 60, out
    assert "TFLOPS" not in out and "tokens/s" in out
    point_log = (results / "smoke" / _by_system(schema.read_results(results / "smoke" / "results.csv"))["native"]["point"]
                 / "log.txt").read_text()
    assert "tokens/s" in point_log and "TFLOPS" not in point_log
    assert "## Formulas" in (results / "REPORT.md").read_text()
    # no hydra litter
    assert not (ROOT / "outputs").exists() and not (ROOT / ".hydra").exists()
    assert not list(ROOT.glob("*.log"))
    if importlib.util.find_spec("baselines.registry") is None:
        # the registry has not landed: every row says so, and the sweep still completed
        assert all(r["status"] == "error" and "baselines.registry" in r["error"] for r in rows.values())
        return
    assert all(r["status"] == "ok" for r in rows.values()), {n: r["error"] for n, r in rows.items()}
    native = rows["native"]
    assert native["status"] == "ok", native["error"]
    assert native["steps"] == 3 and native["warmup_steps"] == 1
    assert native["step_time_median_s"] > 0 and native["tflops"] > 0 and native["tokens_per_s"] > 0
    assert native["loss_first"] > 0 and native["host_peak_rss_gib"] > 0
    lines = (results / "smoke" / native["point"] / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["warmup"] is True


def test_engine_through_a_factory_trains_on_cpu(tmp_path, cache):
    """A real system end to end (metrics, formula, memory columns), independent of the registry."""
    results = tmp_path / "results"
    proc = run_runner("sweep=smoke", "system=megatrain", "system.factory=baselines.megatrain_system:build",
                      f"results_dir={results}", f"cache_dir={cache}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (r,) = [r for _, r in schema.read_results(results / "smoke" / "results.csv").iterrows()]
    assert r["status"] == "ok", r["error"]
    assert r["point"] == "megatrain__tiny-qwen2__L4__w1__s32__b4__default__cpu"
    records = [json.loads(l) for l in (results / "smoke" / r["point"] / "metrics.jsonl").read_text().splitlines()]
    assert [x["warmup"] for x in records] == [True, False, False, False]
    times = sorted(x["step_time_s"] for x in records[1:])
    assert r["step_time_median_s"] == pytest.approx(times[1], rel=1e-4)
    p, t = r["num_params"], r["tokens_per_step"]
    flops = 6 * p * t + 12 * r["num_layers"] * r["hidden_size"] * r["seq_len"] * t
    assert r["tflops"] == pytest.approx(flops / r["step_time_median_s"] / 1e12, rel=1e-3)
    assert r["loss_first"] == pytest.approx(records[0]["loss"], rel=1e-5)
    # the engine's phase timers go with every step (the host_side sweep's "why" needs them)
    for x in records:
        ph = x["phases"]
        assert {"forward_s", "backward_s", "optimizer_exposed_s", "h2d_loads"} <= set(ph), ph
        assert 0 <= ph["forward_s"] + ph["backward_s"] <= x["step_time_s"] * 1.05
    assert r["loss_last"] == pytest.approx(records[-1]["loss"], rel=1e-5)
    assert r["host_bytes_per_param"] == pytest.approx(r["host_peak_rss_gib"] * 2**30 / p, rel=1e-3)
    assert r["host_estimate_gib"] > 0


def test_failures_become_rows_and_the_sweep_goes_on_then_resume_and_redo(tmp_path, cache, test_conf):
    results = tmp_path / "results"
    common = ["sweep=_test", f"hydra.searchpath=[file://{test_conf}]", f"results_dir={results}",
              f"cache_dir={cache}"]
    proc = run_runner(*common)
    # the crash and the hang are failures (exit 1, named on the last line); OOMs are memory verdicts
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "2 point(s) failed for a reason other than memory" in last and "_test_crash" in last and "_test_hang" in last
    assert "_test_gpu_oom" not in last and "_test_host_oom" not in last and "_test_sigkill" not in last
    assert summary(proc) == {"points": 6, "launched": 6, "skipped": 0, "done": 0}
    csv = results / "_test" / "results.csv"
    rows = _by_system(schema.read_results(csv))
    status = {k: r["status"] for k, r in rows.items()}
    assert status == {"_test_ok": "ok", "_test_crash": "error", "_test_gpu_oom": "gpu_oom",
                      "_test_host_oom": "host_oom", "_test_sigkill": "host_oom", "_test_hang": "timeout"}
    assert rows["_test_crash"]["error"] == "RuntimeError: injected failure with a second line"
    assert "CUDA out of memory" in rows["_test_gpu_oom"]["error"]
    assert rows["_test_sigkill"]["error"].startswith("host_oom_killed")
    assert "timeout" in rows["_test_hang"]["error"]
    ok = rows["_test_ok"]
    assert ok["loss_first"] == pytest.approx(4.9) and ok["loss_last"] == pytest.approx(4.7)
    assert ok["host_pinned_gib"] == pytest.approx(1 / 1024)
    # the hung point's first step was recorded before it was killed
    hang = rows["_test_hang"]
    assert hang["loss_first"] == pytest.approx(4.9) and pd_isna(hang["tflops"])
    assert len((results / "_test" / hang["point"] / "metrics.jsonl").read_text().splitlines()) == 1

    # rerun: done points are skipped, failed ones retried
    proc = run_runner(*common, "only=[_test_ok*,_test_crash*]")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the crash, retried, crashed again
    assert summary(proc) == {"points": 2, "launched": 1, "skipped": 0, "done": 1}
    df = schema.read_results(csv)
    assert len(df) == 7 and df.iloc[-1]["system"] == "_test_crash"

    # redo=true re-runs done points too
    proc = run_runner(*common, "only=[_test_ok*]", "redo=true")
    assert summary(proc) == {"points": 1, "launched": 1, "skipped": 0, "done": 0}
    df = schema.read_results(csv)
    assert len(df) == 8 and df.iloc[-1]["system"] == "_test_ok" and df.iloc[-1]["status"] == "ok"


def pd_isna(x) -> bool:
    import pandas as pd

    return bool(pd.isna(x))


def test_points_over_host_ram_are_skipped_without_launching(tmp_path):
    results = tmp_path / "results"
    proc = run_runner("sweep=size", "only=[megatrain__gpt-oss-120b-dense*,zero3__gpt-oss-120b-dense*]",
                      f"results_dir={results}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary(proc) == {"points": 2, "launched": 0, "skipped": 2, "done": 0}
    df = schema.read_results(results / "size" / "results.csv")
    assert list(df["status"]) == ["skipped", "skipped"]
    assert df["error"].str.contains("engine host estimate").all()
    assert (df["host_estimate_gib"] > 1000).all()
    assert not (results / "size" / df.iloc[0]["point"]).exists()  # nothing was started


@pytest.mark.parametrize("override, expected", [
    ("sweep=nope", ["error: sweep=nope does not exist; valid:", "smoke", "size", "ablation"]),
    ("system=nope", ["error: system=nope does not exist; valid:", "megatrain", "zero3", "fsdp", "gemini", "native"]),
    ("foo=1", ["Unknown config key 'foo'", "steps", "batch_size", "results_dir"]),
    ("sweep.sytems=[megatrain]", ["'sytems' is not a key of 'sweep'", "systems", "seq_lens"]),
])
def test_bad_overrides_fail_fast_and_list_the_choices(tmp_path, override, expected):
    args = [override] if override.startswith("sweep=") else ["sweep=smoke", override]
    proc = run_runner(*args, f"results_dir={tmp_path}", timeout=60)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    for text in expected:
        assert text in out, out
    assert not list(tmp_path.iterdir())  # nothing ran


def test_a_point_that_times_out_late_keeps_the_steps_it_finished(tmp_path, cache, test_conf):
    """Nothing measured is lost: a point that hangs after 3 of its 4 timed steps times out, and its row is an
    ok row of those 3 steps (reason "partial", the timeout in error) that a rerun retries."""
    results = tmp_path / "results"
    proc = run_runner("sweep=_test", f"hydra.searchpath=[file://{test_conf}]", f"results_dir={results}",
                      f"cache_dir={cache}", "sweep.systems=[_test_hang_late]", "steps=4", "warmup_steps=1", "timeout_s=25")
    csv = results / "_test" / "results.csv"
    (r,) = [r for _, r in schema.read_results(csv).iterrows()]
    assert r["status"] == "ok" and r["reason"] == "partial", (r["status"], r["error"], proc.stdout + proc.stderr)
    assert r["steps"] == 4 and r["timed_steps"] == 3 and r["tokens_per_s"] > 0 and r["step_time_median_s"] > 0
    assert r["error"].startswith("partial: 3 of 4 timed steps finished before the point process exceeded 25s")
    assert "a rerun retries it" in r["error"]
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a partial row is a result, not a failure
    status = schema.point_status(csv)
    assert status == {r["point"]: "partial"} and "partial" not in schema.DONE_STATUSES


@pytest.mark.parametrize("behavior, said", [
    ("settle", "step 2: warm-up extended (2 of at most 2): fake: measuring a trial"),
    ("cold", "step 2: warm-up extended (2 of at most 2): fake: a cold update"),
])
def test_warmup_goes_on_while_the_system_says_so_up_to_settle_steps(tmp_path, cache, test_conf, behavior, said):
    """More warm-up steps, at most settle_steps, for a system still choosing how to run (``choosing()``, asked
    before a step: the "settle" fake says so until it has run 4 steps) or whose would-be first timed step was a
    transient (``transient()``, asked once it ran: MegaTrain's cold update after the runtime split moved groups;
    the "cold" fake says so after its 2nd to 4th steps). With one warm-up step and a cap of 2, steps 1 and 2 are
    warm-up and step 3 is timed all the same (the cap ends the warm-up); the timed steps are the 2 asked for,
    and the row counts the warm-up steps that ran."""
    results = tmp_path / "results"
    proc = run_runner("sweep=_test", f"hydra.searchpath=[file://{test_conf}]", f"results_dir={results}",
                      f"cache_dir={cache}", f"sweep.systems=[_test_{behavior}]", "steps=2", "warmup_steps=1",
                      "settle_steps=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (r,) = [r for _, r in schema.read_results(results / "_test" / "results.csv").iterrows()]
    assert r["status"] == "ok" and r["timed_steps"] == 2 and r["warmup_steps"] == 3, dict(r)
    recs = [json.loads(x) for x in (results / "_test" / r["point"] / "metrics.jsonl").read_text().splitlines()]
    assert [x["warmup"] for x in recs] == [True, True, True, False, False]
    log = (results / "_test" / r["point"] / "log.txt").read_text()
    assert said in log, log


def test_a_killed_runner_takes_its_point_process_with_it(tmp_path, cache, test_conf):
    import os
    import signal
    import time

    import psutil

    results = tmp_path / "results"
    children = []
    runner = subprocess.Popen(
        [sys.executable, "-m", "experiments.run", "sweep=_test", f"hydra.searchpath=[file://{test_conf}]",
         f"results_dir={results}", f"cache_dir={cache}", "only=[_test_hang*]", "timeout_s=120"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        metrics = None
        while time.time() < deadline and runner.poll() is None:
            found = list(results.glob("_test/_test_hang*/metrics.jsonl"))
            if found and found[0].read_text().strip():
                metrics = found[0]
                break
            time.sleep(0.2)
        assert metrics is not None, "the hanging point never recorded its first step"
        children = psutil.Process(runner.pid).children(recursive=True)
        assert children
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait(timeout=10)
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"point process survived its runner: {alive}"
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=30)
        for child in children:  # only if the assertion above failed
            if child.is_running():
                child.kill()


def test_megatrain_data_parallel_point_through_torchrun_on_cpu(tmp_path, cache):
    """``gpus=2``: the point runs as two torchrun ranks (gloo on CPU), one host store, and the row counts
    both ranks' tokens; a system without several-GPU support is refused before anything runs."""
    results = tmp_path / "results"
    proc = run_runner("sweep=smoke", "system=megatrain", "gpus=2", f"results_dir={results}", f"cache_dir={cache}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    df = schema.read_results(results / "smoke" / "results.csv")
    row = df.iloc[0]
    assert row["status"] == "ok", row["error"]
    assert row["tokens_per_step"] == 2 * row["batch_size"] * row["seq_len"]
    log = next((results / "smoke").glob("megatrain__*/log.txt")).read_text()
    assert log.count("[point] ok") == 2  # both ranks trained and finished
    refused = run_runner("sweep=smoke", "system=native", "gpus=2", f"results_dir={tmp_path / 'r2'}",
                         f"cache_dir={cache}")
    assert refused.returncode == 2 and "at most 1 GPU" in refused.stdout + refused.stderr


def test_engine_side_init_writes_no_weights_and_matches_the_shared_init(tmp_path, cache):
    """shared_init=false: the MegaTrain point initialises inside the engine from the seed (nothing in the
    cache); on the CPU that is the same init code on the same device, so the first loss equals the shared
    weights' first loss."""
    losses = {}
    for shared in ("true", "false"):
        results, own_cache = tmp_path / f"results_{shared}", tmp_path / f"cache_{shared}"
        proc = run_runner("sweep=smoke", "system=megatrain", f"shared_init={shared}", f"results_dir={results}",
                          f"cache_dir={own_cache}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (r,) = [r for _, r in schema.read_results(results / "smoke" / "results.csv").iterrows()]
        assert r["status"] == "ok", r["error"]
        losses[shared] = r["loss_first"]
        weights = list((own_cache / "weights").glob("*")) if (own_cache / "weights").exists() else []
        assert bool(weights) == (shared == "true")
    assert losses["false"] == pytest.approx(losses["true"], rel=1e-6)
