"""scripts/accuracy_parity.py on the CPU: a tiny model trained by each system from one init folder.

fp32 on the CPU, same initial weights, same batches: the step-0 held-out loss must be bit-identical
across systems (one evaluator, the same weights) and the training losses equal to 1e-4 relative.
"""
from __future__ import annotations

import copy
import json
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import accuracy_parity as ap  # noqa: E402

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
SYSTEMS = ["megatrain"] + (["zero3"] if HAS_DEEPSPEED else []) + ["native"]
STEPS, EVERY = 6, 3
TINY = ["--device", "cpu", "--model", "tiny-qwen2", "--steps", str(STEPS), "--eval-every", str(EVERY),
        "--eval-batches", "2", "--batch-size", "4", "--seq-len", "32", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("accuracy_parity")
    rc = ap.main(TINY + ["--systems", ",".join(SYSTEMS), "--out", str(out), "--cache", str(out / "cache")])
    return rc, out, ap.read_rows(out / ap.JSONL)


def evals(rows, system):
    return {r["step"]: r for r in rows if r["kind"] == "eval" and r["system"] == system}


def test_every_system_has_every_eval_point_and_a_summary(run):
    rc, _, rows = run
    assert rc == 0
    assert not [r for r in rows if r["kind"] == "error"]
    for system in SYSTEMS:
        points = evals(rows, system)
        assert sorted(points) == [0, 3, 6]
        assert points[0]["train_loss"] is None and points[6]["train_loss"] is not None
        assert sum(len(p["train_losses"]) for p in points.values()) == STEPS
        assert all(p["eval_loss"] > 0 and p["wall_s"] >= 0 for p in points.values())
        summary = [r for r in rows if r["kind"] == "summary" and r["system"] == system]
        assert len(summary) == 1 and summary[0]["steps_per_s"] > 0
        assert summary[0]["final_eval_loss"] == points[6]["eval_loss"]
        for key in ("git_sha", "gpu_name", "torch_version", "deepspeed_version", "date", "command"):
            assert key in summary[0]


def test_step0_held_out_loss_identical_across_systems(run):
    """Same init folder, same batches, one evaluator: exactly equal, or a system did not load the init."""
    _, _, rows = run
    step0 = {s: evals(rows, s)[0]["eval_loss"] for s in SYSTEMS}
    assert len(set(step0.values())) == 1, step0


def test_training_losses_agree_in_fp32(run):
    _, _, rows = run
    ref = [x for p in sorted(evals(rows, "native").items()) for x in p[1]["train_losses"]]
    for system in SYSTEMS:
        losses = [x for p in sorted(evals(rows, system).items()) for x in p[1]["train_losses"]]
        assert losses == pytest.approx(ref, rel=1e-4), system
        held = [evals(rows, system)[s]["eval_loss"] for s in (3, 6)]
        assert held == pytest.approx([evals(rows, "native")[s]["eval_loss"] for s in (3, 6)], rel=1e-4)
    assert ref[-1] < ref[0]  # it trained: the comparison is not between untouched models


def test_agreement_passes_and_flags_a_doctored_row(run):
    _, _, rows = run
    result = ap.agreement(rows)
    assert result["verdict"] == "agree"
    assert all(v["agree"] and v["max_abs_dev"] < 1e-4 for v in result["systems"].values())
    assert set(result["systems"]) == set(SYSTEMS) - {"native"}

    doctored = copy.deepcopy(rows)
    row = next(r for r in doctored if r["kind"] == "eval" and r["system"] == "megatrain" and r["step"] == 3)
    row["eval_loss"] += 0.5
    bad = ap.agreement(doctored)
    assert bad["verdict"] == "disagree"
    assert not bad["systems"]["megatrain"]["agree"] and bad["systems"]["megatrain"]["at_step"] == 3
    assert bad["systems"]["megatrain"]["max_abs_dev"] == pytest.approx(0.5, abs=1e-4)

    # within max(0.02, 2 %) passes, beyond fails; a missing eval point fails
    row["eval_loss"] -= 0.5 - 0.01
    assert ap.agreement(doctored)["systems"]["megatrain"]["agree"]
    missing = [r for r in rows if not (r["kind"] == "eval" and r["system"] == "megatrain" and r["step"] == 6)]
    assert ap.agreement(missing)["systems"]["megatrain"]["missing_steps"] == [6]
    assert not ap.agreement(missing)["systems"]["megatrain"]["agree"]
    assert ap.agreement(rows, ref="fsdp")["verdict"] == "no reference"


def test_figure_written(run, tmp_path):
    _, out, _ = run
    assert (out / "accuracy_parity.png").stat().st_size > 0 and (out / "accuracy_parity.pdf").stat().st_size > 0
    paths = ap.plot_accuracy(out / ap.JSONL, tmp_path / "fig.png")
    assert [p.name for p in paths] == ["fig.png", "fig.pdf"] and all(p.stat().st_size > 0 for p in paths)


def test_merge_rebuilds_the_verdict(run, tmp_path):
    _, out, rows = run
    assert ap.main(["--merge", str(out / ap.JSONL), "--out", str(tmp_path)]) == 0
    assert ap.read_rows(tmp_path / ap.JSONL) == rows


def test_no_row_means_non_zero_exit(run, tmp_path):
    """gemini does not run on a CPU: skipped with an error row, no eval row, exit status 1."""
    _, out, _ = run
    assert ap.main(TINY + ["--systems", "gemini", "--out", str(tmp_path), "--cache", str(out / "cache")]) == 1
    rows = ap.read_rows(tmp_path / ap.JSONL)
    assert [r["status"] for r in rows] == ["skipped"]


def test_held_out_split_is_disjoint_and_deterministic():
    text = bytes(range(256)) * 40
    train, held = ap.split_text(text, 0.1)
    assert train + held == text and len(held) == len(text) - int(len(text) * 0.9)
    assert ap.split_text(text, 0.1) == (train, held)


def test_report_section_from_the_rows(tmp_path):
    """The report's accuracy section: one line per eval step and system, the rule, each system's largest
    difference and the verdict; a doctored curve flips the verdict."""
    from analysis.accuracy import report_lines

    rows = [{"system": s, "kind": "eval", "step": st, "eval_loss": 3.0 - st / 100 + (0.001 if s == "zero3" else 0),
             "model": "tiny", "device": "cuda"} for s in ("native", "megatrain", "zero3") for st in (0, 50, 100)]
    rows.append({"system": "megatrain", "kind": "summary", "steps": 100, "num_params": 1e6, "steps_per_s": 2.0,
                 "optimizer": "cpp", "gpu_name": "NVIDIA H200", "git_sha": "abcdef1234567", "date": "2026-12-01"})
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    text = "\n".join(report_lines(path, "../plots/accuracy_parity.png"))
    assert "| 50 | 2.5000 | 2.5000 | 2.5010 |" in text and "Verdict (over the exact systems): **agree**" in text
    assert "zero3** vs native: largest difference 0.0010" in text and "accuracy_parity.png" in text
    # a system that is not exact AdamW (ZenFlow) far off: measured against the tolerance, not judged by it
    far = [{"system": "zenflow", "kind": "eval", "step": st, "eval_loss": 3.0 - st / 200, "model": "tiny",
            "device": "cuda"} for st in (0, 50, 100)]
    far.append({"system": "zenflow", "kind": "summary", "final_eval_loss": 2.5, "zenflow_effective":
                {"update_interval": 4}, "notes": "bounded staleness"})
    far.append({"system": "native", "kind": "summary", "final_eval_loss": 2.0})
    path.write_text("\n".join(json.dumps(r) for r in rows + far) + "\n")
    text = "\n".join(report_lines(path))
    assert "Verdict (over the exact systems): **agree**" in text
    assert ("zenflow** vs native: largest difference 0.5000 at step 100 (25.00%) → *not exact AdamW, not judged*: "
            "12.5× the tolerance at its farthest; final held-out loss 2.5000 against 2.0000 (+0.5000); settings as "
            "run: update_interval 4 (bounded staleness)") in text
    rows[4]["eval_loss"] += 0.5  # megatrain at step 50
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert "Verdict (over the exact systems): **disagree**" in "\n".join(report_lines(path))
