"""How the engine computes: the dtype of its GPU weight buffers and hidden states, and the autocast region
(if any) that layers and the loss head run in. Chosen once at build from ``EngineConfig.compute_dtype`` and
``EngineConfig.mixed_precision``; the step only enters ``policy.region()`` around each layer's forward
and recompute and around the loss head (docs/autocast_mode.md).

- ``mixed_precision="layer"`` (or an fp32 compute dtype): weights are cast to the compute dtype in the slots,
  every layer computes wholly in it, hidden states between layers are in it (the engine's own arithmetic).
- ``mixed_precision="autocast"`` with a bf16 (fp16) compute dtype: HF's mixed precision as all-on-GPU
  training runs it (fp32 model under ``torch.autocast(bfloat16)``): slots, resident buffers and hidden
  states stay fp32, and autocast casts only the inputs of the ops on its lower-precision list (matmuls:
  Linear weights and activations) to bf16; RMSNorm, the residual stream, the embedding output and the
  rotary tables stay fp32.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ComputePolicy:
    """``buffers``: dtype of the slots, resident buffers, hidden states and the layers' gradients;
    ``autocast``: the dtype autocast computes in, or None (no autocast region)."""

    buffers: torch.dtype
    autocast: torch.dtype | None = None
    device_type: str = "cpu"

    def region(self):
        """The context a layer's forward (and recompute) and the loss head run in."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast)


def make_policy(cfg, device: torch.device) -> ComputePolicy:
    """The policy of ``cfg.compute_dtype`` and ``cfg.mixed_precision`` on ``device``."""
    compute = cfg.resolved_compute_dtype()
    autocast = compute if (cfg.mixed_precision == "autocast" and compute != torch.float32) else None
    return ComputePolicy(cfg.resolved_buffer_dtype(), autocast, device.type)
