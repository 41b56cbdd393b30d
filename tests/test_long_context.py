"""Long context (issue 10): token-chunked MLP recompute, the max_position_embeddings override.

Chunk sizes are chosen not to divide the tokens per micro-batch (2 rows x 16 = 32), so the last chunk is
short and chunks cross row boundaries."""
from __future__ import annotations

import pytest
import torch

from megatrain import EngineConfig, MegaTrain, PRESETS, arch
from megatrain.chunked_mlp import AUTO_CHUNK_TOKENS, AUTO_MIN_TOKENS, resolve_chunk
from megatrain.spec import with_positions
from megatrain.data import synthetic_batch

from test_engine_parity import RTOL, assert_matches_reference, assert_parity, batches, engine_cfg, run_engine


@pytest.mark.parametrize("preset,chunk,interval", [
    ("tiny-llama", 7, 2), ("tiny-qwen2", 5, 1), ("tiny-qwen3", 7, 0), ("tiny-mistral", 13, 2)])
def test_chunked_mlp_parity_with_reference(preset, chunk, interval):
    """Engine with a chunked MLP vs plain HF + torch AdamW: same losses and weights (fp32, 1e-5)."""
    spec = PRESETS[preset]
    assert_parity(spec.to_hf_config("eager"), engine_cfg(checkpoint_interval=interval, mlp_chunk_tokens=chunk),
                  batches(spec))


def test_chunked_mlp_matches_unchunked_engine():
    spec = PRESETS["tiny-qwen2"]
    hf, data = spec.to_hf_config("sdpa"), batches(spec)
    _, plain_losses, plain = run_engine(hf, engine_cfg(checkpoint_interval=2, mlp_chunk_tokens=-1), data)
    _, losses, final = run_engine(hf, engine_cfg(checkpoint_interval=2, mlp_chunk_tokens=6), data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=RTOL, atol=0)
    for name, value in final.items():
        if name.endswith("k_proj.bias"):  # zero true gradient: AdamW amplifies rounding noise (see parity)
            continue
        assert float((value - plain[name]).norm() / plain[name].norm()) <= RTOL, name


def test_resolve_chunk_rules():
    assert resolve_chunk(-1, 10**6) == 0  # never
    assert resolve_chunk(0, AUTO_MIN_TOKENS) == 0  # auto: short sequences run the plain layer
    assert resolve_chunk(0, AUTO_MIN_TOKENS + 1) == AUTO_CHUNK_TOKENS
    assert resolve_chunk(7, 32) == 7
    assert resolve_chunk(32, 32) == 0  # one chunk = unchunked: take the exact plain path


def test_unchunked_path_is_the_hf_layer_bit_for_bit():
    """mlp_chunk_tokens that resolves to no chunking must compute exactly what the HF layer computes."""
    cfg = PRESETS["tiny-qwen3"].to_hf_config("sdpa")
    torch.manual_seed(0)
    layer = type(arch.build_meta_model(cfg).model.layers[0])(cfg, 0)
    rotary = arch.build_rotary(arch.build_meta_model(cfg), torch.device("cpu"))
    x, pos = torch.randn(2, 16, cfg.hidden_size), torch.arange(16).unsqueeze(0)
    mask = arch.make_masks(cfg, x, None, pos)["full_attention"]
    pe = rotary(x, pos)
    want = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    for chunk in (-1, 0, 32):
        torch.testing.assert_close(arch.run_layer(layer, x, mask, pos, pe, chunk), want, rtol=0, atol=0)
    chunked = arch.run_layer(layer, x, mask, pos, pe, 5)
    torch.testing.assert_close(chunked, want, rtol=1e-6, atol=1e-6)


# -- asking for long context ------------------------------------------------------------------------------
def test_with_positions_on_spec_and_hf_config():
    spec = PRESETS["tiny-llama"]
    assert with_positions(spec, 0) is spec
    assert with_positions(spec, 4096).max_position_embeddings == 4096
    hf = spec.to_hf_config("sdpa")
    longer = with_positions(hf, 4096)
    assert longer.max_position_embeddings == 4096 and hf.max_position_embeddings == 512  # a copy
    assert longer.rope_parameters == hf.rope_parameters  # RoPE passed through
    with pytest.raises(ValueError):
        with_positions(spec, -1)


def test_with_positions_keeps_scaled_rope_anchored():
    """yarn's scaling is anchored to the pretraining length: raising the maximum keeps the anchor."""
    from transformers import AutoConfig

    hf = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128, vocab_size=256, num_hidden_layers=2,
                              max_position_embeddings=512,
                              rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    longer = with_positions(hf, 2048)
    assert longer.rope_parameters["original_max_position_embeddings"] == 512
    assert longer.rope_parameters["factor"] == 4.0


def test_engine_override_allows_longer_sequences():
    spec = PRESETS["tiny-llama"]  # 512 positions
    hf = spec.to_hf_config("sdpa")
    data = [synthetic_batch(spec.vocab_size, 1, 600, 0, s) for s in range(3)]
    engine = MegaTrain.from_config(hf, EngineConfig(device="cpu"), verbose=False)
    with pytest.raises(ValueError, match="max_position_embeddings=600"):  # the error names the knob
        engine.step(data[0])
    engine.close()
    # 600 positions past the preset's 512, MLP chunks of 256 (the last one short): the
    # same training as plain PyTorch on the HF model with max_position_embeddings=1024 (fp32, 1e-5)
    cfg = engine_cfg(max_position_embeddings=1024, mlp_chunk_tokens=256, checkpoint_interval=2, micro_batches=1)
    engine = MegaTrain.from_config(hf, cfg, verbose=False)
    assert engine.config.max_position_embeddings == 1024
    engine.close()
    init, losses, final = run_engine(hf, cfg, data)
    assert_matches_reference(with_positions(hf, 1024), init, losses, final, data, micro_batches=1)
