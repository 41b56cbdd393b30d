"""One sweep point, in its own process.

    python -m experiments.point <point_dir>/point.json          # train and measure
    python -m experiments.point --init <point_dir>/point.json   # write the model's initial weights

The runner (``experiments.run``) writes ``point.json`` and starts this module with a timeout; its stdout
and stderr go to ``<point_dir>/log.txt``. Training builds the system through
``baselines.registry.build_system`` (or the system's ``factory``), runs ``warmup_steps + steps`` steps on
``megatrain.data.synthetic_batch`` and appends one JSON line per step to ``metrics.jsonl`` as it goes
(nothing is lost if the process dies), then writes ``result.json``. Exceptions are classified into
gpu_oom / host_oom / error there; deaths the process cannot report (timeout, SIGKILL from the kernel's
OOM killer) are classified by the runner from the exit status (``launch``).

Initial weights are materialised once per (model shape, seed) in a cache
(``$MEGATRAIN_CACHE`` or ``<results_dir>/.init_cache``) and reused by every system and sweep: the weights
live in ``weights/<shape key>/``; each exact config gets ``init/<config key>/`` with its own
``config.json`` and symlinks to the weight files (configs that differ only in max_position_embeddings,
rope_theta or rms_norm_eps share the weights). When the disk is short, the least recently used cached
weights are evicted first.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .schema import sanitize

GIB = 2**30
REPO_ROOT = Path(__file__).resolve().parents[1]
_NON_WEIGHT_FIELDS = ("name", "max_position_embeddings", "rope_theta", "rms_norm_eps")
KILL_GRACE_S = 10.0


# ================================================================================================
# initial-weight cache
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


# ================================================================================================
# the point process
# ================================================================================================
def load_callable(ref: str):
    """``package.module:name`` or ``/path/to/file.py:name``."""
    mod, _, attr = ref.rpartition(":")
    if not mod or not attr:
        raise ValueError(f"factory must look like 'package.module:function' or '/path/file.py:function', got {ref!r}")
    if mod.endswith(".py") or os.sep in mod:
        path = Path(mod).resolve()
        name = f"_factory_{sanitize(path.stem)}_{_digest(str(path))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load factory module from {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod)
    return getattr(module, attr)


def resolve_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    from megatrain.config import parse_dtype

    return parse_dtype(dtype)


def build_system(pt: dict, init_dir: str):
    """The point's TrainSystem: its ``factory`` if set, else ``baselines.registry.build_system``."""
    from megatrain.system import OptimConfig

    o = pt["optim"]
    optim = OptimConfig(lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], weight_decay=o["weight_decay"],
                        max_grad_norm=o["max_grad_norm"], warmup_steps=o["lr_warmup_steps"], total_steps=None)
    kwargs = dict(init_dir=init_dir, optim=optim, micro_batches=pt["micro_batches"], device=pt["device"],
                  dtype=resolve_dtype(pt["dtype"], pt["device"]),
                  activation_checkpointing=pt["activation_checkpointing"], options=dict(pt["options"] or {}))
    if pt.get("factory"):
        factory = load_callable(pt["factory"])
        if _accepts(factory, "name"):
            kwargs["name"] = pt["system"]
        return factory(**kwargs)
    from baselines.registry import build_system as registry_build

    return registry_build(pt["system"], **kwargs)


def _accepts(fn, param: str) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return param in params


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen and len(seen) < 8:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def classify(exc: BaseException) -> str:
    """gpu_oom / host_oom / error for an exception (or its cause)."""
    for e in _chain(exc):
        names = {c.__name__ for c in type(e).__mro__}
        if "OutOfMemory" in names:  # baselines.common.OutOfMemory(kind="gpu"|"host")
            return "host_oom" if getattr(e, "kind", "gpu") == "host" else "gpu_oom"
        if "OutOfMemoryError" in names:  # torch.OutOfMemoryError (= torch.cuda.OutOfMemoryError)
            return "gpu_oom"
        if isinstance(e, MemoryError):
            return "host_oom"
        msg = str(e)
        if "CUDA out of memory" in msg or "CUDA error: out of memory" in msg:
            return "gpu_oom"
        if "DefaultCPUAllocator: can't allocate memory" in msg or "CUDAHostAllocator" in msg and "memory" in msg:
            return "host_oom"
    return "error"


def one_line(text: str, limit: int = 500) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_text(exc: BaseException) -> str:
    """``Type: message`` on one line (what a traceback's last line says)."""
    msg = str(exc).strip()
    return one_line(f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__)


def summarize(records: list[dict], pt: dict) -> dict:
    """Step statistics of the measured (non-warmup) steps, and first/last loss of all steps."""
    out = {"steps_done": len(records)}
    if records:
        out["loss_first"] = records[0].get("loss")
        out["loss_last"] = records[-1].get("loss")
    times = [r["step_time_s"] for r in records if not r.get("warmup")]
    out["measured_steps_done"] = len(times)
    if not times:
        return out
    med = statistics.median(times)
    tokens = pt["batch_size"] * pt["seq_len"]
    spec = pt["spec"]
    flops = step_flops(pt["num_params"], spec["num_layers"], spec["hidden_size"], pt["seq_len"], tokens)
    tflops = flops / med / 1e12 if med > 0 else None
    peak = pt["hardware"].get("peak_tflops")
    out.update(step_time_median_s=med, step_time_mean_s=statistics.fmean(times),
               tokens_per_s=tokens / med if med > 0 else None, tflops=tflops,
               mfu=(tflops / peak) if (tflops is not None and peak) else None, step_flops=flops)
    return out


def step_flops(num_params: int, num_layers: int, hidden: int, seq_len: int, tokens: int) -> float:
    """``megatrain.system.step_flops`` (6·P·T + 12·L·h·s·T), imported lazily so the runner's parent side
    stays light; the same formula if megatrain cannot be imported."""
    try:
        from megatrain.system import step_flops as f
    except Exception:
        return 6.0 * num_params * tokens + 12.0 * num_layers * hidden * seq_len * tokens
    return f(num_params, num_layers, hidden, seq_len, tokens)


def read_metrics(path: Path) -> list[dict]:
    records = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    with contextlib.suppress(ValueError):
                        records.append(json.loads(line))
    except OSError:
        pass
    return records


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default))
    tmp.replace(path)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def _finite(x):
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _cap_gpu_memory(torch, pt: dict, log) -> None:
    cap = pt["hardware"].get("gpu_mem_gib")
    if not cap:
        return
    dev = torch.device(pt["device"])
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    frac = min(1.0, float(cap) * GIB / total)
    torch.cuda.set_per_process_memory_fraction(frac, index)
    log(f"[point] emulating {pt['hardware']['label']}: GPU memory capped to {cap} GiB "
        f"(fraction {frac:.4f} of {total / GIB:.1f} GiB; caching allocator only, compute unchanged)")


def train(pt: dict) -> int:
    """Body of the point process. Always writes result.json; exit status 0 only for ok."""
    from tqdm import tqdm

    from .monitor import Monitor

    pdir = Path(pt["point_dir"])
    pdir.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    result: dict = {"point": pt["id"], "status": "error", "error": "", "pid": os.getpid()}
    t_start = time.time()
    records: list[dict] = []
    system = mon = None
    cuda = str(pt["device"]).startswith("cuda")
    try:
        from omegaconf import OmegaConf

        (pdir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(
            {k: v for k, v in pt.items() if k != "run"} | {"run": pt.get("run", {})})))
        import torch

        from megatrain.data import synthetic_batch

        if pt.get("torch_threads"):
            torch.set_num_threads(int(pt["torch_threads"]))

        log(f"[point] {pt['id']}: {pt['system']} ({pt['variant']}) on {pt['device']}, model {pt['model']} "
            f"{pt['num_params'] / 1e9:.3f}B params, batch {pt['batch_size']} x seq {pt['seq_len']}, "
            f"{pt['warmup_steps']} warmup + {pt['steps']} steps; torch {torch.__version__}")
        if cuda:
            _cap_gpu_memory(torch, pt, log)
            result["gpu_name"] = torch.cuda.get_device_name(torch.device(pt["device"]))
        mon = Monitor(interval=0.2, gpu=cuda).start()
        t0 = time.time()
        system = build_system(pt, pt["init_dir"])
        result["build_s"] = time.time() - t0
        log(f"[point] built {pt['system']} in {result['build_s']:.1f}s")
        # What the system chose at build time (e.g. which CPU Adam ran), kept with the result.
        result["system_info"] = json.loads(json.dumps(getattr(system, "info", {}) or {}, default=str))
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        total = pt["warmup_steps"] + pt["steps"]
        vocab = pt["spec"]["vocab_size"]
        with open(pdir / "metrics.jsonl", "a") as mf, \
                tqdm(total=total, desc="steps", file=sys.stderr, mininterval=5, dynamic_ncols=False) as bar:
            for i in range(total):
                batch = synthetic_batch(vocab, pt["batch_size"], pt["seq_len"], pt["seed"], step=i)
                sync()
                t = time.perf_counter()
                r = system.step(batch)
                sync()
                dt = time.perf_counter() - t
                rec = {"step": i, "warmup": i < pt["warmup_steps"], "loss": _finite(r.loss), "step_time_s": dt,
                       "system_step_time_s": _finite(getattr(r, "step_time_s", None)),
                       "lr": _finite(getattr(r, "lr", None)), "grad_norm": _finite(getattr(r, "grad_norm", None)),
                       "tokens": getattr(r, "tokens", None), "host_rss_gib": mon.last_rss / GIB,
                       "time": time.time()}
                if cuda:
                    rec["gpu_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                records.append(rec)
                bar.update(1)
                bar.write(f"step {i:3d}{' (warmup)' if rec['warmup'] else '         '} loss {rec['loss']} "
                          f"time {dt:.3f}s rss {rec['host_rss_gib']:.2f} GiB", file=sys.stderr)
        mem = system.memory()
        result["memory"] = mem.to_dict() if hasattr(mem, "to_dict") else dict(vars(mem))
        if cuda:
            result["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            result["gpu_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        else:
            result["gpu_peak_allocated_bytes"] = mem.gpu_peak_allocated if mem.gpu_peak_allocated >= 0 else None
            result["gpu_peak_reserved_bytes"] = mem.gpu_peak_reserved if mem.gpu_peak_reserved >= 0 else None
        result["host_pinned_bytes"] = mem.host_pinned if getattr(mem, "host_pinned", -1) >= 0 else None
        result["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - every failure becomes a row
        result["status"] = classify(e)
        result["error"] = error_text(e)
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        if system is not None:
            try:
                system.close()
            except Exception as e:  # a failing close does not undo a measurement
                log(f"[point] warning: close() failed: {error_text(e)}")
        if mon is not None:
            peaks = mon.stop()
            result["host_peak_rss_bytes"] = peaks["host_peak_rss_bytes"]
            result["gpu_peak_nvml_bytes"] = peaks["gpu_peak_nvml_bytes"]
        result["metrics"] = summarize(records, pt)
        result["duration_s"] = time.time() - t_start
        _write_json(pdir / "result.json", result)
        log(f"[point] {result['status']}{': ' + result['error'] if result['error'] else ''}")
    return 0 if result["status"] == "ok" else 1


def init_main(pt: dict) -> int:
    try:
        ensure_init_dir(pt["spec"], pt["seed"], Path(pt["cache_dir"]), log=lambda m: print(m, flush=True))
    except BaseException as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"[init] {classify(e)}: {error_text(e)}", flush=True)
        return 1
    return 0


def _die_with_runner() -> None:
    """Ask Linux to SIGKILL this process when the runner dies (the point runs in its own session, so
    a runner killed from outside would otherwise leave it holding the GPU)."""
    runner = os.environ.get("MEGATRAIN_RUNNER_PID")
    if not runner or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        return
    if os.getppid() != int(runner):  # the runner died before prctl took effect
        os._exit(1)


def main(argv=None) -> int:
    _die_with_runner()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("point_json", help="point.json written by the runner")
    ap.add_argument("--init", action="store_true", help="only write the model's initial weights into the cache")
    args = ap.parse_args(argv)
    pt = json.loads(Path(args.point_json).read_text())
    return init_main(pt) if args.init else train(pt)


# ================================================================================================
# the runner's side: start the process, classify how it ended, build the CSV row
# ================================================================================================
def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(args: list[str], *, timeout: float, log_path: Path, monitor: bool = False,
              threads: int | None = None) -> dict:
    """Run ``python -m experiments.point *args`` in a new session with its output appended to
    ``log_path``; on timeout the whole process group is terminated (then killed)."""
    env = os.environ.copy()
    env["PYTHONUNBUFFERED"] = "1"
    env["MEGATRAIN_RUNNER_PID"] = str(os.getpid())
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(int(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "experiments.point", *args]
    t0 = time.time()
    timed_out = False
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        mon = None
        if monitor:
            from .monitor import Monitor

            mon = Monitor(pid=proc.pid, interval=0.5, gpu=False).start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            peaks = mon.stop() if mon is not None else {}
    return {"rc": rc, "timed_out": timed_out, "duration_s": time.time() - t0,
            "outside_peak_rss_bytes": peaks.get("host_peak_rss_bytes")}


def last_log_line(path: Path, skip_prefixes=("[point]",)) -> str:
    try:
        lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if not line.startswith(skip_prefixes) and "\r" not in line:
            return one_line(line)
    return one_line(lines[-1]) if lines else ""


def _death(child: dict, what: str, timeout: float, log_path: Path) -> tuple[str, str]:
    rc = child["rc"]
    if child["timed_out"]:
        return "timeout", f"timeout: {what} exceeded {timeout:.0f}s and was terminated"
    if rc is not None and rc < 0:
        sig = -rc
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig == signal.SIGKILL:
            peak = child.get("outside_peak_rss_bytes")
            at = f" at ~{peak / GIB:.1f} GiB RSS" if peak else ""
            return "host_oom", f"host_oom_killed: {what} killed by SIGKILL{at} (likely the kernel OOM killer)"
        return "error", f"{what} killed by {name}"
    return "error", f"{what} exited with status {rc}: {last_log_line(log_path)}"


def launch(pt: dict, *, timeout: float, init_timeout: float, log=print) -> dict:
    """Run one point: initial weights (if not cached), then training, each in a subprocess. Returns the
    point's result dict (``status``, ``error``, metrics; see ``train``) whatever happened."""
    pdir = Path(pt["point_dir"])
    if pdir.exists():
        shutil.rmtree(pdir)
    pdir.mkdir(parents=True)
    pjson = pdir / "point.json"
    pjson.write_text(json.dumps(pt, indent=2, default=_json_default))
    log_path = pdir / "log.txt"
    result: dict = {"launched": True}
    if not init_complete(Path(pt["init_dir"])):
        child = run_child(["--init", str(pjson)], timeout=init_timeout, log_path=log_path, monitor=True,
                          threads=pt.get("torch_threads"))
        result["init_s"] = child["duration_s"]
        if child["rc"] != 0 or not init_complete(Path(pt["init_dir"])):
            status, error = _death(child, "writing the initial weights", init_timeout, log_path)
            if not child["timed_out"] and child["rc"] is not None and child["rc"] > 0:
                line = last_log_line(log_path)
                if line.startswith("[init] "):
                    status, _, error = line[len("[init] "):].partition(": ")
                    status = status if status in ("gpu_oom", "host_oom", "error") else "error"
                error = f"initial weights: {error}"
            result.update(status=status, error=error, duration_s=child["duration_s"], init_failed=True,
                          host_peak_rss_bytes=child.get("outside_peak_rss_bytes"))
            return result
    child = run_child([str(pjson)], timeout=timeout, log_path=log_path, monitor=True,
                      threads=pt.get("torch_threads"))
    rjson = pdir / "result.json"
    if rjson.exists() and not child["timed_out"]:
        try:
            result.update(json.loads(rjson.read_text()))
        except ValueError:
            result.update(status="error", error="unreadable result.json")
    else:
        status, error = _death(child, "the point process", timeout, log_path)
        records = read_metrics(pdir / "metrics.jsonl")
        result.update(status=status, error=error, metrics=summarize(records, pt),
                      host_peak_rss_bytes=child.get("outside_peak_rss_bytes"))
        if status != "ok":
            for k in ("step_time_median_s", "step_time_mean_s", "tokens_per_s", "tflops", "mfu"):
                result["metrics"].pop(k, None)
    result["duration_s"] = child["duration_s"]
    result["returncode"] = child["rc"]
    return result


def to_row(pt: dict, result: dict, env: dict) -> dict:
    """The CSV row (``experiments.schema.COLUMNS``) of a point and its result."""
    spec = pt["spec"]
    m = result.get("metrics") or {}
    gib = lambda b: (b / GIB) if isinstance(b, (int, float)) and b is not None and b >= 0 else None  # noqa: E731
    p = pt["num_params"]
    rss = result.get("host_peak_rss_bytes")
    est = pt.get("host_estimate_bytes")
    ok = result.get("status") == "ok"
    hw = pt["hardware"]
    return dict(
        sweep=pt["sweep"], point=pt["id"], system=pt["system"], variant=pt["variant"],
        status=result.get("status", "error"), error=result.get("error", ""), model=pt["model"],
        family=spec["family"], num_params=p, num_layers=spec["num_layers"], hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"], width_mult=pt["width"], seq_len=pt["seq_len"],
        batch_size=pt["batch_size"], micro_batches=pt["micro_batches"],
        tokens_per_step=pt["batch_size"] * pt["seq_len"], hardware=hw["label"], emulated=hw["emulated"],
        gpu_mem_cap_gib=hw.get("gpu_mem_gib"), steps=pt["steps"], warmup_steps=pt["warmup_steps"],
        step_time_median_s=m.get("step_time_median_s") if ok else None,
        step_time_mean_s=m.get("step_time_mean_s") if ok else None,
        tokens_per_s=m.get("tokens_per_s") if ok else None, tflops=m.get("tflops") if ok else None,
        mfu=m.get("mfu") if ok else None, peak_tflops=hw.get("peak_tflops"),
        gpu_peak_allocated_gib=gib(result.get("gpu_peak_allocated_bytes")),
        gpu_peak_reserved_gib=gib(result.get("gpu_peak_reserved_bytes")),
        gpu_peak_nvml_gib=gib(result.get("gpu_peak_nvml_bytes")),
        host_peak_rss_gib=gib(rss), host_pinned_gib=gib(result.get("host_pinned_bytes")),
        host_bytes_per_param=(rss / p) if rss and p else None,
        host_estimate_gib=gib(est), loss_first=m.get("loss_first"), loss_last=m.get("loss_last"),
        gpu_name=result.get("gpu_name") or env.get("gpu_name", ""), driver=env.get("driver", ""),
        torch_version=env.get("torch_version", ""), transformers_version=env.get("transformers_version", ""),
        deepspeed_version=env.get("deepspeed_version", ""), git_sha=env.get("git_sha", ""),
        host_ram_gib=env.get("host_ram_gib"), date=_now(),
        duration_s=result.get("duration_s"),
    )


def _now() -> str:
    from .envinfo import now

    return now()


if __name__ == "__main__":
    sys.exit(main())
