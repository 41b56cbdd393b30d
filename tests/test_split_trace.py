"""scripts/split_trace.py on a committed H100 row (41b7e4d, 7B pure streaming, bf16 shadow over the link): the
chooser's trial of the CPU path alone and its return to the 13-group split read off metrics.jsonl."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import split_trace  # noqa: E402

POINT = (ROOT / "results/update_path_bf16link_h100/megatrain__qwen2.5-7b__L28__w1__s1024__b8__streaming_hybrid_bf16"
         "__H100-80GB-HBM3/metrics.jsonl")


def test_trace_reads_the_splits_and_decisions():
    rows = split_trace.trace(POINT.read_text().splitlines())
    assert len(rows) == 6 and rows[0].startswith("  0w") and rows[3].startswith("  3 ")
    assert rows[1].split()[2:4] == ["17", "13"] and rows[1].endswith("measuring the CPU path alone once -> 0")
    assert rows[2].split()[2:4] == ["30", "0"] and rows[2].endswith("switched: measured faster -> 13")
    assert " 2.814 " in rows[3] and rows[3].endswith("kept: measured fastest -> 13")


def test_cli_exits_nonzero_on_a_file_without_steps(tmp_path):
    empty = tmp_path / "metrics.jsonl"
    empty.write_text("")
    run = subprocess.run([sys.executable, str(ROOT / "scripts/split_trace.py"), str(POINT), str(empty)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "(no step)" in run.stdout and "kept: measured fastest" in run.stdout
