"""FSDP2 (fully_shard per decoder layer + root, gloo, in-process) against native on the tiny models.

On CPU both run fp32 without offload; observed: losses identical to ~1e-7 relative, final weights within
~1e-6 relative (fused vs foreach AdamW rounding); asserted at 1e-5.
"""
from __future__ import annotations

import pytest
import torch

from test_baselines_registry import (HAS_CUDA, OPTIM, assert_losses_close, batches, init_dirs,  # noqa: F401
                                     run_system, weight_rel_diffs)

RTOL = 1e-5


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama"])  # tied and untied embeddings
def test_fsdp_matches_native(init_dirs, preset):
    data = batches(preset)
    native, native_final, *_ = run_system("native", init_dirs[preset], data)
    results, final, memory, info, label = run_system("fsdp", init_dirs[preset], data)
    losses, ref = [r.loss for r in results], [r.loss for r in native]
    assert losses[0] == pytest.approx(ref[0], rel=1e-6), "step-0 loss differs: not the shared initial weights"
    assert_losses_close(losses, ref, RTOL, "fsdp vs native")
    worst = weight_rel_diffs(final, native_final)
    assert max(worst.values()) <= RTOL, {k: v for k, v in worst.items() if v > RTOL}
    assert [r.grad_norm for r in results] == pytest.approx([r.grad_norm for r in native], rel=1e-5)
    assert [r.lr for r in results] == pytest.approx([OPTIM.lr_at(s) for s in range(len(results))])
    assert label == "fsdp" and info["optimizer"] in ("torch.AdamW(fused)", "torch.AdamW(foreach)")
    assert info["cpu_offload"] is False and memory.host_rss > 0


def test_fsdp_without_clipping_reports_norm(init_dirs):
    from dataclasses import replace

    data = batches("tiny-llama", 2)
    optim = replace(OPTIM, max_grad_norm=None)
    native, *_ = run_system("native", init_dirs["tiny-llama"], data, optim=optim)
    results, *_ = run_system("fsdp", init_dirs["tiny-llama"], data, optim=optim)
    assert [r.loss for r in results] == pytest.approx([r.loss for r in native], rel=RTOL)
    assert [r.grad_norm for r in results] == pytest.approx([r.grad_norm for r in native], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_fsdp_cuda_offload_close_to_native(init_dirs):
    preset = "tiny-llama"
    data = batches(preset)
    native, *_ = run_system("native", init_dirs[preset], data, device="cuda", dtype=torch.bfloat16)
    results, _, memory, info, _ = run_system("fsdp", init_dirs[preset], data, device="cuda", dtype=torch.bfloat16)
    assert info["cpu_offload"] is True and info["optimizer_device"] == "cpu"
    assert results[0].loss == pytest.approx(native[0].loss, rel=2e-2)
    assert_losses_close([r.loss for r in results], [r.loss for r in native], 2e-2, "fsdp vs native (cuda)")
    assert memory.gpu_peak_allocated > 0
