"""The host tier's GPU update path (update_path="hybrid", megatrain/streamed_update.py) on CPU: the same
code with streams as no-ops. Parity with plain PyTorch with a forced split (host-tier groups on both paths)
for clipping firing and not, 1 and 2 micro-batches, tied and untied, speculation with rollback, NaN skip,
a save and load in the middle, gradients on the host; the split model; config errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain import EngineConfig, MegaTrain, PRESETS, update_split
from megatrain.update_split import UpdateRates, forced_split, plan_split

from test_engine_parity import (OPTIM, RTOL, assert_matches_reference, assert_parity, batches, engine_cfg,
                                assert_state_restored, inject_nan_gradient, train_past_a_nan_step)

NO_CLIP = dataclasses.replace(OPTIM, max_grad_norm=1e9)
# Host-tier groups on both paths: the embedding (first needed), a middle layer and the last layer (+ the
# head when untied) on the GPU path; the rest on the CPU kernel.
FORCED = "embed,layer.1,layer.3,final"


def hybrid_cfg(**kw):
    base = dict(checkpoint_interval=2, update_path="hybrid", gpu_path_groups=FORCED, gpu_resident="0")
    base.update(kw)
    return engine_cfg(**base)


def _expected_counts(spec, steps, forced=FORCED):
    host = ["embed"] + [f"layer.{i}" for i in range(spec.num_layers)] + ["final"]
    gpu = [x for x in forced.split(",") if x in host]
    return steps * (len(host) - len(gpu)), steps * len(gpu)


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])  # untied, tied
def test_parity_forced_split(preset, clip, micro_batches):
    spec = PRESETS[preset]
    optim = OPTIM if clip else NO_CLIP
    data = batches(spec)
    stats = {}
    assert_parity(spec.to_hf_config("eager"), hybrid_cfg(micro_batches=micro_batches, optim=optim), data,
                  micro_batches=micro_batches, optim=optim, stats_out=stats)
    cpu, gpu = _expected_counts(spec, len(data))
    assert stats["cpu_groups"] == cpu and stats["gpu_path_groups"] == gpu
    assert stats["clipped"] == (len(data) if clip else 0)
    if not clip:  # "auto" speculates from the second step: the CPU path's groups only, none rolled back
        assert stats["speculated"] == len(data) - 1 and stats["rollbacks"] == 0
        assert stats["early_groups"] == (len(data) - 1) * cpu // len(data)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_parity_speculation_rolled_back_beside_gpu_path(preset):
    """speculate="always" with clipping firing every step: the CPU path's early updates are undone and
    redone, the GPU path updates after the norm; both match plain PyTorch."""
    spec = PRESETS[preset]
    data = batches(spec)
    stats = {}
    assert_parity(spec.to_hf_config("eager"), hybrid_cfg(speculate="always"), data, stats_out=stats)
    assert stats["rollbacks"] == len(data) and stats["clipped"] == len(data)
    assert stats["early_groups"] == _expected_counts(spec, len(data))[0]


@pytest.mark.parametrize("overrides", [
    dict(gpu_resident="2"),  # mixed tiers: GPU tier (embed, layers 0-1) + host tier on both paths
    dict(grad_placement="host"),  # the GPU path's gradients wait in host buffers (uploaded with the state)
    dict(gpu_path_groups="auto"),  # the bandwidth model's split (default rates on the CPU)
    dict(overlap_optimizer=False, num_slots=3, checkpoint_interval=1),
])
def test_parity_variants(overrides):
    spec = PRESETS["tiny-llama"]
    kw = dict(overrides)
    if kw.get("gpu_resident") == "2":
        kw["gpu_path_groups"] = "layer.3,final"  # embed and layers 0-1 are on the GPU tier
    stats = {}
    assert_parity(spec.to_hf_config("eager"), hybrid_cfg(**kw), batches(spec), stats_out=stats)
    assert stats["gpu_path_groups"] > 0 and stats["cpu_groups"] > 0


@pytest.mark.parametrize("clip", [True, False])
def test_parity_in_chunks(monkeypatch, clip):
    """Groups stream through the rotating buffers in chunks (here 1000 elements: several per group, the
    last one short, buffers reused across groups); kept masters or not."""
    from megatrain import streamed_update

    monkeypatch.setattr(streamed_update, "CHUNK_ELEMS", 1000)
    spec = PRESETS["tiny-qwen2"]
    optim = OPTIM if clip else NO_CLIP
    assert_parity(spec.to_hf_config("eager"), hybrid_cfg(optim=optim), batches(spec), optim=optim)
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), hybrid_cfg(), verbose=False)
    assert engine.host_tier.gpu.chunk == 1000 and len(engine.host_tier.gpu.kept) == 4
    engine.close()


def test_staging_chunk_halves_to_fit():
    from megatrain.streamed_update import CHUNK_ELEMS, MIN_CHUNK_ELEMS, rotating_bytes, staging_chunk

    assert staging_chunk(10**9, float("inf"), False) == CHUNK_ELEMS
    assert staging_chunk(5000, float("inf"), False) == 5000  # never more than the largest group
    half = staging_chunk(10**9, rotating_bytes(CHUNK_ELEMS, False) - 1, False)
    assert half == CHUNK_ELEMS // 2
    assert staging_chunk(10**9, rotating_bytes(MIN_CHUNK_ELEMS, True) - 1, True) == 0


@pytest.mark.parametrize("auto", [False, True])
@pytest.mark.parametrize("clip", [True, False])
def test_parity_with_prefetch(clip, auto):
    """gpu_path_prefetch: from the second step on, GPU-path groups' state goes up during the backward (as
    each gradient arrives) and only the update and download run after the norm."""
    spec = PRESETS["tiny-qwen2"]
    optim = OPTIM if clip else NO_CLIP
    kw = dict(gpu_path_prefetch=True, optim=optim, **(dict(gpu_path_groups="auto") if auto else {}))
    prefetched = []
    import megatrain.streamed_update as su

    orig = su.StreamedAdamW.set_prefetch

    def spy(self, names):
        out = orig(self, names)
        prefetched.append(out)
        return out

    su.StreamedAdamW.set_prefetch = spy
    try:
        assert_parity(spec.to_hf_config("eager"), hybrid_cfg(**kw), batches(spec), optim=optim)
    finally:
        su.StreamedAdamW.set_prefetch = orig
    assert len(prefetched) == 1 and prefetched[0]  # decided once, after the first step; something prefetched


def test_auto_split_uses_both_paths_on_default_rates():
    spec = PRESETS["tiny-llama"]
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), hybrid_cfg(gpu_path_groups="auto"), verbose=False)
    split = engine.host_tier.split_for(False)
    assert split.gpu and split.cpu and set(split.gpu) | set(split.cpu) == set(engine.placement.host_names)
    assert engine.host_tier.split_for(True).gpu == []  # no backward measured yet: CPU path alone
    assert "GPU path" in engine.host_tier.summary()
    engine.close()


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_cpu_path_reports_counts_and_bf16_shadow_matches(micro_batches):
    """update_path="cpu" reports every host group on the CPU path; with a bf16 shadow the hybrid engine
    produces the same losses and weights as the CPU-only one (the GPU path refreshes the shadow too), and its
    GPU-path groups keep their shadow on the device (2 B/param): from the second step on every load of them
    reads that kept bf16 copy, the very bits the host shadow got."""
    import megatrain.streamed_update as su

    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("eager")
    data = batches(spec)
    results = {}
    served = []  # (group, dtype) of every load a kept copy served
    orig = su.StreamedAdamW.device_source

    def source(self, name):
        out = orig(self, name)
        if out is not None:
            served.append((name, out.dtype))
            assert torch.equal(out.cpu(), self.store.shadow[name])  # the kept bits are the host shadow's
        return out

    for path in ("cpu", "hybrid"):
        cfg = hybrid_cfg(update_path=path, stream_dtype="bf16", micro_batches=micro_batches)
        engine = MegaTrain.from_config(hf, cfg, verbose=False)
        su.StreamedAdamW.device_source = source
        try:
            losses = [engine.step(b).loss for b in data]
        finally:
            su.StreamedAdamW.device_source = orig
        if path == "cpu":
            assert engine.stats["cpu_groups"] == spec.num_layers + 2 and engine.stats["gpu_path_groups"] == 0
        else:
            kept = engine.host_tier.gpu.kept
            assert set(kept) == set(FORCED.split(",")) and all(t.dtype == torch.bfloat16 for t in kept.values())
            assert {name for name, _ in served} == set(FORCED.split(","))
            assert {dtype for _, dtype in served} == {torch.bfloat16}
        engine.synchronize()
        results[path] = (losses, {k: v.clone() for k, v in engine.state_dict().items()},
                         {n: (t.clone(), engine.store.master[n].to(t.dtype)) for n, t in engine.store.shadow.items()})
        engine.close()
    torch.testing.assert_close(torch.tensor(results["hybrid"][0]), torch.tensor(results["cpu"][0]), rtol=RTOL, atol=0)
    for name, value in results["hybrid"][1].items():
        ref = results["cpu"][1][name]
        assert float((value - ref).norm() / ref.norm()) <= RTOL, name
    for name, (shadow, master_rounded) in results["hybrid"][2].items():  # the streamed copy is the master's
        assert torch.equal(shadow, master_rounded), name


@pytest.mark.parametrize("nan_in", ["layer.1", "layer.2"])  # a GPU-path group, a CPU-path group
@pytest.mark.parametrize("speculate,prefetch", [("never", False), ("always", False), ("never", True)])
def test_nan_gradient_skips_step(nan_in, speculate, prefetch):
    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("eager")
    data = batches(spec)
    engine = MegaTrain.from_config(hf, hybrid_cfg(speculate=speculate, optim=NO_CLIP, gpu_path_prefetch=prefetch),
                                   verbose=False)
    init = {k: v.clone() for k, v in engine.state_dict().items()}
    inject_nan_gradient(engine, nan_in, at_call=3)  # the third step's

    def check(before, after, _):
        # bit for bit without speculation, and on the GPU path (it never updates early)
        assert_state_restored(before, after, exact=lambda key: speculate == "never" or key[1] in FORCED.split(","))
        assert engine.skipped_steps == 1

    losses, final = train_past_a_nan_step(engine, data, 2, check)
    kept = [b for s, b in enumerate(data) if s != 2]  # the reference skips the same batch
    assert_matches_reference(hf, init, losses, final, kept, 2, NO_CLIP)


@pytest.mark.parametrize("resume_path,prefetch", [("hybrid", False), ("cpu", False), ("hybrid", True)])
def test_save_and_load_in_the_middle(tmp_path, resume_path, prefetch):
    """Three steps on the hybrid path, save, load (hybrid again, or the CPU path), two more: the same
    losses as five straight steps."""
    spec = PRESETS["tiny-qwen3"]
    hf = spec.to_hf_config("eager")
    data = batches(spec)
    engine = MegaTrain.from_config(hf, hybrid_cfg(gpu_path_prefetch=prefetch), verbose=False)
    straight = [engine.step(b).loss for b in data]
    engine.close()
    engine = MegaTrain.from_config(hf, hybrid_cfg(gpu_path_prefetch=prefetch), verbose=False)
    resumed = [engine.step(b).loss for b in data[:3]]
    engine.save(tmp_path / "ckpt")
    engine.close()
    engine = MegaTrain.load(tmp_path / "ckpt", hybrid_cfg(update_path=resume_path, gpu_path_prefetch=prefetch),
                            verbose=False)
    resumed += [engine.step(b).loss for b in data[3:]]
    engine.close()
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), rtol=1e-6, atol=0)


# -- the split model ------------------------------------------------------------------------------------
def _layers(n=28, numel=233_000_000, embed=545_000_000):
    return [("embed", embed)] + [(f"layer.{i}", numel) for i in range(n)] + [("final", embed)]


def test_split_after_norm_balances_both_paths_in_forward_order():
    rates = UpdateRates()
    order = _layers()
    split = plan_split(order, rates)
    assert split.gpu and split.cpu
    assert sorted(split.gpu + split.cpu, key=[x for x, _ in order].index) == [x for x, _ in order]
    # Both paths together beat the CPU alone by a clear margin with the H200 rates.
    assert split.predicted_s < 0.85 * split.predicted_cpu_only_s
    # Interleaved, not a block: both paths hold groups from the first and the last third of the forward.
    first, last = {x for x, _ in order[:10]}, {x for x, _ in order[-10:]}
    assert first & set(split.gpu) and first & set(split.cpu) and last & set(split.gpu) and last & set(split.cpu)
    # A slower link gives the GPU path fewer groups; a staging limit keeps big groups on the CPU.
    slow = plan_split(order, dataclasses.replace(rates, h2d_gbs=10, d2h_gbs=10))
    assert len(slow.gpu) < len(split.gpu)
    small = plan_split(order, rates, max_numel=300_000_000)
    assert "embed" not in small.gpu and "final" not in small.gpu and small.gpu
    assert plan_split(order, rates, max_gpu_groups=0).gpu == []
    # A split the model predicts slower than the CPU alone (copies slow the CPU a lot, a slow link) is not
    # planned: the CPU path alone.
    slow_both = plan_split(order, dataclasses.replace(rates, cpu_loaded_gps=1.0, h2d_gbs=12, d2h_gbs=12))
    assert slow_both.gpu == [] and "CPU only" in slow_both.reason


def test_split_speculative_is_a_prefix_that_shrinks_with_the_head_start():
    rates = UpdateRates()
    order = _layers()
    names = [x for x, _ in order]
    short = plan_split(order, rates, speculative=True, backward_s=0.5)
    long_bwd = plan_split(order, rates, speculative=True, backward_s=1.5)
    assert short.gpu == names[:len(short.gpu)] and long_bwd.gpu == names[:len(long_bwd.gpu)]
    assert len(long_bwd.gpu) < len(short.gpu)
    assert short.predicted_s <= short.predicted_cpu_only_s
    # A backward longer than the whole CPU update: nothing to gain, the CPU path alone.
    assert plan_split(order, rates, speculative=True, backward_s=10.0).gpu == []


def test_forced_split_and_config_errors():
    names = ["embed", "layer.0", "layer.1", "final"]
    split = forced_split(names, ["layer.1", "embed"])
    assert split.gpu == ["embed", "layer.1"] and split.cpu == ["layer.0", "final"]
    with pytest.raises(ValueError, match="not on the host tier"):
        forced_split(names, ["layer.7"])
    with pytest.raises(ValueError, match="update_path must be"):
        EngineConfig(update_path="gpu")
    with pytest.raises(ValueError, match="update_staging_gib"):
        EngineConfig(update_staging_gib=-1)
    spec = PRESETS["tiny-llama"]
    with pytest.raises(ValueError, match="not on the host tier"):
        MegaTrain.from_config(spec.to_hf_config("eager"), hybrid_cfg(gpu_resident="2", gpu_path_groups="layer.0"),
                              verbose=False)


def test_prefetch_set_is_a_suffix_bounded_by_spare_link_and_memory():
    from megatrain.update_split import prefetch_set

    order = _layers()
    names = [x for x, _ in order]
    rates = UpdateRates()
    loads = 4 * sum(n for _, n in order)
    pre = prefetch_set(order, rates, backward_s=1.5, load_bytes=loads, budget_bytes=1e12)
    assert pre and pre == names[-len(pre):]
    spare = 0.7 * (1.5 * rates.h2d_gbs * 1e9 - loads)
    assert 12 * sum(n for x, n in order if x in pre) <= spare
    assert len(prefetch_set(order, rates, backward_s=3.0, load_bytes=loads, budget_bytes=1e12)) > len(pre)
    assert len(prefetch_set(order, rates, backward_s=1.5, load_bytes=loads, budget_bytes=12 * 233_000_000 * 2)) <= 2
    assert prefetch_set(order, rates, backward_s=0.1, load_bytes=loads, budget_bytes=1e12) == []
    # The split puts them on the GPU path and plans the rest.
    split = plan_split(order, rates, prefetched=frozenset(pre))
    assert set(pre) <= set(split.gpu) and split.cpu and "prefetched" in split.reason


def test_rates_calibrate_from_busy_times_after_the_norm_only():
    """Never from speculative or skipped steps; within 4x of the build's: the CPU params over the worker's busy
    time (the rate under copies with GPU-path groups, the rate alone without) replace a rate they disagree with
    by more than MODEL_DOUBT, move it halfway within it, and move the other CPU rate by the same factor until
    the run has seen that one too; the link rates by the model's GPU-path span for the split that ran over the
    measured one (not the GPU path's bytes over that span: the link carried the forward's loads too), and not
    from a cold update (kept masters uploaded again: a one-off the model does not count)."""
    spec = PRESETS["tiny-llama"]
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), hybrid_cfg(gpu_path_groups="auto"), verbose=False)
    ht = engine.host_tier
    base = dataclasses.replace(ht.rates)
    split = ht.split_for(False)
    assert split.gpu and split.predicted_gpu_path_s > 0
    span = ht._evaluate(split.gpu, frozenset()).predicted_gpu_path_s
    ht._params = [(2 * 10**9, 10**9, False, split), (2 * 10**9, 10**9, False, split)]
    before = dataclasses.replace(ht.rates)
    ht._calibrate({"host_update_busy_s": 1.0, "gpu_path_busy_s": span * 2, "gpu_path_cold_bytes": 4})
    assert (ht.rates.h2d_gbs, ht.rates.d2h_gbs) == (before.h2d_gbs, before.d2h_gbs)  # a cold update: no link rate
    ht.rates, ht.calibrated = dataclasses.replace(before), 0
    ht._cpu_seen.clear()
    ht._calibrate({"host_update_busy_s": 1.0, "gpu_path_busy_s": span / 2})  # 2 Gparam/s; the path twice as fast
    assert abs(2.0 / base.cpu_loaded_gps - 1) > update_split.MODEL_DOUBT
    assert ht.rates.cpu_loaded_gps == pytest.approx(2.0)  # beyond the doubt: replaced
    assert ht.rates.cpu_gps == pytest.approx(base.cpu_gps * 2.0 / base.cpu_loaded_gps)  # not seen: same factor
    assert ht.rates.h2d_gbs == pytest.approx(base.h2d_gbs * 1.5) and ht.calibrated == 1
    assert ht.rates.d2h_gbs == pytest.approx(base.d2h_gbs * 1.5)
    ht._calibrate({"host_update_busy_s": 2 / 2.2, "gpu_path_busy_s": 0.0})  # 2.2: within the doubt, halfway
    assert ht.rates.cpu_loaded_gps == pytest.approx(2.1)
    assert ht.rates.cpu_gps == pytest.approx(base.cpu_gps * 2.1 / base.cpu_loaded_gps)
    ht._calibrate({"host_update_busy_s": 1e-9, "gpu_path_busy_s": 0.0})  # absurdly fast: clamped
    assert ht.rates.cpu_loaded_gps == pytest.approx(4 * base.cpu_loaded_gps)
    assert ht.rates.cpu_gps == pytest.approx(4 * base.cpu_gps)
    cpu_only = forced_split(split.gpu + split.cpu, [])
    ht._params = [(3 * 10**9, 0, False, cpu_only)] * 2  # CPU path alone: its rate without the copies
    ht._calibrate({"host_update_busy_s": 1.0})
    assert ht.rates.cpu_gps == pytest.approx(3.0)  # far from 4x the build's: replaced
    assert ht.rates.cpu_loaded_gps == pytest.approx(4 * base.cpu_loaded_gps)  # seen in this run: stays
    ht._calibrate({"host_update_busy_s": 3 / 3.2})
    assert ht.rates.cpu_gps == pytest.approx(3.1)
    before = dataclasses.replace(ht.rates)
    ht._params = [(10**9, 0, True, cpu_only), (10**9, 0, False, cpu_only)]  # a speculative update: not comparable
    ht._calibrate({"host_update_busy_s": 5.0})
    assert ht.rates == before
    engine.close()


def test_gpu_path_update_is_issued_when_the_next_step_begins_or_state_is_needed():
    """finish only records the GPU path's update; the next step (or synchronize / a load) issues it, so a
    device sync between steps does not serialize it. The host state is the updated one once it is needed."""
    spec = PRESETS["tiny-llama"]
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), hybrid_cfg(), verbose=False)
    gpu = engine.host_tier.gpu
    data = batches(spec, steps=2)
    before = engine.store.master["layer.1"].clone()
    engine.step(data[0])
    assert gpu._pending is not None and torch.equal(engine.store.master["layer.1"], before)
    engine.synchronize()
    assert gpu._pending is None and not torch.equal(engine.store.master["layer.1"], before)
    engine.step(data[1])  # begin_step finds nothing pending; this step's update is pending again
    assert gpu._pending is not None
    engine.close()
    assert gpu._pending is None  # close applied it


def test_summary_says_why_hybrid_runs_the_cpu_path_alone():
    """update_path="hybrid" where the split at the measured rates takes no group (the H200's 14B tiered row at
    a9736ef): the printed summary and the row say so, with the rates and both predictions."""
    from types import SimpleNamespace

    from megatrain.host_tier import HybridHostAdamW
    from megatrain.update_split import Split, UpdateRates

    cpu = SimpleNamespace(names=["layer.0", "layer.1"])
    rates = UpdateRates(cpu_gps=4.0, measured=True)
    split = Split([], ["layer.0", "layer.1"], predicted_s=1.5, predicted_cpu_only_s=1.5, reason="no gain")
    line = HybridHostAdamW(cpu, None, {False: split}, rates).summary()
    assert "CPU kernel only (the GPU path takes no group" in line and "'cpu_gps': 4.0" in line
    assert "predicted 1.500 s vs CPU only 1.500 s" in line and "no gain" in line
    assert HybridHostAdamW(cpu).summary() == "host update: CPU kernel only"  # update_path="cpu": nothing to explain


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("clip", [True, False])
def test_backward_reads_the_kept_master(micro_batches, clip):
    """A GPU-path group's kept master serves every load until its next update: the next forward's cast AND
    the backward's (no load over the link, no wait for the download), still matching plain PyTorch. In
    tiny-llama (4 layers, K=2) the forced GPU-path layer 1 is loaded twice per step (forward, then its
    block's backward; layer 3, the last, stays in its slot from the forward into the backward): from the
    second step on (the first update lands after step 1), both of layer 1's loads read the kept master
    (before, only the forward's did)."""
    import megatrain.streamed_update as su

    spec = PRESETS["tiny-llama"]
    optim = OPTIM if clip else NO_CLIP
    served = []  # (group, step) of every load the kept master served
    step = [0]
    orig_source, orig_begin = su.StreamedAdamW.device_source, su.StreamedAdamW.begin_step

    def source(self, name):
        out = orig_source(self, name)
        if out is not None:
            served.append((name, step[0]))
        return out

    def begin(self, s, speculate):
        step[0] = s
        return orig_begin(self, s, speculate)

    su.StreamedAdamW.device_source, su.StreamedAdamW.begin_step = source, begin
    try:
        data = batches(spec)
        assert_parity(spec.to_hf_config("eager"), hybrid_cfg(micro_batches=micro_batches, optim=optim), data,
                      micro_batches=micro_batches, optim=optim)
    finally:
        su.StreamedAdamW.device_source, su.StreamedAdamW.begin_step = orig_source, orig_begin
    for s in range(1, len(data)):
        assert served.count(("layer.1", s)) == 2, (s, served)
        assert served.count(("layer.3", s)) == 1, (s, served)
    assert not [x for x in served if x[1] == 0]  # nothing kept before the first update


def test_kept_masters_go_to_the_planned_groups_first():
    """The kept-master budget goes to ``kept_first`` (build_host_tier: the first split's GPU-path groups) before
    the other candidates, so that a hedge candidate early in the forward order never takes the buffer a planned
    group's next load would read; with no preference, forward order."""
    from megatrain.streamed_update import StreamedAdamW

    spec = PRESETS["tiny-llama"]
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), hybrid_cfg(update_path="cpu"), verbose=False)
    try:
        names = [g.name for g in engine.groups]
        n = {x: engine.store.by_name[x].numel for x in names}
        budget = 4 * max(n[names[0]], n[names[-1]])  # one master of the two fits, not both
        assert 4 * (n[names[0]] + n[names[-1]]) > budget
        make = lambda **kw: StreamedAdamW(engine.store, OPTIM, [names[0], names[-1]], engine.streams,  # noqa: E731
                                          chunk=1 << 20, kept_budget=budget, pin=False, **kw)
        assert list(make().kept) == [names[0]]
        assert list(make(kept_first=[names[-1]]).kept) == [names[-1]]
    finally:
        engine.close()


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_parity_kept_bf16_shadow_against_pytorch(micro_batches):
    """The GPU path's kept bf16 shadow (stream_dtype="bf16") against tests/reference.py doing the same casting
    (the fp32 master rounded to bf16 once per step): losses at the fp32 bound, weights at BF16_WEIGHT_RTOL
    (test_engine_parity explains it). That those loads read the kept copies is asserted above
    (test_cpu_path_reports_counts_and_bf16_shadow_matches); here only that both paths ran."""
    from test_engine_parity import BF16_WEIGHT_RTOL, run_engine

    spec = PRESETS["tiny-llama"]
    hf, data = spec.to_hf_config("eager"), batches(spec)
    stats = {}
    init, losses, final = run_engine(hf, hybrid_cfg(stream_dtype="bf16", micro_batches=micro_batches), data,
                                     stats_out=stats)
    assert stats["gpu_path_groups"] > 0 and stats["cpu_groups"] > 0
    assert_matches_reference(hf, init, losses, final, data, micro_batches, weight_rtol=BF16_WEIGHT_RTOL,
                             stream_dtype=torch.bfloat16)


@pytest.mark.parametrize("stream_dtype", ["fp32", "bf16"])
def test_a_kept_master_goes_up_once_while_its_group_stays_on_the_gpu_path(stream_dtype):
    """A GPU-path group's kept fp32 master is its master of record: updated in place, not downloaded (host RAM
    gets it when it needs it), and from the group's second update on not uploaded either: 8 B/param each way
    (m and v), not 12; the weights still match plain PyTorch (a stale buffer reused after a CPU-path update
    fails test_runtime_split.py::test_engine_parity_while_the_runtime_split_changes; a missed write-back
    fails the save/load, NaN and state_dict cases). With a bf16 shadow the kept copy is the shadow, so the
    master goes up and down every time. ``gpu_path_h2d_bytes`` / ``gpu_path_d2h_bytes``: what the path queued
    in the step (a step issues the previous step's update); ``gpu_path_cold_bytes`` the kept masters' uploads."""
    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("eager")
    cfg = hybrid_cfg(micro_batches=1, stream_dtype=stream_dtype)
    data = batches(spec)
    engine = MegaTrain.from_config(hf, cfg, verbose=False)
    gpu_params = sum(engine.store.by_name[x].numel for x in FORCED.split(",") if x in engine.store.by_name)
    kept = set(engine.host_tier.gpu.kept)
    assert kept == {x for x in FORCED.split(",") if x in engine.store.by_name}  # all kept: the CPU staging holds them
    init = {k: v.clone() for k, v in engine.state_dict().items()}
    losses, up, down, cold = [], [], [], []
    for b in data:
        losses.append(engine.step(b).loss)
        up.append(engine.stats["gpu_path_h2d_bytes"])
        down.append(engine.stats["gpu_path_d2h_bytes"])
        cold.append(engine.stats["gpu_path_cold_bytes"])
    final = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    if stream_dtype == "fp32":
        assert_matches_reference(hf, init, losses, final, data, micro_batches=1)
    # step 0 issued nothing; step 1 the first update (p, m, v); then m, v only where the master is kept fp32
    later = 12 if stream_dtype == "bf16" else 8
    assert up == [0, 12 * gpu_params] + [later * gpu_params] * (len(data) - 2), (up, gpu_params)
    assert down == [0] + [later * gpu_params] * (len(data) - 1), (down, gpu_params)
    # the kept fp32 masters' first upload is the split's cold start (SplitChooser rule 0); a shadow is no master
    first = 4 * gpu_params if stream_dtype == "fp32" else 0
    assert cold == [0, first] + [0] * (len(data) - 2), (cold, gpu_params)


def test_a_skipped_step_then_loads_from_host_ram_see_the_kept_masters_written_back():
    """Kept fp32 masters are the GPU-path groups' masters of record (host RAM gets them only when it needs
    them). After a skipped step (NaN gradient) they no longer serve loads (``_fresh`` is cleared), so the next
    forward loads those groups from host RAM: the masters must be written back first. No synchronize
    around the skipped step here (train_past_a_nan_step's would write everything back itself)."""
    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("eager")
    data = batches(spec)
    engine = MegaTrain.from_config(hf, hybrid_cfg(optim=NO_CLIP), verbose=False)
    init = {k: v.clone() for k, v in engine.state_dict().items()}
    inject_nan_gradient(engine, "layer.2", at_call=3)  # a CPU-path group's gradient: the whole step is skipped
    losses = []
    for s, b in enumerate(data):
        if s == 2:
            with pytest.warns(RuntimeWarning, match="step skipped"):
                engine.step(b)
            assert engine.host_tier.gpu._dirty  # the last update's masters are still only on the "GPU"
            continue
        losses.append(engine.step(b).loss)
    final = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    assert_matches_reference(hf, init, losses, final, [b for s, b in enumerate(data) if s != 2], 2, NO_CLIP)
