"""How the engine computes: the dtype of its GPU weight buffers and hidden states, and the autocast region
(if any) that layers and the loss head run in. Chosen once at build from ``EngineConfig.compute_dtype``;
the step only enters ``policy.region()`` around each layer and the loss head (docs/autocast_mode.md).

- "fp32" / "bf16" / "fp16" (``plain``): weights are cast to that dtype in the slots, every layer computes
  wholly in it, hidden states between layers are in it (the engine's original arithmetic).
- "bf16-autocast" (``autocast``): HF's mixed precision as all-on-GPU training runs it (fp32 model under
  ``torch.autocast(bfloat16)``): slots, resident buffers and hidden states stay fp32, and autocast casts
  only the inputs of the ops on its lower-precision list (matmuls: Linear weights and activations) to
  bf16; RMSNorm, the residual stream, the embedding output and the rotary tables stay fp32.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

AUTOCAST_DTYPES = {"bf16-autocast": torch.bfloat16}  # config.AUTOCAST_MODES -> autocast dtype


@dataclass(frozen=True)
class ComputePolicy:
    """``buffers``: dtype of the slots, resident buffers, hidden states and the layers' gradients;
    ``autocast``: the dtype autocast computes in, or None (no autocast region)."""

    buffers: torch.dtype
    autocast: torch.dtype | None = None
    device_type: str = "cpu"

    @property
    def name(self) -> str:
        if self.autocast is None:
            return str(self.buffers).replace("torch.", "")
        return f"{str(self.autocast).replace('torch.', '')}-autocast"

    def region(self):
        """The context a layer's forward (and recompute) and the loss head run in."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast)


def make_policy(cfg, device: torch.device) -> ComputePolicy:
    """The policy of ``cfg.compute_dtype`` ("auto", a dtype name, or an autocast mode) on ``device``."""
    # resolved_compute_dtype: fp32 in an autocast mode (weights stay fp32 on the GPU side; autocast casts the
    # ones it computes in bf16 at each use).
    return ComputePolicy(cfg.resolved_compute_dtype(), AUTOCAST_DTYPES.get(cfg.compute_dtype), device.type)
