"""Unit checks of the engine's pieces: slots/templates, layout, memory model, LR schedule."""
from __future__ import annotations

import math

import pytest
import torch

from megatrain import EngineConfig, MegaTrain, OptimConfig, PRESETS
from megatrain.arch import flat_layout
from megatrain.memory import estimate_bytes, host_estimate
from megatrain.system import lr_multiplier, step_flops


@pytest.fixture(scope="module")
def engine():
    e = MegaTrain.from_config(PRESETS["tiny-qwen3"].to_hf_config("eager"),
                              EngineConfig(device="cpu", checkpoint_interval=2, num_slots=2), verbose=False)
    yield e
    e.close()


def test_templates_are_views_into_their_slot(engine):
    """Parameters of every template live inside the slot buffer: loading a layer is one bulk copy."""
    for slot in engine.pool.slots:
        lo = slot.buf.data_ptr()
        hi = lo + slot.buf.numel() * slot.buf.element_size()
        for kind, params in slot.params.items():
            names = [n for n, _ in slot.templates[kind].named_parameters()]
            assert len(params) == len(names) == len(engine.layer_groups[0].spans)
            for p in slot.templates[kind].parameters():
                assert lo <= p.data_ptr() < hi


def test_loading_a_layer_makes_the_template_compute_with_it(engine):
    pool = engine.pool
    pool.begin_step([3])
    before = pool.loads
    slot = pool.acquire(3)
    assert pool.loads == before + 1  # one bulk copy
    master = engine.store.param_views("layer.3")
    for (name, p), hf_name in zip(slot.templates["full_attention"].named_parameters(),
                                  engine.layer_groups[3].hf_names):
        assert hf_name.endswith(name)
        torch.testing.assert_close(p.detach(), master[hf_name], rtol=0, atol=0)
    pool.release(slot)


def test_pool_size_holds_a_block_plus_prefetch():
    cfg = EngineConfig(device="cpu", checkpoint_interval=3, num_slots=2)
    e = MegaTrain.from_config(PRESETS["tiny-llama"].to_hf_config("eager"), cfg, verbose=False)
    assert e.num_pool_slots == 3 + 2 - 1
    e.close()


def test_flat_layout_aligns_every_parameter():
    slots, total = flat_layout([("a", (3, 5)), ("b", (7,)), ("c", (2, 2))], align=64)
    assert [s.offset for s in slots] == [0, 64, 128]
    assert total == 192 and all(s.offset % 64 == 0 for s in slots)


def test_memory_estimate_formula():
    est = estimate_bytes([100, 100], 50, grad_slabs=3, bf16_shadow=False)
    p = est["parts"]
    assert p["master_fp32"] == 4 * 250 and p["adam_m_v_fp32"] == 8 * 250
    assert p["grad_slabs"] == 3 * (1 << 24) * 4 and "grads" not in p  # no host gradient buffer
    assert est["total_bytes"] == sum(p.values())
    spec = PRESETS["qwen2.5-7b"]
    big = host_estimate(spec)
    assert big["num_params"] == spec.num_params()
    # 12 B/param + a fixed part (slabs + overhead) <= 4 GiB, for any micro-batch count (issue 8's target)
    for mb in (1, 4):
        est = host_estimate(spec, micro_batches=mb)
        assert est["variable_bytes_per_param"] == 12.0
        assert est["total_bytes"] - 12 * spec.num_params() <= 4 * 2**30


def test_lr_schedule_warmup_then_cosine():
    assert lr_multiplier(0, 4, 10, 0.1) == pytest.approx(0.25)
    assert lr_multiplier(3, 4, 10, 0.1) == pytest.approx(1.0)
    assert lr_multiplier(4, 4, 10, 0.1) == pytest.approx(1.0)
    assert lr_multiplier(7, 4, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(10, 4, 10, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(50, 0, None, 0.0) == 1.0
    assert OptimConfig(lr=2.0, warmup_steps=2).lr_at(0) == pytest.approx(1.0)


def test_step_flops_formula():
    assert step_flops(10, 2, 4, 8, 16) == 6 * 10 * 16 + 12 * 2 * 4 * 8 * 16


def test_engine_config_rejects_bad_values():
    for bad in (dict(num_slots=0), dict(checkpoint_interval=-1), dict(grad_slabs=-1), dict(micro_batches=0),
                dict(stream_dtype="fp8")):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        if not torch.cuda.is_available():
            EngineConfig(device="cuda").resolved_device()
        else:
            raise RuntimeError("CUDA is not available (skip on GPU machines)")


def test_no_double_buffering_means_no_prefetch():
    """num_slots=1 (the ablation): nothing is loaded ahead of the layer compute asks for."""
    cfg = EngineConfig(device="cpu", checkpoint_interval=2, num_slots=1)
    e = MegaTrain.from_config(PRESETS["tiny-llama"].to_hf_config("eager"), cfg, verbose=False)
    pool = e.pool
    assert not pool.prefetch and len(pool.slots) == 2
    pool.begin_step([0, 1, 2, 3])
    slot = pool.acquire(0)
    assert pool.loads == 1 and not pool._issued  # layer 1 not loaded ahead although a slot is free
    pool.release(slot)
    assert pool.loads == 1
    for i in (1, 2, 3):
        pool.release(pool.acquire(i))
    assert pool.loads == 4
    e.close()
