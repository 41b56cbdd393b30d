"""Typed configuration of the sweep runner (hydra structured configs).

The schemas are the engine's own dataclasses wherever the engine has one, so nothing is declared twice:

* ``system=megatrain``: ``options`` *is* ``megatrain.config.EngineConfig``; ``experiments.sweeps`` makes
  each point's one EngineConfig from it, which reaches the engine untouched (its run-level fields, device,
  compute_dtype, micro_batches, optim, max_position_embeddings and seed, are set by the runner for every
  system alike);
* ``optim``: ``megatrain.system.OptimConfig`` (``optim.lr=3e-4``), the same for every system;
* ``model``: one option per ``megatrain.spec.PRESETS`` entry, registered here from the presets
  (``model=qwen2.5-14b model.depth=8``): the presets are the one record of a model family;
* ``sweep``  (``SweepConfig``, files ``conf/sweep/*.yaml``, package ``_global_``): which systems and
  which axis values; a sweep file may also set run-level defaults, which command-line overrides beat;
* ``hardware`` (``HardwareConfig``): ``real`` or an emulated profile (GPU memory, CPU core and host-RAM
  caps, peak TFLOPS).

Systems are described once, in ``baselines.registry.SYSTEM_RECORDS``. This module imports neither torch
nor the engine (``megatrain.config`` and ``megatrain.system`` are torch-free dataclasses).
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from megatrain.config import EngineConfig
from megatrain.system import OptimConfig

from .sft_config import SFTConfig
from .schema import H200_PEAK_TFLOPS, PEAK_TFLOPS, peak_tflops_for  # noqa: F401  (the one copy: a fact of rows)
HARDWARE_ORDER = ("H200", "A100-80GB", "RTX-A6000-48GB", "RTX-3090-24GB")  # figure/table order


@dataclass
class ModelConfig:
    """A model preset (``megatrain.spec.PRESETS``) and the depth/width knobs of ``ModelSpec.scaled``."""

    name: str = "qwen2.5-7b"
    depth: Optional[int] = None  # number of decoder layers; None = the preset's
    width: float = 1.0  # multiplier of hidden and FFN size (head_dim fixed, heads scale)


@dataclass
class SystemConfig:
    """One training system (described in ``baselines.registry.SYSTEM_RECORDS``). ``options`` go to its
    builder as they are.

    ``factory`` ("package.module:callable" or "/path/file.py:callable") replaces the registry for this
    system: it is called with the registry's keyword arguments plus ``name``. Used by the tests' fake
    systems; leave it null for the real ones."""

    name: str = MISSING
    options: Dict[str, Any] = field(default_factory=dict)
    activation_checkpointing: bool = True
    factory: Optional[str] = None


@dataclass
class MegatrainSystemConfig(SystemConfig):
    name: str = "megatrain"
    options: EngineConfig = field(default_factory=EngineConfig)  # type: ignore[assignment]


# Systems whose options have a typed schema (unknown option keys fail at composition / expansion).
SYSTEM_SCHEMAS: dict[str, type] = {"megatrain": MegatrainSystemConfig}
SYSTEM_OPTION_SCHEMAS: dict[str, type] = {"megatrain": EngineConfig}
# EngineConfig fields the runner sets for every system alike (not options of one system).
RUN_LEVEL_ENGINE_FIELDS = ("device", "compute_dtype", "micro_batches", "optim", "max_position_embeddings", "seed")
# EngineConfig fields a hardware profile sets (``HardwareConfig`` fields of the same name), not options.
HARDWARE_ENGINE_FIELDS = ("host_link_gbps",)


@dataclass
class HardwareConfig:
    """``real``: the machine as it is (label = the GPU's short name, peak from ``PEAK_TFLOPS``). An
    emulated profile (label = its name) caps what the point process may use, each cap optional:

    * ``gpu_mem_gib``: GPU memory, ``torch.cuda.set_per_process_memory_fraction`` (the caching allocator
      only; compute is still the real GPU's);
    * ``cpu_cores``: the point process is pinned to the first N cores of the runner's affinity set
      (``os.sched_setaffinity``) and torch/OpenMP get N threads unless ``torch_threads`` is set;
    * ``host_ram_gib``: the machine's total host RAM as the engine's plan and the runner's skip rule see
      it (``megatrain.memory.available_host_bytes``): a planning cap, not an enforced limit;
    * ``host_link_gbps``: the host link (host <-> GPU), GB/s each way, slower than the real one: becomes
      MegaTrain's ``EngineConfig.host_link_gbps`` (a GPU sleep after each copy, megatrain/link.py); the other
      systems cannot emulate it, so a profile with it has only MegaTrain points.

    MFU uses ``peak_tflops``, or the real GPU's when null (a CPU-side profile computes on the real GPU)."""

    name: str = "real"
    gpu_mem_gib: Optional[float] = None  # cap; None = no cap
    peak_tflops: Optional[float] = None  # None = look the real GPU up in PEAK_TFLOPS
    emulated: bool = False
    gpus: Optional[int] = None  # GPUs of the node used data-parallel (None: the run-level ``gpus``)
    cpu_cores: Optional[int] = None  # cores the point process may run on; None = all of the runner's
    host_ram_gib: Optional[float] = None  # emulated total host RAM (GiB); None = the real RAM
    host_link_gbps: Optional[float] = None  # emulated host link (GB/s each way, MegaTrain only); None = real
    description: str = ""


@dataclass
class SweepConfig:
    """The axes of a sweep; the points are their cartesian product (model, depth, width, shape,
    hardware, variant, system; systems innermost). An empty axis means "the run-level value"
    (``model``, ``model.depth``, ``model.width``, ``seq_len``, ``batch_size``, ``hardware``)."""

    name: str = MISSING
    description: str = ""
    order: int = 100  # position of the sweep in reports and figures (experiments.schema.known_sweeps)
    systems: List[str] = MISSING
    models: List[str] = field(default_factory=list)
    depths: List[int] = field(default_factory=list)
    widths: List[float] = field(default_factory=list)
    seq_lens: List[int] = field(default_factory=list)
    batch_sizes: List[int] = field(default_factory=list)
    # If set, batch = max(1, T // seq) for each seq (tokens per step held roughly constant); replaces
    # batch_sizes.
    tokens_per_step: List[int] = field(default_factory=list)
    hardware: List[str] = field(default_factory=list)  # hardware profile names
    # variant name -> system option overrides (merged over the system's options). Empty = one variant,
    # "default", with no overrides.
    variants: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    # Points whose sequences have at least this many tokens run ``long_steps`` measured steps after
    # ``long_warmup_steps`` warm-up steps instead of the run's steps/warmup_steps (one 256K step of the 7B
    # takes ~150 s: 3 + 1 of them would not fit one device call). 0 = every point runs the run's steps.
    long_seq_from: int = 0
    long_steps: int = 1
    long_warmup_steps: int = 0
    # Set: every point fine-tunes a pretrained model on a generated task and evaluates it
    # (experiments/sft_point.py, sweep=accuracy_sft) instead of timing steps on random tokens.
    sft: Optional[SFTConfig] = None


@dataclass
class RunConfig:
    """The primary config (``conf/config.yaml`` on top of this schema)."""

    sweep: SweepConfig = MISSING
    model: ModelConfig = MISSING
    hardware: HardwareConfig = MISSING
    system: Optional[SystemConfig] = None  # null: all systems of the sweep
    optim: OptimConfig = field(default_factory=OptimConfig)  # every system's AdamW (megatrain.system)
    steps: int = 5  # measured steps per point
    warmup_steps: int = 2  # steps run first and excluded from the statistics (not optim.warmup_steps)
    # then at most this many more warm-up steps while the system says it is still choosing how to run
    # (MegaTrain: speculate="auto" measuring both modes, the runtime split's trials), or that the step that would
    # have been the first timed one was a transient (MegaTrain.transient(): a cold update); one process only
    settle_steps: int = 8
    batch_size: int = 8
    seq_len: int = 1024
    micro_batches: int = 1
    # EngineConfig.max_position_embeddings for every system (0 = the model's own): written into the
    # model config all systems load, so each gets the same positions.
    max_position_embeddings: int = 0
    gpus: int = 1  # processes per node; > 1 only for systems whose record supports it
    seed: int = 0  # initial weights and synthetic data
    # the batches: "synthetic" (uniform random tokens: clipping fires every step at random init) or "text"
    # (byte-level tokens of the Python standard library's source, megatrain.data.text_batch: real text)
    data: str = "synthetic"
    timeout_s: float = 1800.0  # per point (the training process; init weights have their own)
    init_timeout_s: float = 3600.0  # writing a model's initial weights into the cache
    # Stop starting points once this many seconds have passed (a point's timeout is clipped to what is
    # left; a point is not started when less is left than a finished point of its shape took in this run:
    # experiments/budget.py); a rerun continues with the rest. For wrappers that kill long commands. None =
    # no budget.
    time_budget_s: Optional[float] = None
    redo: bool = False  # re-run points already recorded as ok/skipped (failed ones are always re-run)
    # Where rows, per-point folders, figures and REPORT.md go. None: runs/<machine>/ (per machine, git-
    # ignored), so a run never touches the committed results/; results_dir=results only when asked.
    results_dir: Optional[str] = None
    # Append to a results CSV that holds rows measured on another machine (refused by default).
    mix_machines: bool = False
    cache_dir: Optional[str] = None  # initial weights; None: $MEGATRAIN_CACHE or <results_dir>/.init_cache
    # true: every system loads the same initial weights from the cache (written once, fp32: 4 B/param of disk).
    # false: MegaTrain points initialise inside the engine from `seed` (HF's init, on the GPU) and write
    # nothing to disk; for sizes only MegaTrain runs (a 14B cache is 59 GB), throughput is unaffected.
    shared_init: bool = True
    device: str = "auto"  # auto: cuda if available else cpu
    # CPU threads of torch in the point process (OMP_NUM_THREADS + torch.set_num_threads); None = torch's
    # default, or the hardware profile's cpu_cores when it has one. The smoke sweep uses 1: on 2 cores,
    # OpenMP workers spinning against the systems' sampler threads made tiny steps ~50x slower.
    torch_threads: Optional[int] = None
    dtype: str = "auto"  # compute dtype: auto (bf16 on cuda, fp32 on cpu), bf16, fp16, fp32
    only: List[str] = field(default_factory=list)  # fnmatch patterns on point ids; empty = all points
    dry_run: bool = False  # list the points (and what a run would do with each) and exit
    # After the sweep: figures (plots_dir) and <results_dir>/REPORT.md from the CSVs of results_dir.
    post: bool = True
    plots_dir: Optional[str] = None  # None: <results_dir>/plots (results/ -> plots/ for the committed ones)


GROUP_SCHEMAS: dict[str, type] = {
    "sweep": SweepConfig,
    "model": ModelConfig,
    "hardware": HardwareConfig,
    "system": SystemConfig,
}


def register() -> None:
    """Put the schemas and the model presets into hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from megatrain.spec import PRESETS

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=f"schema/{group}", name="base", node=node)
    for name, node in SYSTEM_SCHEMAS.items():
        cs.store(group="schema/system", name=name, node=node)
    for name in PRESETS:
        cs.store(group="model", name=name, node=ModelConfig(name=name))


register()


# -- fail-fast checks of command-line overrides ---------------------------------------------------
def _fields(cls) -> dict[str, Any]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _nested_schema(cls, name: str):
    """The dataclass type of field ``name`` of dataclass ``cls`` (None if it is not a dataclass)."""
    hints = typing.get_type_hints(cls)
    t = hints.get(name)
    for candidate in (t, *getattr(t, "__args__", ())):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


CONF_DIR = Path(__file__).resolve().parent / "conf"


def group_choices(group: str) -> list[str]:
    """The options of a config group: ``conf/<group>/*.yaml`` (models: the presets)."""
    if group == "model":
        from megatrain.spec import PRESETS

        return list(PRESETS)
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_choices(args: list[str]) -> str | None:
    """One line for a group choice that does not exist (``sweep=nope``, ``model=bogus``) naming the valid
    ones, or for ``system.options...`` without ``system=`` (the options of which system?). None if fine."""
    chosen = {}
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key in GROUP_SCHEMAS:
            chosen[key] = value
    searchpath = any(a.lstrip("+~").startswith("hydra.searchpath") for a in args)  # other config folders
    for group, value in ({} if searchpath else chosen).items():
        valid = group_choices(group) + (["null"] if group == "system" else [])
        if value not in valid:
            return f"error: {group}={value} does not exist; valid: {', '.join(valid)}"
    if "system" not in chosen and any(a.split("=", 1)[0].lstrip("+~").startswith("system.") for a in args
                                      if "=" in a and not a.startswith("-")):
        return (f"error: system.* overrides need the system they edit, e.g. system=megatrain "
                f"(one of: {', '.join(group_choices('system'))})")
    return None


def check_overrides(args: list[str]) -> str | None:
    """A message for the first override whose key does not exist (listing the valid keys), else None.

    Hydra itself rejects unknown keys, but without saying which exist; this runs first, after
    ``check_choices`` (unknown group options, system.* without system=).
    """
    choice = check_choices(args)
    if choice:
        return choice
    groups = set(GROUP_SCHEMAS)
    top = _fields(RunConfig)
    chosen_system = None
    parsed = []
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue  # hydra flags (--cfg job, -m, ...)
        key = arg.split("=", 1)[0]
        prefix = ""
        while key[:1] in "+~":
            prefix += key[0]
            key = key[1:]
        if "@" in key:  # group@package: leave to hydra
            continue
        parsed.append((prefix, key, arg.split("=", 1)[1]))
        if key == "system":
            chosen_system = arg.split("=", 1)[1]
    for prefix, key, _value in parsed:
        parts = key.split(".")
        if parts[0] == "hydra":
            continue
        if parts[0] not in top:
            return (f"Unknown config key '{key}' (in override '{prefix}{key}=...').\n"
                    f"Valid top-level keys: {', '.join(k for k in top if k not in groups)}\n"
                    f"Config groups (choose with group=option, edit with group.key=value): "
                    f"{', '.join(sorted(groups))}\n"
                    f"See `python -m experiments.run sweep=smoke --cfg job` for the whole config.")
        cls, path = RunConfig, []
        for part in parts:
            if cls is None:  # below a dict/list/scalar field: not checked here
                break
            names = _fields(cls)
            if part not in names:
                where = ".".join(path)
                return (f"Unknown config key '{key}': '{part}' is not a key of '{where}' ({cls.__name__}).\n"
                        f"Valid keys of '{where}': {', '.join(names)}")
            path.append(part)
            if cls is RunConfig and part == "system":
                cls = SYSTEM_SCHEMAS.get(chosen_system or "", SystemConfig)
            else:
                cls = _nested_schema(cls, part)
    return None
