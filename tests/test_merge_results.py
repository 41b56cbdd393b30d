"""scripts/merge_results.py: a device call's sweep folder joins results/<sweep>/ without losing anything."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import schema  # noqa: E402
from scripts.merge_results import main  # noqa: E402


def _sweep(folder: Path, points: dict[str, float], hardware: str = "H200") -> Path:
    for point, tflops in points.items():
        (folder / point).mkdir(parents=True)
        (folder / point / "result.json").write_text(f'{{"tflops": {tflops}}}')
        schema.append_row(folder / "results.csv", dict(sweep="s", point=point, system="megatrain", status="ok",
                                                        hardware=hardware, tflops=tflops))
    (folder / "runs.jsonl").write_text('{"run": 1}\n')
    return folder


def test_merge_appends_rows_and_refuses_to_overwrite(tmp_path):
    dst = _sweep(tmp_path / "dst", {"a": 1.0})
    src = _sweep(tmp_path / "src", {"b": 2.0})
    assert main([str(src), str(dst)]) == 0
    rows = schema.read_records(dst / "results.csv")
    assert [r["point"] for r in rows] == ["a", "b"] and (dst / "b" / "result.json").exists()
    assert (dst / "runs.jsonl").read_text().count("\n") == 2
    again = _sweep(tmp_path / "again", {"b": 3.0})
    assert main([str(again), str(dst)]) == 2  # b exists: refused, nothing written
    assert len(schema.read_records(dst / "results.csv")) == 2
    assert main([str(again), str(dst), "--replace"]) == 0  # newer folder; both rows kept as history
    rows = schema.read_records(dst / "results.csv")
    assert [r["point"] for r in rows] == ["a", "b", "b"] and rows[-1]["tflops"] == "3"
    assert "3.0" in (dst / "b" / "result.json").read_text()


def test_merge_refuses_another_machine_and_empty_runs(tmp_path):
    dst = _sweep(tmp_path / "dst", {"a": 1.0})
    assert main([str(_sweep(tmp_path / "other", {"b": 2.0}, hardware="A100")), str(dst)]) == 2
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), str(dst)]) == 2
    assert len(schema.read_records(dst / "results.csv")) == 1


def test_replace_removes_only_point_folders(tmp_path):
    dst = _sweep(tmp_path / "dst", {"a": 1.0})
    (dst / "b").mkdir()
    (dst / "b" / "notes.txt").write_text("a user's file")
    assert main([str(_sweep(tmp_path / "src", {"b": 2.0})), str(dst), "--replace"]) == 2
    assert (dst / "b" / "notes.txt").read_text() == "a user's file"
    assert len(schema.read_records(dst / "results.csv")) == 1


def _timed_out_point(folder: Path, point: str, step_times: list[float], steps: int = 8, warmup: int = 2,
                     budget_cut: bool = False) -> None:
    """A timeout row (as runners before partial rows wrote it) and its folder: job.json, metrics.jsonl."""
    import json

    from experiments.sweeps import Job

    pdir = folder / point
    pdir.mkdir(parents=True)
    spec = {"family": "qwen2", "num_layers": 2, "hidden_size": 64, "intermediate_size": 128}
    Job(id=point, sweep="s", system="superoffload", variant="default", model="m", width=1.0, spec=spec,
        num_params=1_000_000, seq_len=16, batch_size=4, micro_batches=1,
        hardware={"label": "H200", "peak_tflops": 797.5, "emulated": False}, options={},
        steps=steps, warmup_steps=warmup).save(pdir / "job.json")
    recs = [{"step": i, "warmup": i < warmup, "step_time_s": t, "loss": 3.0, "grad_norm": 2.0}
            for i, t in enumerate(step_times)]
    (pdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    err = "timeout: the point process exceeded 200s and was terminated"
    schema.append_row(folder / "results.csv", dict(
        sweep="s", point=point, system="superoffload", status="timeout", hardware="H200", steps=steps,
        warmup_steps=warmup, reason="budget_cut" if budget_cut else "",
        error=err + (" (clipped by time_budget_s; a rerun retries it)" if budget_cut else "")))


def test_a_timeout_row_that_finished_most_steps_merges_as_a_partial_row(tmp_path, capsys):
    dst = _sweep(tmp_path / "dst", {"a": 1.0})
    src = tmp_path / "src"
    _timed_out_point(src, "late", [30.0, 10.0, 9.4, 9.1, 9.3, 9.9, 9.8, 9.3])       # 6 of 8 timed steps
    _timed_out_point(src, "early", [30.0, 10.0, 9.4, 9.1], budget_cut=True)         # 2 of 8: stays a timeout
    _timed_out_point(src, "cut", [30.0, 10.0, 9.4, 9.1, 9.3, 9.9], steps=6, budget_cut=True)  # 4 of 6
    assert main([str(src), str(dst)]) == 0
    rows = {r["point"]: r for r in schema.read_records(dst / "results.csv")}
    late, early, cut = rows["late"], rows["early"], rows["cut"]
    assert late["status"] == "ok" and late["reason"] == "partial" and late["timed_steps"] == "6"
    assert float(late["step_time_median_s"]) == 9.35 and float(late["tflops"]) > 0 and late["steps_clipped"] == "6"
    assert late["error"] == ("partial: 6 of 8 timed steps finished before the point process exceeded 200s and was "
                             "terminated (a rerun retries it)")
    assert early["status"] == "timeout" and early["reason"] == "budget_cut" and early["tflops"] == ""
    assert cut["status"] == "ok" and cut["error"].endswith("(clipped by time_budget_s; a rerun retries it)")
    assert "late: partial: 6 of 8" in capsys.readouterr().out
    assert schema.point_status(dst / "results.csv")["late"] == "partial"  # a rerun retries it


def test_a_timeout_row_a_rerun_finished_stays_a_timeout(tmp_path, capsys):
    """The rerun's steps are in the folder: they belong to its own row, not to the earlier timeout's."""
    dst = _sweep(tmp_path / "dst", {"a": 1.0})
    src = tmp_path / "src"
    _timed_out_point(src, "p", [30.0, 10.0, 9.4, 9.1, 9.3, 9.9, 9.8, 9.3], budget_cut=True)  # folder: 8 steps
    schema.append_row(src / "results.csv", dict(sweep="s", point="p", system="superoffload", status="ok",
                                                hardware="H200", tflops=5.0))  # the rerun, same folder
    assert main([str(src), str(dst)]) == 0
    rows = [r for r in schema.read_records(dst / "results.csv") if r["point"] == "p"]
    assert [r["status"] for r in rows] == ["timeout", "ok"] and rows[0]["tflops"] == ""
    assert "partial" not in capsys.readouterr().out
