"""Plain PyTorch: the whole HF model, its gradients and AdamW state on the device.

The upper bound on speed where the model fits, and the CPU parity reference. On CUDA: fp32 parameters
and optimizer state, bf16 autocast for compute, ``torch.optim.AdamW(fused=True)``, HF gradient
checkpointing (non-reentrant) when ``activation_checkpointing``. On CPU: fp32 throughout, no autocast,
torch's default (foreach) AdamW.
"""
from __future__ import annotations

import contextlib

import torch

from megatrain.system import StepResult, lr_multiplier

from .common import (COMMON_OPTIONS, BaselineSystem, CausalLMLoss, build_guarded,
                     enable_activation_checkpointing, load_hf_model, prepare_step)

OPTIONS = dict(COMMON_OPTIONS, fused_adamw=None)  # fused_adamw: None = fused on CUDA, foreach on CPU


class NativeSystem(BaselineSystem):
    name = "native"

    OPTIONS = OPTIONS

    def _build(self, init_dir, opts, dtype, activation_checkpointing) -> None:
        optim = self.optim
        on_cuda = self.device.type == "cuda"
        self.autocast_dtype = dtype if (on_cuda and dtype != torch.float32) else None
        lm = load_hf_model(init_dir, opts["attn_implementation"])
        if activation_checkpointing:
            enable_activation_checkpointing(lm)
        self.model = CausalLMLoss(lm, opts["loss_chunk_tokens"]).to(self.device)
        fused = on_cuda if opts["fused_adamw"] is None else bool(opts["fused_adamw"])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                           eps=optim.eps, weight_decay=optim.weight_decay,
                                           **({"fused": True} if fused else {"foreach": True}))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_multiplier(s, optim.warmup_steps, optim.total_steps, optim.min_lr_ratio))
        self.info.update(system=self.name, optimizer="torch.AdamW(fused)" if fused else "torch.AdamW(foreach)",
                         settings={"fused_adamw": fused, "activation_checkpointing": bool(activation_checkpointing)},
                         compute_dtype=str(self.autocast_dtype or torch.float32).replace("torch.", ""),
                         activation_checkpointing=bool(activation_checkpointing), options=opts)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _step(self, batch, t0) -> StepResult:
        mbs, denom, tokens = prepare_step(batch, self.micro_batches, self.device)
        lr = self.scheduler.get_last_lr()[0]
        total = None
        for mb in mbs:
            with self._autocast():
                loss = self.model(**mb.inputs, denom=denom)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return self._clip_and_update(total, tokens, lr, t0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named fp32 weights (CPU copies), for parity tests."""
        return {k: v.detach().float().cpu().clone() for k, v in self.model.lm.state_dict().items()}


def build(**kwargs) -> NativeSystem:
    return build_guarded(NativeSystem, NativeSystem.name, **kwargs)
