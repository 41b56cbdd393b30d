"""The engine's core test: same model, data and seed, engine vs plain PyTorch -> same losses and weights."""
from __future__ import annotations

import pytest
import torch

from megatrain import EngineConfig, MegaTrain, OptimConfig, PRESETS
from megatrain.data import synthetic_batch

from reference import reference_model, reference_train, weight_rel_diffs

RTOL = 1e-5
STEPS = 5
OPTIM = OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=0.5,
                    warmup_steps=2, total_steps=5, min_lr_ratio=0.1)


def batches(spec, steps=STEPS, bsz=4, seq=16, seed=0):
    return [synthetic_batch(spec.vocab_size, bsz, seq, seed, s) for s in range(steps)]


def engine_cfg(**kw):
    base = dict(device="cpu", micro_batches=2, optim=OPTIM, loss_chunk_tokens=24, seed=1)
    base.update(kw)
    return EngineConfig(**base)


def run_engine(hf_config, cfg, data, engine_kwargs=None, stats_out=None):
    engine = MegaTrain.from_config(hf_config, cfg, verbose=False, **(engine_kwargs or {}))
    init = {k: v.clone() for k, v in engine.state_dict().items()}
    losses = []
    for b in data:
        losses.append(engine.step(b).loss)
        if stats_out is not None:  # per-step counters summed over the run
            for k, v in engine.stats.items():
                stats_out[k] = stats_out.get(k, 0) + v
    final = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return init, losses, final


def inject_nan_gradient(engine, group: str, at_call: int) -> None:
    """Make ``group``'s ``at_call``-th final gradient (one per group and step) hold a NaN, as a real
    overflow would, to test that the step is skipped."""
    orig, calls = engine._grad_ready, {"n": 0}

    def grad_ready(name, flat, st):
        if name == group:
            calls["n"] += 1
            if calls["n"] == at_call:
                flat = flat.clone()
                flat[3] = float("nan")
        return orig(name, flat, st)

    engine._grad_ready = grad_ready


def optimizer_snapshot(engine) -> dict:
    """Copies of every host/GPU-tier group's master, m, v and step count, keyed (kind, group)."""
    st = engine.store
    return {(k, n): t[n].detach().cpu().clone() for k, t in (("p", st.master), ("m", st.m), ("v", st.v),
                                                            ("step", st.steps)) for n in t}


def assert_state_restored(before: dict, after: dict, exact) -> None:
    """After a skipped step, every tensor of ``optimizer_snapshot`` as it was: bit for bit where
    ``exact(key)`` (nothing was applied early), else within fp32 rounding (early updates undone)."""
    for key, t in before.items():
        if exact(key):
            assert torch.equal(t, after[key]), key
        else:
            rel = float((t.double() - after[key].double()).norm() / max(float(t.double().norm()), 1e-30))
            assert rel <= 1e-6, (key, rel)


def train_past_a_nan_step(engine, data, at: int, check) -> tuple[list, dict]:
    """Train ``engine`` (closed at the end) on ``data``, step ``at`` having a NaN gradient
    (``inject_nan_gradient``): that step must warn "step skipped"; ``check(before, after, result)`` judges
    it from the ``optimizer_snapshot``s around it. Returns the other steps' losses and the final weights,
    for ``assert_matches_reference`` on the data without step ``at``."""
    losses = []
    for s, b in enumerate(data):
        if s != at:
            losses.append(engine.step(b).loss)
            continue
        engine.synchronize()  # the previous step's update runs in the background
        before = optimizer_snapshot(engine)
        with pytest.warns(RuntimeWarning, match="step skipped"):
            result = engine.step(b)
        engine.synchronize()
        check(before, optimizer_snapshot(engine), result)
    final = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return losses, final


def assert_parity(hf_config, cfg, data, micro_batches=2, optim=OPTIM, engine_kwargs=None, stats_out=None):
    init, losses, final = run_engine(hf_config, cfg, data, engine_kwargs, stats_out)
    return assert_matches_reference(hf_config, init, losses, final, data, micro_batches, optim)


def assert_matches_reference(hf_config, init, losses, final, data, micro_batches=2, optim=OPTIM,
                             weight_rtol=RTOL, stream_dtype=None, grad_norms=None, loss_rtol=RTOL):
    """An engine run (its initial weights, per-step losses and final weights) against plain PyTorch
    (tests/reference.py) from the same initial weights on the same data: losses within ``loss_rtol`` and
    every weight within ``weight_rtol`` relative in norm (``reference.weight_rel_diffs``: k_proj biases
    skipped), every weight moved. Returns the worst weight difference; ``grad_norms``, if given, receives
    the reference's per-step gradient norms."""
    ref = reference_model(hf_config, init)
    ref_losses, ref_state = reference_train(ref, data, optim, micro_batches, stream_dtype=stream_dtype,
                                            grad_norms=grad_norms)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=loss_rtol, atol=0)
    # The losses must actually move, or parity would be vacuous.
    assert abs(losses[-1] - losses[0]) > 1e-3
    # every tensor the engine holds (a tied model's head is its embedding: the reference names it twice)
    diffs = weight_rel_diffs(final, {name: ref_state[name] for name in final})
    for name, rel in diffs.items():
        assert rel <= weight_rtol, f"{name}: relative difference {rel:.2e} > {weight_rtol}"
        assert float((final[name] - init[name]).norm()) > 0, f"{name} was not updated"
    return max(diffs.values())


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_parity_families(preset):
    spec = PRESETS[preset]
    assert_parity(spec.to_hf_config("eager"), engine_cfg(checkpoint_interval=2), batches(spec))


@pytest.mark.parametrize("interval", [1, 2, 0])
def test_parity_checkpoint_intervals(interval):
    spec = PRESETS["tiny-qwen2"]  # tied embeddings
    assert_parity(spec.to_hf_config("eager"), engine_cfg(checkpoint_interval=interval), batches(spec))


@pytest.mark.parametrize("overrides", [
    dict(num_slots=1),  # double buffering off (synchronous)
    dict(num_slots=3, grad_slabs=0, overlap_optimizer=False),  # slab pool and optimizer overlap off
])  # stream_dtype="bf16" rounds the weights it streams: test_parity_bf16_stream
def test_parity_ablations(overrides):
    spec = PRESETS["tiny-llama"]
    assert_parity(spec.to_hf_config("eager"), engine_cfg(checkpoint_interval=2, **overrides), batches(spec))


# stream_dtype="bf16" against tests/reference.py doing the same casting (fp32 master updated by AdamW,
# forward and backward in fp32 on the master rounded to bf16 once per step). Losses agree to 1.6e-6, like
# fp32 parity, but the weights only to ~2e-5 after 5 steps (measured: tiny-llama 1.8e-5, tiny-qwen2 1.3e-5),
# not 1e-5: the engine and the reference differ at fp32 rounding level (as in fp32 parity: ~1e-6, largest
# where AdamW normalises a near-zero gradient), and a master element within that distance of a bf16
# rounding midpoint rounds the other way, moving its compute weight by a whole bf16 ulp (2^-8 relative).
# Such flips grow step by step (tiny-llama: 2 of 180,800 elements after step 1, 1,249 after step 4) and
# spread to every weight through the gradients. BF16_WEIGHT_RTOL sits 5x above that and 35x below what
# separates bf16 from fp32 streaming (3.5e-3 after 5 steps, checked below), so a stale or unrounded
# shadow, or another rounding mode, fails it.
BF16_WEIGHT_RTOL = 1e-4


def _mixed_tiers(hf_config):
    """Every other layer and the head on the "GPU" tier (DeviceAdamW), the rest on the host tier."""
    from megatrain.arch import build_meta_model
    from megatrain.store import make_groups

    return {g.name: "gpu" if (g.kind == "layer" and g.index % 2 == 0) or g.kind == "final" else "host"
            for g in make_groups(build_meta_model(hf_config))}


@pytest.mark.parametrize("preset,overrides,tiers", [
    ("tiny-llama", dict(), False),
    ("tiny-qwen2", dict(speculate="always", checkpoint_interval=1), False),  # tied; early updates rolled back
    ("tiny-llama", dict(overlap_optimizer=False), True),  # both tiers' optimizers refresh the shadow
])
def test_parity_bf16_stream(preset, overrides, tiers):
    spec = PRESETS[preset]
    hf, data = spec.to_hf_config("eager"), batches(spec)
    cfg = engine_cfg(**{"checkpoint_interval": 2, "stream_dtype": "bf16", **overrides})
    init, losses, final = run_engine(hf, cfg, data, dict(tiers=_mixed_tiers(hf)) if tiers else None)
    # losses at the fp32 bound (RTOL), weights at BF16_WEIGHT_RTOL
    assert_matches_reference(hf, init, losses, final, data, weight_rtol=BF16_WEIGHT_RTOL,
                             stream_dtype=torch.bfloat16)
    # The bf16 stream is in effect: against the fp32 reference the weights are far outside the tolerance.
    _, fp32_state = reference_train(reference_model(hf, init), data, OPTIM, 2)
    apart = max(float((final[k] - fp32_state[k]).norm() / fp32_state[k].norm()) for k in final)
    assert apart > 10 * BF16_WEIGHT_RTOL, apart


def test_parity_mistral_sdpa_single_microbatch():
    spec = PRESETS["tiny-mistral"]
    cfg = engine_cfg(micro_batches=1, checkpoint_interval=3, attn_implementation="sdpa")
    hf = spec.to_hf_config("sdpa")
    init, losses, final = run_engine(hf, cfg, batches(spec))
    ref_losses, _ = reference_train(reference_model(hf, init), batches(spec), OPTIM, 1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)


def test_padding_mask_and_ignored_labels():
    """attention_mask (right padding), labels with -100 and explicit position_ids are honoured."""
    spec = PRESETS["tiny-qwen3"]
    hf = spec.to_hf_config("eager")
    data = batches(spec)
    for b in data:
        mask = torch.ones_like(b["input_ids"])
        mask[0, 10:] = 0
        mask[3, 12:] = 0
        labels = b["labels"].masked_fill(mask == 0, -100)
        labels[1, :5] = -100
        b.update(attention_mask=mask, labels=labels,
                 position_ids=torch.arange(16).unsqueeze(0).expand(4, 16).contiguous())
    assert_parity(hf, engine_cfg(checkpoint_interval=2), data)


def test_weights_cross_pcie_twice_per_step():
    """Each layer is loaded once for forward and once for recompute+backward (minus slots reused at the
    forward/backward turn), never three times."""
    spec = PRESETS["tiny-llama"]
    for interval, slots in [(1, 2), (2, 2), (4, 1)]:
        engine = MegaTrain.from_config(spec.to_hf_config("eager"),
                                       engine_cfg(checkpoint_interval=interval, num_slots=slots), verbose=False)
        data = batches(spec, steps=2)
        engine.step(data[0])
        per_step = engine.pool.loads
        engine.step(data[1])
        assert engine.pool.loads == 2 * per_step
        L = spec.num_layers
        assert L <= per_step <= 2 * L, (interval, slots, per_step)
        if interval == 1:  # the layers still in slots at the turn are reused, all others load twice
            assert per_step == 2 * L - engine.num_pool_slots
        engine.close()
