"""Claim verdicts read row fields, never prose: memory skips ("not reproducible here", "predicted"), the
engine's own limits ("missed"), noise, commits, machines, placement/clipping in every verdict, the
summary's counts, and REPORT.md regenerated from the committed rows (no torch)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from analysis import claims as C, report  # noqa: E402
from experiments import schema  # noqa: E402

HW = {"GH200": ["GH200", "Hopper"], "H200_1.5TB": ["H200 + 1.5 TB RAM", "H200, 1.5 TB host"]}
SHAPES = {7: (7.62e9, 28, 3584), 14: (14.77e9, 48, 5120), 32: (32.76e9, 64, 5120), 72: (72.71e9, 80, 8192),
          120: (117.15e9, 116, 10240)}


def _row(system: str, size: int, status: str = "ok", tflops: float | None = None, point: str | None = None,
         sweep: str = "size", spread: tuple[float, float] | None = None, **kw) -> dict:
    p, layers, hidden = SHAPES[size]
    base = dict(sweep=sweep, point=point or f"{system}__qwen2.5-{size}b", system=system, variant="default",
                status=status, model=f"qwen2.5-{size}b", num_params=p, num_layers=layers, hidden_size=hidden,
                seq_len=1024, batch_size=8, tokens_per_step=8192, hardware="H200", emulated=False,
                tflops=tflops if status == "ok" else None, step_time_median_s=1.0 if status == "ok" else None,
                gpu_name="NVIDIA H200", git_sha="abc1234", host_ram_gib=125.9)
    if spread:  # (fastest, slowest) step time around the 1.0 s median
        base.update(timed_steps=3, step_time_min_s=spread[0], step_time_max_s=spread[1])
    base.update(kw)
    return base


def _frame(tmp_path: Path, rows: list[dict]):
    for r in rows:
        schema.append_row(tmp_path / r["sweep"] / "results.csv", r)
    frames = {s: schema.read_results(tmp_path / s / "results.csv") for s in {r["sweep"] for r in rows}}
    return C._all_rows(frames)


def _claim(cid: str, compare: str, system, where: dict, paper=100.0, **kw) -> dict:
    base = dict(id=cid, section="size", claim=cid, paper=paper, paper_hardware="GH200", compare=compare,
                system=system, where=where, sweeps=["size", "depth"])
    return {**base, **kw}


def _v(claim, rows) -> C.Verdict:
    return C.evaluate_claim(claim, rows, 0.10, HW).verdict


HOST = dict(reason="host_memory", need_host_gib=812.3, have_host_gib=120.1)


def test_a_memory_skip_is_read_from_fields_not_from_its_text(tmp_path):
    # the text says nothing a regex could use; the fields decide
    rows = _frame(tmp_path, [_row("megatrain", 72, "skipped", error="see fields", **HOST),
                             _row("megatrain", 32, "skipped", error="skipped: host needs 999 GiB > 1 GiB RAM")])
    v = _v(_claim("c", "absolute", "megatrain", {"params_b": 72}), rows)
    assert v.kind == "not reproducible here" and "needs ~812 GiB host RAM, 120 GiB available" in v.detail
    # memory words in the prose but no reason field: not a memory verdict
    assert _v(_claim("c", "absolute", "megatrain", {"params_b": 32}), rows).kind == "not measured"
    assert not hasattr(C, "memory_limit") and "re" not in vars(C)  # no regex over prose in the claims code


def test_the_engines_own_limits_are_missed(tmp_path):
    rows = _frame(tmp_path, [
        _row("megatrain", 72, "skipped", reason="plan_gpu", need_gpu_gib=162.2, have_gpu_gib=133.4),
        _row("megatrain", 120, "skipped", reason="host_memory", need_host_gib=1684.9, have_host_gib=123.0),
        _row("megatrain", 32, "skipped", reason="host_memory", need_host_gib=452.0, have_host_gib=123.0)])
    gpu = _v(_claim("c", "trains", "megatrain", {"params_b": 72}), rows)
    assert gpu.kind == "missed" and "162 GiB GPU memory" in gpu.detail and "limit of the engine" in gpu.detail
    trains = lambda size: _v(_claim("c", "trains", "megatrain", {"params_b": size}, paper_host_gib=1397), rows)  # noqa: E731
    assert trains(120).kind == "missed" and "more than the paper's 1,397 GiB host" in trains(120).detail
    assert trains(32).kind == "not reproducible here" and "fits in 1.5 TB" in trains(32).detail


def test_out_of_memory_claims_matched_only_when_measured(tmp_path):
    rows = _frame(tmp_path, [_row("zero3", 32, "skipped", **HOST), _row("fsdp", 32, "gpu_oom"),
                             _row("zero3", 14, "host_oom"), _row("fsdp", 14, "gpu_oom"),
                             _row("zero3", 7, "ok", 50.0)])
    both = lambda size: _v(_claim("c", "status", ["zero3", "fsdp"], {"params_b": size}), rows)  # noqa: E731
    assert both(32).kind == "predicted" and "1 of 2 not launched" in both(32).detail
    assert both(14).kind == "matched"
    assert _v(_claim("c", "status", "zero3", {"params_b": 7}), rows).kind == "differs"


def test_each_verdict_states_placement_and_clipping(tmp_path):
    rows = _frame(tmp_path, [
        _row("megatrain", 7, "ok", 300.0, gpu_tier_layers=28, host_tier_layers=0, steps_clipped=3, timed_steps=3,
             max_grad_norm=1.0),
        _row("megatrain", 14, "ok", 250.0, gpu_tier_layers=19, host_tier_layers=29, steps_clipped=0, timed_steps=3,
             max_grad_norm=1.0),
        _row("megatrain", 32, "ok", 200.0, gpu_tier_layers=0, host_tier_layers=64, max_grad_norm=0.0)])
    v7 = _v(_claim("c", "absolute", "megatrain", {"params_b": 7}, paper=284), rows)
    assert "all 28 layers on the GPU tier" in v7.detail and "clipping fired 3 of 3 timed steps" in v7.detail
    assert "the paper streams every layer, this row streams none" in v7.detail
    v14 = str(_v(_claim("c", "absolute", "megatrain", {"params_b": 14}, paper=250), rows))
    assert v14.startswith("matched") and "tiered, 19 of 48 layers on the GPU tier" in v14 and "0 of 3" in v14
    v32 = _v(_claim("c", "absolute", "megatrain", {"params_b": 32}, paper=200), rows)
    assert "pure streaming, all 64 layers from the host" in v32.detail and "no clipping" in v32.detail


def test_a_ratio_inside_the_spread_is_within_noise(tmp_path):
    rows = _frame(tmp_path, [_row("megatrain", 7, "ok", 105.0, spread=(0.9, 1.2)),
                             _row("zero3", 7, "ok", 100.0, spread=(0.8, 1.1))])
    v = _v(_claim("c", "ratio", "megatrain", {"params_b": 7}, paper=2.0, baseline="zero3"), rows)
    assert v.kind == "within noise" and "spread" in v.detail
    # the paper's own ratio inside the tolerance is still a match
    assert _v(_claim("c", "ratio", "megatrain", {"params_b": 7}, paper=1.0, baseline="zero3"), rows).kind == "matched"
    apart = _frame(tmp_path / "b", [_row("megatrain", 7, "ok", 300.0, spread=(0.99, 1.01)),
                                    _row("zero3", 7, "ok", 100.0, spread=(0.99, 1.01))])
    assert _v(_claim("c", "ratio", "megatrain", {"params_b": 7}, paper=2.0, baseline="zero3"), apart).kind == "exceeded"


def test_ratios_across_commits_are_marked_and_machines_never_mixed(tmp_path):
    rows = _frame(tmp_path, [_row("megatrain", 7, "ok", 300.0), _row("zero3", 7, "ok", 100.0, git_sha="def5678")])
    j = C.evaluate_claim(_claim("c", "ratio", "megatrain", {"params_b": 7}, paper=3.0, baseline="zero3"), rows, 0.1, HW)
    assert "3.00×‡" in j.ours and "across commits: git abc1234 vs def5678" in j.verdict.detail
    other = _frame(tmp_path / "m", [_row("megatrain", 7, "ok", 300.0), _row("zero3", 7, "ok", 100.0, gpu_name="A100")])
    v = _v(_claim("c", "ratio", "megatrain", {"params_b": 7}, paper=3.0, baseline="zero3"), other)
    assert v.kind == "not comparable" and "two machines" in v.detail


def test_summary_counts_each_kind_apart():
    mk = lambda k: C.Judged("i", "c", "s", "", "", "", C.Verdict(k))  # noqa: E731
    lines = C.summary_lines([mk("matched"), mk("predicted"), mk("predicted"), mk("missed"), mk("not measured")])
    assert lines[0] == ("Verdict summary (5 claims): 2 measured — matched: 1, missed: 1; not measured against "
                        "the paper — predicted: 2, not measured: 1.")
    with pytest.raises(ValueError):
        C.Verdict("matched-ish")


def test_a_cpu_report_judges_no_claim(tmp_path):
    rows = [_row("megatrain", 7, "ok", 1.0, sweep="smoke", hardware="cpu", gpu_name="cpu")]
    _frame(tmp_path, rows)
    text, _ = report.build_report(tmp_path, plots_dir=None, log=lambda *_: None)
    assert "No claim is judged: every row of this report was measured on a CPU" in text
    assert "**matched**" not in text and "TFLOPS [" not in text


def test_claims_file_refuses_evidence_files(tmp_path):
    p = tmp_path / "claims.yaml"
    p.write_text("claims:\n  - {id: a, section: s, claim: x, paper: 1, compare: absolute, system: megatrain,\n"
                 "     evidence: {file: x.jsonl, where: {a: 1}}}\n")
    with pytest.raises(C.ClaimsError, match="evidence"):
        C.load_claims(p)
    assert not any("evidence" in c or c["id"].startswith("ref_") for c in C.load_claims()["claims"])


def test_a_claim_on_another_shape_than_the_papers_is_not_comparable(tmp_path):
    """``shape_differs``: our row is another model than the paper's (the width axis, docs/reproduction.md):
    a predicted OOM or a measured number on it is no verdict on the paper's claim; without a row it stays
    "not measured". The committed width claims say so."""
    rows = _frame(tmp_path, [_row("zero3", 72, "skipped", **HOST), _row("megatrain", 7, tflops=100.0)])
    why = "not the paper's model: ours is wider"
    oom = _claim("oom", "status", "zero3", {"params_b": 72}, paper="OOM", expect="oom")
    assert _v(oom, rows).kind == "predicted"
    v = _v({**oom, "shape_differs": why}, rows)
    assert v.kind == "not comparable" and v.detail.startswith(why) and "predicted" in v.detail
    num = _claim("num", "absolute", "megatrain", {"params_b": 7}, shape_differs=why)
    assert _v(num, rows).kind == "not comparable"
    assert _v({**num, "where": {"params_b": 32}}, rows).kind == "not measured"
    with pytest.raises(C.ClaimsError, match="shape_differs"):
        C._check_optional_fields(Path("x.yaml"), {**oom, "shape_differs": 1})
    width = {c["id"]: c for c in C.load_claims()["claims"] if c["section"] == "width"}
    assert {i for i, c in width.items() if c.get("shape_differs")} == {
        "width_5x", "width_5x_zero3_oom", "width_4x_fsdp_oom", "width_5x_fsdp_oom"}


def test_committed_report_is_what_the_committed_rows_give():
    """results/REPORT.md is regenerated from results/*/results.csv and the claims file, byte for byte."""
    text, errors = report.build_report(ROOT / "results", plots_dir=ROOT / "plots",
                                       out_path=ROOT / "results" / "REPORT.md", log=lambda *_: None)
    assert errors == []
    committed = (ROOT / "results" / "REPORT.md").read_text()
    assert text == committed, ("results/REPORT.md is stale: python -m analysis.report --results results "
                               "--plots plots")
