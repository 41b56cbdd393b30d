"""Plain PyTorch: the whole HF model, its gradients and AdamW state on the device.

The upper bound on speed where the model fits, and the CPU parity reference. On CUDA: fp32 parameters
and optimizer state, bf16 autocast for compute, ``torch.optim.AdamW(fused=True)``, HF gradient
checkpointing (non-reentrant) when ``activation_checkpointing``. On CPU: fp32 throughout, no autocast,
torch's default (foreach) AdamW.

``options["auto_config"]`` (True, False, or "cuda" = on for CUDA only; the sweeps' ``conf/system/native.yaml``
sets "cuda"): before training, pick the fastest configuration that fits the step (with or without HF
checkpointing, and the micro-batch split, never fewer micro-batches than the run asks for) by a short probe at learning rate 0 (``baselines/autoconfig.py``);
the row's ``settings`` say which won (``activation_checkpointing``, ``micro_batches``) and list every
candidate tried with its step time or its out-of-memory. False keeps the run's own settings (the
behaviour before issue 24).
"""
from __future__ import annotations

import contextlib
import time

import torch

from megatrain.system import StepResult, lr_multiplier

from .common import (COMMON_OPTIONS, BaselineSystem, CausalLMLoss, build_guarded, clip_norm,
                     enable_activation_checkpointing, load_hf_model, prepare_step)

OPTIONS = dict(
    COMMON_OPTIONS,
    fused_adamw=None,  # None = fused on CUDA, foreach on CPU
    auto_config=False,  # True | False | "cuda": probe the best checkpointing / micro-batch split first
    probe_steps=2,  # auto_config: steps per candidate (the last one is timed)
    auto_micro_batches=None,  # auto_config: micro-batch counts to try (None: the run's micro_batches, then
    #                           twice that, ... up to the rows: an asked-for split is a floor)
)


class NativeSystem(BaselineSystem):
    name = "native"

    OPTIONS = OPTIONS
    CHOICES = {"auto_config": (True, False, "cuda")}

    def __init__(self, *, step_shape: tuple[int, int] | None = None, **kwargs):
        self.step_shape = tuple(step_shape) if step_shape else None
        self._auto_pending = False
        super().__init__(**kwargs)

    def _build(self, init_dir, opts, dtype, activation_checkpointing) -> None:
        optim = self.optim
        on_cuda = self.device.type == "cuda"
        self.autocast_dtype = dtype if (on_cuda and dtype != torch.float32) else None
        lm = load_hf_model(init_dir, opts["attn_implementation"])
        self.activation_checkpointing = bool(activation_checkpointing)
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
        self._auto_opts = opts
        auto = opts["auto_config"]
        if auto is True or (auto == "cuda" and on_cuda):
            if self.step_shape:
                self._auto_configure(*self.step_shape)
            else:  # built outside the runner: probe on the first batch's shape
                self._auto_pending = True

    # -- the best configuration (baselines/autoconfig.py) ------------------------------------------
    def _auto_configure(self, rows: int, seq: int) -> None:
        from .autoconfig import choose_config

        opts = self._auto_opts
        before = {"activation_checkpointing": self.activation_checkpointing, "micro_batches": self.micro_batches}
        record = choose_config(self, rows, seq, self.model.lm.config.vocab_size, steps=int(opts["probe_steps"]),
                               micro_batches=opts["auto_micro_batches"], least=self.micro_batches)
        record["requested"] = before
        self.info["auto_config"] = record
        self.info["activation_checkpointing"] = self.activation_checkpointing
        self.info["micro_batches"] = self.micro_batches
        self.info["settings"].update(activation_checkpointing=self.activation_checkpointing,
                                     micro_batches=self.micro_batches,
                                     auto_config={c["key"]: (round(c["step_s"], 4) if c["status"] == "ok"
                                                             else c["status"])
                                                  for c in record["candidates"]} | {"winner": record["winner"]})

    def set_activation_checkpointing(self, on: bool) -> None:
        """HF's per-layer checkpointing on or off (the auto-config probe switches it between candidates)."""
        lm = self.model.lm
        if on:
            enable_activation_checkpointing(lm)
        elif hasattr(lm, "activation_checkpointing_disable"):
            lm.activation_checkpointing_disable()
        else:
            lm.gradient_checkpointing_disable()
        self.activation_checkpointing = bool(on)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _step(self, batch, t0) -> StepResult:
        if self._auto_pending:
            self._auto_pending = False
            self._auto_configure(*batch["input_ids"].shape)
            t0 = time.perf_counter()  # the step's time excludes the probe
        return self.train_step(batch, t0)

    def train_step(self, batch, t0: float | None = None, *, probe: bool = False) -> StepResult | None:
        """One step. ``probe``: the auto-config probe's step (clip + AdamW, no LR schedule step, no result)."""
        mbs, denom, tokens = prepare_step(batch, self.micro_batches, self.device)
        lr = self.scheduler.get_last_lr()[0]
        total = None
        for mb in mbs:
            with self._autocast():
                loss = self.model(**mb.inputs, denom=denom)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        if probe:
            max_norm = clip_norm(self.optim)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm if max_norm else float("inf"))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            float(total)  # the loss on the host, as a real step's result would need
            return None
        return self._clip_and_update(total, tokens, lr, t0 if t0 is not None else time.perf_counter())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named fp32 weights (CPU copies), for parity tests."""
        return {k: v.detach().float().cpu().clone() for k, v in self.model.lm.state_dict().items()}


def build(*, step_shape: tuple[int, int] | None = None, **kwargs) -> NativeSystem:
    """``step_shape`` (rows, seq): the shape the auto-config probe measures (the runner passes it)."""
    return build_guarded(NativeSystem, NativeSystem.name, step_shape=step_shape, **kwargs)
