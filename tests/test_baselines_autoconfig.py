"""The all-on-GPU system's auto-config probe (baselines/autoconfig.py) on the CPU, with CUDA
out-of-memory errors faked where a candidate would not fit on a GPU.

What must hold: the first fitting micro-batch split per checkpointing setting is kept, the fastest
fitting candidate wins, every candidate is recorded, an out-of-memory leaves no gradients or optimizer
state behind, and probing does not change training (weights bit-identical after the probe; the run
afterwards equals a plain run with the winning configuration)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from test_baselines_registry import (CPU_OPTIONS, OPTIM, assert_losses_close, batches, init_dirs,  # noqa: F401
                                     run_system, weight_rel_diffs)

PRESET = "tiny-llama"
ROWS, SEQ = 4, 16  # the shape of test_baselines_registry.batches


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: one torch thread keeps a step in milliseconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _fake_gpu(monkeypatch, oom_when, step_s=None, where="forward"):
    """Patch NativeSystem.train_step: probe steps of candidates for which ``oom_when(system)`` holds
    raise torch.OutOfMemoryError (``where``="forward" before any work, "optimizer" from AdamW's step,
    after backward made gradients). ``step_s`` {candidate key: seconds} replaces the measured time of the
    candidates that fitted (CPU timings on a shared machine are noise; the choice logic is under test)."""
    from baselines import autoconfig
    from baselines.native import NativeSystem

    real = NativeSystem.train_step
    if step_s:
        real_try = autoconfig._try

        def timed_try(system, cand, batch, steps):
            real_try(system, cand, batch, steps)
            if cand.status == "ok":
                cand.step_s = step_s[cand.key]

        monkeypatch.setattr(autoconfig, "_try", timed_try)

    def fake(self, batch, t0=None, *, probe=False):
        if not probe:
            return real(self, batch, t0)
        if oom_when(self):
            if where == "forward":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (faked)")

            def boom(*a, **k):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB (faked, AdamW)")

            saved, self.optimizer.step = self.optimizer.step, boom
            try:
                return real(self, batch, t0, probe=True)
            finally:
                self.optimizer.step = saved
        return real(self, batch, t0, probe=True)

    monkeypatch.setattr(NativeSystem, "train_step", fake)


def _ckpt_on(system) -> bool:
    """Whether HF checkpointing is on in the model (its decoder layers' flag)."""
    return any(getattr(m, "gradient_checkpointing", False) for m in system.model.lm.modules())


def _build(init_dir, micro_batches=1, **options):
    from baselines import build_system

    return build_system("native", init_dir=init_dir, optim=OPTIM, micro_batches=micro_batches, device="cpu",
                        dtype=torch.float32, options=dict(CPU_OPTIONS, auto_config=True, **options),
                        step_shape=(ROWS, SEQ))


def test_no_checkpointing_ooms_then_checkpointing_wins(init_dirs, monkeypatch):
    """Every no-checkpointing split runs out of memory (in AdamW's step, after backward): the
    checkpointed one-micro-batch config wins; nothing of the failed tries is left behind."""
    _fake_gpu(monkeypatch, oom_when=lambda s: not s.activation_checkpointing, where="optimizer")
    init = load_file(str(init_dirs[PRESET] / "model.safetensors"))
    system = _build(init_dirs[PRESET])
    try:
        rec = system.info["auto_config"]
        keys = [(c["key"], c["status"]) for c in rec["candidates"]]
        assert keys == [("no_ckpt/mb1", "gpu_oom"), ("no_ckpt/mb2", "gpu_oom"), ("no_ckpt/mb4", "gpu_oom"),
                        ("ckpt/mb1", "ok")], keys
        assert rec["winner"] == "ckpt/mb1" and rec["requested"] == {"activation_checkpointing": True,
                                                                      "micro_batches": 1}
        assert all("CUDA out of memory" in c["detail"] for c in rec["candidates"][:3])
        settings = system.info["settings"]
        assert settings["activation_checkpointing"] is True and settings["micro_batches"] == 1
        assert settings["auto_config"]["no_ckpt/mb1"] == "gpu_oom" and settings["auto_config"]["winner"] == "ckpt/mb1"
        assert system.micro_batches == 1 and _ckpt_on(system)
        # the probe left nothing: no gradients, no AdamW state, weights bit-identical to the checkpoint
        assert all(p.grad is None for p in system.model.parameters())
        assert len(system.optimizer.state) == 0
        after = system.state_dict()
        assert all(torch.equal(after[k], v) for k, v in init.items())
        assert system.scheduler.last_epoch == 0 and system.scheduler.get_last_lr()[0] == pytest.approx(OPTIM.lr_at(0))
        data = batches(PRESET)
        results = [system.step(b) for b in data]
        final = system.state_dict()
    finally:
        system.close()
    # training after the probe == a plain run with the winning configuration
    ref, ref_final, *_ = run_system("native", init_dirs[PRESET], data, micro_batches=1)
    assert_losses_close([r.loss for r in results], [r.loss for r in ref], 1e-6, "auto-configured vs plain")
    worst = weight_rel_diffs(final, ref_final)
    assert max(worst.values()) <= 1e-6, worst


def test_fastest_fitting_candidate_wins(init_dirs, monkeypatch):
    """No checkpointing fits from 2 micro-batches on; checkpointing fits in one but is slower: the
    no-checkpointing 2-micro-batch split wins, the larger splits are not tried."""
    _fake_gpu(monkeypatch, oom_when=lambda s: not s.activation_checkpointing and s.micro_batches == 1,
              step_s={"no_ckpt/mb2": 0.8, "ckpt/mb1": 1.0})
    system = _build(init_dirs[PRESET])
    try:
        rec = system.info["auto_config"]
        statuses = {c["key"]: c["status"] for c in rec["candidates"]}
        assert statuses == {"no_ckpt/mb1": "gpu_oom", "no_ckpt/mb2": "ok", "ckpt/mb1": "ok"}, statuses
        times = {c["key"]: c["step_s"] for c in rec["candidates"] if c["status"] == "ok"}
        assert times["ckpt/mb1"] > times["no_ckpt/mb2"]
        assert rec["winner"] == "no_ckpt/mb2"
        assert system.micro_batches == 2 and not _ckpt_on(system)
        assert system.info["settings"]["activation_checkpointing"] is False
        r = system.step(batches(PRESET, 1)[0])
        assert r.loss > 0 and r.lr == pytest.approx(OPTIM.lr_at(0))
    finally:
        system.close()


def test_checkpointing_skipped_when_one_micro_batch_fits(init_dirs):
    system = _build(init_dirs[PRESET])
    try:
        rec = system.info["auto_config"]
        assert [(c["key"], c["status"]) for c in rec["candidates"]] == [("no_ckpt/mb1", "ok"), ("ckpt/mb1", "skipped")]
        assert rec["winner"] == "no_ckpt/mb1"
    finally:
        system.close()


def test_an_asked_for_split_is_a_floor(init_dirs):
    """A run that asks for 2 micro-batches (e.g. all-on-GPU's spread in another summation order) is never
    probed into 1: the probe starts at 2, and the run trains in 2, equal to a plain 2-micro-batch run.
    (On the H200 the probe once turned such a variant back into one micro-batch, a plain rerun.)"""
    system = _build(init_dirs[PRESET], micro_batches=2)
    try:
        rec = system.info["auto_config"]
        assert [(c["key"], c["status"]) for c in rec["candidates"]] == [("no_ckpt/mb2", "ok"), ("ckpt/mb2", "skipped")]
        assert rec["winner"] == "no_ckpt/mb2" and system.micro_batches == 2
        assert rec["requested"]["micro_batches"] == 2 and system.info["settings"]["micro_batches"] == 2
        data = batches(PRESET)
        results = [system.step(b) for b in data]
    finally:
        system.close()
    ref, *_ = run_system("native", init_dirs[PRESET], data, micro_batches=2)
    assert_losses_close([r.loss for r in results], [r.loss for r in ref], 1e-6, "floored auto-config vs plain mb2")


def test_nothing_fits_is_a_gpu_oom(init_dirs, monkeypatch):
    from baselines import OutOfMemory

    _fake_gpu(monkeypatch, oom_when=lambda s: True)
    with pytest.raises(OutOfMemory) as err:
        _build(init_dirs[PRESET], auto_micro_batches=[1, 2])
    assert err.value.kind == "gpu" and "no configuration fits" in str(err.value)


def test_other_errors_are_not_swallowed(init_dirs, monkeypatch):
    from baselines.native import NativeSystem

    def broken(self, batch, t0=None, *, probe=False):
        raise ValueError("a real bug")

    monkeypatch.setattr(NativeSystem, "train_step", broken)
    with pytest.raises(ValueError, match="a real bug"):
        _build(init_dirs[PRESET])


def test_off_and_cuda_only_keep_the_old_behaviour(init_dirs):
    from baselines import build_system

    for auto in (False, "cuda"):  # "cuda" on a CPU: off
        system = build_system("native", init_dir=init_dirs[PRESET], optim=OPTIM, micro_batches=2, device="cpu",
                              options=dict(CPU_OPTIONS, auto_config=auto), step_shape=(ROWS, SEQ))
        try:
            assert "auto_config" not in system.info and system.micro_batches == 2
            assert system.info["settings"] == {"fused_adamw": False, "activation_checkpointing": True}
        finally:
            system.close()
    with pytest.raises(ValueError, match="auto_config must be one of"):
        build_system("native", init_dir=init_dirs[PRESET], optim=OPTIM, device="cpu",
                     options=dict(CPU_OPTIONS, auto_config="always"))


def test_without_a_step_shape_the_first_batch_is_probed(init_dirs):
    """Built outside the runner (no step_shape): the probe runs on the first step's batch shape and
    that step's result is a normal first step."""
    from baselines import build_system

    system = build_system("native", init_dir=init_dirs[PRESET], optim=OPTIM, micro_batches=2, device="cpu",
                          options=dict(CPU_OPTIONS, auto_config=True))
    try:
        assert "auto_config" not in system.info
        data = batches(PRESET, 2)
        results = [system.step(b) for b in data]
        assert system.info["auto_config"]["probe_shape"] == [ROWS, SEQ]
    finally:
        system.close()
    assert system.info["auto_config"]["winner"] == "no_ckpt/mb2"  # the asked-for split of 2 is kept
    ref, *_ = run_system("native", init_dirs[PRESET], data, micro_batches=2, options={})
    assert_losses_close([r.loss for r in results], [r.loss for r in ref], 1e-6, "lazy auto-config vs plain")
