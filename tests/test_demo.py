"""The demo a new user runs first: real text, a loss that visibly falls, one-line errors for bad flags."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.timeout(600)  # above demo()'s own 240 s bound


def demo(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "megatrain.demo", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_demo_trains_on_stdlib_text_and_the_loss_falls():
    proc = demo("--steps", "20")
    assert proc.returncode == 0, proc.stderr
    assert "Python standard library" in proc.stdout and "byte-level" in proc.stdout
    losses = [float(x) for x in re.findall(r"loss\s+([0-9.]+)\s+grad_norm", proc.stdout)]
    assert len(losses) == 20
    assert min(losses[-3:]) < losses[0] - 0.5, losses  # visibly learning, not noise around ln(vocab)
    assert "TFLOPS" not in proc.stdout or "cuda" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--batch", "-1"], "--batch must be >= 1, got -1"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--seq", "1000000"], "exceeds the model's"),
])
def test_bad_demo_arguments_give_one_line_errors(args, message):
    proc = demo(*args, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"megatrain.demo: error: {message}"] or \
        (len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr


def test_text_batches_are_bytes_and_reproducible():
    from megatrain.data import stdlib_text_bytes, text_batch

    text = stdlib_text_bytes(1 << 16)
    a, b = text_batch(text, 2, 32, seed=0, step=3), text_batch(text, 2, 32, seed=0, step=3)
    assert a["input_ids"].shape == (2, 32) and int(a["input_ids"].max()) < 256
    assert (a["input_ids"] == b["input_ids"]).all()
    assert bytes(a["input_ids"][0].tolist()) in text
