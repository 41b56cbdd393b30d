"""The device-call scripts (results/**/*.sh, scripts/*.sh) parse, and none passes several hydra overrides as one
quoted word. Both mistakes cost device time only once the script runs on the GPU machine: on 2026-12-06
`chain_1206.sh 5` passed 'steps=3 warmup_steps=4 timeout_s=80' as one argument, hydra refused it ("mismatched
input '='") and the call measured nothing."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for d in ("results", "scripts") for p in (ROOT / d).rglob("*.sh"))
# A quoted word holding two or more `key=value` overrides separated by spaces; not an assignment (NAME='a=1 b=2',
# expanded unquoted later as several words, which is how the scripts pass a group of overrides).
JOINED = re.compile(r"(?<![=\w])'([\w.+~]+=[^' ]+(?: +[\w.+~]+=[^' ]*)+)'")


def joined_overrides(text: str) -> list[tuple[int, str]]:
    return [(i, m.group(0)) for i, line in enumerate(text.splitlines(), 1) if not line.lstrip().startswith("#")
            for m in JOINED.finditer(line)]


def test_the_check_finds_the_mistake_of_2026_12_06():
    bad = """    new 'steps=3 warmup_steps=4 timeout_s=80' 'sweep.models=[qwen2.5-7b]' \\\n"""
    assert joined_overrides(bad) == [(1, "'steps=3 warmup_steps=4 timeout_s=80'")]
    good = """    ORDER='steps=4 warmup_steps=4 timeout_s=110'\n    new $ORDER 'sweep.models=[qwen2.5-7b]' "only=[$P7]"\n"""
    assert joined_overrides(good) == []
    assert joined_overrides("python3 -c 'x = 1; print(x)' 'only=[a,b]'\n# new 'a=1 b=2'\n") == []


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS])
def test_device_script_parses_and_passes_one_override_per_word(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=60)
    assert joined_overrides(script.read_text()) == [], f"{script}: several hydra overrides in one quoted word"


def test_there_are_scripts_to_check():
    names = {p.name for p in SCRIPTS}
    assert {"chain_1206.sh", "same_run.sh", "device_call_env.sh"} <= names


def _sweep_variants() -> set[str]:
    import yaml

    names = set()
    for path in (ROOT / "experiments" / "conf" / "sweep").glob("*.yaml"):
        sweep = (yaml.safe_load(path.read_text()) or {}).get("sweep") or {}
        names |= set(sweep.get("variants") or {})
    return names


def test_variants_a_script_names_exist_in_some_sweep():
    """A variant misspelt in a script's `only=` (or chain_pinning's `pts` lists) selects no point: the runner
    then measures nothing, and the call is spent."""
    known = _sweep_variants()
    assert {"streaming_cpu_pinned_locked", "tiered_cpu_pinned"} <= known
    named = set()
    for script in SCRIPTS:
        text = "\n".join(x for x in script.read_text().splitlines() if not x.lstrip().startswith("#"))
        named |= set(re.findall(r"__b\d+__(?!\*|\$)(\w+?)__\*", text))
        for m in re.finditer(r"\$\(pts [\w.-]+ \d+ ([\w ]+)\)", text):
            named |= set(m.group(1).split())
    assert named and not named - known, sorted(named - known)
