"""The host AdamW kernel: a one-pass C++/OpenMP extension when it is built here, else torch's fused kernel.

The extension (megatrain/csrc/adamw.cpp) reads p, m, v and the bf16 gradient once and writes p, m, v
once: 26 B/param, no widened copy of the gradient. megatrain/kernels.py builds it (once per source + flags
hash, in a child process, bounded in time; ``python -m megatrain.kernels build`` builds ahead) and loads it;
when it cannot be built, one warning line and torch's fused kernel. ``MEGATRAIN_HOST_ADAMW=torch`` forces the
pure-torch kernel, ``=cpp`` makes a missing extension an error instead of a fallback.

Speculative updates (coefficient 1 before the clip coefficient is known, megatrain/host_adamw.py) go
through ``step(..., speculative=True)``, then ``undo`` (rollback, optionally redone with the true
coefficient) or ``kept``/``commit`` (it stands). A speculative update saves the exact m and v of the
elements whose second moment the undo could not restore closely (see adamw.cpp), at most 1 % of a chunk's
elements (12 B each); in a block whose fragile elements do not fit ("deferred"), they are left as they were
(torch's path: the whole block) and ``undo`` or ``commit`` updates them from that state. A kept speculative
update is bit-identical to the plain one.
"""
from __future__ import annotations

import os
import warnings

import torch

from . import kernels
from .optim import adamw_, adamw_undo_
from .system import OptimConfig

SUB = 1 << 20  # fallback: elements per fused call, so the widened fp32 gradient (4 MiB) stays in cache
BLOCK = 4096  # elements per block: the unit of deferral (kBlock in adamw.cpp); SUB is a multiple of it
FRAGILE = 64.0  # v_new > FRAGILE * v_old: the undo could not restore v closely (kFragile in adamw.cpp)
SAVE_FRACTION = 0.01  # at most this fraction of a chunk's elements saved by a speculative update (12 B each)
SAVE_MIN = BLOCK  # ... or this many, for small chunks
_NO_SHADOW = torch.empty(0, dtype=torch.bfloat16)  # adamw_step's "no bf16 shadow to write"
_EXT = None
_TRIED = False


def extension():
    """The compiled module, or None when it cannot be built here (and the choice allows a fallback). Loads a
    prebuilt file without compiling; otherwise builds it (child process, bounded) once per process."""
    global _EXT, _TRIED
    choice = os.environ.get("MEGATRAIN_HOST_ADAMW", "auto")
    if choice == "torch":
        return None
    if not _TRIED:
        _TRIED = True
        try:
            _EXT = kernels.load_built()
            if _EXT is None:
                kernels.build()
                _EXT = kernels.load_built()
        except Exception as exc:  # no compiler, no OpenMP, a timeout, an unloadable file, ...
            if choice == "cpp":
                raise
            warnings.warn(kernels.fallback_warning(exc), RuntimeWarning, stacklevel=2)
    if _EXT is None and choice == "cpp":
        raise RuntimeError("MEGATRAIN_HOST_ADAMW=cpp but the extension is not available")
    return _EXT


def name() -> str:
    """The host kernel in use, with the build's ISA and extra flags (they decide its speed): rows record it."""
    if extension() is None:
        return "torch-fused"
    return " ".join(["cpp-openmp", *kernels.isa_flags(), *kernels.extra_flags()])


class HostKernel:
    """Applies AdamW to host chunks: ``step(p, g, m, v, step_t, lr, coef)`` with g bf16 or fp32."""

    def __init__(self, cfg: OptimConfig, threads: int = 0):
        self.cfg = cfg
        self.ext = extension()
        self.threads = threads or max(1, torch.get_num_threads())
        self._g32 = None if self.ext is not None else torch.empty(SUB, dtype=torch.float32)
        # Speculative chunks that deferred blocks or saved elements: (address, numel) of the chunk's p ->
        # (one uint8 per block or None, saved indices int32, saved m and v [k, 2]). Worker thread only.
        self._pending: dict[tuple[int, int], tuple] = {}
        self.deferred_blocks = 0  # cumulative counts, for tests and stats
        self.saved_elements = 0

    def warm_up(self) -> None:
        """One parallel region of ``threads`` threads on scratch memory (the OpenMP team is created by the
        calling thread's first region; megatrain/host_adamw.py binds its threads after this)."""
        n = BLOCK * self.threads
        p, m, v = (torch.zeros(n) for _ in range(3))
        self.step(p, torch.zeros(n, dtype=torch.bfloat16), m, v, torch.ones(()), 0.0, 1.0)

    def _args(self, step_t, lr):
        cfg = self.cfg
        return lr, cfg.betas[0], cfg.betas[1], cfg.eps, cfg.weight_decay, float(step_t), self.threads

    def step(self, p, g, m, v, step_t: torch.Tensor, lr: float, coef: float, speculative: bool = False,
             shadow: torch.Tensor | None = None) -> bool:
        """Update with clip coefficient ``coef``; ``speculative`` (coefficient 1 only): to be resolved by
        ``undo`` or ``commit`` once the true coefficient is known. ``shadow``: p's bf16 copy, written in the
        same pass as p (its bits those of ``shadow.copy_(p)``); returns whether it was (a speculative update
        leaves it to the caller: its blocks may still change)."""
        if speculative:
            assert coef == 1.0, "a speculative update uses coefficient 1"
            flags = torch.zeros(-(-p.numel() // BLOCK), dtype=torch.uint8)
            cap = max(SAVE_MIN, int(p.numel() * SAVE_FRACTION))
            if self.ext is not None:
                count, idx, saved = self.ext.adamw_speculate(p, g, m, v, flags, cap, *self._args(step_t, lr))
            else:
                count, idx, saved = self._fallback_speculate(p, g, m, v, flags, cap, step_t, lr)
            key = (p.data_ptr(), p.numel())
            self._pending.pop(key, None)  # (an entry left by a failed step would be stale)
            if count or idx.numel():
                self._pending[key] = (flags if count else None, idx, saved)
                self.deferred_blocks += int(count)
                self.saved_elements += idx.numel()
            return False
        if self.ext is not None:
            cfg = self.cfg
            self.ext.adamw_step(p, g, m, v, coef, lr, cfg.betas[0], cfg.betas[1], cfg.eps, cfg.weight_decay,
                                float(step_t), self.threads, _NO_SHADOW if shadow is None else shadow)
            return shadow is not None
        scale = None if coef == 1.0 else torch.tensor(1.0 / coef, dtype=torch.float32)
        for s in range(0, g.numel(), SUB):
            gs = g[s:s + SUB]
            # bf16 from the slab is widened in cache; an fp32 gradient is copied too when scaled, because
            # the fused kernel divides the gradient by grad_scale in place (the caller's must stay intact).
            if gs.dtype != torch.float32 or scale is not None:
                gs = self._g32[:gs.numel()].copy_(gs)
            adamw_(p[s:s + SUB], gs, m[s:s + SUB], v[s:s + SUB], step_t, lr, self.cfg, scale)
            if shadow is not None:  # while the sub-chunk is in cache
                shadow[s:s + SUB].copy_(p[s:s + SUB])
        return shadow is not None

    def undo(self, p, g, m, v, step_t: torch.Tensor, lr: float, redo_coef: float | None) -> None:
        """Undo a speculative update (step count ``step_t`` after its increment); then, unless ``redo_coef``
        is None, apply the update with that clip coefficient instead. One pass over the chunk."""
        flags, idx, saved = self._pending.pop((p.data_ptr(), p.numel()), (None, _EMPTY_I, _EMPTY_F))
        if self.ext is not None:
            self.ext.adamw_resolve(p, g, m, v, _EMPTY_U8 if flags is None else flags, idx, saved,
                                   -1.0 if redo_coef is None else redo_coef, True, *self._args(step_t, lr))
            return
        for s in range(0, g.numel(), SUB):  # cache-sized pieces: the float64 temporaries stay small
            sl = slice(s, s + SUB)
            keep = _save_blocks((p[sl], m[sl], v[sl]), _blocks_in(flags, s, g[sl].numel()))
            adamw_undo_(p[sl], g[sl], m[sl], v[sl], float(step_t), lr, self.cfg)
            _restore_blocks(keep)  # never updated: nothing to undo
        if idx.numel():  # fragile elements: their exact moments
            i = idx.long()
            m.index_copy_(0, i, saved[:, 0].contiguous())
            v.index_copy_(0, i, saved[:, 1].contiguous())
        if redo_coef is not None:
            self.step(p, g, m, v, step_t, lr, redo_coef)

    def kept(self, p: torch.Tensor) -> bool:
        """The speculative updates of the chunks inside ``p`` stand (coefficient 1): forget what only an undo
        needed. True when some chunk deferred blocks: ``commit`` each chunk then."""
        lo = p.data_ptr()
        hi = lo + p.numel() * p.element_size()
        inside = [key for key in self._pending if lo <= key[0] < hi]
        deferred = False
        for key in inside:
            if self._pending[key][0] is None:
                del self._pending[key]
            else:
                deferred = True
        return deferred

    def commit(self, p, g, m, v, step_t: torch.Tensor, lr: float) -> None:
        """A speculative update stands (coefficient 1): apply the blocks it deferred."""
        flags = self._pending.pop((p.data_ptr(), p.numel()), (None,))[0]
        if flags is None:
            return
        if self.ext is not None:
            self.ext.adamw_resolve(p, g, m, v, flags, _EMPTY_I, _EMPTY_F, 1.0, False, *self._args(step_t, lr))
            return
        for b in flags.nonzero().flatten().tolist():
            sl = slice(b * BLOCK, (b + 1) * BLOCK)
            self.step(p[sl], g[sl], m[sl], v[sl], step_t, lr, 1.0)

    def _fallback_speculate(self, p, g, m, v, flags, cap: int, step_t, lr):
        """torch's kernel with the extension's rule: fragile elements saved while they fit under ``cap``, the
        blocks of a piece whose fragile elements do not fit saved whole and put back after the fused call
        (which cannot skip them)."""
        b2 = self.cfg.betas[1]
        idx, saved, used = [], [], 0
        for s in range(0, g.numel(), SUB):
            sl = slice(s, s + SUB)
            gs = self._g32[:g[sl].numel()].copy_(g[sl])
            ms, vs = m[sl], v[sl]
            if float(step_t) > 1:
                fragile = gs * gs > (FRAGILE - b2) / (1 - b2) * vs  # v_new > FRAGILE v_old, as adamw.cpp
            else:  # the moments are zeros: the undo restores them exactly
                fragile = torch.zeros_like(vs, dtype=torch.bool)
            n_frag = int(fragile.sum())
            keep = []
            if n_frag and used + n_frag <= cap:
                i = fragile.nonzero().flatten()
                idx.append((i + s).to(torch.int32))
                saved.append(torch.stack([ms[i], vs[i]], 1))
                used += n_frag
            elif n_frag:
                per_block = torch.nn.functional.pad(fragile, (0, -fragile.numel() % BLOCK)).view(-1, BLOCK).any(1)
                flags[s // BLOCK:s // BLOCK + per_block.numel()] = per_block.to(torch.uint8)
                keep = _save_blocks((p[sl], ms, vs), per_block.nonzero().flatten().tolist())
            adamw_(p[sl], gs, ms, vs, step_t, lr, self.cfg)
            _restore_blocks(keep)
        return (int(flags.sum()), torch.cat(idx) if idx else _EMPTY_I,
                torch.cat(saved) if saved else _EMPTY_F)


_EMPTY_U8 = torch.empty(0, dtype=torch.uint8)
_EMPTY_I = torch.empty(0, dtype=torch.int32)
_EMPTY_F = torch.empty(0, 2, dtype=torch.float32)


def bench_setup(n: int, allow_fallback: bool = False):
    """What the host-kernel benchmarks (scripts/bench_host_*.py) time: a HostKernel and ``n`` parameters of state
    (p random, m and v zero, a bf16 gradient ~1e-3), or a one-line reason when the kernel is torch's fallback,
    which the engine does not run on a GPU node (unless ``allow_fallback``, for tests)."""
    kernel = HostKernel(OptimConfig(lr=1e-4, weight_decay=0.1))
    if kernel.ext is None and not allow_fallback:
        return f"the C++ host kernel is not built here ({name()}): nothing the engine runs to measure"
    g = torch.randn(n).mul_(1e-3).to(torch.bfloat16)
    return kernel, (torch.randn(n), torch.zeros(n), torch.zeros(n), g)


def _blocks_in(flags, start: int, n: int) -> list[int]:
    """Indices (relative to ``start``, a multiple of BLOCK) of the deferred blocks among n elements."""
    if flags is None:
        return []
    b0 = start // BLOCK
    return (flags[b0:b0 + -(-n // BLOCK)].nonzero().flatten()).tolist()


def _save_blocks(tensors, blocks: list[int]):
    return [(t[b * BLOCK:(b + 1) * BLOCK], t[b * BLOCK:(b + 1) * BLOCK].clone()) for b in blocks for t in tensors]


def _restore_blocks(saved) -> None:
    for view, old in saved:
        view.copy_(old)
