"""The code's layout, held against the code: every module is on its package's code map (docs/engine.md,
docs/runner.md), and the project's packages import each other in one direction: no module reaches,
through any chain of imports (function-local ones included), back to itself. A circle hides in a lazy
import until a refactor moves it to the top and Python fails half-initialised; the runner's point process
and the row schema had two (point <-> sft_point <-> sweeps, schema <-> schema_legacy) before
experiments/point_frame.py and experiments/step_records.py."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatrain", "experiments", "baselines", "analysis")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere in its body (``from . import x`` counts as ``pkg.x``
    where that is a module, else as the package)."""
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out |= {n for n in names if n in modules and n != me}
    return out


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py")]
    modules = {_module(p) for p in files}
    # a package's __init__ is imported with every module of it: not an edge of the circles we look for
    return {_module(p): {m for m in _imports(p, modules) if m not in PACKAGES} for p in files}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_graph_sees_lazy_and_relative_imports():
    g = _graph()
    assert "experiments.point_frame" in g["experiments.sft_point"]        # from .point_frame import (...)
    assert "experiments.sft_point" in g["experiments.point"]              # inside main(): a lazy import
    assert "megatrain.engine" in g["baselines.megatrain_system"]                # across packages


def test_no_module_imports_itself_back():
    circle = _circle(_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_a_circle_is_found():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


def test_every_module_is_in_its_packages_code_map():
    """docs/engine.md's file table names every megatrain/ module and docs/runner.md's code map every
    experiments/ module: a new file comes with its line there, or this fails."""
    for pkg, doc, start in (("megatrain", "docs/engine.md", "## Files"), ("experiments", "docs/runner.md", "## Code map")):
        text = (ROOT / doc).read_text()
        table = text[text.index(start):].split("\n## ", 1)[0]
        missing = [p.name for p in sorted((ROOT / pkg).glob("*.py"))
                   if p.name != "__init__.py" and p.name not in table]
        assert not missing, f"{doc} ({start}) lacks: {', '.join(missing)}"


def test_the_megatrain_adapter_forwards_every_hook_the_point_process_asks_for():
    """The point process asks a system for optional hooks by name (``getattr(system, "choosing", None)``...);
    the MegaTrain adapter must forward each one the engine has, or the runner silently goes without it (the
    2026-12-07i H100 call ran ``transient`` unforwarded: its first timed 7B step measured a cold update)."""
    import re

    from baselines.megatrain_system import MegaTrainSystem
    from megatrain.engine import MegaTrain

    asked = set(re.findall(r'getattr\(system, "(\w+)"', (ROOT / "experiments" / "point.py").read_text()))
    assert {"choosing", "transient", "phase_times"} <= asked
    engine_has = {name for name in asked if callable(getattr(MegaTrain, name, None))}
    assert {"choosing", "transient"} <= engine_has
    missing = sorted(name for name in asked if not callable(getattr(MegaTrainSystem, name, None)))
    assert not missing, f"baselines/megatrain_system.py does not forward: {missing}"
    import inspect

    for name in engine_has:  # forwarded, not reimplemented: the adapter calls the engine's method
        src = inspect.getsource(getattr(MegaTrainSystem, name))
        assert f"self.engine.{name}()" in src, (name, src)
