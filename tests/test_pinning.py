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
