"""What ran where: GPU, driver, library versions, git commit, host RAM, date.

Collected once per sweep by the runner without importing torch or deepspeed (versions come from the
installed package metadata; the GPU from NVML). Every failure degrades to an empty field: on a machine
without an NVIDIA driver (CI) ``pynvml`` imports but ``nvmlInit`` raises, and that is fine.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from baselines.monitor import nvml_handle

GIB = 2**30
REPO_ROOT = Path(__file__).resolve().parents[1]


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def git_sha(root: Path = REPO_ROOT) -> str:
    """Short commit of the working tree, '+dirty' with uncommitted changes to tracked files;
    ``$MEGATRAIN_GIT_SHA`` when set (a copy of the tree without .git), else 'unknown'."""
    if os.environ.get("MEGATRAIN_GIT_SHA"):
        return os.environ["MEGATRAIN_GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# -- NVML -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def nvml():
    """``pynvml`` initialised, or ``None`` when there is no driver/library (never raises)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        yield None
        return
    try:
        yield pynvml
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpu_info() -> dict:
    """``{gpu_name, driver, gpu_total_bytes, gpu_count}`` from NVML; empty values without a driver."""
    info = {"gpu_name": "", "driver": "", "gpu_total_bytes": None, "gpu_count": 0}
    with nvml() as nv:
        if nv is None:
            return info
        try:
            info["gpu_count"] = int(nv.nvmlDeviceGetCount())
            info["driver"] = _text(nv.nvmlSystemGetDriverVersion())
            if info["gpu_count"]:
                h = nvml_handle(nv)
                info["gpu_name"] = _text(nv.nvmlDeviceGetName(h))
                info["gpu_total_bytes"] = int(nv.nvmlDeviceGetMemoryInfo(h).total)
        except Exception:
            pass
    return info


def short_gpu_name(name: str) -> str:
    """'NVIDIA H200' -> 'H200', 'NVIDIA GeForce RTX 3090' -> 'RTX-3090' (the CSV's hardware label)."""
    for prefix in ("NVIDIA ", "GeForce "):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return "-".join(name.split()) or "gpu"


def host_ram_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def now() -> str:
    return _dt.datetime.now().replace(microsecond=0).isoformat()


def collect(device: str = "cuda") -> dict:
    """Environment of this run. ``device`` 'cpu' records gpu_name 'cpu' (no GPU involved)."""
    gpu = gpu_info() if device != "cpu" else {"gpu_name": "cpu", "driver": "", "gpu_total_bytes": None,
                                                "gpu_count": 0}
    return {
        "gpu_name": gpu["gpu_name"] or ("cpu" if device == "cpu" else ""),
        "driver": gpu["driver"],
        "gpu_total_bytes": gpu["gpu_total_bytes"],
        "gpu_count": gpu["gpu_count"],
        "torch_version": package_version("torch"),
        "transformers_version": package_version("transformers"),
        "deepspeed_version": package_version("deepspeed"),
        "colossalai_version": package_version("colossalai"),
        "git_sha": git_sha(),
        "host_ram_gib": round(host_ram_bytes() / GIB, 1),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "hostname": platform.node(),
        "date": now(),
    }
