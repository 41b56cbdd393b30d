"""Which points are not launched, and why (``Skip``, typed): the memory rules the runner applies before a
point starts -- the host RAM a point needs (the engine's own placement plan for MegaTrain, the baselines'
bytes per parameter) against what this machine, or the profile it emulates, has, and the GPU's the same way.
A point skipped here has a row that says so with the numbers (``need_*`` / ``have_*``), never a silent gap.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from baselines.registry import record

from .sweeps import Job

GIB = 2**30
NATIVE_BYTES_PER_PARAM = 12  # all-on-GPU, at least: fp32 weights + AdamW m, v in GPU memory
NATIVE_CPU_BYTES_PER_PARAM = 16  # all-on-"GPU" on a CPU run: fp32 weights, gradients, m, v in host RAM


def host_estimate(point: Job, device: str, gpu_total: int | None = None) -> dict | None:
    """Host bytes the point needs by MegaTrain's memory model: for megatrain on a GPU (``gpu_total`` known)
    the two-tier plan's host side with the GPU tier filled (key ``gpu_refusal`` set when the plan cannot
    fit the GPU side at all); otherwise the pure-streaming estimate (the system's options for megatrain,
    the engine defaults for the others). None if megatrain.memory is unavailable."""
    try:
        from megatrain.memory import host_estimate as est
    except Exception:
        return None
    if point.system == "megatrain" and device != "cpu" and gpu_total:
        return _megatrain_plan(point, gpu_capacity_bytes(point, gpu_total) - CUDA_CONTEXT_BYTES)
    options = asdict(point.options) if point.system == "megatrain" else None
    try:
        return est(point.model_spec(), micro_batches=point.micro_batches, options=options,
                   on_gpu=device != "cpu")
    except TypeError:  # an older signature without on_gpu
        return est(point.model_spec(), micro_batches=point.micro_batches, options=options)


def _megatrain_plan(point: Job, gpu_bytes: int) -> dict:
    """The engine's placement plan for the point with unlimited host RAM: what the host side needs."""
    from megatrain.memory import plan_for_spec

    spec, refusal = point.model_spec(), None
    kw = dict(micro_batches=point.micro_batches, tokens_per_step=point.seq_len * point.batch_size,
              seq_len=point.seq_len)
    try:  # the plan the engine will make (its step-time model chooses within the host RAM it sees) ...
        plan = plan_for_spec(spec, point.options, gpu_free=gpu_bytes, host_available=available_host(point), **kw)
    except MemoryError:  # ... or, where that does not fit, what the host side needs
        plan = None
    try:
        plan = plan or plan_for_spec(spec, point.options, gpu_free=gpu_bytes, host_available=1 << 62, **kw)
    except MemoryError as e:  # the GPU side alone does not fit: the host side of pure streaming, for the numbers
        refusal = str(e).splitlines()[0].replace("model does not fit: ", "")
        plan = plan_for_spec(spec, replace(point.options, gpu_resident="0"), gpu_free=1 << 62,
                             host_available=1 << 62, **kw)
    host = sum(plan.host_parts.values())
    out = {"total_bytes": host, "num_params": spec.num_params(), "bytes_per_param": host / spec.num_params(),
           "gpu_refusal": refusal, "plan": plan.summary(), "tiers": tier_counts(plan)}
    if refusal:  # what the streaming plan needs on the GPU against what the GPU has after the plan's margin
        margin = int(float(point.options.gpu_margin_gib or 0) * GIB)
        out.update(gpu_need_bytes=sum(plan.gpu_parts.values()), gpu_usable_bytes=gpu_bytes - margin)
    return out


def tier_counts(plan) -> dict:
    """The placement as numbers: decoder layers and params on each tier (row fields)."""
    layers = [n for n in plan.tiers if n.startswith("layer.")]
    return {"gpu_tier_layers": plan.gpu_layers, "host_tier_layers": len(layers) - plan.gpu_layers,
            "gpu_tier_params": plan.params_on("gpu"), "host_tier_params": plan.params_on("host")}


CUDA_CONTEXT_BYTES = 1 << 30  # the CUDA context and torch's own, not available to the plan


def available_host(point: Job) -> int:
    """Host RAM the point may plan with, as its own process will see it: the real available RAM, or
    under the profile's ``host_ram_gib`` the same capped value ``megatrain.memory.available_host_bytes``
    gives the engine (one rule on both sides, so a skip here is what the engine would refuse)."""
    from megatrain.memory import capped_available_bytes

    cap = point.hardware.get("host_ram_gib")
    return capped_available_bytes(int(float(cap) * GIB) if cap else None)


def _host_ram_text(point: Job, available: int) -> str:
    """'available host RAM 95.6 GiB', naming the profile's cap when there is one."""
    cap = point.hardware.get("host_ram_gib")
    capped = f" (emulated {float(cap):g} GiB host, profile {point.hardware['label']})" if cap else ""
    return f"available host RAM {available / GIB:.1f} GiB{capped}"


def gpu_capacity_bytes(point: Job, real_total: int | None) -> int | None:
    cap = point.hardware.get("gpu_mem_gib")
    if cap:
        return int(float(cap) * GIB)
    return real_total


@dataclass(frozen=True)
class Skip:
    """Why a point is not launched: ``reason`` (a key of ``experiments.schema.REASONS``), the bytes
    needed and available per memory (None: not a memory skip), and one line for people (``text``). The
    row carries the fields; nothing reads ``text`` back."""

    reason: str
    text: str
    need_host: int | None = None
    have_host: int | None = None
    need_gpu: int | None = None
    have_gpu: int | None = None

    def __str__(self) -> str:
        return self.text

    def row_fields(self) -> dict:
        gib = lambda b: b / GIB if b is not None else None  # noqa: E731
        return {"reason": self.reason, "need_host_gib": gib(self.need_host), "have_host_gib": gib(self.have_host),
                "need_gpu_gib": gib(self.need_gpu), "have_gpu_gib": gib(self.have_gpu)}


def skip_reason(point: Job, *, device: str, available_host: int | None, gpu_total: int | None,
                estimate: dict | None) -> Skip | None:
    """Why the point should not be launched (None: launch it)."""
    p = point.num_params
    rec = record(point.system)
    if device == "cpu" and not rec.runs_on_cpu:
        return Skip("needs_gpu", f"skipped: {rec.label} needs a GPU (this run is on the CPU)")
    if rec.on_device:
        if device == "cpu":  # "all on the device" = all in host RAM: fp32 weights, grads, Adam m, v
            need = NATIVE_CPU_BYTES_PER_PARAM * p
            if available_host is not None and need > available_host:
                return Skip("host_memory", f"skipped: training on the CPU needs >= {NATIVE_CPU_BYTES_PER_PARAM} "
                            f"B/param = {need / GIB:.1f} GiB > {_host_ram_text(point, available_host)}",
                            need_host=need, have_host=available_host)
            return None
        cap = gpu_capacity_bytes(point, gpu_total)
        need = NATIVE_BYTES_PER_PARAM * p
        if cap is not None and need > cap:
            return Skip("gpu_memory", f"skipped: all-on-GPU needs >= {NATIVE_BYTES_PER_PARAM} B/param (fp32 weights "
                        f"+ Adam m, v) = {need / GIB:.1f} GiB > {cap / GIB:.1f} GiB of GPU memory",
                        need_gpu=need, have_gpu=cap)
        return None
    if estimate is not None and estimate.get("gpu_refusal"):
        need_gpu, have_gpu = estimate.get("gpu_need_bytes"), estimate.get("gpu_usable_bytes")
        numbers = (f"GPU needs {need_gpu / GIB:.1f} GiB > {have_gpu / GIB:.1f} GiB usable"
                   if need_gpu is not None and have_gpu is not None else estimate["gpu_refusal"])
        return Skip("plan_gpu", f"skipped: the engine's plan refuses the GPU side even with every layer streamed: "
                    f"{numbers} (host side: {estimate['total_bytes'] / GIB:.1f} GiB)",
                    need_gpu=need_gpu, have_gpu=have_gpu, need_host=estimate["total_bytes"])
    if estimate is not None and available_host is not None and estimate["total_bytes"] > available_host:
        need = estimate["total_bytes"]
        what = ("engine plan (GPU tier filled first): host needs" if "plan" in estimate else "engine host estimate")
        per = f"{estimate['bytes_per_param']:.2f} B/param x " if "plan" not in estimate else ""
        return Skip("host_memory", f"skipped: {what} {need / GIB:.1f} GiB ({per}{p / 1e9:.2f}B params) > "
                    f"{_host_ram_text(point, available_host)}", need_host=need, have_host=available_host)
    return None
