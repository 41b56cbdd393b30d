"""Gradients out: GPU flat gradient -> pinned slab (D2H stream) -> host accumulation (worker thread).

The compute stream never waits for PCIe: a layer's gradient is copied on the D2H stream while the next
layer's backward runs, and a worker thread waits for each copy, adds it into the host gradient buffer
and computes its squared norm (for global clipping). Slabs are returned to the pool after use; when all
are in flight the main thread blocks (back-pressure), bounding pinned memory.

With the pool off (``n_slabs == 0``, an ablation) each gradient is copied synchronously into freshly
allocated pageable memory on the compute stream, which is what a naive implementation does.
"""
from __future__ import annotations

import queue
import threading
import time

import torch

from .host_store import HostStore
from .streams import StreamSet


class GradOffloader:
    def __init__(self, store: HostStore, streams: StreamSet, n_slabs: int, slab_bytes: int, pin: bool):
        self.store = store
        self.streams = streams
        self.slab_bytes = slab_bytes
        self.slabs = [torch.empty(slab_bytes, dtype=torch.uint8) for _ in range(n_slabs)]
        self._registered = []
        if pin and streams.cuda:
            for s in self.slabs:
                if int(torch.cuda.cudart().cudaHostRegister(s.data_ptr(), s.numel(), 0)) != 0:
                    raise RuntimeError("cudaHostRegister failed for a gradient slab")
                self._registered.append(s)
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(n_slabs):
            self._free.put(i)
        self._work: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.sqnorms: dict[str, float] = {}
        self.bytes_d2h = 0
        self.slab_wait_s = 0.0  # cumulative: main thread blocked waiting for a free slab
        self.busy_s = 0.0  # cumulative: worker time spent accumulating (incl. waiting for copies)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._worker, name="megatrain-grad-worker", daemon=True)
        self._thread.start()

    @property
    def pinned_bytes(self) -> int:
        return sum(s.numel() for s in self._registered)

    def begin_step(self) -> None:
        self.sqnorms = {}

    def offload(self, group: str, flat: torch.Tensor, accumulate: bool, last: bool) -> None:
        """Send ``flat`` (GPU, fully written by kernels queued on the compute stream) to the host gradient
        of ``group``: copied (``accumulate=False``) or added; ``last``: its squared norm is then final."""
        self._raise_if_failed()
        step = max(1, self.slab_bytes // flat.element_size()) if self.slabs else flat.numel()
        chunks = list(range(0, flat.numel(), step))
        for start in chunks:
            piece = flat[start:start + step]
            item = dict(group=group, start=start, accumulate=accumulate, last=last)
            if self.slabs:
                t0 = time.perf_counter()
                idx = self._free.get()  # back-pressure: wait for the worker to return a slab
                self.slab_wait_s += time.perf_counter() - t0
                slab = self.slabs[idx][:piece.numel() * piece.element_size()].view(piece.dtype)
                grads_done = self.streams.record(self.streams.compute)
                with self.streams.use(self.streams.d2h):
                    # The gradient kernels on the compute stream must finish before the copy reads.
                    self.streams.d2h.wait_event(grads_done)
                    slab.copy_(piece, non_blocking=True)
                    # ``flat`` was allocated on the compute stream; keep its memory from being reused
                    # until this D2H copy has read it.
                    self.streams.keep_alive(flat, self.streams.d2h)
                    item.update(slab=idx, data=slab, copied=self.streams.record(self.streams.d2h))
            else:
                item.update(slab=None, data=piece.to("cpu"), copied=None)  # synchronous, pageable
            self.bytes_d2h += piece.numel() * piece.element_size()
            self._work.put(item)

    def wait(self) -> dict[str, float]:
        """Block until every gradient is on the host; return the squared norms per group."""
        self._work.join()
        self._raise_if_failed()
        return dict(self.sqnorms)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("gradient offload worker failed") from err

    def _worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                self._work.task_done()
                return
            t0 = time.perf_counter()
            try:
                if item["copied"] is not None:
                    item["copied"].synchronize()  # the D2H copy into the slab has landed
                src = item["data"]
                dst = self.store.grad[item["group"]][item["start"]:item["start"] + src.numel()]
                if item["accumulate"]:
                    dst.add_(src)
                else:
                    dst.copy_(src)
                if item["last"]:
                    sq = float(torch.linalg.vector_norm(dst, dtype=torch.float32).double() ** 2)
                    with self._lock:
                        self.sqnorms[item["group"]] = self.sqnorms.get(item["group"], 0.0) + sq
            except BaseException as exc:  # surfaced on the main thread at the next offload/wait
                self._error = exc
            finally:
                self.busy_s += time.perf_counter() - t0
                if item["slab"] is not None:
                    self._free.put(item["slab"])
                self._work.task_done()

    def close(self) -> None:
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join(timeout=30)
        for s in self._registered:
            torch.cuda.cudart().cudaHostUnregister(s.data_ptr())
        self._registered.clear()
