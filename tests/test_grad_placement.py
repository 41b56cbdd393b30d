"""grad_placement: where the host tier's gradients wait for the global norm ("gpu", "host", "auto").

On CPU the "host" path runs the same code as on CUDA (the D2H copy into the group's host buffer is a
synchronous copy, events are always complete): parity with plain PyTorch at 1e-5 for pure streaming, mixed
tiers, clipping, speculation with rollback, 1 and 2 micro-batches, tied and untied embeddings; the plan's
"auto" resolution and its numbers for models whose gradients do not fit the GPU."""
from __future__ import annotations

import pytest
import torch

from megatrain import EngineConfig, MegaTrain, PRESETS
from megatrain import placement as placement_mod
from megatrain.grad_placement import GradsOnGpu, GradsOnHost, make_grad_home
from megatrain.memory import plan_for_spec
from megatrain.spec import get_preset
from megatrain.streams import StreamSet

from test_engine_parity import assert_parity, batches, engine_cfg
from test_engine_tiers import NO_CLIP, every_other_plus_head

GIB = 2**30


def _tiers(hf):
    from megatrain.arch import build_meta_model
    from megatrain.store import make_groups

    return every_other_plus_head(make_groups(build_meta_model(hf)))


class _Spy:
    """Records what each host-tier group's optimizer received, to prove it reads the host buffer."""

    def __init__(self, engine):
        self.seen = {}
        orig = engine.host_opt.grad_ready

        def grad_ready(name, flat, sqnorm, ready):
            self.seen[name] = flat
            return orig(name, flat, sqnorm, ready)

        engine.host_opt.grad_ready = grad_ready


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])  # untied, tied
@pytest.mark.parametrize("setting", ["0", "mixed"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_parity_host_gradients(preset, setting, micro_batches):
    """grad_placement="host": pure streaming and a mix of tiers (every other layer + head on the GPU tier);
    clipping fires every step (max_grad_norm 0.5 against norms of ~2-5)."""
    spec = PRESETS[preset]
    hf = spec.to_hf_config("eager")
    kw = {"tiers": _tiers(hf)} if setting == "mixed" else {}
    cfg = engine_cfg(checkpoint_interval=2, grad_placement="host", micro_batches=micro_batches,
                     **({} if setting == "mixed" else {"gpu_resident": setting}))
    stats = {}
    assert_parity(hf, cfg, batches(spec), micro_batches=micro_batches, engine_kwargs=kw, stats_out=stats)
    assert stats["clipped"] == len(batches(spec))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_parity_host_gradients_speculation(preset):
    """Speculative early updates read the host buffer; rolled back and redone from it when clipping fires
    (every step), kept when it never fires."""
    spec = PRESETS[preset]
    hf = spec.to_hf_config("eager")
    data = batches(spec)
    stats = {}
    assert_parity(hf, engine_cfg(checkpoint_interval=2, speculate="always", grad_placement="host"), data,
                  stats_out=stats)
    assert stats["rollbacks"] == len(data) and stats["early_groups"] == len(data) * (spec.num_layers + 2)
    stats = {}
    assert_parity(hf, engine_cfg(checkpoint_interval=2, grad_placement="host", gpu_resident="1", optim=NO_CLIP),
                  data, optim=NO_CLIP, stats_out=stats)
    assert stats["rollbacks"] == 0 and stats["speculated"] == len(data) - 1


def test_host_tier_optimizer_reads_the_host_buffers():
    """Under "host" each host-tier group's optimizer gets the group's own host buffer (no slabs), holding
    the gradient whose norm went into the global norm; GPU-tier groups get their gradient as it was."""
    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("eager")
    engine = MegaTrain.from_config(hf, engine_cfg(grad_placement="host", gpu_resident="2"), verbose=False)
    home = engine.grad_home
    assert isinstance(home, GradsOnHost) and engine.grad_stream.n_slabs == 0
    assert set(home.buffers) == set(engine.placement.host_names) == {"layer.2", "layer.3", "final"}
    assert home.host_bytes == 4 * engine.placement.params_on("host") == engine.placement.host_parts["host_grads"]
    spy = _Spy(engine)
    engine.step(batches(spec, steps=1)[0])
    engine.synchronize()
    for name in engine.placement.host_names:
        assert spy.seen[name] is home.buffers[name]
        assert spy.seen[name].dtype == torch.float32 and float(spy.seen[name].norm()) > 0
    assert engine.memory().extra["grad_placement"] == "host"
    engine.close()
    # "gpu": nothing changes (slabs, no buffers)
    engine = MegaTrain.from_config(hf, engine_cfg(grad_placement="gpu", gpu_resident="2"), verbose=False)
    assert isinstance(engine.grad_home, GradsOnGpu) and engine.placement.host_parts["host_grads"] == 0
    engine.close()


def test_grads_on_host_places_only_host_tier_groups():
    home = make_grad_home("host", {"layer.1": 10}, StreamSet(torch.device("cpu")), pin=False)
    g = torch.arange(10, dtype=torch.bfloat16)
    out, ready = home.place("layer.1", g, "ready")
    assert out is home.buffers["layer.1"] and out.dtype == torch.float32 and torch.equal(out, g.float())
    assert ready != "ready"  # the copy's event, not the gradient's
    other = torch.ones(4)
    assert home.place("layer.0", other, "ready") == (other, "ready")  # GPU tier: untouched
    assert home.slabs(4) == 0 and make_grad_home("gpu", {}, None, False).slabs(4) == 4
    with pytest.raises(ValueError, match="unresolved"):
        make_grad_home("auto", {}, None, False)


def test_config_rejects_bad_grad_placement():
    with pytest.raises(ValueError, match="grad_placement"):
        EngineConfig(grad_placement="cpu")


def test_cpu_auto_keeps_gradients_where_they_are():
    """On a CPU run "auto" is "gpu" (one memory: moving gradients would only add a copy)."""
    spec = PRESETS["tiny-llama"]
    engine = MegaTrain.from_config(spec.to_hf_config("eager"), engine_cfg(), verbose=False)
    assert engine.placement.grads == "gpu" and "grad_placement=auto -> gpu" in engine.placement.summary()
    engine.close()


# -- the plan ----------------------------------------------------------------------------------------
def _plan(model, gpu_gib, options=None, host=1 << 62, tokens=16 * 1024):
    return plan_for_spec(get_preset(model), options or {}, tokens_per_step=tokens, gpu_free=int(gpu_gib * GIB),
                         host_available=host)


def test_plan_72b_on_h200_moves_gradients_to_the_host():
    """72B on a 141 GB H200: 140 GiB of bf16 gradients cannot wait on the GPU; "auto" plans them on the host
    (4 B/param there), the GPU side fits, and the host side (~1 TiB) is reported with its numbers."""
    spec = get_preset("qwen2.5-72b")
    with pytest.raises(MemoryError, match=r"GPU needs 1\d\d\.\d\d GiB but 140\.00 GiB is free"):
        _plan("qwen2.5-72b", 140, {"grad_placement": "gpu"})
    plan = _plan("qwen2.5-72b", 140)
    assert plan.grads == "host" and plan.grad_setting == "auto"
    assert sum(plan.gpu_parts.values()) <= plan.gpu_budget
    p_host = plan.params_on("host")
    assert plan.host_parts["host_grads"] == 4 * p_host and plan.host_parts["grad_slabs"] == 0
    assert p_host > 0.9 * spec.num_params()
    host = sum(plan.host_parts.values())
    assert 900 * GIB < host < 1200 * GIB  # ~1.1 TB: 16 B/param of the host tier
    summary = plan.summary()
    assert "grad_placement=auto -> host" in summary and f"host predicted {host / GIB:.2f} GiB" in summary
    assert "host_grads" in summary
    # GPU side: the GPU tier's gradients + what is in flight, far below the 140 GiB of all of them
    assert plan.gpu_parts["grads"] < 30 * GIB
    # the H200 node's 126 GiB host: refused with the host's numbers, and the plan it tried
    with pytest.raises(MemoryError, match=r"host needs \d{3,4}\.\d\d GiB but 126\.00 GiB is available") as err:
        _plan("qwen2.5-72b", 140, host=126 * GIB)
    assert "grad_placement=auto -> host" in err.value.placement.summary()


def test_plan_14b_on_24gib_gpu_moves_gradients_to_the_host():
    """14B on a 24 GiB GPU (the paper's RTX 3090), a 3090-sized step: 27.5 GiB of bf16 gradients do not fit;
    with them on the host the GPU side does. (With the default knobs, 16K tokens per step, a 4096-token loss
    chunk and a 6 GiB margin, the GPU side does not fit 24 GiB even so: refused with the numbers.)"""
    opts = {"loss_chunk_tokens": 1024, "gpu_margin_gib": 2}
    with pytest.raises(MemoryError, match="GPU needs"):
        _plan("qwen2.5-14b", 24, dict(opts, grad_placement="gpu"), tokens=4096)
    plan = _plan("qwen2.5-14b", 24, opts, tokens=4096)
    assert plan.grads == "host" and not plan.gpu_names
    assert sum(plan.gpu_parts.values()) <= plan.gpu_budget
    spec = get_preset("qwen2.5-14b")
    assert plan.host_parts["host_grads"] == 4 * plan.params_on("host") >= 4 * spec.num_params() - 4096
    assert 200 * GIB < sum(plan.host_parts.values()) < 260 * GIB  # 16 B/param + overhead
    with pytest.raises(MemoryError, match=r"GPU needs \d+\.\d\d GiB but 24\.00 GiB is free") as err:
        _plan("qwen2.5-14b", 24)
    assert "grad_placement=auto -> host" in err.value.placement.summary()


def test_plan_auto_keeps_gradients_on_the_gpu_when_they_fit():
    plan = _plan("qwen2.5-7b", 140)
    assert plan.grads == "gpu" and plan.host_parts["host_grads"] == 0
    assert "grad_placement=auto -> gpu" in plan.summary()
    gpu = _plan("qwen2.5-7b", 140, {"grad_placement": "gpu"})
    assert gpu.tiers == plan.tiers and gpu.gpu_parts == plan.gpu_parts and gpu.host_parts == plan.host_parts


def test_grad_bytes_formula():
    """GPU gradient bytes: "gpu" every group (c per layer parameter, 4 for embedding/head); "host" the GPU
    tier's + in flight ((2c + 4) x the largest host layer + 8 x the largest host embedding/head group)."""
    numels = {"embed": 100, "layer.0": 10, "layer.1": 20, "layer.2": 30, "final": 50}
    tiers = {"embed": "gpu", "layer.0": "gpu", "layer.1": "host", "layer.2": "host", "final": "host"}
    shape = placement_mod.StepShape(num_layers=3, hidden=8, ffn=16, vocab=50, micro_batches=1,
                                    tokens_per_micro_batch=4, block=1, num_pool_slots=2, compute_bytes=2,
                                    stream_fp32=True, bf16_shadow=False, slab_bytes_total=0, loss_chunk_tokens=4)
    assert placement_mod.grad_bytes(numels, tiers, shape) == 2 * 60 + 4 * 150
    host = placement_mod.replace(shape, grads="host")
    assert placement_mod.grad_bytes(numels, tiers, host) == (4 * 100 + 2 * 10) + 8 * 30 + 8 * 50
    fp32 = placement_mod.replace(host, compute_bytes=4)
    assert placement_mod.grad_bytes(numels, tiers, fp32) == (4 * 100 + 4 * 10) + 4 * 30 + 8 * 50
