"""Plain PyTorch reference training loop: the HF model, torch.optim.AdamW, clip_grad_norm_, LambdaLR.

Written independently of the engine (no megatrain code but the shared loss convention), so parity with
it means the engine computes the same training, not merely something self-consistent.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from megatrain.system import IGNORE_INDEX, lr_multiplier


def reference_model(hf_config, state_dict):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=hf_config._attn_implementation)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" for k in missing), missing  # tied head shares the embedding
    model.train()
    return model


def reference_train(model, batches, optim, micro_batches: int):
    """Returns per-step losses (mean token CE over the step) and the final state dict."""
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_multiplier(s, optim.warmup_steps, optim.total_steps, optim.min_lr_ratio))
    losses = []
    for batch in batches:
        labels = batch.get("labels", batch["input_ids"])
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
        denom = int((targets != IGNORE_INDEX).sum())
        total = 0.0
        for idx in torch.tensor_split(torch.arange(labels.shape[0]), micro_batches):
            kwargs = {"input_ids": batch["input_ids"][idx]}
            if batch.get("attention_mask") is not None:
                kwargs["attention_mask"] = batch["attention_mask"][idx]
            if batch.get("position_ids") is not None:
                kwargs["position_ids"] = batch["position_ids"][idx]
            logits = model(**kwargs).logits.float()
            loss = F.cross_entropy(logits.flatten(0, 1), targets[idx].flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum") / denom
            loss.backward()
            total += loss.item()
        if optim.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
