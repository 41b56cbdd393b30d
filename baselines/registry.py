"""One record per training system, and ``build_system(name, ...)``: the engine and every baseline.

``SYSTEM_RECORDS`` is the only place a system is described: the module (and function) that builds it,
its labels and colour in figures and tables, whether it holds the whole model on the device (then its
label and memory rule depend on whether that device is a GPU), whether it runs on a CPU, and the typed
schema of its options where it has one (the engine: ``megatrain.config.EngineConfig``). The runner,
the figures and the report read it; nothing else lists systems. Importing this module imports neither
torch nor any framework: a system's module is imported when it is built.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class SystemRecord:
    name: str
    module: str  # "package.module" whose ``builder`` builds it
    label: str  # long label (figure legends)
    short: str  # table rows
    colour: str  # fixed across every figure (Okabe-Ito, colour-blind safe)
    marker: str = "o"
    builder: str = "build"
    on_device: bool = False  # the whole model, gradients and optimizer state on the device (no offload)
    runs_on_cpu: bool = True  # part of the CPU smoke sweep
    cpu_label: str | None = None  # label when it ran on a CPU (on_device systems: not "on GPU")
    cpu_short: str | None = None
    max_gpus: int = 1  # processes per node it supports through the runner
    description: str = ""
    exact_adamw: bool = True  # False: its update is not AdamW on the step's gradient (reports mark its rows)
    # "mean": compared by the mean step time, not the median (a system whose every k-th step waits for
    # deferred work -- ZenFlow's CPU update every update_interval steps -- would look faster by the median)
    compare_by: str = "median"

    def label_for(self, hardware: str | None, short: bool = False) -> str:
        """The label for rows measured on ``hardware`` ("cpu" or a GPU name): label by what ran."""
        on_cpu = str(hardware or "").lower() == "cpu"
        if short:
            return (self.cpu_short or self.short) if on_cpu else self.short
        return (self.cpu_label or self.label) if on_cpu else self.label


SYSTEM_RECORDS: dict[str, SystemRecord] = {r.name: r for r in (
    SystemRecord("megatrain", "baselines.megatrain_system", "MegaTrain", "MegaTrain", "#D55E00", "o",
                 description="host RAM holds the model; layers streamed to the GPU", max_gpus=8),
    SystemRecord("zero3", "baselines.zero3", "DeepSpeed ZeRO-3 offload", "ZeRO-3", "#0072B2", "s",
                 description="ZeRO-3, parameters and optimizer state offloaded to pinned CPU memory"),
    SystemRecord("zero2", "baselines.zero3", "DeepSpeed ZeRO-2 optimizer offload", "ZeRO-2", "#56B4E9", "P",
                 builder="build_zero2", runs_on_cpu=False,
                 description="ZeRO-2, optimizer state offloaded; bf16 parameters and gradients on the GPU"),
    SystemRecord("superoffload", "baselines.zero3", "DeepSpeed SuperOffload", "SuperOffload", "#E69F00", "X",
                 builder="build_superoffload", runs_on_cpu=False,
                 description="ZeRO-3 with offload_optimizer.super_offload (DeepSpeed >= 0.18)"),
    SystemRecord("superoffload_noclip", "baselines.zero3", "DeepSpeed SuperOffload, no clipping",
                 "SuperOffload (no clip)", "#E69F00", "x", builder="build_superoffload_noclip", runs_on_cpu=False,
                 description="SuperOffload with gradient_clipping 0 (its speculation runs only without clipping)"),
    SystemRecord("zenflow", "baselines.zenflow", "DeepSpeed ZenFlow (not exact AdamW)", "ZenFlow", "#F0E442", "*",
                 runs_on_cpu=False, exact_adamw=False, compare_by="mean",
                 description="ZeRO-2 optimizer offload with ZenFlow: top-k gradient columns updated on the GPU, "
                             "the rest on the CPU every update_interval steps (bounded staleness)"),
    SystemRecord("fsdp", "baselines.fsdp", "FSDP2 CPU offload", "FSDP2", "#009E73", "^",
                 description="PyTorch FSDP2 with CPUOffloadPolicy"),
    SystemRecord("gemini", "baselines.gemini", "ColossalAI Gemini", "Gemini", "#CC79A7", "D", runs_on_cpu=False,
                 description="ColossalAI Gemini, everything offloaded"),
    SystemRecord("native", "baselines.native", "All-on-GPU (no offload)", "All-on-GPU", "#555555", "v",
                 on_device=True, cpu_label="Plain PyTorch on the CPU (no offload)", cpu_short="PyTorch (CPU)",
                 description="plain HF model + AdamW, everything on the device"),
)}
SYSTEMS = tuple(SYSTEM_RECORDS)


def record(name: str) -> SystemRecord:
    """The record of ``name``; a system the registry does not know (a test's fake) gets a neutral one."""
    return SYSTEM_RECORDS.get(name) or SystemRecord(name, "", name, name, "#000000")


def option_names(name: str) -> frozenset:
    """The option keys system ``name`` takes (its module's ``OPTIONS``; imports that module, hence torch).
    A system the registry does not know, or whose module has no ``OPTIONS``, takes none."""
    rec = SYSTEM_RECORDS.get(name)
    if rec is None:
        return frozenset()
    return frozenset(getattr(importlib.import_module(rec.module), "OPTIONS", None) or ())


def build_system(name: str, *, init_dir, optim, micro_batches: int = 1, device: str = "cuda",
                 dtype=None, activation_checkpointing: bool = True, options: dict | None = None,
                 step_shape: tuple[int, int] | None = None, dist=None, hf_config=None):
    """Build system ``name`` from the ``save_pretrained`` folder ``init_dir`` (megatrain also without one:
    ``init_dir`` empty and ``hf_config`` given, it initialises itself from its options' seed).

    ``options`` holds the system's own knobs (each module's ``OPTIONS`` lists them; unknown keys raise).
    Running out of GPU or host memory while building raises ``baselines.OutOfMemory`` (``.kind`` is
    "gpu" or "host"); the baselines raise it from ``step`` too. ``dtype`` None: bf16. ``step_shape``
    (rows, seq) goes to builders that take it (the engine sizes its placement plan's activations by it).
    """
    if name not in SYSTEM_RECORDS:
        raise ValueError(f"unknown system {name!r}; choose one of: {', '.join(SYSTEMS)}")
    import torch

    from .oom import oom_guard

    rec = SYSTEM_RECORDS[name]
    builder = getattr(importlib.import_module(rec.module), rec.builder)
    extra = {}
    params = inspect.signature(builder).parameters
    anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = set(params) | ({"step_shape", "dist", "hf_config"} if anything and name == "megatrain" else set())
    if step_shape is not None and "step_shape" in accepted:
        extra["step_shape"] = step_shape
    if dist is not None:
        if "dist" not in accepted:
            raise ValueError(f"system {name!r} does not train data-parallel through the runner (gpus > 1)")
        extra["dist"] = dist
    if not init_dir:
        if "hf_config" not in accepted or hf_config is None:
            raise ValueError(f"system {name!r} needs the shared initial weights (init_dir); only megatrain "
                             f"initialises itself (shared_init=false)")
        extra["hf_config"] = hf_config
    with oom_guard(name, "build"):
        return builder(init_dir=init_dir, optim=optim, micro_batches=micro_batches, device=device,
                       dtype=torch.bfloat16 if dtype is None else dtype,
                       activation_checkpointing=activation_checkpointing, options=options, **extra)
