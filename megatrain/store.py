"""The model's store. Per group (embedding, each decoder layer, final norm + head) one contiguous fp32
master buffer and fp32 AdamW ``m`` and ``v``, on the group's tier: host RAM (streamed) or the GPU
(resident, see megatrain/placement.py).

Parameters are views into the flat buffers, so a layer moves to the GPU as ONE bulk copy and the
optimizer runs ONE fused AdamW call per layer.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .arch import EMBED_NAME, HEAD_NAME, LAYER_PREFIX, NORM_NAME, ParamSpan, flat_layout
from .pinning import PinError, pin_in_place, unpin


@dataclass
class Group:
    """A unit of streaming and of optimizer work."""

    name: str  # "embed", "layer.{i}", "final"
    kind: str  # "embed" | "layer" | "final"
    index: int  # layer index, -1 otherwise
    spans: list[ParamSpan]  # local parameter names and offsets in the flat buffer
    hf_names: list[str]  # full HF state-dict names, aligned with ``slots``
    numel: int  # flat size including alignment padding

    @property
    def num_params(self) -> int:
        return sum(s.numel for s in self.spans)


def make_groups(meta_model) -> list[Group]:
    """Groups in the order the forward pass needs them: embed, layer 0..L-1, final."""
    groups = []
    embed = meta_model.model.embed_tokens.weight
    slots, n = flat_layout([("weight", embed.shape)])
    groups.append(Group("embed", "embed", -1, slots, [EMBED_NAME], n))
    for i, layer in enumerate(meta_model.model.layers):
        named = [(name, p.shape) for name, p in layer.named_parameters()]
        if any(True for _ in layer.buffers()):
            raise NotImplementedError("decoder layers with buffers are not supported by the streaming engine")
        slots, n = flat_layout(named)
        groups.append(Group(f"layer.{i}", "layer", i, slots, [LAYER_PREFIX.format(i) + s for s, _ in named], n))
    final = [("norm.weight", meta_model.model.norm.weight.shape)]
    names = [NORM_NAME]
    if not meta_model.config.tie_word_embeddings:
        final.append(("lm_head.weight", meta_model.lm_head.weight.shape))
        names.append(HEAD_NAME)
    slots, n = flat_layout(final)
    groups.append(Group("final", "final", -1, slots, names, n))
    return groups


def views(flat: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Per-parameter views (shaped) into a group's flat buffer."""
    return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in group.spans]


class ModelStore:
    """fp32 master + AdamW m, v + step count per group, each group on its tier's device.

    Host-tier groups live in CPU memory; their master (or the bf16 shadow, when streaming bf16) is
    page-locked with ``cudaHostRegister`` so H2D copies are true DMA (55 GB/s measured vs 18 pageable).
    We register plain allocations instead of ``pin_memory=True`` because torch's pinned caching allocator
    rounds each block up to a power of two (up to 2x host memory on big layers).
    GPU-tier groups live on the compute device: their weights never cross PCIe.
    There are no gradient buffers here: gradients wait on the GPU until their optimizer consumes them.
    """

    def __init__(self, groups: list[Group], devices: dict[str, torch.device], shadow_dtype: torch.dtype | None,
                 pin: bool, shared: dict[tuple[str, str], torch.Tensor] | None = None, pin_all: bool = False):
        """``shared``: (group, "master" | "m" | "v" | "shadow") -> a zero-filled tensor to use instead of a
        private allocation (data parallel: the node's host tier in shared memory, megatrain/distributed.py).
        ``pin``: page-lock each host-tier group's streamed buffer (the master, or the shadow); a failure raises.
        ``pin_all`` (with ``pin``; EngineConfig.pin_host_state="all"): page-lock its master, m and v too (measured
        no faster on an H100, megatrain/config.py); one that cannot be registered stays pageable (correct), with
        a warning."""
        self.groups = groups
        self.by_name = {g.name: g for g in groups}
        self.devices = dict(devices)
        dev = self.devices
        shared = shared or {}

        def new(g: Group, what: str, dtype=torch.float32, device=None):
            t = shared.get((g.name, what))
            return t if t is not None else torch.zeros(g.numel, dtype=dtype, device=device or dev[g.name])

        self.master = {g.name: new(g, "master") for g in groups}
        self.m = {g.name: new(g, "m") for g in groups}
        self.v = {g.name: new(g, "v") for g in groups}
        # The bf16 shadow exists only for host-tier groups (GPU-tier weights are cast on the GPU).
        self.shadow = ({g.name: new(g, "shadow", shadow_dtype, "cpu") for g in groups if dev[g.name].type == "cpu"}
                       if shadow_dtype is not None else None)
        # One optimizer step counter per group (a tensor on the group's device, as the fused kernels expect).
        self.steps = {g.name: torch.zeros((), dtype=torch.float32, device=dev[g.name]) for g in groups}
        self._registered: list[torch.Tensor] = []
        if pin:
            for name in self.host_names:
                self._register(self.stream_source(name))
            if pin_all:
                self._pin_state()

    @property
    def host_names(self) -> list[str]:
        return [g.name for g in self.groups if self.devices[g.name].type == "cpu"]

    def _register(self, t: torch.Tensor) -> None:
        self._registered.append(pin_in_place(t, "a host-tier tensor"))

    def _pin_state(self) -> None:
        """Page-lock every host-tier group's master, m and v not registered yet (the streamed buffer is)."""
        for name in self.host_names:
            for table in (self.master, self.m, self.v):
                t = table[name]
                if self.is_pinned(t):
                    continue
                try:
                    self._register(t)
                except PinError as exc:  # pageable: the CPU kernel is only slower on it
                    warnings.warn(f"pin_host_state='all': {exc}; left pageable", RuntimeWarning)
                    if exc.code == 2:  # page-locked memory exhausted: the next ones would fail the same way
                        return

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes lie inside a buffer this store page-locked."""
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        return any(r.data_ptr() <= lo and hi <= r.data_ptr() + r.numel() * r.element_size()
                   for r in self._registered)

    @property
    def pinned_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._registered)

    def bytes_on(self, device_type: str) -> int:
        """Bytes this store allocated on devices of ``device_type`` ("cpu" or "cuda")."""
        total = 0
        for table in (self.master, self.m, self.v, self.shadow or {}):
            total += sum(t.numel() * t.element_size() for t in table.values() if t.device.type == device_type)
        return total

    def stream_source(self, name: str) -> torch.Tensor:
        """The buffer a group's compute weights are made from (H2D for host tier, a cast on the GPU)."""
        if self.shadow is not None and name in self.shadow:
            return self.shadow[name]
        return self.master[name]

    def refresh_shadow(self, name: str, lo: int = 0, hi: int | None = None) -> None:
        """Copy the master (elements ``lo:hi``, default all) into the bf16 shadow, if there is one."""
        if self.shadow is not None and name in self.shadow:
            self.shadow[name][lo:hi].copy_(self.master[name][lo:hi])

    def param_views(self, name: str) -> dict[str, torch.Tensor]:
        """HF name -> fp32 master view (on the group's device)."""
        g = self.by_name[name]
        return dict(zip(g.hf_names, views(self.master[name], g)))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All master weights as HF-named tensors: views for the host tier, CPU copies for the GPU tier."""
        out = {}
        for g in self.groups:
            out.update({k: (v if v.device.type == "cpu" else v.cpu()) for k, v in self.param_views(g.name).items()})
        return out

    def close(self) -> None:
        for t in self._registered:
            unpin(t)
        self._registered.clear()
