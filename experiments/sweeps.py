"""Expanding a sweep config into points, and deciding which points not to launch.

A point is one (system, model shape, seq, batch, variant, hardware) combination, run in its own
process. ``expand`` is pure apart from reading presets; ``skip_reason`` applies the memory rules:

* offloading systems (megatrain, zero3, fsdp, gemini): skipped when MegaTrain's host-memory estimate
  (``megatrain.memory.host_estimate``; 12 B/param of fp32 master + Adam m, v plus gradients and
  overhead, a lower bound for every system that keeps fp32 Adam state on the host) exceeds the
  available host RAM;
* all-on-GPU (native): skipped when 12 B/param (fp32 weights + Adam m, v, before gradients and
  activations) exceeds the GPU's memory (the emulated cap, or the real GPU's total); on the CPU when
  16 B/param (weights, gradients, m, v) exceed the available host RAM.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from . import config as C
from .schema import point_id

GIB = 2**30
NATIVE_BYTES_PER_PARAM = 12
NATIVE_CPU_BYTES_PER_PARAM = 16
ON_GPU_SYSTEMS = ("native",)


class SweepError(ValueError):
    """A sweep that cannot be expanded (unknown preset, bad axis value, bad variant option...)."""


@dataclass
class Point:
    id: str
    sweep: str
    system: str
    variant: str
    model: str
    width: float
    spec: dict  # megatrain.spec.ModelSpec as a dict (depth/width applied)
    num_params: int
    seq_len: int
    batch_size: int
    micro_batches: int
    hardware: dict  # name, label, gpu_mem_gib, peak_tflops, emulated
    options: dict  # system options (variant applied)
    activation_checkpointing: bool = True
    factory: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    @property
    def num_layers(self) -> int:
        return int(self.spec["num_layers"])

    def model_spec(self):
        from megatrain.spec import ModelSpec

        return ModelSpec(**self.spec)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_step"] = self.tokens_per_step
        return d


def _container(node) -> Any:
    if isinstance(node, DictConfig) or OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return node


def hardware_entry(hw: dict, *, device: str, gpu_name: str) -> dict:
    """The point's hardware: label for the CSV, cap, peak TFLOPS and the emulated flag."""
    from .envinfo import short_gpu_name

    hw = dict(hw)
    if hw.get("emulated"):
        label = hw["name"]
        peak = hw.get("peak_tflops")
    elif device == "cpu":
        label, peak = "cpu", hw.get("peak_tflops")
    else:
        label = short_gpu_name(gpu_name) if gpu_name else "gpu"
        peak = hw.get("peak_tflops") or C.peak_tflops_for(gpu_name)
    return {"name": hw.get("name", "real"), "label": label, "gpu_mem_gib": hw.get("gpu_mem_gib"),
            "peak_tflops": peak, "emulated": bool(hw.get("emulated", False))}


def merge_options(system: str, base: dict, overrides: dict, variant: str) -> dict:
    """System options with a variant's overrides; typed systems (megatrain) reject unknown keys."""
    schema = C.SYSTEM_OPTION_SCHEMAS.get(system)
    if schema is None:
        out = dict(base)
        out.update(overrides)
        return out
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), base, overrides)
    except Exception as e:  # omegaconf's ConfigKeyError / ValidationError
        valid = ", ".join(f.name for f in dataclasses.fields(schema))
        raise SweepError(f"variant {variant!r} of system {system!r}: {str(e).splitlines()[0]}; "
                         f"valid options: {valid}") from None
    return OmegaConf.to_container(merged)


def expand(cfg, load_option: Callable[[str, str], Any], *, device: str, gpu_name: str = "") -> list[Point]:
    """All points of ``cfg.sweep``, in run order (model-major, so one model's initial weights are
    written once and reused by the systems that follow). ``load_option(group, name)`` returns the
    config of a ``system`` or ``hardware`` group option (the run's selected ones are used as they are,
    overrides included)."""
    from megatrain.spec import PRESETS

    sw = cfg.sweep
    if cfg.system is not None:
        systems = [cfg.system.name]
    else:
        systems = list(sw.systems)
    if not systems:
        raise SweepError(f"sweep {sw.name!r} lists no systems")
    sys_cfgs = {}
    for name in dict.fromkeys(systems):
        node = cfg.system if (cfg.system is not None and cfg.system.name == name) else load_option("system", name)
        sys_cfgs[name] = _container(node)

    hw_names = list(sw.hardware) or [cfg.hardware.name]
    hw_cfgs = {}
    for name in dict.fromkeys(hw_names):
        node = cfg.hardware if cfg.hardware.name == name else load_option("hardware", name)
        hw_cfgs[name] = hardware_entry(_container(node), device=device, gpu_name=gpu_name)

    models = list(sw.models) or [cfg.model.name]
    unknown = [m for m in models if m not in PRESETS]
    if unknown:
        raise SweepError(f"unknown model preset(s) {unknown}; known: {', '.join(PRESETS)}")
    depths = list(sw.depths) or [cfg.model.depth]
    widths = [float(w) for w in (list(sw.widths) or [cfg.model.width])]
    seqs = list(sw.seq_lens) or [cfg.seq_len]
    if sw.tokens_per_step:
        shapes = [(s, max(1, int(t) // int(s))) for s in seqs for t in sw.tokens_per_step]
    else:
        shapes = [(s, b) for s in seqs for b in (list(sw.batch_sizes) or [cfg.batch_size])]
    variants = _container(sw.variants) or {"default": {}}

    for d in depths:
        if d is not None and int(d) < 1:
            raise SweepError(f"depth must be >= 1 layer, got {d}")
    for w in widths:
        if w <= 0:
            raise SweepError(f"width multiplier must be > 0, got {w}")
    for s, b in shapes:
        if s < 1 or b < 1:
            raise SweepError(f"seq_len and batch_size must be >= 1, got seq {s}, batch {b}")
        if cfg.micro_batches > b:
            raise SweepError(f"micro_batches ({cfg.micro_batches}) > batch_size ({b}) at seq {s}")

    points: list[Point] = []
    seen = set()
    for model in models:
        for depth in depths:
            for width in widths:
                spec = PRESETS[model].scaled(depth=depth, width=width)
                for seq, batch in shapes:
                    pspec = spec
                    if seq > spec.max_position_embeddings:  # RoPE has no weights: same initial weights
                        pspec = replace(spec, max_position_embeddings=int(seq))
                    for hw in hw_names:
                        hwe = hw_cfgs[hw]
                        for variant, overrides in variants.items():
                            for system in systems:
                                sc = sys_cfgs[system]
                                opts = merge_options(system, sc.get("options") or {}, overrides or {}, variant)
                                pid = point_id(system, model, spec.num_layers, width, seq, batch, variant,
                                               hwe["label"])
                                if pid in seen:
                                    continue
                                seen.add(pid)
                                points.append(Point(
                                    id=pid, sweep=sw.name, system=system, variant=variant, model=model,
                                    width=width, spec=pspec.to_dict(), num_params=spec.num_params(),
                                    seq_len=int(seq), batch_size=int(batch), micro_batches=int(cfg.micro_batches),
                                    hardware=hwe, options=opts,
                                    activation_checkpointing=bool(sc.get("activation_checkpointing", True)),
                                    factory=sc.get("factory"),
                                ))
    if cfg.only:
        points = [p for p in points if any(fnmatch.fnmatchcase(p.id, pat) for pat in cfg.only)]
    return points


# -- memory rules ---------------------------------------------------------------------------------
def host_estimate(point: Point, device: str) -> dict | None:
    """MegaTrain's host estimate for the point's model (the system's options for megatrain, the engine
    defaults for the others); None if megatrain.memory is unavailable."""
    try:
        from megatrain.memory import host_estimate as est
    except Exception:
        return None
    options = point.options if point.system == "megatrain" else None
    try:
        return est(point.model_spec(), micro_batches=point.micro_batches, options=options,
                   on_gpu=device != "cpu")
    except TypeError:  # an older signature without on_gpu
        return est(point.model_spec(), micro_batches=point.micro_batches, options=options)


def gpu_capacity_bytes(point: Point, real_total: int | None) -> int | None:
    cap = point.hardware.get("gpu_mem_gib")
    if cap:
        return int(float(cap) * GIB)
    return real_total


def skip_reason(point: Point, *, device: str, available_host: int | None, gpu_total: int | None,
                estimate: dict | None) -> str | None:
    """Why the point should not be launched (None: launch it)."""
    p = point.num_params
    if point.system in ON_GPU_SYSTEMS:
        if device == "cpu":  # "all on the device" = all in host RAM: fp32 weights, grads, Adam m, v
            need = NATIVE_CPU_BYTES_PER_PARAM * p
            if available_host is not None and need > available_host:
                return (f"skipped: training on the CPU needs >= {NATIVE_CPU_BYTES_PER_PARAM} B/param = "
                        f"{need / GIB:.1f} GiB > available host RAM {available_host / GIB:.1f} GiB")
            return None
        cap = gpu_capacity_bytes(point, gpu_total)
        need = NATIVE_BYTES_PER_PARAM * p
        if cap is not None and need > cap:
            return (f"skipped: all-on-GPU needs >= {NATIVE_BYTES_PER_PARAM} B/param (fp32 weights + Adam m, v) "
                    f"= {need / GIB:.1f} GiB > {cap / GIB:.1f} GiB of GPU memory")
        return None
    if estimate is not None and available_host is not None and estimate["total_bytes"] > available_host:
        return (f"skipped: engine host estimate {estimate['total_bytes'] / GIB:.1f} GiB "
                f"({estimate['bytes_per_param']:.2f} B/param x {p / 1e9:.2f}B params) > available host RAM "
                f"{available_host / GIB:.1f} GiB")
    return None
