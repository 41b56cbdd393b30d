"""The CPU side of an emulated hardware profile (``config.HardwareConfig``), applied in the point process.

* ``cpu_cores``: the process is pinned to the first N CPUs of its affinity set before torch does any
  work; the threads it starts later and its children inherit the mask. torch/OpenMP get N threads through
  the job's ``torch_threads`` (``sweeps.expand`` sets it from the profile unless given explicitly), which
  is also what the engine's host AdamW sizes its OpenMP team from (``torch.get_num_threads()``).
* ``host_ram_gib``: ``$MEGATRAIN_HOST_RAM_GIB`` is set for the engine's placement plan
  (``megatrain.memory.available_host_bytes``); a planning cap, not an enforced limit.

GPU memory caps stay in ``point._cap_gpu_memory`` (they need torch and the device). The host link
(``host_link_gbps``) is emulated by the engine itself (``EngineConfig.host_link_gbps``, set from the profile
by ``sweeps.expand``; megatrain/link.py); ``apply`` only records it. No torch import here: ``apply`` runs
before torch is loaded.
"""
from __future__ import annotations

import contextlib
import os


def usable_cores() -> int:
    """CPUs this process may run on: its affinity set (what taskset, a cgroup's cpuset or a cores cap
    leave), not ``os.cpu_count()``, which counts the whole machine whatever the process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity outside Linux
        return os.cpu_count() or 1


def cores_error(cores, available: int | None = None) -> str | None:
    """Why a profile's ``cpu_cores`` cannot be applied on this machine (None: it can, or none is set)."""
    if cores is None:
        return None
    available = usable_cores() if available is None else available
    if int(cores) < 1:
        return f"cpu_cores={cores} must be >= 1 (null = all cores)"
    if int(cores) > available:
        return f"cpu_cores={cores} > the {available} CPU core(s) this process may use"
    return None


def pin_cores(n: int) -> list[int]:
    """Pin every thread of this process to the first ``n`` CPUs of its current affinity set; returns them.

    ``sched_setaffinity(0, ...)`` sets only the calling thread's mask (threads already started keep
    theirs), so each thread of the process is pinned by its id; threads and processes started later
    inherit the mask."""
    error = cores_error(n)
    if error:
        raise ValueError(error)
    cpus = set(sorted(os.sched_getaffinity(0))[:n])
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)
    return sorted(cpus)


def apply(hardware: dict) -> dict:
    """Apply the profile's CPU-side caps to this process; returns what is in force, for result.json
    (``cpu_cores``: the CPUs the process may use, capped or not; ``host_ram_cap_gib``: the cap or None;
    ``host_link_gbps``: only when the profile emulates the host link)."""
    applied: dict = {}
    cores = hardware.get("cpu_cores")
    if cores:
        applied["cpu_affinity"] = pin_cores(int(cores))
    # imported after pinning: megatrain.memory loads torch, whose thread pools must start inside the mask
    from megatrain.memory import HOST_RAM_ENV

    cap = hardware.get("host_ram_gib")
    if cap:
        os.environ[HOST_RAM_ENV] = f"{float(cap):g}"
    else:  # the profile is the one record of what was emulated: no cap inherited from the runner's shell
        os.environ.pop(HOST_RAM_ENV, None)
    applied["cpu_cores"] = usable_cores()
    applied["host_ram_cap_gib"] = float(cap) if cap else None
    if hardware.get("host_link_gbps"):  # applied by the engine (EngineConfig.host_link_gbps), recorded here
        applied["host_link_gbps"] = float(hardware["host_link_gbps"])
    return applied
