"""The baselines' registry and shared plumbing; also the helpers the other test_baselines_* files import.

Every system starts from one ``save_pretrained`` folder (``make_init_dir``) and sees the same batches.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatrain.data import synthetic_batch
from megatrain.spec import PRESETS
from megatrain.system import MemoryStats, OptimConfig, StepResult, TrainSystem

from reference import weight_rel_diffs  # noqa: F401  (the other test_baselines_* files import it from here)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5
BSZ, SEQ = 4, 16
OPTIM = OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=0.5,
                    warmup_steps=2, total_steps=5, min_lr_ratio=0.1)
# Small chunks so the chunked loss really runs in several pieces (64 tokens per step, 32 per micro-batch).
CPU_OPTIONS = {"attn_implementation": "eager", "loss_chunk_tokens": 24}
HAS_CUDA = torch.cuda.is_available()


# -- helpers shared by the test_baselines_* files ---------------------------------------------------
def make_init_dir(root: Path, preset: str, seed: int = 0, attn: str = "eager") -> Path:
    """The shared initial weights: HF's own init under a fixed seed, written by ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    spec = PRESETS[preset]
    path = Path(root) / f"{preset}-seed{seed}"
    if not (path / "config.json").is_file():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(spec.to_hf_config(attn))
        model.save_pretrained(str(path))
    return path


def batches(preset: str, steps: int = STEPS, bsz: int = BSZ, seq: int = SEQ, seed: int = 0):
    spec = PRESETS[preset]
    return [synthetic_batch(spec.vocab_size, bsz, seq, seed, s) for s in range(steps)]


def run_system(name: str, init_dir, data, *, micro_batches: int = 2, device: str = "cpu",
               dtype=torch.float32, options: dict | None = None, optim: OptimConfig = OPTIM):
    """Build, step through ``data``, collect results, the final fp32 weights and memory; close."""
    from baselines import build_system

    opts = dict(CPU_OPTIONS if (device == "cpu" and name != "megatrain") else {})
    opts.update(options or {})
    system = build_system(name, init_dir=init_dir, optim=optim, micro_batches=micro_batches, device=device,
                          dtype=dtype, options=opts)
    try:
        assert isinstance(system, TrainSystem)
        results = [system.step(b) for b in data]
        final = system.state_dict() if hasattr(system, "state_dict") else None
        memory = system.memory()
        info = dict(getattr(system, "info", {}))
        label = system.name
    finally:
        system.close()
    return results, final, memory, info, label


def assert_losses_close(losses, ref_losses, rtol: float, what: str) -> float:
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    assert max(rel) <= rtol, f"{what}: relative loss differences {['%.2e' % r for r in rel]} exceed {rtol}"
    return max(rel)


@pytest.fixture(scope="session")
def init_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("baseline_init")
    return {p: make_init_dir(root, p) for p in ("tiny-qwen2", "tiny-llama")}


# -- registry ---------------------------------------------------------------------------------------
def test_systems_listed():
    from baselines import SYSTEMS

    assert SYSTEMS == ("megatrain", "zero3", "zero2", "superoffload", "superoffload_noclip", "zenflow", "fsdp",
                       "gemini", "native")


def test_unknown_system_lists_choices(tmp_path):
    from baselines import SYSTEMS, build_system

    with pytest.raises(ValueError) as err:
        build_system("zero4", init_dir=tmp_path, optim=OPTIM, device="cpu")
    for name in SYSTEMS:
        assert name in str(err.value)


def test_import_is_lazy():
    """Importing baselines (and building native) must not import DeepSpeed or ColossalAI."""
    code = ("import sys, baselines, baselines.native, baselines.fsdp; "
            "bad = [m for m in ('deepspeed', 'colossalai') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_unknown_option_rejected(init_dirs):
    from baselines import build_system

    with pytest.raises(ValueError, match="unknown native options"):
        build_system("native", init_dir=init_dirs["tiny-qwen2"], optim=OPTIM, device="cpu", options={"bogus": 1})


# -- out of memory ----------------------------------------------------------------------------------
def test_classify_oom():
    from baselines import classify_oom

    assert classify_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "gpu"
    assert classify_oom(MemoryError()) == "host"
    assert classify_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                                     "can't allocate memory: you tried to allocate 123 bytes")) == "host"
    assert classify_oom(RuntimeError("CUDA error: out of memory")) == "gpu"
    assert classify_oom(RuntimeError("shape mismatch")) is None
    assert classify_oom(ValueError("CUDA out of memory")) is None


@pytest.mark.parametrize("exc, kind", [(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB"), "gpu"),
                                       (MemoryError("host"), "host")])
def test_step_oom_becomes_status(init_dirs, monkeypatch, exc, kind):
    from baselines import OutOfMemory, build_system
    from baselines.native import NativeSystem

    system = build_system("native", init_dir=init_dirs["tiny-qwen2"], optim=OPTIM, device="cpu",
                          options=CPU_OPTIONS)
    try:
        def boom(self, batch, t0):
            raise exc

        monkeypatch.setattr(NativeSystem, "_step", boom)
        with pytest.raises(OutOfMemory) as err:
            system.step(batches("tiny-qwen2", 1)[0])
        assert err.value.kind == kind
        assert err.value.system == "native" and err.value.phase == "step 0"
        assert err.value.__cause__ is None and err.value.__suppress_context__
        assert err.value.__context__ is None or err.value.__context__.__traceback__ is None  # frames released
    finally:
        system.close()


def test_other_errors_pass_through(init_dirs, monkeypatch):
    from baselines import build_system
    from baselines.native import NativeSystem

    system = build_system("native", init_dir=init_dirs["tiny-qwen2"], optim=OPTIM, device="cpu",
                          options=CPU_OPTIONS)
    try:
        monkeypatch.setattr(NativeSystem, "_step", lambda self, b, t0: (_ for _ in ()).throw(KeyError("x")))
        with pytest.raises(KeyError):
            system.step(batches("tiny-qwen2", 1)[0])
    finally:
        system.close()


def test_build_oom_becomes_status(init_dirs, monkeypatch):
    import baselines.native as native
    from baselines import OutOfMemory, build_system

    def boom(*_a, **_k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(native, "load_hf_model", boom)
    with pytest.raises(OutOfMemory) as err:
        build_system("native", init_dir=init_dirs["tiny-qwen2"], optim=OPTIM, device="cpu")
    assert err.value.kind == "gpu" and err.value.phase == "build"


def test_native_interface_and_memory(init_dirs):
    results, _, memory, info, label = run_system("native", init_dirs["tiny-qwen2"], batches("tiny-qwen2", 2))
    assert label == "native"
    assert all(isinstance(r, StepResult) for r in results)
    assert results[0].tokens == BSZ * SEQ and results[0].step_time_s > 0
    assert results[0].lr == pytest.approx(OPTIM.lr_at(0)) and results[1].lr == pytest.approx(OPTIM.lr_at(1))
    assert isinstance(memory, MemoryStats) and memory.host_rss > 0
    assert memory.gpu_peak_allocated == -1  # CPU run
    assert info["compute_dtype"] == "float32"


def test_megatrain_through_the_registry_starts_where_native_starts(init_dirs):
    """The registry's lazy route to the engine; same init folder, same data -> same losses on CPU."""
    data = batches("tiny-llama", 2)
    engine, *_ = run_system("megatrain", init_dirs["tiny-llama"], data)
    native, *_ = run_system("native", init_dirs["tiny-llama"], data)
    assert [r.loss for r in engine] == pytest.approx([r.loss for r in native], rel=1e-5)


def test_close_is_idempotent_and_step_after_close_fails(init_dirs):
    from baselines import build_system

    system = build_system("native", init_dir=init_dirs["tiny-qwen2"], optim=OPTIM, device="cpu",
                          options=CPU_OPTIONS)
    system.close()
    system.close()
    with pytest.raises(RuntimeError, match="after close"):
        system.step(batches("tiny-qwen2", 1)[0])
