"""The repository's promises about itself: CI runs exactly the README's test command."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    line = next(l for l in ci.splitlines() if l.startswith("TEST_CMD="))
    cmd = line.split("=", 1)[1].strip("'")
    assert cmd in (ROOT / "README.md").read_text(), f"README does not show the CI test command: {cmd}"


def test_every_test_is_bounded_in_time(request):
    """pytest-timeout is in the test extra and active, with a default bound per test from pyproject.toml."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(r.startswith("pytest-timeout") for r in project["project"]["optional-dependencies"]["test"])
    assert request.config.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed"
    default = float(project["tool"]["pytest"]["ini_options"]["timeout"])
    assert 0 < default <= 600
    assert float(request.config.getini("timeout")) == default
