"""Streams and events behind one small interface, so the scheduler is the same code on CUDA and CPU.

On CUDA: the compute stream (the default one), an H2D stream (weights in) and a D2H stream (gradients
out), and real events. On CPU every operation is synchronous in program order, so streams are no-op
contexts and events are always complete: the CPU path runs the identical schedule and ordering logic.
"""
from __future__ import annotations

import contextlib

import torch


class _NullEvent:
    def record(self, stream=None) -> None:  # noqa: D401 - mirrors torch.cuda.Event
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class StreamSet:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.compute = self.h2d = self.d2h = _NullStream()

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.cuda else _NullEvent()

    def use(self, stream):
        """Context in which kernels are issued on ``stream``."""
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def record(self, stream, timing: bool = False):
        """Record a new event on ``stream`` and return it (``timing``: one ``elapsed_time`` can read)."""
        ev = self.event(timing)
        if self.cuda:
            ev.record(stream)
        return ev

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        """Tell the caching allocator that ``tensor`` (made on another stream) is used on ``stream``, so its
        memory is not handed out again before that stream's pending work is done."""
        if self.cuda and tensor.is_cuda:
            tensor.record_stream(stream)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


class WaitTimer:
    """GPU time a stream spends blocked in ``wait_event``: a timing event is recorded on the stream just
    before the wait and one just after, so the first completes when the stream reaches the wait and the
    second when it passes it; their elapsed time is the stall (0 when the awaited work was already done).
    Elapsed times are read in ``settle``, after a sync that covers them. On CPU nothing waits: 0.
    ``record(stream)`` records a timing event (default ``streams.record(stream, timing=True)``; tests pass
    a fake)."""

    def __init__(self, streams: StreamSet, record=None):
        if record is None and streams.cuda:
            record = lambda stream: streams.record(stream, timing=True)  # noqa: E731
        self._record = record
        self._pending: list[tuple[object, object]] = []
        self.total_s = 0.0  # cumulative over settled waits (the engine reports per-step differences)

    def wait(self, stream, event) -> None:
        if self._record is None:
            stream.wait_event(event)
            return
        before = self._record(stream)
        stream.wait_event(event)
        self._pending.append((before, self._record(stream)))

    def settle(self) -> float:
        """Add the recorded waits to ``total_s`` and return it. Call after a sync of the stream: each
        ``synchronize`` below then returns at once (it only guards against a caller that did not sync)."""
        for before, after in self._pending:
            after.synchronize()
            self.total_s += before.elapsed_time(after) / 1e3  # elapsed_time is in milliseconds
        self._pending.clear()
        return self.total_s

    def discard(self) -> None:
        """Forget unsettled waits (a failed step: its events may never complete)."""
        self._pending.clear()
