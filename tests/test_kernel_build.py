"""Building the host AdamW extension (megatrain/kernels.py): one build per hash, in a child process, never an
unbounded wait, a one-line fallback when it cannot be built, nothing compiled where a build exists."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain import kernels

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)  # every wait below is bounded too; this bounds the test as a whole
# Children start from this environment minus megatrain's switches and caches (flags stay: they are part of
# the hash that ``prebuilt`` was built for).
CLEAN = {k: v for k, v in os.environ.items()
         if not k.startswith(("MEGATRAIN_", "TORCH_EXTENSIONS_DIR")) or k == "MEGATRAIN_HOST_ADAMW_CFLAGS"}


def run(code_or_args, env=None, timeout=120):
    """A fresh interpreter in the repository root (so it imports this checkout), with ``env`` on top of a
    clean environment."""
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else list(code_or_args)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**CLEAN, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def prebuilt():
    """This machine's build in the default cache (built once here if no earlier test did)."""
    path = kernels.build_ahead(verbose=False, retry=True)
    if path is None:
        pytest.skip("the extension cannot be built on this machine")
    return path


def test_the_name_is_a_hash_of_source_flags_and_torch(monkeypatch):
    base = kernels.build_id()
    assert re.fullmatch(r"[0-9a-f]{16}", base) and kernels.name() == f"megatrain_cpu_adamw_{base}"
    assert kernels.build_id() == base  # stable
    monkeypatch.setenv("MEGATRAIN_HOST_ADAMW_CFLAGS", "-mno-avx512f")
    assert kernels.build_id() != base and "-mno-avx512f" in kernels.cflags()
    assert "-march=native" not in kernels.cflags() and "-ffp-contract=off" in kernels.cflags()
    monkeypatch.setenv("MEGATRAIN_KERNEL_CACHE", "/somewhere")
    assert kernels.so_path() == Path("/somewhere") / f"{kernels.name()}.so"


def _hold_lock(path: Path) -> subprocess.Popen:
    """A process that holds the build lock (flock) until killed, as a build in progress would."""
    code = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nos.pwrite(fd, str(os.getpid()).encode(), 0)\n"
            "print('held', flush=True)\ntime.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"  # returns at once: the child prints right away
    return holder


def test_a_held_lock_is_waited_for_with_a_bound_and_a_dead_holder_never_blocks(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_KERNEL_CACHE", str(tmp_path))
    compiled = []

    def fake_compile(dest, timeout):  # the lock logic, without a compiler
        compiled.append(dest)
        dest.write_bytes(b"built")

    monkeypatch.setattr(kernels, "_compile", fake_compile)
    lock = kernels.so_path().with_suffix(".lock")
    holder = _hold_lock(lock)
    try:
        t0 = time.monotonic()
        with pytest.raises(kernels.BuildError, match=f"another process \\(pid {holder.pid}\\)"):
            kernels.build(timeout=2)
        assert time.monotonic() - t0 < 10 and not compiled  # bounded, and it did not build meanwhile
        assert not kernels.so_path().with_suffix(".failed").exists()  # a busy lock is not a failed build
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # killed mid-"build": its lock file stays behind
        holder.wait(timeout=30)
    assert lock.exists()
    t0 = time.monotonic()
    assert kernels.build(timeout=60) == kernels.so_path()  # the stale lock is no obstacle
    assert time.monotonic() - t0 < 5 and compiled == [kernels.so_path()]
    assert kernels.build(timeout=60) == kernels.so_path() and len(compiled) == 1  # one build per hash


def test_a_failing_build_falls_back_with_one_warning_and_is_not_retried(tmp_path):
    env = {"MEGATRAIN_KERNEL_CACHE": str(tmp_path), "MEGATRAIN_HOST_ADAMW_CFLAGS": "-fno-such-flag-megatrain"}
    code = "from megatrain import cpu_adamw; print(cpu_adamw.name())"
    proc = run(code, env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torch-fused"
    warning = [ln for ln in proc.stderr.splitlines() if "host AdamW extension unavailable" in ln]
    assert len(warning) == 1 and "compile failed" in warning[0] and "torch's fused AdamW" in warning[0], proc.stderr
    assert list(tmp_path.glob("*.failed")) and not list(tmp_path.glob("*.so"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".build-")]  # its temporary folder is gone
    # The next process does not compile again (the failure is remembered): fast, and says how to retry.
    t0 = time.monotonic()
    again = run(f"import subprocess\nsubprocess.Popen = None  # any compile would fail loudly\n{code}", env)
    assert again.stdout.strip() == "torch-fused" and "kernels build` retries" in again.stderr, again.stderr
    assert time.monotonic() - t0 < 60
    # MEGATRAIN_HOST_ADAMW=cpp turns the fallback into an error; the explicit build retries and exits 1.
    strict = run(code, {**env, "MEGATRAIN_HOST_ADAMW": "cpp"})
    assert strict.returncode != 0 and "BuildError" in strict.stderr
    cli = run(["-m", "megatrain.kernels", "build"], env, timeout=300)
    assert cli.returncode == 1 and "compile failed" in cli.stderr


def test_no_compiler_and_a_build_timeout_fall_back(tmp_path):
    code = "from megatrain import cpu_adamw; print(cpu_adamw.name())"
    proc = run(code, {"MEGATRAIN_KERNEL_CACHE": str(tmp_path / "a"), "CXX": "/nonexistent/c++"})
    assert proc.stdout.strip() == "torch-fused" and "no C++ compiler" in proc.stderr, proc.stderr
    t0 = time.monotonic()
    proc = run(code, {"MEGATRAIN_KERNEL_CACHE": str(tmp_path / "b"), "MEGATRAIN_KERNEL_BUILD_TIMEOUT": "3"})
    assert proc.stdout.strip() == "torch-fused" and "did not finish within 3 s" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 60
    assert not [p for p in (tmp_path / "b").iterdir() if p.name.startswith(".build-")]


def test_a_prebuilt_kernel_is_loaded_without_compiling(prebuilt):
    """A process that trains with the extension already built starts no child process at all (so no
    compiler's memory can be counted as its own)."""
    code = """
import subprocess, warnings
started = []
popen = subprocess.Popen.__init__
def record(self, args, *a, **k):
    started.append(str(args))
    popen(self, args, *a, **k)
subprocess.Popen.__init__ = record  # other libraries may start helpers (ldconfig); a compile would show here
warnings.simplefilter("error", RuntimeWarning)  # and no fallback warning
import torch
from megatrain import MegaTrain, EngineConfig, PRESETS, kernels
from megatrain import cpu_adamw
from megatrain.data import synthetic_batch
def refuse(*a, **k):
    raise AssertionError("a compile was started")
kernels._compile = kernels.build = refuse
spec = PRESETS["tiny-llama"]
engine = MegaTrain.from_config(spec.to_hf_config("eager"), EngineConfig(device="cpu"), verbose=False)
engine.step(synthetic_batch(spec.vocab_size, 2, 16, 0, 0))
engine.close()
compiles = [c for c in started if any(w in c for w in ("cpp_extension", "ninja", "c++", "g++", "cc1plus"))]
assert not compiles, compiles
print(cpu_adamw.name())
"""
    proc = run(code, {"MEGATRAIN_KERNEL_CACHE": str(prebuilt.parent)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == " ".join(["cpp-openmp", *kernels.isa_flags()])


def _host_peak_gib(stdout: str) -> float:
    return float(re.search(r"host peak RSS ([0-9.]+) GiB", stdout).group(1))


@pytest.mark.slow  # one real compile (1-3 min on 2 cores)
@pytest.mark.timeout(1200)
def test_stale_locks_do_not_hang_the_demo_and_its_memory_is_not_the_compilers(tmp_path, prebuilt):
    """A fresh extensions folder holding what a killed build leaves behind: torch's own lock of the old
    shared extension name, this hash's lock file (its holder dead) and a temporary build folder. The demo
    builds (in a child process), trains, and its host peak is that of a rerun with the extension built."""
    legacy = tmp_path / "megatrain_cpu_adamw"
    legacy.mkdir()
    (legacy / "lock").write_text("")
    ours = tmp_path / "megatrain"
    ours.mkdir()
    (ours / f"{prebuilt.stem}.lock").write_text("999999999")
    (ours / f".build-{prebuilt.stem}-dead").mkdir()
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    first = run(["-m", "megatrain.demo", "--steps", "3"], env, timeout=900)
    assert first.returncode == 0, first.stderr
    assert "unavailable" not in first.stderr and (ours / prebuilt.name).exists(), first.stderr
    assert not (ours / f".build-{prebuilt.stem}-dead").exists()  # a killed build's leftovers: cleaned
    rerun = run(["-m", "megatrain.demo", "--steps", "3"], env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert _host_peak_gib(first.stdout) <= 1.25 * _host_peak_gib(rerun.stdout) + 0.1, (first.stdout, rerun.stdout)
