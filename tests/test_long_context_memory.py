"""Long context (issue 10): the GPU activation memory model and a measured CPU check of one layer.

Claim under test: with the chunked MLP, a layer's working memory grows with the sequence only through
attention terms (multiples of t·h), not through the MLP's t·f intermediates."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megatrain import ModelSpec, arch
from megatrain.activations import gpu_working_set, host_boundary_bytes

SEVEN_B = dict(num_layers=28, hidden=3584, ffn=18944, vocab=152064, micro_batches=1, block=1, compute_bytes=2,
               loss_chunk_tokens=4096, kv_hidden=512)
K = 1024


def per_layer(t, mlp_chunk_tokens, **kw):
    shape = dict(SEVEN_B, **kw)
    ws = gpu_working_set(tokens_per_micro_batch=t, mlp_chunk_tokens=mlp_chunk_tokens, **shape)
    return ws["block_recompute"] + ws["mlp_grad_accum"]


def test_chunked_working_set_grows_only_through_attention_terms():
    for ffn in (18944, 4 * 18944):  # the growth with t must not depend on the FFN size
        growth = per_layer(512 * K, 8192, ffn=ffn) - per_layer(256 * K, 8192, ffn=ffn)
        h, kv, c, dt = 3584, 512, 2, 256 * K
        assert growth == (7 * h + 2 * kv + 6 * h) * c * dt  # exactly the attention terms
    unchunked = per_layer(512 * K, -1) - per_layer(256 * K, -1)
    assert unchunked > 3 * growth  # the model would have caught an MLP term that grows with t


def test_seven_b_at_512k_per_layer_fits_only_chunked():
    """The issue's numbers: unchunked, one 7B layer at 512K needs > 140 GB; chunked it is ~50 GB."""
    assert per_layer(512 * K, -1) > 140e9
    assert per_layer(512 * K, 0) < 60e9  # "auto" chunks at this length


def test_auto_chunk_equals_unchunked_for_short_sequences():
    assert per_layer(16 * K, 0) == per_layer(16 * K, -1)


def test_offloaded_boundaries_cost_two_on_gpu_and_the_rest_on_host():
    t = 512 * K
    one = t * 3584 * 2
    gpu = gpu_working_set(tokens_per_micro_batch=t, **SEVEN_B)["boundaries"]
    off = gpu_working_set(tokens_per_micro_batch=t, boundaries_on_gpu=0, **SEVEN_B)["boundaries"]
    part = gpu_working_set(tokens_per_micro_batch=t, boundaries_on_gpu=10, **SEVEN_B)["boundaries"]
    assert gpu == 28 * one and off == 2 * one and part == 12 * one
    shape = {k: SEVEN_B[k] for k in ("num_layers", "hidden", "micro_batches", "block", "compute_bytes")}
    assert host_boundary_bytes(tokens_per_micro_batch=t, **shape) == 28 * one
    assert host_boundary_bytes(tokens_per_micro_batch=t, boundaries_on_gpu=10, **shape) == 18 * one
    assert host_boundary_bytes(tokens_per_micro_batch=t, gpu_budget_bytes=10 * one + 5, **shape) == 18 * one


# -- measured on the CPU -----------------------------------------------------------------------------------
H, FFN = 64, 1024


@pytest.fixture(scope="module")
def layer():
    cfg = ModelSpec("qwen2", H, 1, 4, 2, FFN, 256).to_hf_config("sdpa")
    meta = arch.build_meta_model(cfg)
    torch.manual_seed(0)
    return cfg, type(meta.model.layers[0])(cfg, 0), arch.build_rotary(meta, torch.device("cpu"))


def measure(layer, seq, chunk):
    """(bytes saved for backward by one layer's recompute, peak bytes of recompute + backward)."""
    cfg, mod, rotary = layer
    x, pos = torch.randn(1, seq, H), torch.arange(seq).unsqueeze(0)
    mask = arch.make_masks(cfg, x, None, pos)["full_attention"]
    pe = rotary(x, pos)
    params = {p.untyped_storage().data_ptr() for p in mod.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:  # weights are not activations
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        xi = x.requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = arch.run_layer(mod, xi, mask, pos, pe, chunk)
        torch.autograd.grad(y, [xi, *mod.parameters()], torch.ones_like(y))
        del y
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):  # net bytes per op, in time order
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return sum(saved.values()), peak


def test_measured_layer_memory_growth_is_attention_only(layer):
    (s1, p1), (s2, p2) = measure(layer, 256, 64), measure(layer, 1024, 64)
    (u1, q1), (u2, q2) = measure(layer, 256, -1), measure(layer, 1024, -1)
    dt, c = 1024 - 256, 4
    # Chunked: saved activations grow by under 8 t·h units, and below the model's attention terms.
    assert s2 - s1 <= 8 * dt * H * c
    model = lambda t, ch: gpu_working_set(num_layers=1, hidden=H, ffn=FFN, vocab=256, micro_batches=1,
                                          tokens_per_micro_batch=t, block=1, compute_bytes=c,
                                          loss_chunk_tokens=t, mlp_chunk_tokens=ch, kv_hidden=32)["block_recompute"]
    assert 0 < p2 - p1 <= model(1024, 64) - model(256, 64)  # measured peak growth within the model's bound
    # Unchunked the MLP's t·f intermediates are there: the same check would fail.
    assert u2 - u1 > 4 * FFN * dt * c * 0.9
    assert q2 - q1 > 4 * (p2 - p1)


def test_choose_block_trades_boundaries_for_recompute():
    from megatrain.activations import choose_block

    shape = {k: v for k, v in SEVEN_B.items() if k != "block"}
    t, G = 512 * K, 2**30
    one = t * 3584 * 2
    # plenty of both: K = 1 with every boundary on the GPU
    assert choose_block(gpu_bytes=400 * G, host_bytes=0, tokens_per_micro_batch=t, mlp_chunk_tokens=0,
                        **shape) == (1, 28)
    # GPU short, host generous: K = 1, the rest offloaded
    k, on_gpu = choose_block(gpu_bytes=120 * G, host_bytes=200 * G, tokens_per_micro_batch=t, mlp_chunk_tokens=0,
                             **shape)
    assert k == 1 and 0 < on_gpu < 28
    # no host room: only a larger K (fewer boundaries) fits, or nothing does
    assert choose_block(gpu_bytes=150 * G, host_bytes=0, tokens_per_micro_batch=t, mlp_chunk_tokens=0,
                        **shape) == (2, 14)
    assert choose_block(gpu_bytes=100 * G, host_bytes=0, tokens_per_micro_batch=t, mlp_chunk_tokens=0, **shape) is None
    # a little host room lets K = 1 run on the same GPU, its first boundaries offloaded
    k, on_gpu = choose_block(gpu_bytes=150 * G, host_bytes=20 * one, tokens_per_micro_batch=t, mlp_chunk_tokens=0,
                             **shape)
    assert k == 1 and 28 - on_gpu <= 20


def test_plan_puts_offloaded_boundaries_on_the_host_side():
    """The placement plan counts boundaries where they will live: on the host with boundary_offload="host";
    with "auto", on the GPU while they fit beside the working set, the rest on the host (as
    megatrain.boundaries decides at step time); and it refuses with the host's numbers when neither fits."""
    import dataclasses

    from megatrain.memory import plan_for_spec
    from megatrain.spec import get_preset

    gib = 2**30
    spec = dataclasses.replace(get_preset("qwen2.5-7b"), max_position_embeddings=512 * K)
    per = 256 * K * 3584 * 2  # one 256K boundary in bf16
    kw = dict(tokens_per_step=256 * K, gpu_free=139 * gib, host_available=124 * gib)
    host = plan_for_spec(spec, {"boundary_offload": "host"}, **kw)
    assert host.host_parts["offloaded_boundaries"] == 28 * per
    auto = plan_for_spec(spec, {"boundary_offload": "auto"}, **kw)  # fits with all 28 on the GPU
    assert auto.host_parts["offloaded_boundaries"] == 0 and auto.gpu_parts["boundaries"] == 28 * per
    # a GPU too small for all of them: pure streaming keeps g on the GPU (+2 in flight), 28 - g on the host
    small = plan_for_spec(spec, {"boundary_offload": "auto"}, **dict(kw, gpu_free=100 * gib))
    g = small.gpu_parts["boundaries"] // per - 2
    assert 0 < g < 28 and small.host_parts["offloaded_boundaries"] == (28 - g) * per
    assert sum(small.gpu_parts.values()) <= 94 * gib and not small.gpu_names
    # 512K: boundaries (98 GiB) + working set + the 85 GiB model state exceed GPU + host: refused, host numbers
    with pytest.raises(MemoryError, match="host needs"):
        plan_for_spec(spec, {"boundary_offload": "auto"}, **dict(kw, tokens_per_step=512 * K))
