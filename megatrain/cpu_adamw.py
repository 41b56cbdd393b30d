"""The host AdamW kernel: a one-pass C++/OpenMP extension when it builds here, else torch's fused kernel.

The extension (megatrain/csrc/adamw.cpp) reads p, m, v and the bf16 gradient once and writes p, m, v
once: 26 B/param, no widened copy of the gradient. It is compiled on first use on each machine with
torch.utils.cpp_extension (a C++ compiler with OpenMP is needed; ~30-60 s, cached under
~/.cache/torch_extensions). ``MEGATRAIN_HOST_ADAMW=torch`` forces the pure-torch fallback, ``=cpp``
makes a failed build an error instead of a fallback.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from .optim import adamw_, adamw_undo_
from .system import OptimConfig

SUB = 1 << 20  # fallback: elements per fused call, so the widened fp32 gradient (4 MiB) stays in cache
_EXT = None
_TRIED = False


def extension():
    """The compiled module, or None when it cannot be built here (and the choice allows a fallback)."""
    global _EXT, _TRIED
    choice = os.environ.get("MEGATRAIN_HOST_ADAMW", "auto")
    if choice == "torch":
        return None
    if not _TRIED:
        _TRIED = True
        try:
            from torch.utils.cpp_extension import load

            src = Path(__file__).with_name("csrc") / "adamw.cpp"
            _EXT = load(name="megatrain_cpu_adamw", sources=[str(src)], verbose=False,
                        extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"], extra_ldflags=["-fopenmp"])
        except Exception as exc:  # no compiler, no OpenMP, ...
            if choice == "cpp":
                raise
            warnings.warn(f"host AdamW extension not built ({type(exc).__name__}: {exc}); using torch's fused "
                          f"kernel", RuntimeWarning)
    if _EXT is None and choice == "cpp":
        raise RuntimeError("MEGATRAIN_HOST_ADAMW=cpp but the extension is not available")
    return _EXT


def name() -> str:
    return "cpp-openmp" if extension() is not None else "torch-fused"


class HostKernel:
    """Applies AdamW to host chunks: ``step(p, g, m, v, step_t, lr, coef)`` with g bf16 or fp32."""

    def __init__(self, cfg: OptimConfig, threads: int = 0):
        self.cfg = cfg
        self.ext = extension()
        self.threads = threads or max(1, torch.get_num_threads())
        self._g32 = None if self.ext is not None else torch.empty(SUB, dtype=torch.float32)

    def undo(self, p, g, m, v, step_t: torch.Tensor, lr: float, redo_coef: float | None) -> None:
        """Undo a coefficient-1 update (step count ``step_t`` after its increment); then, unless
        ``redo_coef`` is None, apply the update again with that clip coefficient."""
        cfg = self.cfg
        if self.ext is not None:  # one pass over the chunk (float64 arithmetic in registers)
            self.ext.adamw_undo(p, g, m, v, -1.0 if redo_coef is None else redo_coef, lr, cfg.betas[0],
                                cfg.betas[1], cfg.eps, cfg.weight_decay, float(step_t), self.threads)
            return
        for s in range(0, g.numel(), SUB):  # cache-sized pieces: the float64 temporaries stay small
            adamw_undo_(p[s:s + SUB], g[s:s + SUB], m[s:s + SUB], v[s:s + SUB], float(step_t), lr, cfg)
        if redo_coef is not None:
            self.step(p, g, m, v, step_t, lr, redo_coef)

    def step(self, p, g, m, v, step_t: torch.Tensor, lr: float, coef: float) -> None:
        cfg = self.cfg
        if self.ext is not None:
            self.ext.adamw_step(p, g, m, v, coef, lr, cfg.betas[0], cfg.betas[1], cfg.eps, cfg.weight_decay,
                                float(step_t), self.threads)
            return
        scale = None if coef == 1.0 else torch.tensor(1.0 / coef, dtype=torch.float32)
        for s in range(0, g.numel(), SUB):
            gs = g[s:s + SUB]
            # bf16 from the slab is widened in cache; an fp32 gradient is copied too when scaled, because
            # the fused kernel divides the gradient by grad_scale in place (the caller's must stay intact).
            if gs.dtype != torch.float32 or scale is not None:
                gs = self._g32[:gs.numel()].copy_(gs)
            adamw_(p[s:s + SUB], gs, m[s:s + SUB], v[s:s + SUB], step_t, lr, cfg, scale)
