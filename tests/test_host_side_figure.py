"""The host_side figure: three panels (CPU cores, host link, host RAM cap) from the committed H200 rows
and from altered copies of them (only some profiles, no ok rows, a CPU smoke). No GPU, no torch."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from analysis import fig_host_side, figures  # noqa: E402
from experiments import schema  # noqa: E402

# a frozen copy of the H200 rows of 2026-12-01 (results/host_side/results.csv may be re-measured). The
# figure reads nothing but these rows: no file beside them, no fact of a machine written in its code.
CSV = ROOT / "tests" / "data" / "host_side_h200_2026-12-01.csv"


@pytest.fixture
def rows():
    return schema.read_results(CSV)


@pytest.fixture
def captured(monkeypatch):
    """The figure handed to ``_finish`` (which closes it after saving): its axes stay inspectable."""
    figs = []
    orig = fig_host_side._finish

    def spy(fig, *a, **k):
        figs.append(fig)
        return orig(fig, *a, **k)

    monkeypatch.setattr(fig_host_side, "_finish", spy)
    return figs


def _draw(df, tmp_path, captured):
    paths = figures.fig_host_side(df, tmp_path, ("png",))
    assert [p.name for p in paths] == ["host_side.png"]
    assert paths[0].exists() and paths[0].stat().st_size > 0
    (fig,) = captured
    axes = fig.axes[:3]
    assert [a.get_xlabel().split(" (")[0] for a in axes] == ["CPU cores", "host link", "host RAM cap"]
    return axes


def _texts(ax):
    """The panel's texts as read (a reason drawn on two lines reads as one)."""
    return [t.get_text().replace("\n", " ") for t in ax.texts]


def _xs(ax, marker=None):
    """x values of the lines drawn on ``ax`` (only those with ``marker`` if given)."""
    return {round(float(x), 1) for l in ax.get_lines() if marker is None or l.get_marker() == marker
            for x in l.get_xdata()}


def test_registered():
    assert figures.FIGURES["host_side"] == [("host_side", figures.fig_host_side)]
    assert figures.figures_for("host_side") == [("host_side", figures.fig_host_side)]


def test_panels_x_values_ratios_and_skip_marks(rows, tmp_path, captured):
    cores, link, ram = _draw(rows, tmp_path, captured)
    assert {4.0, 8.0, 16.0} <= set(cores.get_xticks()) and _xs(cores) >= {4.0, 16.0}
    lx = sorted(link.get_xticks())
    # no row measures the real link: the real host stands one log2 step right of the profiles, and says so
    assert lx == [16.0, 32.0, 64.0]
    assert link.get_xticklabels()[-1].get_text() == "real host\n(host link\nnot measured)"
    assert set(ram.get_xticks()) == {64.0, 96.0, 125.8}
    assert cores.get_ylabel() == "training throughput (TFLOPS)"
    # the real host is the right-most point of every panel
    for ax in (cores, link, ram):
        assert "real host" in ax.get_xticklabels()[-1].get_text()
    # values with their ratio to the same series on the real host
    assert "162 (0.60×)" in _texts(cores) and "272 (1.00×)" in _texts(cores)
    assert "227 (0.83×)" in _texts(link)
    # the skipped host-RAM rows: an × at 64 and 96 GiB with the RAM the plan needs
    assert {64.0, 96.0} <= _xs(ram, marker="x")
    assert _texts(ram).count("skip: needs 102.6 GiB") == 2 and "skip: needs 88.9 GiB" in _texts(ram)
    # the 8-core 7B point was stopped by the run's time budget, not by its own timeout
    assert 8.0 in _xs(cores, marker="x") and "budget cut" in _texts(cores) and "timeout" not in _texts(cores)


def test_real_host_facts_come_from_rows_or_say_not_measured(rows, tmp_path, captured):
    """The real host's cores and RAM are the rows' own fields (16 cores, 125.8 GiB on the H200 rows); where
    no row records them the figure says "not measured" instead of writing in a machine's numbers, and the
    real host still stands right of the profiles. The module holds no machine's facts."""
    import inspect

    src = inspect.getsource(fig_host_side)
    assert "55.0" not in src and "H200" not in src and "result.json" not in src and "import json" not in src
    _draw(rows, tmp_path, captured)
    (fig,) = captured
    foot = " ".join(t.get_text() for t in fig.texts)
    assert "Real host (H200): 16 CPU cores, host link not measured in these rows, 126 GiB RAM." in foot, foot
    captured.clear()
    blank = rows.assign(cpu_cores=float("nan"), host_ram_gib=rows["host_ram_gib"].where(rows["emulated"]))
    cores, link, ram = _draw(blank, tmp_path, captured)
    assert cores.get_xticklabels()[-1].get_text() == "real host\n(CPU cores\nnot measured)"
    assert sorted(cores.get_xticks()) == [4.0, 8.0, 16.0]  # 2 x 8: the profiles' largest, one step right
    assert ram.get_xticklabels()[-1].get_text() == "real host\n(host RAM\nnot measured)"
    assert sorted(ram.get_xticks()) == [64.0, 96.0, 192.0]
    (fig,) = captured
    foot = " ".join(t.get_text() for t in fig.texts)
    assert ("CPU cores not measured in these rows, host link not measured in these rows, "
            "host RAM not measured in these rows") in foot, foot


def test_only_some_profiles(rows, tmp_path, captured):
    part = rows[rows["hardware"].isin(["H200", "cores-4"])]
    cores, link, ram = _draw(part, tmp_path, captured)
    assert set(cores.get_xticks()) == {4.0, 16.0}
    assert len(link.get_xticks()) == 1 and set(ram.get_xticks()) == {125.8}


def test_no_ok_rows_does_not_crash(rows, tmp_path, captured):
    bad = rows.assign(status="skipped", tflops=float("nan"), tokens_per_s=float("nan"), settings="", cpu_cores=float("nan"),
                      error="prose is not read", reason="host_memory", need_host_gib=200.0, have_host_gib=125.0)
    cores, link, ram = _draw(bad, tmp_path, captured)
    assert any("no successful runs" in t for t in _texts(cores))
    assert "skip: needs 200.0 GiB" in _texts(ram)
    assert {4.0, 8.0, 16.0} <= _xs(cores, marker="x")  # cores from the profile name; real host: cores of the others


def test_failures_without_an_x_value_or_a_known_profile(rows, tmp_path, captured):
    weird = rows.head(4).assign(hardware=["realbox", "mystery", "cores-4", "host-big"],
                                emulated=[False, True, True, True], status=["error", "error", "ok", "error"],
                                tflops=float("nan"), tokens_per_s=float("nan"), settings="", cpu_cores=float("nan"),
                                host_ram_gib=float("nan"))
    cores, link, ram = _draw(weird, tmp_path, captured)
    # the real host's cores, link and RAM are unknown here: its × stands right of each panel's profiles
    # (cores: 2 x 4; link and RAM: no profile with a value, 1), labelled "not measured"
    assert 8.0 in _xs(cores, marker="x") and 1.0 in _xs(link, marker="x") and 1.0 in _xs(ram, marker="x")
    assert all(ax.get_xticklabels()[-1].get_text().endswith("not measured)") for ax in (cores, link, ram))
    # a profile whose value no field nor name gives is listed in its panel instead of dropped
    assert any(t.startswith("× without an x value") and "host-big" in t for t in _texts(ram))
    assert "no value" in _texts(cores)  # an ok row without a throughput: an × at 4 cores
    assert 4.0 in _xs(cores, marker="x")
    (fig,) = captured
    assert "not drawn (unknown profile): mystery" in " ".join(t.get_text() for t in fig.texts)


def test_cpu_smoke_falls_back_to_tokens_per_s(rows, tmp_path, captured):
    cpu = rows.assign(tflops=float("nan"), mfu=float("nan"))
    cores, _, _ = _draw(cpu, tmp_path, captured)
    assert cores.get_ylabel() == "training throughput (tokens/s)"
    assert any(t.startswith("1,769 (0.60×)") for t in _texts(cores))


def test_a_ratio_across_code_versions_is_marked(rows, tmp_path, captured):
    """A point measured by another commit than its series' real-host row: its ratio gets a double dagger
    (‡; the report's † means not at steady state), and the footnote names both commits; points of the same
    commit stay unmarked."""
    moved = rows.copy()
    moved.loc[moved["hardware"] == "link-16GBps", "git_sha"] = "eeec94db1735abc552ba705b6ba4d8843672d8db"
    cores, link, _ = _draw(moved, tmp_path, captured)
    assert "227 (0.83×‡)" in _texts(link), _texts(link)
    assert "162 (0.60×)" in _texts(cores)  # same commit as the real host: no mark
    (fig,) = captured
    foot = " ".join(t.get_text() for t in fig.texts)
    assert "‡ ratio across code versions" in foot and "eeec94d vs 525281e" in foot, foot


def test_same_commit_everywhere_has_no_double_dagger(rows, tmp_path, captured):
    cores, link, ram = _draw(rows, tmp_path, captured)
    assert not any("‡" in t for ax in (cores, link, ram) for t in _texts(ax))
    (fig,) = captured
    assert "code versions" not in " ".join(t.get_text() for t in fig.texts)
