"""Background sampling of host and GPU memory peaks: the one RSS sampler of the repo.

``Monitor(pid)`` samples, every ``interval`` seconds in a daemon thread, the RSS of process ``pid`` plus
all its descendants (psutil) and, where NVML works, the used memory of the GPU (whole device, so other
processes on it count too). The point process monitors itself; the runner also monitors each point
process from outside, so a point killed by the OOM killer still gets a host peak; every baseline samples
its own peak with one (``BaselineSystem``). Imports neither torch nor experiments.

Sampling misses spikes shorter than the interval; the allocator's own peaks
(``torch.cuda.max_memory_allocated``) are recorded separately by the point process.

A process of the tree that exits between being listed and being read is skipped (children come and go:
compilers, dataloader workers, torchrun ranks). Any other failure stops the sampler and is kept in
``error``; from then on ``ok`` is False and ``peaks()`` reports the host peak as unknown (None), never the
lower peak of the samples taken before it died.
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
        self.vanished = 0  # processes that exited between being listed and being read (skipped)
        self.error: str | None = None  # why the sampler stopped early; None while it works
        self._gpu, self._gpu_index = gpu, gpu_index
        self._nvml = self._handle = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def ok(self) -> bool:
        """True while every sample so far was taken (processes that vanished mid-sample excepted)."""
        return self.error is None

    # -- sampling -------------------------------------------------------------------------------
    def _read(self, fn, default):
        """``fn()`` of one process of the tree, or ``default`` if that process has exited (or cannot be
        read) since it was listed: a child may end at any moment between ``children()`` and here."""
        try:
            return fn()
        except self._psutil.Error:
            self.vanished += 1
            return default

    def _tree_rss(self) -> int:
        if self._proc is None:
            return 0
        ps = self._psutil
        try:
            procs = [self._proc] + self._proc.children(recursive=True)
        except ps.Error:  # the root itself has exited: nothing left to sample
            return 0
        # Several processes (torchrun ranks) map one shared host store: RSS would count it once per rank,
        # PSS splits shared pages among them, so the sum is the node's memory.
        many = len(procs) > 1 and sum(1 for p in procs if "python" in (self._read(p.name, "") or "")) > 1
        total = 0
        for p in procs:
            if many:
                total += self._read(lambda: p.memory_full_info().pss, 0)
            else:
                total += self._read(lambda: p.memory_info().rss, 0)
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
        try:
            while not self._stop.wait(self.interval):
                self.sample()
        except BaseException as e:  # noqa: BLE001 - kept, so the peak is reported unknown rather than low
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = f"memory sampler stopped: {type(e).__name__}: {e}"

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
        """Stop sampling (one last sample first); returns ``peaks()``."""
        if self._thread is not None:
            if self._thread.is_alive():
                try:
                    self.sample()
                except Exception as e:  # noqa: BLE001
                    self._fail(e)
            elif self.error is None:  # ended without a recorded reason: the samples stopped at some point
                self.error = "memory sampler stopped: its thread ended early"
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
        """``host_peak_rss_bytes`` (None when unknown: no sample, or the sampler died), ``gpu_peak_nvml_bytes``,
        ``samples`` and ``error`` (None, or why the sampler stopped early)."""
        with self._lock:
            host = self.peak_rss or None
            return {"host_peak_rss_bytes": host if self.error is None else None,
                    "gpu_peak_nvml_bytes": self.peak_gpu_used if self.error is None else None,
                    "samples": self.samples, "error": self.error}

    def __enter__(self) -> "Monitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def nvml_handle(pynvml, index: int | None = None):
    """Handle of the GPU this process uses: ``index`` or the first of ``CUDA_VISIBLE_DEVICES``
    (an index or a UUID), else GPU 0."""
    if index is None:
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        if first and not first.lstrip("-").isdigit():
            return pynvml.nvmlDeviceGetHandleByUUID(first)
        index = int(first) if first.isdigit() else 0
    return pynvml.nvmlDeviceGetHandleByIndex(index)
