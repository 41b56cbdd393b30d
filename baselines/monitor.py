"""Background sampling of host and GPU memory peaks: the one RSS sampler of the repo.

``Monitor(pid)`` samples, every ``interval`` seconds in a daemon thread, the RSS of process ``pid`` plus
all its descendants (psutil) and, where NVML works, the used memory of the GPU (whole device, so other
processes on it count too). The point process monitors itself; the runner also monitors each point
process from outside, so a point killed by the OOM killer still gets a host peak; every baseline samples
its own peak with one (``BaselineSystem``). Imports neither torch nor experiments.

Sampling misses spikes shorter than the interval; the allocator's own peaks
(``torch.cuda.max_memory_allocated``) are recorded separately by the point process.
"""
from __future__ import annotations

import os
import threading



class Monitor:
    def __init__(self, pid: int | None = None, interval: float = 0.2, gpu: bool = True,
                 gpu_index: int | None = None):
        import psutil

        self.pid = os.getpid() if pid is None else pid
        self.interval = interval
        self._psutil = psutil
        try:
            self._proc = psutil.Process(self.pid)
        except psutil.Error:
            self._proc = None
        self.peak_rss = 0
        self.last_rss = 0
        self.peak_gpu_used: int | None = None
        self.samples = 0
        self._gpu, self._gpu_index = gpu, gpu_index
        self._nvml = self._handle = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- sampling -------------------------------------------------------------------------------
    def _tree_rss(self) -> int:
        if self._proc is None:
            return 0
        ps = self._psutil
        total = 0
        try:
            procs = [self._proc] + self._proc.children(recursive=True)
        except ps.Error:
            return 0
        # Several processes (torchrun ranks) map one shared host store: RSS would count it once per rank,
        # PSS splits shared pages among them, so the sum is the node's memory.
        many = sum(1 for p in procs if "python" in _name(p, ps)) > 1 if len(procs) > 1 else False
        for p in procs:
            try:
                total += p.memory_full_info().pss if many else p.memory_info().rss
            except ps.Error:
                pass
        return total

    def sample(self) -> int:
        """Take one sample now; returns the current RSS (process tree)."""
        rss = self._tree_rss()
        used = None
        if self._handle is not None:
            try:
                used = int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
            except Exception:
                used = None
        with self._lock:
            self.samples += 1
            if rss:
                self.last_rss = rss
                self.peak_rss = max(self.peak_rss, rss)
            if used is not None:
                self.peak_gpu_used = max(self.peak_gpu_used or 0, used)
        return rss

    def reset_peak(self) -> int:
        """Restart peak tracking from the current RSS (e.g. after a build's transient peak); returns it."""
        rss = self._tree_rss()
        with self._lock:
            self.peak_rss = self.last_rss = rss
        return rss

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Monitor":
        if self._gpu:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handle = nvml_handle(pynvml, self._gpu_index)
            except Exception:  # no driver (CPU machines): GPU sampling off
                self._nvml = self._handle = None
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="memory-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict:
        if self._thread is not None:
            self.sample()
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = self._handle = None
        return self.peaks()

    def peaks(self) -> dict:
        with self._lock:
            return {"host_peak_rss_bytes": self.peak_rss or None, "gpu_peak_nvml_bytes": self.peak_gpu_used,
                    "samples": self.samples}

    def __enter__(self) -> "Monitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _name(proc, ps) -> str:
    """A process's name, "" if it is gone (a child that exits between listing and asking: spawned
    optimizer processes do, and an exception here would end the sampling thread)."""
    try:
        return proc.name() or ""
    except ps.Error:
        return ""


def nvml_handle(pynvml, index: int | None = None):
    """Handle of the GPU this process uses: ``index`` or the first of ``CUDA_VISIBLE_DEVICES``
    (an index or a UUID), else GPU 0."""
    if index is None:
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        if first and not first.lstrip("-").isdigit():
            return pynvml.nvmlDeviceGetHandleByUUID(first)
        index = int(first) if first.isdigit() else 0
    return pynvml.nvmlDeviceGetHandleByIndex(index)
