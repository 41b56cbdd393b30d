"""The offline wheelhouse for the GPU node (docs/wheelhouse.md): pins, build and install scripts.

No network: pip runs with PIP_NO_INDEX=1 on tiny wheels written by hand in tmp_path.
"""
import base64
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
BUILD = SCRIPTS / "build_wheelhouse.sh"
INSTALL = SCRIPTS / "install_offline.sh"
PINS = SCRIPTS / "wheelhouse_requirements.txt"
NODE = SCRIPTS / "wheelhouse_node_packages.txt"

pytestmark = pytest.mark.timeout(900)  # builds and offline installs, each bounded by run()'s own 180-300 s

_spec = importlib.util.spec_from_file_location("wheelhouse_tool", SCRIPTS / "wheelhouse_tool.py")
wt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wt)


# ----------------------------------------------------------------------------- helpers

def make_wheel(directory: Path, name: str, version: str, modules: dict, requires=(), tag="py3-none-any") -> Path:
    """A minimal valid wheel: the given files plus a dist-info with METADATA, WHEEL and RECORD."""
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    files = dict(modules)
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires))
    files[f"{info}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"
    record = []
    for path, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(out, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return out


def offline_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "WHEELHOUSE_", "MEGATRAIN_"))}
    env.pop("PYTHONPATH", None)
    env.update(PIP_NO_INDEX="1", PYTHON=sys.executable, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, env, timeout=180):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def fake_house(tmp_path, required_module="VALUE = 42\n", optional_module="raise ImportError('no gemini here')\n"):
    """A wheelhouse of fake wheels with a MANIFEST written by the build side's finalize()."""
    house = tmp_path / "house"
    make_wheel(house, "whfake-a", "1.0", {"whfake_a/__init__.py": required_module})
    make_wheel(house, "whfake-opt", "2.0", {"whfake_opt/__init__.py": optional_module})
    make_wheel(house, "whfake-fb", "1.0", {"whfake_fb.py": "FB = 1\n"})
    make_wheel(house, "pytest", "0.1", {"pytest_fake_never_installed.py": ""})  # older than ours: kept
    make_wheel(house, "whfake-proj", "0.3", {"whfake_proj/__init__.py": "from whfake_a import VALUE\n"},
               requires=["whfake-a>=1", "torch>=2"])
    pins = tmp_path / "pins.txt"
    pins.write_text("whfake-a==1.0\nwhfake-opt==2.0  # [optional]\n"
                    "whfake-fb==1.0  # [fallback]\npytest==0.1  # [fallback]\n")
    node = tmp_path / "node.txt"
    node.write_text("torch\n")
    wt.finalize(house, pins, node, "whfake-proj", log=lambda m: None)
    return house


# ----------------------------------------------------------------------------- static checks

@pytest.mark.parametrize("script", [BUILD, INSTALL])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=60)


def test_every_pip_call_is_no_deps():
    """pip must never resolve anything (it would drag in a CUDA torch): every install/download/wheel is --no-deps."""
    for script in (BUILD, INSTALL):
        text = script.read_text().replace("\\\n", " ")
        calls = [l for l in text.splitlines() if re.search(r"-m pip (install|download|wheel)\b", l)]
        assert calls, script
        for line in calls:
            assert "--no-deps" in line, f"{script.name}: {line.strip()}"
    assert "--no-index" in INSTALL.read_text()


def test_pins_one_version_each_never_torch():
    entries = wt.parse_pins(PINS)
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names))
    assert not any(wt.FORBIDDEN.match(n) for n in names)
    by = {e["name"]: e for e in entries}
    for name in ("deepspeed", "hydra-core", "omegaconf", "antlr4-python3-runtime", "pydantic", "pydantic-core",
                 "hjson", "colossalai", "contexttimer"):
        assert name in by, name
    for name in ("deepspeed", "antlr4-python3-runtime", "colossalai", "contexttimer"):  # sdist-only on PyPI
        assert by[name]["method"] == "sdist", name
    assert by["colossalai"]["role"] == by["contexttimer"]["role"] == "optional"
    assert by["deepspeed"]["role"] == by["hydra-core"]["role"] == "required"
    assert by["antlr4-python3-runtime"]["version"].startswith("4.9.")  # omegaconf 2.3: ==4.9.*


@pytest.mark.parametrize("line, err", [
    ("torch==2.11.0", "never"),
    ("nvidia-cublas-cu12==12.0", "never"),
    ("hjson>=3.1", "exactly one version"),
    ("omegaconf==2.3.*", "exactly one version"),
    ("hjson==3.1.0\nhjson==3.1.1", "twice"),
    ("hjson==3.1.0  # [sdsit]", "unknown tag"),
])
def test_pins_reject_bad_lines(tmp_path, line, err):
    p = tmp_path / "pins.txt"
    p.write_text(line + "\n")
    with pytest.raises(wt.WheelhouseError, match=err):
        wt.parse_pins(p)


def test_pins_and_node_list_cover_the_projects_dependencies():
    """Every dependency in pyproject.toml is pinned (at a version it accepts) or already on the node."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for group in project.get("optional-dependencies", {}).values()
                                            for r in group]
    pinned = {e["name"]: e["version"] for e in wt.parse_pins(PINS)}
    node = wt.parse_node_packages(NODE)
    for r in map(wt.Requirement, reqs):
        name = wt._norm(r.name)
        if name in pinned:
            assert r.specifier.contains(pinned[name], prereleases=True), f"{r} vs pin {pinned[name]}"
        else:
            assert name in node, f"{r.name}: neither pinned in {PINS.name} nor on the node ({NODE.name})"


def test_target_tags_are_cpython312_manylinux():
    tags = wt.target_tags()

    def ok(fn):
        return bool(wt.wheel_info(Path(fn))["tags"] & tags)

    assert ok("pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    assert ok("x-1.0-py3-none-any.whl")
    assert ok("x-1.0-cp39-abi3-manylinux_2_28_x86_64.whl")
    assert not ok("x-1.0-cp311-cp311-manylinux_2_17_x86_64.whl")
    assert not ok("x-1.0-cp312-cp312-linux_x86_64.whl")
    assert not ok("x-1.0-cp312-cp312-musllinux_1_2_x86_64.whl")
    assert not ok("x-1.0-cp312-cp312-manylinux_2_17_aarch64.whl")


def test_finalize_checks_closure_and_tags(tmp_path):
    house = tmp_path / "h"
    make_wheel(house, "whfake-a", "1.0", {"whfake_a.py": ""}, requires=["whfake-b>=2", "extra-only; extra == 'x'"])
    make_wheel(house, "whfake-proj", "0.1", {"whfake_proj.py": ""})
    pins = tmp_path / "pins.txt"
    pins.write_text("whfake-a==1.0\n")
    node = tmp_path / "node.txt"
    node.write_text("")
    with pytest.raises(wt.WheelhouseError, match="whfake-b"):
        wt.finalize(house, pins, node, "whfake-proj", log=lambda m: None)
    node.write_text("whfake-b\n")
    rows = wt.finalize(house, pins, node, "whfake-proj", log=lambda m: None)
    assert {r["name"] for r in rows} == {"whfake-a", "whfake-proj"}
    assert (house / "MANIFEST.txt").exists()
    # a wheel for this machine's CPython 3.11 is useless on the node
    (house / "whfake_a-1.0-py3-none-any.whl").rename(house / "whfake_a-1.0-cp311-cp311-manylinux_2_17_x86_64.whl")
    with pytest.raises(wt.WheelhouseError, match="CPython 3.12"):
        wt.finalize(house, pins, node, "whfake-proj", log=lambda m: None)


def test_check_built_rejects_binaries(tmp_path):
    good = make_wheel(tmp_path, "whfake-a", "1.0", {"whfake_a/__init__.py": ""})
    wt.check_built(good)
    bad = make_wheel(tmp_path / "b", "whfake-b", "1.0", {"whfake_b/_ops.so": "ELF"})
    with pytest.raises(wt.WheelhouseError, match="compiled"):
        wt.check_built(bad)
    ds = make_wheel(tmp_path / "d", "deepspeed", "0.0.1",
                    {"deepspeed/git_version_info_installed.py": "installed_ops={'cpu_adam': True}\n"})
    with pytest.raises(wt.WheelhouseError, match="DS_BUILD_OPS"):
        wt.check_built(ds)


def test_top_level_modules(tmp_path):
    w = make_wheel(tmp_path, "whfake-a", "1.0", {"pkg/__init__.py": "", "pkg/sub/__init__.py": "", "mod.py": "",
                                                 "nsdir/x.py": "", "tests/__init__.py": "", "_private.py": ""})
    assert wt.top_level_modules(w) == ["mod", "pkg"]


# ----------------------------------------------------------------------------- install_offline.sh

def test_install_offline_into_target(tmp_path):
    house = fake_house(tmp_path)
    site = tmp_path / "site"
    r = run(["bash", str(INSTALL), str(house)], offline_env(MEGATRAIN_SITE=site))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"export PYTHONPATH={site}" in r.stdout
    assert (site / "megatrain-env.sh").exists()
    # the optional wheel installs but does not import: a warning, never a failure
    assert (site / "whfake_opt").is_dir()
    assert "optional package does not import" in r.stderr
    # fallback: installed where missing, kept where the interpreter already has a newer one
    assert (site / "whfake_fb.py").exists()
    assert not (site / "pytest_fake_never_installed.py").exists()
    assert "pytest: the node's copy is recent enough" in r.stdout
    check = subprocess.run([sys.executable, "-c", "import whfake_proj, whfake_a, whfake_fb; print(whfake_proj.VALUE)"],
                           env=offline_env(PYTHONPATH=site), capture_output=True, text=True, cwd=tmp_path,
                           timeout=120)
    assert check.stdout.strip() == "42", check.stderr
    # idempotent: a second run over the same target succeeds too
    r2 = run(["bash", str(INSTALL), str(house)], offline_env(MEGATRAIN_SITE=site))
    assert r2.returncode == 0, r2.stdout + r2.stderr


def test_install_offline_skip_list(tmp_path):
    house = fake_house(tmp_path)
    site = tmp_path / "site"
    r = run(["bash", str(INSTALL), str(house)],
            offline_env(MEGATRAIN_SITE=site, WHEELHOUSE_SKIP="whfake-opt"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (site / "whfake_opt").exists()
    assert "WARNING" not in r.stderr


def test_install_offline_fails_on_required_import_error(tmp_path):
    house = fake_house(tmp_path, required_module="raise RuntimeError('broken')\n")
    r = run(["bash", str(INSTALL), str(house)], offline_env(MEGATRAIN_SITE=tmp_path / "site"))
    assert r.returncode != 0
    assert "FAIL  import whfake_a" in r.stdout


def test_install_offline_refuses_damaged_wheel(tmp_path):
    house = fake_house(tmp_path)
    w = next(house.glob("whfake_a-*.whl"))
    w.write_bytes(w.read_bytes() + b"\0")
    site = tmp_path / "site"
    r = run(["bash", str(INSTALL), str(house)], offline_env(MEGATRAIN_SITE=site))
    assert r.returncode != 0
    assert "sha256" in r.stderr
    assert not (site / "whfake_a").exists()


@pytest.mark.parametrize("extra", [("torch", "9.9"), ("whfake-a", "1.1")])
def test_install_offline_refuses_torch_and_second_versions(tmp_path, extra):
    house = tmp_path / "house"
    make_wheel(house, "whfake-a", "1.0", {"whfake_a.py": ""})
    make_wheel(house, *extra, {"x_whfake.py": ""})
    site = tmp_path / "site"
    r = run(["bash", str(INSTALL), str(house)], offline_env(MEGATRAIN_SITE=site))
    assert r.returncode != 0
    assert ("torch" in r.stderr) if extra[0] == "torch" else ("exactly one version" in r.stderr)
    assert not (site / "whfake_a.py").exists()


def test_install_offline_without_manifest(tmp_path):
    house = tmp_path / "house"
    make_wheel(house, "whfake-a", "1.0", {"whfake_a.py": "A = 1\n"})
    site = tmp_path / "site"
    r = run(["bash", str(INSTALL), str(house)], offline_env(MEGATRAIN_SITE=site))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MANIFEST.txt not found" in r.stderr
    assert (site / "whfake_a.py").exists()


# ----------------------------------------------------------------------------- build_wheelhouse.sh

def _can_build_project_offline():
    try:
        import setuptools
    except ImportError:
        return False
    major = int(setuptools.__version__.split(".")[0])
    if major >= 71:  # bdist_wheel built in
        return True
    return major >= 61 and importlib.util.find_spec("wheel") is not None


@pytest.mark.skipif(not _can_build_project_offline(),
                    reason="building the project wheel offline needs setuptools>=61 (and wheel) installed")
def test_build_wheelhouse_offline_with_cached_wheels(tmp_path):
    """With every pinned wheel already in OUT_DIR the build needs no network: it keeps them, removes a stale
    version, rebuilds the project wheel, checks the set and writes MANIFEST.txt."""
    out = tmp_path / "out"
    make_wheel(out, "whfake-a", "1.0", {"whfake_a.py": ""})
    make_wheel(out, "whfake-a", "0.9", {"whfake_a.py": ""})  # stale: pins moved on
    make_wheel(out, "whfake-opt", "2.0", {"whfake_opt.py": ""})
    pins = tmp_path / "pins.txt"
    pins.write_text("whfake-a==1.0\nwhfake-opt==2.0  # [sdist] [optional]\n")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    node = tmp_path / "node.txt"
    node.write_text("\n".join(wt.Requirement(r).name for r in project["dependencies"]) + "\n")
    env = offline_env(WHEELHOUSE_PINS=pins, WHEELHOUSE_NODE_PACKAGES=node)
    r = run(["bash", str(BUILD), str(out)], env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "already there" in r.stdout and "removing stale whfake_a-0.9" in r.stdout
    rows = wt.read_manifest(out)
    assert {(x["name"], x["role"]) for x in rows} == {
        ("whfake-a", "required"), ("whfake-opt", "optional"), (wt._norm(project["name"]), "project")}
    assert sorted(p.name for p in out.glob("*.whl")) == sorted(x["file"] for x in rows)
    proj = next(x for x in rows if x["role"] == "project")
    assert proj["version"] == project["version"] and proj["file"].endswith("-py3-none-any.whl")


def test_build_wheelhouse_fails_loudly_on_bad_pins(tmp_path):
    pins = tmp_path / "pins.txt"
    pins.write_text("torch==2.11.0\n")
    r = run(["bash", str(BUILD), str(tmp_path / "out")], offline_env(WHEELHOUSE_PINS=pins))
    assert r.returncode != 0
    assert "never" in r.stderr


@pytest.mark.skipif(not _can_build_project_offline(),
                    reason="building the project wheel offline needs setuptools>=61 (and wheel) installed")
def test_build_wheelhouse_optional_failure_only_warns(tmp_path):
    """ColossalAI's rule: an [optional] wheel that cannot be had is a warning; the rest is still built."""
    out = tmp_path / "out"
    make_wheel(out, "whfake-a", "1.0", {"whfake_a.py": ""})
    pins = tmp_path / "pins.txt"
    pins.write_text("whfake-a==1.0\nwhfake-unobtainable==1.0  # [sdist] [optional]\n")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    node = tmp_path / "node.txt"
    node.write_text("\n".join(wt.Requirement(r).name for r in project["dependencies"]) + "\n")
    r = run(["bash", str(BUILD), str(out)], offline_env(WHEELHOUSE_PINS=pins, WHEELHOUSE_NODE_PACKAGES=node),
            timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "could not get optional whfake-unobtainable==1.0" in r.stderr
    assert {x["name"] for x in wt.read_manifest(out)} == {"whfake-a", wt._norm(project["name"])}


def test_build_wheelhouse_fails_loudly_on_missing_required(tmp_path):
    pins = tmp_path / "pins.txt"
    pins.write_text("whfake-unobtainable==1.0\n")
    out = tmp_path / "out"
    r = run(["bash", str(BUILD), str(out)], offline_env(WHEELHOUSE_PINS=pins))
    assert r.returncode != 0
    assert "could not get required whfake-unobtainable==1.0" in r.stderr
    assert not (out / "MANIFEST.txt").exists()
