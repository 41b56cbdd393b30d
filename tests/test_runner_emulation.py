"""The CPU side of emulated hardware profiles (CPU only): the host-RAM cap in megatrain.memory and the
engine's plan, the core pinning of experiments.emulation, and both through the runner end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments import emulation, schema  # noqa: E402
from megatrain import memory  # noqa: E402

GIB = 2**30


@pytest.fixture
def host(monkeypatch):
    """A fake machine for megatrain.memory: 100 GiB available, this process resident at 2 GiB."""
    fake = types.SimpleNamespace(
        virtual_memory=lambda: types.SimpleNamespace(available=100 * GIB),
        Process=lambda: types.SimpleNamespace(memory_info=lambda: types.SimpleNamespace(rss=2 * GIB)))
    monkeypatch.setattr(memory, "psutil", fake)
    monkeypatch.delenv(memory.HOST_RAM_ENV, raising=False)
    return monkeypatch


def test_available_host_bytes_honours_the_env_cap(host):
    assert memory.available_host_bytes() == 100 * GIB  # unset: the real available
    host.setenv(memory.HOST_RAM_ENV, "")
    assert memory.available_host_bytes() == 100 * GIB  # empty: unset
    host.setenv(memory.HOST_RAM_ENV, "64")
    assert memory.available_host_bytes() == 62 * GIB  # the emulated total less this process's RSS
    host.setenv(memory.HOST_RAM_ENV, "200")
    assert memory.available_host_bytes() == 100 * GIB  # never more than the real available
    host.setenv(memory.HOST_RAM_ENV, "1.5")
    assert memory.available_host_bytes() == 0  # the process already holds more than the cap
    for bad in ("0", "-8", "64GB"):
        host.setenv(memory.HOST_RAM_ENV, bad)
        with pytest.raises(ValueError):  # a typo must not silently mean "no cap"
            memory.available_host_bytes()


def test_the_engine_plan_is_refused_under_the_cap(monkeypatch):
    """The engine plans with available_host_bytes: a cap just above its RSS refuses it, before allocating."""
    import megatrain.engine as engine_mod
    from megatrain.config import EngineConfig
    from megatrain.spec import PRESETS

    allocated = []
    monkeypatch.setattr(engine_mod, "ModelStore", lambda *a, **k: allocated.append(1))
    rss = memory.psutil.Process().memory_info().rss
    monkeypatch.setenv(memory.HOST_RAM_ENV, f"{(rss + GIB // 2) / GIB:.4f}")  # ~0.5 GiB left
    with pytest.raises(MemoryError, match=r"host needs .* but 0\.\d\d GiB is available"):
        engine_mod.MegaTrain.from_config(PRESETS["tiny-llama"].to_hf_config("eager"), EngineConfig(device="cpu"),
                                         verbose=False)
    assert not allocated


def test_apply_sets_the_cap_and_clears_an_inherited_one(monkeypatch):
    monkeypatch.setenv(memory.HOST_RAM_ENV, "32")  # e.g. exported in the runner's shell
    applied = emulation.apply({"name": "real"})
    assert memory.HOST_RAM_ENV not in os.environ  # the profile says no cap: the row must not be capped
    assert applied == {"cpu_cores": emulation.usable_cores(), "host_ram_cap_gib": None}
    applied = emulation.apply({"name": "host-64GB", "host_ram_gib": 64})
    assert os.environ[memory.HOST_RAM_ENV] == "64" and applied["host_ram_cap_gib"] == 64.0
    # the host link is emulated by the engine; apply records it, and the row carries it as a column
    applied = emulation.apply({"name": "link-16GBps", "host_link_gbps": 16})
    assert applied["host_link_gbps"] == 16.0 and "host_link_gbps" not in emulation.apply({"name": "real"})


def test_cores_error():
    assert emulation.cores_error(None) is None and emulation.cores_error(2, available=2) is None
    assert "must be >= 1" in emulation.cores_error(0, available=2)
    assert emulation.cores_error(3, available=2) == "cpu_cores=3 > the 2 CPU core(s) this process may use"


@pytest.mark.skipif(emulation.usable_cores() < 2, reason="pinning to 1 of 1 core cannot be told from no pinning")
def test_pin_cores_pins_threads_started_before_and_after():
    """In a child process (pinning pytest itself would slow the rest of the suite)."""
    code = textwrap.dedent("""
        import os, threading
        from experiments import emulation
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        cpus = emulation.pin_cores(1)
        after = threading.Thread(target=stop.wait); after.start()
        masks = [os.sched_getaffinity(t) for t in (0, before.native_id, after.native_id)]
        stop.set()
        print(cpus, all(m == set(cpus) for m in masks), emulation.usable_cores())
    """)
    first = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{first}]", "True", "1"]


# -- through the runner ---------------------------------------------------------------------------------
pytestmark = pytest.mark.timeout(600)  # above run_runner's own 300 s bound on a point's runner


def run_runner(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


CAPPED = ["sweep=smoke", "system=megatrain", "hardware.name=cores-1", "hardware.emulated=true",
          "hardware.cpu_cores=1", "torch_threads=null", "post=false"]  # threads from the cores, not smoke's 1


@pytest.mark.skipif(emulation.usable_cores() < 2, reason="needs 2 cores to tell a 1-core cap from none")
def test_a_cores_and_host_capped_point_runs_on_one_core(tmp_path):
    results = tmp_path / "results"
    proc = run_runner(*CAPPED, "hardware.host_ram_gib=16", f"results_dir={results}", f"cache_dir={tmp_path / 'c'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = [r for _, r in schema.read_results(results / "smoke" / "results.csv").iterrows()]
    assert row["status"] == "ok", row["error"]
    assert row["hardware"] == "cores-1" and row["emulated"] and row["host_ram_gib"] == 16
    assert row["cpu_cores"] == 1 and row["torch_threads"] == 1  # settings as columns
    assert row["checkpoint_interval"] == 1 and json.loads(row["settings"])["checkpoint_interval"] == 1
    result = json.loads((results / "smoke" / row["point"] / "result.json").read_text())
    assert result["cpu_cores"] == 1 and len(result["cpu_affinity"]) == 1 and result["torch_threads"] == 1
    assert result["host_ram_cap_gib"] == 16
    assert "[point] emulating cores-1: pinned to 1 CPU core(s)" in (results / "smoke" / row["point"] / "log.txt").read_text()


def test_a_point_over_the_host_cap_is_a_skip_row_with_the_estimate(tmp_path):
    results = tmp_path / "results"
    proc = run_runner(*CAPPED, "hardware.host_ram_gib=1", f"results_dir={results}", f"cache_dir={tmp_path / 'c'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = [r for _, r in schema.read_results(results / "smoke" / "results.csv").iterrows()]
    assert row["status"] == "skipped" and row["host_estimate_gib"] > 1
    assert "engine host estimate" in row["error"] and "(emulated 1 GiB host, profile cores-1)" in row["error"]
    assert row["host_ram_gib"] == 1 and row["emulated"]
    assert not (results / "smoke" / row["point"]).exists()  # nothing was launched


def test_more_cores_than_the_machine_is_refused_before_anything_runs(tmp_path):
    proc = run_runner(*CAPPED[:4], f"hardware.cpu_cores={emulation.usable_cores() + 1}", f"results_dir={tmp_path}",
                      timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"cpu_cores={emulation.usable_cores() + 1} > the {emulation.usable_cores()} CPU core(s)" in proc.stderr
    assert not list(tmp_path.iterdir())
