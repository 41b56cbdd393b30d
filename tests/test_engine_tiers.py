"""Tiered memory (GPU tier + host tier) and the speculative host optimizer, on CPU: parity with plain
PyTorch for every placement and optimizer path, the placement plan, skipped steps, save/load across
placements."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain import EngineConfig, MegaTrain, OptimConfig, PRESETS
from megatrain import placement as placement_mod
from megatrain import planner

from test_engine_parity import (OPTIM, RTOL, assert_matches_reference, assert_parity, batches, engine_cfg,
                                assert_state_restored, inject_nan_gradient, train_past_a_nan_step)

NO_CLIP = dataclasses.replace(OPTIM, max_grad_norm=1e9)  # clipping never fires: speculation is kept


def every_other_plus_head(engine_groups):
    tiers = {g.name: "host" for g in engine_groups}
    for g in engine_groups:
        if (g.kind == "layer" and g.index % 2 == 0) or g.kind == "final":
            tiers[g.name] = "gpu"
    return tiers


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])  # untied, tied
@pytest.mark.parametrize("setting", ["0", "4", "mixed"])
def test_parity_placements(preset, setting):
    """None, all, and a mix (every other layer + head) on the GPU tier; clipping active, 2 micro-batches."""
    spec = PRESETS[preset]
    hf = spec.to_hf_config("eager")
    kw = {}
    if setting == "mixed":
        from megatrain.arch import build_meta_model
        from megatrain.store import make_groups

        kw["tiers"] = every_other_plus_head(make_groups(build_meta_model(hf)))
        cfg = engine_cfg(checkpoint_interval=2)
    else:
        cfg = engine_cfg(checkpoint_interval=2, gpu_resident=setting)
    assert_parity(hf, cfg, batches(spec), engine_kwargs=kw)


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_parity_speculation_rollback_and_kept(preset, micro_batches):
    """Speculative host updates: undone and redone when clipping fires every step (rollback path), kept
    when it never fires; both match plain PyTorch."""
    spec = PRESETS[preset]
    hf = spec.to_hf_config("eager")
    data = batches(spec, bsz=4)
    # Clipping fires every step (max_grad_norm 0.5 against norms of ~2-5): every step rolls back.
    stats = {}
    assert_parity(hf, engine_cfg(checkpoint_interval=2, speculate="always", micro_batches=micro_batches), data,
                  micro_batches=micro_batches, stats_out=stats)
    assert stats["rollbacks"] == len(data) and stats["clipped"] == len(data)
    assert stats["early_groups"] == len(data) * (spec.num_layers + 2)
    # Never fires: "auto" speculates from the second step on, nothing is rolled back.
    stats = {}
    assert_parity(hf, engine_cfg(checkpoint_interval=2, micro_batches=micro_batches, optim=NO_CLIP), data,
                  micro_batches=micro_batches, optim=NO_CLIP, stats_out=stats)
    assert stats["rollbacks"] == 0 and stats["speculated"] == len(data) - 1


def test_auto_does_not_speculate_after_clipping():
    spec = PRESETS["tiny-llama"]
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(), verbose=False)
    for b in batches(spec):
        engine.step(b)
        assert engine.stats["speculated"] == 0 and engine.stats["rollbacks"] == 0  # norms > 0.5 every step
    engine.close()


@pytest.mark.parametrize("speculate,gpu_resident,grads", [
    ("never", "0", "gpu"), ("never", "2", "gpu"), ("always", "0", "gpu"),
    ("never", "0", "host"), ("never", "2", "host"), ("always", "0", "host")])  # grad_placement
def test_nan_gradient_skips_step(speculate, gpu_resident, grads):
    """A NaN in one layer's gradient: the step is skipped with a warning and counted; weights, m, v and
    step counts are as before (bit-identical without speculation; undone to fp32 rounding when early
    updates had been applied); the next steps match a reference that skipped the same batch. With the
    host tier's gradients in host buffers (grad_placement="host") too."""
    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("eager")
    data = batches(spec)
    cfg = engine_cfg(checkpoint_interval=2, speculate=speculate, gpu_resident=gpu_resident, optim=NO_CLIP,
                     grad_placement=grads)
    engine = MegaTrain.from_config(hf, cfg, verbose=False)
    assert engine.placement.grads == grads
    init = {k: v.clone() for k, v in engine.state_dict().items()}
    inject_nan_gradient(engine, "layer.1", at_call=3)  # third step (one gradient per step with the last micro-batch)

    def check(before, after, r):
        assert r.grad_norm != r.grad_norm  # NaN
        assert_state_restored(before, after, exact=lambda key: speculate == "never")
        assert engine.skipped_steps == 1 and engine.step_count == 2

    losses, final = train_past_a_nan_step(engine, data, 2, check)
    kept = [b for s, b in enumerate(data) if s != 2]  # the reference skips the same batch
    assert_matches_reference(hf, init, losses, final, kept, 2, NO_CLIP)


def test_plan_bytes_match_allocation():
    """The plan's per-tier state bytes are what the store allocates (within 2 %)."""
    spec = PRESETS["tiny-llama"]
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(gpu_resident="2"), verbose=False)
    plan = engine.placement
    st = engine.store
    for tier in ("gpu", "host"):
        allocated = sum(t[n].numel() * t[n].element_size() for t in (st.master, st.m, st.v)
                        for n in plan.tiers if plan.tiers[n] == tier)
        assert allocated > 0
        assert abs(allocated - plan.state_bytes(tier)) <= 0.02 * allocated
    assert plan.gpu_layers == 2 and plan.tiers["embed"] == "gpu" and plan.tiers["final"] == "host"
    assert engine.num_params() == spec.num_params()
    engine.close()


def _shape(**kw):
    base = dict(num_layers=28, hidden=3584, ffn=18944, vocab=152064, micro_batches=1, tokens_per_micro_batch=8192,
                block=1, num_pool_slots=2, compute_bytes=2, stream_fp32=True, bf16_shadow=False,
                slab_bytes_total=4 * 2**26, loss_chunk_tokens=4096)
    base.update(kw)
    return placement_mod.StepShape(**base)


def _numels_7b():
    spec = PRESETS["qwen2.5-7b"]
    per_layer = (spec.num_params() - 2 * spec.vocab_size * spec.hidden_size - spec.hidden_size) // spec.num_layers
    numels = {"embed": spec.vocab_size * spec.hidden_size}
    numels.update({f"layer.{i}": per_layer for i in range(spec.num_layers)})
    numels["final"] = spec.vocab_size * spec.hidden_size + spec.hidden_size
    return numels


def test_plan_auto_fills_gpu_in_preference_order_and_refuses_with_numbers():
    numels, gib = _numels_7b(), 2**30
    plan = planner.plan(numels, _shape(), setting="auto", on_gpu=True, gpu_free=80 * gib,
                              host_available=120 * gib, gpu_margin=6 * gib, host_margin=2 * gib)
    gpu = plan.gpu_names
    assert gpu[0] == "embed" and gpu[1:] == [f"layer.{i}" for i in range(len(gpu) - 1)]  # a prefix
    assert 5 < len(gpu) < 28 and plan.tiers["final"] == "host"
    assert sum(plan.gpu_parts.values()) <= plan.gpu_budget
    # The 7B shape fits an H200 whole (the head goes last).
    plan = planner.plan(numels, _shape(), setting="auto", on_gpu=True, gpu_free=139 * gib,
                              host_available=120 * gib, gpu_margin=6 * gib, host_margin=2 * gib)
    assert plan.host_names == []
    # Pure streaming on a host too small: refused with both memories' numbers.
    with pytest.raises(MemoryError, match=r"host needs .* GiB but 40\.00 GiB is available"):
        planner.plan(numels, _shape(), setting="0", on_gpu=True, gpu_free=139 * gib,
                           host_available=40 * gib, gpu_margin=6 * gib, host_margin=2 * gib)
    with pytest.raises(MemoryError, match="GPU needs"):
        planner.plan(numels, _shape(), setting="28", on_gpu=True, gpu_free=80 * gib,
                           host_available=120 * gib, gpu_margin=6 * gib, host_margin=2 * gib)
    with pytest.raises(ValueError, match="only 28 decoder layers"):
        planner.plan(numels, _shape(), setting="29", on_gpu=True, gpu_free=80 * gib,
                           host_available=120 * gib, gpu_margin=6 * gib, host_margin=2 * gib)


def test_refused_before_any_allocation(monkeypatch):
    """A plan that cannot fit raises before the store allocates anything."""
    import megatrain.engine as engine_mod

    allocated = []
    monkeypatch.setattr(engine_mod.memory, "available_host_bytes", lambda: 1 << 20)
    monkeypatch.setattr(engine_mod, "ModelStore", lambda *a, **k: allocated.append(1))
    spec = PRESETS["tiny-llama"]
    with pytest.raises(MemoryError, match="host needs"):
        MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(), verbose=False)
    assert not allocated


@pytest.mark.parametrize("first,second", [("0", "4"), ("3", "0")])
def test_save_with_one_placement_load_with_another(tmp_path, first, second):
    spec = PRESETS["tiny-qwen3"]
    hf = spec.to_hf_config("eager")
    data = batches(spec, steps=5)
    engine = MegaTrain.from_config(hf, engine_cfg(checkpoint_interval=2, gpu_resident=first), verbose=False)
    straight = [engine.step(b).loss for b in data]
    engine.close()
    engine = MegaTrain.from_config(hf, engine_cfg(checkpoint_interval=2, gpu_resident=first), verbose=False)
    resumed = [engine.step(b).loss for b in data[:3]]
    engine.save(tmp_path / "ckpt")
    engine.close()
    engine = MegaTrain.load(tmp_path / "ckpt", engine_cfg(checkpoint_interval=2, gpu_resident=second), verbose=False)
    assert engine.placement.gpu_layers == int(second)
    resumed += [engine.step(b).loss for b in data[3:]]
    engine.close()
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), rtol=1e-6, atol=0)
