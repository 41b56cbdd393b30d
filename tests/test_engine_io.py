"""Checkpoints (HF dir in, save -> load -> continue) and bad input (clear error, nothing half-written)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain import EngineConfig, MegaTrain, OptimConfig, PRESETS
from megatrain.checkpoint import write_initial_weights
from megatrain.data import synthetic_batch

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1, total_steps=8)


def cfg(**kw):
    return EngineConfig(**{"device": "cpu", "micro_batches": 2, "checkpoint_interval": 2, "optim": OPTIM, **kw})


def data(spec, n, start=0):
    return [synthetic_batch(spec.vocab_size, 4, 16, 3, s) for s in range(start, start + n)]


def test_from_pretrained_matches_from_same_weights(tmp_path):
    """An HF save_pretrained folder (sharded) trains exactly like the engine built on the same weights."""
    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf)
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()  # really sharded
    a = MegaTrain.from_pretrained(tmp_path / "hf", cfg(), verbose=False)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(a.state_dict()[name], value, rtol=0, atol=0)
    # Same weights handed over as a fresh init folder written by the engine itself:
    a.save(tmp_path / "copy")
    b = MegaTrain.from_pretrained(tmp_path / "copy", cfg(), verbose=False)
    la = [a.step(x).loss for x in data(spec, 3)]
    lb = [b.step(x).loss for x in data(spec, 3)]
    assert la == lb
    a.close(), b.close()


def test_engine_save_is_loadable_by_hf(tmp_path):
    spec = PRESETS["tiny-qwen2"]
    e = MegaTrain.from_config(spec.to_hf_config("eager"), cfg(), verbose=False)
    e.step(data(spec, 1)[0])
    step_dir = e.save(tmp_path / "ck")
    assert step_dir == tmp_path / "ck" / "step-000001"  # HF reads a step folder (the root resolves for MegaTrain)
    hf = AutoModelForCausalLM.from_pretrained(step_dir)
    ours = e.state_dict()
    for name, value in hf.state_dict().items():
        key = "model.embed_tokens.weight" if name == "lm_head.weight" else name  # tied
        torch.testing.assert_close(value, ours[key], rtol=0, atol=0)
    e.close()


def test_save_load_continue_equals_uninterrupted(tmp_path):
    spec = PRESETS["tiny-qwen3"]
    hf = spec.to_hf_config("eager")
    full = MegaTrain.from_config(hf, cfg(), verbose=False)
    losses_full = [full.step(x).loss for x in data(spec, 6)]
    full.close()
    first = MegaTrain.from_config(hf, cfg(), verbose=False)
    losses = [first.step(x).loss for x in data(spec, 3)]
    first.save(tmp_path / "ck")
    first.close()
    resumed = MegaTrain.load(tmp_path / "ck", verbose=False)
    assert resumed.step_count == 3
    losses += [resumed.step(x).loss for x in data(spec, 3, start=3)]
    resumed.close()
    assert losses == losses_full


def test_write_initial_weights_equals_engine_init(tmp_path):
    spec = PRESETS["tiny-qwen2"]
    write_initial_weights(spec, tmp_path / "init", seed=5)
    a = MegaTrain.from_pretrained(tmp_path / "init", cfg(), verbose=False)
    b = MegaTrain.from_config(spec.to_hf_config(), cfg(seed=5), verbose=False)
    for name, value in a.state_dict().items():
        torch.testing.assert_close(value, b.state_dict()[name], rtol=0, atol=0)
    assert float(a.state_dict()["model.layers.0.mlp.up_proj.weight"].std()) == pytest.approx(0.02, rel=0.2)
    a.close(), b.close()


# -- bad input ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    spec = PRESETS["tiny-llama"]
    e = MegaTrain.from_config(spec.to_hf_config("eager"), cfg(micro_batches=1), verbose=False)
    yield e
    e.close()


def _snapshot(e):
    return {k: v.clone() for k, v in e.state_dict().items()}


@pytest.mark.parametrize("batch, match", [
    ({"input_ids": torch.zeros(0, 16, dtype=torch.long)}, "empty batch"),
    ({"input_ids": torch.randint(0, 256, (2, 513))}, "exceeds the model's max_position_embeddings"),
    ({"input_ids": torch.full((2, 8), 256)}, r"token ids must be in \[0, 256\)"),
    ({"input_ids": torch.full((2, 8), -1)}, r"token ids must be in \[0, 256\)"),
    ({"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.full((2, 8), -100)}, "no labelled tokens"),
    ({"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.ones(2, 7, dtype=torch.long)}, "shape"),
    ({"input_ids": torch.ones(8, dtype=torch.long)}, "2-D"),
    ({"tokens": torch.ones(2, 8, dtype=torch.long)}, "input_ids"),
])
def test_bad_batches_raise_and_change_nothing(engine, batch, match):
    before = _snapshot(engine)
    step = engine.step_count
    with pytest.raises(ValueError, match=match):
        engine.step(batch)
    assert engine.step_count == step
    after = _snapshot(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # still usable afterwards
    engine.step({"input_ids": torch.randint(0, 256, (2, 8))})


def test_unknown_architecture_names_supported():
    from transformers import AutoConfig

    gpt2 = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2)
    with pytest.raises(ValueError, match="llama, qwen2, qwen3, mistral"):
        MegaTrain.from_config(gpt2, cfg(), verbose=False)


def test_model_too_big_for_host_is_refused_with_numbers(monkeypatch):
    from megatrain import memory

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 2 * 2**30)
    spec = PRESETS["qwen2.5-7b"]  # ~7.6B params: 100+ GiB
    with pytest.raises(MemoryError, match=r"host needs \d+\.\d+ GiB of RAM .* but 2\.00 GiB is available") as e:
        MegaTrain.from_config(spec.to_hf_config(), cfg(), verbose=False)
    assert "\n" not in str(e.value)  # one line a user can act on


def test_missing_checkpoint_pieces(tmp_path):
    spec = PRESETS["tiny-llama"]
    write_initial_weights(spec, tmp_path / "ck")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MegaTrain.from_pretrained(tmp_path / "nope", cfg(), verbose=False)
    # a shard named by the index is gone
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    os.rename(tmp_path / "ck" / shard, tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match="missing weight files"):
        MegaTrain.from_pretrained(tmp_path / "ck", cfg(), verbose=False)
    os.rename(tmp_path / "moved", tmp_path / "ck" / shard)
    # a tensor is missing from the index
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "ck" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match="lacks tensors: model.layers.1.mlp.up_proj.weight"):
        MegaTrain.from_pretrained(tmp_path / "ck", cfg(), verbose=False)
    (tmp_path / "ck" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        MegaTrain.from_pretrained(tmp_path / "ck", cfg(), verbose=False)
    # MegaTrain.load on plain weights says what is missing
    write_initial_weights(spec, tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="engine_state.json"):
        MegaTrain.load(tmp_path / "plain", verbose=False)


def test_failed_save_leaves_previous_save_intact(tmp_path, monkeypatch):
    spec = PRESETS["tiny-llama"]
    e = MegaTrain.from_config(spec.to_hf_config("eager"), cfg(), verbose=False)
    e.save(tmp_path / "ck")
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    from megatrain import checkpoint

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_write_shards", boom)
    with pytest.raises(OSError, match="disk full"):
        e.save(tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before  # no half step folder, latest unchanged
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-000000"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    MegaTrain.load(tmp_path / "ck", verbose=False).close()
    e.close()
