"""The activation plan (issue 22): which blocks keep their activations, chosen with the tiers by one
step-time model (megatrain/cost_model.py); K and the slot pool from one formula; the boundary decision made
once by the plan; one-line refusals (issue 27 item 5)."""
from __future__ import annotations

import dataclasses

import pytest

from megatrain import EngineConfig, MegaTrain, PRESETS
from megatrain import cost_model, placement
from megatrain import planner
from megatrain.memory import plan_for_spec
from megatrain.spec import get_preset

from test_engine_parity import batches, engine_cfg

GIB = 2**30
H200 = dict(gpu_free=138 * GIB, host_available=120 * GIB, seq_len=1024)


def _plan(model, tokens, options=None, **kw):
    return plan_for_spec(get_preset(model), options or {}, tokens_per_step=tokens, **dict(H200, **kw))


def test_3b_keeps_every_block_where_the_gpu_holds_them():
    """3B at 16x1024 on the H200: the whole model on the GPU tier and every block's activations kept; the
    predicted step drops by the recompute (the forward's GPU time)."""
    auto, every = _plan("qwen2.5-3b", 16 * 1024), _plan("qwen2.5-3b", 16 * 1024, {"recompute": "all"})
    assert auto.tiers == every.tiers and not auto.host_names
    assert len(auto.kept_blocks) == auto.num_blocks == 36 and every.kept_blocks == ()
    assert auto.prediction.parts["recompute_s"] == 0 and every.prediction.parts["recompute_s"] > 0
    saved = every.prediction.step_s - auto.prediction.step_s
    assert saved == pytest.approx(every.prediction.parts["recompute_s"], rel=1e-6)
    assert auto.gpu_parts["kept_activations"] > 60 * GIB and "boundaries" in every.gpu_parts
    assert auto.gpu_parts["boundaries"] == 0 and sum(auto.gpu_parts.values()) <= auto.gpu_budget
    text = auto.summary()
    assert "activations: kept 36/36" in text and "predicted step" in text and "recompute=auto" in text
    assert auto.info()["recompute_blocks"] == "kept 36/36" and auto.info()["predicted_step_s"] > 0


def test_14b_never_trades_gpu_tier_layers_for_activations():
    """14B at 16x1024 (K = 4): a GPU-tier layer saves its exposed host update, far more than a kept block's
    recompute: the plan is today's (same tiers), nothing kept."""
    opts = {"checkpoint_interval": 4}
    auto, every = _plan("qwen2.5-14b", 16 * 1024, opts), _plan("qwen2.5-14b", 16 * 1024, dict(opts, recompute="all"))
    assert auto.tiers == every.tiers and auto.kept_blocks == ()
    assert auto.prediction.parts["host_update_exposed_s"] > 0


def test_contested_memory_goes_to_the_faster_split():
    """Where a GPU byte can hold a GPU-tier layer or kept activations, the model picks: with a cheap host
    update (a fast host) the GPU tier shrinks to keep more blocks; with the default (H200) rates it does not
    (3B at 16x1024 on a 64 GiB GPU). The chosen prediction beats recomputing every block with the most GPU
    tier by more than CONTESTED_GAIN."""
    fast_host = dataclasses.replace(cost_model.Rates(), cpu_adamw_gparams=1e3, cpu_adamw_under_copy_gparams=1e3)
    spec = get_preset("qwen2.5-3b")
    numels = {"embed": spec.vocab_size * spec.hidden_size}
    per = (spec.num_params() - numels["embed"] - spec.hidden_size) // spec.num_layers
    numels.update({f"layer.{i}": per for i in range(spec.num_layers)}, final=spec.hidden_size)
    cfg = EngineConfig(checkpoint_interval=1)
    from megatrain.memory import step_shape
    shape = step_shape(cfg, num_layers=36, hidden=2048, ffn=11008, vocab=spec.vocab_size,
                       tokens_per_micro_batch=16 * 1024, compute_bytes=2, on_gpu=True, seq_len=1024)
    kw = dict(setting="auto", on_gpu=True, gpu_free=64 * GIB, host_available=120 * GIB, gpu_margin=6 * GIB,
              host_margin=2 * GIB)
    default = planner.plan(numels, shape, **kw)
    fast = planner.plan(numels, shape, rates=fast_host, **kw)
    assert len(default.kept_blocks) < 36
    assert fast.host_names and len(fast.kept_blocks) > len(default.kept_blocks)
    every = planner.plan(numels, dataclasses.replace(shape, recompute="all"), rates=fast_host, **kw)
    assert fast.prediction.step_s < every.prediction.step_s * (1 - planner.CONTESTED_GAIN)


def test_sequential_micro_batches_keep_every_block_at_3b_64k():
    """3B at 64x1024: in one micro-batch only 7 layers' graphs fit; in 8 micro-batches run one at a time
    (micro_batch_schedule auto -> sequential) every block is kept, and the plan says why."""
    one = _plan("qwen2.5-3b", 64 * 1024)
    eight = _plan("qwen2.5-3b", 64 * 1024, micro_batches=8)
    assert not one.sequential and 0 < len(one.kept_blocks) < 36
    assert eight.sequential and len(eight.kept_blocks) == 36 and not eight.host_names
    assert eight.gpu_parts["grad_accumulators"] == 36 * eight.numels["layer.0"] * 4  # every layer's fp32 sum
    assert eight.prediction.step_s < one.prediction.step_s and "micro-batches: sequential" in eight.summary()
    assert eight.info()["micro_batch_schedule"] == "sequential"
    # below SEQUENTIAL_MIN_TOKENS per micro-batch it stays layer-major
    small = _plan("qwen2.5-3b", 16 * 1024, micro_batches=8)
    assert not small.sequential and "< 4096" in small.schedule_reason
    with pytest.raises(ValueError, match="micro_batch_schedule"):
        EngineConfig(micro_batch_schedule="random")


def test_recompute_none_that_does_not_fit_is_one_line():
    with pytest.raises(placement.DoesNotFit) as err:
        _plan("qwen2.5-7b", 64 * 1024, {"recompute": "none"})
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("model does not fit: GPU needs") and "recompute='auto'" in msg
    assert err.value.placement.kept_blocks  # the plan it tried, for whoever wants its parts


def test_config_rejects_bad_recompute():
    with pytest.raises(ValueError, match="recompute must be"):
        EngineConfig(recompute="some")
    with pytest.raises(ValueError, match="mlp_chunk_tokens"):
        EngineConfig(recompute="none", mlp_chunk_tokens=1024)
    with pytest.raises(ValueError, match="boundary_offload"):
        EngineConfig(recompute="none", boundary_offload="host")


def test_cpu_says_one_memory_and_refuses_in_one_line(monkeypatch):
    """On a CPU there is one memory: the plan prints one host-RAM line (no GPU tier, no 'GPU predicted') and
    a refusal gives one number that includes the activations; "auto" recomputes every block there."""
    import megatrain.engine as engine_mod

    spec = PRESETS["tiny-llama"]
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(), verbose=False)
    text = engine.placement.summary()
    assert "GPU tier" not in text and "GPU predicted" not in text and "host RAM predicted" in text
    assert engine.placement.kept_blocks == () and "CPU run" in engine.placement.recompute_reason
    engine.close()
    monkeypatch.setattr(engine_mod.memory, "available_host_bytes", lambda: 1 << 20)
    with pytest.raises(placement.DoesNotFit) as err:
        MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(), verbose=False)
    msg = str(err.value)
    assert "\n" not in msg and "host needs" in msg and "GiB of RAM (CPU run" in msg and "try" in msg
    assert isinstance(err.value, MemoryError)


def test_k_slots_and_boundaries_come_from_the_plan(monkeypatch):
    """K and the pool's slot count are the plan's (one formula: placement.block_and_slots); the step's
    boundary store is where the plan put the boundaries (here: the plan says 1 on the device, 3 offloaded)."""
    from megatrain import boundaries

    spec = PRESETS["tiny-llama"]
    assert placement.block_and_slots(0, 2, 4) == (4, 5) and placement.block_and_slots(3, 1, 4) == (3, 3)
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(checkpoint_interval=1, micro_batches=1),
                                   verbose=False)
    assert (engine.block, engine.num_pool_slots) == (engine.placement.block, engine.placement.num_pool_slots) == (1, 2)
    engine.placement.boundaries_on_gpu = 1
    made = []
    real = boundaries.HostBoundaries
    monkeypatch.setattr("megatrain.engine.make_boundaries",
                        lambda *a, **kw: made.append(kw["on_gpu"]) or boundaries.make_boundaries(*a, **kw))
    engine.step(batches(spec, steps=1)[0])
    assert made == [1] and engine._boundary_host.plan["boundary_store"] == "host"
    assert engine._boundary_host.plan["boundaries_on_gpu"] == 1 and real is boundaries.HostBoundaries
    engine.close()
