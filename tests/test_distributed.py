"""Data parallelism (megatrain/distributed.py) on CPU with gloo: parity of 2 ranks x B against 1 process x
2B, the node's host store mapped once (not copied per rank), and a dying rank failing the others fast.

Each test starts real processes (spawn) that meet over TCP on a free localhost port."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback

import pytest
import torch

from megatrain import MegaTrain, ModelSpec, PRESETS
from megatrain.arch import build_meta_model
from megatrain.store import make_groups

from test_engine_parity import OPTIM, assert_matches_reference, batches, engine_cfg
from test_engine_tiers import every_other_plus_head

B = 2  # rows per rank; the single-process run gets 2B
STEPS = 4
TIMEOUT_S = 30  # process-group and shared-memory wait timeouts in the ranks


# -- launching ranks --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, out_dir, kwargs):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import datetime

    import torch.distributed as tdist

    result = None
    try:
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                 timeout=datetime.timedelta(seconds=TIMEOUT_S))
        result = fn(rank, world, **kwargs)
    except BaseException as exc:  # reported to the test, which decides
        result = {"error": f"{type(exc).__name__}: {exc}", "error_type": type(exc).__name__,
                  "traceback": traceback.format_exc(), "t": time.time()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # no teardown: a peer may be dead, and destroy_process_group is not what is tested


def launch(fn, world: int, tmp_path, timeout: float = 90, **kwargs) -> list:
    """Run ``fn(rank, world, **kwargs)`` in ``world`` spawned processes; returns each rank's result (None for
    a rank that died without writing one)."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, str(tmp_path), kwargs)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.time()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {timeout} s"
    out = []
    for r in range(world):
        f = tmp_path / f"rank{r}.pt"
        out.append(torch.load(f, weights_only=False) if f.exists() else None)
    return out


def _check(results):
    for r, res in enumerate(results):
        assert res is not None and "error" not in res, f"rank {r}: {res and res.get('traceback')}"


# -- (a) parity ---------------------------------------------------------------------------------------------
def _hf():
    return PRESETS["tiny-llama"].to_hf_config("eager")


def _tiers(kind):
    return every_other_plus_head(make_groups(build_meta_model(_hf()))) if kind == "mixed" else None


def _train(engine, data, rank=0, rows=None):
    out = []
    for b in data:
        r = engine.step({k: v[rank * rows:(rank + 1) * rows] for k, v in b.items()} if rows else b)
        out.append((r.loss, r.grad_norm))
    return out


def _resume(engine, path, cfg_kw, tiers_kind, dist=None):
    """save, close, load: the engine that continues."""
    engine.save(path)
    engine.close()
    return MegaTrain.load(path, engine_cfg(**cfg_kw), verbose=False, tiers=_tiers(tiers_kind), dist=dist)


def _parity_rank(rank, world, cfg_kw, tiers_kind, ckpt):
    from megatrain.distributed import DataParallel

    dp = DataParallel(timeout_s=TIMEOUT_S)
    engine = MegaTrain.from_config(_hf(), engine_cfg(**cfg_kw), verbose=False, tiers=_tiers(tiers_kind), dist=dp)
    data = batches(PRESETS["tiny-llama"], steps=STEPS, bsz=B * world)
    results = _train(engine, data[:-1], rank, B)
    if ckpt:  # every rank saves (rank 0 writes) and resumes
        engine = _resume(engine, ckpt, cfg_kw, tiers_kind, dp)
    results += _train(engine, data[-1:], rank, B)
    stats = dict(engine.stats)
    final = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return {"steps": results, "final": final, "stats": stats}


@pytest.mark.parametrize("cfg_kw,tiers_kind,resume", [
    (dict(gpu_resident="0", speculate="always"), None, False),  # host tier only; early updates rolled back
    (dict(), "mixed", True),  # every other layer + head on the "GPU" tier (replicated); save + resume
])
def test_two_ranks_match_one_process_with_twice_the_batch(tmp_path, cfg_kw, tiers_kind, resume):
    """Same per-step losses and final weights (1e-5, fp32) with clipping firing and 2 micro-batches, as one
    engine process and as plain PyTorch on the whole batch."""
    cfg_kw = dict(checkpoint_interval=2, micro_batches=2, **cfg_kw)
    ranks = launch(_parity_rank, 2, tmp_path, cfg_kw=cfg_kw, tiers_kind=tiers_kind,
                   ckpt=str(tmp_path / "dp_ckpt") if resume else None)
    _check(ranks)
    engine = MegaTrain.from_config(_hf(), engine_cfg(**cfg_kw), verbose=False, tiers=_tiers(tiers_kind))
    init = {k: v.clone() for k, v in engine.state_dict().items()}
    data = batches(PRESETS["tiny-llama"], steps=STEPS, bsz=2 * B)
    ref = _train(engine, data[:-1])
    if resume:
        engine = _resume(engine, str(tmp_path / "ref_ckpt"), cfg_kw, tiers_kind)
    ref += _train(engine, data[-1:])
    ref_final = engine.state_dict()
    engine.close()
    losses = torch.tensor([s[0] for s in ranks[0]["steps"]])
    torch.testing.assert_close(losses, torch.tensor([r[0] for r in ref]), rtol=1e-5, atol=0)
    assert ranks[0]["steps"] == ranks[1]["steps"]  # the same global loss and norm on every rank
    assert all(r[1] > OPTIM.max_grad_norm for r in ref)  # clipping fires every step
    assert abs(losses[-1] - losses[0]) > 1e-3
    for name, want in ref_final.items():
        got0, got1 = ranks[0]["final"][name], ranks[1]["final"][name]
        assert torch.equal(got0, got1), f"{name}: ranks disagree"  # shared host tier, identical replicas
        rel = float((got0 - want).norm() / want.norm())
        assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"
    # plain PyTorch (tests/reference.py) on the whole 2B-row batch: losses, gradient norms and weights
    ref_norms = []
    assert_matches_reference(_hf(), init, [s[0] for s in ranks[0]["steps"]], ranks[0]["final"], data,
                             micro_batches=2, grad_norms=ref_norms)
    torch.testing.assert_close(torch.tensor([s[1] for s in ranks[0]["steps"]]), torch.tensor(ref_norms),
                               rtol=1e-5, atol=0)


# -- (b) one host store per node ------------------------------------------------------------------------------
MEM_SPEC = ModelSpec("llama", hidden_size=256, num_layers=16, num_heads=4, num_kv_heads=2, intermediate_size=1024,
                     vocab_size=256, tie_embeddings=False, max_position_embeddings=64, name="mem")


def _rollup() -> dict[str, int]:
    """/proc/self/smaps_rollup in bytes. Data only: Pss_Anon + Pss_Shmem leaves out shared-library pages,
    whose PSS moves with what the other rank has touched so far."""
    out = {}
    for line in open("/proc/self/smaps_rollup").read().splitlines()[1:]:
        key, value = line.split(":")
        out[key] = int(value.split()[0]) * 1024
    return {"pss": out["Pss_Anon"] + out["Pss_Shmem"], "private": out["Private_Dirty"]}


def _memory_rank(rank, world, shared):
    import ctypes
    import gc

    from megatrain.distributed import DataParallel

    def measure():
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap memory (CPU "GPU" gradients) back to the OS
        return _rollup()

    # Blocks >= 1 MiB straight from mmap and back to the OS when freed (no dynamic threshold): the
    # CPU run's "GPU" gradients and activations do not linger in the heap and blur the measurement.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    # Warm-up: every module the engine imports is loaded before the baseline (imports are private memory).
    warm = MegaTrain.from_config(_hf(), engine_cfg(gpu_resident="0"), verbose=False)
    warm.step(batches(PRESETS["tiny-llama"], steps=1)[0])
    warm.close()
    del warm
    hf = MEM_SPEC.to_hf_config("eager")
    cfg = engine_cfg(checkpoint_interval=1, micro_batches=1, gpu_resident="0", speculate="never")
    dp = DataParallel(timeout_s=TIMEOUT_S)
    dp.barrier("baseline")
    before = measure()
    engine = MegaTrain.from_config(hf, cfg, verbose=False, dist=dp if shared else None)
    for b in batches(MEM_SPEC, steps=2, bsz=1, seq=8):
        engine.step(b)
    engine.synchronize()
    dp.barrier("measure")  # both ranks done touching their slices of m and v
    after = measure()
    dp.barrier("measured")  # keep the store mapped here until the other rank has measured too
    state = engine.store.bytes_on("cpu")
    engine.close()
    return {"pss": after["pss"] - before["pss"], "private": after["private"] - before["private"], "state": state,
            "shm_file": os.path.join(dp.shm_dir, f"megatrain-{dp.token}.store")}


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux smaps_rollup")
def test_host_store_is_mapped_once_per_node(tmp_path):
    """Two ranks' combined PSS growth ~ one model's host state (12 B/param), and far below two copies;
    the same run without sharing (one store per rank) shows the two copies."""
    ranks = launch(_memory_rank, 2, tmp_path, shared=True)
    _check(ranks)
    state = ranks[0]["state"]
    assert state > 150e6  # the host state dominates the per-rank noise
    total_pss = sum(r["pss"] for r in ranks)
    assert not os.path.exists(ranks[0]["shm_file"])  # unlinked once every rank had it mapped
    assert 0.85 * state < total_pss < 1.3 * state, (total_pss / state, ranks)
    for r in ranks:  # each rank's own pages: its slices of m, v (~8 B/param / 2) plus working memory
        assert r["private"] < 0.6 * state, (r["private"] / state, ranks)
    for f in tmp_path.glob("rank*.pt"):
        f.unlink()
    private = launch(_memory_rank, 2, tmp_path, shared=False)
    _check(private)
    assert sum(r["pss"] for r in private) > 1.8 * state


# -- (c) a rank that dies ---------------------------------------------------------------------------------------
def _dying_rank(rank, world, where):
    from megatrain.distributed import DataParallel

    spec = PRESETS["tiny-llama"]
    engine = MegaTrain.from_config(_hf(), engine_cfg(checkpoint_interval=2, gpu_resident="0"), verbose=False,
                                   dist=DataParallel(timeout_s=TIMEOUT_S))
    data = batches(spec, steps=3, bsz=B)
    engine.step(data[0])
    engine.synchronize()
    if rank == 1:
        if where == "collective":  # dies mid-backward: rank 0 is left in the gradient all-reduce
            orig = engine._grad_ready

            def grad_ready(name, flat, st):
                if name == "layer.1":
                    os._exit(3)
                return orig(name, flat, st)
            engine._grad_ready = grad_ready
        else:  # dies in its host update: rank 0 is left waiting for rank 1's slice before its next load
            opt = engine.host_opt

            def apply(*a, **k):
                time.sleep(1.0)
                os._exit(3)
            opt._apply = apply
    t0 = time.time()
    for b in data[1:]:
        engine.step(b)
    return {"ok": True, "t0": t0}


@pytest.mark.parametrize("where", ["collective", "host_update"])
def test_dead_rank_fails_the_others_fast(tmp_path, where):
    t0 = time.time()
    ranks = launch(_dying_rank, 2, tmp_path, timeout=60, where=where)
    assert ranks[1] is None  # it died (os._exit before writing a result)
    res = ranks[0]
    assert res is not None and "error" in res, res
    assert res["error_type"] == "RankFailure", res["traceback"]
    assert "died" in res["error"] or "failed" in res["error"]
    assert res["t"] - t0 < 45  # well within the launch timeout: nobody hung
