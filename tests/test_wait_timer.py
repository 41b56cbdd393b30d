"""megatrain.streams.WaitTimer: GPU stall time around stream waits, from timing-event pairs (a fake event
clock here; the engine's CPU path records nothing and reports 0)."""
from __future__ import annotations

import torch

from megatrain import PRESETS, EngineConfig, MegaTrain
from megatrain.data import synthetic_batch
from megatrain.streams import StreamSet, WaitTimer


class _Clock:
    """Stands in for the GPU: each recorded event gets the next scripted completion time (ms)."""

    def __init__(self, times_ms):
        self.times = list(times_ms)


class _Event:
    def __init__(self, clock):
        self.clock, self.t, self.synced = clock, None, False

    def record(self, stream):
        self.t = self.clock.times.pop(0)

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, other):
        return other.t - self.t


class _Stream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_wait_timer_sums_the_gap_between_each_pair_and_settles_once():
    clock = _Clock([10.0, 35.0, 50.0, 50.0, 60.0, 70.0])  # a 25 ms stall, a wait on work already done, ...
    made = []

    def record(stream):
        made.append(_Event(clock))
        made[-1].record(stream)
        return made[-1]

    timer = WaitTimer(StreamSet(torch.device("cpu")), record=record)
    stream = _Stream()
    timer.wait(stream, "load-1")
    timer.wait(stream, "load-2")
    assert stream.waited == ["load-1", "load-2"]  # the wait itself still happens, in order
    assert timer.settle() == 0.025
    assert all(e.synced for e in made[1::2])  # each closing event is synchronized before it is read
    assert timer.settle() == 0.025  # cumulative: settled pairs are not counted twice
    timer.wait(stream, "load-3")
    timer.discard()  # a failed step: its pairs are dropped, the total stays
    assert timer.settle() == 0.025


def test_without_cuda_the_wait_is_plain_and_costs_nothing():
    timer = WaitTimer(StreamSet(torch.device("cpu")))
    stream = _Stream()
    timer.wait(stream, "ev")
    assert stream.waited == ["ev"] and timer.settle() == 0.0


def test_engine_reports_the_load_wait_per_step():
    spec = PRESETS["tiny-qwen2"]
    engine = MegaTrain.from_config(spec.to_hf_config("sdpa"), EngineConfig(device="cpu"), verbose=False,
                                   tokens_per_step=2 * 32, seq_len=32)
    engine.step(synthetic_batch(spec.vocab_size, 2, 32, 1, 0))
    assert engine.stats["gpu_load_wait_s"] == 0.0  # CPU: nothing waits
    engine.close()
