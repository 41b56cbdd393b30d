"""PyTorch FSDP2 (``fully_shard``) with CPU offload of parameters, gradients and optimizer state.

Configured as the FSDP2 docs and torchtitan do for one big model: ``fully_shard`` on every decoder layer,
then on the root (embedding, final norm, LM head); ``CPUOffloadPolicy(pin_memory=True)`` keeps the fp32
sharded parameters (and so their gradients and the AdamW state) in pinned host memory, each unit being
all-gathered to the GPU for its forward and backward; ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``; HF activation checkpointing; ``torch.nn.utils.clip_grad_norm_`` (DTensor-aware)
and a CPU AdamW on the offloaded DTensor parameters: the fused CPU kernel where it runs on them,
else foreach (``self.info["optimizer"]`` says which). World size 1, process group created in-process
(nccl on CUDA, gloo on CPU).

CPU (CI parity) path: ``fully_shard`` on a CPU mesh with gloo, fp32, no offload policy (offloading to
the CPU from the CPU is meaningless; the policy's pinned-memory and D2H/H2D copies need CUDA).
"""
from __future__ import annotations

import torch

from megatrain.system import StepResult, lr_multiplier

from .common import (COMMON_OPTIONS, BaselineSystem, CausalLMLoss, build_guarded,
                     enable_activation_checkpointing, ensure_process_group, load_hf_model, prepare_step)

OPTIONS = dict(
    COMMON_OPTIONS,
    reshard_after_forward=True,  # free each decoder layer's gathered weights after its forward (ZeRO-3)
    cpu_offload=None,  # None: on for CUDA; the CPU path never offloads
    optimizer="auto",  # "auto" (fused CPU AdamW if it runs on the DTensor params, else foreach), "fused", "foreach"
)


def probe_fused_adamw(mesh, device_type: str) -> bool:
    """Does torch's fused AdamW step run on DTensor parameters living on ``device_type``?"""
    from torch.distributed.tensor import Shard, distribute_tensor

    try:
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(8), mesh, [Shard(0)]))
        if device_type != mesh.device_type:
            p = torch.nn.Parameter(p.to(device_type))
        p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        opt.step()
        return bool(torch.isfinite(p.to_local()).all())
    except Exception:
        return False


class FSDPSystem(BaselineSystem):
    name = "fsdp"

    OPTIONS = OPTIONS
    CHOICES = {"optimizer": ("auto", "fused", "foreach")}

    def _build(self, init_dir, opts, dtype, activation_checkpointing) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        on_cuda = self.device.type == "cuda"
        offload = on_cuda if opts["cpu_offload"] is None else (bool(opts["cpu_offload"]) and on_cuda)
        # With CPU offload the gradients (and so clip_grad_norm_'s partial norms) are CPU DTensors: their
        # collectives need a CPU-capable backend next to NCCL (pytorch/pytorch#148532).
        backend = ("cpu:gloo,cuda:nccl" if offload else "nccl") if on_cuda else "gloo"
        self._owns_process_group = ensure_process_group(backend, self.device)
        mesh = init_device_mesh(self.device.type, (1,))
        kwargs = {"mesh": mesh}
        compute = torch.float32
        if on_cuda and dtype != torch.float32:
            compute = dtype
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)

        lm = load_hf_model(init_dir, opts["attn_implementation"])  # fp32 on CPU
        if activation_checkpointing:
            enable_activation_checkpointing(lm)
        model = CausalLMLoss(lm, opts["loss_chunk_tokens"])
        for layer in lm.model.layers:
            fully_shard(layer, reshard_after_forward=bool(opts["reshard_after_forward"]), **kwargs)
        # Root: embedding, final norm, LM head (tied or not), rotary buffers. reshard_after_forward left at
        # its default, under which FSDP2 keeps the root gathered from forward into backward (its weights
        # are needed again at once); passing True would free and re-gather them every step.
        fully_shard(model, **kwargs)
        self.model = model

        params = list(model.parameters())
        param_device = "cpu" if (offload or not on_cuda) else self.device.type
        impl = opts["optimizer"]
        if impl == "auto":
            impl = "fused" if probe_fused_adamw(mesh, param_device) else "foreach"
        o = self.optim
        akw = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        if impl == "fused":
            self.optimizer = torch.optim.AdamW(params, fused=True, **akw)
        else:
            self.optimizer = torch.optim.AdamW(params, foreach=True, **akw)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_multiplier(s, o.warmup_steps, o.total_steps, o.min_lr_ratio))
        self.info.update(system=self.name, optimizer=f"torch.AdamW({impl})", optimizer_device=param_device,
                         settings={"cpu_offload": offload, "reshard_after_forward": bool(opts["reshard_after_forward"]),
                                   "optimizer": impl, "activation_checkpointing": bool(activation_checkpointing)},
                         cpu_offload=offload, compute_dtype=str(compute).replace("torch.", ""),
                         reshard_after_forward=bool(opts["reshard_after_forward"]),
                         activation_checkpointing=bool(activation_checkpointing), options=opts)

    def _step(self, batch, t0) -> StepResult:
        mbs, denom, tokens = prepare_step(batch, self.micro_batches, self.device)
        lr = self.scheduler.get_last_lr()[0]
        total = None
        for mb in mbs:
            loss = self.model(**mb.inputs, denom=denom)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return self._clip_and_update(total, tokens, lr, t0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named fp32 weights gathered to CPU (for parity tests; small models only)."""
        out = {}
        for name, param in self.model.lm.named_parameters(remove_duplicate=False):
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            out[name] = full.detach().float().cpu().clone()
        return out


def build(**kwargs) -> FSDPSystem:
    return build_guarded(FSDPSystem, FSDPSystem.name, **kwargs)
