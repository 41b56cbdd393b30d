"""The MegaTrain engine: host RAM is the home of the model, the GPU a transient compute engine.

    engine = MegaTrain.from_config(hf_config, EngineConfig(...))     # or .from_pretrained(dir)
    result = engine.step({"input_ids": ids, "labels": labels})       # forward, backward, AdamW
    engine.save(dir); engine = MegaTrain.load(dir)                   # resume with optimizer state (dir/step-N/)

One step reads top to bottom (see ``step``): forward through streamed layers keeping block-boundary
activations (or, for the blocks the plan keeps, their autograd graphs), chunked loss, backward block by
block (recomputing the blocks not kept), gradients out to the host, then the optimizer: fused AdamW on the GPU for the GPU tier, a worker thread for the host tier (speculatively
during the backward when clipping is not expected, overlapping the next forward either way).
"""
from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from . import arch, checkpoint, checkpoint_layout, cost_model, memory, placement, planner
from .boundaries import HostBuffers, make_boundaries
from .compute_policy import make_policy
from .config import EngineConfig
from .cpu_adamw import HostKernel
from .device_adamw import DeviceAdamW
from .grad_offload import GradStream
from .grad_placement import make_grad_home
from .host_adamw import HostAdamW
from .host_tier import build_host_tier
from .keep import KeptBlocks, KeptGraph
from .link import make_link
from .loss import chunked_lm_loss
from .optim import Optimizers
from .slots import SlotPool
from .spec import with_positions
from .store import ModelStore, make_groups, views
from .streams import StreamSet
from .system import IGNORE_INDEX, MemoryStats, StepResult, labels_from_batch, shift_labels, split_micro_batches
from .update_split import UpdateRates, measure_rates
from .validate import validate_batch


@dataclass
class _StepState:
    """What one step accumulates between its phases."""

    sqnorms: list = field(default_factory=list)  # per-group squared gradient norms (GPU scalars)
    acc: dict = field(default_factory=dict)  # layer -> gradient being accumulated across micro-batches
    embed_w: torch.Tensor | None = None  # the resident embedding (the tied head reads it)
    mlp_chunk: int = -1  # mlp_chunk_tokens this step's layers run with (MegaTrain._mlp_chunk), forward and recompute
    kept: KeptBlocks | None = None  # the kept blocks' graphs, forward to backward
    # The pass over the layers this is (micro_batch_schedule="sequential": one per micro-batch; else one):
    first_mb: int = 0  # index of the pass's first micro-batch in the step
    num_mbs: int = 1  # micro-batches in the step
    last_pass: bool = True  # the step's last pass: gradients are final after it
    final_views: list | None = None  # the resident final norm / head, loaded once per step
    d_norm: torch.Tensor | None = None  # final norm / head gradients summed over the step's passes
    d_head: torch.Tensor | None = None
    embed_acc: torch.Tensor | None = None  # embedding gradient summed over passes before the last


# Tokens per micro-batch the placement plan sizes activations for unless told (tokens_per_step=...).
DEFAULT_PLAN_TOKENS = 8192


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
                 _source: str | None = None, verbose: bool = True, tokens_per_step: int | None = None,
                 seq_len: int | None = None, tiers: dict[str, str] | None = None, keep: set[int] | None = None,
                 rates=None, dist=None):
        """``tokens_per_step`` / ``seq_len``: the step the placement plan sizes activations for (default:
        one sequence of min(max positions, DEFAULT_PLAN_TOKENS) per micro-batch; a larger batch warns).
        ``tiers``: group name -> "gpu" | "host", overriding the plan's choice; ``keep``: the checkpoint blocks
        (index b = layers b*K ..) whose activations are kept, overriding ``cfg.recompute`` (advanced; tests
        use both for mixed placements). ``rates``: a ``megatrain.cost_model.Rates`` of this machine for the
        step-time model (default: the H200's; its ``update``, an ``UpdateRates``, replaces the host update's
        rates otherwise measured here before planning, for the plan and the runtime split alike). ``dist``: a
        ``megatrain.distributed.DataParallel`` to train data-parallel with one host store per node."""
        cfg = cfg or EngineConfig()
        arch.check_supported(hf_config)
        hf_config = copy.deepcopy(hf_config)
        hf_config = with_positions(hf_config, cfg.max_position_embeddings)  # long context: 0 = model's own
        hf_config._attn_implementation = cfg.attn_implementation
        hf_config.use_cache = False
        if dist is not None and cfg.pin_host_state == "all":
            # each rank would register the node's whole shared arena, every slice's m and v: never run on GPUs
            raise ValueError("pin_host_state='all' is not supported with data parallel training (use 'stream')")
        self.cfg = cfg
        self.dist = dist
        self.config = hf_config
        self.device = cfg.resolved_device()
        # How layers compute (megatrain/compute_policy.py): ``dtype`` is the slots', resident buffers' and hidden
        # states' dtype; ``policy.region()`` the autocast context (or none) of each layer and the loss head.
        self.policy = make_policy(cfg, self.device)
        self.dtype = self.policy.buffers
        self.streams = StreamSet(self.device)
        # The host link every weight/gradient/activation copy goes over: NULL_LINK (the real one, no-op)
        # unless host_link_gbps emulates a slower one (measured here, before the plan reads free memory).
        self.link = make_link(cfg.host_link_gbps, self.device)
        self.meta = arch.build_meta_model(hf_config)
        self.meta.train()
        self.groups = make_groups(self.meta)
        self.layer_groups = [g for g in self.groups if g.kind == "layer"]
        self.num_layers = len(self.layer_groups)
        self.kinds = arch.layer_kinds(hf_config)
        self.tied = bool(hf_config.tie_word_embeddings)
        self.pad_idx = self.meta.model.embed_tokens.padding_idx
        on_gpu = self.device.type == "cuda"
        pin = on_gpu and cfg.pin_memory
        self._boundary_host = HostBuffers(pin, self.link)  # offloaded block boundaries' host home, reused

        # The host update's rates, measured here on a GPU (about a second) BEFORE planning: the plan's
        # update-path decision and the runtime split (build_host_tier) then come from one set of rates.
        self.update_rates = self._update_rates(rates)
        if self.update_rates is not None:
            rates = replace(rates or cost_model.Rates(), update=self.update_rates)
        # Placement: which groups live on the GPU tier, checked against both memories before allocating.
        self.placement = self._plan(tokens_per_step, seq_len, tiers, keep, rates)
        # K and the pool (one block resident through recompute + backward, plus num_slots - 1 prefetch
        # slots) and the blocks whose activations are kept: as the plan sized them.
        self.block, self.num_pool_slots = self.placement.block, self.placement.num_pool_slots
        self.kept = frozenset(self.placement.kept_blocks)
        if verbose:
            print(f"[megatrain] {self.placement.summary()}", flush=True)
        if _weights == "load":
            checkpoint.validate_checkpoint_dir(_source, self.groups, self.meta)  # before allocating anything

        # The store (12 B/param on each group's tier), then weights into it.
        devices = {name: (self.device if tier == "gpu" else torch.device("cpu"))
                   for name, tier in self.placement.tiers.items()}
        shadow = torch.bfloat16 if cfg.stream_dtype == "bf16" else None
        # Data parallel: the host tier lives once per node in shared memory, written by the node's leader.
        shared = dist.host_arena(self.groups, self.placement.host_names, shadow) if dist else None
        self.store = ModelStore(self.groups, devices, shadow, pin, shared=shared, pin_all=cfg.pins_all_host_state)
        writer = dist.writer(self.store) if dist else self.store
        if _weights == "init":
            checkpoint.init_into(writer, self.meta, self.groups, cfg.seed, self.device)
        else:
            checkpoint.load_into(writer, _source, self.groups)
        for g in self.groups:
            writer.refresh_shadow(g.name)
        if dist:
            dist.barrier("weights written")  # the others read what the leader wrote only after this

        # Where final gradients wait for the norm (grad_placement, resolved by the plan): on the GPU, or the
        # host tier's in pinned host buffers filled during the backward (megatrain/grad_placement.py).
        self.grad_home = make_grad_home(self.placement.grads, {n: self.store.by_name[n].numel
                                                               for n in self.placement.host_names}, self.streams, pin,
                                        self.link)
        # Optimizers: one implementation per tier behind one interface (megatrain/optim.py).
        self.grad_stream = GradStream(self.streams, self.grad_home.slabs(cfg.grad_slabs), pin=pin, link=self.link)
        host_adamw = dist.host_adamw if dist else HostAdamW  # data parallel: each local rank updates a slice
        self.host_opt = host_adamw(self.store, cfg.optim, self.placement.host_names, self.grad_stream,
                                   background=cfg.overlap_optimizer)
        self.device_opt = DeviceAdamW(self.store, cfg.optim, self.placement.gpu_names, self.streams)
        # The host tier's optimizer: the CPU kernel alone, or with the GPU update path (update_path="hybrid").
        self.host_tier = build_host_tier(self.host_opt, store=self.store, cfg=cfg, streams=self.streams,
                                         host_names=self.placement.host_names, grads_on_host=self.placement.grads == "host",
                                         staging_bytes=self._staging_bytes(), dist=dist,
                                         update_path=self.placement.update_path, rates=self.update_rates)
        # host_update_cores (default auto): after the rate measurement (before the plan), which runs the kernel
        # from this thread, so that its OpenMP team is not created inside the main thread's narrowed mask.
        self.host_opt.bind_cores(cfg.host_update_cores, cuda=on_gpu, ranks=getattr(dist, "world_size", 2) if dist else 1)
        if verbose and self.placement.update_path != "cpu":
            print(f"[megatrain] {self.host_tier.summary()}", flush=True)
        self.optimizer = Optimizers([self.device_opt, self.host_tier], cfg.optim, cfg.speculate)

        # GPU side: resident embed/final compute buffers, slots with bound templates, the rotary module.
        self.resident = {g.name: torch.zeros(g.numel, device=self.device, dtype=self.dtype)
                         for g in self.groups if g.kind != "layer"}
        self.pool = SlotPool(store=self.store, layer_groups=self.layer_groups, make_template=self._make_template,
                             kinds=self.kinds, num_slots=self.num_pool_slots, device=self.device, dtype=self.dtype,
                             streams=self.streams, wait_for_update=self.optimizer.wait_group,
                             prefetch=cfg.num_slots > 1, link=self.link, host_tier=set(self.placement.host_names),
                             device_source=self.optimizer.device_source)
        self.rotary = arch.build_rotary(self.meta, self.device)
        self.final_norm = copy.deepcopy(self.meta.model.norm)
        # The final norm module computes with a view into the resident "final" buffer (norm is first).
        self.final_norm._parameters["weight"] = nn.Parameter(views(self.resident["final"], self.groups[-1])[0])
        self.step_count = 0
        self.skipped_steps = 0  # steps whose gradient norm was not finite (weights left untouched)
        self._peak_rss = 0
        self.stats: dict[str, float] = {}  # host-side timings of the last step (see _Timer)

    def _update_rates(self, rates) -> UpdateRates | None:
        """The host update's rates for the plan and the runtime split: None where nothing is to decide (update
        path "cpu", data parallel, or a forced split); those given (``rates.update``); measured on a GPU
        (update_split.measure_rates with the host kernel, as build_host_tier measured them before); else the
        cost model's (a CPU run)."""
        cfg = self.cfg
        if cfg.update_path == "cpu" or self.dist is not None or cfg.gpu_path_groups != "auto":
            return None
        if rates is not None and rates.update is not None:
            return rates.update
        if self.device.type == "cuda":
            threads = max(1, torch.get_num_threads() - 1)  # as HostAdamW runs it (one core left to this thread)
            # on page-locked state where the store's is (pin_host_state="all"): the kernel's rate depends on it
            return measure_rates(self.device, HostKernel(cfg.optim, threads), shadow=cfg.stream_dtype == "bf16",
                                 pinned=cfg.pins_all_host_state)
        return (rates or cost_model.Rates()).update_rates()

    def _plan(self, tokens_per_step, seq_len, tiers, keep, rates) -> placement.Placement:
        cfg, c = self.cfg, torch.finfo(self.dtype).bits // 8
        seq = seq_len or min(self.config.max_position_embeddings, DEFAULT_PLAN_TOKENS)
        tokens = tokens_per_step or seq * cfg.micro_batches
        self.planned_tokens_per_micro_batch = max(1, tokens // cfg.micro_batches)
        self._warned_tokens = False  # the over-plan warning is given once
        hc = self.config
        on_gpu = self.device.type == "cuda"
        shape = memory.step_shape(cfg, num_layers=self.num_layers, hidden=hc.hidden_size, ffn=hc.intermediate_size,
                                  vocab=hc.vocab_size, tokens_per_micro_batch=self.planned_tokens_per_micro_batch,
                                  compute_bytes=c, on_gpu=on_gpu, seq_len=seq)
        gpu_free = memory.gpu_free_bytes(self.device) if on_gpu else 0
        return planner.plan({g.name: g.numel for g in self.groups}, shape, setting=cfg.gpu_resident,
                            on_gpu=on_gpu, gpu_free=gpu_free, host_available=memory.available_host_bytes(),
                            gpu_margin=int(cfg.gpu_margin_gib * placement.GIB),
                            host_margin=int(cfg.host_margin_gib * placement.GIB), tiers=tiers,
                            grads=cfg.grad_placement, kept=keep, rates=rates,
                            update_path="cpu" if (self.dist and cfg.update_path == "auto") else cfg.update_path,
                            staging_reserve=planner.staging_bytes(cfg.update_staging_gib) if on_gpu else 0,
                            # keep an explicit "hybrid" as asked: a forced split, prefetch (not in the model),
                            # data parallel (refused by build_host_tier)
                            gpu_path_forced=(cfg.gpu_path_groups != "auto" or cfg.gpu_path_prefetch
                                             or self.dist is not None))

    def _staging_reserve_gib(self) -> float:
        """GPU memory the plan kept free for the host tier's GPU update path (update_path "hybrid", or "auto"
        resolved to it by the plan)."""
        hybrid = self.placement.update_path == "hybrid" and self.device.type == "cuda"
        return self.placement.staging_reserve / placement.GIB if hybrid else 0.0  # as asked, or the plan's choice

    def _staging_bytes(self) -> float:
        """GPU bytes the GPU update path may hold: the reserve plus what the plan leaves unused (90 % of it:
        the plan's parts are estimates). On the CPU, unbounded (the "GPU" is host RAM and tests are tiny)."""
        if self.device.type != "cuda":
            return float("inf")
        plan = self.placement
        unused = max(0, plan.gpu_budget - sum(plan.gpu_parts.values())) if plan.gpu_budget is not None else 0
        return self._staging_reserve_gib() * placement.GIB + 0.9 * unused

    @classmethod
    def from_config(cls, hf_config, cfg: EngineConfig | None = None, **kw) -> "MegaTrain":
        """Random init (HF's init scheme), layer by layer straight into the host store; seed = cfg.seed."""
        return cls(hf_config, cfg, _weights="init", **kw)

    @classmethod
    def from_pretrained(cls, path: str, cfg: EngineConfig | None = None, **kw) -> "MegaTrain":
        """Load a local HF directory (config.json + safetensors, sharded or not) tensor by tensor; a
        checkpoint folder written by ``save`` reads its ``latest`` step folder; a ``.gguf`` file is de-quantized
        to fp32 through a temporary HF folder (megatrain/gguf_import.py; its tokenizer is not carried into
        saves: convert once with ``python -m megatrain.gguf_import`` to keep one)."""
        if str(path).endswith(".gguf"):
            from .gguf_import import converted

            with converted(path) as folder:
                engine = cls.from_pretrained(folder, cfg, **kw)
            engine.source_dir = None  # the temporary folder is gone
            return engine
        path = checkpoint_layout.resolve(path)
        hf_config = checkpoint.read_config(path)
        engine = cls(hf_config, cfg, _weights="load", _source=str(path), **kw)
        engine.source_dir = str(path)  # its tokenizer files travel into every save
        return engine

    @classmethod
    def load(cls, path: str, cfg: EngineConfig | None = None, **kw) -> "MegaTrain":
        """Resume from ``save``: weights, AdamW state and step counter (engine config from the save unless
        ``cfg`` is given). ``path``: a checkpoint folder (its ``latest`` step) or one of its step folders."""
        path = checkpoint_layout.resolve(path)
        saved_cfg, step = checkpoint.read_engine_state(path)
        engine = cls.from_pretrained(path, cfg or saved_cfg, **kw)
        dist = engine.dist
        checkpoint.load_optimizer_into(dist.writer(engine.store) if dist else engine.store, path, engine.groups)
        if dist:
            dist.barrier("optimizer state loaded")
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
        if tokens // len(mbs) > self.planned_tokens_per_micro_batch and not self._warned_tokens:
            self._warned_tokens = True
            warnings.warn(f"this batch has {tokens // len(mbs)} tokens per micro-batch but the placement plan was "
                          f"made for {self.planned_tokens_per_micro_batch}: activations may not fit the GPU; pass "
                          f"tokens_per_step= (and seq_len=) when building the engine", RuntimeWarning)
        before = self._counters()
        try:
            self.optimizer.begin_step(self.step_count)  # speculate this step? (host tier)
            self.pool.begin_step(self._load_order())
            st = _StepState(num_mbs=len(mbs))  # this step's gradient bookkeeping (nothing parked on self)
            timer = _Timer(self.stats, t0)
            loss = 0.0
            for first, part in self._passes(mbs):  # all micro-batches at once, or one at a time (the plan's)
                st.first_mb, st.last_pass = first, first + len(part) == len(mbs)
                hidden, boundaries, ctx = self._forward(part, st)
                timer("forward_s")
                part_loss, d_hidden = self._loss(hidden, part, denom, st)
                loss = loss + part_loss
                timer("loss_s")
                self._backward(part, boundaries, d_hidden, ctx, st)
                timer("backward_s")
            if self.dist:
                self.dist.all_reduce_(loss, "the loss")  # for reporting: the global mean token loss
            # One sync for every group's squared norm, computed on the GPU while the gradients were there.
            grad_norm = math.sqrt(float(torch.stack(st.sqnorms).sum()))
            timer("grad_norm_s")
        except BaseException:
            self._recover()
            raise
        lr = self.cfg.optim.lr_at(self.step_count)
        coef = self.optimizer.finish(self.step_count, grad_norm)  # GPU tier queued, host tier in its thread
        if coef is None:
            self.skipped_steps += 1
            warnings.warn(f"step {self.step_count}: gradient norm is {grad_norm}; step skipped, weights and "
                          f"optimizer state untouched ({self.skipped_steps} skipped so far)", RuntimeWarning)
        else:
            self.step_count += 1
        loss_value = float(loss)  # a CPU-GPU sync point: the step's GPU work is done after this
        timer("optimizer_launch_s")
        after = self._counters()
        predicted = self.placement.prediction
        self.stats.update(predicted_step_s=predicted.step_s if predicted else float("nan"),
                          blocks_kept=float(len(self.kept)),
                          speculated=float(self.optimizer.speculating), clipped=float(coef is not None and coef < 1),
                          skipped=float(coef is None), step_s=time.perf_counter() - t0,
                          **{k: after[k] - before[k] for k in after})
        self.optimizer.observe_step(self.stats)  # speculate="auto": this step's time to the chooser (its decision in stats)
        self.host_tier.observe_step(self.stats)  # the backward's time: how early a speculative CPU path starts
        self._sample_rss()
        return StepResult(loss=loss_value, tokens=tokens, step_time_s=time.perf_counter() - t0, lr=lr,
                          grad_norm=grad_norm)

    def _counters(self) -> dict[str, float]:
        """Cumulative counters whose per-step differences go into ``stats``."""
        h = self.host_tier
        # load_wait.settle(): the step's last timing events are complete here (the step ends with a sync)
        return dict(h2d_loads=self.pool.loads, gpu_load_wait_s=self.pool.load_wait.settle(),
                    optimizer_exposed_s=h.wait_s, host_update_busy_s=h.busy_s,
                    early_groups=h.early_groups, rollbacks=h.rollbacks,
                    d2h_bytes=self.grad_stream.bytes_d2h + self.grad_home.bytes_d2h,
                    # cpu_groups, gpu_path_groups, gpu_path_busy_s, gpu_path_wait_s, gpu_path_{h2d,d2h}_bytes
                    **h.counters())

    def _passes(self, mbs: list[_MicroBatch]) -> list[tuple[int, list[_MicroBatch]]]:
        """(index of the first micro-batch, micro-batches) of each pass over the layers: one pass with every
        micro-batch (each layer loaded twice per step, every micro-batch's activations held), or with
        micro_batch_schedule "sequential" one pass per micro-batch (loaded twice per micro-batch, one
        micro-batch's activations held: more blocks kept; the plan chooses, megatrain/planner.py)."""
        if self.placement.sequential:
            return [(i, [mb]) for i, mb in enumerate(mbs)]
        return [(0, mbs)]

    def _load_order(self) -> list[int]:
        """Every layer use of a step, in order: per pass, forward 0..L-1, then per block (last first)
        ascending."""
        order = list(range(self.num_layers))
        for start in reversed(range(0, self.num_layers, self.block)):
            order += list(range(start, min(start + self.block, self.num_layers)))
        return order * (self.cfg.micro_batches if self.placement.sequential else 1)

    def _mlp_chunk(self, tokens: list[int]) -> int:
        """mlp_chunk_tokens for a step with ``tokens`` per micro-batch: the plan's resolved value ("auto" is
        the plan's decision, megatrain/planner.py), which the plan's GPU prediction was made with."""
        if max(tokens) > self.planned_tokens_per_micro_batch:
            # The plan checked its choice only at the tokens it was made for; unchunked may not fit with
            # more. The config's own rule ("auto": chunk above AUTO_MIN_TOKENS) bounds memory as before.
            return self.cfg.mlp_chunk_tokens
        # At most the planned tokens: what the plan sized. A plan that chose chunks keeps them for a smaller
        # step too (it was not checked unchunked there; chunking only lowers memory).
        return self.placement.mlp_chunk_tokens

    def _forward(self, mbs: list[_MicroBatch], st: "_StepState"):
        if st.embed_w is None:  # once per step
            st.embed_w = self._resident_weight("embed")[0]
        embed_w = st.embed_w
        tokens = [mb.ids.numel() for mb in mbs]
        st.mlp_chunk = self._mlp_chunk(tokens)
        # Where the boundaries of the recomputed blocks live: decided by the plan (boundary_offload).
        recomputed = self.placement.num_blocks - len(self.kept)
        boundaries = make_boundaries(self.cfg, self.streams, model_config=self.config, block=self.block,
                                     dtype=self.dtype, tokens=tokens, host=self._boundary_host,
                                     on_gpu=self.placement.boundaries_on_gpu, total=recomputed * len(mbs))
        st.kept = KeptBlocks()
        ctx = []
        with torch.no_grad():
            hidden = [F.embedding(mb.ids, embed_w) for mb in mbs]
            for h, mb in zip(hidden, mbs):
                masks = arch.make_masks(self.config, h, mb.attention_mask, mb.position_ids)
                ctx.append((masks, mb.position_ids, self.rotary(h, mb.position_ids)))
        for i in range(self.num_layers):
            kept = i // self.block in self.kept
            if i % self.block == 0 and not kept:  # a recomputed block's boundary: all its backward needs
                for b, h in enumerate(hidden):
                    boundaries.keep(b, i, h)
            slot = self.pool.acquire(i)
            for b in range(len(mbs)):
                hidden[b] = self._layer_forward(i, slot, b, hidden[b], ctx[b], st, keep=kept)
            self.pool.release(slot)
        return hidden, boundaries, ctx

    def _layer_forward(self, i: int, slot, b: int, x: torch.Tensor, ctx, st: "_StepState", keep: bool):
        """Layer ``i`` (in ``slot``) on micro-batch ``b``'s hidden state: without autograd, or, in a kept
        block, with autograd and the graph kept in ``st.kept`` for the backward."""
        masks, pos, pos_emb = ctx
        layer, mask = slot.template(self.kinds[i]), masks[self.kinds[i]]
        if not keep:
            with torch.no_grad(), self.policy.region():
                return arch.run_layer(layer, x, mask, pos, pos_emb, st.mlp_chunk)
        # The graph saves the weights by position in the slot (megatrain/keep.py): the slot is released after
        # this layer as usual, and the backward reads them from whichever slot holds the layer then.
        x_in = x.detach().requires_grad_(True)
        with torch.enable_grad(), st.kept.recording(i, slot), self.policy.region():
            out = arch.run_layer(layer, x_in, mask, pos, pos_emb, st.mlp_chunk)
        st.kept.graphs[(b, i)] = KeptGraph(x_in, out, slot.params[self.kinds[i]])
        return out.detach()

    def _loss(self, hidden: list[torch.Tensor], mbs: list[_MicroBatch], denom: int, st: "_StepState"):
        if st.final_views is None:  # once per step
            st.final_views = self._resident_weight("final")
        head_w = st.embed_w if self.tied else st.final_views[1]
        head_w = nn.Parameter(head_w, requires_grad=True)  # a leaf sharing the resident buffer
        total = torch.zeros((), device=self.device)
        d_hidden = []
        for h, mb in zip(hidden, mbs):
            with self.policy.region():
                loss, dh, dn, dw = chunked_lm_loss(h, mb.targets, self.final_norm, head_w, denom,
                                                   self.cfg.loss_chunk_tokens)
            total += loss
            d_hidden.append(dh)
            st.d_norm = dn if st.d_norm is None else st.d_norm + dn
            st.d_head = dw if st.d_head is None else st.d_head + dw
        if st.last_pass:  # final: the head's gradient goes out (tied: the embedding backward adds it)
            self._resident_grad("final", [st.d_norm] if self.tied else [st.d_norm, st.d_head], st)
        return total, d_hidden

    def _backward(self, mbs, boundaries, d_hidden, ctx, st: "_StepState") -> None:
        last_mb = len(mbs) - 1
        for start in reversed(range(0, self.num_layers, self.block)):
            layers = list(range(start, min(start + self.block, self.num_layers)))
            slots = [self.pool.acquire(i) for i in layers]  # prefetched while the previous block ran
            kept = start // self.block in self.kept
            for i, slot in zip(layers, slots):
                st.kept.bind(i, slot)  # a kept graph's weights are read from here (megatrain/keep.py)
            for b in range(len(mbs)):
                if kept:  # the graphs the forward made
                    graphs = [st.kept.take(b, i) for i in layers]
                else:
                    graphs = self._recompute(b, layers, slots, boundaries, ctx, st)
                grad = d_hidden[b]
                for j in reversed(range(len(layers))):
                    i, slot, g = layers[j], slots[j], graphs[j]
                    grads = torch.autograd.grad(g.output, [g.input, *g.params], grad, allow_unused=True)
                    grad = grads[0]
                    graphs[j] = None  # this layer's activations are free now
                    step_mb = st.first_mb + b  # the micro-batch's index in the step: its gradient is final at the last
                    self._layer_grad(i, g.params, grads[1:], st, first=step_mb == 0, last=step_mb == st.num_mbs - 1)
                    if b == last_mb:
                        self.pool.release(slot)  # weights no longer needed: the slot can prefetch
                d_hidden[b] = grad
        self._embedding_backward(mbs, d_hidden, st)

    def _recompute(self, b: int, layers: list[int], slots, boundaries, ctx, st: "_StepState") -> list[KeptGraph]:
        """A recomputed block's forward for micro-batch ``b`` with autograd from its boundary, one graph per
        layer (the backward's weights are the slots' own: no position hooks needed)."""
        masks, pos, pos_emb = ctx[b]
        graphs = []
        with torch.enable_grad():
            x = boundaries.take(b, layers[0])
            for i, slot in zip(layers, slots):
                x_in = x.detach().requires_grad_(True)
                with self.policy.region():  # as the forward ran it: the same arithmetic
                    x = arch.run_layer(slot.template(self.kinds[i]), x_in, masks[self.kinds[i]], pos, pos_emb,
                                       st.mlp_chunk)
                graphs.append(KeptGraph(x_in, x, slot.params[self.kinds[i]]))
        return graphs

    def _embedding_backward(self, mbs: list[_MicroBatch], d_hidden: list[torch.Tensor], st: "_StepState") -> None:
        embed = self.groups[0]
        grad = st.embed_acc
        if grad is None:  # tied, one pass: the head's gradient is complete; add into it
            grad = st.d_head if (self.tied and st.last_pass) else \
                torch.zeros(embed.spans[0].shape, device=self.device, dtype=torch.float32)
        for mb, dh in zip(mbs, d_hidden):
            ids = mb.ids.reshape(-1)
            dh = dh.reshape(-1, dh.shape[-1]).float()
            if self.pad_idx is not None:  # nn.Embedding(padding_idx) never updates the padding row
                keep = ids != self.pad_idx
                ids, dh = ids[keep], dh[keep]
            grad.index_add_(0, ids, dh)
        if not st.last_pass:
            st.embed_acc = grad
            return
        if self.tied and grad is not st.d_head:
            grad += st.d_head  # several passes: the head's gradient is complete only now
        self._resident_grad("embed", [grad], st)

    # -- gradients out ------------------------------------------------------------------------------
    def _layer_grad(self, layer: int, params, grads, st: "_StepState", first: bool, last: bool) -> None:
        """Micro-batch ``b``'s gradient of ``layer``: accumulated on the device across micro-batches and
        handed to the optimizer once, when final."""
        group = self.layer_groups[layer]
        acc_dtype = self.dtype if self.cfg.micro_batches == 1 else torch.float32
        if first:
            st.acc[layer] = torch.zeros(group.numel, device=self.device, dtype=acc_dtype)
        flat = st.acc[layer]
        fixed = [g if g is not None else torch.zeros_like(p) for p, g in zip(params, grads)]
        if first:
            torch._foreach_copy_(views(flat, group), fixed)
        else:
            torch._foreach_add_(views(flat, group), fixed)
        if last:
            del st.acc[layer]
            # Kept in the compute dtype while it waits (2 B/param on the GPU with bf16).
            self._grad_ready(group.name, flat.to(self.dtype), st)

    def _resident_grad(self, name: str, grads: list[torch.Tensor], st: "_StepState") -> None:
        group = self.store.by_name[name]
        flat = torch.zeros(group.numel, device=self.device, dtype=torch.float32)
        torch._foreach_copy_(views(flat, group), grads)
        self._grad_ready(name, flat, st)

    def _grad_ready(self, name: str, flat: torch.Tensor, st: "_StepState") -> None:
        if self.dist:  # SUM over ranks: every rank holds the exact global gradient (and the same norm)
            self.dist.all_reduce_(flat, f"the gradient of {name}")
        # The group's squared norm on the GPU while the gradient is there (global clipping needs the sum).
        sqnorm = torch.linalg.vector_norm(flat, dtype=torch.float32).square()
        st.sqnorms.append(sqnorm)
        ready = self.streams.record(self.streams.compute)  # the gradient and its norm are written after this
        # grad_placement="host": a host-tier gradient leaves the GPU now (D2H stream, after ``ready``) and its
        # optimizer gets the host buffer and the copy's event; otherwise the GPU tensor and ``ready``.
        flat, ready = self.grad_home.place(name, flat, ready)
        self.optimizer.grad_ready(name, flat, sqnorm, ready)

    # -- weights in ---------------------------------------------------------------------------------
    def _resident_weight(self, name: str) -> list[torch.Tensor]:
        """Load a resident group (embedding or final norm + head) for this step; returns its views."""
        # Host tier: blocks until updated (CPU path), or an event for the copy (GPU update path); GPU tier:
        # ordered by the stream.
        updated = self.optimizer.wait_group(name)
        group = self.store.by_name[name]
        buf = self.resident[name]
        # The GPU update path's kept master, when it holds this group's update (a cast on the GPU, no load).
        kept = self.optimizer.device_source(name)
        src = kept if kept is not None else self.store.stream_source(name)
        with self.streams.use(self.streams.h2d):
            # Last step's kernels that read this buffer were queued on compute before this point.
            self.streams.h2d.wait_stream(self.streams.compute)
            if updated is not None:
                self.streams.h2d.wait_event(updated)
            if src.dtype == buf.dtype:
                buf.copy_(src, non_blocking=True)
            else:
                buf.copy_(src.to(self.device, non_blocking=True))  # cast on the GPU
            if self.placement.tiers[name] == "host" and kept is None:  # else a cast on the device
                self.link.throttle(self.streams.h2d, src.numel() * src.element_size(), "h2d")
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
        if self.dist:  # every rank divides by the global count: gradients then simply add up
            denom = self.dist.all_reduce_count(denom)
        if denom == 0:
            raise ValueError("batch has no labelled tokens (every target is -100 after shifting)")
        return mbs, denom, tokens

    def _recover(self) -> None:
        """After a failed step: drain queued work, undo any early (speculative) update of this step, so the
        engine is as before the step and can be closed or stepped again."""
        self.streams.synchronize()
        self.pool.reset()
        try:
            self.optimizer.abort(self.step_count)
            self.optimizer.wait_all()
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

    def save(self, path: str):
        """Save into checkpoint folder ``path`` (docs/checkpoints.md): a new ``step-NNNNNN/`` folder with
        the weights (HF layout: ``from_pretrained`` and HF load it), AdamW state and step counter, then
        ``path/latest`` switched to it atomically; the engine's own saves beyond the newest
        ``cfg.keep_checkpoints`` are removed. Nothing else in ``path`` is touched; a non-empty folder that
        is not a MegaTrain checkpoint is refused. Returns the step folder (None on ranks other than 0)."""
        self.synchronize()
        written = None
        if self.dist is None or self.dist.rank == 0:  # data parallel: every rank holds the same model
            written = checkpoint.save(self, path, keep=self.cfg.keep_checkpoints)
        if self.dist:
            self.dist.barrier("checkpoint written")  # nobody reads it (resume) before it is complete
        return written

    def save_pretrained(self, path: str):
        """The weights alone as a plain HF folder at ``path`` (new or empty), e.g. to publish a model."""
        self.synchronize()
        written = None
        if self.dist is None or self.dist.rank == 0:
            written = checkpoint.export_hf(self, path)
        if self.dist:
            self.dist.barrier("weights exported")
        return written

    def choosing(self) -> str:
        """Why the next steps are still tuning themselves ("" when they are not): speculate="auto" measuring
        both modes, or the host tier's runtime split running or timing a trial. Training is exact either way;
        only the step time moves. A benchmark's warm-up waits for it (experiments' ``settle_steps``)."""
        return self.optimizer.choosing()

    def transient(self) -> str:
        """Why the step that just ran is not a steady one ("" when it is), known only after it ran: its time
        measured a host update that uploaded kept fp32 masters again (a cold start of the GPU update path, after
        the runtime split moved groups). A benchmark's warm-up may count such a first step as warm-up too."""
        return self.optimizer.transient()

    def memory(self) -> MemoryStats:
        self._sample_rss()
        plan = self.placement
        host_estimate = sum(plan.host_parts.values())
        stats = MemoryStats(host_rss=self._peak_rss,
                            host_pinned=(self.store.pinned_bytes + self.grad_stream.pinned_bytes
                                         + self.grad_home.pinned_bytes + self.host_tier.pinned_bytes),
                            extra={"host_estimate_bytes": host_estimate,
                                   "host_bytes_per_param": (host_estimate / plan.params_on("host")) if plan.params_on("host") else None,
                                   "gpu_estimate_bytes": sum(plan.gpu_parts.values()),
                                   "gpu_resident_layers": plan.gpu_layers, "gpu_tier": plan.gpu_names,
                                   "grad_placement": plan.grads, "mlp_chunk_tokens": plan.mlp_chunk_tokens,
                                   **self.info,
                                   "skipped_steps": self.skipped_steps,
                                   "update_path": self.placement.update_path,
                                   "gpu_path_staging_bytes": self.host_tier.gpu.staging_bytes if self.host_tier.gpu else 0,
                                   # the rates the runtime split used (measured at build on a GPU), for
                                   # comparison with the plan's cost-model rates
                                   "update_rates": self.host_tier.rates.to_dict() if self.host_tier.rates else None,
                                   "update_summary": self.host_tier.summary(),
                                   "speculation_summary": self.optimizer.policy.describe(),
                                   "pool_slots": self.num_pool_slots, "h2d_loads": self.pool.loads})
        if self.device.type == "cuda":
            stats.gpu_peak_allocated = torch.cuda.max_memory_allocated(self.device)
            stats.gpu_peak_reserved = torch.cuda.max_memory_reserved(self.device)
        return stats

    @property
    def info(self) -> dict:
        """The plan's decisions and the step-time model's prediction, flat (for rows): ``recompute_setting``
        (as asked), ``blocks``, ``blocks_kept``, ``recompute_blocks`` ("kept 3/18"), ``gpu_resident_layers``,
        ``predicted_step_s`` and its parts ``predicted_forward_s``, ``predicted_backward_s``,
        ``predicted_recompute_s``, ``predicted_loss_s``, ``predicted_host_update_s``,
        ``predicted_host_update_exposed_s``, ``predicted_gpu_update_s``, ``predicted_h2d_s``,
        ``predicted_d2h_s`` (None / absent on a CPU run, where nothing is predicted)."""
        return self.placement.info()

    @property
    def host_estimate(self) -> dict:
        """The plan's host-tier prediction: total bytes and bytes per host-tier parameter."""
        plan = self.placement
        total, p_host = sum(plan.host_parts.values()), plan.params_on("host")
        return {"total_bytes": total, "num_params": p_host, "bytes_per_param": total / max(1, p_host),
                "parts": dict(plan.host_parts)}

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
            self.optimizer.close()  # joins the worker: nothing reads the host gradient buffers after this
            self.grad_home.close()
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
        """Time since the last mark, added to phase ``name`` (a sequential step passes each phase once per
        micro-batch)."""
        now = time.perf_counter()
        self.stats[name] = self.stats.get(name, 0.0) + now - self.last
        self.last = now
