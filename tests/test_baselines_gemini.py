"""ColossalAI Gemini. The real run needs CUDA (and colossalai, a GPU-node wheel); on CPU we test the parts
that do not: the import stand-ins, the plugin arguments, the labelling, the clipping fix, the CPU refusal."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from test_baselines_registry import (HAS_CUDA, OPTIM, assert_losses_close, batches, init_dirs,  # noqa: F401
                                     run_system)


@pytest.fixture
def clean_stub_modules(monkeypatch):
    """Pretend galore_torch / bitsandbytes are neither imported nor installed; undo whatever gets added."""
    import baselines.gemini as gemini

    names = ("galore_torch", "bitsandbytes", "bitsandbytes.optim", "bitsandbytes.optim.optimizer")
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(gemini.importlib.util, "find_spec",
                        lambda name, *a: None if name in gemini.STUB_MODULES else real_find_spec(name, *a))
    yield gemini
    for n in names:
        sys.modules.pop(n, None)
    sys.modules.update(saved)


def test_stubs_cover_what_colossalai_imports(clean_stub_modules):
    gemini = clean_stub_modules
    assert sorted(gemini.stub_optional_imports()) == ["bitsandbytes", "galore_torch"]
    # colossalai/nn/optimizer/__init__.py, galore.py, distributed_galore.py, quantization/bnb.py:
    from galore_torch import GaLoreAdafactor, GaLoreAdamW  # noqa: F401
    from bitsandbytes.optim.optimizer import Optimizer2State
    import bitsandbytes

    assert bitsandbytes.__version__ == "0.0.0"
    assert issubclass(Optimizer2State, torch.optim.Optimizer)
    class GaLoreAdamW8bit(Optimizer2State):  # what colossalai defines at import time
        pass
    with pytest.raises(ImportError, match="not installed"):
        GaLoreAdamW8bit([torch.nn.Parameter(torch.zeros(1))])
    assert gemini.stub_optional_imports() == []  # idempotent


def test_installed_packages_are_not_stubbed(monkeypatch):
    import baselines.gemini as gemini

    sentinel = object()
    monkeypatch.setitem(sys.modules, "galore_torch", sentinel)
    monkeypatch.setattr(gemini.importlib.util, "find_spec", lambda name, *a: object())  # "installed"
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    assert gemini.stub_optional_imports() == []
    assert sys.modules["galore_torch"] is sentinel and "bitsandbytes" not in sys.modules


def test_plugin_kwargs_and_labels():
    from baselines.gemini import OPTIONS, gemini_plugin_kwargs, precision_name, system_label

    kw = gemini_plugin_kwargs(dict(OPTIONS), OPTIM, micro_batches=2, dtype=torch.bfloat16, hidden_size=64)
    assert kw["placement_policy"] == "static"
    assert kw["shard_param_frac"] == kw["offload_optim_frac"] == kw["offload_param_frac"] == 1.0
    assert kw["precision"] == "bf16" and kw["pin_memory"] is True
    assert kw["max_norm"] == OPTIM.max_grad_norm and kw["enable_gradient_accumulation"] is True
    assert kw["hidden_dim"] == 64
    one = gemini_plugin_kwargs(dict(OPTIONS, plugin_kwargs={"max_prefetch": 2}), OPTIM, 1, torch.bfloat16)
    assert one["enable_gradient_accumulation"] is False and one["max_prefetch"] == 2
    assert system_label("hybrid_adam") == "gemini" and system_label("torch_adamw") == "gemini[torch-adamw]"
    with pytest.raises(ValueError, match="bf16 or fp16"):
        precision_name(torch.float32)


class _FakeHybridAdam(torch.optim.Optimizer):
    """The shape of ColossalAI's HybridAdam CPU path for bf16 grads: step(div_scale) calls
    torch_adam_update(data, grad, ...) without passing div_scale on (here: plain SGD for checking).
    Gemini points fp32 master data at bf16 gradient chunks; the fake keeps the bf16 grads beside."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.bf16_grads = [torch.ones(3, dtype=torch.bfloat16) for _ in self.param_groups[0]["params"]]

    def torch_adam_update(self, data, grad, lr):
        data.add_(grad.to(data.dtype), alpha=-lr)

    @torch.no_grad()
    def step(self, closure=None, div_scale: float = -1):
        for group in self.param_groups:
            for p, g in zip(group["params"], self.bf16_grads):
                self.torch_adam_update(p.data, g, group["lr"])


@pytest.mark.parametrize("div_scale, expected", [(4.0, 0.75), (-1, 0.0)])
def test_bf16_clipping_fix_applies_div_scale(div_scale, expected):
    from baselines.gemini import patch_bf16_clipping

    unpatched = _FakeHybridAdam([torch.nn.Parameter(torch.ones(3))], lr=1.0)
    unpatched.step(div_scale=4.0)
    assert torch.equal(unpatched.param_groups[0]["params"][0].data, torch.zeros(3))  # the bug: unclipped
    p = torch.nn.Parameter(torch.ones(3))
    adam = _FakeHybridAdam([p], lr=1.0)
    patch_bf16_clipping(adam)
    adam.step(div_scale=div_scale)
    assert torch.allclose(p.data, torch.full((3,), expected))
    adam.step()  # div_scale is not sticky
    assert torch.allclose(p.data, torch.full((3,), expected - 1.0))


def test_gemini_refuses_cpu_with_reason(init_dirs):
    from baselines import build_system

    imported_before = "colossalai" in sys.modules
    with pytest.raises(RuntimeError, match="Gemini needs CUDA"):
        build_system("gemini", init_dir=init_dirs["tiny-qwen2"], optim=OPTIM, device="cpu")
    if not imported_before:
        assert "colossalai" not in sys.modules


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="Gemini needs CUDA: ColossalAI's chunks, streams and HybridAdam run "
                                         "only on a GPU")
def test_gemini_cuda_close_to_native(init_dirs):
    pytest.importorskip("colossalai", reason="colossalai is not installed (GPU-node wheel)")
    preset = "tiny-llama"
    data = batches(preset)
    native, *_ = run_system("native", init_dirs[preset], data, device="cuda", dtype=torch.bfloat16)
    results, _, memory, info, label = run_system("gemini", init_dirs[preset], data, device="cuda",
                                                 dtype=torch.bfloat16)
    assert label in ("gemini", "gemini[torch-adamw]"), label
    assert info["non_fp32_buffers"] == [] and info["bf16_clipping_fixed"]
    assert results[0].loss == pytest.approx(native[0].loss, rel=2e-2)
    assert_losses_close([r.loss for r in results], [r.loss for r in native], 2e-2, "gemini vs native (cuda)")
    assert all(r.grad_norm == pytest.approx(n.grad_norm, rel=5e-2) for r, n in zip(results, native))
    assert memory.gpu_peak_allocated > 0
