"""analysis.same_run: issue 24's one table per shape -- every system against MegaTrain tiered, with its costs,
and marks for what makes a ratio weaker (another call, not exact AdamW, a partial row)."""
from __future__ import annotations

import json

from analysis.report import build_report
from experiments import schema

P, L, H, S, B = 3085938688, 36, 2048, 1024, 16
T = S * B
FLOPS = 6 * P * T + 12 * L * H * S * T


def _row(system, step, variant="default", sha="c5fdcd8", date="2026-12-04T20:52:00", **kw):
    point = f"{system}__qwen2.5-3b__L36__w1__s1024__b16__{variant}__H200"
    base = dict(sweep="baselines2026", point=point, system=system, variant=variant, status="ok", model="qwen2.5-3b",
                num_params=P, num_layers=L, hidden_size=H, seq_len=S, batch_size=B, tokens_per_step=T,
                hardware="H200", gpu_name="NVIDIA H200", git_sha=sha, date=date, timed_steps=6,
                step_time_median_s=step, step_time_mean_s=step, step_time_min_s=step * 0.99,
                step_time_max_s=step * 1.01, tflops=FLOPS / step / 1e12, host_peak_rss_gib=P * 12 / 2**30,
                host_bytes_per_param=12.0, gpu_peak_reserved_gib=20.0)
    return base | kw


def test_every_system_against_megatrain_with_its_marks(tmp_path):
    rows = [
        _row("megatrain", 0.75, gpu_tier_layers=36, blocks=36, blocks_kept=36),
        _row("native", 0.82, settings=json.dumps({"auto_config": {"winner": "no_ckpt/mb1"}})),
        _row("zero3", 3.0),
        _row("zenflow", 2.0, step_time_mean_s=4.0, settings=json.dumps({"topk_ratio": 0.05, "update_interval": 4})),
        _row("superoffload", 9.0, sha="dae4494", reason="partial", timed_steps=7,
             error="partial: 7 of 8 timed steps finished before the point process exceeded 200s"),
        _row("fsdp", 1.0, status="host_oom", tflops=None, step_time_median_s=None, step_time_mean_s=None,
             step_time_min_s=None, step_time_max_s=None, timed_steps=None),
    ]
    for r in rows:
        schema.append_row(tmp_path / "baselines2026" / "results.csv", r)
    text, errors = build_report(tmp_path, out_path=tmp_path / "REPORT.md", log=lambda *a: None)
    assert not errors
    head = "#### baselines2026: qwen2.5-3b, 16×1024 tokens per step, every system against MegaTrain"
    assert head in text
    table = text[text.index(head):].split("\n\n")[1].splitlines()
    names = [line.split(" | ")[0].lstrip("| ") for line in table[2:]]
    assert names == ["MegaTrain", "All-on-GPU", "ZeRO-3", "ZenFlow", "SuperOffload", "FSDP2"]  # fastest first
    mt, native, z3, zen, so, fsdp = table[2:]
    ref = FLOPS / 0.75 / 1e12
    assert f"| {ref:.1f} (" in mt and "| 1.00× |" in mt and "36/36 layers on the GPU tier, 36/36 blocks kept" in mt
    assert f"| {0.75 / 0.82:.2f}× |" in native and "best of probe: no_ckpt/mb1" in native
    assert f"| {0.75 / 3.0:.2f}× |" in z3 and "| 12.0 |" in z3 and "‡" not in z3
    # ZenFlow by its mean step (4.0 s, not the 2.0 s median), marked, its staleness settings named
    assert f"| {FLOPS / 4.0 / 1e12:.1f}§ |" in zen and f"| {0.75 / 4.0:.2f}× |" in zen
    assert "not exact AdamW: topk_ratio 0.05, update_interval 4" in zen
    assert f"| {FLOPS / 9.0 / 1e12:.1f}◊ (" in so and "| dae4494 ‡ |" in so  # partial, and another call
    assert "*host OOM*" in fsdp and "| — |" in fsdp


def test_no_table_without_a_megatrain_row(tmp_path):
    schema.append_row(tmp_path / "baselines2026" / "results.csv", _row("zero3", 3.0))
    text, _ = build_report(tmp_path, out_path=tmp_path / "REPORT.md", log=lambda *a: None)
    assert "every system against MegaTrain" not in text


def test_a_machine_folder_gets_its_own_table(tmp_path):
    """Rows of another machine live in their own folder (baselines2026_h100): it gets its table too, titled by it."""
    for r in (_row("megatrain", 0.9), _row("zero3", 3.6)):
        r = r | dict(point=r["point"].replace("H200", "H100-80GB-HBM3"), hardware="H100-80GB-HBM3",
                     gpu_name="NVIDIA H100 80GB HBM3")
        schema.append_row(tmp_path / "baselines2026_h100" / "results.csv", r)
    text, _ = build_report(tmp_path, out_path=tmp_path / "REPORT.md", log=lambda *a: None)
    head = "#### baselines2026_h100: qwen2.5-3b, 16×1024 tokens per step, every system against MegaTrain"
    assert head in text
    assert "| ZeRO-3 | " in text[text.index(head):] and "| 0.25× |" in text[text.index(head):]


def test_the_figure_draws_the_tables_numbers_fastest_first(tmp_path):
    """baselines2026 and its machine folders are drawn by analysis.fig_same_run: one panel per shape, bars fastest
    first with the table's value and ratio written at each bar's end (§ for ZenFlow by its mean step, ‡ another
    call), a failed point as its reason; a shape without MegaTrain gets values, no ratios."""
    import matplotlib

    matplotlib.use("Agg")
    from analysis import figures
    from analysis.report import load_results

    rows = [_row("megatrain", 0.75), _row("native", 0.82), _row("zero3", 3.0, sha="dae4494"),
            _row("zenflow", 2.0, step_time_mean_s=4.0),
            _row("fsdp", 1.0, status="host_oom", tflops=None, step_time_median_s=None, step_time_mean_s=None),
            _row("zenflow", 6.0, tokens_per_step=4 * T, batch_size=64, variant="b64")]
    for r in rows:
        schema.append_row(tmp_path / "baselines2026_h100" / "results.csv", r)
    frames, _ = load_results(tmp_path, log=lambda *a: None)  # as the figures get them
    df = frames["baselines2026_h100"]
    for sweep in ("baselines2026", "baselines2026_h100", "activations", "activations_mb8"):
        (name, fn_), = figures.figures_for(sweep)
        assert name == sweep and "fig_same_run" in fn_.__code__.co_names
    assert "fig_same_run" not in figures.figures_for("baselines2026x")[0][1].__code__.co_names
    (name, fn), = figures.figures_for("baselines2026_h100")
    fig_texts = []
    import analysis.fig_same_run as F

    orig = F._finish

    def capture(fig, df_, title, note, out, name_, formats, **kw):
        fig_texts.append([t.get_text() for ax in fig.axes for t in ax.texts])
        fig_texts.append([ax.get_title(loc="left") for ax in fig.axes])
        fig_texts.append([[x.get_text() for x in ax.get_yticklabels()] for ax in fig.axes])
        return orig(fig, df_, title, note, out, name_, formats, **kw)

    F._finish = capture
    try:
        paths = fn(df, tmp_path / "plots", ["png"])
    finally:
        F._finish = orig
    assert [p.name for p in paths] == ["baselines2026_h100.png"] and paths[0].stat().st_size > 10_000
    texts, titles, ticks = fig_texts
    assert ticks[0] == ["MegaTrain", "All-on-GPU", "ZeRO-3", "ZenFlow", "FSDP2"]  # fastest first, failure last
    ref = FLOPS / 0.75 / 1e12
    assert f"{ref:.1f}   1.00×" in texts
    assert f"{FLOPS / 4.0 / 1e12:.1f}§   {0.75 / 4.0:.2f}×" in texts  # ZenFlow by its mean step
    assert f"{FLOPS / 3.0 / 1e12:.1f}   {0.75 / 3.0:.2f}×  ‡ dae4494" in texts  # another call, named
    assert "× host OOM" in texts
    assert "no MegaTrain row at this shape" in titles[1] and ticks[1] == ["ZenFlow · b64"]
