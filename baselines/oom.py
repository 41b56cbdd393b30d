"""Out of memory, and what a failure was: the one classifier of the repo (torch-free).

``classify_oom(exc)`` says "gpu", "host" or None for one exception; ``failure_status(exc)`` walks the
exception's cause/context chain and gives the results CSV's status (gpu_oom / host_oom / timeout /
error). Both go by class names and messages, so they need neither torch nor DeepSpeed imported: the
sweep runner's parent process and the baselines use the same rules.
"""
from __future__ import annotations

import gc

HOST_OOM_MARKERS = ("DefaultCPUAllocator: can't allocate memory", "Cannot allocate memory", "std::bad_alloc",
                    "CPU out of memory", "not enough memory: you tried to allocate")
GPU_OOM_MARKERS = ("CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
                   "cudaErrorMemoryAllocation", "out of memory on device")
# A framework's own watchdog giving up (DeepSpeed SuperOffload: "CPU optimizer timeout after 60.0 seconds").
TIMEOUT_MARKERS = ("timeout after",)


class OutOfMemory(Exception):
    """A system ran out of GPU (``kind="gpu"``) or host (``kind="host"``) memory in build or step.

    Raised ``from None`` with the original exception's traceback dropped, so the frames (and the
    tensors they hold) can be freed before the runner calls ``close()``; ``detail`` keeps the original's
    type and message. A host OOM that the kernel answers with SIGKILL cannot be caught in-process: run
    each system in a subprocess and treat exit code -9 / 137 as ``host``.
    """

    def __init__(self, kind: str, detail: str = "", system: str | None = None, phase: str | None = None):
        if kind not in ("gpu", "host"):
            raise ValueError(f"OutOfMemory kind must be 'gpu' or 'host', got {kind!r}")
        self.kind, self.detail, self.system, self.phase = kind, detail, system, phase
        where = " ".join(x for x in (system, phase) if x)
        super().__init__(f"{kind} out of memory{f' ({where})' if where else ''}: {detail}")


def classify_oom(exc: BaseException) -> str | None:
    """"gpu", "host" or None (not an out-of-memory error)."""
    names = {c.__name__ for c in type(exc).__mro__}
    if "OutOfMemory" in names:  # this module's, or a look-alike with the same ``kind`` attribute
        return "host" if getattr(exc, "kind", "gpu") == "host" else "gpu"
    if "OutOfMemoryError" in names:  # torch.OutOfMemoryError (= torch.cuda.OutOfMemoryError)
        return "gpu"
    if isinstance(exc, MemoryError):
        return "host"
    if isinstance(exc, RuntimeError):
        msg = str(exc)
        if any(m in msg for m in HOST_OOM_MARKERS):
            return "host"
        if any(m in msg for m in GPU_OOM_MARKERS):
            return "gpu"
    return None


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen and len(seen) < 8:
        seen.add(id(exc))
        yield exc
        # ``raise ... from None`` hides the context on purpose (the new error states the cause): so here too
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def failure_status(exc: BaseException) -> str:
    """gpu_oom / host_oom / timeout / error for an exception (or anything in its cause chain)."""
    for e in _chain(exc):
        kind = classify_oom(e)
        if kind:
            return f"{kind}_oom"
    for e in _chain(exc):
        if any(m in str(e) for m in TIMEOUT_MARKERS):
            return "timeout"
    return "error"


class oom_guard:
    """``with oom_guard(system, phase):`` turns out-of-memory errors raised inside into ``OutOfMemory``
    (``raise ... from None``, the original's traceback dropped so the frames and the tensors they hold
    can be freed); any other exception passes through unchanged."""

    def __init__(self, system: str | None = None, phase: str | None = None):
        self.system, self.phase = system, phase

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, OutOfMemory):
            return False
        kind = classify_oom(exc)
        if kind is None:
            return False
        detail = f"{type(exc).__name__}: {str(exc)[:2000]}"
        exc.__traceback__ = None
        del tb
        gc.collect()
        raise OutOfMemory(kind, detail, system=self.system, phase=self.phase) from None
