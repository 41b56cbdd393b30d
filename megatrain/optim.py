"""AdamW for both tiers behind one interface, and the math they share.

A step's optimizer work is driven by the engine through ``Optimizers``:

    begin_step(step)                        the speculation decision for this step
    grad_ready(name, flat, sqnorm, ready)   a group's final gradient exists on the GPU (backward order)
    finish(step, grad_norm)                 the global norm is known: clip coefficient, or skip if not finite
    wait_group(name)                        before a group's weights are read again (next forward)

Each group belongs to one implementation (its tier): ``DeviceAdamW`` (GPU tier, megatrain/device_adamw.py)
updates after the norm with a fused kernel on the device; ``HostAdamW`` (host tier, megatrain/host_adamw.py)
updates in a worker thread, speculatively during the backward when the policy allows.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch

from .system import OptimConfig


class GroupOptimizer(Protocol):
    names: list[str]

    def begin_step(self, step: int, speculate: bool) -> None: ...

    def grad_ready(self, name: str, flat: torch.Tensor, sqnorm: torch.Tensor, ready) -> None: ...

    def finish(self, step: int, coef: float | None) -> None: ...

    def wait_group(self, name: str): ...  # returns a device event the next load must wait on, or None

    # Optional: ``device_source(name)`` -> the group's updated master already on the GPU (the next load casts
    # it instead of copying from host RAM), or None. Implementations without it have none.

    def wait_all(self) -> None: ...

    def close(self) -> None: ...


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), clamped to 1."""
    if max_norm is None or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def adamw_(p, g, m, v, step_t, lr: float, cfg: OptimConfig, grad_scale=None) -> None:
    """One fused AdamW update of flat fp32 ``p, m, v`` with fp32 gradient ``g`` (all on one device).
    ``step_t`` is the already-incremented step count (as torch.optim passes it); ``grad_scale`` divides
    the gradient inside the kernel (clipping folded in, no extra pass)."""
    b1, b2 = cfg.betas
    torch._fused_adamw_([p], [g], [m], [v], [], [step_t], lr=lr, beta1=b1, beta2=b2,
                        weight_decay=cfg.weight_decay, eps=cfg.eps, amsgrad=False, maximize=False,
                        grad_scale=grad_scale, found_inf=None)


def adamw_undo_(p, g, m, v, step: float, lr: float, cfg: OptimConfig) -> None:
    """Invert ``adamw_`` (unscaled gradient ``g``, step count ``step`` after the increment), in float64.

    AdamW is invertible given the gradient: p_mid = p + lr/bc1 · m/(sqrt(v)/sqrt(bc2) + eps) undoes the
    step, p_mid / (1 - lr·wd) the decoupled decay, (m - (1-b1)·g)/b1 and (v - (1-b2)·g²)/b2 the moments.
    At step 1 the moments were zeros, restored exactly. float64 keeps the rounding of the round trip far
    below fp32's; the result is the previous state to within fp32 rounding, not bit for bit."""
    b1, b2 = cfg.betas
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    pd, md, vd = p.double(), m.double(), v.double()
    denom = vd.sqrt().div_(math.sqrt(bc2)).add_(cfg.eps)
    pd.addcdiv_(md, denom, value=lr / bc1)
    if cfg.weight_decay:
        pd.div_(1 - lr * cfg.weight_decay)
    p.copy_(pd)
    if step <= 1:
        m.zero_()
        v.zero_()
        return
    gd = g.double()
    m_old = (md - gd * (1 - b1)).div_(b1)
    v_old = vd.addcmul(gd, gd, value=-(1 - b2)).div_(b2)
    # Elements whose moments were zero (e.g. embedding rows never seen before) come back as rounding
    # residue of the fp32 update; a residue in m over a ~0 v would turn into an lr-sized step later, so
    # moments indistinguishable from zero at fp32 precision (both below 2^-18 of the new ones) are zero.
    zero = (v_old.abs() <= vd * 2.0**-18) & (m_old.abs() <= md.abs() * 2.0**-18)
    m.copy_(m_old.masked_fill_(zero, 0.0))
    v.copy_(v_old.masked_fill_(zero, 0.0).clamp_(min=0))


class SpeculationPolicy:
    """Whether the host tier updates early (clip coefficient 1) this step. Speculation pays only when
    clipping does not fire: "auto" speculates while the previous step did not clip (never on the first
    step, whose norm is unknown); with clipping off it always speculates (only a non-finite norm can
    undo it)."""

    def __init__(self, mode: str, max_norm: float | None):
        self.mode, self.max_norm = mode, max_norm
        self.prev_clipped: bool | None = None

    def decide(self) -> bool:
        if self.mode != "auto":
            return self.mode == "always"
        if self.max_norm is None or self.max_norm <= 0:
            return True
        return self.prev_clipped is False

    def observe(self, grad_norm: float) -> None:
        self.prev_clipped = not math.isfinite(grad_norm) or clip_coefficient(grad_norm, self.max_norm) < 1.0


class Optimizers:
    """Routes each group's gradient to its tier's optimizer and turns the global norm into one clip
    coefficient for all of them (or a skipped step when it is not finite)."""

    def __init__(self, impls: list[GroupOptimizer], cfg: OptimConfig, speculate: str):
        self.impls = impls
        self.cfg = cfg
        self.by_group = {name: impl for impl in impls for name in impl.names}
        self.policy = SpeculationPolicy(speculate, cfg.max_grad_norm)
        self.speculating = False

    def begin_step(self, step: int) -> None:
        self.speculating = self.policy.decide()
        for impl in self.impls:
            impl.begin_step(step, self.speculating)

    def grad_ready(self, name: str, flat: torch.Tensor, sqnorm: torch.Tensor, ready) -> None:
        self.by_group[name].grad_ready(name, flat, sqnorm, ready)

    def finish(self, step: int, grad_norm: float) -> float | None:
        """Apply the step's update everywhere; returns the clip coefficient, None if the step is skipped."""
        coef = clip_coefficient(grad_norm, self.cfg.max_grad_norm) if math.isfinite(grad_norm) else None
        self.policy.observe(grad_norm)
        for impl in self.impls:
            impl.finish(step, coef)
        return coef

    def abort(self, step: int) -> None:
        """A step failed part-way: undo whatever was applied early, as for a skipped step."""
        for impl in self.impls:
            impl.finish(step, None)

    def wait_group(self, name: str):
        return self.by_group[name].wait_group(name)

    def device_source(self, name: str):
        """``name``'s updated master on the GPU for its next load, or None (load from its store)."""
        source = getattr(self.by_group[name], "device_source", None)
        return source(name) if source is not None else None

    def wait_all(self) -> None:
        for impl in self.impls:
            impl.wait_all()

    def close(self) -> None:
        for impl in self.impls:
            impl.close()
