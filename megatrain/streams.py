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

    def event(self):
        return torch.cuda.Event() if self.cuda else _NullEvent()

    def use(self, stream):
        """Context in which kernels are issued on ``stream``."""
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def record(self, stream):
        """Record a new event on ``stream`` and return it."""
        ev = self.event()
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
