"""GPU-only checks of the stream/event logic (run on the device machine: pytest -m gpu)."""
from __future__ import annotations

import pytest
import torch

from megatrain import EngineConfig, MegaTrain, OptimConfig, PRESETS
from megatrain.data import synthetic_batch

from reference import reference_model, reference_train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, total_steps=6)


@pytest.mark.parametrize("overrides", [
    dict(num_slots=2, checkpoint_interval=1),
    dict(num_slots=3, checkpoint_interval=2, overlap_optimizer=False),
    dict(num_slots=1, checkpoint_interval=2, grad_slabs=0),
    dict(num_slots=2, checkpoint_interval=0, stream_dtype="fp32", grad_slabs=1),
    dict(num_slots=2, checkpoint_interval=1, gpu_resident="2"),  # mixed tiers
    dict(num_slots=2, checkpoint_interval=2, gpu_resident="4"),  # all on the GPU tier
    dict(num_slots=2, checkpoint_interval=1, speculate="always"),  # early host updates, rolled back (clip fires)
    dict(num_slots=2, checkpoint_interval=2, boundary_offload="host", gpu_resident="1"),
    # host-tier gradients into pinned host buffers during the backward (D2H stream, events, back-pressure)
    dict(num_slots=2, checkpoint_interval=1, grad_placement="host", gpu_resident="0"),
    dict(num_slots=2, checkpoint_interval=2, grad_placement="host", gpu_resident="2", speculate="always"),
])
def test_cuda_fp32_matches_cpu_reference(overrides):
    """fp32 compute on the GPU through streams/events/slabs equals plain PyTorch on the CPU (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("sdpa")
    data = [synthetic_batch(spec.vocab_size, 4, 64, 0, s) for s in range(6)]
    cfg = EngineConfig(device="cuda", compute_dtype="fp32", micro_batches=2, optim=OPTIM, seed=0,
                       attn_implementation="sdpa", **overrides)
    engine = MegaTrain.from_config(hf, cfg, verbose=False)
    init = {k: v.clone() for k, v in engine.state_dict().items()}
    losses = [engine.step(b).loss for b in data]
    final = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    ref_losses, ref_state = reference_train(reference_model(hf, init), data, OPTIM, 2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for name, value in final.items():
        rel = float((value - ref_state[name]).norm() / ref_state[name].norm())
        assert rel < 1e-4, (name, rel)


@pytest.mark.parametrize("grads", ["gpu", "host"])  # "host": bf16 gradients widened on the D2H stream
def test_cuda_bf16_tracks_reference(grads):
    spec = PRESETS["tiny-qwen2"]
    hf = spec.to_hf_config("sdpa")
    data = [synthetic_batch(spec.vocab_size, 8, 128, 1, s) for s in range(8)]
    tiers = dict(gpu_resident="0", grad_placement="host") if grads == "host" else {}  # "host": all streamed
    engine = MegaTrain.from_config(hf, EngineConfig(device="cuda", micro_batches=1, optim=OPTIM, **tiers),
                                   verbose=False, tokens_per_step=8 * 128, seq_len=128)  # the batch below
    init = {k: v.clone() for k, v in engine.state_dict().items()}
    losses = [engine.step(b).loss for b in data]
    engine.close()
    ref_losses, _ = reference_train(reference_model(hf, init), data, OPTIM, 1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)


def test_cuda_load_wait_timer_is_a_part_of_the_step():
    """The GPU-side stall timer (streams.WaitTimer around each slot wait) reads real timing events: every
    step reports a wait between 0 and the step's own time, and streaming all layers does load them."""
    spec = PRESETS["tiny-qwen2"]
    engine = MegaTrain.from_config(spec.to_hf_config("sdpa"),
                                   EngineConfig(device="cuda", num_slots=2, gpu_resident="0", optim=OPTIM),
                                   verbose=False, tokens_per_step=4 * 128, seq_len=128)
    for s in range(3):
        engine.step(synthetic_batch(spec.vocab_size, 4, 128, 1, s))
        st = engine.stats
        assert st["h2d_loads"] > 0 and 0.0 <= st["gpu_load_wait_s"] <= st["step_s"], st
    engine.close()


@pytest.mark.parametrize("recompute,kw", [
    ("none", dict(gpu_resident="4")),  # every block kept, all on the GPU tier
    ("none", dict(gpu_resident="1")),  # every block kept, host-tier layers streamed (weights by slot position)
    ("auto", dict(gpu_resident="2", keep={1})),  # a mixed keep-set with mixed tiers
    ("none", dict(gpu_resident="4", micro_batch_schedule="sequential")),  # one micro-batch at a time
])
def test_cuda_kept_activations_match_recompute_all(recompute, kw):
    """Kept blocks on CUDA (graphs made in the forward, weights read back by slot position in the backward,
    slots overwritten by the next loads meanwhile): the same training as recomputing every block, and as
    plain PyTorch (fp32, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("sdpa")
    data = [synthetic_batch(spec.vocab_size, 4, 64, 0, s) for s in range(5)]
    kw = dict(kw)
    keep = kw.pop("keep", None)
    runs = {}
    for mode in ("all", recompute):
        cfg = EngineConfig(device="cuda", compute_dtype="fp32", micro_batches=2, optim=OPTIM, seed=0, num_slots=2,
                           checkpoint_interval=2, attn_implementation="sdpa", recompute=mode, **kw)
        engine = MegaTrain.from_config(hf, cfg, verbose=False, keep=keep if mode != "all" else None,
                                       tokens_per_step=4 * 64, seq_len=64)
        assert engine.info["blocks_kept"] == (0 if mode == "all" else len(keep) if keep else 2)
        init = {k: v.clone() for k, v in engine.state_dict().items()}
        losses = [engine.step(b).loss for b in data]
        runs[mode] = (init, losses, {k: v.clone() for k, v in engine.state_dict().items()})
        engine.close()
    init, losses, final = runs[recompute]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(runs["all"][1]), rtol=1e-5, atol=0)
    ref_losses, ref_state = reference_train(reference_model(hf, init), data, OPTIM, 2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    for name, value in final.items():
        rel = float((value - ref_state[name]).norm() / ref_state[name].norm())
        assert rel < 1e-4, (name, rel)


def test_cuda_auto_keeps_what_the_plan_says_and_reports_it():
    """recompute="auto" on a GPU with room: the tiny model keeps every block, and the step and the memory
    stats report the plan's choice and prediction beside the step's own time."""
    spec = PRESETS["tiny-qwen2"]
    engine = MegaTrain.from_config(spec.to_hf_config("sdpa"), EngineConfig(device="cuda", optim=OPTIM),
                                   verbose=False, tokens_per_step=8 * 128, seq_len=128)
    assert engine.info["blocks_kept"] == engine.info["blocks"] and engine.info["predicted_step_s"] > 0
    for s in range(2):
        engine.step(synthetic_batch(spec.vocab_size, 8, 128, 1, s))
    assert engine.stats["predicted_step_s"] == engine.info["predicted_step_s"] and engine.stats["blocks_kept"] > 0
    extra = engine.memory().extra
    assert extra["recompute_blocks"] == engine.info["recompute_blocks"]
    engine.close()
