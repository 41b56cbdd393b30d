"""GGUF import: parity with transformers' own GGUF loader on tiny GGUF files the test writes itself.

Weights: ours == transformers' de-quantized tensors exactly (F32, Q8_0, Q4_1; Llama tied with permuted q/k,
Qwen2 untied with biases), and the F32 export round-trips to the original weights exactly. Tokenizer and
chat template kept. Training: the engine built from the .gguf takes the same first step as plain PyTorch
on transformers' GGUF-loaded model (loss at 1e-5 in fp32, weights after the update at 1e-5).
"""
from __future__ import annotations

import glob

import pytest
import torch

pytest.importorskip("gguf", reason="pip install gguf (in the test extra)")

from gguf_tiny import random_model, write_gguf  # noqa: E402

from megatrain import EngineConfig, MegaTrain, OptimConfig  # noqa: E402
from megatrain import gguf_import  # noqa: E402
from megatrain.system import IGNORE_INDEX  # noqa: E402

CASES = [("llama", True, "F32"), ("llama", True, "Q8_0"), ("llama", True, "Q4_1"), ("qwen2", False, "Q8_0")]


def load_folder(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in glob.glob(str(path) + "/model-*.safetensors"):
        out.update(load_file(f))
    return out


def transformers_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


@pytest.mark.parametrize("family,tied,qtype", CASES)
def test_weights_equal_transformers_gguf_load(tmp_path, family, tied, qtype):
    model = random_model(family, tied)
    path = write_gguf(model, tmp_path / f"tiny-{qtype}.gguf", qtype)
    out = gguf_import.convert(path, tmp_path / "hf")
    ours, ref = load_folder(out), transformers_gguf(path).state_dict()
    expected = {k for k in model.state_dict() if not (tied and k == "lm_head.weight")}
    assert set(ours) == expected
    for name, t in ours.items():
        assert t.dtype == torch.float32
        torch.testing.assert_close(t, ref[name], rtol=0, atol=0, msg=name)
        if qtype == "F32":  # lossless export: the permutation and the names round-trip exactly
            torch.testing.assert_close(t, model.state_dict()[name], rtol=0, atol=0, msg=name)
    # quantized: close to the original, not garbage (Q4_1 steps are ~1/15 of a 32-value block's range)
    worst = max(float((ours[k] - model.state_dict()[k]).abs().max()) for k in ours)
    assert worst < {"F32": 1e-9, "Q8_0": 2e-3, "Q4_1": 2e-2}[qtype]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(out))
    assert config.model_type == family and config.tie_word_embeddings == tied


def test_tokenizer_and_chat_template_kept(tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(random_model(), tmp_path / "tiny.gguf", "Q8_0")
    out = gguf_import.convert(path, tmp_path / "hf")
    ours = AutoTokenizer.from_pretrained(str(out))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert ours(text)["input_ids"] == ref(text)["input_ids"]
    assert ours.convert_tokens_to_ids("<|im_end|>") == ref.convert_tokens_to_ids("<|im_end|>")
    assert ours.eos_token == ref.eos_token


def reference_first_step(model, batch, optim: OptimConfig):
    """One plain-PyTorch AdamW step (clipping at optim.max_grad_norm); returns (loss, grad_norm)."""
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay, foreach=False)
    labels = batch["labels"]
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.max_grad_norm)
    opt.step()
    return float(loss.detach()), float(norm)


@pytest.mark.parametrize("family,tied,qtype", [("llama", True, "Q4_1"), ("qwen2", False, "Q8_0")])
def test_engine_from_gguf_first_step_equals_pytorch(tmp_path, family, tied, qtype):
    path = write_gguf(random_model(family, tied), tmp_path / "tiny.gguf", qtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (4, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0  # a padded row, labels -100 there and on a "prompt" span
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, :6] = IGNORE_INDEX
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    optim = OptimConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=0.5)
    engine = MegaTrain.from_pretrained(str(path), EngineConfig(device="cpu", micro_batches=2, checkpoint_interval=1,
                                                               optim=optim), verbose=False)
    ref = transformers_gguf(path).train()
    try:
        for name, t in ref.state_dict().items():  # the engine starts from transformers' de-quantized weights
            if not (tied and name == "lm_head.weight"):
                torch.testing.assert_close(engine.state_dict()[name], t, rtol=0, atol=0)
        result = engine.step(batch)
        loss, norm = reference_first_step(ref, batch, optim)
        assert abs(result.loss - loss) < 1e-5 and abs(result.grad_norm - norm) < 1e-5 * max(1.0, norm)
        assert norm > optim.max_grad_norm  # clipping fired: the comparison covers it
        after = engine.state_dict()
        for name, t in ref.state_dict().items():
            if not (tied and name == "lm_head.weight"):
                torch.testing.assert_close(after[name], t.detach(), rtol=1e-5, atol=1e-5, msg=name)
    finally:
        engine.close()


def test_cli_and_errors(tmp_path, capsys):
    path = write_gguf(random_model(), tmp_path / "tiny.gguf", "Q8_0")
    assert gguf_import.main([str(path), str(tmp_path / "out")]) == 0
    assert "llama, 2 layers" in capsys.readouterr().out
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    assert gguf_import.main([str(not_gguf), str(tmp_path / "o2")]) == 2
    assert "not a GGUF file" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gguf_import.convert(tmp_path / "missing.gguf", tmp_path / "o3")
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
