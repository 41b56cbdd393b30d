"""The GPU update path (update_path="hybrid") on CUDA: its streams, events, pinned copies and kept masters
against plain PyTorch on the CPU (run on the device machine: pytest -m gpu tests/test_update_path_gpu.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain import EngineConfig, MegaTrain, OptimConfig, PRESETS, cost_model
from megatrain.data import synthetic_batch
from megatrain.update_split import UpdateRates

from test_engine_parity import assert_matches_reference, inject_nan_gradient

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, total_steps=6)
NO_CLIP = dataclasses.replace(OPTIM, max_grad_norm=1e9)
FORCED = "embed,layer.1,layer.3,final"  # host-tier groups on both paths
SLOW_CPU = UpdateRates(cpu_gps=1.0, cpu_loaded_gps=0.8, h2d_gbs=46.0, d2h_gbs=46.0)  # as test_update_path_plan


@pytest.mark.parametrize("overrides", [
    dict(micro_batches=2),  # clipping fires every step
    dict(micro_batches=1),
    dict(micro_batches=2, optim=NO_CLIP),  # speculative CPU path beside the GPU path, nothing rolled back
    dict(micro_batches=2, speculate="always"),  # CPU path rolled back and redone, GPU path after the norm
    dict(micro_batches=2, gpu_path_groups="auto"),  # measured rates, the model's split
    dict(micro_batches=2, grad_placement="host"),  # gradients uploaded with the state
    dict(micro_batches=2, gpu_resident="2", gpu_path_groups="layer.3,final"),  # beside the GPU tier
    dict(micro_batches=2, update_staging_gib=0.0),  # what the plan leaves free only (kept masters or not)
    dict(micro_batches=2, gpu_path_prefetch=True),  # state uploaded during the backward (from step 2 on)
    dict(micro_batches=1, gpu_path_prefetch=True, gpu_path_groups="auto", optim=NO_CLIP),
    dict(micro_batches=2, gpu_path_prefetch=True, grad_placement="host"),
    dict(micro_batches=2, pin_host_state="all"),  # the store page-locks m and v, the GPU path none again
])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])  # untied, tied
def test_cuda_fp32_hybrid_matches_cpu_reference(preset, overrides):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    spec = PRESETS[preset]
    hf = spec.to_hf_config("sdpa")
    data = [synthetic_batch(spec.vocab_size, 4, 64, 0, s) for s in range(6)]
    kw = dict(dict(gpu_resident="0", gpu_path_groups=FORCED, optim=OPTIM), **overrides)
    optim, mb = kw["optim"], kw.get("micro_batches", 2)
    cfg = EngineConfig(device="cuda", compute_dtype="fp32", seed=0, attn_implementation="sdpa",
                       update_path="hybrid", checkpoint_interval=2, **kw)
    # "auto" splits at rates measured on this machine, where the tiny model's groups (16-37k params) are not
    # worth the GPU path (H200, 3b6c5ca: no path built); a slow CPU rate, injected, makes the model's split
    # take groups, so this case tests that split on CUDA rather than the machine's rates.
    rates = cost_model.Rates(update=SLOW_CPU) if kw.get("gpu_path_groups") == "auto" else None
    engine = MegaTrain.from_config(hf, cfg, verbose=False, rates=rates)
    assert engine.host_tier.gpu is not None
    init = {k: v.clone() for k, v in engine.state_dict().items()}
    losses, gpu_groups, busy = [], 0, 0.0
    for b in data:
        losses.append(engine.step(b).loss)
        gpu_groups += engine.stats["gpu_path_groups"]
        busy += engine.stats["gpu_path_busy_s"]
    final = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    assert gpu_groups > 0 and busy > 0
    # CUDA fp32 against the CPU reference: 1e-4 (kernels differ in summation order), as this test always had
    assert_matches_reference(hf, init, losses, final, data, mb, optim, weight_rtol=1e-4, loss_rtol=1e-4)


def test_cuda_bf16_hybrid_equals_cpu_path_and_resumes(tmp_path):
    """bf16 compute: the hybrid path gives the CPU path's losses (same arithmetic, another place), and a
    save / load in the middle continues it exactly."""
    spec = PRESETS["tiny-qwen2"]
    hf = spec.to_hf_config("sdpa")
    data = [synthetic_batch(spec.vocab_size, 8, 128, 1, s) for s in range(6)]
    runs = {}
    for path in ("cpu", "hybrid"):
        cfg = EngineConfig(device="cuda", optim=OPTIM, gpu_resident="0", update_path=path, gpu_path_groups=FORCED)
        engine = MegaTrain.from_config(hf, cfg, verbose=False, tokens_per_step=8 * 128, seq_len=128)
        runs[path] = [engine.step(b).loss for b in data]
        if path == "hybrid":
            engine.close()
            engine = MegaTrain.from_config(hf, cfg, verbose=False, tokens_per_step=8 * 128, seq_len=128)
            resumed = [engine.step(b).loss for b in data[:3]]
            engine.save(tmp_path / "ckpt")
            engine.close()
            engine = MegaTrain.load(tmp_path / "ckpt", cfg, verbose=False, tokens_per_step=8 * 128, seq_len=128)
            resumed += [engine.step(b).loss for b in data[3:]]
        engine.close()
    torch.testing.assert_close(torch.tensor(runs["hybrid"]), torch.tensor(runs["cpu"]), rtol=1e-3, atol=0)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(runs["hybrid"]), rtol=1e-6, atol=0)


def test_cuda_nan_skip_leaves_gpu_path_groups_untouched():
    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("sdpa")
    data = [synthetic_batch(spec.vocab_size, 4, 64, 0, s) for s in range(4)]
    cfg = EngineConfig(device="cuda", compute_dtype="fp32", optim=NO_CLIP, gpu_resident="0", update_path="hybrid",
                       gpu_path_groups=FORCED, micro_batches=2)
    engine = MegaTrain.from_config(hf, cfg, verbose=False)
    inject_nan_gradient(engine, "layer.1", at_call=3)  # one final gradient per group and step: the third step's
    for b in data[:2]:
        engine.step(b)
    engine.synchronize()
    before = {n: (engine.store.master[n].clone(), engine.store.m[n].clone()) for n in FORCED.split(",")}
    with pytest.warns(RuntimeWarning, match="step skipped"):
        engine.step(data[2])
    engine.synchronize()
    for n, (p, m) in before.items():
        assert torch.equal(p, engine.store.master[n]) and torch.equal(m, engine.store.m[n]), n
    engine.step(data[3])
    engine.close()


@pytest.mark.parametrize("gpu_resident", ["0", "2"])  # pure streaming, tiered (layers 2-3 + head on the host)
def test_cuda_plan_and_runtime_split_agree_at_the_measured_rates(gpu_resident):
    """The update rates are measured before the plan, and the plan and the host tier use the same ones: the
    plan's predicted GPU-path groups are the runtime's first split (the groups of the first step), or the
    plan is "cpu" (no staging kept, one line why) and no GPU path is built. The rows carry the rates."""
    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("sdpa")
    cfg = EngineConfig(device="cuda", seed=0, optim=OPTIM, gpu_resident=gpu_resident, update_path="hybrid",
                       gpu_path_groups="auto", checkpoint_interval=2)
    engine = MegaTrain.from_config(hf, cfg, verbose=False)
    try:
        rates = engine.update_rates
        assert rates.measured and engine.host_tier.rates == rates
        assert engine.memory().extra["update_rates"] == rates.to_dict()
        if engine.placement.update_path == "hybrid":
            planned = engine.placement.info()["predicted_gpu_path_groups"]
            assert len(engine.host_tier.split_for(False).gpu) == planned
            if planned == 0:  # a contested split: the GPU path is built, the first split is the CPU path alone
                assert "contested groups built as candidates" in engine.placement.update_path_reason
                assert engine.host_tier.gpu is not None
            engine.step(synthetic_batch(spec.vocab_size, 4, 64, 0, 0))
            assert engine.stats["gpu_path_groups"] == planned  # clipping fires: the first split ran
        else:
            assert engine.host_tier.gpu is None and engine.placement.update_path_setting == "hybrid"
            assert engine.placement.update_path_reason.startswith("hybrid asked, but the split")
    finally:
        engine.close()


def test_cuda_measure_rates_is_a_median_with_its_spread_and_loaded_runs_under_copies():
    """The build probe (update_split.measure_rates): CPU rates are medians (so one fast run does not set them),
    the spread of the runs alone is reported, the loaded runs ran while both copy streams did, and the link
    rates are plausible for PCIe (1-100 GB/s each way)."""
    from megatrain.cpu_adamw import HostKernel
    from megatrain.update_split import measure_rates

    rates = measure_rates(torch.device("cuda"), HostKernel(OPTIM, 0), numel=1 << 24, runs=5)
    assert rates.measured and rates.cpu_gps > 0 and rates.cpu_spread >= 0
    assert 0 < rates.cpu_loaded_gps <= 1.5 * rates.cpu_gps
    assert 1.0 < rates.h2d_gbs < 100.0 and 1.0 < rates.d2h_gbs < 100.0
    assert rates.to_dict()["cpu_spread"] == rates.cpu_spread
    # stream_dtype="bf16": the probe's kernel writes the shadow too, as the CPU path's updates then do
    with_shadow = measure_rates(torch.device("cuda"), HostKernel(OPTIM, 0), numel=1 << 24, runs=5, shadow=True)
    assert with_shadow.cpu_gps > 0 and 0 < with_shadow.cpu_loaded_gps <= 1.5 * with_shadow.cpu_gps
    # pin_host_state="all": the probe's p, m, v, gradient and shadow page-locked, and unlocked after it
    from megatrain.pinning import pin_in_place, unpin

    locked = measure_rates(torch.device("cuda"), HostKernel(OPTIM, 0), numel=1 << 24, runs=5, shadow=True,
                           pinned=True)
    assert locked.cpu_gps > 0 and 0 < locked.cpu_loaded_gps <= 1.5 * locked.cpu_gps
    t = torch.empty(1 << 20)  # registering again works: nothing was left registered in a broken state
    unpin(pin_in_place(t, "a probe check"))


@pytest.mark.parametrize("stream_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("update_path", ["cpu", "hybrid"])
def test_cuda_pin_host_state_page_locks_what_it_says_once(update_path, stream_dtype, recwarn):
    """pin_host_state="all": every host-tier group's master, m, v (and the bf16 shadow) page-locked
    by the store, the GPU path registering none twice (no warning); "stream" (the default): the streamed buffer only."""
    spec = PRESETS["tiny-llama"]
    for setting, fp32_arrays in (("all", 3), ("stream", 0)):
        cfg = EngineConfig(device="cuda", seed=0, gpu_resident="0", update_path=update_path,
                           gpu_path_groups=FORCED if update_path == "hybrid" else "auto", optim=OPTIM,
                           stream_dtype=stream_dtype, pin_host_state=setting)
        engine = MegaTrain.from_config(spec.to_hf_config("sdpa"), cfg, verbose=False, tokens_per_step=2 * 32,
                                       seq_len=32)
        try:
            host = sum(engine.store.by_name[n].numel for n in engine.placement.host_names)
            stream = 2 if stream_dtype == "bf16" else 4
            extra = fp32_arrays * 4 - (4 if stream_dtype == "fp32" and setting == "all" else 0)
            assert engine.store.pinned_bytes == host * (stream + extra)
            engine.step(synthetic_batch(spec.vocab_size, 2, 32, 0, 0))
            if update_path == "hybrid" and setting == "all":
                assert engine.host_tier.gpu._pinned == []  # the store's, not registered twice
            elif update_path == "hybrid":  # "stream": the GPU path locks its groups' m, v (+ the master, bf16)
                gpu_set = engine.host_tier.gpu.names
                per = 8 + (4 if stream_dtype == "bf16" else 0)
                assert engine.host_tier.pinned_bytes == per * sum(engine.store.by_name[n].numel for n in gpu_set)
            mem = engine.memory()  # the row's host_pinned_gib: every page-locked byte, the GPU path's included
            assert mem.host_pinned >= engine.store.pinned_bytes + engine.host_tier.pinned_bytes
        finally:
            engine.close()
    failed = [str(w.message) for w in recwarn if "cudaHostRegister" in str(w.message)]
    assert not failed, failed  # a second registration of one tensor fails (and would warn)


def test_cuda_a_failed_registration_leaves_no_error_for_the_next_kernel():
    """cudaHostRegister on memory already registered fails (712); the runtime keeps that as the thread's last
    error, which torch's next kernel-launch check would raise as its own. pin_in_place consumes it: the
    fallbacks (the store's pin_host_state="all", the GPU path's, the probe's) then run on pageable memory."""
    from megatrain.pinning import PinError, pin_in_place, unpin

    t = pin_in_place(torch.empty(1 << 20), "a test buffer")
    try:
        with pytest.raises(PinError) as info:
            pin_in_place(t, "the same buffer again")
        assert info.value.code != 0
        x = torch.ones(1 << 10, device="cuda").mul_(2.0)  # a launch check after the failure: must not raise
        torch.cuda.synchronize()
        assert float(x.sum()) == 2.0 * (1 << 10)
    finally:
        unpin(t)
