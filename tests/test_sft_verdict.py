"""The SFT sweep's judging rules (analysis/sft_verdict.py) on synthetic runs: each run against all-on-GPU at
its own dtype, held against all-on-GPU's own run-to-run spread where the sweep measured it, both numbers
always stated; failed, incomplete and not-exact runs kept out of the overall verdict."""
from __future__ import annotations

import pytest

from analysis import sft_verdict as V
from analysis.sft_report import run_dtype, run_label

STEPS = (0, 25, 50, 75, 100)


def run(system, variant="default", dtype="bf16", *, offsets=None, acc=0.95, status="ok", steps=100, step0=3.4575,
        label=None, tier="", arithmetic=None):
    """A run whose held-out loss is the reference curve plus ``offsets`` (one per eval step)."""
    base = {0: 3.39, 25: 0.19, 50: 0.12, 75: 0.07, 100: 0.04}
    offsets = offsets or {}
    evals = [{"step": s, "eval_loss": base[s] + offsets.get(s, 0.0)} for s in STEPS]
    evals[0]["exact_match"], evals[-1]["exact_match"] = 0.0, acc
    return {"system": system, "variant": variant, "dtype": dtype, "status": status, "tier": tier,
            **({"arithmetic": arithmetic} if arithmetic else {}),
            "label": label or f"{system}/{variant}", "evals": evals if status == "ok" else [],
            "steps": [{"step": i, "loss": step0 if i == 0 else 1.0, "grad_norm": 51.0} for i in range(steps)],
            "summary": {"exact_match_after": acc} if status == "ok" else {}, "error": "" if status == "ok" else "boom"}


def test_within_tolerance_agrees():
    runs = [run("native"), run("megatrain", offsets={50: 0.004}, acc=0.948, step0=3.4610)]
    res = V.agreement(runs)
    v = res["runs"]["megatrain/default"]
    assert res["verdict"] == V.AGREE and v["verdict"] == V.AGREE
    assert v["max_loss_dev"] == pytest.approx(0.004) and v["at_step"] == 50
    assert v["acc_dev"] == pytest.approx(-0.002) and v["step0_loss_dev"] == pytest.approx(0.0035)
    assert res["runs"]["native/default"]["role"] == "reference"


def test_gap_without_a_measured_spread_disagrees_and_says_so():
    runs = [run("native"), run("megatrain", offsets={50: -0.08})]
    res = V.agreement(runs)
    assert res["verdict"] == V.DISAGREE and res["spread"] == {}
    line = V.explain(res, runs)[0]
    assert "0.0800 nats (step 50)" in line and "not measured at bf16" in line and "**disagree**" in line


def test_gap_within_all_on_gpu_spread_is_said_with_both_numbers():
    runs = [run("native"), run("megatrain", offsets={50: -0.08}, acc=0.94),
            run("native", "rerun", offsets={50: -0.09, 75: 0.01}, acc=0.93)]
    res = V.agreement(runs)
    assert res["spread"]["bf16"]["max_loss_dev"] == pytest.approx(0.09)
    assert res["runs"]["megatrain/default"]["verdict"] == V.WITHIN_SPREAD
    assert res["runs"]["native/rerun"]["role"] == "spread"  # the repeat measures, it is not judged
    assert res["verdict"] == V.WITHIN_SPREAD
    line = V.explain(res, runs)[0]
    assert "0.0800 nats (step 50)" in line and "all-on-GPU vs all-on-GPU 0.0900 nats (step 50, native/rerun)" in line
    assert "agree within run-to-run spread" in line


def test_several_reruns_the_farthest_is_the_spread():
    """A bit-identical rerun (deterministic GPU) and an ulp-perturbed one: the spread is the larger distance,
    and the accuracy spread the larger of theirs."""
    runs = [run("native", acc=0.95), run("megatrain", offsets={50: -0.06}, acc=0.942),
            run("native", "rerun", acc=0.95), run("native", "rerun_ulp", offsets={50: 0.07}, acc=0.955)]
    res = V.agreement(runs)
    sp = res["spread"]["bf16"]
    assert sp["label"] == "native/rerun_ulp" and sp["max_loss_dev"] == pytest.approx(0.07)
    assert sp["acc_dev"] == pytest.approx(0.005)
    assert res["runs"]["native/rerun"]["max_loss_dev"] == 0.0 and res["runs"]["native/rerun"]["role"] == "spread"
    assert res["runs"]["megatrain/default"]["verdict"] == V.WITHIN_SPREAD  # 0.06 <= 0.07 nats, -0.8 points
    runs[1] = run("megatrain", offsets={50: -0.06}, acc=0.935)  # -1.5 points: beyond 1 point and the spread's 0.5
    assert V.agreement(runs)["runs"]["megatrain/default"]["verdict"] == V.DISAGREE



def test_gap_larger_than_the_spread_disagrees():
    runs = [run("native"), run("megatrain", offsets={50: 0.08}), run("native", "rerun", offsets={25: 0.02})]
    res = V.agreement(runs)
    assert res["runs"]["megatrain/default"]["verdict"] == V.DISAGREE and res["verdict"] == V.DISAGREE
    assert "all-on-GPU vs all-on-GPU 0.0200 nats (step 25, native/rerun)" in V.explain(res, runs)[0]


def test_accuracy_gap_beyond_one_point_and_the_spread_disagrees():
    runs = [run("native", acc=0.95), run("megatrain", offsets={50: 0.01}, acc=0.90),
            run("native", "rerun", offsets={50: 0.05}, acc=0.94)]
    assert V.agreement(runs)["runs"]["megatrain/default"]["verdict"] == V.DISAGREE


def test_each_dtype_has_its_own_reference_and_the_fp32_pair_explains_the_bf16_gap():
    runs = [run("native"), run("megatrain", offsets={50: 0.08}, step0=3.4610, label="MT", tier="tiered"),
            run("native", "fp32", "fp32", offsets={50: 0.5}, step0=3.50),
            run("megatrain", "fp32", "fp32", offsets={50: 0.5002}, step0=3.5000004, label="MT fp32", tier="tiered")]
    res = V.agreement(runs)
    assert res["refs"] == {"bf16": "native/default", "fp32": "native/fp32"}
    fp32 = res["runs"]["MT fp32"]
    assert fp32["verdict"] == V.AGREE and fp32["max_loss_dev"] == pytest.approx(2e-4, abs=1e-9)  # vs native fp32
    assert fp32["step0_loss_dev"] == pytest.approx(4e-7, abs=1e-9)
    assert res["runs"]["MT"]["verdict"] == V.DISAGREE and res["verdict"] == V.DISAGREE  # never hidden
    lines = V.explain(res, runs)
    assert any("With one arithmetic (fp32) MT fp32 stays within" in ln and "bf16 arithmetic" in ln for ln in lines)
    assert any("bf16 vs all-on-GPU fp32" in ln and "0.5000 nats (step 50)" in ln for ln in lines)
    # and when fp32 does not close it, the report says the gap is not bf16's alone
    runs[3] = run("megatrain", "fp32", "fp32", offsets={50: 0.56}, label="MT fp32", tier="tiered")
    assert any("not bf16's alone" in ln for ln in V.explain(V.agreement(runs), runs))


def test_failed_incomplete_and_not_exact_runs():
    runs = [run("native"), run("megatrain", offsets={50: 0.001}), run("zero3", status="error"),
            run("megatrain", "short", steps=50, label="short"), run("zenflow", offsets={50: 0.3})]
    res = V.agreement(runs)
    assert res["runs"]["zero3/default"]["verdict"] == V.FAILED and res["failed"] == ["zero3/default"]
    assert res["runs"]["short"]["verdict"] == V.INCOMPLETE  # 50 steps against 100: not the same run
    assert res["runs"]["zenflow/default"]["role"] == "not exact"
    assert res["verdict"] == V.DISAGREE  # the incomplete one; zenflow and the failure do not count
    del runs[3]
    assert V.agreement(runs)["verdict"] == V.AGREE
    assert any("zero3/default (bf16): error: boom → not judged" in ln for ln in V.explain(V.agreement(runs), runs))


def test_no_reference():
    assert V.agreement([run("megatrain")])["verdict"] == "no reference"


def test_dtype_and_labels_of_rows():
    assert run_dtype("bf16", {}, "H200") == "bf16" and run_dtype("float32", {}, "H200") == "fp32"
    assert run_dtype("auto", {"dtype": "auto", "device": "cuda"}, "H200") == "bf16"
    assert run_dtype(None, {"dtype": "fp32"}, "H200") == "fp32" and run_dtype("auto", {}, "cpu") == "fp32"
    labels = {run_label("megatrain", "default", "tiered", "H200"), run_label("megatrain", "fp32", "tiered", "H200"),
              run_label("megatrain", "pure_streaming", "pure streaming", "H200"),
              run_label("native", "rerun", "", "H200"), run_label("native", "default", "", "H200")}
    assert labels == {"MegaTrain tiered", "MegaTrain tiered [fp32]", "MegaTrain pure streaming",
                      "All-on-GPU [rerun]", "All-on-GPU"}


# -- the autocast point and the fp32 points (issue 26): arithmetic from the rows, both yardsticks stated ----
SPREAD = {50: 0.022}  # all-on-GPU against itself with beta2 two fp32 ulps off (the a9736ef rows: 0.0223)


def sweep_runs(autocast_gap, *, autocast_acc=0.95):
    """The sweep's bf16 runs with their arithmetic: all-on-GPU (autocast) and its ulp rerun, MegaTrain tiered
    in its own bf16 arithmetic (0.042 off) and in all-on-GPU's (``autocast_gap`` off), and an fp32 all-on-GPU
    half a nat away from the bf16 one, so a run judged against the wrong reference cannot agree."""
    return [run("native", arithmetic="autocast"),
            run("megatrain", offsets={25: 0.042}, acc=0.928, label="MT", tier="tiered", arithmetic="bf16 layers"),
            run("megatrain", "autocast", offsets={50: autocast_gap}, acc=autocast_acc, step0=3.4575003,
                label="MT autocast", tier="tiered", arithmetic="autocast"),
            run("native", "rerun_ulp", offsets=SPREAD, acc=0.962, arithmetic="autocast"),
            run("native", "fp32", "fp32", offsets={50: 0.5}, step0=3.50, arithmetic="fp32")]


def test_autocast_within_the_target_agrees_against_all_on_gpu_bf16():
    runs = sweep_runs(0.004)
    res = V.agreement(runs)
    v = res["runs"]["MT autocast"]
    assert v["dtype"] == "bf16" and v["same_arithmetic"] is True  # judged against bf16 all-on-GPU, not fp32
    assert v["max_loss_dev"] == pytest.approx(0.004) and v["step0_loss_dev"] == pytest.approx(3e-7, abs=1e-9)
    assert v["verdict"] == V.AGREE and v["target"] is True and v["within_spread"] is True
    assert res["runs"]["MT"]["same_arithmetic"] is False and res["runs"]["MT"]["verdict"] == V.DISAGREE
    lines = V.explain(res, runs)
    line = next(ln for ln in lines if ln.startswith("- MT autocast "))
    assert "(bf16 autocast: all-on-GPU's own arithmetic, expected gap 0 up to GPU nondeterminism)" in line
    assert "issue target (≤ 0.01 nats, ≤ 1 point) met" in line and ": within it → **agree**" in line
    assert "0.0220 nats (step 50, native/rerun_ulp)" in line
    assert any(ln.startswith("- With all-on-GPU's own bf16 arithmetic (autocast) MT autocast is 0.0040 nats")
               and "with its own (bf16 layers) 0.0420" in ln and "the gap was the choice of arithmetic" in ln
               for ln in lines)
    assert V.by_arithmetic(res)[("bf16", "autocast")] == [("MT autocast", V.AGREE)]


def test_autocast_beyond_the_target_and_the_spread_disagrees():
    runs = sweep_runs(0.03)
    res = V.agreement(runs)
    v = res["runs"]["MT autocast"]
    assert v["verdict"] == V.DISAGREE and v["target"] is False and v["within_spread"] is False
    assert res["verdict"] == V.DISAGREE
    lines = V.explain(res, runs)
    line = next(ln for ln in lines if ln.startswith("- MT autocast "))
    assert "0.0300 nats (step 50)" in line and "missed" in line and ": beyond it → **disagree**" in line
    assert any("the same arithmetic does not close the gap" in ln for ln in lines)


def test_autocast_between_the_target_and_the_spread_says_both():
    """0.015 nats: over the issue's 0.01, within all-on-GPU's 0.022 from itself; an accuracy gap of 2 points
    (beyond 1 point and the spread's 1.2) disagrees however close the loss is."""
    res = V.agreement(sweep_runs(0.015))
    v = res["runs"]["MT autocast"]
    assert (v["target"], v["within_spread"], v["verdict"]) == (False, True, V.WITHIN_SPREAD)
    line = next(ln for ln in V.explain(res, sweep_runs(0.015)) if ln.startswith("- MT autocast "))
    assert "missed" in line and ": within it → **agree within run-to-run spread**" in line
    res = V.agreement(sweep_runs(0.004, autocast_acc=0.93))
    v = res["runs"]["MT autocast"]
    assert (v["target"], v["within_spread"], v["verdict"]) == (False, False, V.DISAGREE)


def test_zero3_fp32_is_judged_against_all_on_gpu_fp32():
    runs = [run("native", arithmetic="autocast"),
            run("zero3", offsets={50: 0.026}, acc=0.948, step0=3.4610, label="Z3", arithmetic="bf16 model"),
            run("native", "rerun_ulp", offsets=SPREAD, acc=0.962, arithmetic="autocast"),
            run("native", "fp32", "fp32", offsets={50: 0.5}, step0=3.50, arithmetic="fp32"),
            run("zero3", "fp32", "fp32", offsets={50: 0.5003}, step0=3.5000002, label="Z3 fp32", arithmetic="fp32")]
    res = V.agreement(runs)
    assert res["refs"] == {"bf16": "native/default", "fp32": "native/fp32"}
    z = res["runs"]["Z3 fp32"]
    assert z["max_loss_dev"] == pytest.approx(3e-4, abs=1e-9) and z["verdict"] == V.AGREE  # 0.5 from bf16's
    assert z["target"] is True and z["within_spread"] is None and z["same_arithmetic"] is True
    assert res["runs"]["Z3"]["verdict"] == V.DISAGREE  # 0.026 > 0.022: beyond the spread, never hidden
    lines = V.explain(res, runs)
    assert any(ln.startswith("- Z3 fp32 (fp32): ") and "not measured at fp32 → **agree**" in ln for ln in lines)
    assert any(ln.startswith("- With one arithmetic (fp32) Z3 fp32 stays within 0.01 nats") and "(0.0260;" in ln
               and "bf16 arithmetic, not from the system's schedule or update" in ln for ln in lines)
    assert V.by_arithmetic(res) == {("bf16", "bf16 model"): [("Z3", V.DISAGREE)],
                                    ("fp32", "fp32"): [("Z3 fp32", V.AGREE)]}


def test_arithmetic_of_rows():
    """Which arithmetic a row ran, from its recorded fields (result.json's system_info, the job's options)."""
    from analysis.sft_report import run_arithmetic

    assert run_arithmetic("native", "bf16", {"compute_dtype": "bfloat16"}, {}) == "autocast"
    assert run_arithmetic("native", "fp32", {"compute_dtype": "float32"}, {}) == "fp32"
    mt = {"config": {"compute_dtype": "bf16", "mixed_precision": "autocast"}}
    assert run_arithmetic("megatrain", "bf16", mt, {}) == "autocast"
    # a row from before the option: the engine's default
    assert run_arithmetic("megatrain", "bf16", {"config": {"compute_dtype": "bf16"}}, {}) == "bf16 layers"
    assert run_arithmetic("megatrain", "bf16", {}, {"options": {"mixed_precision": "autocast"}}) == "autocast"
    assert run_arithmetic("megatrain", "fp32", {"config": {"compute_dtype": "fp32", "mixed_precision": "autocast"}},
                          {}) == "fp32"  # autocast with an fp32 compute dtype is plain fp32
    ds = {"compute_dtype": "bfloat16", "ds_config": {"bf16": {"enabled": True}}}
    assert run_arithmetic("zero3", "bf16", ds, {}) == "bf16 model"
    assert run_arithmetic("zero3", "fp32", {"compute_dtype": "float32", "ds_config": {"bf16": {"enabled": False}}},
                          {}) == "fp32"
    assert run_arithmetic("fsdp", "bf16", {}, {}) == ""  # not recorded: said so, not guessed


def test_report_section_states_arithmetic_and_what_it_reproduces(monkeypatch):
    """The REPORT section from synthetic runs: an arithmetic column and legend, the verdict by arithmetic,
    and what this is and is not of the paper's Table 3 from the rows' own sizes."""
    from analysis import sft_report

    runs = sweep_runs(0.004)
    for r in runs:
        r.update(model="smollm2-135m", num_params=134_515_008, batch_size=64, seq_len=48, hardware="H200",
                 gpu_name="NVIDIA H200", git_sha="abc", date="2026-12-04",
                 sft={"gguf": "x.gguf", "digits": 3, "op": "add", "n_train": 20000, "n_eval": 500})
    monkeypatch.setattr(sft_report, "collect", lambda *a, **k: runs)
    text = "\n".join(sft_report.report_lines("unused"))
    assert "| system | compute | arithmetic | status |" in text
    assert "| MT autocast | bf16 | autocast | ok |" in text and "| MT | bf16 | bf16 layers | ok |" in text
    assert "- *bf16 layers*: each layer wholly in bf16" in text and "Ran it: MT." in text
    assert "By arithmetic: bf16 layers: MT disagree; bf16 autocast: MT autocast agree." in text
    assert "Model size: the paper's 7B and 14B models, here 135M" in text
    assert "here 20000 generated problems of which 6,400 (100 steps × 64, 0.32 epochs) are seen" in text
    assert "Training length: here 100 steps" in text and "MetaMathQA" in text and "GSM8K" in text


def _with_train(r, deltas):
    """``r`` with its training losses moved by ``deltas`` (one per step, cycled) from the reference's 1.0."""
    for i, st in enumerate(r["steps"][1:], start=1):
        st["loss"] = 1.0 + deltas[i % len(deltas)]
    return r


def test_whole_run_test_rescues_a_one_evaluation_bump_and_says_so():
    """Held-out beyond the spread at one evaluation (0.05 > 0.02), but its training losses no farther from the
    reference over the run than a rerun's (RMS 0.02 <= 0.03): agree within run-to-run spread, by the whole
    run; a bit-identical rerun (RMS 0) does not set the whole-run spread."""
    runs = [run("native"), _with_train(run("megatrain", offsets={25: 0.05}), [0.02, -0.02]),
            run("native", "rerun"), _with_train(run("native", "rerun_mb2", offsets={50: 0.02}), [0.03, -0.03])]
    res = V.agreement(runs)
    sp = res["spread"]["bf16"]
    assert sp["train_rms"] == pytest.approx(0.03 * (99 / 100) ** 0.5) and sp["train_label"] == "native/rerun_mb2"
    v = res["runs"]["megatrain/default"]
    assert v["train_rms"] == pytest.approx(0.02 * (99 / 100) ** 0.5) and abs(v["train_bias"]) < 1e-3
    assert v["spread_tests"] == {"heldout": False, "whole_run": True, "accuracy": True}
    assert v["verdict"] == V.WITHIN_SPREAD
    line = next(ln for ln in V.explain(res, runs) if ln.startswith("- megatrain/default"))
    assert "held-out beyond it, the whole run within it → **agree within run-to-run spread**" in line
    assert "training loss 0.0298 RMS (native/rerun_mb2)" in line
    # farther over the whole run too: disagree, both tests named
    runs[1] = _with_train(run("megatrain", offsets={25: 0.05}), [0.05, -0.05])
    res = V.agreement(runs)
    assert res["runs"]["megatrain/default"]["verdict"] == V.DISAGREE
    line = next(ln for ln in V.explain(res, runs) if ln.startswith("- megatrain/default"))
    assert "beyond it (held-out and whole run) → **disagree**" in line


def test_only_bit_identical_reruns_leave_the_whole_run_test_unmeasured():
    runs = [run("native"), _with_train(run("megatrain", offsets={25: 0.05}), [0.001]),
            run("native", "rerun", offsets={50: 0.01})]
    v = V.agreement(runs)["runs"]["megatrain/default"]
    assert v["spread_tests"]["whole_run"] is None and v["verdict"] == V.DISAGREE


def test_a_row_that_trained_in_another_split_says_so():
    from analysis.sft_report import split_note

    info = lambda mb: {"system_info": {"settings": {"micro_batches": mb}}}  # noqa: E731
    assert split_note({"micro_batches": 2}, info(1)) == " (ran in 1 micro-batch, not 2)"
    assert split_note({"micro_batches": 1}, info(4)) == " (ran in 4 micro-batches, not 1)"
    assert split_note({"micro_batches": 2}, info(2)) == "" and split_note({"micro_batches": 2}, {}) == ""
