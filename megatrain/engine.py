"""The MegaTrain engine: host RAM is the home of the model, the GPU a transient compute engine.

    engine = MegaTrain.from_config(hf_config, EngineConfig(...))     # or .from_pretrained(dir)
    result = engine.step({"input_ids": ids, "labels": labels})       # forward, backward, AdamW
    engine.save(dir); engine = MegaTrain.load(dir)                   # resume with optimizer state

One step reads top to bottom (see ``step``): forward through streamed layers keeping block-boundary
activations, chunked loss, backward block by block with recompute, gradients out to the host, then the
CPU AdamW (overlapped with the next step when ``overlap_optimizer``).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import arch, checkpoint, memory
from .boundaries import HostBuffers, make_boundaries
from .config import EngineConfig
from .grad_offload import GradOffloader
from .host_store import HostStore, make_groups, views
from .loss import chunked_lm_loss
from .optim import HostAdamW, clip_coefficient, global_norm
from .slots import SlotPool
from .spec import with_positions
from .streams import StreamSet
from .system import IGNORE_INDEX, MemoryStats, StepResult, labels_from_batch, shift_labels, split_micro_batches
from .validate import validate_batch


@dataclass
class _MicroBatch:
    ids: torch.Tensor
    targets: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor


class MegaTrain:
    """Train an HF decoder-only causal LM (Llama, Qwen2, Qwen3, Mistral) with weights streamed from host RAM."""

    name = "megatrain"

    # -- construction --------------------------------------------------------------------------------
    def __init__(self, hf_config, cfg: EngineConfig | None = None, *, _weights: str = "init",
                 _source: str | None = None, verbose: bool = True):
        cfg = cfg or EngineConfig()
        arch.check_supported(hf_config)
        hf_config = copy.deepcopy(hf_config)
        hf_config = with_positions(hf_config, cfg.max_position_embeddings)  # long context: 0 = model's own
        hf_config._attn_implementation = cfg.attn_implementation
        hf_config.use_cache = False
        self.cfg = cfg
        self.config = hf_config
        self.device = cfg.resolved_device()
        self.dtype = cfg.resolved_compute_dtype()
        self.streams = StreamSet(self.device)
        self.meta = arch.build_meta_model(hf_config)
        self.meta.train()
        self.groups = make_groups(self.meta)
        self.layer_groups = [g for g in self.groups if g.kind == "layer"]
        self.num_layers = len(self.layer_groups)
        self.kinds = arch.layer_kinds(hf_config)
        self.tied = bool(hf_config.tie_word_embeddings)
        self.pad_idx = self.meta.model.embed_tokens.padding_idx
        k = cfg.checkpoint_interval or self.num_layers
        self.block = min(k, self.num_layers)
        # Pool: one block resident through recompute + backward, plus (num_slots - 1) prefetch slots.
        self.num_pool_slots = self.block + cfg.num_slots - 1
        on_gpu = self.device.type == "cuda"
        pin = on_gpu and cfg.pin_memory
        self._boundary_host = HostBuffers(pin)  # host home of offloaded block boundaries, reused every step

        # Gradient buffers: bf16 layer gradients are exact copies of what the GPU produced when there is
        # one micro-batch; accumulation over micro-batches needs fp32.
        layer_grad_dtype = self.dtype if (cfg.micro_batches == 1 and self.dtype != torch.float32) else torch.float32
        grad_dtypes = {g.name: (layer_grad_dtype if g.kind == "layer" else torch.float32) for g in self.groups}
        max_layer = max(g.numel for g in self.layer_groups)
        n_slabs = cfg.grad_slabs
        self.host_estimate = memory.estimate_bytes(
            [g.numel for g in self.layer_groups], sum(g.numel for g in self.groups if g.kind != "layer"),
            layer_grad_bytes=torch.finfo(layer_grad_dtype).bits // 8, compute_bytes=torch.finfo(self.dtype).bits // 8,
            grad_slabs=n_slabs, bf16_shadow=cfg.stream_dtype == "bf16")
        if verbose:
            print(f"[megatrain] {memory.format_estimate(self.host_estimate)}", flush=True)
        memory.check_fits(self.host_estimate, cfg.host_margin_gib)
        if _weights == "load":
            checkpoint.validate_checkpoint_dir(_source, self.groups, self.meta)  # before allocating anything

        # Host store (allocates ~12-16 B/param), then weights into it.
        self.store = HostStore(self.groups, grad_dtypes, torch.bfloat16 if cfg.stream_dtype == "bf16" else None, pin)
        if _weights == "init":
            checkpoint.init_into(self.store, self.meta, self.groups, cfg.seed, self.device)
        else:
            checkpoint.load_into(self.store, _source, self.groups)
        for g in self.groups:
            self.store.refresh_shadow(g.name)

        # GPU side: resident embed/final buffers, slots with bound templates, the rotary module.
        self.optimizer = HostAdamW(self.store, cfg.optim, [g.name for g in self.groups])
        self.resident = {g.name: torch.zeros(g.numel, device=self.device, dtype=self.dtype)
                         for g in self.groups if g.kind != "layer"}
        self._resident_ready = {name: self.streams.event() for name in self.resident}
        self.pool = SlotPool(store=self.store, layer_groups=self.layer_groups, make_template=self._make_template,
                             kinds=self.kinds, num_slots=self.num_pool_slots, device=self.device, dtype=self.dtype,
                             streams=self.streams, wait_for_update=self.optimizer.wait_group,
                             prefetch=cfg.num_slots > 1)
        self.offloader = GradOffloader(self.store, self.streams, n_slabs, max_layer * torch.finfo(self.dtype).bits // 8,
                                       pin)
        self.rotary = arch.build_rotary(self.meta, self.device)
        self.final_norm = copy.deepcopy(self.meta.model.norm)
        # The final norm module computes with a view into the resident "final" buffer (norm is first).
        self.final_norm._parameters["weight"] = nn.Parameter(views(self.resident["final"], self.groups[-1])[0])
        self.step_count = 0
        self._peak_rss = 0
        self.stats: dict[str, float] = {}  # host-side timings of the last step (see _Timer)

    @classmethod
    def from_config(cls, hf_config, cfg: EngineConfig | None = None, **kw) -> "MegaTrain":
        """Random init (HF's init scheme), layer by layer straight into the host store; seed = cfg.seed."""
        return cls(hf_config, cfg, _weights="init", **kw)

    @classmethod
    def from_pretrained(cls, path: str, cfg: EngineConfig | None = None, **kw) -> "MegaTrain":
        """Load a local HF directory (config.json + safetensors, sharded or not) tensor by tensor."""
        hf_config = checkpoint.read_config(path)
        return cls(hf_config, cfg, _weights="load", _source=str(path), **kw)

    @classmethod
    def load(cls, path: str, cfg: EngineConfig | None = None, **kw) -> "MegaTrain":
        """Resume from ``save``: weights, AdamW state and step counter (engine config from the save unless
        ``cfg`` is given)."""
        saved_cfg, step = checkpoint.read_engine_state(path)
        engine = cls.from_pretrained(path, cfg or saved_cfg, **kw)
        checkpoint.load_optimizer_into(engine.store, path, engine.groups)
        engine.step_count = step
        return engine

    def _make_template(self, kind: str) -> nn.Module:
        layer_idx = self.kinds.index(kind)
        with torch.device("meta"):
            tmpl = type(self.meta.model.layers[layer_idx])(self.config, layer_idx)
        return tmpl.train()

    # -- the step ------------------------------------------------------------------------------------
    def step(self, batch: dict[str, torch.Tensor]) -> StepResult:
        """Forward, backward and AdamW on one batch (split into ``cfg.micro_batches``). Returns the mean
        token loss of the batch (see megatrain.system) before the update."""
        t0 = time.perf_counter()
        mbs, denom, tokens = self._prepare(batch)  # validates; raises before any state changes
        try:
            self.pool.begin_step(self._load_order())
            self.offloader.begin_step()
            self._gpu_sqnorms: list[torch.Tensor] = []
            timer = _Timer(self.stats, t0)
            hidden, boundaries, ctx = self._forward(mbs)
            timer("forward_s")
            loss, d_hidden = self._loss(hidden, mbs, denom)
            timer("loss_s")
            self._backward(mbs, boundaries, d_hidden, ctx)
            timer("backward_s")
            sqnorms = self.offloader.wait()  # all gradients are on the host now
            if self._gpu_sqnorms:  # one sync for all per-layer norms computed on the GPU
                sqnorms["gpu"] = float(torch.stack(self._gpu_sqnorms).sum())
            timer("grad_wait_s")
        except BaseException:
            self._recover()
            raise
        grad_norm = global_norm(sqnorms)
        coef = clip_coefficient(grad_norm, self.cfg.optim.max_grad_norm)
        lr = self.cfg.optim.lr_at(self.step_count)
        self.optimizer.launch(self.step_count, coef, background=self.cfg.overlap_optimizer)
        self.step_count += 1
        loss_value = float(loss)  # a CPU-GPU sync point: the step's GPU work is done after this
        timer("optimizer_launch_s")
        self.stats.update(optimizer_prev_s=self.optimizer.last_update_s, h2d_loads=self.pool.loads,
                          update_wait_s=self.optimizer.wait_s, slab_wait_s=self.offloader.slab_wait_s,
                          worker_busy_s=self.offloader.busy_s, step_s=time.perf_counter() - t0)
        self._sample_rss()
        return StepResult(loss=loss_value, tokens=tokens, step_time_s=time.perf_counter() - t0, lr=lr,
                          grad_norm=grad_norm)

    def _load_order(self) -> list[int]:
        """Every layer use of a step, in order: forward 0..L-1, then per block (last first) ascending."""
        order = list(range(self.num_layers))
        for start in reversed(range(0, self.num_layers, self.block)):
            order += list(range(start, min(start + self.block, self.num_layers)))
        return order

    def _forward(self, mbs: list[_MicroBatch]):
        embed_w = self._embed_w = self._resident_weight("embed")[0]
        boundaries = make_boundaries(self.cfg, self.streams, model_config=self.config, block=self.block, dtype=self.dtype,
                                     tokens=[mb.ids.numel() for mb in mbs], host=self._boundary_host)
        ctx = []
        with torch.no_grad():
            hidden = [F.embedding(mb.ids, embed_w) for mb in mbs]
            for h, mb in zip(hidden, mbs):
                masks = arch.make_masks(self.config, h, mb.attention_mask, mb.position_ids)
                ctx.append((masks, mb.position_ids, self.rotary(h, mb.position_ids)))
            for i in range(self.num_layers):
                if i % self.block == 0:  # block boundary: the only activations kept for backward
                    for b, h in enumerate(hidden):
                        boundaries.keep(b, i, h)
                slot = self.pool.acquire(i)
                layer = slot.template(self.kinds[i])
                for b in range(len(mbs)):
                    masks, pos, pos_emb = ctx[b]
                    hidden[b] = arch.run_layer(layer, hidden[b], masks[self.kinds[i]], pos, pos_emb,
                                               self.cfg.mlp_chunk_tokens)
                self.pool.release(slot)
        return hidden, boundaries, ctx

    def _loss(self, hidden: list[torch.Tensor], mbs: list[_MicroBatch], denom: int):
        final_views = self._resident_weight("final")
        head_w = self._embed_w if self.tied else final_views[1]
        head_w = nn.Parameter(head_w, requires_grad=True)  # a leaf sharing the resident buffer
        total = torch.zeros((), device=self.device)
        d_hidden, d_norm, d_head = [], None, None
        for h, mb in zip(hidden, mbs):
            loss, dh, dn, dw = chunked_lm_loss(h, mb.targets, self.final_norm, head_w, denom,
                                               self.cfg.loss_chunk_tokens)
            total += loss
            d_hidden.append(dh)
            d_norm = dn if d_norm is None else d_norm + dn
            d_head = dw if d_head is None else d_head + dw
        if self.tied:
            self._embed_grad = d_head  # the embedding backward adds into this, then it goes out once
            self._send_resident_grad("final", [d_norm])
        else:
            self._embed_grad = None
            self._send_resident_grad("final", [d_norm, d_head])
        return total, d_hidden

    def _backward(self, mbs, boundaries, d_hidden, ctx) -> None:
        last_mb = len(mbs) - 1
        for start in reversed(range(0, self.num_layers, self.block)):
            layers = list(range(start, min(start + self.block, self.num_layers)))
            slots = [self.pool.acquire(i) for i in layers]  # prefetched while the previous block ran
            for b in range(len(mbs)):
                masks, pos, pos_emb = ctx[b]
                inputs, outputs = [], []
                with torch.enable_grad():  # recompute the block with autograd, one graph per layer
                    x = boundaries.take(b, start)
                    for i, slot in zip(layers, slots):
                        x_in = x.detach().requires_grad_(True)
                        x = arch.run_layer(slot.template(self.kinds[i]), x_in, masks[self.kinds[i]], pos, pos_emb,
                                           self.cfg.mlp_chunk_tokens)
                        inputs.append(x_in)
                        outputs.append(x)
                grad = d_hidden[b]
                for j in reversed(range(len(layers))):
                    i, slot = layers[j], slots[j]
                    params = slot.params[self.kinds[i]]
                    grads = torch.autograd.grad(outputs[j], [inputs[j], *params], grad, allow_unused=True)
                    grad = grads[0]
                    inputs[j] = outputs[j] = None  # this layer's activations are free now
                    self._send_layer_grad(i, params, grads[1:], accumulate=b > 0, last=b == last_mb)
                    if b == last_mb:
                        self.pool.release(slot)  # weights no longer needed: the slot can prefetch
                d_hidden[b] = grad
        self._embedding_backward(mbs, d_hidden)

    def _embedding_backward(self, mbs: list[_MicroBatch], d_hidden: list[torch.Tensor]) -> None:
        embed = self.groups[0]
        grad = self._embed_grad
        if grad is None:
            grad = torch.zeros(embed.slots[0].shape, device=self.device, dtype=torch.float32)
        for mb, dh in zip(mbs, d_hidden):
            ids = mb.ids.reshape(-1)
            dh = dh.reshape(-1, dh.shape[-1]).float()
            if self.pad_idx is not None:  # nn.Embedding(padding_idx) never updates the padding row
                keep = ids != self.pad_idx
                ids, dh = ids[keep], dh[keep]
            grad.index_add_(0, ids, dh)
        self._send_resident_grad("embed", [grad])

    # -- gradients out ------------------------------------------------------------------------------
    def _send_layer_grad(self, layer: int, params, grads, accumulate: bool, last: bool) -> None:
        group = self.layer_groups[layer]
        flat = torch.zeros(group.numel, device=self.device, dtype=self.dtype)
        fixed = [g if g is not None else torch.zeros_like(p) for p, g in zip(params, grads)]
        torch._foreach_copy_(views(flat, group), fixed)
        self._send(group.name, flat, accumulate, last)

    def _send_resident_grad(self, name: str, grads: list[torch.Tensor]) -> None:
        group = self.store.by_name[name]
        flat = torch.zeros(group.numel, device=self.device, dtype=torch.float32)
        torch._foreach_copy_(views(flat, group), grads)
        self._send(name, flat, accumulate=False, last=True)

    def _send(self, name: str, flat: torch.Tensor, accumulate: bool, last: bool) -> None:
        # With one micro-batch the GPU gradient is final: its squared norm is computed on the GPU while
        # the gradient is still there (no host pass). With accumulation the norm must be of the host sum.
        on_gpu_norm = self.cfg.micro_batches == 1
        if on_gpu_norm:
            self._gpu_sqnorms.append(torch.linalg.vector_norm(flat, dtype=torch.float32).square())
        self.offloader.offload(name, flat, accumulate=accumulate, last=last and not on_gpu_norm)

    # -- weights in ---------------------------------------------------------------------------------
    def _resident_weight(self, name: str) -> list[torch.Tensor]:
        """Load a resident group (embedding or final norm + head) for this step; returns its views."""
        self.optimizer.wait_group(name)
        group = self.store.by_name[name]
        buf = self.resident[name]
        src = self.store.stream_source[name]
        with self.streams.use(self.streams.h2d):
            # Last step's kernels that read this buffer were queued on compute before this point.
            self.streams.h2d.wait_stream(self.streams.compute)
            if src.dtype == buf.dtype:
                buf.copy_(src, non_blocking=True)
            else:
                buf.copy_(src.to(self.device, non_blocking=True))  # cast on the GPU
            ready = self.streams.record(self.streams.h2d)
        self.streams.compute.wait_event(ready)  # compute may read it only once the copy has landed
        return views(buf, group)

    # -- batches ------------------------------------------------------------------------------------
    def _prepare(self, batch) -> tuple[list[_MicroBatch], int, int]:
        validate_batch(batch, self.config, self.cfg.micro_batches)
        mbs, denom, tokens = [], 0, 0
        for part in split_micro_batches(batch, self.cfg.micro_batches):
            ids = part["input_ids"]
            targets = shift_labels(labels_from_batch(part))
            denom += int((targets != IGNORE_INDEX).sum())
            tokens += ids.numel()
            pos = part.get("position_ids")
            if pos is None:
                pos = torch.arange(ids.shape[1]).unsqueeze(0)
            mask = part.get("attention_mask")
            mbs.append(_MicroBatch(ids.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True),
                                   None if mask is None else mask.to(self.device), pos.to(self.device)))
        if denom == 0:
            raise ValueError("batch has no labelled tokens (every target is -100 after shifting)")
        return mbs, denom, tokens

    def _recover(self) -> None:
        """After a failed step: drain queued work so the engine can be closed or stepped again."""
        self.streams.synchronize()
        for s in self.pool.slots:
            s.refcount = 0
        self.pool._issued.clear()
        self.pool._queue.clear()
        try:
            self.offloader.wait()
        except RuntimeError:
            pass

    # -- state --------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for the background optimizer and all device work."""
        self.optimizer.wait_all()
        self.streams.synchronize()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named fp32 master weights (views into the host store, after pending updates)."""
        self.synchronize()
        return self.store.state_dict()

    def save(self, path: str) -> None:
        """Weights (HF safetensors layout, loadable by ``from_pretrained`` and by HF), AdamW state and
        the step counter; written to a temporary folder and renamed, so a crash leaves no half save."""
        self.synchronize()
        checkpoint.save(self, path)

    save_pretrained = save

    def memory(self) -> MemoryStats:
        self._sample_rss()
        stats = MemoryStats(host_rss=self._peak_rss,
                            host_pinned=self.store.pinned_bytes + self.offloader.pinned_bytes,
                            extra={"host_estimate_bytes": self.host_estimate["total_bytes"],
                                   "host_bytes_per_param": self.host_estimate["bytes_per_param"],
                                   "pool_slots": self.num_pool_slots, "h2d_loads": self.pool.loads})
        if self.device.type == "cuda":
            stats.gpu_peak_allocated = torch.cuda.max_memory_allocated(self.device)
            stats.gpu_peak_reserved = torch.cuda.max_memory_reserved(self.device)
        return stats

    def _sample_rss(self) -> None:
        import psutil

        self._peak_rss = max(self._peak_rss, psutil.Process().memory_info().rss)

    def num_params(self) -> int:
        return sum(g.num_params for g in self.groups)

    def close(self) -> None:
        """Finish pending work and free GPU buffers, pinned registrations and worker threads."""
        try:
            self.synchronize()
        finally:
            self.offloader.close()
            self.store.close()
            self._boundary_host.close()  # unpin offloaded-boundary buffers
            self.pool = self.resident = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()



class _Timer:
    """Host wall time between phases of a step. On CUDA these are launch times plus any blocking waits
    (slot loads waiting for the optimizer, slab back-pressure), not GPU kernel times."""

    def __init__(self, stats: dict, t0: float):
        self.stats, self.last = stats, t0
        stats.clear()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.stats[name] = now - self.last
        self.last = now
