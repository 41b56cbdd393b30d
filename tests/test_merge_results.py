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
