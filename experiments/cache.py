"""Initial weights, written once per (model shape, seed) and shared by every system and sweep.

They live in a cache (``$MEGATRAIN_CACHE`` or ``<results_dir>/.init_cache``): the weights in
``weights/<shape key>/``; each exact config gets ``init/<config key>/`` with its own ``config.json`` and
symlinks to the weight files (configs that differ only in max_position_embeddings, rope_theta or
rms_norm_eps share the weights). When the disk is short, the least recently used cached weights are
evicted first. Written by the point process's ``--init`` mode (``experiments.point``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from .schema import sanitize

GIB = 2**30
_NON_WEIGHT_FIELDS = ("name", "max_position_embeddings", "rope_theta", "rms_norm_eps")


# ================================================================================================
def cache_root(results_dir, cache_dir=None) -> Path:
    return Path(cache_dir or os.environ.get("MEGATRAIN_CACHE") or Path(results_dir) / ".init_cache").resolve()


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def init_paths(spec: dict, seed: int, cache: Path) -> tuple[Path, Path]:
    """(weights dir, init dir) of a model spec (dict) and seed inside ``cache``."""
    wspec = {k: v for k, v in spec.items() if k not in _NON_WEIGHT_FIELDS}
    shape = f"{spec['family']}-L{spec['num_layers']}-h{spec['hidden_size']}-f{spec['intermediate_size']}"
    weights = Path(cache) / "weights" / f"{shape}-seed{seed}-{_digest([wspec, seed])}"
    name = sanitize(spec.get("name") or spec["family"])
    init = Path(cache) / "init" / f"{name}-L{spec['num_layers']}-seed{seed}-{_digest([spec, seed])}"
    return weights, init


def _weight_files(d: Path) -> list[str] | None:
    index = d / "model.safetensors.index.json"
    try:
        wmap = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError):
        return None
    return sorted(set(wmap.values()))


def weights_complete(d: Path) -> bool:
    files = _weight_files(d)
    return bool(files) and (d / "config.json").is_file() and all((d / f).is_file() for f in files)


def init_complete(d: Path) -> bool:
    """config.json present and every weight file (through its symlink) readable."""
    return weights_complete(d)


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())


@contextlib.contextmanager
def _locked(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _make_room(cache: Path, need: int, keep: Path, log) -> None:
    """Evict least recently used cached weights (never ``keep``) until ``need`` bytes are free."""
    free = shutil.disk_usage(cache).free
    if free >= need:
        return
    candidates = sorted((d for d in (cache / "weights").glob("*") if d.is_dir() and d != keep),
                        key=lambda d: d.stat().st_mtime)
    evicted = 0
    for d in candidates:
        size = _dir_bytes(d)
        shutil.rmtree(d, ignore_errors=True)
        evicted += 1
        log(f"[cache] evicted {d.name} ({size / GIB:.1f} GiB) to make room")
        free = shutil.disk_usage(cache).free
        if free >= need:
            break
    for d in (cache / "init").glob("*"):  # init dirs whose weights were evicted
        if d.is_dir() and not init_complete(d):
            shutil.rmtree(d, ignore_errors=True)
    if free < need:
        raise OSError(f"not enough disk for the initial weights: need {need / GIB:.1f} GiB under {cache}, "
                      f"{free / GIB:.1f} GiB free after evicting {evicted} cached model(s); set cache_dir= "
                      f"(or $MEGATRAIN_CACHE) to a larger disk")


def _link_init(init: Path, weights: Path, spec) -> None:
    tmp = init.parent / f".{init.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        spec.to_hf_config().save_pretrained(str(tmp))
        for f in weights.iterdir():
            if f.name == "config.json" or f.name.startswith("."):
                continue
            os.symlink(os.path.relpath(f, tmp), tmp / f.name)
        if init.exists():
            shutil.rmtree(init)
        tmp.rename(init)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_init_dir(spec_dict: dict, seed: int, cache: Path, log=print) -> Path:
    """The point's initial-weights directory (HF save_pretrained layout), written if missing."""
    from megatrain.spec import ModelSpec

    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / ".gitignore").exists():
        (cache / ".gitignore").write_text("# initial weights of benchmark models: large, regenerable\n*\n")
    spec = ModelSpec(**spec_dict)
    weights, init = init_paths(spec_dict, seed, cache)
    with _locked(cache / ".lock"):
        if init_complete(init):
            os.utime(weights, None) if weights.exists() else None
            log(f"[cache] initial weights: {init} (cached)")
            return init
        if not weights_complete(weights):
            from megatrain.checkpoint import write_initial_weights

            need = int(4 * spec.num_params() * 1.02) + 256 * 2**20
            weights.parent.mkdir(parents=True, exist_ok=True)
            _make_room(cache, need, keep=weights, log=log)
            t0 = time.time()
            log(f"[cache] writing initial weights of {spec.name or spec.family} ({spec.num_params() / 1e9:.3f}B "
                f"params, seed {seed}, {need / GIB:.1f} GiB) to {weights}")
            write_initial_weights(spec, weights, seed=seed, device="cpu")
            log(f"[cache] wrote {weights.name} in {time.time() - t0:.1f}s")
        os.utime(weights, None)
        _link_init(init, weights, spec)
        log(f"[cache] initial weights: {init}")
        return init
