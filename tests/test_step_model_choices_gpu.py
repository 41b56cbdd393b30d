"""update_path="auto" and host_update_cores on CUDA against plain PyTorch on the CPU (run on the device
machine: pytest -m gpu tests/test_step_model_choices_gpu.py, ~1 min)."""
from __future__ import annotations

import os

import pytest
import torch

from megatrain import EngineConfig, MegaTrain, OptimConfig, PRESETS
from megatrain.data import synthetic_batch

from reference import reference_model, reference_train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, total_steps=6)


def _run(overrides):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    spec = PRESETS["tiny-qwen2"]
    hf = spec.to_hf_config("sdpa")
    data = [synthetic_batch(spec.vocab_size, 4, 64, 0, s) for s in range(6)]
    cfg = EngineConfig(device="cuda", compute_dtype="fp32", seed=0, attn_implementation="sdpa", optim=OPTIM,
                       gpu_resident="0", checkpoint_interval=2, micro_batches=2, **overrides)
    main_before = os.sched_getaffinity(0)
    engine = MegaTrain.from_config(hf, cfg, verbose=False, tokens_per_step=4 * 64, seq_len=64)
    init = {k: v.clone() for k, v in engine.state_dict().items()}
    losses = [engine.step(b).loss for b in data]
    final = {k: v.clone() for k, v in engine.state_dict().items()}
    facts = dict(update_path=engine.placement.update_path, reason=engine.placement.update_path_reason,
                 bound=engine.host_opt.bound, bound_each=engine.host_opt.bound_each,
                 worker_mask=os.sched_getaffinity(engine.host_opt.worker_native_id), main_mask=os.sched_getaffinity(0))
    engine.close()
    assert os.sched_getaffinity(0) == main_before
    ref_losses, ref_state = reference_train(reference_model(hf, init), data, OPTIM, 2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for name, value in final.items():
        if name.endswith("k_proj.bias"):  # zero true gradient: AdamW amplifies rounding noise (test_engine_parity)
            continue
        rel = float((value - ref_state[name]).norm() / ref_state[name].norm())
        assert rel < 1e-4, (name, rel)
    return facts


def test_cuda_update_path_auto_matches_cpu_reference():
    facts = _run(dict(update_path="auto"))
    assert facts["update_path"] in ("cpu", "hybrid") and facts["reason"].startswith("auto: predicted")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 3, reason="needs 3 cores")
def test_cuda_host_update_cores_auto_binds_and_matches_cpu_reference():
    facts = _run(dict(host_update_cores="auto"))
    worker, main = facts["bound"]
    assert len(main) == 1 and facts["main_mask"] == set(main)
    assert facts["bound_each"] and facts["worker_mask"] == {worker[0]}
