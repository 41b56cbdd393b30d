"""The step-time model (megatrain/cost_model.py) decides grad_placement="auto" and update_path="auto": each
choice is planned and predicted, the faster wins (the non-default one only by CONTESTED_GAIN), an explicit
setting always wins, and the printed plan says why with both predictions. CPU only: the plan is a pure
function of the sizes, the memories and the rates, injected here."""
from __future__ import annotations

import dataclasses

import pytest

from megatrain import PRESETS, MegaTrain, cost_model
from megatrain import placement as P
from megatrain import planner
from megatrain.host_tier import build_host_tier

from test_engine_parity import assert_parity, batches, engine_cfg

GIB = 2**30
LAYERS = 32


def _numels():
    return {"embed": 50_000_000, **{f"layer.{i}": 50_000_000 for i in range(LAYERS)}, "final": 50_000_000}


def _shape(**kw):
    # fp32 compute: a gradient waiting on the GPU costs 4 B/param there, and the CPU update reads the same
    # bytes from either home (so only the tiers and the link decide)
    base = dict(num_layers=LAYERS, hidden=1024, ffn=4096, vocab=50_000, micro_batches=1, tokens_per_micro_batch=4096,
                block=1, num_pool_slots=2, compute_bytes=4, stream_fp32=True, bf16_shadow=False, slab_bytes_total=0,
                loss_chunk_tokens=1024, recompute="all", seq_len=1024)
    base.update(kw)
    return P.StepShape(**base)


def _plan(rates, gpu_gib=10, grads="auto", update_path="cpu", setting="auto", **shape_kw):
    return planner.plan(_numels(), _shape(**shape_kw), setting=setting, on_gpu=True, gpu_free=int(gpu_gib * GIB),
                  host_available=1 << 40, gpu_margin=0, host_margin=0, grads=grads, rates=rates,
                  update_path=update_path, staging_reserve=GIB)


# -- grad_placement ---------------------------------------------------------------------------------------
def test_grad_placement_auto_follows_the_predicted_step():
    """Both placements fit a 10 GiB GPU; gradients on the host free GPU memory for 7 more GPU-tier layers. At
    the H200's rates that is predicted faster ("host"); where the link loses most of each direction while the
    other runs (link_both_ways 0.1), the backward's gradient copies slow its weight loads and "gpu" wins (with a
    CPU kernel at 2.72 Gparam/s: a faster one hides less of that backward behind the update)."""
    default, crowded = cost_model.Rates(), cost_model.Rates(link_both_ways=0.1, cpu_adamw_gparams=2.72)
    for rates, want in ((default, "host"), (crowded, "gpu")):
        gpu, host = _plan(rates, grads="gpu"), _plan(rates, grads="host")
        assert host.gpu_layers > gpu.gpu_layers  # what "host" buys: more of the model on the GPU tier
        auto = _plan(rates)
        assert auto.grads == want and auto.grad_setting == "auto"
        faster, slower = (host, gpu) if want == "host" else (gpu, host)
        assert faster.prediction.step_s < slower.prediction.step_s
        assert auto.tiers == faster.tiers and auto.prediction.step_s == pytest.approx(faster.prediction.step_s)
        line = next(x for x in auto.summary().splitlines() if x.strip().startswith("gradients:"))
        assert line.strip().startswith(f"gradients: {want} (auto: predicted")
        assert f"{gpu.prediction.step_s:.3f} s" in line and f"{host.prediction.step_s:.3f} s" in line
    assert "grad_placement=auto -> host" in _plan(default).summary()


def test_grad_placement_explicit_setting_wins():
    """The model prefers "host" at these rates; an explicit "gpu" is kept (and "host" where it prefers "gpu")."""
    assert _plan(cost_model.Rates(), grads="gpu").grads == "gpu"
    assert _plan(cost_model.Rates(link_both_ways=0.1), grads="host").grads == "host"
    assert not _plan(cost_model.Rates(), grads="gpu").grads_reason  # nothing was chosen


def test_grad_placement_host_needs_the_contested_gain():
    """With the tiers fixed (gpu_resident=0: nothing for "host" to buy) "host" only adds fp32 copies during the
    backward: "gpu" stays, and a "host" predicted faster by less than CONTESTED_GAIN would not move it."""
    plan = _plan(cost_model.Rates(), setting="0")
    assert plan.grads == "gpu" and "on the host" in plan.grads_reason
    load_gpu = P.step_load(_numels(), plan.tiers, _shape())
    load_host = P.step_load(_numels(), plan.tiers, _shape(grads="host"))
    assert load_host.grads_on_host and not load_gpu.grads_on_host
    a, b = cost_model.predict(load_gpu).step_s, cost_model.predict(load_host).step_s
    assert b >= a * (1 - planner.CONTESTED_GAIN)


def test_grad_placement_when_gpu_does_not_fit_is_host_as_before():
    plan = _plan(cost_model.Rates(), gpu_gib=8)
    assert plan.grads == "host" and "do not fit on the GPU" in plan.grads_reason
    with pytest.raises(MemoryError, match="GPU needs"):
        _plan(cost_model.Rates(), gpu_gib=8, grads="gpu")


def test_cost_model_grads_on_host_terms():
    """"host": each host layer's gradient goes out during the backward (fp32, both directions sharing the
    link), and the update then waits for no gradient; "gpu": the update pulls c B/param down after the norm."""
    tiers = {x: "host" for x in _numels()}
    shape = _shape(compute_bytes=2)
    slow = cost_model.Rates(d2h_gbps=0.5)
    on_gpu = cost_model.predict(P.step_load(_numels(), tiers, shape), slow)
    on_host = cost_model.predict(P.step_load(_numels(), tiers, dataclasses.replace(shape, grads="host")), slow)
    layer_out = 50e6 * 4 / (0.5e9 * slow.link_both_ways)  # one layer's fp32 gradient at that link
    assert on_host.parts["backward_s"] >= LAYERS * layer_out
    assert on_gpu.parts["backward_s"] < LAYERS * layer_out / 10
    assert on_gpu.parts["host_update_s"] == pytest.approx(34 * 50e6 * 2 / (0.5e9 * slow.link_both_ways))
    a = cost_model.predict(P.step_load(_numels(), tiers, shape)).parts["host_update_s"]
    b = cost_model.predict(P.step_load(_numels(), tiers, dataclasses.replace(shape, grads="host"))).parts["host_update_s"]
    assert b == pytest.approx(a * 28 / 26)  # an fp32 gradient read from host RAM


# -- update_path --------------------------------------------------------------------------------------------
def test_update_path_auto_follows_the_predicted_step():
    """Pure streaming: at the H200's rates the GPU update path beside the CPU kernel is predicted faster
    ("hybrid"); with a fast CPU kernel (100 Gparam/s) it has nothing to take ("cpu"). The plan prints both."""
    fast_cpu = cost_model.Rates(cpu_adamw_gparams=100.0, cpu_adamw_under_copy_gparams=100.0)
    for rates, want in ((cost_model.Rates(), "hybrid"), (fast_cpu, "cpu")):
        cpu, hybrid = _plan(rates, setting="0"), _plan(rates, setting="0", update_path="hybrid")
        auto = _plan(rates, setting="0", update_path="auto")
        assert auto.update_path == want and auto.update_path_setting == "auto"
        assert hybrid.prediction.step_s <= cpu.prediction.step_s  # a split never predicted slower than none
        line = next(x for x in auto.summary().splitlines() if x.strip().startswith("host update:"))
        assert line.strip().startswith(f"host update: {want} (auto: predicted {cpu.prediction.step_s:.3f} s with "
                                       f"the CPU kernel alone vs {hybrid.prediction.step_s:.3f} s")
        assert auto.info()["update_path"] == want
    hybrid = _plan(cost_model.Rates(), setting="0", update_path="hybrid")
    parts = hybrid.prediction.parts
    assert parts["gpu_path_groups"] > 0 and parts["host_update_s"] < parts["host_update_cpu_only_s"]
    assert "update_path hybrid:" in hybrid.prediction.describe()


def test_update_path_hybrid_keeps_its_staging_free():
    """"hybrid" plans with update_staging free on top of the margin: the GPU tier may hold less."""
    cpu, hybrid = _plan(cost_model.Rates()), _plan(cost_model.Rates(), update_path="hybrid")
    assert sum(hybrid.gpu_parts.values()) <= hybrid.gpu_budget == cpu.gpu_budget - GIB
    assert hybrid.gpu_layers <= cpu.gpu_layers
    assert _plan(cost_model.Rates(), update_path="cpu").update_path == "cpu"


def test_cost_model_hybrid_is_the_split_of_update_split():
    """The hybrid term is the runtime's first split (host_tier.first_split: update_split.plan_split) at the
    model's update rates: its CPU-only time is the CPU term."""
    tiers = {x: "host" for x in _numels()}
    load = P.step_load(_numels(), tiers, _shape(compute_bytes=2), gpu_path_staging=float("inf"))
    cpu = cost_model.predict(load)
    hybrid = cost_model.predict(dataclasses.replace(load, update_path="hybrid"))
    assert hybrid.parts["host_update_cpu_only_s"] == pytest.approx(cpu.parts["host_update_s"], rel=1e-2)
    split, on, _, _ = cost_model.hybrid_split(load, cost_model.Rates(), 0.0)
    assert split.predicted_cpu_only_s == pytest.approx(cpu.parts["host_update_s"], rel=1e-2)
    assert hybrid.parts["host_update_s"] == pytest.approx(split.predicted_s)
    assert len(on) == len(_numels()) and sum(on) == len(split.gpu) == hybrid.parts["gpu_path_groups"]
    # without kept masters (no staging beyond the rotating buffers) the forward loads GPU-path groups again
    tight = cost_model.predict(dataclasses.replace(load, update_path="hybrid", gpu_path_staging_bytes=0))
    assert tight.parts["host_update_s"] >= hybrid.parts["host_update_s"]
    # speculative: the split's time after the norm is what is exposed
    spec = cost_model.predict(dataclasses.replace(load, update_path="hybrid", speculate=True))
    assert spec.parts["host_update_exposed_s"] == pytest.approx(spec.parts["host_update_s"] - spec.parts["backward_s"])


def test_update_path_auto_on_cpu_is_cpu_and_matches_pytorch():
    """A CPU run predicts nothing: "auto" is "cpu" (parity with plain PyTorch as every path)."""
    spec = PRESETS["tiny-llama"]
    cfg = engine_cfg(update_path="auto", checkpoint_interval=2)
    assert_parity(spec.to_hf_config("eager"), cfg, batches(spec))
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), cfg, verbose=False)
    try:
        assert engine.placement.update_path == "cpu" and engine.host_tier.gpu is None
        assert engine.memory().extra["update_path"] == "cpu"
        assert "host update: cpu (auto: CPU run" in engine.placement.summary()
        with pytest.raises(ValueError, match="resolved update path"):
            build_host_tier(engine.host_opt, store=engine.store, cfg=cfg, streams=engine.streams,
                            host_names=engine.placement.host_names, grads_on_host=False, staging_bytes=0.0)
    finally:
        engine.close()


def test_config_accepts_update_path_auto_and_rejects_others():
    from megatrain import EngineConfig

    assert EngineConfig(update_path="auto").update_path == "auto"
    assert EngineConfig().update_path == "auto"  # the default since 2026-12-07j (docs/engine.md "Choosing it")
    with pytest.raises(ValueError, match="update_path must be 'cpu', 'hybrid' or 'auto'"):
        EngineConfig(update_path="gpu")


def test_cost_model_gpu_path_backward_casts_kept_masters():
    """With every updated master kept on the GPU, a GPU-path layer's backward load is a cast on the device
    (megatrain/streamed_update.py ``device_source``): the hybrid backward and H2D drop by those layers' link
    time where the link bounds them; without kept masters (no staging beyond the chunks) they do not."""
    tiers = {x: "host" for x in _numels()}
    # few tokens: each layer's backward is bound by its load over the link
    load = P.step_load(_numels(), tiers, _shape(compute_bytes=2, tokens_per_micro_batch=256),
                       gpu_path_staging=float("inf"))
    assert load.host_group_layers == [-1, *range(LAYERS), -1]
    cpu = cost_model.predict(load)
    hybrid = cost_model.predict(dataclasses.replace(load, update_path="hybrid"))
    split, on, _, _ = cost_model.hybrid_split(load, cost_model.Rates(), 0.0)
    layers_on_path = sum(1 for layer, x in zip(load.host_group_layers, on) if x and layer >= 0)
    assert layers_on_path > 0
    per_layer = 50_000_000 * load.stream_bytes / (cost_model.Rates().h2d_gbps * cost_model.GB)
    assert hybrid.parts["h2d_s"] == pytest.approx(cpu.parts["h2d_s"] - layers_on_path * per_layer)
    assert hybrid.parts["backward_s"] < cpu.parts["backward_s"]
    from megatrain.streamed_update import CHUNK_ELEMS, rotating_bytes

    chunks_only = dataclasses.replace(load, update_path="hybrid",
                                      gpu_path_staging_bytes=rotating_bytes(CHUNK_ELEMS, False) + 1)
    tight = cost_model.predict(chunks_only)
    assert tight.parts["gpu_path_groups"] > 0  # a GPU path, but no kept master: its loads cross the link
    assert tight.parts["backward_s"] == pytest.approx(cpu.parts["backward_s"])


def test_cpu_variants_of_the_sweeps_ask_for_the_cpu_path():
    """With "auto" the default, a variant named for the CPU path must say update_path: cpu, or on a GPU the
    plan may give it the GPU update path and the same-run pair compares the hybrid with itself."""
    from pathlib import Path

    import yaml

    conf = Path(__file__).resolve().parents[1] / "experiments/conf/sweep"
    variants = lambda stem: yaml.safe_load((conf / f"{stem}.yaml").read_text())["sweep"]["variants"]  # noqa: E731
    asked = {f"update_path/{n}": o.get("update_path") for n, o in variants("update_path").items() if "_cpu" in n}
    asked["ablation/cpu_update_path"] = variants("ablation")["cpu_update_path"].get("update_path")
    assert len(asked) == 9 and set(asked.values()) == {"cpu"}, asked
