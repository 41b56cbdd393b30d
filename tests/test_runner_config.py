"""Sweep configs: every sweep composes and expands to the paper's points; YAML mirrors the schemas."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments import config as C  # noqa: E402  (registers the schemas)
from experiments import skips, sweeps  # noqa: E402

CONF = ROOT / "experiments" / "conf"
SWEEPS = ("smoke", "baselines", "size", "depth", "width", "context", "hardware", "ablation", "tokens",
          "baselines_tune", "host_side", "activations", "update_path", "baselines2026", "accuracy_sft", "engine")
GIB = 2**30


@pytest.fixture(scope="module")
def compose_fn():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield compose
    GlobalHydra.instance().clear()


def expand(compose_fn, *overrides, device="cuda", gpu_name="NVIDIA H200"):
    cfg = compose_fn(config_name="config", overrides=list(overrides))
    sweep = [o for o in overrides if o.startswith("sweep=")][0]

    def load(group, name):
        return compose_fn(config_name="config", overrides=[sweep, f"{group}={name}"])[group]

    return cfg, sweeps.expand(cfg, load, device=device, gpu_name=gpu_name)


def test_paper_width_and_depth_shapes():
    """docs/reproduction.md "The paper's width shapes": our depth axis reproduces the paper's 180 layers =
    43B; our width 5x (hidden and FFN x 5: 166.5B parameters, 2.0 TB of fp32 master + Adam state) could not
    be held by either of the paper's hosts (a 480 GB GH200; 1.5 TB on the H200), so it is not the paper's."""
    from megatrain.memory import host_estimate
    from megatrain.spec import PRESETS

    base = PRESETS["qwen2.5-7b"]
    assert abs(base.scaled(depth=180).num_params() / 43e9 - 1) < 0.005  # the paper: "180 layers (43B)"
    billions = [round(base.scaled(depth=28, width=w).num_params() / 1e9, 1) for w in (1, 1.5, 2, 3, 4, 5)]
    assert billions == [7.6, 15.4, 28.1, 61.4, 107.5, 166.5]
    host = lambda w: host_estimate(base.scaled(depth=28, width=w))["total_bytes"]  # noqa: E731
    assert host(5) > 1.5e12 and round(host(5) / 1e12, 2) == 2.0  # beyond the paper's largest host
    assert host(2.25) < 480e9 < host(2.5)  # the widest of ours a 480 GB GH200 could hold


def test_every_sweep_file_exists_and_expands(compose_fn):
    assert sorted(p.stem for p in (CONF / "sweep").glob("*.yaml")) == sorted(SWEEPS)
    for name in SWEEPS:
        cfg, points = expand(compose_fn, f"sweep={name}")
        assert cfg.sweep.name == name and points, name
        assert len({p.id for p in points}) == len(points)


def test_paper_axes(compose_fn):
    _, pts = expand(compose_fn, "sweep=size")
    assert [p.model for p in pts[::5]] == ["qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b",
                                           "gpt-oss-120b-dense"]
    assert [p.system for p in pts[:5]] == ["megatrain", "zero3", "fsdp", "gemini", "native"]
    assert {(p.batch_size, p.seq_len) for p in pts} == {(8, 1024)}

    _, pts = expand(compose_fn, "sweep=depth")
    mt = [p for p in pts if p.system == "megatrain"]
    assert [p.num_layers for p in mt] == [4, 8, 14, 28, 42, 56, 84, 132, 180]
    assert {(p.spec["hidden_size"], p.spec["intermediate_size"]) for p in mt} == {(3584, 18944)}

    cfg, pts = expand(compose_fn, "sweep=width")
    mt = [p for p in pts if p.system == "megatrain"]
    assert [p.width for p in mt] == [1.0, 1.5, 2.0, 3.0, 4.0, 5.0]
    assert {p.num_layers for p in mt} == {28}
    assert mt[2].spec["hidden_size"] == 2 * 3584 and mt[0].id.endswith("w1__s1024__b4__default__H200")
    _, pts = expand(compose_fn, "sweep=width", "model.depth=14")
    assert {p.num_layers for p in pts} == {14}

    _, pts = expand(compose_fn, "sweep=context")
    mt = [p for p in pts if p.system == "megatrain"]
    assert [p.seq_len for p in mt] == [1024 * 2**i for i in range(10)]
    assert [p.batch_size for p in mt] == [16, 8, 4, 2, 1, 1, 1, 1, 1, 1]
    assert all(p.spec["max_position_embeddings"] == 524288 for p in pts)  # every system, the same override
    assert {p.options.max_position_embeddings for p in mt} == {524288}
    # from 128K on: one measured step, no warm-up; shorter points keep the run's 3 + 1
    assert [(p.steps, p.warmup_steps) for p in mt] == [(3, 1)] * 7 + [(1, 0)] * 3
    _, pts = expand(compose_fn, "sweep=context", "sweep.long_seq_from=0")
    assert {(p.steps, p.warmup_steps) for p in pts} == {(3, 1)}
    with pytest.raises(sweeps.SweepError, match="long_steps"):
        expand(compose_fn, "sweep=context", "sweep.long_steps=0")

    _, pts = expand(compose_fn, "sweep=tokens")
    mt = [p for p in pts if p.system == "megatrain"]
    assert [p.tokens_per_step for p in mt] == [8192 * 2**i for i in range(5)] + [158 * 1024]  # the paper's 158x1024
    assert {p.seq_len for p in mt} == {1024} and {p.system for p in pts} == {"megatrain", "native", "zero3"}
    assert {p.model for p in pts} == {"qwen2.5-3b"}


def test_hardware_profiles(compose_fn):
    _, pts = expand(compose_fn, "sweep=hardware", "system=megatrain")
    hw = [(p.hardware["label"], p.hardware["emulated"], p.hardware["gpu_mem_gib"], p.hardware["peak_tflops"])
          for p in pts]
    assert hw == [("H200", False, None, 797.5), ("H200x2", False, None, 797.5), ("A100-80GB", True, 80, 312.0),
                  ("RTX-A6000-48GB", True, 48, 154.8), ("RTX-3090-24GB", True, 24, 142.0)]
    assert [p.gpus for p in pts] == [1, 2, 1, 1, 1]  # real-x2: two GPUs of the node, data parallel
    _, pts = expand(compose_fn, "sweep=hardware")
    assert {p.system for p in pts if p.gpus == 2} == {"megatrain"}  # the others cannot use two GPUs
    _, pts = expand(compose_fn, "sweep=smoke", device="cpu", gpu_name="")
    assert {p.hardware["label"] for p in pts} == {"cpu"} and pts[0].hardware["peak_tflops"] is None


def test_host_side_sweep_and_cpu_side_profiles(compose_fn):
    """The host_side sweep pairs 14B tiered and 7B pure streaming with the real host and four emulated
    ones; a cores profile gives the point as many torch threads as cores, a host profile its RAM cap."""
    _, pts = expand(compose_fn, "sweep=host_side")
    assert [(p.model, p.variant) for p in pts[::7]] == [("qwen2.5-14b", "tiered"), ("qwen2.5-7b", "pure_streaming")]
    assert len(pts) == 14 and {p.system for p in pts} == {"megatrain"} and {p.batch_size for p in pts} == {16}
    assert {p.options.gpu_resident for p in pts if p.variant == "tiered"} == {"auto"}
    assert {p.options.gpu_resident for p in pts if p.variant == "pure_streaming"} == {"0"}
    hw = [(p.hardware["label"], p.hardware["emulated"], p.hardware["cpu_cores"], p.hardware["host_ram_gib"],
           p.hardware["gpu_mem_gib"], p.hardware["peak_tflops"], p.torch_threads, p.hardware["host_link_gbps"],
           p.options.host_link_gbps) for p in pts[:7]]
    assert hw == [("H200", False, None, None, None, 797.5, None, None, None),
                  ("cores-4", True, 4, None, None, 797.5, 4, None, None),  # the real GPU's peak: it computes there
                  ("cores-8", True, 8, None, None, 797.5, 8, None, None),
                  ("host-64GB", True, None, 64, None, 797.5, None, None, None),
                  ("host-96GB", True, None, 96, None, 797.5, None, None, None),
                  # an emulated host link: MegaTrain's engine option, from the profile
                  ("link-16GBps", True, None, None, None, 797.5, None, 16, 16),
                  ("link-32GBps", True, None, None, None, 797.5, None, 32, 32)]
    assert pts[1].id == "megatrain__qwen2.5-14b__L48__w1__s1024__b16__tiered__cores-4"
    # an explicit torch_threads wins over the profile's cores
    _, pts = expand(compose_fn, "sweep=host_side", "torch_threads=2", "only=[*14b*tiered__cores-4]")
    assert [p.torch_threads for p in pts] == [2]


def test_link_profiles_expand_only_megatrain_with_the_engine_option(compose_fn):
    """A host-link profile is MegaTrain's EngineConfig.host_link_gbps; the other systems cannot slow their own
    copies, so (as with a several-GPU profile) they have no point on it, and run on the other profiles."""
    _, pts = expand(compose_fn, "sweep=size", "sweep.hardware=[real,link-16GBps]", "model=qwen2.5-7b",
                    "sweep.models=[qwen2.5-7b]")
    on_link = [p for p in pts if p.hardware["label"] == "link-16GBps"]
    assert [p.system for p in on_link] == ["megatrain"] and on_link[0].options.host_link_gbps == 16
    assert on_link[0].id.endswith("__default__link-16GBps") and on_link[0].hardware["emulated"] is True
    real = [p for p in pts if p.hardware["label"] == "H200"]
    assert [p.system for p in real] == ["megatrain", "zero3", "fsdp", "gemini", "native"]
    assert real[0].options.host_link_gbps is None
    # a command-line link on a profile: a float, plumbed the same way
    _, pts = expand(compose_fn, "sweep=smoke", "hardware.name=slow", "hardware.emulated=true",
                    "hardware.host_link_gbps=8.5", device="cpu", gpu_name="")
    assert {p.system for p in pts} == {"megatrain"} and {p.options.host_link_gbps for p in pts} == {8.5}
    # the engine option is the hardware's: as a system option it would label a throttled row as the real GPU
    with pytest.raises(sweeps.SweepError, match="'host_link_gbps' belongs to the hardware profile"):
        expand(compose_fn, "sweep=smoke", "system=megatrain", "system.options.host_link_gbps=8", device="cpu",
               gpu_name="")
    assert sweeps.emulates_host_link("megatrain") and not any(
        sweeps.emulates_host_link(s) for s in ("zero3", "fsdp", "gemini", "native"))


def test_link_profile_files():
    for bw in (16, 32):
        hw = yaml.safe_load((CONF / "hardware" / f"link-{bw}GBps.yaml").read_text())
        assert hw["name"] == f"link-{bw}GBps" and hw["host_link_gbps"] == bw and hw["emulated"] is True
        assert all(hw[k] is None for k in ("gpu_mem_gib", "cpu_cores", "host_ram_gib", "gpus", "peak_tflops"))


def test_malformed_hardware_profiles_are_refused(compose_fn):
    base = ["sweep=smoke", "hardware.name=capped"]
    with pytest.raises(sweeps.SweepError, match="cpu_cores=0 must be >= 1"):
        expand(compose_fn, *base, "hardware.emulated=true", "hardware.cpu_cores=0", device="cpu", gpu_name="")
    with pytest.raises(sweeps.SweepError, match="host_ram_gib=0.0 must be > 0"):
        expand(compose_fn, *base, "hardware.emulated=true", "hardware.host_ram_gib=0", device="cpu", gpu_name="")
    with pytest.raises(sweeps.SweepError, match="host_link_gbps=0.0 must be > 0"):
        expand(compose_fn, *base, "hardware.emulated=true", "hardware.host_link_gbps=0", device="cpu", gpu_name="")
    with pytest.raises(sweeps.SweepError, match="sets host_link_gbps but emulated: false"):
        expand(compose_fn, *base, "hardware.host_link_gbps=16", device="cpu", gpu_name="")
    # a cap on a profile that calls itself real would label a capped row as the real machine
    with pytest.raises(sweeps.SweepError, match="sets cpu_cores, host_ram_gib but emulated: false"):
        expand(compose_fn, *base, "hardware.cpu_cores=1", "hardware.host_ram_gib=8", device="cpu", gpu_name="")
    # more cores than this machine gives the runner: refused before anything runs (validate)
    _, jobs = expand(compose_fn, *base, "hardware.emulated=true", "hardware.cpu_cores=100000", device="cpu",
                     gpu_name="")
    with pytest.raises(sweeps.SweepError, match=r"hardware capped: cpu_cores=100000 > the \d+ CPU core"):
        sweeps.validate(jobs)
    _, jobs = expand(compose_fn, *base, "hardware.emulated=true", "hardware.cpu_cores=1", device="cpu", gpu_name="")
    sweeps.validate(jobs)
    assert jobs[0].hardware["label"] == "capped" and jobs[0].torch_threads == 1  # smoke's torch_threads: 1


def test_host_ram_profiles_skip_with_the_engine_estimate(compose_fn, monkeypatch):
    """The skip rule of a host_ram_gib profile uses the capped RAM the point's engine will plan with: 14B
    tiered (~100 GiB of host) is a skip row on 64 and 96 GiB; 7B pure streaming (~89 GiB) runs on 96."""
    import types

    from megatrain import memory

    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=120 * GIB))
    _, pts = expand(compose_fn, "sweep=host_side")
    by = {(p.model, p.hardware["label"]): p for p in pts}
    gpu = 141 * GIB

    def reason(model, hw):
        p = by[(model, hw)]
        return skips.skip_reason(p, device="cuda", available_host=skips.available_host(p), gpu_total=gpu,
                                  estimate=skips.host_estimate(p, "cuda", gpu))

    rss = memory.psutil.Process().memory_info().rss
    assert skips.available_host(by[("qwen2.5-7b", "H200")]) == 120 * GIB  # uncapped: the real available
    assert skips.available_host(by[("qwen2.5-7b", "host-64GB")]) == 64 * GIB - rss
    assert reason("qwen2.5-14b", "H200") is None
    for hw in ("host-64GB", "host-96GB"):
        r = reason("qwen2.5-14b", hw)
        assert r.reason == "host_memory" and 90 * GIB <= r.need_host < 100 * GIB, r
        assert r.have_host == skips.available_host(by[("qwen2.5-14b", hw)])
        assert f"(emulated {hw[5:7]} GiB host, profile {hw})" in r.text
    r7 = reason("qwen2.5-7b", "host-64GB")
    assert r7.reason == "host_memory" and "host needs 88.9 GiB" in r7.text
    assert reason("qwen2.5-7b", "host-96GB") is None and reason("qwen2.5-7b", "cores-4") is None


def test_ablation_variants_and_overrides(compose_fn):
    _, pts = expand(compose_fn, "sweep=ablation")
    # each variant's engine options (the optimizer is the run's: compared below)
    opts = {p.variant: {k: v for k, v in dataclasses.asdict(p.options).items() if k != "optim"} for p in pts}
    assert {p.options.optim == p.optim for p in pts} == {True}
    assert list(opts) == ["full", "no_double_buffer", "no_slab_pool", "ckpt_interval_1", "no_opt_overlap",
                          "pure_streaming", "full_no_clip", "no_speculation", "grads_on_host", "cpu_update_path"]
    # speculation differs from full only where clipping does not fire: both measured without it
    clip = {p.variant: p.optim.max_grad_norm for p in pts}
    assert clip["full_no_clip"] == clip["no_speculation"] == 0.0 and clip["full"] == 1.0
    full = opts["full"]
    assert full["checkpoint_interval"] == 4 and full["num_slots"] == 2 and full["grad_slabs"] > 0
    assert full["overlap_optimizer"] is True
    diff = {v: {k: o[k] for k in o if o[k] != full[k]} for v, o in opts.items()}
    assert diff == {"full": {}, "no_double_buffer": {"num_slots": 1}, "no_slab_pool": {"grad_slabs": 0},
                    "ckpt_interval_1": {"checkpoint_interval": 1}, "no_opt_overlap": {"overlap_optimizer": False},
                    "pure_streaming": {"gpu_resident": "0"}, "full_no_clip": {}, "no_speculation": {"speculate": "never"},
                    "grads_on_host": {"grad_placement": "host"}, "cpu_update_path": {"update_path": "cpu"}}
    assert full["update_path"] == "auto"  # the engine's default: the plan adds the GPU update path where faster
    assert {p.model for p in pts} == {"qwen2.5-3b"} and {p.batch_size for p in pts} == {16}
    # the sweep's model default yields to the command line; system options too
    _, pts = expand(compose_fn, "sweep=ablation", "model=qwen2.5-7b", "system=megatrain",
                    "system.options.stream_dtype=bf16", "batch_size=4")
    assert {p.model for p in pts} == {"qwen2.5-7b"} and {p.batch_size for p in pts} == {4}
    assert {p.options.stream_dtype for p in pts} == {"bf16"}
    with pytest.raises(sweeps.SweepError, match="valid options"):
        expand(compose_fn, "sweep=ablation", "+sweep.variants.bad={nmu_slots: 1}")


def test_a_variant_option_an_untyped_system_has_reaches_it(compose_fn):
    # `unpinned: {pin_memory: false}` names an engine field too; ZenFlow has an option of that name, so
    # its variant must reach it (it was dropped as the engine's, and the point equalled the default)
    _, pts = expand(compose_fn, "sweep=baselines2026", "only=[zenflow__qwen2.5-3b__*__b16__*]")
    opts = {p.variant: p.options for p in pts}
    assert set(opts) == {"default", "unpinned"}
    assert opts["unpinned"]["pin_memory"] is False and "pin_memory" not in opts["default"]
    # a system without such an option gets none of the engine's names (pure_streaming's gpu_resident)
    _, pts = expand(compose_fn, "sweep=baselines2026", "only=[zero3__qwen2.5-3b__*__b16__*]")
    assert [p.variant for p in pts] == ["default"] and "gpu_resident" not in pts[0].options


def test_system_filter_and_errors(compose_fn):
    _, pts = expand(compose_fn, "sweep=size", "system=zero3")
    assert {p.system for p in pts} == {"zero3"} and len(pts) == 6  # 3B, then the paper's five sizes
    with pytest.raises(sweeps.SweepError, match="known: "):
        expand(compose_fn, "sweep=size", "sweep.models=[qwen9]")
    with pytest.raises(sweeps.SweepError, match="micro_batches"):
        expand(compose_fn, "sweep=smoke", "micro_batches=8")
    _, pts = expand(compose_fn, "sweep=size", "only=[*72b*,native__*7b*]")
    assert len(pts) == 6


def test_skip_rules(compose_fn):
    _, pts = expand(compose_fn, "sweep=size")
    by = {(p.system, p.model): p for p in pts}
    avail, gpu = 126 * GIB, 141 * GIB  # the H200 node
    kw = dict(device="cuda", available_host=avail, gpu_total=gpu)
    # MegaTrain on a GPU: the engine's two-tier plan. 14B fits (GPU tier + host tier), 32B does not (host).
    mt7, mt14, mt32 = (by[("megatrain", m)] for m in ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"))
    est7, est14, est32 = (skips.host_estimate(j, "cuda", gpu) for j in (mt7, mt14, mt32))
    assert est7["total_bytes"] < 8 * GIB  # everything on the GPU tier
    assert 60 * GIB < est14["total_bytes"] < avail
    assert skips.skip_reason(mt7, estimate=est7, **kw) is None
    assert skips.skip_reason(mt14, estimate=est14, **kw) is None
    reason = skips.skip_reason(mt32, estimate=est32, **kw)
    assert reason.reason == "host_memory" and reason.need_host == est32["total_bytes"] and reason.have_host == avail
    assert reason.row_fields()["need_host_gib"] == est32["total_bytes"] / GIB
    # the pure-streaming estimate (12 B/param) would have skipped 14B: the plan is what the engine does
    assert skips.host_estimate(mt14, "cuda")["total_bytes"] > avail
    # 72B: its bf16 gradients alone exceed the GPU, so grad_placement="auto" gives the host tier's a host
    # home; the GPU side then fits and the point is skipped for host RAM (~1 TiB), with the plan's numbers
    mt72 = by[("megatrain", "qwen2.5-72b")]
    est72 = skips.host_estimate(mt72, "cuda", gpu)
    assert not est72["gpu_refusal"] and est72["total_bytes"] > 800 * GIB
    assert "grad_placement=auto -> host" in est72["plan"]
    reason = skips.skip_reason(mt72, estimate=est72, **kw)
    assert reason.reason == "host_memory" and "126.0 GiB" in reason.text
    # with the gradients kept on the GPU (the engine before grad_placement) it is a GPU-side refusal
    mt72_gpu = dataclasses.replace(mt72, options=dataclasses.replace(mt72.options, grad_placement="gpu"))
    est72_gpu = skips.host_estimate(mt72_gpu, "cuda", gpu)
    assert est72_gpu["gpu_refusal"]
    refusal = skips.skip_reason(mt72_gpu, estimate=est72_gpu, **kw)
    assert refusal.reason == "plan_gpu" and refusal.need_gpu > refusal.have_gpu > 0
    assert est72_gpu["tiers"]["gpu_tier_layers"] == 0 and est72_gpu["tiers"]["host_tier_layers"] == 80
    zero3_14 = by[("zero3", "qwen2.5-14b")]
    assert skips.skip_reason(zero3_14, estimate=skips.host_estimate(zero3_14, "cuda", gpu), **kw)
    # all-on-GPU: judged by GPU memory (12 B/param), not by host RAM
    nat7, nat14 = by[("native", "qwen2.5-7b")], by[("native", "qwen2.5-14b")]
    assert skips.skip_reason(nat7, estimate=None, **kw) is None
    nat = skips.skip_reason(nat14, estimate=None, **kw)
    assert nat.reason == "gpu_memory" and nat.need_gpu == 12 * nat14.num_params and nat.have_gpu == gpu
    _, hw = expand(compose_fn, "sweep=hardware", "system=native")
    capped = [p for p in hw if p.hardware["label"] == "RTX-3090-24GB"][0]
    assert skips.skip_reason(capped, estimate=None, **kw).have_gpu == 24 * GIB
    # an emulated 24 GB GPU leaves the 14B engine's host side over this host's RAM
    _, hw = expand(compose_fn, "sweep=hardware", "system=megatrain", "model=qwen2.5-14b")
    mt_3090 = [p for p in hw if p.hardware["label"] == "RTX-3090-24GB"][0]
    est = skips.host_estimate(mt_3090, "cuda", gpu)
    assert est["total_bytes"] > est14["total_bytes"] and skips.skip_reason(mt_3090, estimate=est, **kw)


def test_gpu_free_bytes_honours_the_memory_fraction(monkeypatch):
    """The plan of an emulated (capped) GPU sizes from the cap, not from the real GPU's free memory."""
    import torch

    from megatrain import memory

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (130 * GIB, 140 * GIB))
    def fraction(d):
        assert d.index == 0  # torch refuses a device without an index here
        return frac
    frac = 1.0
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 2 * GIB)
    assert memory.gpu_free_bytes("cuda") == 130 * GIB
    frac = 80 / 140
    assert memory.gpu_free_bytes("cuda") == 78 * GIB


def test_engine_dataclasses_are_the_schemas_no_mirrors():
    """The megatrain system's options *are* EngineConfig and optim *is* OptimConfig: no copy to drift."""
    from megatrain.config import EngineConfig
    from megatrain.spec import PRESETS
    from megatrain.system import OptimConfig

    assert C.MegatrainSystemConfig.__dataclass_fields__["options"].type in ("EngineConfig", EngineConfig)
    assert C.RunConfig.__dataclass_fields__["optim"].type in ("OptimConfig", OptimConfig)
    assert not hasattr(C, "MegatrainOptions") and not hasattr(C, "OptimSettings")
    import baselines.megatrain_system as ms

    assert not hasattr(ms, "ENGINE_OPTIONS")
    meg = yaml.safe_load((CONF / "system" / "megatrain.yaml").read_text())
    assert "options" not in meg  # defaults come from EngineConfig itself
    from baselines.registry import SYSTEMS

    for name in SYSTEMS:  # one config file per registered system, nothing else
        data = yaml.safe_load((CONF / "system" / f"{name}.yaml").read_text())
        assert data["name"] == name
        assert set(data) - {"defaults"} <= {f.name for f in dataclasses.fields(C.SystemConfig)}
    assert sorted(p.stem for p in (CONF / "system").glob("*.yaml")) == sorted(SYSTEMS)
    assert not (CONF / "model").exists(), "model presets are registered from megatrain.spec.PRESETS"
    for f in (CONF / "hardware").glob("*.yaml"):
        data = yaml.safe_load(f.read_text())
        assert data["name"] == f.stem
        assert set(data) == {fl.name for fl in dataclasses.fields(C.HardwareConfig)}
        if data["emulated"]:
            assert data["peak_tflops"] == C.peak_tflops_for(data["name"])
    assert C.peak_tflops_for("NVIDIA H200") == 797.5 and C.peak_tflops_for("Tesla T4") is None
    assert len(PRESETS) > 5


def test_engine_option_walk_from_command_line_to_engine_config(compose_fn, monkeypatch):
    """The walk of a knob (docs/runner.md "The walk of a knob"): ``system.options.gpu_resident`` is turned
    into the point's one EngineConfig at expansion (experiments/sweeps.py), crosses job.json typed, and the
    point process, the registry and the system adapter hand that very object to the engine, which gives
    ``gpu_resident`` to the placement plan. A re-parse on the way (a new hop) breaks the identity below."""
    from megatrain import planner
    from megatrain.config import EngineConfig

    from experiments import point_frame as point
    from experiments.sweeps import Job

    _, jobs = expand(compose_fn, "sweep=smoke", "system=megatrain", "system.options.checkpoint_interval=2",
                     "system.options.gpu_resident=1", "optim.lr=3e-4", "seed=5", device="cpu", gpu_name="")
    (job,) = jobs
    cfg = job.options
    assert type(cfg) is EngineConfig and cfg.gpu_resident == "1" and cfg.checkpoint_interval == 2
    # the run-level fields are set once, here, as every system gets them
    assert (cfg.device, cfg.compute_dtype, cfg.micro_batches, cfg.optim, cfg.seed) == (
        "cpu", "fp32", job.micro_batches, job.optim, 5) and cfg.optim.lr == 3e-4
    back = Job.from_dict(json.loads(json.dumps(job.to_dict())))  # what the point process reads
    assert back == job and type(back.options) is EngineConfig and back.optim.betas == (0.9, 0.95)

    seen = {}

    class Reached(Exception):
        pass

    real_init = __import__("megatrain.engine", fromlist=["MegaTrain"]).MegaTrain.__init__

    def spy_init(self, hf_config, cfg=None, **kw):
        seen["cfg"] = cfg
        return real_init(self, hf_config, cfg, **kw)

    def spy_plan(numels, shape, *, setting, **kw):
        seen["setting"] = setting
        raise Reached

    import megatrain.engine as engine

    monkeypatch.setattr(engine.MegaTrain, "__init__", spy_init)
    monkeypatch.setattr(planner, "plan", spy_plan)
    with pytest.raises(Reached):
        point.build_system(dataclasses.replace(back, init_dir=""))  # shared_init=false: from the spec
    assert seen["cfg"] is back.options and seen["setting"] == "1"
    # no runner or adapter file builds an EngineConfig field by field but the adapter's dict path (for
    # callers outside the runner): the runner's is made once, by sweeps.merge_options from the schema
    import ast

    builders = set()
    for path in [*(ROOT / "experiments").glob("*.py"), *(ROOT / "baselines").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "EngineConfig":
                builders.add(path.relative_to(ROOT).as_posix())
    assert builders == {"baselines/megatrain_system.py"}
    with pytest.raises(sweeps.SweepError, match="gpu_resident"):
        expand(compose_fn, "sweep=smoke", "system=megatrain", "system.options.gpu_resident=many", device="cpu")
    with pytest.raises(sweeps.SweepError, match="run-level"):
        expand(compose_fn, "sweep=smoke", "system=megatrain", "system.options.micro_batches=2", device="cpu")
    with pytest.raises(sweeps.SweepError, match="run-level"):
        expand(compose_fn, "sweep=smoke", "system=megatrain", "system.options.seed=3", device="cpu")


def test_engine_config_of_the_job_must_agree_with_the_run():
    """An EngineConfig handed to the adapter is used as it is; run-level arguments that disagree are refused."""
    from baselines.megatrain_system import engine_config
    from megatrain.config import EngineConfig
    from megatrain.system import OptimConfig

    cfg = EngineConfig(device="cpu", compute_dtype="fp32", gpu_resident="0")
    assert engine_config(cfg, optim=OptimConfig(), micro_batches=1, device="cpu", compute_dtype="fp32") is cfg
    with pytest.raises(ValueError, match="micro_batches=1 vs 2"):
        engine_config(cfg, optim=OptimConfig(), micro_batches=2, device="cpu", compute_dtype="fp32")
    made = engine_config({"gpu_resident": "0"}, optim=OptimConfig(lr=1.0), micro_batches=2, device="cpu")
    assert made.gpu_resident == "0" and made.micro_batches == 2 and made.optim.lr == 1.0
    with pytest.raises(ValueError, match="unknown megatrain options"):
        engine_config({"micro_batches": 2}, optim=OptimConfig(), micro_batches=1, device="cpu")


def test_invalid_points_are_refused_before_launch(compose_fn):
    _, jobs = expand(compose_fn, "sweep=smoke", "steps=0", device="cpu", gpu_name="")
    with pytest.raises(sweeps.SweepError, match="steps=0"):
        sweeps.validate(jobs)
    _, jobs = expand(compose_fn, "sweep=smoke", "seq_len=100000", device="cpu", gpu_name="")
    with pytest.raises(sweeps.SweepError, match="max_position_embeddings=100000") as e:
        sweeps.validate(jobs)
    assert "nothing was launched" in str(e.value)
    _, jobs = expand(compose_fn, "sweep=smoke", "seq_len=100000", "max_position_embeddings=100000",
                     device="cpu", gpu_name="")
    sweeps.validate(jobs)  # raising the positions makes them valid, for every system alike
    assert {j.spec["max_position_embeddings"] for j in jobs} == {100000}
    _, jobs = expand(compose_fn, "sweep=smoke", "gpus=2", device="cpu", gpu_name="")
    with pytest.raises(sweeps.SweepError, match="gpus=2"):
        sweeps.validate(jobs)
    _, jobs = expand(compose_fn, "sweep=smoke", device="cpu", gpu_name="")
    sweeps.validate(jobs)


def test_size_sweep_has_14b_and_gpu_only_systems_skip_on_cpu(compose_fn):
    _, jobs = expand(compose_fn, "sweep=size", device="cpu", gpu_name="")
    assert "qwen2.5-14b" in {j.model for j in jobs}
    _, jobs = expand(compose_fn, "sweep=baselines", device="cpu", gpu_name="")
    by = {j.system: j for j in jobs}
    assert {"zero2", "superoffload"} <= set(by)
    reason = skips.skip_reason(by["gemini"], device="cpu", available_host=None, gpu_total=None, estimate=None)
    assert reason.reason == "needs_gpu" and "needs a GPU" in reason.text


def test_override_precheck_lists_valid_keys():
    msg = C.check_overrides(["sweep=smoke", "stpes=3"])
    assert "Unknown config key 'stpes'" in msg and "steps" in msg and "warmup_steps" in msg
    msg = C.check_overrides(["system=megatrain", "system.options.num_slot=1"])
    assert "num_slots" in msg and "checkpoint_interval" in msg and "gpu_resident" in msg
    assert C.check_overrides(["sweep=smoke", "steps=3", "model.depth=2", "system=zero3",
                              "system.options.anything=1", "hydra.run.dir=x", "--cfg", "job"]) is None


def test_engine_sweep_variants_apply_per_system(compose_fn):
    """optim.* and data reach every system; engine options only MegaTrain; identical setups run once."""
    _, pts = expand(compose_fn, "sweep=engine", "model=qwen2.5-3b")
    by = {(p.system, p.model, p.variant): p for p in pts}
    native = sorted(v for s, m, v in by if s == "native" and m == "qwen2.5-3b")
    assert native == ["default", "no_clip", "text"]  # the streaming variants change nothing of native
    assert by[("native", "qwen2.5-3b", "no_clip")].optim.max_grad_norm == 0.0
    assert by[("native", "qwen2.5-3b", "text")].data == "text" and by[("native", "qwen2.5-3b", "default")].data == "synthetic"
    mt = by[("megatrain", "qwen2.5-3b", "streaming_no_clip")]
    assert mt.options.gpu_resident == "0" and mt.optim.max_grad_norm == 0.0
    from megatrain.system import OptimConfig

    with pytest.raises(sweeps.SweepError, match="unknown optimizer field"):
        sweeps.optim_with(OptimConfig(), {"lrr": 1}, "bad")


def test_update_path_runs_each_shapes_cpu_path_before_its_hybrids(compose_fn):
    """A call cut by its time budget loses the last points: within each model the CPU path (the baseline of the
    same-run ratio) runs first, so a cut takes a hybrid point, not the baseline."""
    _, pts = expand(compose_fn, "sweep=update_path")
    for model in {p.model for p in pts}:
        kinds = ["cpu" if "_cpu" in p.variant else "hybrid" for p in pts if p.model == model]
        assert "cpu" in kinds and "hybrid" in kinds and kinds == sorted(kinds), (model, kinds)
