"""host_update_cores: the host tier's CPU update worker (and the OpenMP teams it starts) bound to cores away
from the main thread (megatrain/host_adamw.py, HostAdamW.bind_cores). Observed as the OS sees it: each
thread's affinity mask (``os.sched_getaffinity(thread id)``); the training itself is unchanged (parity)."""
from __future__ import annotations

import glob
import os

import pytest

from megatrain import EngineConfig, MegaTrain, PRESETS
from megatrain.host_adamw import update_cores

from test_engine_parity import assert_parity, batches, engine_cfg

ALLOWED = set(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 cores this process may use")


def _thread_masks() -> dict[int, set[int]]:
    out = {}
    for path in glob.glob("/proc/self/task/*"):
        tid = int(path.rsplit("/", 1)[1])
        try:
            out[tid] = os.sched_getaffinity(tid)
        except OSError:  # ended meanwhile
            pass
    return out


def test_update_cores_setting():
    cores = set(range(16))
    assert update_cores("none", True, cores) is None
    assert update_cores("auto", False, cores) is None  # CPU run: the main thread computes, it needs every core
    assert update_cores("auto", True, cores) == (list(range(1, 16)), [0])
    assert update_cores("auto", True, cores, ranks=2) is None  # several ranks: their main threads would share core 0
    assert update_cores("all-but-1", True, cores, ranks=2) == (list(range(1, 16)), [0])  # explicit: as asked
    assert update_cores("all-but-2", False, {3, 5, 7, 9}) == ([7, 9], [3, 5])  # the cores this process may use
    with pytest.warns(RuntimeWarning, match="not bound"):
        assert update_cores("all-but-4", True, {0, 1, 2, 3}) is None


@pytest.mark.parametrize("bad", ["all", "all-but-0", "all-but-x", "some-but-1", "2"])
def test_config_rejects_bad_setting(bad):
    with pytest.raises(ValueError, match="host_update_cores must be 'none', 'auto' or 'all-but-N'"):
        EngineConfig(host_update_cores=bad)
    assert EngineConfig(host_update_cores=" All-But-3 ").host_update_cores == "all-but-3"


@needs_two_cores
def test_worker_and_its_teams_bound_away_from_the_main_thread():
    """all-but-1: the main thread on the lowest allowed core, the worker on the rest; a kernel team the worker
    starts (forced to 2 threads here, so that one is created even on a 2-core machine) inherits the worker's
    cores; close gives the main thread its cores back."""
    spec = PRESETS["tiny-llama"]
    main_before = os.sched_getaffinity(0)
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(host_update_cores="all-but-1"), verbose=False)
    try:
        worker, main = engine.host_opt.bound
        assert main == [min(ALLOWED)] and worker == sorted(ALLOWED - {min(ALLOWED)})
        assert os.sched_getaffinity(0) == set(main)
        assert os.sched_getaffinity(engine.host_opt.worker_native_id) == set(worker)
        assert engine.host_opt.kernel.threads == len(worker)
        engine.host_opt.kernel.threads = 2  # a team of two: one thread created by the worker
        before = _thread_masks()
        for b in batches(spec, steps=2):
            engine.step(b)
        new = {tid: m for tid, m in _thread_masks().items() if tid not in before}
        assert any(m == set(worker) for m in new.values()), new  # the worker's team
        # every thread created meanwhile is inside one side's cores: none straddles the main thread's
        assert all(m <= set(worker) or m <= set(main) for m in new.values()), new
    finally:
        engine.close()
    assert os.sched_getaffinity(0) == main_before


@needs_two_cores
def test_each_kernel_thread_bound_to_a_core_of_its_own():
    """Given two cores, the worker is bound to the first and the C++ kernel's second team thread, created by
    the warm-up region, to the second; both keep their core through the steps that follow."""
    spec = PRESETS["tiny-llama"]
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(), verbose=False)
    try:
        if engine.host_opt.kernel.ext is None:
            pytest.skip("the C++ host kernel is not built here")
        c0, c1 = sorted(ALLOWED)[:2]
        before = _thread_masks()
        engine.host_opt.bind([c0, c1], None)  # the main thread left as it is
        new = {tid: m for tid, m in _thread_masks().items() if tid not in before}
        assert engine.host_opt.bound_each and engine.host_opt.kernel.threads == 2
        assert os.sched_getaffinity(engine.host_opt.worker_native_id) == {c0}
        team = [tid for tid, m in new.items() if m == {c1}]
        assert len(team) == 1, new  # the kernel's second thread; torch's team (if another) over both cores
        assert all(m in ({c1}, {c0, c1}) for m in new.values()), new
        assert os.sched_getaffinity(0) == ALLOWED
        for b in batches(spec, steps=2):
            engine.step(b)
        assert os.sched_getaffinity(engine.host_opt.worker_native_id) == {c0}
        assert os.sched_getaffinity(team[0]) == {c1}
    finally:
        engine.close()


@needs_two_cores
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])  # untied, tied
def test_parity_bound(preset):
    """The bound engine matches plain PyTorch (speculation and rollback included: clipping fires)."""
    spec = PRESETS[preset]
    stats = {}
    assert_parity(spec.to_hf_config("eager"), engine_cfg(host_update_cores="all-but-1"), batches(spec),
                  stats_out=stats)
    assert stats["clipped"] > 0
    assert os.sched_getaffinity(0) == ALLOWED


def test_none_and_auto_on_cpu_bind_nothing():
    spec = PRESETS["tiny-llama"]
    for setting in ("none", "auto"):
        engine = MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(host_update_cores=setting), verbose=False)
        try:
            assert engine.host_opt.bound is None
            assert os.sched_getaffinity(engine.host_opt.worker_native_id) == ALLOWED
        finally:
            engine.close()
