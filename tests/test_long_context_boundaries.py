"""Long context (issue 10): block boundaries offloaded to host memory and prefetched for the backward.

On CPU the streams are no-ops, so these run the same keep/take/prefetch logic as CUDA."""
from __future__ import annotations

import pytest
import torch

from megatrain import EngineConfig, PRESETS
from megatrain.boundaries import GpuBoundaries, HostBoundaries, HostBuffers, make_boundaries
from megatrain.streams import StreamSet

from test_engine_parity import assert_matches_reference, batches, engine_cfg, run_engine


@pytest.mark.parametrize("interval,mb,chunk", [(1, 2, -1), (2, 2, 7), (0, 1, -1)])
def test_offload_on_vs_off_identical(interval, mb, chunk):
    """Same losses and weights, bit for bit, with boundaries on the device or offloaded; both match plain
    PyTorch (losses and weights at 1e-5, fp32)."""
    spec = PRESETS["tiny-llama"]
    hf, data = spec.to_hf_config("sdpa"), batches(spec, steps=3)
    kw = dict(checkpoint_interval=interval, micro_batches=mb, mlp_chunk_tokens=chunk)
    init_a, losses_a, final_a = run_engine(hf, engine_cfg(boundary_offload="gpu", **kw), data)
    init_b, losses_b, final_b = run_engine(hf, engine_cfg(boundary_offload="host", **kw), data)
    assert losses_a == losses_b
    for name in final_a:
        assert torch.equal(init_a[name], init_b[name])
        assert torch.equal(final_a[name], final_b[name]), name
    assert_matches_reference(hf, init_b, losses_b, final_b, data, micro_batches=mb)


def _store(total, on_gpu, buffers=None):
    streams = StreamSet(torch.device("cpu"))
    return HostBoundaries(streams, torch.device("cpu"), buffers or HostBuffers(pin=False), total, on_gpu)


def test_host_store_offloads_the_first_and_prefetches_one_ahead():
    one = torch.zeros(3, 5).numel() * 4
    store = _store(total=6, on_gpu=2)
    kept = {}
    for layer in (0, 2, 4):  # forward order: blocks ascending, micro-batches within
        for mb in (0, 1):
            kept[(mb, layer)] = torch.randn(3, 5)
            store.keep(mb, layer, kept[(mb, layer)])
    assert set(store._on_gpu) == {(0, 4), (1, 4)}  # the last two: the backward needs them first
    assert store.offloaded_bytes == 4 * one
    order = [(0, 4), (1, 4), (0, 2), (1, 2), (0, 0), (1, 0)]  # the backward's order
    for n, key in enumerate(order):
        got = store.take(*key)
        assert torch.equal(got, kept[key])
        assert (got is kept[key]) == (key[1] == 4)  # offloaded ones come back as copies
        # after each take exactly the next offloaded boundary (if any) is on its way, nothing more
        nxt = order[n + 1] if n + 1 < len(order) else None
        assert list(store._loaded) == ([nxt] if nxt is not None and nxt[1] != 4 else [])


def test_host_buffers_are_reused_across_steps():
    buffers = HostBuffers(pin=False)
    ptrs = []
    for step in range(2):
        store = _store(2, 0, buffers)
        for layer in (0, 1):
            store.keep(0, layer, torch.full((4, 8), float(step)))
        ptrs.append([buffers._flat[i].data_ptr() for i in range(2)])
        assert torch.equal(store.take(0, 1), torch.full((4, 8), float(step)))
        assert torch.equal(store.take(0, 0), torch.full((4, 8), float(step)))
    assert ptrs[0] == ptrs[1] and buffers.nbytes() == 2 * 4 * 8 * 4
    store = _store(1, 0, buffers)
    store.keep(0, 0, torch.ones(8, 8))  # a longer sequence: buffer 0 grows, buffer 1 is kept as is
    assert buffers.nbytes() == (8 * 8 + 4 * 8) * 4 and torch.equal(store.take(0, 0), torch.ones(8, 8))
    buffers.close()
    assert buffers.nbytes() == 0


def test_make_boundaries_follows_the_plan():
    """The store is what the plan decided (Placement.boundaries_on_gpu): None -> all on the device; g -> the
    first total - g offloaded. No second decision at step time."""
    hf = PRESETS["tiny-llama"].to_hf_config("sdpa")  # 4 layers, hidden 64
    kw = dict(model_config=hf, block=1, dtype=torch.float32, tokens=[32, 32], host=HostBuffers(pin=False))
    cpu = StreamSet(torch.device("cpu"))
    assert isinstance(make_boundaries(EngineConfig(), cpu, on_gpu=None, total=8, **kw), GpuBoundaries)
    assert isinstance(make_boundaries(EngineConfig(), cpu, on_gpu=8, total=8, **kw), GpuBoundaries)
    host = make_boundaries(EngineConfig(boundary_offload="host"), cpu, on_gpu=0, total=8, **kw)
    assert isinstance(host, HostBoundaries) and host._to_host == 8
    spill = make_boundaries(EngineConfig(), cpu, on_gpu=5, total=8, **kw)
    assert isinstance(spill, HostBoundaries) and spill._to_host == 3


def test_refused_with_numbers_when_the_host_cannot_hold_them():
    hf = PRESETS["tiny-llama"].to_hf_config("sdpa")
    with pytest.raises(MemoryError, match="GiB of host memory"):
        make_boundaries(EngineConfig(boundary_offload="host", host_margin_gib=1e9), StreamSet(torch.device("cpu")),
                        model_config=hf, block=1, dtype=torch.float32, tokens=[64], host=HostBuffers(pin=False),
                        on_gpu=0, total=4)
