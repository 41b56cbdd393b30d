"""An emulated host link slower than the real one (``EngineConfig.host_link_gbps``).

Every copy that moves weights, gradients or offloaded activations between pinned host memory and the GPU
calls ``link.throttle(stream, nbytes, direction)`` right after it is issued on its copy stream, before the
event that publishes it is recorded. With the real link (the option unset) ``link`` is ``NULL_LINK``,
whose ``throttle`` does nothing. With an emulated link it enqueues on that stream a ``torch.cuda._sleep``
of ``nbytes / target - nbytes / real`` seconds: the copy's event, and everything queued on the stream after
it, then complete as late as they would over a link of the target bandwidth.

Limits: only a link *slower* than the real one can be emulated (a faster target is a no-op, with a
warning at build). The real bandwidth is the best of a few 256 MiB pinned copies each way at build, so a
copy that runs slower than that (H2D and D2H sharing the link, host memory contention) takes longer than
the target time: the emulation is "at least this slow". DMA engine concurrency is the real GPU's. The
sleep counts SM clock cycles, converted with a rate measured once at build; a later clock change scales it.
"""
from __future__ import annotations

import warnings

import torch

from .pinning import pin_in_place, unpin

GB = 1e9  # link bandwidths are in GB/s (10^9 bytes), as PCIe's are quoted
MEASURE_BYTES = 256 << 20
MEASURE_REPEATS = 3
CALIBRATION_CYCLES = 20_000_000  # ~10 ms at a 2 GHz SM clock
DIRECTIONS = ("h2d", "d2h")


def delay_s(nbytes: int, target_gbps: float, real_gbps: float) -> float:
    """Seconds to add after a copy of ``nbytes`` that ran at ``real_gbps`` so that it takes as long as at
    ``target_gbps``; 0 when the real link is not faster than the target."""
    if real_gbps <= target_gbps:
        return 0.0
    return nbytes / (target_gbps * GB) - nbytes / (real_gbps * GB)


def sleep_cycles(nbytes: int, target_gbps: float, real_gbps: float, cycles_per_s: float) -> int:
    """``delay_s`` as cycles of ``torch.cuda._sleep``."""
    return int(round(delay_s(nbytes, target_gbps, real_gbps) * cycles_per_s))


class NullLink:
    """The real link: nothing is added to any copy."""

    info: dict | None = None

    def throttle(self, stream, nbytes: int, direction: str) -> None:
        pass


NULL_LINK = NullLink()


class EmulatedLink:
    """A link of ``target_gbps`` each way, emulated on a faster real one (see the module doc).

    ``real_gbps`` ({"h2d": .., "d2h": ..}) and ``cycles_per_s``: measured on ``device`` when not given."""

    def __init__(self, target_gbps: float, device: torch.device, *, real_gbps: dict | None = None,
                 cycles_per_s: float | None = None):
        self.target_gbps = float(target_gbps)
        if real_gbps is None or cycles_per_s is None:
            measured, rate = measure(device)
            real_gbps = real_gbps or measured
            cycles_per_s = cycles_per_s or rate
        self.real_gbps = {d: float(real_gbps[d]) for d in DIRECTIONS}
        self.cycles_per_s = float(cycles_per_s)
        for d in DIRECTIONS:
            if self.real_gbps[d] <= self.target_gbps:
                warnings.warn(f"host_link_gbps={self.target_gbps:g}: the real {d.upper()} link measured "
                              f"{self.real_gbps[d]:.1f} GB/s is not faster; {d.upper()} copies run at the real "
                              f"speed (only a slower link can be emulated)", RuntimeWarning)
        self.info = {"target_gbps": self.target_gbps, "real_h2d_gbps": self.real_gbps["h2d"],
                     "real_d2h_gbps": self.real_gbps["d2h"], "sleep_cycles_per_s": self.cycles_per_s}

    def throttle(self, stream, nbytes: int, direction: str) -> None:
        cycles = sleep_cycles(nbytes, self.target_gbps, self.real_gbps[direction], self.cycles_per_s)
        if cycles > 0:
            with torch.cuda.stream(stream):
                # A one-thread spin kernel: the stream's next work (the copy's event, later copies) waits.
                torch.cuda._sleep(cycles)


def make_link(host_link_gbps: float | None, device: torch.device):
    """``NULL_LINK`` for the real link, else an ``EmulatedLink`` measured on ``device`` (CUDA only)."""
    if host_link_gbps is None:
        return NULL_LINK
    if device.type != "cuda":
        raise ValueError(f"host_link_gbps={host_link_gbps:g} emulates a host link: needs a CUDA device "
                         f"(this engine runs on {device}); leave it unset on the CPU")
    return EmulatedLink(host_link_gbps, device)


def measure(device: torch.device, nbytes: int = MEASURE_BYTES, repeats: int = MEASURE_REPEATS):
    """(best pinned bandwidth each way in GB/s, ``torch.cuda._sleep`` cycles per second) on ``device``."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    pin_in_place(host, "the host link measurement buffer")
    try:
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            h2d = nbytes / min(_timed(lambda: dev.copy_(host, non_blocking=True), repeats)) / GB
            d2h = nbytes / min(_timed(lambda: host.copy_(dev, non_blocking=True), repeats)) / GB
            times = _timed(lambda: torch.cuda._sleep(CALIBRATION_CYCLES), repeats)
        del dev
    finally:
        unpin(host)
    torch.cuda.empty_cache()  # the plan measures free GPU memory after this
    return {"h2d": h2d, "d2h": d2h}, CALIBRATION_CYCLES / sorted(times)[len(times) // 2]


def _timed(fn, repeats: int) -> list[float]:
    """Seconds of ``fn``'s work on the current stream, ``repeats`` times after one warm-up."""
    out = []
    for i in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i:
            out.append(start.elapsed_time(end) / 1e3)
    return out
