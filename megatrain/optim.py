"""AdamW on the CPU over the host store's flat fp32 tensors, one fused call per group.

The update of step n can run in a background thread while step n+1 starts: groups are updated in the
order the next forward needs them (embed, layer 0..L-1, final) and each sets an event; the next step's
load of a group waits for that group's event only (pipelined update -> forward).
"""
from __future__ import annotations

import math
import threading
import time

import torch

from .host_store import HostStore
from .system import OptimConfig

CHUNK = 1 << 22  # elements per fused AdamW call (16 MiB of fp32)


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), clamped to 1."""
    if max_norm is None or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


class HostAdamW:
    def __init__(self, store: HostStore, cfg: OptimConfig, order: list[str]):
        self.store = store
        self.cfg = cfg
        self.order = order
        self._done = {name: threading.Event() for name in order}
        for ev in self._done.values():
            ev.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_update_s = 0.0
        self.wait_s = 0.0  # cumulative time callers spent blocked in wait_group

    def launch(self, step: int, clip_coef: float, background: bool) -> None:
        """Update every group with the LR of 0-based ``step``; returns at once if ``background``."""
        self.wait_all()
        for ev in self._done.values():
            ev.clear()
        lr = self.cfg.lr_at(step)
        if background:
            self._thread = threading.Thread(target=self._run, args=(lr, clip_coef), name="megatrain-adamw",
                                            daemon=True)
            self._thread.start()
        else:
            self._run(lr, clip_coef)
            self._raise_if_failed()

    def wait_group(self, name: str) -> None:
        """Block until ``name``'s update of the last launched step is done."""
        if not self._done[name].is_set():
            t0 = time.perf_counter()
            self._done[name].wait()
            self.wait_s += time.perf_counter() - t0
        self._raise_if_failed()

    def wait_all(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("CPU optimizer failed") from err

    def _run(self, lr: float, clip_coef: float) -> None:
        t0 = time.perf_counter()
        try:
            for name in self.order:
                self._update(name, lr, clip_coef)
                self.store.refresh_shadow(name)
                self._done[name].set()
        except BaseException as exc:
            self._error = exc
        finally:
            for ev in self._done.values():  # never leave a waiter hanging; the error is re-raised
                ev.set()
            self.last_update_s = time.perf_counter() - t0

    def _update(self, name: str, lr: float, clip_coef: float) -> None:
        st = self.store
        step = st.steps[name]
        step.add_(1)  # the fused kernel expects the already-incremented count (as torch.optim does)
        b1, b2 = self.cfg.betas
        # Clipping folded into the kernel: it divides the gradient by grad_scale (no extra pass).
        scale = None if clip_coef == 1.0 else torch.tensor(1.0 / clip_coef, dtype=torch.float32)
        p, g, m, v = st.master[name], st.grad[name], st.m[name], st.v[name]
        # Chunks that stay in cache: a bf16 gradient is widened one chunk at a time, never as a whole.
        for s in range(0, p.numel(), CHUNK):
            gs = g[s:s + CHUNK]
            if gs.dtype != torch.float32:
                gs = gs.float()
            torch._fused_adamw_([p[s:s + CHUNK]], [gs], [m[s:s + CHUNK]], [v[s:s + CHUNK]], [], [step], lr=lr,
                                beta1=b1, beta2=b2, weight_decay=self.cfg.weight_decay, eps=self.cfg.eps,
                                amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)


def global_norm(sqnorms: dict[str, float]) -> float:
    return math.sqrt(sum(sqnorms.values()))
