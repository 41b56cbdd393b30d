"""analysis.steady: rows whose timed steps are still speeding up are flagged, and the report marks them;
analysis.phases: the engine's phase timers of those steps become the report's "where the time went"."""
import json
from pathlib import Path

from experiments import schema
from analysis.report import build_report
from analysis.steady import falling_note, mark_unsteady, timed_step_times


def _metrics(point_dir: Path, times, warmup=1):
    point_dir.mkdir(parents=True, exist_ok=True)
    recs = [{"step": i, "warmup": i < warmup, "step_time_s": t} for i, t in enumerate(times)]
    (point_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_falling_note_rule():
    assert falling_note([4.11, 2.51]) == "4.11 -> 2.51 s over 2 timed steps"
    assert falling_note([1.00, 0.90]) == ""          # a 10 % fall is inside the tolerance
    assert falling_note([1.00, 1.30]) == ""          # slower at the end is not "still speeding up"
    assert falling_note([2.0]) == "" and falling_note([]) == ""


def test_timed_step_times_skips_warmup_and_tolerates_missing(tmp_path):
    _metrics(tmp_path / "p", [9.0, 4.0, 3.0], warmup=1)
    assert timed_step_times(tmp_path / "p") == [4.0, 3.0]
    assert timed_step_times(tmp_path / "absent") == []
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text("{not json\n")
    assert timed_step_times(tmp_path / "bad") == []


def _row(system, status="ok", tflops=None, step=1.0):
    return dict(sweep="size", point=f"{system}__qwen2.5-3b__L36__w1__s1024__b8__default__H200", system=system,
                variant="default", status=status, error="", model="qwen2.5-3b", num_params=3.09e9, num_layers=36,
                hidden_size=2048, seq_len=1024, batch_size=8, tokens_per_step=8192, hardware="H200", emulated=False,
                tflops=tflops, step_time_median_s=step, gpu_name="NVIDIA H200", git_sha="abc1234",
                host_ram_gib=125.9)


def test_report_marks_the_unsteady_row_and_its_ratio(tmp_path):
    rows = [_row("megatrain", tflops=300.0, step=0.505), _row("zero3", tflops=50.0, step=3.31)]
    for r in rows:
        schema.append_row(tmp_path / "size" / "results.csv", r)
    _metrics(tmp_path / "size" / rows[0]["point"], [1.0, 0.51, 0.50])
    _metrics(tmp_path / "size" / rows[1]["point"], [4.7, 4.11, 2.51])
    df = mark_unsteady(tmp_path, "size", schema.read_results(tmp_path / "size" / "results.csv"))
    assert list(df["steady_note"]) == ["", "4.11 -> 2.51 s over 2 timed steps"]
    text, errors = build_report(tmp_path, out_path=tmp_path / "REPORT.md", log=lambda *a: None)
    assert not errors
    assert "| ZeRO-3 | 50.0† |" in text and "6.00×†" in text
    assert "## Rows not at steady state" in text and "4.11 -> 2.51 s over 2 timed steps" in text
    assert "| MegaTrain | 300† |" not in text  # the steady row is not marked


def test_report_without_unsteady_rows_has_no_section(tmp_path):
    schema.append_row(tmp_path / "size" / "results.csv", _row("megatrain", tflops=300.0))
    text, _ = build_report(tmp_path, out_path=tmp_path / "REPORT.md", log=lambda *a: None)
    assert "Rows not at steady state" not in text and "†" not in text


def test_phase_medians_and_the_report_section(tmp_path):
    from analysis.phases import phase_medians

    r = _row("megatrain", tflops=300.0, step=4.2)
    schema.append_row(tmp_path / "size" / "results.csv", r)
    pdir = tmp_path / "size" / r["point"]
    pdir.mkdir(parents=True)
    split = lambda f, b, o: {"forward_s": f, "loss_s": 0.1, "backward_s": b, "grad_norm_s": 0.0,  # noqa: E731
                             "optimizer_launch_s": o, "optimizer_exposed_s": o / 2, "host_update_busy_s": 1.5}
    recs = [{"step": 0, "warmup": True, "step_time_s": 9.0, "phases": split(5.0, 3.0, 0.9)},
            {"step": 1, "warmup": False, "step_time_s": 4.0, "phases": split(1.0, 2.5, 0.4)},
            {"step": 2, "warmup": False, "step_time_s": 4.2, "phases": split(1.2, 2.5, 0.4)},
            {"step": 3, "warmup": False, "step_time_s": 4.4, "phases": split(1.4, 2.5, 0.4)}]
    (pdir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    ph = phase_medians(pdir)
    assert ph["step_s"] == 4.2 and ph["forward_s"] == 1.2 and ph["optimizer_exposed_s"] == 0.2  # warm-up left out
    text, _ = build_report(tmp_path, out_path=tmp_path / "REPORT.md", log=lambda *a: None)
    assert "## Where MegaTrain's step time went" in text
    assert f"| size | {r['point']} | 4.20 | 1.20 (29%) |" in text and "| 0.20 (5%) | 1.50 (36%) | — |" in text
    # (the GPU load-wait column is "—": these steps were written before that timer existed)
    # rows without phase timers (measured before they were recorded): no section
    (pdir / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in x.items() if k != "phases"}) + "\n"
                                                for x in recs))
    assert phase_medians(pdir) == {}
    assert "Where MegaTrain's step time went" not in build_report(tmp_path, out_path=tmp_path / "R.md",
                                                                   log=lambda *a: None)[0]


def test_a_stale_point_folder_is_not_read_for_a_newer_row(tmp_path):
    """A row merged without its folder (the device call could not bring it back) sits beside an older run's
    folder of the same point: neither the steady check nor the phase table may read that folder for it."""
    from analysis.phases import phase_medians
    from analysis.steady import row_folder

    old = _row("megatrain", tflops=300.0, step=4.2)
    schema.append_row(tmp_path / "size" / "results.csv", old)
    pdir = tmp_path / "size" / old["point"]
    pdir.mkdir(parents=True)
    ph = {"forward_s": 1.0, "loss_s": 0.1, "backward_s": 2.5, "grad_norm_s": 0.0, "optimizer_launch_s": 0.6}
    recs = [{"step": i, "warmup": i == 0, "step_time_s": t, "phases": ph} for i, t in enumerate([9.0, 6.0, 4.2, 3.0])]
    (pdir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    df = schema.read_results(tmp_path / "size" / "results.csv")
    assert row_folder(tmp_path, "size", df.iloc[0]) == pdir and phase_medians(pdir)
    assert mark_unsteady(tmp_path, "size", df)["steady_note"].iloc[0]        # 6.0 -> 3.0: still falling
    text, _ = build_report(tmp_path, out_path=tmp_path / "REPORT.md", log=lambda *a: None)
    assert f"| size | {old['point']} | 4.20 |" in text and "Rows not at steady state" in text
    schema.append_row(tmp_path / "size" / "results.csv", _row("megatrain", tflops=330.0, step=3.8))  # newer, no folder
    df = schema.load_results(tmp_path, log=lambda *a: None)[0]["size"]
    assert len(df) == 1 and row_folder(tmp_path, "size", df.iloc[0]) is None
    assert mark_unsteady(tmp_path, "size", df)["steady_note"].iloc[0] == ""
    text, _ = build_report(tmp_path, out_path=tmp_path / "REPORT.md", log=lambda *a: None)
    assert "| MegaTrain | 330 |" in text
    assert "Where MegaTrain's step time went" not in text and "Rows not at steady state" not in text
