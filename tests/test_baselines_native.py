"""native (plain PyTorch, everything on the device) against the independent reference loop of
tests/reference.py (HF model + torch.optim.AdamW + clip_grad_norm_ + LambdaLR, 2 micro-batches)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatrain.spec import PRESETS
from reference import reference_model, reference_train
from test_baselines_registry import (HAS_CUDA, OPTIM, assert_losses_close, batches, init_dirs,  # noqa: F401
                                     run_system, weight_rel_diffs)

RTOL = 1e-5


def reference_run(preset, init_dir, data, micro_batches=2):
    state = load_file(str(init_dir / "model.safetensors"))
    model = reference_model(PRESETS[preset].to_hf_config("eager"), state)
    return reference_train(model, data, OPTIM, micro_batches)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama"])  # tied and untied embeddings
def test_native_matches_reference(init_dirs, preset):
    data = batches(preset)
    results, final, _, info, _ = run_system("native", init_dirs[preset], data, micro_batches=2)
    ref_losses, ref_state = reference_run(preset, init_dirs[preset], data)
    losses = [r.loss for r in results]
    assert_losses_close(losses, ref_losses, RTOL, "native vs reference")
    init = load_file(str(init_dirs[preset] / "model.safetensors"))
    moved = weight_rel_diffs(final, init)  # training moved every tensor: parity is not vacuous
    assert min(moved.values()) > 1e-3, min(moved.items(), key=lambda kv: kv[1])
    worst = weight_rel_diffs(final, ref_state)
    assert max(worst.values()) <= RTOL, {k: v for k, v in worst.items() if v > RTOL}
    assert [r.lr for r in results] == pytest.approx([OPTIM.lr_at(s) for s in range(len(data))])
    assert all(r.grad_norm > 0 for r in results)


def test_micro_batch_split_and_loss_chunking_do_not_change_the_step(init_dirs):
    """One batch, one step: 1 vs 4 micro-batches, chunked vs full logits -> same loss and grad norm."""
    data = batches("tiny-llama", 1)
    runs = {
        (mb, chunk): run_system("native", init_dirs["tiny-llama"], data, micro_batches=mb,
                                options={"loss_chunk_tokens": chunk})[0][0]
        for mb, chunk in [(1, 0), (4, 0), (1, 7), (4, 5)]
    }
    base = runs[(1, 0)]
    for key, r in runs.items():
        assert r.loss == pytest.approx(base.loss, rel=1e-6), key
        assert r.grad_norm == pytest.approx(base.grad_norm, rel=1e-5), key


def test_labels_and_padding_follow_the_shared_convention(init_dirs):
    """attention_mask zeros become ignored labels; explicit labels win; loss = CE sum / labelled count."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from megatrain.system import IGNORE_INDEX, shift_labels

    batch = batches("tiny-qwen2", 1)[0]
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -5:] = 0
    batch = {"input_ids": batch["input_ids"], "attention_mask": mask}
    results, *_ = run_system("native", init_dirs["tiny-qwen2"], [batch], micro_batches=2)
    model = AutoModelForCausalLM.from_pretrained(str(init_dirs["tiny-qwen2"]), dtype=torch.float32,
                                                 attn_implementation="eager")
    labels = batch["input_ids"].masked_fill(mask == 0, IGNORE_INDEX)
    targets = shift_labels(labels)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=mask).logits
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / int((targets != IGNORE_INDEX).sum())
    assert results[0].loss == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_native_cuda_bf16_close_to_cpu_fp32(init_dirs):
    data = batches("tiny-llama")
    cpu, *_ = run_system("native", init_dirs["tiny-llama"], data)
    gpu, _, memory, info, _ = run_system("native", init_dirs["tiny-llama"], data, device="cuda",
                                         dtype=torch.bfloat16)
    assert info["optimizer"] == "torch.AdamW(fused)" and info["compute_dtype"] == "bfloat16"
    assert_losses_close([r.loss for r in gpu], [r.loss for r in cpu], 2e-2, "native cuda bf16 vs cpu fp32")
    assert memory.gpu_peak_allocated > 0
