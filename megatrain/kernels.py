"""Build and load the host AdamW C++ extension (megatrain/csrc/adamw.cpp), bounded in time, once per hash.

    python -m megatrain.kernels build     # build ahead (the runner does this before it launches points)
    python -m megatrain.kernels status    # where the extension is, or why not

* **One build per hash.** The extension is named ``megatrain_cpu_adamw_<hash>``, the hash being that of the
  source, the compiler flags, the torch version and the Python ABI, and it lives in one file,
  ``<cache>/megatrain_cpu_adamw_<hash>.so`` (cache: ``$MEGATRAIN_KERNEL_CACHE``, else
  ``$TORCH_EXTENSIONS_DIR/megatrain``, else ``~/.cache/torch_extensions/megatrain``). Checkouts, venvs and
  flag choices never overwrite each other's builds.
* **Built in a child process, into a fresh temporary folder, then renamed into place** (an atomic rename): a
  process killed mid-build leaves no half-written extension and no lock that others wait on; the
  compiler's memory is never the caller's. A process that finds the file loads it and compiles nothing.
* **Never an unbounded wait.** Concurrent builders of one hash serialise on ``<name>.lock`` with
  ``flock``, which the kernel releases when its holder dies (a stale lock file is just a file). Waiting for
  the lock and the build itself are each bounded by ``$MEGATRAIN_KERNEL_BUILD_TIMEOUT`` seconds (600).
* **A failure falls back.** No compiler, no ninja, a compile error or a timeout: one warning line, and the
  engine uses torch's fused AdamW. The failure is remembered in ``<name>.failed`` so later processes do not
  retry (``python -m megatrain.kernels build`` always retries).

Flags: ``-O3 -ffp-contract=off`` and a fixed ISA (``-mavx2 -mfma`` where the CPU has both, else the
compiler's baseline), never ``-march=native``: with no contraction (the one FMA is an explicit ``std::fma``,
where torch's kernel has one) the arithmetic is IEEE operation by operation, the same bits on every machine. ``$MEGATRAIN_HOST_ADAMW_CFLAGS`` appends
flags (e.g. ``-mno-avx512f`` or ``-march=native``; they enter the hash).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "adamw.cpp"
BASE = "megatrain_cpu_adamw"
DEFAULT_TIMEOUT_S = 600.0

# The child that compiles: only torch's build helper, not the megatrain package (nothing heavy, no engine).
_CHILD = """
import sys
from torch.utils.cpp_extension import load
name, src, build_dir = sys.argv[1:4]
flags = sys.argv[4:]
load(name=name, sources=[src], extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=build_dir,
     verbose=True)
"""


class BuildError(RuntimeError):
    """The extension could not be built or loaded here (the message is one line)."""


def isa_flags() -> list[str]:
    """A fixed instruction set, never the build machine's own: AVX2 on x86 CPUs that have it."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        try:
            cpu = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
        flags = next((line.split(":", 1)[1].split() for line in cpu.splitlines() if line.startswith("flags")), [])
        if "avx2" in flags and "fma" in flags:
            return ["-mavx2", "-mfma"]
    return []


def extra_flags() -> list[str]:
    """Flags appended by ``$MEGATRAIN_HOST_ADAMW_CFLAGS`` (e.g. ``-march=native``)."""
    return os.environ.get("MEGATRAIN_HOST_ADAMW_CFLAGS", "").split()


def cflags() -> list[str]:
    return ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", *isa_flags(), *extra_flags()]


def build_id(flags: list[str] | None = None, source: bytes | None = None) -> str:
    """Hash of what the compiled file depends on: source, flags, torch version, Python ABI, CPU arch, compiler."""
    import torch

    h = hashlib.sha256(SOURCE.read_bytes() if source is None else source)
    for part in (*(flags if flags is not None else cflags()), torch.__version__, sys.implementation.cache_tag,
                 platform.machine(), os.environ.get("CXX", "c++")):
        h.update(b"\0" + str(part).encode())
    return h.hexdigest()[:16]


def name() -> str:
    return kernel_name()


def kernel_name(source: bytes | None = None) -> str:
    return f"{BASE}_{build_id(source=source)}"


def cache_dir() -> Path:
    if os.environ.get("MEGATRAIN_KERNEL_CACHE"):
        return Path(os.environ["MEGATRAIN_KERNEL_CACHE"])
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    return Path(root) / "megatrain"


def so_path() -> Path:
    return cache_dir() / f"{name()}.so"


def timeout_s() -> float:
    return float(os.environ.get("MEGATRAIN_KERNEL_BUILD_TIMEOUT", DEFAULT_TIMEOUT_S))


def load_built():
    """The extension module if this hash's file exists (no compile), else None."""
    path = so_path()
    if not path.exists():
        return None
    import torch  # noqa: F401  (the extension links against libtorch, which must be loaded first)

    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compile(dest: Path, timeout: float) -> None:
    """Compile in a child process into a fresh folder beside ``dest``, then rename the file into place."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise BuildError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{dest.stem}-", dir=dest.parent))
    try:
        source = tmp / SOURCE.name
        source.write_bytes(SOURCE.read_bytes())
        if kernel_name(source.read_bytes()) != dest.stem:  # edited since the name was made: not this hash
            raise BuildError(f"{SOURCE} changed during the build; run it again")
        cmd = [sys.executable, "-c", _CHILD, dest.stem, str(source), str(tmp), *cflags()]
        # Its own session, so that a timeout ends ninja and the compilers with it (their process group).
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
        try:
            log, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(child)
            raise BuildError(f"the compile did not finish within {timeout:.0f} s "
                             f"(MEGATRAIN_KERNEL_BUILD_TIMEOUT)") from None
        built = tmp / f"{dest.stem}.so"
        if child.returncode != 0 or not built.exists():
            lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
            why = next((ln for ln in lines if "error:" in ln.lower()),
                       next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "no output"))
            raise BuildError(f"the compile failed (exit {child.returncode}): {why[:300]}")
        os.replace(built, dest)  # atomic: readers see no file or the whole file
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # our own temporary folder, nothing else


def _kill_group(child: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait(timeout=30)


class _Lock:
    """An exclusive ``flock`` on a file, acquired within ``timeout`` seconds or not at all. The kernel drops
    the lock when its holder exits or is killed, so a lock file left behind never blocks anyone."""

    def __init__(self, path: Path, timeout: float):
        self.path, self.timeout, self.fd = path, timeout, None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # no flock here: the temporary folder + rename alone keep builds safe
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                    os.close(fd)
                    raise BuildError(f"another process (pid {holder}) has been building it for more than "
                                     f"{self.timeout:.0f} s") from None
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # for the message above; the lock is the flock
        self.fd = fd
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # releases the flock


def build(force: bool = False, timeout: float | None = None) -> Path:
    """Build this hash's extension unless it exists; return its path. Raises ``BuildError`` (one line).
    A failure is remembered in ``<name>.failed`` and raised again without compiling, unless ``force``."""
    timeout = timeout_s() if timeout is None else timeout
    dest = so_path()
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    failed = dest.with_suffix(".failed")
    if failed.exists() and not force:
        raise BuildError(f"{failed.read_text().strip()} (an earlier attempt; `python -m megatrain.kernels "
                         f"build` retries)")
    t0 = time.monotonic()
    with _Lock(dest.with_suffix(".lock"), timeout):
        if dest.exists():  # built by the process we waited for
            return dest
        for left in dest.parent.glob(f".build-{dest.stem}-*"):  # no one else builds this hash: a killed build's
            shutil.rmtree(left, ignore_errors=True)
        try:
            _compile(dest, max(1.0, timeout - (time.monotonic() - t0)))
        except BuildError as exc:
            failed.write_text(str(exc))
            raise
    failed.unlink(missing_ok=True)
    return dest


def fallback_warning(exc: BaseException) -> str:
    why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"host AdamW extension unavailable ({why}); using torch's fused AdamW"


def build_ahead(verbose: bool = True, retry: bool = False) -> Path | None:
    """Build (or find) the host AdamW extension now, before anything is timed; returns its path, or None
    when it cannot be built here (after one warning line: the engine then uses torch's fused AdamW) or
    when ``MEGATRAIN_HOST_ADAMW=torch`` asks for torch's kernel. A build that failed earlier is retried only
    with ``retry`` (the command line does; a runner need not spend the timeout again on every sweep)."""
    if os.environ.get("MEGATRAIN_HOST_ADAMW", "auto") == "torch":
        return None
    t0 = time.monotonic()
    existed = so_path().exists()
    try:
        path = build(force=retry)
    except BuildError as exc:
        warnings.warn(fallback_warning(exc), RuntimeWarning, stacklevel=2)
        return None
    if verbose:
        what = "found" if existed else f"built in {time.monotonic() - t0:.0f} s"
        print(f"host AdamW extension {what}: {path}", file=sys.stderr)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build"]:
        return 0 if build_ahead(retry=True) is not None else 1
    if argv[:1] == ["status"]:
        path = so_path()
        failed = path.with_suffix(".failed")
        state = "built" if path.exists() else (f"failed: {failed.read_text().strip()}" if failed.exists()
                                               else "not built")
        print(f"{path}: {state} (flags: {' '.join(cflags())})")
        return 0 if path.exists() else 1
    print("usage: python -m megatrain.kernels {build|status}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
