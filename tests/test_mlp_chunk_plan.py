"""mlp_chunk_tokens = 0 ("auto") decided by the placement plan: unchunked where the unchunked plan fits and
places everything as the chunked one does, chunks of 16384 otherwise (megatrain/planner.py); the engine
runs the plan's resolved value (megatrain/engine.py ``_mlp_chunk``).

Measured reason (H200, commit 34edccb): the 3B shape at 158x1024 tokens ran chunked at 291.6 TFLOPS with the
whole model on the GPU tier, against 347.6 at 128K unchunked. The new rule itself is not yet measured on a
GPU; these tests check the plan's arithmetic and that the engine does what the plan says."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain import PRESETS, arch
from megatrain import boundaries as boundaries_mod
from megatrain import engine as engine_mod
from megatrain import placement as placement_mod
from megatrain import planner
from megatrain.activations import gpu_working_set
from megatrain.chunked_mlp import AUTO_CHUNK_TOKENS, AUTO_MIN_TOKENS
from megatrain.engine import MegaTrain
from megatrain.memory import plan_for_spec
from megatrain.spec import get_preset

from test_engine_parity import assert_parity, batches, engine_cfg

GIB = 2**30
K = 1024
H200 = dict(gpu_free=139 * GIB, host_available=124 * GIB)  # the H200 node as the tokens sweep saw it


def _plan(model, tokens, options=None, **kw):
    spec = dataclasses.replace(get_preset(model), max_position_embeddings=1 << 20)
    return plan_for_spec(spec, options or {}, tokens_per_step=tokens, **dict(H200, **kw))


def _gpu_total(plan):
    return sum(plan.gpu_parts.values())


# -- the plan ----------------------------------------------------------------------------------------
def test_3b_at_158k_runs_unchunked_where_it_fits():
    """The measured case: everything on the GPU tier either way, so "auto" no longer chunks."""
    auto = _plan("qwen2.5-3b", 158 * K)
    chunked = _plan("qwen2.5-3b", 158 * K, {"mlp_chunk_tokens": AUTO_CHUNK_TOKENS})
    never = _plan("qwen2.5-3b", 158 * K, {"mlp_chunk_tokens": -1})
    assert 158 * K > AUTO_MIN_TOKENS  # the threshold rule alone would chunk here
    assert auto.mlp_chunk_tokens == -1 and "MLP chunk: none (auto: fits unchunked)" in auto.summary()
    assert chunked.mlp_chunk_tokens == AUTO_CHUNK_TOKENS
    # Same placement both ways: all 36 layers + embedding + head on the GPU tier, gradients on the GPU, every
    # boundary on the GPU. The prediction is the unchunked one (what the engine will run).
    assert auto.tiers == chunked.tiers and auto.gpu_layers == 36 and not auto.host_names
    assert auto.grads == chunked.grads == "gpu" and auto.boundaries_on_gpu is chunked.boundaries_on_gpu is None
    assert auto.gpu_parts == never.gpu_parts and auto.gpu_parts["mlp_grad_accum"] == 0
    assert auto.gpu_parts["block_recompute"] > 2 * chunked.gpu_parts["block_recompute"]  # the t x f terms
    assert _gpu_total(chunked) < _gpu_total(auto) <= auto.gpu_budget
    assert f"GPU predicted {_gpu_total(auto) / GIB:.2f} GiB" in auto.summary()


def test_7b_at_256k_keeps_chunking():
    """Unchunked, the 7B shape at 256K tokens does not fit (the GPU tier is given up and the boundaries
    spill to the host, which then overflows); with room on the host it would still put fewer layers on the
    GPU tier. Either way "auto" chunks."""
    auto = _plan("qwen2.5-7b", 256 * K)
    chunked = _plan("qwen2.5-7b", 256 * K, {"mlp_chunk_tokens": AUTO_CHUNK_TOKENS})
    assert auto.mlp_chunk_tokens == AUTO_CHUNK_TOKENS
    assert auto.tiers == chunked.tiers and auto.gpu_parts == chunked.gpu_parts and auto.gpu_layers == 5
    assert "MLP chunk: 16384 tokens (auto: unchunked would not fit (host needs" in auto.summary()
    with pytest.raises(MemoryError, match="host needs"):
        _plan("qwen2.5-7b", 256 * K, {"mlp_chunk_tokens": -1})
    roomy = _plan("qwen2.5-7b", 256 * K, host_available=1 << 62)
    unchunked = _plan("qwen2.5-7b", 256 * K, {"mlp_chunk_tokens": -1}, host_available=1 << 62)
    assert unchunked.gpu_layers < roomy.gpu_layers and roomy.mlp_chunk_tokens == AUTO_CHUNK_TOKENS
    assert "unchunked would put" in roomy.mlp_chunk_reason


@pytest.mark.parametrize("model,tokens,kw,lost,what", [
    ("qwen2.5-3b", 256 * K, {}, "put ", lambda c, u: u.gpu_layers < c.gpu_layers),
    ("qwen2.5-7b", 136 * K, dict(gpu_free=80 * GIB, host_available=1 << 62), "gradients to the host",
     lambda c, u: c.grads == "gpu" and u.grads == "host" and c.tiers == u.tiers),
    ("qwen2.5-3b", 192 * K, dict(gpu_free=60 * GIB), "offload more block boundaries",
     lambda c, u: c.tiers == u.tiers and u.boundaries_on_gpu < c.boundaries_on_gpu),
])
def test_auto_chunks_when_unchunked_would_place_less_on_the_gpu(model, tokens, kw, lost, what):
    """Each thing the unchunked plan must not give up: GPU-tier layers, the gradients' GPU home, boundaries
    kept on the GPU. The unchunked plan fits in each case; "auto" chunks anyway."""
    auto = _plan(model, tokens, **kw)
    chunked = _plan(model, tokens, {"mlp_chunk_tokens": AUTO_CHUNK_TOKENS}, **kw)
    unchunked = _plan(model, tokens, {"mlp_chunk_tokens": -1}, **kw)
    assert what(chunked, unchunked)
    assert auto.mlp_chunk_tokens == AUTO_CHUNK_TOKENS and lost in auto.mlp_chunk_reason
    assert auto.tiers == chunked.tiers and auto.gpu_parts == chunked.gpu_parts


@pytest.mark.parametrize("asked", [8192, -1])
def test_explicit_values_are_never_changed(asked):
    plan = _plan("qwen2.5-3b", 158 * K, {"mlp_chunk_tokens": asked})
    assert plan.mlp_chunk_tokens == asked
    assert ("MLP chunk: 8192 tokens (asked)" if asked > 0 else "MLP chunk: none (asked: never)") in plan.summary()
    # below the threshold too, where "auto" would not chunk at all
    assert _plan("qwen2.5-3b", 16 * K, {"mlp_chunk_tokens": 8192}).mlp_chunk_tokens == 8192


@pytest.mark.parametrize("tokens", [16 * K, AUTO_MIN_TOKENS])
def test_below_the_threshold_auto_is_unchunked(tokens):
    plan = _plan("qwen2.5-3b", tokens)
    assert plan.mlp_chunk_tokens == -1
    assert f"MLP chunk: none (auto: <= {AUTO_MIN_TOKENS} tokens per micro-batch)" in plan.summary()
    assert plan.gpu_parts == _plan("qwen2.5-3b", tokens, {"mlp_chunk_tokens": -1}).gpu_parts


def test_tokens_per_micro_batch_decide_not_tokens_per_step():
    """2 micro-batches of 79K: below the threshold per micro-batch, unchunked by the rule itself."""
    plan = _plan("qwen2.5-3b", 158 * K, micro_batches=2)
    assert plan.mlp_chunk_tokens == -1 and "auto: <=" in plan.mlp_chunk_reason


def _shape(tokens, chunk):
    """A tiny step shape for planner.plan directly."""
    return placement_mod.StepShape(num_layers=2, hidden=8, ffn=32, vocab=16, micro_batches=1,
                                   tokens_per_micro_batch=tokens, block=1, num_pool_slots=2, compute_bytes=4,
                                   stream_fp32=True, bf16_shadow=False, slab_bytes_total=0, loss_chunk_tokens=64,
                                   mlp_chunk_tokens=chunk)


def test_cpu_keeps_the_threshold_rule():
    """on_gpu False: one memory, nothing to decide; "auto" chunks above the threshold as before."""
    numels = {"embed": 128, "layer.0": 1000, "layer.1": 1000, "final": 8}
    kw = dict(setting="auto", gpu_free=0, host_available=1 << 62, gpu_margin=0, host_margin=0)
    cpu = planner.plan(numels, _shape(AUTO_MIN_TOKENS + 1, 0), on_gpu=False, **kw)
    assert cpu.mlp_chunk_tokens == AUTO_CHUNK_TOKENS and "auto: > 131072" in cpu.summary()
    gpu = planner.plan(numels, _shape(AUTO_MIN_TOKENS + 1, 0), on_gpu=True, **dict(kw, gpu_free=1 << 62))
    assert gpu.mlp_chunk_tokens == -1  # the same shape on a roomy GPU: unchunked
    want = gpu_working_set(num_layers=2, hidden=8, ffn=32, vocab=16, micro_batches=1,
                           tokens_per_micro_batch=AUTO_MIN_TOKENS + 1, block=1, compute_bytes=4,
                           loss_chunk_tokens=64, mlp_chunk_tokens=-1)
    assert all(gpu.gpu_parts[k] == v for k, v in want.items())  # predicted with what runs


# -- the engine --------------------------------------------------------------------------------------
def _plan_says(monkeypatch, chunk):
    """Make the engine's plan resolve MLP chunking to ``chunk`` (whatever the config asks)."""
    real = planner.plan

    def plan(*a, **kw):
        p = real(*a, **kw)
        p.mlp_chunk_tokens, p.mlp_chunk_reason = chunk, "test"
        return p

    monkeypatch.setattr(planner, "plan", plan)


def _spy_run_layer(monkeypatch):
    seen, real = [], arch.run_layer

    def run_layer(*a):
        seen.append(a[5])
        return real(*a)

    monkeypatch.setattr(arch, "run_layer", run_layer)
    return seen


def _spy_boundaries(monkeypatch):
    seen, real = [], engine_mod.make_boundaries

    def make_boundaries(*a, **kw):
        seen.append(kw["on_gpu"])  # the plan's boundary decision (no second one at step time)
        return real(*a, **kw)

    monkeypatch.setattr(engine_mod, "make_boundaries", make_boundaries)
    return seen


def test_engine_runs_the_plans_chunk_and_falls_back_above_the_plan(monkeypatch):
    """Config: never chunk. Plan: chunks of 5. A step within the plan's tokens runs 5 (forward and
    recompute; the boundaries are where the plan put them); a longer one falls back to the config's -1."""
    _plan_says(monkeypatch, 5)
    seen, budget = _spy_run_layer(monkeypatch), _spy_boundaries(monkeypatch)
    spec = PRESETS["tiny-llama"]
    engine = MegaTrain.from_config(spec.to_hf_config("sdpa"), engine_cfg(mlp_chunk_tokens=-1), verbose=False,
                                   tokens_per_step=64)  # 2 micro-batches of 32 tokens
    assert engine.placement.mlp_chunk_tokens == 5 and engine.memory().extra["mlp_chunk_tokens"] == 5
    engine.step(batches(spec, steps=1, bsz=4, seq=16)[0])
    calls = 2 * spec.num_layers * 2  # forward + recompute, per micro-batch, per layer
    assert seen == [5] * calls and budget == [None]
    seen.clear()
    with pytest.warns(RuntimeWarning, match="placement plan was made for 32"):
        engine.step(batches(spec, steps=1, bsz=4, seq=32)[0])  # 64 tokens per micro-batch
    assert seen == [-1] * calls and budget == [None, None]
    engine.close()


@pytest.mark.parametrize("preset,asked", [("tiny-qwen2", -1), ("tiny-llama", 0)])
def test_parity_with_the_plans_chunk(monkeypatch, preset, asked):
    """The plan-resolved chunked path matches plain PyTorch (fp32, 1e-5), and it is the chunked path that
    ran: the config alone (-1, or "auto" at 32 tokens) would not chunk."""
    _plan_says(monkeypatch, 5)  # does not divide 32 tokens: a short last chunk, chunks across rows
    chunked, real = [], arch.tokenwise_checkpoint

    def tokenwise_checkpoint(fn, chunk, x, params):
        chunked.append(chunk)
        return real(fn, chunk, x, params)

    monkeypatch.setattr(arch, "tokenwise_checkpoint", tokenwise_checkpoint)
    spec = PRESETS[preset]
    assert_parity(spec.to_hf_config("eager"), engine_cfg(checkpoint_interval=2, mlp_chunk_tokens=asked),
                  batches(spec))
    assert chunked and set(chunked) == {5}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_auto_runs_a_long_micro_batch_unchunked():
    """On a GPU a tiny model above the threshold fits unchunked: the plan says so and the step runs it."""
    from megatrain import EngineConfig
    from megatrain.data import synthetic_batch

    spec = PRESETS["tiny-llama"]
    seq = AUTO_MIN_TOKENS + 1024
    cfg = EngineConfig(device="cuda", max_position_embeddings=seq, mlp_chunk_tokens=0)
    engine = MegaTrain.from_config(spec.to_hf_config("sdpa"), cfg, verbose=False, tokens_per_step=seq, seq_len=seq)
    assert engine.placement.mlp_chunk_tokens == -1 and engine.placement.mlp_chunk_reason == "auto: fits unchunked"
    loss = engine.step(synthetic_batch(spec.vocab_size, 1, seq, 0, 0)).loss
    assert loss == loss
    engine.close()
