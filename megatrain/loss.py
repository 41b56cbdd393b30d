"""Final norm + LM head + cross-entropy, forward and backward in token chunks.

Full logits ([tokens x vocab], 10 GB in fp32 at 16K tokens x 152K vocab) never exist: each chunk's
logits are made, reduced to a loss and differentiated before the next chunk starts. Returns the loss
sum (already divided by the step's labelled-token count), d(hidden), and the weight gradients.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .system import IGNORE_INDEX


def chunked_lm_loss(hidden: torch.Tensor, targets: torch.Tensor, norm: nn.Module, head_weight: torch.Tensor,
                    denom: int, chunk_tokens: int):
    """hidden [B, S, h] (no grad), targets [B, S] already shifted (IGNORE_INDEX = no loss).

    ``norm``'s weight and ``head_weight`` must be leaves with requires_grad. Returns
    (loss: 0-dim fp32 tensor, d_hidden like hidden, d_norm_weight fp32, d_head_weight fp32).
    """
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    d_hidden = torch.empty_like(flat_h)
    d_norm = torch.zeros_like(norm.weight, dtype=torch.float32)
    d_head = torch.zeros_like(head_weight, dtype=torch.float32)
    loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
    for start in range(0, flat_h.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, flat_h.shape[0])
        h = flat_h[start:end].detach().requires_grad_(True)
        t = flat_t[start:end]
        with torch.enable_grad():
            logits = F.linear(norm(h), head_weight).float()
            chunk_loss = F.cross_entropy(logits, t, ignore_index=IGNORE_INDEX, reduction="sum") / denom
            gh, gn, gw = torch.autograd.grad(chunk_loss, [h, norm.weight, head_weight])
        d_hidden[start:end] = gh
        d_norm += gn
        d_head += gw
        loss += chunk_loss.detach()
    return loss, d_hidden.view_as(hidden), d_norm, d_head
