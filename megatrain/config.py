"""Engine configuration: plain dataclasses, importable without torch (the runner uses them as its hydra
schemas). Torch is imported only by the methods that resolve devices and dtypes."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from .system import OptimConfig

_DTYPES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")


def parse_dtype(value):
    """"bf16" / "fp32" / ... (or a torch.dtype) -> torch.dtype."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    try:
        return table[value]
    except KeyError:
        raise ValueError(f"unknown dtype {value!r}; use one of {sorted(table)}") from None


@dataclass
class EngineConfig:
    """Knobs of the streaming engine. Defaults are the "full" system of the paper's ablation."""

    device: str = "auto"  # "auto" (cuda if available), "cuda", "cuda:N" or "cpu"
    compute_dtype: str = "auto"  # "auto": bf16 on CUDA, fp32 on CPU (how it is applied: mixed_precision)
    # How a bf16/fp16 compute dtype is applied (megatrain/compute_policy.py, docs/autocast_mode.md): "layer"
    # (weights cast to it in the GPU slots, each layer computed wholly in it, hidden states in it between
    # layers) or "autocast" (HF mixed precision, the arithmetic of all-on-GPU training under torch.autocast:
    # fp32 slots, resident weights and hidden states; each layer and the loss head run under
    # torch.autocast(compute dtype), which casts only matmul inputs; 2x the slot and boundary bytes). With an
    # fp32 compute dtype both are plain fp32.
    mixed_precision: str = "layer"
    # Weight slots on the GPU. 2 = double buffering (load layer i+1 while i computes); 1 = the
    # synchronous ablation: no prefetch at all, each load issued when compute needs it and serialised
    # after queued compute. With checkpoint interval K the pool holds K + num_slots - 1 slots, because a
    # block's K layers must stay resident from recompute through backward (loaded once, not twice).
    num_slots: int = 2
    # Layers per activation-checkpoint block (K). Boundaries are kept every K layers; 0 = all layers.
    checkpoint_interval: int = 1
    # Pinned host slabs receiving weight gradients on the D2H stream. 0 = no pool: each layer's gradient
    # is copied synchronously to fresh pageable memory (the "no slab pool" ablation).
    grad_slabs: int = 4
    # Run the CPU AdamW of step n in a background thread, overlapping the next step's forward: layer i's
    # next load waits only for layer i's update. False: the update finishes inside step().
    overlap_optimizer: bool = True
    # What crosses PCIe for weights: "fp32" master (cast to compute dtype on the GPU; 4 B/param) or a
    # pinned "bf16" shadow refreshed by the optimizer (2 B/param over PCIe, +2 B/param host).
    stream_dtype: str = "fp32"
    # Gradient accumulation: the batch given to step() is split into this many micro-batches.
    micro_batches: int = 1
    # Tokens per chunk of the final norm + LM head + cross-entropy (full logits never exist at once).
    loss_chunk_tokens: int = 4096
    # Pin the fp32 master buffers (page-locked H2D source). Only on CUDA.
    pin_memory: bool = True
    # Which host-tier state is page-locked (cudaHostRegister; CUDA with pin_memory only): "stream" (the default:
    # the buffer that crosses PCIe, the fp32 master or the bf16 shadow with stream_dtype="bf16") or "all" (the
    # master, AdamW m and v and the shadow; one that cannot be registered stays pageable, with a warning).
    # Measured (H100, ec20ff4, 2026-12-07d): no gain. The kernel alone on 2e9 params, pageable -> page-locked ->
    # pageable again: 3.56 / 4.10 / 4.22 Gparam/s (the first phase warms; locked = pageable within 3 %), under
    # H2D+D2H copies 1.57 / 1.51 / 1.49; the 7B 8x1024 CPU path in the same runner 131.8 vs 132.8 TFLOPS fp32,
    # 110.0 vs 107.8 with the bf16 shadow (results/update_path_pinning_h100_2026-12-07d.md). The lead that made
    # it (the hybrid's CPU kernel faster than the CPU path's) was an off-by-one in the analysis. Kept as a
    # setting for hosts where page-locking may matter; "stream" stays the default.
    pin_host_state: str = "stream"
    # Refuse to build unless estimate <= available host RAM - margin.
    host_margin_gib: float = 2.0
    # Tiered memory: decoder layers that live entirely on the GPU (fp32 master + AdamW m, v, updated by a
    # fused AdamW on the GPU). "auto": as many as fit after the streaming working set (see
    # megatrain/planner.py); an integer N: layers 0..N-1 (plus embedding and head) on the GPU; "0": pure
    # streaming, as in the paper. Given as a string so one type carries both (hydra: gpu_resident=12).
    gpu_resident: str = "auto"
    # GPU memory kept free by the placement plan (GiB), on top of its working-set estimate.
    gpu_margin_gib: float = 6.0
    # Host AdamW of a layer starts as soon as its gradient is on the host (during the backward), with
    # clip coefficient 1; if the step's global norm then clips, those updates are undone and redone
    # exactly. "auto": only where the previous step did not clip, and there as measured step times decide
    # (megatrain/optim.py SpeculationChooser: a few steps speculating, a few without, the faster kept with a 2 %
    # margin for speculation; per step ``speculation_decision`` in the stats); "always"; "never".
    speculate: str = "auto"
    # Long context. 0 = the model's own max_position_embeddings; N = raise (or lower) it to N positions
    # (RoPE as the family defines it; any rope_scaling in the config is passed through unchanged).
    max_position_embeddings: int = 0
    # Tokens per chunk when recomputing/backpropagating a layer's MLP (bounds the per-layer working set
    # at long sequence lengths). 0 = "auto": never at <= 131072 tokens per micro-batch; above, on a GPU the
    # placement plan decides (unchunked when that fits without placing less on the GPU; megatrain/planner.py),
    # on the CPU chunks of 16384. -1 = never chunk.
    mlp_chunk_tokens: int = 0
    # Block-boundary activations: "gpu" (kept on the GPU), "host" (offloaded to pinned host memory on the
    # D2H stream, prefetched back for the backward) or "auto" (host only when the GPU cannot hold them).
    boundary_offload: str = "auto"
    # Where the host tier's gradients wait until the step's global norm is known (megatrain/grad_placement.py):
    # "gpu" (on the GPU, c B/param for every group; streamed through the slabs into the host update), "host"
    # (each host-tier group's gradient leaves the GPU on the D2H stream as soon as it is final, into a pinned
    # fp32 host buffer, 4 B/param of host RAM; only the GPU tier's gradients stay on the GPU) or "auto"
    # ("gpu" when the placement plan fits the GPU with them there, else "host").
    grad_placement: str = "auto"
    # Activations of each checkpoint block: kept from the forward to the backward (no recompute) or recomputed
    # from the block's boundary. "all": recompute every block (the paper); "none": keep every block (refused
    # when that does not fit the GPU); "auto": the placement plan keeps what fits in the GPU memory the tiers
    # leave, and where a GPU byte could hold a GPU-tier layer or kept activations the step-time model picks
    # the faster split (megatrain/planner.py, cost_model.py). On a CPU run "auto" recomputes as "all".
    recompute: str = "auto"
    # With several micro-batches: "layers" runs each layer on every micro-batch before the next layer (each
    # layer loaded twice per step; every micro-batch's activations held at once); "sequential" runs forward
    # and backward one micro-batch at a time (loaded twice per micro-batch; one micro-batch's activations
    # held, so more blocks can keep theirs; every layer's fp32 gradient accumulator lives through the step);
    # "auto": the placement plan picks (sequential only where the step-time model predicts it
    # CONTESTED_GAIN faster, e.g. a model wholly on the GPU tier, whose loads are casts on the device).
    micro_batch_schedule: str = "auto"
    # Emulate a host link (host <-> GPU) of this many GB/s each way, slower than the real one: each
    # weight/gradient/activation copy over it is followed on its copy stream by a GPU sleep for the
    # difference (megatrain/link.py; CUDA only). None = the real link, untouched.
    host_link_gbps: Optional[float] = None
    # The host tier's AdamW (megatrain/streamed_update.py): "cpu" (the CPU kernel updates every host-tier
    # group), "hybrid" (after the norm, some groups' fp32 master, m and v are streamed through the GPU and
    # updated there by the fused kernel while the CPU kernel updates the others; exact, clipping included) or
    # "auto" (the default since 2026-12-07j: the placement plan predicts the step with each,
    # megatrain/cost_model.py, and takes "hybrid" where it is CONTESTED_GAIN faster; "cpu" on a CPU run and
    # with data parallel). Why the default: in every same-run pair measured, the hybrid was faster (1.12-1.78x
    # on pure streaming, H100 nodes D-H and the H200) or tied (14B tiered on the H200 1.00x, where "auto"
    # predicts "cpu"; one fast-host H100 0.98x within the ranges), and the runtime split measures the CPU path
    # alone and keeps it where it is faster (docs/engine.md "Choosing it"; README's update_path table).
    update_path: str = "auto"
    # With "hybrid": which host-tier groups take the GPU path. "auto": the split of the bandwidth model
    # (megatrain/update_split.py, rates measured at build on a GPU); or a comma list of group names
    # ("embed,layer.0,layer.3") forced onto it in every step (tests, ablations).
    gpu_path_groups: str = "auto"
    # With "hybrid" on a GPU: GiB the placement plan keeps free for the GPU path's staging (two rotating
    # master+m+v chunk buffers, ~0.9 GiB at full chunk size, then kept masters, 4 B/param, in forward
    # order); GPU memory the plan leaves unused beyond its margin is used as well. None ("auto"): the plan
    # chooses it (planner.STAGING_CANDIDATES_GIB, 1 GiB unless a larger reserve is predicted RESERVE_GAIN
    # faster: kept masters bought with kept activation blocks or GPU-tier layers).
    update_staging_gib: Optional[float] = None
    # With "hybrid": upload some GPU-path groups' master, m and v during the backward, as their gradients
    # arrive (only the update needs the clip coefficient), into buffers held until the norm (12 B/param of
    # the staging budget): after the norm only their update and download are left. How many: what the
    # backward's spare H2D bandwidth carries (measured after the first step) and the budget holds.
    gpu_path_prefetch: bool = False
    # Cores of the host tier's CPU update (megatrain/host_adamw.py, HostAdamW.bind_cores): "none" (default: the
    # OS schedules the worker's OpenMP threads anywhere), "all-but-N" (the main thread, which keeps the GPU fed,
    # is bound to the N lowest-numbered cores this process may use, the update worker and the OpenMP teams it
    # starts to the others, one kernel thread per core) or "auto" (the default: "all-but-1" on a one-process GPU
    # run; none on the CPU, where the main thread computes, and none with several ranks, whose main threads
    # would share the lowest core). Measured on the H200 (a9736ef, sweep update_path, clipping fires): 14B
    # tiered 16x1024 326.7 TFLOPS bound vs 307.4 not (1.06x, host update busy 1.74-1.88 vs 2.04-2.10 s); 3B
    # pure streaming 244.4 vs 246.1 (within noise).
    host_update_cores: str = "auto"
    attn_implementation: str = "sdpa"
    seed: int = 0
    # Saves kept in a checkpoint folder: ``save`` removes the engine's own step folders beyond the newest N.
    keep_checkpoints: int = 2
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        if isinstance(self.optim, dict):
            self.optim = OptimConfig(**self.optim)
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval must be >= 0 (0 = all layers), got {self.checkpoint_interval}")
        if self.grad_slabs < 0:
            raise ValueError(f"grad_slabs must be >= 0, got {self.grad_slabs}")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.stream_dtype not in ("fp32", "bf16"):
            raise ValueError(f"stream_dtype must be 'fp32' or 'bf16', got {self.stream_dtype!r}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 saves, got {self.keep_checkpoints}")
        if self.loss_chunk_tokens < 1:
            raise ValueError("loss_chunk_tokens must be >= 1")
        self.gpu_resident = str(self.gpu_resident).strip().lower()
        if self.gpu_resident != "auto" and not (self.gpu_resident.isdigit()):
            raise ValueError(f"gpu_resident must be 'auto' or a number of decoder layers >= 0, got {self.gpu_resident!r}")
        if self.speculate not in ("auto", "always", "never"):
            raise ValueError(f"speculate must be 'auto', 'always' or 'never', got {self.speculate!r}")
        if self.boundary_offload not in ("auto", "gpu", "host"):
            raise ValueError(f"boundary_offload must be 'auto', 'gpu' or 'host', got {self.boundary_offload!r}")
        if self.recompute not in ("auto", "all", "none"):
            raise ValueError(f"recompute must be 'auto', 'all' or 'none', got {self.recompute!r}")
        if self.recompute == "none" and self.mlp_chunk_tokens > 0:
            raise ValueError(f"recompute='none' keeps every layer's activations, but mlp_chunk_tokens="
                             f"{self.mlp_chunk_tokens} recomputes the MLP in the backward; use one or the other")
        if self.recompute == "none" and self.boundary_offload == "host":
            raise ValueError("recompute='none' keeps every block's activations on the GPU: there are no block "
                             "boundaries for boundary_offload='host' to offload; use one or the other")
        if self.micro_batch_schedule not in ("auto", "layers", "sequential"):
            raise ValueError(f"micro_batch_schedule must be 'auto', 'layers' or 'sequential', got "
                             f"{self.micro_batch_schedule!r}")
        if self.grad_placement not in ("auto", "gpu", "host"):
            raise ValueError(f"grad_placement must be 'auto', 'gpu' or 'host', got {self.grad_placement!r}")
        if self.max_position_embeddings < 0:
            raise ValueError(f"max_position_embeddings must be >= 0 (0 = the model's), got {self.max_position_embeddings}")
        if self.mlp_chunk_tokens < -1:
            raise ValueError(f"mlp_chunk_tokens must be -1 (never), 0 (auto) or a positive chunk size, got {self.mlp_chunk_tokens}")
        if self.gpu_margin_gib < 0:
            raise ValueError(f"gpu_margin_gib must be >= 0, got {self.gpu_margin_gib}")
        if self.host_link_gbps is not None and not self.host_link_gbps > 0:
            raise ValueError(f"host_link_gbps must be > 0 GB/s (None = the real link), got {self.host_link_gbps}")
        if self.update_path not in ("cpu", "hybrid", "auto"):
            raise ValueError(f"update_path must be 'cpu', 'hybrid' or 'auto', got {self.update_path!r}")
        self.pin_host_state = str(self.pin_host_state).strip().lower()
        if self.pin_host_state not in ("stream", "all"):
            raise ValueError(f"pin_host_state must be 'stream' or 'all', got {self.pin_host_state!r}")
        if self.update_staging_gib is not None and self.update_staging_gib < 0:
            raise ValueError(f"update_staging_gib must be >= 0, got {self.update_staging_gib}")
        self.host_update_cores = str(self.host_update_cores).strip().lower()
        if self.host_update_cores not in ("none", "auto"):
            parse_all_but(self.host_update_cores)  # raises the one-line error
        self.gpu_path_groups = str(self.gpu_path_groups).strip()
        if not self.gpu_path_groups:
            raise ValueError("gpu_path_groups must be 'auto' or a comma list of host-tier group names")
        if self.compute_dtype != "auto" and self.compute_dtype not in _DTYPES:
            raise ValueError(f"compute_dtype must be 'auto' or one of {list(_DTYPES)}, got {self.compute_dtype!r}")
        if self.mixed_precision not in ("layer", "autocast"):
            raise ValueError(f"mixed_precision must be 'layer' or 'autocast', got {self.mixed_precision!r}")
        if self.mixed_precision == "autocast" and self.stream_dtype == "bf16":
            # The shadow would round the fp32 norm weights to bf16, which autocast keeps in fp32.
            raise ValueError("mixed_precision='autocast' keeps RMSNorm weights in fp32 but stream_dtype='bf16' "
                             "streams them rounded to bf16; use stream_dtype='fp32'")

    @property
    def pins_all_host_state(self) -> bool:
        """Whether the host state is page-locked whole (pin_host_state="all", with pin_memory)."""
        return self.pin_memory and self.pin_host_state == "all"

    def resolved_device(self):
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {self.device!r} requested but CUDA is not available")
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be cuda or cpu, got {self.device!r}")
        return dev

    def resolved_compute_dtype(self):
        """The dtype the matmuls compute in (with mixed_precision "layer", every op of a layer)."""
        import torch

        if self.compute_dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return parse_dtype(self.compute_dtype)

    def resolved_buffer_dtype(self):
        """The dtype of the GPU weight slots, resident weights, hidden states and layer gradients: the compute
        dtype, or fp32 with mixed_precision "autocast" (autocast casts matmul inputs at each use)."""
        import torch

        return torch.float32 if self.mixed_precision == "autocast" else self.resolved_compute_dtype()

    def to_dict(self) -> dict:
        return asdict(self)


def parse_all_but(setting: str) -> int:
    """host_update_cores "all-but-N" -> N (>= 1); a one-line ValueError otherwise."""
    head, _, n = setting.rpartition("-")
    if head != "all-but" or not n.isdigit() or int(n) < 1:
        raise ValueError(f"host_update_cores must be 'none', 'auto' or 'all-but-N' (N >= 1), got {setting!r}")
    return int(n)
