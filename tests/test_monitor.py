"""baselines.monitor.Monitor: the host-memory sampler survives children that come and go, and a sampler
that dies reports the host peak as unknown, never as the lower peak of the samples it took before."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from baselines.monitor import Monitor

# A python parent that keeps one python child alive (so the sampler takes the PSS path, which reads each
# process's name) and starts short-lived children as fast as it can, for ``seconds`` seconds.
CHURN = textwrap.dedent("""
    import subprocess, sys, time
    keep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    end = time.time() + float(sys.argv[1])
    while time.time() < end:
        subprocess.Popen([sys.executable, "-c", "pass"]).wait(timeout=30)
        subprocess.Popen(["true"]).wait(timeout=30)
    keep.kill(); keep.wait(timeout=30)
""")


def _dead_process() -> psutil.Process:
    """A psutil handle on a process that has exited and been reaped: every read raises NoSuchProcess,
    as for a child that exits between ``children()`` and ``name()``."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    handle = psutil.Process(proc.pid)
    proc.kill()
    proc.wait(timeout=30)
    return handle


def test_a_child_that_vanished_after_being_listed_is_skipped(monkeypatch):
    dead, other = _dead_process(), _dead_process()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live_handle = psutil.Process(live.pid)
        # children() lists processes that are gone by the time they are read (name(), memory_*_info())
        monkeypatch.setattr(psutil.Process, "children", lambda self, recursive=False: [dead, live_handle, other])
        mon = Monitor(gpu=False)
        rss = mon.sample()
        assert rss > 0 and mon.vanished >= 2 and mon.ok
    finally:
        live.kill()
        live.wait(timeout=30)


def test_the_sampler_thread_survives_children_that_come_and_go():
    parent = subprocess.Popen([sys.executable, "-c", CHURN, "6"])
    try:
        mon = Monitor(pid=parent.pid, interval=0.001, gpu=False).start()
        deadline = time.time() + 5
        while time.time() < deadline and parent.poll() is None:
            time.sleep(0.1)
        alive = mon._thread.is_alive()
        peaks = mon.stop()
    finally:
        parent.kill()
        parent.wait(timeout=30)
    assert alive, f"the sampler thread died: {mon.error}"
    assert mon.ok and peaks["error"] is None
    assert peaks["samples"] > 50 and peaks["host_peak_rss_bytes"] > 0


def test_a_dead_sampler_reports_the_host_peak_unknown(monkeypatch):
    mon = Monitor(interval=0.001, gpu=False).start()
    assert mon.peaks()["host_peak_rss_bytes"] > 0  # samples were taken before it broke

    def broken() -> int:
        raise RuntimeError("something unexpected")

    monkeypatch.setattr(mon, "_tree_rss", broken)
    deadline = time.time() + 10
    while mon._thread.is_alive() and time.time() < deadline:
        time.sleep(0.01)
    peaks = mon.stop()
    assert not mon.ok and "RuntimeError: something unexpected" in peaks["error"]
    assert peaks["host_peak_rss_bytes"] is None  # unknown, not the lower peak of the earlier samples


def test_a_thread_that_ended_without_a_reason_is_a_dead_sampler():
    mon = Monitor(interval=0.001, gpu=False).start()
    mon._stop.set()  # the loop ends as if it had died silently
    mon._thread.join(timeout=10)
    mon._stop.clear()
    peaks = mon.stop()
    assert not mon.ok and "ended early" in peaks["error"] and peaks["host_peak_rss_bytes"] is None


def test_a_working_sampler_reports_its_peak():
    with Monitor(interval=0.01, gpu=False) as mon:
        time.sleep(0.05)
    peaks = mon.peaks()
    assert mon.ok and peaks["error"] is None
    assert peaks["host_peak_rss_bytes"] == pytest.approx(psutil.Process().memory_info().rss, rel=0.5)
