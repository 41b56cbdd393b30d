"""speculate="auto" decided by measured step times (megatrain/optim.py ``SpeculationChooser``, behind
``SpeculationPolicy``): the precondition (the previous step did not clip) gates every step; where it holds,
speculation is measured, then steps without it, and the faster stays (2 % hysteresis, speculation kept
within it). Measured on the H200 at 3b6c5ca (Qwen2.5-7B, every layer streamed, 8x1024, no clipping):
speculating 2.72 s a step against 2.44 with the CPU update after the norm; at 14B tiered speculating was
faster (393 vs 316 TFLOPS). Timings are injected through a model of where each update lands; then parity
with plain PyTorch while the chooser switches speculation off and on with clipping firing in some steps."""
from __future__ import annotations

import dataclasses

import pytest

from megatrain import MegaTrain, PRESETS
from megatrain.optim import (SPEC_FIXED, SPEC_KEPT_FASTER, SPEC_KEPT_WITHIN_MARGIN, SPEC_MEASURING_OFF,
                             SPEC_MEASURING_ON, SPEC_OFF_FASTER, SpeculationChooser, SpeculationPolicy)

from test_engine_parity import OPTIM, assert_matches_reference, batches, engine_cfg
from test_update_path import hybrid_cfg

CLIP = 0.5  # max_grad_norm of the driver: a norm of 1.0 clips, 0.1 does not


@dataclasses.dataclass
class Timing:
    """Where a step's time comes from: ``base`` forward + backward; ``after`` the previous step's update after
    its norm, exposed in this step's forward; ``spec`` this step's own speculative update in its backward;
    ``roll`` the previous step's undo + redo (it speculated and clipped), in this step's forward."""

    base: float = 1.0
    after: float = 1.44
    spec: float = 1.72
    roll: float = 2.0

    def step_s(self, prev_spec: bool | None, prev_clipped: bool, spec: bool) -> float:
        t = self.base + (self.spec if spec else 0.0)
        if prev_spec is False:
            t += self.after
        elif prev_spec and prev_clipped:
            t += self.roll
        return t


H200_7B = Timing(base=1.0, after=1.44, spec=1.72)  # 2.44 s after the norm, 2.72 s speculating (no clip)
H200_14B = Timing(base=1.0, after=1.0, spec=0.61)  # speculating 393 vs 316 TFLOPS: 1.61 vs 2.00 s


def drive(policy: SpeculationPolicy, timing: Timing, steps: int, clips=()) -> list[dict]:
    """Run ``policy`` as the engine does (decide, observe the norm, observe_step with the step's phases) for
    ``steps`` steps, the steps in ``clips`` clipping; returns each step's phases."""
    out, prev_spec, prev_clipped = [], None, False
    for s in range(steps):
        spec = policy.decide()
        clipped = s in clips
        policy.observe(1.0 if clipped else 0.1)
        stats = dict(speculated=float(spec), step_s=timing.step_s(prev_spec, prev_clipped, spec))
        policy.observe_step(stats)
        out.append(stats)
        prev_spec, prev_clipped = spec, clipped
    return out


def speculated(stats: list[dict]) -> list[int]:
    return [int(s["speculated"]) for s in stats]


def auto(**kw) -> SpeculationPolicy:
    return SpeculationPolicy("auto", CLIP, SpeculationChooser(**kw))


def test_speculation_measured_slower_stops_speculating():
    """The 7B H200 shape: 3 speculative samples (2.72 s), 3 steps without after the switch (2.44 s; the
    switch step itself, which holds neither update, is no sample), then it stops speculating for good."""
    policy = auto()
    stats = drive(policy, H200_7B, 14)
    assert speculated(stats) == [0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    ch = policy.chooser
    assert ch.times[True] == pytest.approx([2.72] * 3) and ch.times[False] == pytest.approx([2.44] * 3)
    assert [s.get("speculation_measured") for s in stats[:9]] == [None, None, 1, 1, 1, None, 0, 0, 0]
    assert [s["speculation_decision"] for s in stats[3:9]] == [SPEC_MEASURING_ON, SPEC_MEASURING_OFF] + [
        SPEC_MEASURING_OFF] * 3 + [SPEC_OFF_FASTER]
    assert all(s["speculation_next"] == 0 for s in stats[8:])
    assert ch.decided and ch.last_decision == SPEC_OFF_FASTER
    assert "stopped speculating" in policy.describe() and "2.440" in policy.describe()


def test_speculation_measured_faster_keeps_speculating():
    """The 14B tiered case: speculation is faster; after the bounded trial (3 steps without, plus the switch
    step) it speculates again and stays."""
    policy = auto()
    stats = drive(policy, H200_14B, 20)
    assert speculated(stats) == [0, 1, 1, 1, 1, 0, 0, 0, 0] + [1] * 11
    assert policy.chooser.last_decision == SPEC_KEPT_FASTER
    assert policy.chooser.times[True] == pytest.approx([1.61] * 3)
    assert policy.chooser.times[False] == pytest.approx([2.0] * 3)
    assert [d for _, d, _ in policy.chooser.history] == [SPEC_MEASURING_OFF, SPEC_KEPT_FASTER]


@pytest.mark.parametrize("faster_by,keeps", [(0.01, True), (0.03, False)])
def test_within_the_margin_speculation_stays(faster_by, keeps):
    """Not speculating 1 % faster: within the 2 % margin, speculation stays; 3 % faster: it stops."""
    on = 2.0
    timing = Timing(base=1.0, spec=on - 1.0, after=on * (1 - faster_by) - 1.0)
    policy = auto()
    stats = drive(policy, timing, 14)
    assert speculated(stats)[9:] == ([1] * 5 if keeps else [0] * 5)
    assert policy.chooser.last_decision == (SPEC_KEPT_WITHIN_MARGIN if keeps else SPEC_OFF_FASTER)


def test_clipped_steps_count_for_the_mode_that_caused_them():
    """A speculative step that clips (step 3): the next step cannot speculate, but its forward runs the undo +
    redo, so its time is speculation's sample, as is the step that speculates again after it (it holds the
    held-back step's update too); neither is a no-speculation sample. Here the rollbacks make speculation
    the slower mode, though its clean steps are faster (counted the other way, it would be kept). In the
    trial without speculation a clipped step (step 8) makes the next one no sample: speculation was not
    possible there."""
    timing = Timing(base=1.0, after=1.0, spec=0.9, roll=2.5)  # clean: 1.9 speculating vs 2.0 without
    policy = auto(samples=4)
    stats = drive(policy, timing, 16, clips={3, 8})
    ch = policy.chooser
    # step 2 (1.9), step 3 (1.9: clipped, found out at its norm), step 4 (held back: 1 + 2.5 rollback),
    # step 5 (speculates again: 1 + 1 held-back update + 0.9); the switch step 6 is none; then 7, 8, 10, 11
    assert speculated(stats) == [0, 1, 1, 1, 0, 1] + [0] * 10
    assert ch.times[True] == pytest.approx([1.9, 1.9, 3.5, 2.9])
    assert stats[4]["speculation_measured"] == 1 and stats[4]["speculated"] == 0
    assert stats[5]["speculation_measured"] == 1
    assert "speculation_measured" not in stats[6] and "speculation_measured" not in stats[9]
    assert [s.get("speculation_measured") for s in (stats[7], stats[8], stats[10], stats[11])] == [0] * 4
    assert ch.times[False] == pytest.approx([2.0] * 4)
    assert ch.last_decision == SPEC_OFF_FASTER and stats[10]["speculation_decision"] == SPEC_MEASURING_OFF
    assert stats[11]["speculation_decision"] == SPEC_OFF_FASTER


def test_the_precondition_gates_every_step():
    """Clipping every step: nothing speculates, nothing is measured, the mode does not move (and a clipped
    previous step forbids speculation whatever the chooser wants)."""
    policy = auto()
    stats = drive(policy, H200_7B, 12, clips=set(range(12)))
    assert speculated(stats) == [0] * 12
    assert policy.chooser.times == {True: [], False: []}
    assert all(s["speculation_decision"] == SPEC_MEASURING_ON for s in stats)
    policy = auto()
    stats = drive(policy, H200_14B, 20, clips={12})
    assert speculated(stats)[12:15] == [1, 0, 1]


def test_always_and_never_are_fixed_and_an_untimed_step_breaks_the_chain():
    for mode, expect in (("always", 1), ("never", 0)):
        policy = SpeculationPolicy(mode, CLIP)
        stats = drive(policy, H200_7B, 12)
        assert speculated(stats) == [expect] * 12 and all(s["speculation_decision"] == SPEC_FIXED for s in stats)
    # A step whose time never arrives (aborted): the next step's time is no sample (it may hold its update).
    policy = auto(warmup=0)
    drive(policy, H200_14B, 3)
    assert len(policy.chooser.times[True]) == 2  # steps 1, 2 (step 0 has nothing before it)
    policy.decide()  # aborted: no observe, no observe_step
    stats = drive(policy, H200_14B, 2)
    assert "speculation_measured" not in stats[0] and stats[1]["speculation_measured"] == 1


# -- parity: the chooser switches speculation off and on, clipping fires in some steps ----------------------
# tiny-llama, 2 micro-batches, this data: the reference's norms are 2.26 2.32 2.65 2.05 2.14 2.04 2.10 1.77
# 2.28 2.30 2.14 2.05 (max_grad_norm 2.2 clips steps 0-2 and 8-9, each at least 2 % from it).
SWITCH_OPTIM = dataclasses.replace(OPTIM, max_grad_norm=2.2, total_steps=12)


@pytest.mark.parametrize("path", ["cpu", "hybrid"])
def test_parity_while_the_chooser_switches_speculation(path):
    """One speculation sample, one without (injected step times: speculating 1 s, not 2 s), so the run goes
    off and on again: step 4 speculates (kept), steps 5-6 do not (the trial), 7 speculates, 8 speculates and
    clips (rolled back), 9 and 10 cannot (steps 8, 9 clipped), 11 speculates. The weights match plain
    PyTorch to 1e-5 throughout; with update_path="hybrid" the CPU path's groups speculate beside the GPU
    path's forced groups."""
    spec = PRESETS["tiny-llama"]
    hf = spec.to_hf_config("eager")
    data = batches(spec, steps=12)
    kw = dict(gpu_resident="0", optim=SWITCH_OPTIM, micro_batches=2)
    cfg = engine_cfg(checkpoint_interval=2, **kw) if path == "cpu" else hybrid_cfg(**kw)
    engine = MegaTrain.from_config(hf, cfg, verbose=False)
    engine.optimizer.policy.chooser = SpeculationChooser(samples=1)
    orig = engine.optimizer.observe_step

    def injected(stats):  # the chooser sees the injected time; the step's phases keep the real one
        real, stats["step_s"] = stats["step_s"], 1.0 if stats["speculated"] else 2.0
        orig(stats)
        stats["step_s"] = real

    engine.optimizer.observe_step = injected
    init = {k: v.clone() for k, v in engine.state_dict().items()}
    losses, seen, choosing = [], [], []
    for b in data:
        losses.append(engine.step(b).loss)
        seen.append(dict(engine.stats))
        choosing.append(engine.choosing())
    final = {k: v.clone() for k, v in engine.state_dict().items()}
    summary = engine.memory().extra["speculation_summary"]
    engine.close()
    norms: list[float] = []
    assert_matches_reference(hf, init, losses, final, data, 2, SWITCH_OPTIM, grad_norms=norms)
    assert all(abs(n / 2.2 - 1) > 0.015 for n in norms), norms  # the engine's clip pattern is the reference's
    assert [int(s["clipped"]) for s in seen] == [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0]
    assert [int(s["speculated"]) for s in seen] == [0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 1]
    assert [int(s["rollbacks"]) for s in seen] == [0] * 8 + [1, 0, 0, 0]
    assert [s["speculation_decision"] for s in seen[3:7]] == [SPEC_MEASURING_ON, SPEC_MEASURING_OFF,
                                                             SPEC_MEASURING_OFF, SPEC_KEPT_FASTER]
    assert "kept speculating: measured faster" in summary
    # MegaTrain.choosing() (the runner's settle_steps wait on it): nothing while clipping fires (steps 0-2: the
    # next step cannot speculate), the chooser's state while it measures (after steps 3-5), "" once decided
    assert choosing[:3] == [""] * 3 and choosing[6:] == [""] * 6, choosing
    assert choosing[3] == "speculation: speculating: measuring it"
    assert choosing[4] == choosing[5] == "speculation: measuring steps without speculation"
