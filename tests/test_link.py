"""The emulated host link (EngineConfig.host_link_gbps, megatrain/link.py): the delay arithmetic, the
CPU refusal, the no-op seam when unset, and a spy that every host-link copy site of a step calls it with
the bytes it moves. The sleep itself needs a GPU (the ``gpu`` tests at the end)."""
from __future__ import annotations

import math

import pytest
import torch

from megatrain import EngineConfig, MegaTrain, PRESETS
from megatrain import engine as engine_mod
from megatrain import link
from megatrain.data import synthetic_batch

MiB = 1 << 20


# -- arithmetic -------------------------------------------------------------------------------------
def test_delay_is_the_difference_of_the_two_transfer_times():
    n = 256 * MiB
    assert link.delay_s(n, 8, 50) == pytest.approx(n / 8e9 - n / 50e9)
    assert link.delay_s(n, 8, 50) == pytest.approx(0.02818, rel=1e-3)  # 33.6 ms at 8 GB/s - 5.4 ms real
    assert link.delay_s(0, 8, 50) == 0.0
    # the real link is not faster than the target: nothing to add (a faster link cannot be emulated)
    assert link.delay_s(n, 50, 50) == 0.0 and link.delay_s(n, 64, 50) == 0.0
    assert link.sleep_cycles(n, 8, 50, 2e9) == round(link.delay_s(n, 8, 50) * 2e9)
    assert link.sleep_cycles(n, 64, 50, 2e9) == 0


def test_emulated_link_warns_once_per_direction_slower_than_target():
    with pytest.warns(RuntimeWarning, match="D2H link measured 20.0 GB/s is not faster"):
        lk = link.EmulatedLink(25, torch.device("cuda"), real_gbps={"h2d": 50, "d2h": 20}, cycles_per_s=1e9)
    assert lk.info == {"target_gbps": 25.0, "real_h2d_gbps": 50.0, "real_d2h_gbps": 20.0, "sleep_cycles_per_s": 1e9}


def test_host_link_gbps_must_be_positive():
    for bad in (0, -8.0):
        with pytest.raises(ValueError, match="host_link_gbps must be > 0"):
            EngineConfig(host_link_gbps=bad)
    assert EngineConfig().host_link_gbps is None and EngineConfig(host_link_gbps=16).host_link_gbps == 16


# -- the engine -------------------------------------------------------------------------------------
def _cfg(**kw):
    return EngineConfig(**{**dict(device="cpu", checkpoint_interval=2, micro_batches=2, seed=1), **kw})


def test_engine_on_cpu_refuses_an_emulated_link():
    with pytest.raises(ValueError, match="host_link_gbps=16 emulates a host link: needs a CUDA device"):
        MegaTrain.from_config(PRESETS["tiny-llama"].to_hf_config("eager"), _cfg(host_link_gbps=16), verbose=False)


def test_unset_link_is_the_null_link_at_every_site():
    e = MegaTrain.from_config(PRESETS["tiny-llama"].to_hf_config("eager"),
                              _cfg(grad_placement="host", boundary_offload="host"), verbose=False)
    try:
        assert e.link is link.NULL_LINK and e.link.info is None
        assert e.pool.link is e.grad_stream.link is e.grad_home.link is e._boundary_host.link is link.NULL_LINK
    finally:
        e.close()


class SpyLink:
    info = None

    def __init__(self):
        self.calls = []

    def throttle(self, stream, nbytes, direction):
        assert direction in link.DIRECTIONS
        self.calls.append((nbytes, direction))

    def total(self, direction):
        return sum(n for n, d in self.calls if d == direction)


@pytest.mark.parametrize("mixed", [False, True])
def test_every_host_link_copy_of_a_step_is_throttled(monkeypatch, mixed):
    """One step of a tiny model on the CPU (the scheduler is the CUDA one with no-op streams): layer and
    resident weight loads of the host tier (H2D), host-tier gradients into their host buffers (D2H), and
    offloaded block boundaries both ways each call the link once with their bytes; the GPU tier's copies
    (a cast on the device) do not. (The slab path of grad_placement="gpu" only exists on CUDA.)"""
    spy = SpyLink()
    monkeypatch.setattr(engine_mod, "make_link", lambda gbps, device: spy)
    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("eager")
    tiers = None
    if mixed:  # layer 0 and the final norm + head on the GPU tier: their copies never cross the link
        tiers = {"embed": "host", "final": "gpu", **{f"layer.{i}": "host" for i in range(spec.num_layers)}}
        tiers["layer.0"] = "gpu"
    e = MegaTrain.from_config(hf, _cfg(grad_placement="host", boundary_offload="host"), verbose=False, tiers=tiers)
    loaded = []  # layers the slot pool copied in (a slot still holding a layer is reused without a copy)
    load = e.pool._load
    monkeypatch.setattr(e.pool, "_load", lambda slot, layer: (loaded.append(layer), load(slot, layer)))
    try:
        bsz, seq = 4, 16
        e.step(synthetic_batch(spec.vocab_size, bsz, seq, 0, 0))
        e.synchronize()
        host = set(e.placement.host_names)
        nbytes = {g.name: e.store.stream_source(g.name).numel() * e.store.stream_source(g.name).element_size()
                  for g in e.groups}
        assert len(loaded) == e.stats["h2d_loads"] > spec.num_layers  # forward, and again for the backward
        host_loads = [i for i in loaded if f"layer.{i}" in host]
        layer_loads = sum(nbytes[f"layer.{i}"] for i in host_loads)
        resident = sum(nbytes[n] for n in ("embed", "final") if n in host)
        boundaries = math.ceil(spec.num_layers / 2) * 2 * (bsz // 2) * seq * hf.hidden_size * 4  # fp32 on CPU
        grads = sum(e.store.by_name[n].numel * 4 for n in host)  # fp32 host buffers
        assert spy.total("h2d") == layer_loads + resident + boundaries
        assert spy.total("d2h") == grads + boundaries
        assert len(spy.calls) == len(host_loads) + len([n for n in ("embed", "final") if n in host]) \
            + len(host) + 2 * math.ceil(spec.num_layers / 2) * 2
        if mixed:
            assert "layer.0" not in host and "final" not in host and 0 in loaded and len(host_loads) < len(loaded)
    finally:
        e.close()


# -- on a GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_8_gbps_link_makes_a_256_mib_copy_take_at_least_30_ms():
    lk = link.make_link(8.0, torch.device("cuda"))
    assert lk.real_gbps["h2d"] > 8 and lk.cycles_per_s > 1e8, lk.info
    host = torch.empty(256 * MiB, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    stream = torch.cuda.Stream()
    for _ in range(2):  # the second is measured
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            dev.copy_(host, non_blocking=True)
            lk.throttle(stream, host.numel(), "h2d")
            end.record()
        end.synchronize()
    ms = start.elapsed_time(end)
    assert 30 <= ms <= 45, ms  # 256 MiB at 8 GB/s = 33.6 ms


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gradient_slabs_are_throttled_on_cuda():
    from megatrain.grad_offload import GradStream
    from megatrain.streams import StreamSet

    spy = SpyLink()
    gs = GradStream(StreamSet(torch.device("cuda")), n_slabs=2, chunk_elems=1000, link=spy)
    flat = torch.randn(2500, device="cuda", dtype=torch.bfloat16)
    ready = torch.cuda.Event()
    ready.record()
    assert sum(p.numel() for _, p in gs.chunks(flat, ready)) == 2500
    assert spy.calls == [(2000, "d2h"), (2000, "d2h"), (1000, "d2h")]
    gs.close()
