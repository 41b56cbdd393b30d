"""AdamW of the GPU tier: fused, on the device, after the step's global norm is known.

The gradients never leave the GPU; the update is queued on the compute stream right after the backward
(milliseconds for billions of parameters), with the same clip coefficient, LR, weight decay and step
count as the host tier. On a CPU run the same code runs on CPU tensors, so CI exercises the tier logic.
"""
from __future__ import annotations

import torch

from .optim import adamw_
from .store import ModelStore
from .streams import StreamSet
from .system import OptimConfig


class DeviceAdamW:
    def __init__(self, store: ModelStore, cfg: OptimConfig, names: list[str], streams: StreamSet):
        self.store, self.cfg, self.names, self.streams = store, cfg, list(names), streams
        self._grads: dict[str, torch.Tensor] = {}
        self._updated = None  # event on the compute stream after the last update was queued

    def begin_step(self, step: int, speculate: bool) -> None:
        self._grads = {}

    def grad_ready(self, name: str, flat: torch.Tensor, sqnorm: torch.Tensor, ready) -> None:
        self._grads[name] = flat  # stays on the device; consumed by ``finish``

    def finish(self, step: int, coef: float | None) -> None:
        grads, self._grads = self._grads, {}
        if coef is not None:
            st, lr = self.store, self.cfg.lr_at(step)
            # One scale tensor for all groups (one tiny host-to-device copy per step, not per group).
            scale = None
            if coef != 1.0 and self.names:
                scale = torch.tensor(1.0 / coef, dtype=torch.float32, device=st.master[self.names[0]].device)
            for name in self.names:
                st.steps[name].add_(1)  # the fused kernel expects the already-incremented count
                g = grads.pop(name, None)
                if g is None:
                    raise RuntimeError(f"no gradient for GPU-tier group {name} at the end of the step")
                adamw_(st.master[name], g if g.dtype == torch.float32 else g.float(), st.m[name], st.v[name],
                       st.steps[name], lr, self.cfg, scale)
                st.refresh_shadow(name)  # a CPU run's GPU tier is on the CPU and streams a bf16 shadow too
                del g  # the widened copy and the gradient go back to the allocator, one group at a time
        # The next loads of these groups (casts on the H2D stream) must see the updated master.
        self._updated = self.streams.record(self.streams.compute)

    def wait_group(self, name: str):
        return self._updated

    def wait_all(self) -> None:
        pass  # device work: ordered by streams; the engine synchronizes the device where it must

    def close(self) -> None:
        self._grads = {}
