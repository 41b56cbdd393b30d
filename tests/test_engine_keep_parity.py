"""Kept activations (issue 22): blocks whose forward graph is kept for the backward (no recompute) train
exactly as plain PyTorch, for every keep-set (none, all, mixed), with mixed tiers, 1 and 2 micro-batches,
tied and untied embeddings (CPU, fp32, 1e-5)."""
from __future__ import annotations

import pytest
import torch

from megatrain import PRESETS, arch
from megatrain.arch import build_meta_model
from megatrain.store import make_groups

from test_engine_parity import assert_parity, batches, engine_cfg, run_engine
from test_engine_tiers import every_other_plus_head


def _tiers(hf):
    return every_other_plus_head(make_groups(build_meta_model(hf)))


@pytest.mark.parametrize("preset,micro_batches,keep,tiers", [
    ("tiny-llama", 2, "all", False),  # untied; recompute="none": every block kept
    ("tiny-qwen2", 1, "all", True),  # tied, mixed tiers
    ("tiny-llama", 1, {1}, True),  # the last block kept, the first recomputed, mixed tiers
    ("tiny-qwen2", 2, {0}, False),  # the first block kept, the last recomputed
    ("tiny-qwen2", 2, {1}, True),
])
def test_parity_keep_sets(preset, micro_batches, keep, tiers):
    spec = PRESETS[preset]
    hf = spec.to_hf_config("eager")
    kw = {"tiers": _tiers(hf)} if tiers else {}
    if keep == "all":
        cfg = engine_cfg(checkpoint_interval=2, micro_batches=micro_batches, recompute="none")
    else:
        cfg = engine_cfg(checkpoint_interval=2, micro_batches=micro_batches)
        kw["keep"] = keep
    assert_parity(hf, cfg, batches(spec), micro_batches=micro_batches, engine_kwargs=kw)


def test_kept_blocks_are_not_recomputed_and_weights_still_cross_twice(monkeypatch):
    """A kept layer runs once per micro-batch per step (its forward), a recomputed one twice; every layer is
    still loaded for its backward (its weights are read there by position, megatrain/keep.py)."""
    from megatrain import MegaTrain

    spec = PRESETS["tiny-llama"]  # 4 layers: K = 1 -> 4 blocks
    calls = []
    run_layer = arch.run_layer
    monkeypatch.setattr(arch, "run_layer", lambda *a, **k: calls.append(1) or run_layer(*a, **k))
    loads = {}
    for keep in (set(), {0, 2}, {0, 1, 2, 3}):
        engine = MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(checkpoint_interval=1), keep=keep,
                                       verbose=False)
        assert engine.info["blocks_kept"] == len(keep) and engine.info["recompute_blocks"] == f"kept {len(keep)}/4"
        calls.clear()
        engine.step(batches(spec, steps=1)[0])
        assert len(calls) == 2 * 4 + 2 * (4 - len(keep))  # 2 micro-batches
        loads[len(keep)] = engine.pool.loads
        assert engine.stats["blocks_kept"] == len(keep)
        engine.close()
    assert loads[0] == loads[2] == loads[4]


def test_keep_all_matches_recompute_all_bit_for_bit():
    """Keeping a block's graph computes what recomputing it computes: the same losses and weights, exactly."""
    spec = PRESETS["tiny-qwen3"]
    hf, data = spec.to_hf_config("eager"), batches(spec, steps=3)
    _, losses_a, final_a = run_engine(hf, engine_cfg(checkpoint_interval=2, recompute="all"), data)
    _, losses_b, final_b = run_engine(hf, engine_cfg(checkpoint_interval=2, recompute="none"), data)
    assert losses_a == losses_b
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), name


@pytest.mark.parametrize("preset,keep,tiers", [
    ("tiny-llama", "none", False),  # untied, every block recomputed, one micro-batch at a time
    ("tiny-qwen2", "all", True),  # tied, every block kept, mixed tiers
    ("tiny-qwen3", {0}, True),  # mixed keep-set, mixed tiers
])
def test_parity_sequential_micro_batches(preset, keep, tiers):
    """micro_batch_schedule="sequential": forward + backward one micro-batch at a time (gradients summed
    across the passes, the embedding/head gradients handed out after the last) trains as plain PyTorch."""
    spec = PRESETS[preset]
    hf = spec.to_hf_config("eager")
    kw = {"tiers": _tiers(hf)} if tiers else {}
    if isinstance(keep, set):
        recompute, kw["keep"] = "auto", keep
    else:
        recompute = {"none": "all", "all": "none"}[keep]
    cfg = engine_cfg(checkpoint_interval=2, micro_batches=2, recompute=recompute, micro_batch_schedule="sequential")
    assert_parity(hf, cfg, batches(spec), micro_batches=2, engine_kwargs=kw)


def test_sequential_loads_each_layer_twice_per_micro_batch():
    from megatrain import MegaTrain

    spec = PRESETS["tiny-llama"]
    loads = {}
    for schedule in ("layers", "sequential"):
        engine = MegaTrain.from_config(spec.to_hf_config("eager"),
                                       engine_cfg(checkpoint_interval=1, micro_batches=2, micro_batch_schedule=schedule),
                                       verbose=False)
        assert engine.placement.sequential == (schedule == "sequential")
        assert engine.info["micro_batch_schedule"] == schedule
        engine.step(batches(spec, steps=1)[0])
        loads[schedule] = engine.pool.loads
        engine.close()
    L, slots = spec.num_layers, 2
    assert loads["layers"] == 2 * L - slots  # the last layers of the forward are reused at the turn
    # the same once per micro-batch, and at the turn between passes the first layers are reused too (the
    # backward ends with them; weights change only after the step)
    assert loads["sequential"] == 2 * (2 * L - slots) - slots
