"""Results CSV schema, point ids, metrics summary and the initial-weight cache."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments import cache as K  # noqa: E402
from experiments import point_frame as P  # noqa: E402
from experiments import schema  # noqa: E402

BRIEF_COLUMNS = (
    "sweep, point, system, variant, status, error, model, family, num_params, num_layers, hidden_size, "
    "intermediate_size, width_mult, seq_len, batch_size, micro_batches, tokens_per_step, hardware, emulated, "
    "gpu_mem_cap_gib, steps, warmup_steps, step_time_median_s, step_time_mean_s, tokens_per_s, tflops, mfu, "
    "peak_tflops, gpu_peak_allocated_gib, gpu_peak_reserved_gib, gpu_peak_nvml_gib, host_peak_rss_gib, "
    "host_pinned_gib, host_bytes_per_param, host_estimate_gib, loss_first, loss_last, gpu_name, driver, "
    "torch_version, transformers_version, deepspeed_version, git_sha, host_ram_gib, date, duration_s, "
    "optimizer, settings"
).split(", ")


def test_columns_are_the_fixed_schema():
    # v2's columns first, in their order (old files stay readable), then the typed fields of v3
    assert schema.COLUMNS[:len(BRIEF_COLUMNS)] == BRIEF_COLUMNS and schema.SCHEMA_VERSION == 4
    assert set(schema.DESCRIPTIONS) == set(schema.COLUMNS) and all(schema.DESCRIPTIONS.values())
    for col in ("reason", "need_host_gib", "have_host_gib", "need_gpu_gib", "have_gpu_gib", "gpu_tier_layers",
                "host_tier_layers", "gpu_tier_params", "host_tier_params", "steps_clipped", "timed_steps",
                "step_time_min_s", "step_time_max_s", "step_time_stdev_s", "blocks", "blocks_kept",
                "predicted_step_s", "cpu_cores", "torch_threads", "git_sha", "schema"):
        assert col in schema.COLUMNS
    sample = ROOT / "analysis" / "data" / "sample_results" / "smoke" / "results.csv"
    if sample.exists():  # the plots' fixtures are v1 files: still read
        assert schema.header_version(schema.read_header(sample)) == 1


def test_schema_imports_nothing_of_the_runner():
    import subprocess

    # its own parts only: the old rows' upgrade and the timed steps' fields (leaves: they import no schema)
    own = "('experiments.schema', 'experiments.schema_legacy', 'experiments.step_records')"
    code = ("import sys; import experiments.schema; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'hydra', 'omegaconf', 'pandas') "
            f"or (m.startswith('experiments.') and m not in {own})]; print(bad); assert not bad")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_older_header_is_read_and_upgraded_but_not_appended_to(tmp_path):
    old = tmp_path / "results.csv"
    v2 = schema.HEADERS[2]
    cells = dict.fromkeys(v2, "x") | {"status": "skipped", "variant": "", "error":
                                        "skipped: engine plan (GPU tier filled first): host needs 148.7 GiB "
                                        "(14.77B params) > available host RAM 121.0 GiB", "point": "p"}
    old.write_text(",".join(v2) + "\n" + ",".join(cells[c] for c in v2) + "\n")
    df = schema.read_results(old)
    assert list(df.columns) == schema.COLUMNS and df.loc[0, "variant"] == "default"
    r = df.iloc[0]
    assert r["reason"] == "host_memory" and r["need_host_gib"] == 148.7 and r["have_host_gib"] == 121.0
    with pytest.raises(schema.SchemaError, match="--upgrade"):
        schema.append_row(old, schema.make_row(sweep="s", status="ok"))
    assert schema.upgrade_csv(old) == 2 and schema.read_header(old) == schema.COLUMNS
    schema.append_row(old, schema.make_row(sweep="s", point="q", status="ok"))
    assert schema.point_status(old) == {"p": "skipped", "q": "ok"}


def test_typed_row_round_trip(tmp_path):
    row = schema.Row(sweep="s", point="p", system="megatrain", status="skipped", reason="plan_gpu",
                     need_gpu_gib=28.7, have_gpu_gib=17.0, gpu_tier_layers=0, host_tier_layers=28)
    csv = tmp_path / "results.csv"
    schema.append_row(csv, row)
    r = schema.read_results(csv).iloc[0]
    assert (r["reason"], r["need_gpu_gib"], r["host_tier_layers"], r["schema"]) == ("plan_gpu", 28.7, 28, 4)
    with pytest.raises(schema.SchemaError, match="unknown reason"):
        schema.make_row(reason="felt like it")


def test_make_row_append_and_read(tmp_path):
    row = schema.make_row(sweep="s", point="p1", status="ok", num_params=10, tflops=1.23456789, emulated=False,
                          error="line one\nline two", mfu=float("nan"))
    assert list(row) == schema.COLUMNS and row["model"] == "" and row["tflops"] == "1.23457"
    assert row["error"] == "line one line two" and row["mfu"] == "" and row["emulated"] == "False"
    with pytest.raises(schema.SchemaError, match="unknown result column"):
        schema.make_row(bogus=1)
    with pytest.raises(schema.SchemaError, match="unknown status"):
        schema.make_row(status="fine")
    csv = tmp_path / "s" / "results.csv"
    schema.append_row(csv, row)
    schema.append_row(csv, dict(row, point="p2", status="error", tflops=None))
    schema.append_row(csv, dict(row, status="timeout"))
    text = csv.read_text().splitlines()
    assert text[0] == ",".join(schema.COLUMNS) and len(text) == 4
    df = schema.read_results(csv)
    assert list(df.columns) == schema.COLUMNS and len(df) == 3
    assert df["tflops"].dtype.kind == "f" and df["num_params"].iloc[0] == 10
    assert df["emulated"].dtype == bool
    assert schema.point_status(csv) == {"p1": "timeout", "p2": "error"}
    last = schema.latest(df)
    assert dict(zip(last["point"], last["status"])) == {"p1": "timeout", "p2": "error"}
    assert schema.read_results(tmp_path / "missing.csv").empty


def test_append_refuses_a_different_header(tmp_path):
    csv = tmp_path / "results.csv"
    csv.write_text("sweep,point,status\nx,y,ok\n")
    with pytest.raises(schema.SchemaError, match="missing: system"):
        schema.append_row(csv, schema.make_row(sweep="s"))
    assert csv.read_text() == "sweep,point,status\nx,y,ok\n"  # untouched
    with pytest.raises(schema.SchemaError):
        schema.read_results(csv)


def test_point_id_convention():
    pid = schema.point_id("megatrain", "qwen2.5-7b", 28, 1.0, 1024, 8, "default", "H200")
    assert pid == "megatrain__qwen2.5-7b__L28__w1__s1024__b8__default__H200"
    assert schema.point_id("zero3", "my model/x", 4, 1.5, 32, 2, "no opt:overlap", "RTX 3090") == \
        "zero3__my-model-x__L4__w1.5__s32__b2__no-opt-overlap__RTX-3090"
    assert "__" not in schema.point_id("a__b", "m", 1, 1, 1, 1, "v", "h").split("__", 1)[0] + "x"


def test_summarize_uses_measured_steps_and_the_formula():
    from experiments.sweeps import Job

    pt = Job(id="p", sweep="s", system="x", variant="default", model="m", width=1.0,
             spec={"num_layers": 2, "hidden_size": 4}, num_params=1000, seq_len=8, batch_size=2, micro_batches=1,
             hardware={"peak_tflops": 100.0}, options={})
    recs = [{"step": 0, "warmup": True, "loss": 9.0, "step_time_s": 50.0}] + \
           [{"step": i, "warmup": False, "loss": 9.0 - i, "step_time_s": t} for i, t in enumerate([1.0, 3.0, 2.0], 1)]
    m = P.summarize(recs, pt)
    flops = 6 * 1000 * 16 + 12 * 2 * 4 * 8 * 16
    assert m["step_time_median_s"] == 2.0 and m["step_time_mean_s"] == 2.0
    assert m["tflops"] == pytest.approx(flops / 2.0 / 1e12) and m["mfu"] == pytest.approx(m["tflops"] / 100)
    assert m["tokens_per_s"] == 8.0 and m["loss_first"] == 9.0 and m["loss_last"] == 6.0
    assert "tflops" not in P.summarize(recs[:1], pt)
    assert (m["timed_steps"], m["step_time_min_s"], m["step_time_max_s"]) == (3, 1.0, 3.0)
    assert m["step_time_stdev_s"] == pytest.approx(1.0) and "steps_clipped" not in m  # no norms reported
    normed = [dict(r, grad_norm=n) for r, n in zip(recs, [9.0, 0.5, 2.0, 1.5])]
    assert P.summarize(normed, pt)["steps_clipped"] == 2  # timed steps above max_grad_norm = 1.0


def test_init_cache_is_written_once_and_shared(tmp_path):
    from megatrain.spec import PRESETS

    spec = PRESETS["tiny-qwen2"].to_dict()
    cache = tmp_path / "cache"
    logs = []
    d1 = K.ensure_init_dir(spec, 0, cache, log=logs.append)
    assert K.init_complete(d1) and (cache / ".gitignore").read_text().strip().endswith("*")
    weights = K.init_paths(spec, 0, cache)[0]
    mtime = weights.stat().st_mtime_ns
    assert K.ensure_init_dir(spec, 0, cache, log=logs.append) == d1 and any("cached" in m for m in logs)
    # a longer context: own config.json, same weight files (symlinks), nothing rewritten
    long = dict(spec, max_position_embeddings=4096)
    d2 = K.ensure_init_dir(long, 0, cache, log=logs.append)
    assert d2 != d1 and K.init_paths(long, 0, cache)[0] == weights
    assert json.loads((d2 / "config.json").read_text())["max_position_embeddings"] == 4096
    shard = next(d2.glob("*.safetensors"))
    assert shard.is_symlink() and shard.resolve().parent == weights.resolve()
    # one weights folder, a real one (megatrain.checkpoint_layout.write_new_folder), nothing beside it
    assert list((cache / "weights").iterdir()) == [weights] and not weights.is_symlink()
    assert weights.stat().st_mtime_ns >= mtime
    # another seed or shape: other weights
    assert K.init_paths(spec, 1, cache)[0] != weights
    assert K.init_paths(dict(spec, num_layers=2), 0, cache)[0] != weights
    # the systems load it like any HF folder
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(str(d2)).max_position_embeddings == 4096
    # a broken link (evicted weights) makes the init dir incomplete again
    for f in weights.glob("*.safetensors"):
        os.remove(f)
    assert not K.init_complete(d2)


def test_factory_loading(tmp_path):
    f = tmp_path / "fac.py"
    f.write_text("def make(name, **kw):\n    return (name, kw)\ndef plain(**kw):\n    return kw\n")
    assert P.load_callable(f"{f}:make")("x", a=1) == ("x", {"a": 1})
    assert P._accepts(P.load_callable(f"{f}:make"), "name") and not P._accepts(P.load_callable(f"{f}:plain"), "name")
    assert P.load_callable("experiments.schema:point_id") is schema.point_id
    with pytest.raises(ValueError, match="factory must look like"):
        P.load_callable("nocolon")


def test_rows_jsonl_is_the_csvs_typed_twin(tmp_path):
    """Every appended row also lands in rows.jsonl beside the CSV, as typed JSON (ints, floats, bools, null,
    settings as an object), and the committed results' rows.jsonl files are up to date with their CSVs."""
    import json
    from pathlib import Path

    csv_path = tmp_path / "s" / "results.csv"
    schema.append_row(csv_path, dict(sweep="s", point="p1", system="megatrain", status="ok", hardware="H200",
                                     num_params=3085938688, tflops=425.7, emulated=False, blocks_kept=36,
                                     settings='{"recompute": "auto"}'))
    schema.append_row(csv_path, dict(sweep="s", point="p2", system="zero3", status="timeout", hardware="H200",
                                     reason="budget_cut"))
    rows = [json.loads(l) for l in (tmp_path / "s" / "rows.jsonl").read_text().splitlines()]
    assert [r["point"] for r in rows] == ["p1", "p2"] and list(rows[0]) == schema.COLUMNS
    a, b = rows
    assert a["num_params"] == 3085938688 and isinstance(a["num_params"], int) and a["tflops"] == 425.7
    assert a["emulated"] is False and a["blocks_kept"] == 36 and a["settings"] == {"recompute": "auto"}
    assert b["tflops"] is None and b["reason"] == "budget_cut" and b["settings"] is None
    root = Path(__file__).resolve().parents[1] / "results"
    stale = [str(p) for p in sorted(root.glob("*/results.csv"))
             if (p.parent / "rows.jsonl").read_text() != "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                                  for r in schema.jsonl_records(p))]
    assert not stale, f"rows.jsonl out of date (python -m experiments.schema --jsonl results/*/results.csv): {stale}"


def _phase_metrics(folder, medians, warmup_phases=None):
    """A point folder whose metrics.jsonl has one warm-up step and three timed ones (step times 1, 2, 3 s)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [dict(step=0, warmup=True, step_time_s=9.0, phases=warmup_phases or dict(cpu_groups=99.0))]
    for i, t in enumerate((1.0, 2.0, 3.0)):
        lines.append(dict(step=i + 1, warmup=False, step_time_s=t,
                          phases={k: v + (i - 1) for k, v in medians.items()}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_v3_rows_gain_the_host_update_phases_from_their_own_folder(tmp_path):
    """v3 -> v4: an ok MegaTrain row gets cpu_groups, gpu_path_groups, host_update_busy_s, optimizer_exposed_s
    as medians of its timed steps' phases, only from a folder whose timed-step median is the row's own."""
    v3 = schema.HEADERS[3]
    assert v3 == schema.COLUMNS[:-4] and v3[-1] == "schema"
    want = dict(cpu_groups=16.0, gpu_path_groups=14.0, host_update_busy_s=1.07, optimizer_exposed_s=0.81)
    _phase_metrics(tmp_path / "mine", want)
    _phase_metrics(tmp_path / "stale", want)  # its median (2.0 s) is not the row's (2.5 s)
    rows = []
    for point, median in (("mine", "2"), ("stale", "2.5"), ("none", "1")):
        cells = dict.fromkeys(v3, "") | dict(point=point, status="ok", schema="3", step_time_median_s=median)
        rows.append(",".join(cells[c] for c in v3))
    csv_path = tmp_path / "results.csv"
    csv_path.write_text(",".join(v3) + "\n" + "\n".join(rows) + "\n")
    df = schema.read_results(csv_path).set_index("point")
    for k, v in want.items():
        assert df.loc["mine", k] == pytest.approx(v), k
    assert df.loc[["stale", "none"], list(want)].isna().all().all()
    assert schema.upgrade_csv(csv_path) == 3 and schema.read_header(csv_path) == schema.COLUMNS
    assert schema.jsonl_records(csv_path)[0]["gpu_path_groups"] == 14.0


def test_summarize_gives_the_host_update_phases_of_the_timed_steps():
    """The runner's row: medians over the timed steps (warm-up excluded) of MegaTrain's phases; nothing for a
    system without them."""
    recs = [dict(warmup=True, step_time_s=5.0, loss=3.0, phases=dict(cpu_groups=30, optimizer_exposed_s=9.0))]
    recs += [dict(warmup=False, step_time_s=t, loss=2.0, phases=dict(cpu_groups=c, gpu_path_groups=30 - c,
                                                                        host_update_busy_s=b, optimizer_exposed_s=e))
             for t, c, b, e in ((2.0, 15, 1.0, 0.8), (2.1, 16, 1.2, 0.9), (1.9, 17, 1.1, 0.7))]
    from experiments.sweeps import Job

    pt = Job(id="p", sweep="s", system="megatrain", variant="default", model="m", width=1.0,
             spec={"num_layers": 2, "hidden_size": 4}, num_params=1000, seq_len=8, batch_size=2, micro_batches=1,
             hardware={"peak_tflops": 100.0}, options={})
    m = P.summarize(recs, pt)
    assert (m["cpu_groups"], m["gpu_path_groups"], m["host_update_busy_s"], m["optimizer_exposed_s"]) == (16, 14, 1.1, 0.8)
    plain = P.summarize([{k: v for k, v in r.items() if k != "phases"} for r in recs], pt)
    assert not set(schema.PHASE_COLUMNS) & set(plain)


def test_a_budget_cut_does_not_hide_an_earlier_measurement(tmp_path):
    """Readers keep the last row per point, but a budget cut (the run's time budget stopped the point: nothing
    measured) leaves an earlier ok row of the point in place; a real failure after it still wins, and the
    runner's point_status still sees the cut (a rerun retries it)."""
    path = tmp_path / "results.csv"
    rows = [dict(point="a", status="ok", git_sha="old", tflops=275.0, step_time_median_s=1.0),
            dict(point="a", status="timeout", reason="budget_cut", git_sha="new"),
            dict(point="b", status="ok", git_sha="old", tflops=100.0, step_time_median_s=1.0),
            dict(point="b", status="timeout", git_sha="new"),  # its own timeout: a failure, it wins
            dict(point="c", status="timeout", reason="budget_cut", git_sha="new")]  # nothing measured ever
    for r in rows:
        schema.append_row(path, schema.make_row(sweep="s", system="megatrain", hardware="H200", **r))
    df = schema.latest(schema.read_results(path)).set_index("point")
    assert (df.loc["a", "status"], df.loc["a", "git_sha"], df.loc["a", "tflops"]) == ("ok", "old", 275.0)
    assert (df.loc["b", "status"], df.loc["c", "status"]) == ("timeout", "timeout")
    frames, _ = schema.load_results(tmp_path.parent, sweeps=[tmp_path.name], log=lambda *a: None)
    assert frames[tmp_path.name].set_index("point").loc["a", "status"] == "ok"
    assert schema.point_status(path) == {"a": "timeout", "b": "timeout", "c": "timeout"}


def test_mfu_is_filled_only_from_the_rows_own_gpu_peak():
    """A row without a peak gets its GPU's measured one (an old H200 CSV: 797.5) -- never another GPU's: an H100
    row (no measured peak) and a CPU row keep no MFU; a row's own peak_tflops wins."""
    import pandas as pd

    df = pd.DataFrame([
        dict(status="ok", tflops=400.0, step_time_median_s=1.0, mfu=None, peak_tflops=None, hardware="H200",
             gpu_name="NVIDIA H200"),
        dict(status="ok", tflops=300.0, step_time_median_s=1.0, mfu=None, peak_tflops=None,
             hardware="H100-80GB-HBM3", gpu_name="NVIDIA H100 80GB HBM3"),
        dict(status="ok", tflops=1.0, step_time_median_s=1.0, mfu=None, peak_tflops=None, hardware="cpu",
             gpu_name=None),
        dict(status="ok", tflops=100.0, step_time_median_s=1.0, mfu=None, peak_tflops=312.0, hardware="A100-80GB",
             gpu_name="NVIDIA H200"),
    ])
    schema.fill_derived(df)
    assert df.loc[0, "mfu"] == pytest.approx(400.0 / schema.H200_PEAK_TFLOPS)
    assert pd.isna(df.loc[1, "mfu"]) and pd.isna(df.loc[2, "mfu"])
    assert df.loc[3, "mfu"] == pytest.approx(100.0 / 312.0)
    assert schema.peak_tflops_for("NVIDIA H100 80GB HBM3") is None
