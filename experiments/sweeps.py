"""Expanding a sweep config into jobs, checking them, and deciding which not to launch.

A job is one point (system, model shape, seq, batch, variant, hardware) with everything its process
needs, as one typed object (``Job``): the runner writes it as ``job.json``, the point process reads it
back. ``expand`` is pure apart from reading presets; ``validate`` refuses a sweep with an impossible
point before anything runs; ``skip_reason`` applies the memory rules:

* MegaTrain on a GPU: the engine's own two-tier placement plan (``megatrain.memory.plan_for_spec``, the
  GPU tier filled first, on the real or emulated GPU): skipped when the plan refuses the GPU side or its
  host side exceeds the available host RAM;
* other offloading systems: skipped when MegaTrain's pure-streaming host estimate
  (``megatrain.memory.host_estimate``: 12 B/param of fp32 master + Adam m, v plus overhead, a lower bound
  for every system that keeps fp32 Adam state on the host) exceeds the available host RAM;
* on-device systems (native): skipped when 12 B/param (fp32 weights + Adam m, v, before gradients and
  activations) exceeds the GPU's memory (the emulated cap, or the real GPU's total); on the CPU when
  16 B/param (weights, gradients, m, v) exceed the available host RAM;
* a system whose record says it needs a GPU, on a CPU.

"Available host RAM" is the point's own view (``available_host``): under a profile's ``host_ram_gib``
cap, the capped value the engine's plan will see in the point process.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from baselines.registry import SYSTEM_RECORDS, option_names
from megatrain.system import OptimConfig

from . import config as C
from .schema import point_id
from .sft_config import problem as sft_problem

class SweepError(ValueError):
    """A sweep that cannot be expanded or run (unknown preset, bad axis value, invalid point...)."""


@dataclass
class Job:
    """One point of a sweep and everything its process needs (``job.json``)."""

    id: str
    sweep: str
    system: str
    variant: str
    model: str
    width: float
    spec: dict  # megatrain.spec.ModelSpec as a dict (depth/width and max_position_embeddings applied)
    num_params: int
    seq_len: int
    batch_size: int
    micro_batches: int
    # hardware_entry: name, label, gpu_mem_gib, peak_tflops, emulated, gpus, cpu_cores, host_ram_gib, host_link_gbps
    hardware: dict
    # The system's options, variant applied. A typed system's are its schema (megatrain: the whole
    # ``EngineConfig`` the engine is built with, run-level fields included, made once by ``merge_options``
    # and handed on untouched); any other system's, a dict its builder reads.
    options: Any
    activation_checkpointing: bool = True
    factory: str | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 5
    warmup_steps: int = 2
    settle_steps: int = 0  # more warm-up steps, at most, while the system is still choosing (RunConfig)
    seed: int = 0
    data: str = "synthetic"  # "synthetic" | "text" (RunConfig.data)
    device: str = "cpu"
    dtype: str = "auto"
    torch_threads: int | None = None
    gpus: int = 1
    # filled by the runner
    point_dir: str = ""
    init_dir: str = ""
    cache_dir: str = ""
    host_estimate_bytes: int | None = None
    sft: dict | None = None  # sweep.sft (experiments/sft_config.py): an SFT point (experiments/sft_point.py)
    tiers: dict | None = None  # the engine plan's placement as numbers (skips.tier_counts), when predicted

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one step over every GPU (``batch_size`` rows per GPU)."""
        return self.seq_len * self.batch_size * self.gpus

    @property
    def num_layers(self) -> int:
        return int(self.spec["num_layers"])

    def model_spec(self):
        from megatrain.spec import ModelSpec

        return ModelSpec(**self.spec)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_dict(cls, d: dict) -> "Job":
        d = dict(d)
        optim = _optim(d.pop("optim", None))
        schema = C.SYSTEM_OPTION_SCHEMAS.get(d["system"])
        if schema is not None and isinstance(d.get("options"), dict):  # job.json: the typed options again
            opts = dict(d["options"])
            if "optim" in opts:
                opts["optim"] = _optim(opts["optim"])
            d["options"] = schema(**opts)
        return cls(optim=optim, **d)

    @classmethod
    def load(cls, path) -> "Job":
        return cls.from_dict(json.loads(Path(path).read_text()))


def _optim(d: dict | None) -> OptimConfig:
    """``OptimConfig`` from its dict (JSON turns ``betas`` into a list)."""
    d = dict(d or {})
    if "betas" in d:
        d["betas"] = tuple(d["betas"])
    return OptimConfig(**d)


def _container(node) -> Any:
    if isinstance(node, DictConfig) or OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return node


def _max_gpus(system: str) -> int:
    from baselines.registry import record

    return record(system).max_gpus


CAP_FIELDS = ("gpu_mem_gib", "cpu_cores", "host_ram_gib", "host_link_gbps")  # what makes a profile an emulation


def profile_error(hw: dict) -> str | None:
    """Why a hardware profile is malformed, whatever the machine (None: it is not)."""
    name = hw.get("name", "real")
    caps = [k for k in CAP_FIELDS if hw.get(k) is not None]
    if caps and not hw.get("emulated"):  # a capped row labelled as the real GPU would misreport the machine
        return (f"hardware profile {name!r} sets {', '.join(caps)} but emulated: false; a capped profile "
                f"is an emulation (emulated: true, and its name is the CSV label)")
    cores = hw.get("cpu_cores")
    if cores is not None and int(cores) < 1:
        return f"hardware profile {name!r}: cpu_cores={cores} must be >= 1 (null = all cores)"
    for key in ("gpu_mem_gib", "host_ram_gib", "host_link_gbps"):
        if hw.get(key) is not None and float(hw[key]) <= 0:
            return f"hardware profile {name!r}: {key}={hw[key]} must be > 0 (null = no cap)"
    return None


def hardware_entry(hw: dict, *, device: str, gpu_name: str) -> dict:
    """The point's hardware: label for the CSV, caps, peak TFLOPS and the emulated flag. Raises
    ``SweepError`` for a malformed profile (whether this machine has the cores is ``invalid_reason``'s)."""
    from .envinfo import short_gpu_name

    hw = dict(hw)
    error = profile_error(hw)
    if error:
        raise SweepError(error)
    real_peak = None if device == "cpu" else C.peak_tflops_for(gpu_name)
    if hw.get("emulated"):
        label = hw["name"]
        # a profile without its own peak (CPU cores / host RAM caps) computes on the real GPU
        peak = hw.get("peak_tflops") or real_peak
    elif device == "cpu":
        label, peak = "cpu", hw.get("peak_tflops")
    else:
        label = short_gpu_name(gpu_name) if gpu_name else "gpu"
        peak = hw.get("peak_tflops") or real_peak
    gpus = hw.get("gpus")
    if gpus and int(gpus) > 1:  # several GPUs of the node, data parallel: its own label (and point ids)
        label = f"{label}x{int(gpus)}"
    return {"name": hw.get("name", "real"), "label": label, "gpu_mem_gib": hw.get("gpu_mem_gib"),
            "peak_tflops": peak, "emulated": bool(hw.get("emulated", False)), "gpus": gpus,
            "cpu_cores": hw.get("cpu_cores"), "host_ram_gib": hw.get("host_ram_gib"),
            "host_link_gbps": hw.get("host_link_gbps")}


def emulates_host_link(system: str) -> bool:
    """Whether ``system`` can run under a profile's ``host_link_gbps``: only one whose option schema has the
    engine's field (MegaTrain); no baseline can slow its own copies."""
    schema = C.SYSTEM_OPTION_SCHEMAS.get(system)
    return schema is not None and any(f.name == "host_link_gbps" for f in dataclasses.fields(schema))


def torch_threads_for(run_level: int | None, hw: dict) -> int | None:
    """The point's torch threads: ``torch_threads`` when given (an explicit choice wins), else the
    profile's ``cpu_cores`` (one thread per core left to the process: more would only oversubscribe
    them), else None (torch's default)."""
    return run_level if run_level is not None else hw.get("cpu_cores")


def merge_options(system: str, base: dict, overrides: dict, variant: str, run_level: dict,
                  cli_keys: frozenset = frozenset()):
    """System options with a variant's overrides. A typed system (megatrain) gets its schema: the one
    ``EngineConfig`` its engine is built with, made here and nowhere else (unknown keys and bad values fail
    before anything runs), with the run-level fields (the same for every system: device, compute dtype,
    micro-batches, optimizer, positions, seed, the profile's host link) from ``run_level``; setting one of
    those as a system option is an error. Any other system gets a dict. An option set on the command line
    (``cli_keys``) that a variant sets to another value is refused: neither may silently win."""
    for key in sorted(set(overrides) & set(cli_keys)):
        if str(overrides[key]) != str(base.get(key)):
            raise SweepError(f"system.options.{key}={base.get(key)} on the command line clashes with variant "
                             f"{variant!r} ({key}={overrides[key]}); drop one of them (the sweep's variants are in "
                             f"conf/sweep/<name>.yaml)")
    schema = C.SYSTEM_OPTION_SCHEMAS.get(system)
    if schema is None:
        out = dict(base)
        out.update(overrides)
        return out
    defaults = OmegaConf.to_container(OmegaConf.structured(schema))
    try:
        merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(schema), base, overrides))
    except Exception as e:  # omegaconf's ConfigKeyError / ValidationError
        valid = ", ".join(f.name for f in dataclasses.fields(schema))
        raise SweepError(f"variant {variant!r} of system {system!r}: {str(e).splitlines()[0]}; "
                         f"valid options: {valid}") from None
    for key in C.RUN_LEVEL_ENGINE_FIELDS:
        if merged.get(key) != defaults.get(key):
            raise SweepError(f"system {system!r} option {key!r} is run-level (the same for every system): "
                             f"set {key}=... instead of system.options.{key}")
    for key in C.HARDWARE_ENGINE_FIELDS:
        if merged.get(key) != defaults.get(key):
            raise SweepError(f"system {system!r} option {key!r} belongs to the hardware profile (its row must "
                             f"say emulated): set hardware.{key}=... or use a profile with it")
    merged.update(run_level)
    try:
        return schema(**merged)
    except (TypeError, ValueError) as e:
        raise SweepError(f"variant {variant!r} of system {system!r}: {e}") from None


def compute_dtype(dtype: str, device: str) -> str:
    """The run's ``dtype`` as the point computes in it: "auto" is bf16 on a GPU; a CPU computes in fp32."""
    if device == "cpu":
        return "fp32"
    return {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)


# Variant keys that set a run-level field of every system alike: the batches (``data``), the compute dtype
# (``dtype``), the gradient-accumulation split (``micro_batches``: the same step in another summation order,
# e.g. all-on-GPU's spread at its own rounding), and ``repeat`` (changes nothing: the same run again as its
# own point, e.g. to measure a system's run-to-run spread; without it an identical variant is skipped as a
# duplicate).
VARIANT_RUN_KEYS = ("data", "dtype", "micro_batches", "repeat")
DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32")


def split_variant(system: str, overrides: dict) -> tuple[dict, dict]:
    """(system options, run fields) of a variant for ``system``. ``optim.<field>`` keys change the
    optimizer of every system (e.g. ``optim.max_grad_norm: 0``, no clipping) and ``VARIANT_RUN_KEYS``
    their batches, compute dtype, micro-batch split or repetition (returned as ``__data__``, ``__dtype__``,
    ``__micro_batches__``, ``__repeat__``); the
    other keys are system
    options: a typed system (megatrain) gets them all (a typo fails in ``merge_options``), any other
    system gets none of the engine's own option names (they mean nothing to it) unless it has an option of
    that name itself (ZenFlow's ``pin_memory``: its variant ``unpinned`` would otherwise be dropped as the
    engine's and equal its default)."""
    optim = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("optim.")}
    rest = {k: v for k, v in overrides.items() if not k.startswith("optim.") and k not in VARIANT_RUN_KEYS}
    for key in VARIANT_RUN_KEYS:  # like the optimizer, these belong to every system
        if key in overrides:
            optim[f"__{key}__"] = overrides[key]
    if C.SYSTEM_OPTION_SCHEMAS.get(system) is None:
        engine_fields = {f.name for schema in C.SYSTEM_OPTION_SCHEMAS.values() for f in dataclasses.fields(schema)}
        own = option_names(system) if any(k in engine_fields for k in rest) else frozenset()
        rest = {k: v for k, v in rest.items() if k not in engine_fields or k in own}
    return rest, optim


def optim_with(optim: OptimConfig, fields: dict, variant: str) -> OptimConfig:
    """``optim`` with a variant's ``optim.<field>`` values; an unknown field is refused."""
    fields = {k: v for k, v in fields.items() if not k.startswith("__")}  # run fields (split_variant)
    if not fields:
        return optim
    valid = {f.name for f in dataclasses.fields(OptimConfig)}
    bad = sorted(set(fields) - valid)
    if bad:
        raise SweepError(f"variant {variant!r}: unknown optimizer field(s) {bad}; valid: {', '.join(sorted(valid))}")
    return replace(optim, **fields)


def expand(cfg, load_option: Callable[[str, str], Any], *, device: str, gpu_name: str = "",
           cli_options: frozenset = frozenset()) -> list[Job]:
    """All jobs of ``cfg.sweep``, in run order (model-major, so one model's initial weights are
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
    if int(sw.long_seq_from) < 0 or int(sw.long_steps) < 1 or int(sw.long_warmup_steps) < 0:
        raise SweepError(f"long points: long_seq_from ({sw.long_seq_from}) must be >= 0, long_steps "
                         f"({sw.long_steps}) >= 1 and long_warmup_steps ({sw.long_warmup_steps}) >= 0")
    max_pos = int(cfg.max_position_embeddings)
    optim = OptimConfig(**{**_container(cfg.optim), "betas": tuple(cfg.optim.betas)})
    if str(cfg.data) not in ("synthetic", "text"):
        raise SweepError(f"data={cfg.data}: valid: synthetic, text")
    common = dict(optim=optim, steps=int(cfg.steps), warmup_steps=int(cfg.warmup_steps),
                  settle_steps=int(cfg.settle_steps), seed=int(cfg.seed),
                  data=str(cfg.data),
                  device=device, dtype=str(cfg.dtype), torch_threads=cfg.torch_threads, gpus=int(cfg.gpus))
    # the engine fields every system shares (EngineConfig's run-level ones; the optimizer per variant)
    run_level = {"device": device, "compute_dtype": compute_dtype(str(cfg.dtype), device),
                 "micro_batches": int(cfg.micro_batches), "max_position_embeddings": max_pos, "seed": int(cfg.seed)}

    points: list[Job] = []
    seen, runs = set(), set()
    for model in models:
        for depth in depths:
            for width in widths:
                spec = PRESETS[model].scaled(depth=depth, width=width)
                for seq, batch in shapes:
                    # RoPE has no weights: a position override keeps the initial weights shared
                    pspec = replace(spec, max_position_embeddings=max_pos) if max_pos > 0 else spec
                    for hw in hw_names:
                        hwe = hw_cfgs[hw]
                        for variant, overrides in variants.items():
                            for system in systems:
                                sc = sys_cfgs[system]
                                if hwe.get("host_link_gbps") and not emulates_host_link(system):
                                    continue  # an emulated host link: only systems that can emulate it
                                sys_over, optim_over = split_variant(system, overrides or {})
                                same = (system, model, depth, width, seq, batch, hw,
                                        json.dumps([sys_over, optim_over], sort_keys=True, default=str))
                                if same in runs:
                                    continue  # what applies of this variant equals an earlier one: the same run twice
                                runs.add(same)
                                job_common = dict(common, gpus=int(hwe.get("gpus") or common["gpus"]),
                                                  torch_threads=torch_threads_for(cfg.torch_threads, hwe),
                                                  optim=optim_with(common["optim"], optim_over, variant),
                                                  data=str(optim_over.get("__data__", common["data"])),
                                                  dtype=str(optim_over.get("__dtype__", common["dtype"])))
                                if job_common["dtype"] not in DTYPES:
                                    raise SweepError(f"variant {variant!r}: dtype={job_common['dtype']}; valid: "
                                                     f"{', '.join(DTYPES)}")
                                mb = int(optim_over.get("__micro_batches__", cfg.micro_batches))
                                if not 1 <= mb <= int(batch):
                                    raise SweepError(f"variant {variant!r}: micro_batches={mb}; valid: 1 to the "
                                                     f"batch size ({batch})")
                                opts = merge_options(system, sc.get("options") or {}, sys_over, variant,
                                                     dict(run_level, optim=job_common["optim"], micro_batches=mb,
                                                          compute_dtype=compute_dtype(job_common["dtype"], device),
                                                          host_link_gbps=hwe.get("host_link_gbps")),
                                                     cli_options if cfg.system is not None
                                                     and system == cfg.system.name else frozenset())
                                pid = point_id(system, model, spec.num_layers, width, seq, batch, variant,
                                               hwe["label"])
                                if pid in seen:
                                    continue
                                seen.add(pid)
                                if sw.long_seq_from and seq >= int(sw.long_seq_from):  # fewer, longer steps
                                    job_common.update(steps=int(sw.long_steps),
                                                      warmup_steps=int(sw.long_warmup_steps))
                                if hwe.get("gpus") and _max_gpus(system) < job_common["gpus"]:
                                    continue  # a several-GPU profile: only systems that can use them
                                points.append(Job(
                                    id=pid, sweep=sw.name, system=system, variant=variant, model=model,
                                    width=width, spec=pspec.to_dict(), num_params=spec.num_params(),
                                    seq_len=int(seq), batch_size=int(batch),
                                    micro_batches=mb,
                                    hardware=hwe, options=opts,
                                    activation_checkpointing=bool(sc.get("activation_checkpointing", True)),
                                    factory=sc.get("factory"), sft=_container(sw.sft), **job_common,
                                ))
    if cfg.only:
        chosen = [p for p in points if any(fnmatch.fnmatchcase(p.id, pat) for pat in cfg.only)]
        if points and not chosen:  # a typo in only= must not be a run that measured nothing and exited 0
            raise SweepError(f"only={list(cfg.only)} matches none of the sweep's {len(points)} point(s), "
                             f"e.g. {points[0].id}")
        points = chosen
    return points


# -- checks before launching ----------------------------------------------------------------------
def invalid_reason(job: Job) -> str | None:
    """Why ``job`` cannot run at all (a config mistake, not a measurement): None if it can."""
    if job.steps < 1:
        return f"steps={job.steps}: at least 1 measured step is needed"
    if job.warmup_steps < 0:
        return f"warmup_steps={job.warmup_steps} must be >= 0"
    if job.settle_steps < 0:
        return f"settle_steps={job.settle_steps} must be >= 0"
    positions = int(job.spec.get("max_position_embeddings") or 0)
    if positions and job.seq_len > positions:
        return (f"seq_len {job.seq_len} > the model's {positions} positions ({job.model}); "
                f"set max_position_embeddings={job.seq_len} (or more) to raise them for every system")
    if job.gpus < 1:
        return f"gpus={job.gpus} must be >= 1"
    if job.micro_batches > job.batch_size:
        return f"micro_batches {job.micro_batches} > batch_size {job.batch_size}"
    if job.sft and sft_problem(job.sft):
        return sft_problem(job.sft)
    rec = SYSTEM_RECORDS.get(job.system)
    max_gpus = rec.max_gpus if rec else 1
    if job.gpus > max_gpus:
        return f"gpus={job.gpus}: {job.system} runs on at most {max_gpus} GPU(s) per node in this harness"
    from .emulation import cores_error

    cores = cores_error(job.hardware.get("cpu_cores"))  # this machine (the runner's affinity set)
    if cores:
        return f"hardware {job.hardware['label']}: {cores}"
    return None


def validate(jobs: list[Job]) -> None:
    """Refuse (``SweepError``, one line per bad point, at most 5) a sweep with any invalid point."""
    bad = [(j.id, r) for j in jobs for r in [invalid_reason(j)] if r]
    if bad:
        lines = [f"  {pid}: {reason}" for pid, reason in bad[:5]]
        more = f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise SweepError(f"{len(bad)} of {len(jobs)} point(s) cannot run; nothing was launched:\n"
                         + "\n".join(lines) + more)
