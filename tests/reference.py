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


def reference_train(model, batches, optim, micro_batches: int, *, stream_dtype: torch.dtype | None = None,
                    grad_norms: list | None = None, autocast: torch.dtype | None = None):
    """Returns per-step losses (mean token CE over the step) and the final state dict.

    ``stream_dtype`` (e.g. torch.bfloat16): mixed precision as a bf16 weight stream does it. The fp32
    weights are the master that AdamW updates; each step's forward and backward run in fp32 on a copy
    of the master rounded to ``stream_dtype`` (rounded once per step, after the previous update), and
    the gradients taken at the rounded weights update the master. ``grad_norms``: if given, each step's
    global gradient norm (before clipping) is appended to it. ``autocast`` (e.g. torch.bfloat16): each
    forward and its loss run under ``torch.autocast("cpu", autocast)`` with the fp32 weights, as HF mixed
    precision does (and baselines/native.py on a GPU)."""
    params = list(model.parameters())
    if stream_dtype is not None:
        # The master lives apart from the model; the model's parameters hold the rounded compute copy.
        master = [torch.nn.Parameter(p.detach().clone()) for p in params]
    else:
        master = params
    opt = torch.optim.AdamW(master, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_multiplier(s, optim.warmup_steps, optim.total_steps, optim.min_lr_ratio))
    losses = []
    for batch in batches:
        if stream_dtype is not None:
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m.to(stream_dtype))  # round to the stream dtype, back to fp32 in the copy
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
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                logits = model(**kwargs).logits.float()
                loss = F.cross_entropy(logits.flatten(0, 1), targets[idx].flatten(), ignore_index=IGNORE_INDEX,
                                       reduction="sum") / denom
            loss.backward()
            total += loss.item()
        if stream_dtype is not None:
            for p, m in zip(params, master):
                m.grad, p.grad = p.grad, None
        grads = [p.grad for p in master if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if grad_norms is not None:
            grad_norms.append(float(norm))
        if optim.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(master, optim.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    if stream_dtype is not None:  # the state is the master, as the engine's state_dict() is
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def weight_rel_diffs(final: dict, ref: dict) -> dict[str, float]:
    """Per-tensor relative L2 difference of ``final`` against ``ref`` (every tensor of ``ref``).

    k_proj biases are skipped: softmax is invariant to a per-query constant, so d loss / d k_bias is exactly
    0 in exact arithmetic; both sides see ~1e-10 rounding noise that AdamW (m / sqrt(v)) turns into lr-sized
    random steps, nothing to compare but noise. Relative in norm per tensor, not elementwise: AdamW divides
    by sqrt(v), so elements whose gradient is ~0 move by lr-sized steps set by rounding noise, and an
    elementwise rtol on near-zero weights would test noise."""
    out = {}
    for name, ref_value in ref.items():
        if name.endswith("k_proj.bias"):
            continue
        assert name in final, f"{name} missing"
        out[name] = float((final[name] - ref_value).norm() / ref_value.norm())
    return out
