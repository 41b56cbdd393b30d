"""Page-locking a plain host allocation in place (``cudaHostRegister``), and undoing it.

The engine pins its big host buffers this way (host store, gradient slabs and buffers, offloaded
boundaries, the link measurement buffer) rather than with ``pin_memory=True``: torch's pinned caching
allocator rounds each block up to a power of two, up to 2x the host memory on big layers. Page-locked memory
makes H2D/D2H copies true DMA that run asynchronously on their streams (55 GB/s measured vs 18 pageable).
A buffer must not be unpinned (or freed) while a copy from or to it may still be running: callers wait for
the copy's event first.
"""
from __future__ import annotations

import torch


class PinError(RuntimeError):
    """``cudaHostRegister`` failed; ``code`` is its cudaError_t (2: page-locked memory exhausted, 712: already
    registered)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def pin_in_place(t: torch.Tensor, what: str) -> torch.Tensor:
    """Page-lock ``t``'s storage (``cudaHostRegister``, default flags); raises a PinError with ``what`` on
    failure, after consuming the error the runtime keeps as this thread's last error (``_consume_last_error``),
    so that a caller may go on with pageable memory."""
    nbytes = t.numel() * t.element_size()
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
    if err != 0:
        _consume_last_error()
        raise PinError(f"cudaHostRegister failed ({err}) for {what} ({nbytes / 2**30:.2f} GiB)", err)
    return t


def _consume_last_error() -> None:
    """A failed runtime call leaves its error as the thread's "last error" (cudaGetLastError), which torch's
    check after its next kernel launch would raise as that kernel's own failure. torch does not bind
    cudaGetLastError; a tiny launch here makes its check read (and so reset) the error now, where it is
    expected, instead of in the next step."""
    if not torch.cuda.is_available():  # a fake cudart in CPU tests: no runtime, no error kept
        return
    try:
        torch.ones(1, device="cuda")  # a fill kernel (a zero fill may be a memset, not a launch)
    except RuntimeError:  # the stale error, raised by the launch check that reset it
        pass


def unpin(t: torch.Tensor) -> None:
    """Undo ``pin_in_place`` (``cudaHostUnregister``)."""
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
