"""Where a save lives on disk, and why a save never destroys anything it did not write.

A checkpoint is a real folder (``cp -r``, ``tar``, ``rsync`` copy it as it is)::

    ckpt/
      megatrain-checkpoint.json    root marker: "this folder is a MegaTrain checkpoint"
      latest                       one line: the name of the newest complete step folder
      step-000120/                 a complete save: config.json, model-*.safetensors + index (HF-loadable),
      step-000123/                 optimizer-*.safetensors + index, engine_state.json, megatrain-step.json
      notes.txt                    anything else anybody puts here: never touched

A save writes ``step-N.tmp-<pid>-<ns>/``, fsyncs every file and the folder, renames it to ``step-N/``, then
replaces ``latest`` atomically (tmp file + fsync + ``os.replace``). Killed at any moment, ``latest`` names
the previous complete step or the new one. Old steps beyond ``keep`` are removed after the switch, and
only folders the engine wrote: a step folder counts as the engine's only if its ``megatrain-step.json``
names that very folder (a user's ``cp -r step-000120 step-000120-keep`` or a hand-made ``step-000999/``
is left alone). Leftovers of killed saves (``*.tmp-<pid>-<ns>`` of a dead process) are swept likewise.

Refusals (one line, nothing written): a non-empty folder that is not a MegaTrain checkpoint (this
includes the HF folder a model came from: its tokenizer and weights stay as they are), a file, a save of
the layout before this one that is a real folder. A checkpoint of the previous layout (``ckpt`` a symlink
to a hidden sibling ``.ckpt.v<ns>-<pid>/``) still loads, and a save into it converts it in place: the
new folder replaces the link in one ``renameat2(RENAME_EXCHANGE)`` where the OS has it, and the old
version moves inside as an older step.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import time
from pathlib import Path

ROOT_MARKER = "megatrain-checkpoint.json"
STEP_MARKER = "megatrain-step.json"
LATEST = "latest"
ENGINE_STATE = "engine_state.json"
PARTIAL = ".megatrain-partial"  # first file of a plain folder being written (write_new_folder)
FORMAT = "megatrain-checkpoint"
STEP_FORMAT = "megatrain-step"
VERSION = 2

_STEP = re.compile(r"step-(\d+)(?:\.(\d+))?")
_LEFTOVER = re.compile(r"(?:step-\d+(?:\.\d+)?|latest)\.(tmp|del)-(\d+)-\d+")


class CheckpointRefused(FileExistsError):
    """A save that would mix with or replace files the engine did not write. Nothing was written."""


# -- reading --------------------------------------------------------------------------------------
def is_checkpoint(path) -> bool:
    p = Path(path)
    return (p / ROOT_MARKER).is_file() or (p / LATEST).is_file()


def resolve(path) -> Path:
    """The folder holding the weights to read: ``path/<latest>`` for a checkpoint folder, else ``path``
    itself (an HF folder, one step folder, or a save of the previous layout)."""
    p = Path(path)
    if not is_checkpoint(p):
        return p
    latest = p / LATEST
    if not latest.is_file():
        raise FileNotFoundError(f"checkpoint {str(p)!r} holds no completed save yet (no {LATEST!r} file)")
    name = latest.read_text().strip()
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise ValueError(f"checkpoint {str(p)!r}: {LATEST!r} must name a step folder inside it, got {name!r}")
    step = p / name
    if not step.is_dir():
        raise FileNotFoundError(f"checkpoint {str(p)!r}: {LATEST!r} names {name!r}, which is missing")
    return step


def steps(path) -> list[Path]:
    """The complete step folders the engine wrote into checkpoint ``path``, oldest save first."""
    root = Path(path)
    found = []
    for d in root.iterdir() if root.is_dir() else []:
        info = _step_info(d)
        if info is not None:
            found.append((info.get("written_ns", 0), d.name, d))
    return [d for *_, d in sorted(found)]


# -- saving ---------------------------------------------------------------------------------------
def save_step(path, step: int, write, keep: int) -> Path:
    """Write one save of the engine at ``step`` into checkpoint folder ``path`` (created if missing) and
    make it ``latest``; ``write(folder)`` writes the files. Returns the step folder."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 saves, got {keep}")
    root = Path(os.path.abspath(path))
    old = _previous_layout(root)
    if old is not None:
        return _convert_previous_layout(root, old, step, write, keep)
    fresh = _adopt_root(root)
    try:
        _sweep_leftovers(root)
        name = _free_step_name(root, step)
        _write_step(root, name, step, write)
    except BaseException:
        if fresh:  # a first save that failed leaves no trace: the marker (and a folder it made) are its own
            (root / ROOT_MARKER).unlink(missing_ok=True)
            if fresh == "created":
                _rmdir_if_empty(root)
        raise
    _point_latest(root, name)
    prune(root, keep)
    return root / name


def prune(root: Path, keep: int) -> None:
    """Remove the engine's own step folders beyond the newest ``keep`` saves (never the one ``latest``
    names). Each goes first to ``<name>.del-…`` (one rename), so a kill mid-delete leaves a name the next
    save recognises, never a half step folder that looks complete."""
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    ours = [d for d in steps(root) if d.name != latest]
    doomed = ours[:max(0, len(ours) - (keep - 1 if latest else keep))]
    for d in doomed:
        gone = root / f"{d.name}.del-{os.getpid()}-{time.time_ns()}"
        os.rename(d, gone)
        shutil.rmtree(gone, ignore_errors=True)
    if doomed:
        _fsync_dir(root)


def write_new_folder(out, write) -> Path:
    """A plain folder (an HF export, initial weights) written whole or not at all: into a hidden sibling
    ``.NAME.tmp-<pid>-<ns>/``, fsynced, then renamed to ``out``. ``out`` must not exist or be empty."""
    out = Path(os.path.abspath(out))
    old = _previous_layout(out, saved=False)
    if old is not None and (old / ENGINE_STATE).is_file():
        raise CheckpointRefused(f"refusing to write into {str(out)!r}: it holds a MegaTrain save (choose a new "
                                f"or empty folder)")
    if old is None and (out.exists() or out.is_symlink()):
        if not out.is_dir():
            raise CheckpointRefused(f"refusing to write into {str(out)!r}: it exists and is not a folder")
        if any(out.iterdir()):
            raise CheckpointRefused(f"refusing to write into {str(out)!r}: the folder is not empty "
                                    f"(choose a new or empty folder)")
    out.parent.mkdir(parents=True, exist_ok=True)
    pattern = re.compile(rf"\.{re.escape(out.name)}\.tmp-(\d+)-\d+")
    for d in out.parent.iterdir():  # of writes killed before their rename
        m = pattern.fullmatch(d.name)
        if m and d.is_dir() and not d.is_symlink() and not _alive(int(m.group(1))) and _only_ours(d, PARTIAL):
            shutil.rmtree(d, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    try:
        (tmp / PARTIAL).write_text("a MegaTrain write in progress; safe to delete if no process writes it\n")
        write(tmp)
        _fsync_tree(tmp)
        (tmp / PARTIAL).unlink()
        if old is not None:  # a previous-layout link to initial weights (no save): link and folder are the engine's
            out.unlink()
        os.rename(tmp, out)  # onto a missing name or an empty folder: atomic
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None and old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    return out


# -- the pieces -----------------------------------------------------------------------------------
def _adopt_root(root: Path) -> str | None:
    """Make ``root`` a checkpoint folder or refuse: "created" (it did not exist), "adopted" (it was an
    empty folder) or None (already a checkpoint)."""
    if root.is_symlink() and not root.exists():
        raise CheckpointRefused(f"refusing to save to {str(root)!r}: it is a broken symbolic link")
    if not root.exists():
        root.mkdir(parents=True)
        _write_marker(root)
        return "created"
    if not root.is_dir():
        raise CheckpointRefused(f"refusing to save to {str(root)!r}: it exists and is not a folder")
    if is_checkpoint(root):
        return None
    entries = sorted(p.name for p in root.iterdir())
    if not entries:
        _write_marker(root)
        return "adopted"
    shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    if (root / STEP_MARKER).is_file():
        what = f"it is one save of a checkpoint: save to the checkpoint folder {str(root.parent)!r}"
    elif (root / ENGINE_STATE).is_file():
        what = "a MegaTrain save of an older layout: load it with MegaTrain.load and save to a new folder"
    elif (root / "config.json").is_file():
        what = "a model folder (e.g. the one from_pretrained read): save to a new or empty folder"
    else:
        what = "save to a new or empty folder, or to an existing MegaTrain checkpoint"
    raise CheckpointRefused(f"refusing to save into {str(root)!r}: it is not empty and not a MegaTrain "
                            f"checkpoint (holds {shown}); {what}")


def _write_step(root: Path, name: str, step: int, write) -> None:
    tmp = root / f"{name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    try:
        # The marker first, naming the final folder: a killed save's tmp folder is recognisably ours.
        _write_json(tmp / STEP_MARKER, {"format": STEP_FORMAT, "name": name, "step": step, "complete": False})
        write(tmp)
        _write_json(tmp / STEP_MARKER, {"format": STEP_FORMAT, "name": name, "step": step, "complete": True,
                                        "written_ns": time.time_ns()})
        _fsync_tree(tmp)
        os.rename(tmp, root / name)  # ``name`` is free (checked): the folder appears complete or not at all
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _point_latest(root: Path, name: str) -> None:
    tmp = root / f"{LATEST}.tmp-{os.getpid()}-{time.time_ns()}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)  # the switch: before it ``latest`` names the previous save, after it this one
    _fsync_dir(root)


def _free_step_name(root: Path, step: int) -> str:
    """``step-000123``, or ``step-000123.1``, ``.2``, … when that name is taken (a second save at the same
    step, or a folder somebody else made)."""
    base = f"step-{step:06d}"
    name, i = base, 0
    while (root / name).exists() or (root / name).is_symlink():
        i += 1
        name = f"{base}.{i}"
    return name


def _step_info(d: Path) -> dict | None:
    """The marker of a complete step folder the engine wrote, or None."""
    if not _STEP.fullmatch(d.name) or d.is_symlink() or not d.is_dir():
        return None
    try:
        info = json.loads((d / STEP_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("format") != STEP_FORMAT or info.get("name") != d.name:
        return None
    return info if info.get("complete") else None


def _sweep_leftovers(root: Path) -> None:
    """Remove what killed saves left: ``*.del-*`` (already renamed away for deletion) and ``*.tmp-<pid>-*``
    of processes no longer alive, when it carries the engine's marker (or is empty)."""
    for d in root.iterdir():
        m = _LEFTOVER.fullmatch(d.name)
        if not m or (m.group(1) == "tmp" and _alive(int(m.group(2)))):
            continue
        if d.is_file() and not d.is_symlink() and d.name.startswith(LATEST):
            d.unlink(missing_ok=True)
        elif d.is_dir() and not d.is_symlink() and (m.group(1) == "del" or _only_ours(d, STEP_MARKER)):
            shutil.rmtree(d, ignore_errors=True)


def _only_ours(d: Path, marker: str) -> bool:
    return (d / marker).is_file() or not any(d.iterdir())


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process writes one save at a time: its own leftovers are dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the previous layout (a symlink to a hidden sibling version folder) ------------------------------
def _previous_layout(root: Path, saved: bool = True) -> Path | None:
    """The version folder ``root`` links to when ``root`` is a folder the previous layout wrote: a save
    (``saved``: its engine state present), or any such link (initial weights; the folder may be gone)."""
    if not root.is_symlink():
        return None
    target = os.readlink(root)
    if not re.fullmatch(rf"\.{re.escape(root.name)}\.v\d+-[\w-]+", target):
        return None
    version = root.parent / target
    return version if not saved or (version / ENGINE_STATE).is_file() else None


def _convert_previous_layout(root: Path, old: Path, step: int, write, keep: int) -> Path:
    """Build the new checkpoint folder beside the link, swap it in, then move the old version inside as an
    older step. Killed before the swap: the old link still loads (and the next save retries)."""
    new = root.parent / f".{root.name}.convert-{os.getpid()}-{time.time_ns()}"
    new.mkdir()
    try:
        _write_marker(new)
        name = _free_step_name(new, step)
        _write_step(new, name, step, write)
        _point_latest(new, name)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    if _exchange(new, root):  # atomic: ``root`` is the link, then the folder; ``new`` now holds the link
        new.unlink()
    else:  # no renameat2 here: a moment without ``root``; ``new`` holds the new save meanwhile
        root.unlink()
        os.rename(new, root)
    _fsync_dir(root.parent)
    try:
        old_step = int(json.loads((old / ENGINE_STATE).read_text())["step"])
        old_name = _free_step_name(root, old_step)
        os.rename(old, root / old_name)
        _write_json(root / old_name / STEP_MARKER, {"format": STEP_FORMAT, "name": old_name, "step": old_step,
                                                    "complete": True, "written_ns": 0})  # older than any
        _fsync_dir(root)
    except (OSError, ValueError, KeyError):
        pass  # the old version stays where it was; the new checkpoint is complete without it
    prune(root, keep)
    return root / name


def _exchange(a: Path, b: Path) -> bool:
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


# -- small durable writes -----------------------------------------------------------------------------
def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _write_marker(root: Path) -> None:
    """The root marker, written in place: even a torn one marks the folder (only its presence counts)."""
    with open(root / ROOT_MARKER, "w") as f:
        f.write(json.dumps({"format": FORMAT, "version": VERSION}, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(root)


def _rmdir_if_empty(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for f in folder.iterdir():
        fsync_file(f)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fsync_file(folder)
