"""megatrain.pinning: every page-locked host buffer goes through one helper (cudaHostRegister on a plain
allocation, default flags, sized in bytes), and is unregistered by the same pointer. CPU only: a fake
cudart records the calls (the real ones run in the GPU tests)."""
import pytest
import torch

from megatrain.boundaries import HostBuffers
from megatrain.pinning import pin_in_place, unpin
from megatrain.store import Group, ModelStore


class FakeCudart:
    def __init__(self, err=0):
        self.err, self.registered, self.unregistered = err, [], []

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - the CUDA runtime's name
        self.registered.append((ptr, nbytes, flags))
        return self.err

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_pin_in_place_registers_bytes_and_unpin_the_same_pointer(cudart):
    t = torch.empty(1000, dtype=torch.float32)
    assert pin_in_place(t, "a buffer") is t
    assert cudart.registered == [(t.data_ptr(), 4000, 0)]
    unpin(t)
    assert cudart.unregistered == [t.data_ptr()]


def test_a_failed_register_says_what_and_how_big(cudart):
    cudart.err = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match=r"cudaHostRegister failed \(2\) for a host gradient buffer \(0.50 GiB\)"):
        pin_in_place(torch.empty(2**27, dtype=torch.float32), "a host gradient buffer")


def test_store_pins_each_host_group_once_and_unpins_all_on_close(cudart):
    groups = [Group("embed", "embed", -1, [], [], 64), Group("layer.0", "layer", 0, [], [], 128)]
    store = ModelStore(groups, {"embed": torch.device("cpu"), "layer.0": torch.device("cpu")}, None, pin=True)
    ptrs = [store.master[g.name].data_ptr() for g in groups]
    assert cudart.registered == [(ptrs[0], 64 * 4, 0), (ptrs[1], 128 * 4, 0)]
    assert store.pinned_bytes == (64 + 128) * 4
    store.close()
    assert cudart.unregistered == ptrs and store.pinned_bytes == 0


def test_boundary_buffers_pin_on_growth_and_unpin_the_old_one(cudart):
    buf = HostBuffers(pin=True)
    small = buf.get(0, torch.empty(16, dtype=torch.bfloat16))
    first = small.data_ptr()
    assert cudart.registered == [(first, 32, 0)]
    buf.get(0, torch.empty(8, dtype=torch.bfloat16))  # fits: reused, no new registration
    assert len(cudart.registered) == 1
    buf.get(0, torch.empty(64, dtype=torch.bfloat16))  # grows: the old buffer is unpinned first
    assert cudart.unregistered == [first] and cudart.registered[-1][1] == 128


def _two_groups():
    return [Group("embed", "embed", -1, [], [], 64), Group("layer.0", "layer", 0, [], [], 128)]


CPU2 = {"embed": torch.device("cpu"), "layer.0": torch.device("cpu")}


def test_pin_all_page_locks_master_m_and_v_of_each_host_group_once(cudart):
    """pin_host_state="all": the streamed buffer first (as "stream"), then every group's master, m and v that is
    not registered yet; close() unregisters every one."""
    store = ModelStore(_two_groups(), CPU2, None, pin=True, pin_all=True)
    want = [store.master["embed"], store.master["layer.0"]]  # the streamed buffers
    for name in ("embed", "layer.0"):
        want += [store.m[name], store.v[name]]
    assert [r[0] for r in cudart.registered] == [t.data_ptr() for t in want]
    assert store.pinned_bytes == (64 + 128) * 4 * 3
    assert all(store.is_pinned(t) for t in want)
    store.close()
    assert sorted(cudart.unregistered) == sorted(t.data_ptr() for t in want) and store.pinned_bytes == 0


def test_pin_all_with_a_bf16_shadow_locks_the_shadow_and_the_fp32_state(cudart):
    store = ModelStore(_two_groups(), CPU2, torch.bfloat16, pin=True, pin_all=True)
    assert store.pinned_bytes == (64 + 128) * (2 + 4 * 3)
    assert store.is_pinned(store.shadow["embed"]) and store.is_pinned(store.master["embed"])
    stream_only = ModelStore(_two_groups(), CPU2, torch.bfloat16, pin=True)  # "stream": the shadow only
    assert stream_only.pinned_bytes == (64 + 128) * 2 and not stream_only.is_pinned(stream_only.master["embed"])


def test_a_failed_register_is_a_pin_error_with_its_code(cudart):
    from megatrain.pinning import PinError

    cudart.err = 712  # cudaErrorHostMemoryAlreadyRegistered
    with pytest.raises(PinError) as info:
        pin_in_place(torch.empty(8), "a buffer")
    assert info.value.code == 712 and isinstance(info.value, RuntimeError)


def test_is_pinned_knows_views_inside_a_locked_buffer(cudart):
    store = ModelStore(_two_groups(), CPU2, None, pin=True)
    master = store.master["layer.0"]
    assert store.is_pinned(master) and store.is_pinned(master[16:32]) and not store.is_pinned(store.m["layer.0"])


def test_pin_all_skips_only_the_tensor_that_failed_unless_memory_ran_out(cudart):
    """Another error (here "already registered") leaves that tensor pageable and goes on with the next ones."""
    calls = []

    def register(ptr, nbytes, flags):
        calls.append(ptr)
        return 712 if len(calls) == 3 else 0  # the embed group's m

    cudart.cudaHostRegister = register
    with pytest.warns(RuntimeWarning, match=r"cudaHostRegister failed \(712\)"):
        store = ModelStore(_two_groups(), CPU2, None, pin=True, pin_all=True)
    assert len(calls) == 6 and not store.is_pinned(store.m["embed"])
    assert store.is_pinned(store.v["embed"]) and store.is_pinned(store.v["layer.0"])


def test_pin_all_with_data_parallel_is_refused():
    from megatrain import EngineConfig, MegaTrain, PRESETS

    cfg = EngineConfig(device="cpu", pin_host_state="all")
    with pytest.raises(ValueError, match="pin_host_state='all' is not supported with data parallel"):
        MegaTrain.from_config(PRESETS["tiny-llama"].to_hf_config("eager"), cfg, verbose=False, dist=object())


def test_pin_all_leaves_state_pageable_with_a_warning_when_registering_fails(cudart):
    """A streamed buffer that cannot be page-locked is an error (its copies would be synchronous); m and v
    that cannot be are left pageable (the CPU kernel is only slower on them), and no further one is tried."""
    calls = []

    def register(ptr, nbytes, flags):
        calls.append(ptr)
        return 2 if len(calls) > 3 else 0  # the two masters and one m, then page-locked memory runs out

    cudart.cudaHostRegister = register
    with pytest.warns(RuntimeWarning, match="pin_host_state='all': cudaHostRegister failed .* left pageable"):
        store = ModelStore(_two_groups(), CPU2, None, pin=True, pin_all=True)
    assert len(calls) == 4 and store.pinned_bytes == (64 + 128) * 4 + 64 * 4
    assert store.is_pinned(store.m["embed"]) and not store.is_pinned(store.v["embed"])


def test_pin_all_needs_pin():
    """No CUDA (pin False): nothing is page-locked, whatever pin_host_state says."""
    store = ModelStore(_two_groups(), CPU2, None, pin=False, pin_all=True)
    assert store.pinned_bytes == 0


def test_pin_host_state_setting_is_checked():
    from megatrain import EngineConfig

    assert EngineConfig().pin_host_state == "stream"  # until a same-run A/B on the GPU nodes says otherwise
    assert EngineConfig(pin_host_state=" All ").pin_host_state == "all"
    with pytest.raises(ValueError, match="pin_host_state must be 'stream' or 'all', got 'some'"):
        EngineConfig(pin_host_state="some")
