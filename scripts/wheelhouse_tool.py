#!/usr/bin/env python3
"""Helpers behind scripts/build_wheelhouse.sh and scripts/install_offline.sh.

Standard library plus `packaging` (pip's vendored copy when the standalone one is missing), so it
runs on the offline GPU node as well as here. See docs/wheelhouse.md.

  pins PINS                         check the pin file; print name, version, role, method (TSV)
  have DIR NAME VERSION             print the wheel in DIR that is NAME==VERSION (exit 1: none)
  check-built WHEEL                 a wheel built here from an sdist must be pure py3-none-any
  finalize DIR --pins P --node N --project NAME
                                    drop stale wheels, check the set, write DIR/MANIFEST.txt
  plan DIR                          (node) check DIR against its MANIFEST.txt; print
                                    role, name, version, path (TSV)
  need NAME VERSION                 exit 0 when this interpreter lacks NAME or has it older
  smoke WHEEL...                    import the wheels' top-level modules in a clean interpreter
"""
from __future__ import annotations

import argparse
import email.parser
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

try:
    from packaging.markers import Marker  # noqa: F401
    from packaging.requirements import Requirement
    from packaging.tags import compatible_tags, cpython_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pragma: no cover - only where packaging itself is absent
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.tags import compatible_tags, cpython_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

MANIFEST = "MANIFEST.txt"
ROLES = ("required", "optional", "fallback", "project")
TAGS = {"sdist", "optional", "fallback"}
# Never shipped: the node's CUDA torch stack stays exactly as it is.
FORBIDDEN = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch-triton.*|nvidia-(?!ml-py$).*)$")

# The GPU node: CPython 3.12, glibc manylinux x86_64.
TARGET_PY = (3, 12)
TARGET_PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(28, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
TARGET_MARKERS = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_python_implementation": "CPython",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "os_name": "posix", "platform_release": "", "platform_version": "", "extra": "",
}


class WheelhouseError(Exception):
    pass


def _norm(name: str) -> str:
    return str(canonicalize_name(name))


def target_tags() -> set:
    tags = set(cpython_tags(TARGET_PY, abis=["cp312", "abi3", "none"], platforms=TARGET_PLATFORMS))
    tags |= set(compatible_tags(TARGET_PY, "cp312", TARGET_PLATFORMS))
    return tags


# ----------------------------------------------------------------------------- pin file

def parse_pins(path) -> list[dict]:
    """[{name, version, role, method, line}] from the pin file; raises WheelhouseError."""
    entries, seen, errors = [], {}, []
    for lineno, raw in enumerate(Path(path).read_text().splitlines(), 1):
        body, _, comment = raw.partition("#")
        body = body.strip()
        if not body:
            continue
        where = f"{path}:{lineno}"
        try:
            req = Requirement(body)
        except Exception as e:  # InvalidRequirement
            errors.append(f"{where}: not a requirement: {body!r} ({e})")
            continue
        specs = list(req.specifier)
        if req.extras or req.marker or req.url or len(specs) != 1 or specs[0].operator != "==" \
                or "*" in specs[0].version:
            errors.append(f"{where}: pin exactly one version as name==version, got {body!r}")
            continue
        name = _norm(req.name)
        if FORBIDDEN.match(name):
            errors.append(f"{where}: {name} must never be in the wheelhouse (the node's torch stack is used as is)")
            continue
        if name in seen:
            errors.append(f"{where}: {name} pinned twice (also line {seen[name]})")
            continue
        seen[name] = lineno
        tags = set(re.findall(r"\[([^\]]*)\]", comment))
        tags = {t for group in tags for t in group.replace(",", " ").split()}
        unknown = tags - TAGS
        if unknown:
            errors.append(f"{where}: unknown tag(s) {sorted(unknown)}; known: {sorted(TAGS)}")
            continue
        if {"optional", "fallback"} <= tags:
            errors.append(f"{where}: a pin is either [optional] or [fallback], not both")
            continue
        role = "optional" if "optional" in tags else "fallback" if "fallback" in tags else "required"
        entries.append({"name": name, "version": specs[0].version, "role": role,
                        "method": "sdist" if "sdist" in tags else "binary", "line": lineno})
    if errors:
        raise WheelhouseError("\n".join(errors))
    if not entries:
        raise WheelhouseError(f"{path}: no pins")
    return entries


def parse_node_packages(path) -> set:
    names = set()
    for raw in Path(path).read_text().splitlines():
        body = raw.split("#", 1)[0].strip()
        if body:
            names.add(_norm(re.split(r"[\s=<>!~;\[]", body, maxsplit=1)[0]))
    return names


# ----------------------------------------------------------------------------- wheels

def wheel_info(path) -> dict:
    path = Path(path)
    name, version, _build, tags = parse_wheel_filename(path.name)
    return {"name": _norm(name), "version": str(version), "tags": tags, "path": path}


def wheels_in(directory) -> list[dict]:
    return [wheel_info(p) for p in sorted(Path(directory).glob("*.whl"))]


def find_wheel(directory, name, version):
    want = (_norm(name), str(Version(version)))
    for w in wheels_in(directory):
        if (w["name"], str(Version(w["version"]))) == want:
            return w
    return None


def _dist_info_file(zf: zipfile.ZipFile, leaf: str) -> str:
    hits = [n for n in zf.namelist()
            if n.count("/") == 1 and n.split("/")[0].endswith(".dist-info") and n.endswith("/" + leaf)]
    if len(hits) != 1:
        raise WheelhouseError(f"{zf.filename}: expected one *.dist-info/{leaf}, found {hits}")
    return hits[0]


def wheel_metadata(path):
    with zipfile.ZipFile(path) as zf:
        return email.parser.Parser().parsestr(zf.read(_dist_info_file(zf, "METADATA")).decode("utf-8"))


def wheel_requirements(path) -> list:
    """Requirements that apply on the node (no extras; markers evaluated for CPython 3.12 Linux)."""
    out = []
    for line in wheel_metadata(path).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(dict(TARGET_MARKERS)):
            out.append(req)
    return out


def top_level_modules(path) -> list[str]:
    """Importable top-level modules and packages that a wheel installs."""
    mods = set()
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
    for n in names:
        first, _, rest = n.partition("/")
        if first.endswith((".dist-info", ".data")):
            continue
        if not rest:
            if n.endswith(".py"):
                mods.add(n[:-3])
            elif n.endswith((".so", ".pyd")):
                mods.add(n.split(".", 1)[0])
        elif rest == "__init__.py" or (rest.startswith("__init__.") and rest.endswith((".so", ".pyd"))):
            mods.add(first)
    return sorted(m for m in mods if m.isidentifier() and not m.startswith("_")
                  and m not in ("tests", "test", "docs", "examples", "benchmarks"))


def check_built(path) -> None:
    """A wheel built here from an sdist must run anywhere: py3-none-any, purelib, no binaries."""
    w = wheel_info(path)
    if not any(t.abi == "none" and t.platform == "any" for t in w["tags"]):
        raise WheelhouseError(f"{path.name}: built wheel is not pure python (tags {sorted(map(str, w['tags']))})")
    with zipfile.ZipFile(path) as zf:
        binaries = [n for n in zf.namelist() if n.endswith((".so", ".pyd", ".dll", ".dylib"))
                    or re.search(r"\.so\.\d", n)]
        wheel_txt = zf.read(_dist_info_file(zf, "WHEEL")).decode()
        installed = [n for n in zf.namelist() if n.endswith("deepspeed/git_version_info_installed.py")]
        ops = zf.read(installed[0]).decode() if installed else ""
    if binaries:
        raise WheelhouseError(f"{path.name}: contains compiled files built on this machine: {binaries[:5]}")
    if "Root-Is-Purelib: true" not in wheel_txt:
        raise WheelhouseError(f"{path.name}: not a purelib wheel")
    if re.search(r"installed_ops=.*True", ops):
        raise WheelhouseError(f"{path.name}: DeepSpeed ops were pre-compiled (build with DS_BUILD_OPS=0)")


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- build side

def finalize(directory, pins_path, node_path, project, max_mib=20.0, log=print) -> list[dict]:
    """Prune stale wheels, check the set, write MANIFEST.txt. Returns the manifest rows."""
    directory = Path(directory)
    pins = parse_pins(pins_path)
    node = parse_node_packages(node_path)
    project = _norm(project)
    role_of = {p["name"]: p for p in pins}
    errors, keep = [], []
    for w in wheels_in(directory):
        pin = role_of.get(w["name"])
        current = (pin is not None and Version(w["version"]) == Version(pin["version"])) or w["name"] == project
        if FORBIDDEN.match(w["name"]):
            errors.append(f"{w['path'].name}: {w['name']} must never be in the wheelhouse")
        elif not current:
            log(f"  removing stale {w['path'].name} (not in the pin file)")
            w["path"].unlink()
            continue
        keep.append(w)
    by_name = {}
    for w in keep:
        by_name.setdefault(w["name"], []).append(w)
    for name, ws in by_name.items():
        if len(ws) > 1:
            errors.append(f"{name}: {len(ws)} wheels ({', '.join(w['path'].name for w in ws)}); want exactly one")
    if project not in by_name:
        errors.append(f"the project wheel ({project}) is missing")
    for p in pins:
        if p["name"] not in by_name:
            if p["role"] == "optional":
                log(f"  WARNING: optional {p['name']}=={p['version']} is not in the wheelhouse (Gemini baseline unavailable)")
            else:
                errors.append(f"{p['name']}=={p['version']} ({p['role']}) is missing")
    supported = target_tags()
    for w in keep:
        if not (w["tags"] & supported):
            errors.append(f"{w['path'].name}: not installable on CPython 3.12 manylinux x86_64")
        try:
            with zipfile.ZipFile(w["path"]) as zf:
                bad = zf.testzip()
            if bad:
                errors.append(f"{w['path'].name}: corrupt member {bad}")
        except zipfile.BadZipFile as e:
            errors.append(f"{w['path'].name}: not a zip file ({e})")
    if errors:
        raise WheelhouseError("\n".join(errors))
    # Closure: what each wheel needs on the node is in the wheelhouse or already on the node.
    have = {w["name"]: w["version"] for w in keep}
    for w in keep:
        role = "project" if w["name"] == project else role_of[w["name"]]["role"]
        if role == "optional":
            continue  # installed --no-deps on purpose; its declared deps are not wanted
        for req in wheel_requirements(w["path"]):
            dep = _norm(req.name)
            if dep in have:
                if req.specifier and not req.specifier.contains(have[dep], prereleases=True):
                    errors.append(f"{w['name']} needs {req}, the wheelhouse has {dep}=={have[dep]}")
            elif dep not in node:
                errors.append(f"{w['name']} needs {req}: neither pinned in {pins_path} nor listed in {node_path}")
    if errors:
        raise WheelhouseError("\n".join(errors))
    rows = []
    for w in sorted(keep, key=lambda w: w["name"]):
        role = "project" if w["name"] == project else role_of[w["name"]]["role"]
        rows.append({"name": w["name"], "version": w["version"], "role": role, "sha256": sha256(w["path"]),
                     "size": w["path"].stat().st_size, "file": w["path"].name})
    total = sum(r["size"] for r in rows)
    lines = ["# megatrain wheelhouse for the GPU node: CPython 3.12, manylinux x86_64 (docs/wheelhouse.md)",
             "# install: bash scripts/install_offline.sh DIR   (offline: --no-index --no-deps; torch untouched)",
             "# name\tversion\trole\tsha256\tsize\tfile"]
    lines += ["\t".join(str(r[k]) for k in ("name", "version", "role", "sha256", "size", "file")) for r in rows]
    lines.append(f"# total: {len(rows)} wheels, {total} bytes ({total / 2**20:.1f} MiB)")
    (directory / MANIFEST).write_text("\n".join(lines) + "\n")
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        log(f"  {r['name']:<{width}}  {r['version']:<10} {r['role']:<9} {r['size'] / 2**10:9.1f} KiB")
    log(f"  total: {len(rows)} wheels, {total / 2**20:.2f} MiB")
    if total > max_mib * 2**20:
        log(f"  WARNING: the wheelhouse is {total / 2**20:.1f} MiB, over the {max_mib:g} MiB target "
            "(it travels to the node with the repo under a 64 MiB limit)")
    return rows


# ----------------------------------------------------------------------------- node side

def read_manifest(directory) -> list[dict]:
    rows = []
    for raw in (Path(directory) / MANIFEST).read_text().splitlines():
        if not raw.strip() or raw.startswith("#"):
            continue
        parts = raw.split("\t")
        if len(parts) != 6 or parts[2] not in ROLES:
            raise WheelhouseError(f"{MANIFEST}: bad line {raw!r}")
        rows.append(dict(zip(("name", "version", "role", "sha256", "size", "file"), parts)))
    return rows


def plan(directory, log=None) -> list[dict]:
    """What to install from DIR: [{role, name, version, path}], verified against MANIFEST.txt."""
    log = log or (lambda m: print(m, file=sys.stderr))
    directory = Path(directory)
    wheels = wheels_in(directory)
    if not wheels:
        raise WheelhouseError(f"{directory}: no wheels")
    errors = [f"{w['path'].name}: {w['name']} must never be installed from here (torch stays as it is)"
              for w in wheels if FORBIDDEN.match(w["name"])]
    names = {}
    for w in wheels:
        names.setdefault(w["name"], []).append(w["path"].name)
    errors += [f"{n}: several wheels {fs}; want exactly one version" for n, fs in names.items() if len(fs) > 1]
    if errors:
        raise WheelhouseError("\n".join(errors))
    if not (directory / MANIFEST).exists():
        log(f"WARNING: {directory}/{MANIFEST} not found: installing every wheel as required, unchecked")
        return [{"role": "required", "name": w["name"], "version": w["version"], "path": str(w["path"])}
                for w in wheels]
    rows, out = read_manifest(directory), []
    listed = {r["file"] for r in rows}
    for w in wheels:
        if w["path"].name not in listed:
            log(f"WARNING: {w['path'].name} is not in {MANIFEST}: ignored")
    for r in rows:
        path = directory / r["file"]
        if not path.exists():
            if r["role"] == "optional":
                log(f"WARNING: optional {r['file']} is missing: skipped")
                continue
            errors.append(f"{r['file']} ({r['role']}) is listed in {MANIFEST} but missing")
            continue
        if path.stat().st_size != int(r["size"]) or sha256(path) != r["sha256"]:
            errors.append(f"{r['file']}: size or sha256 differs from {MANIFEST} (damaged in transfer?)")
            continue
        out.append({"role": r["role"], "name": r["name"], "version": r["version"], "path": str(path)})
    if errors:
        raise WheelhouseError("\n".join(errors))
    return out


def need(name, version) -> bool:
    """True when this interpreter lacks NAME or has an older version than VERSION."""
    from importlib import metadata
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        return True
    try:
        return Version(have) < Version(version)
    except Exception:
        return True


_SMOKE = r"""
import importlib, sys, traceback
from importlib import metadata
bad = 0
for spec in sys.argv[1:]:
    dist, mods = spec.split("=", 1)
    for mod in filter(None, mods.split(",")):
        try:
            m = importlib.import_module(mod)
            try:
                ver = metadata.version(dist)
            except Exception:
                ver = "?"
            print(f"  ok    import {mod:<24} {dist} {ver}  ({getattr(m, '__file__', None)})", flush=True)
        except BaseException as e:
            bad += 1
            print(f"  FAIL  import {mod:<24} {dist}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
sys.exit(1 if bad else 0)
"""


def smoke(wheels) -> int:
    """Import every top-level module of the given wheels in a fresh interpreter, outside the repo."""
    specs = []
    for path in wheels:
        w = wheel_info(path)
        specs.append(f"{w['name']}=" + ",".join(top_level_modules(path)))
    with tempfile.TemporaryDirectory() as cwd:  # so the repo checkout never shadows what was installed
        return subprocess.call([sys.executable, "-c", _SMOKE, *specs], cwd=cwd)


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("pins").add_argument("pins")
    p = sub.add_parser("have")
    p.add_argument("dir"), p.add_argument("name"), p.add_argument("version")
    sub.add_parser("check-built").add_argument("wheel")
    p = sub.add_parser("finalize")
    p.add_argument("dir"), p.add_argument("--pins", required=True), p.add_argument("--node", required=True)
    p.add_argument("--project", required=True), p.add_argument("--max-mib", type=float, default=20.0)
    sub.add_parser("plan").add_argument("dir")
    p = sub.add_parser("need")
    p.add_argument("name"), p.add_argument("version")
    sub.add_parser("smoke").add_argument("wheels", nargs="+")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "pins":
            for e in parse_pins(a.pins):
                print(f"{e['name']}\t{e['version']}\t{e['role']}\t{e['method']}")
        elif a.cmd == "have":
            w = find_wheel(a.dir, a.name, a.version)
            if w is None:
                return 1
            print(w["path"])
        elif a.cmd == "check-built":
            check_built(Path(a.wheel))
        elif a.cmd == "finalize":
            finalize(a.dir, a.pins, a.node, a.project, a.max_mib)
        elif a.cmd == "plan":
            for r in plan(a.dir):
                print(f"{r['role']}\t{r['name']}\t{r['version']}\t{r['path']}")
        elif a.cmd == "need":
            return 0 if need(a.name, a.version) else 1
        elif a.cmd == "smoke":
            return smoke(a.wheels)
    except WheelhouseError as e:
        for line in str(e).splitlines():
            print(f"ERROR: {line}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
