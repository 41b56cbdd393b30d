"""The repository's promises about itself: CI runs exactly the README's test command."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    line = next(l for l in ci.splitlines() if l.startswith("TEST_CMD="))
    cmd = line.split("=", 1)[1].strip("'")
    assert cmd in (ROOT / "README.md").read_text(), f"README does not show the CI test command: {cmd}"
