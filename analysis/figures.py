"""The figures, one function per sweep (``FIGURES``), and a generic one for a sweep that has none:
a new sweep shows up without editing this file. Each takes the sweep's rows (``experiments.schema``)
and writes ``<out>/<name>.<format>``."""
from __future__ import annotations

import math

import pandas as pd

from . import same_run, update_path
from .fig_host_side import fig_host_side
from .fig_same_run import fig_same_run
from .fig_update_path import fig_update_path
from experiments.schema import fill_x_from_point
from .style import (ADAM_BYTES_PER_PARAM, FORMULA_NOTE, HARDWARE_ORDER, SWEEPS, TB_1_5_GIB, fmt_params, fmt_tokens,
                    on_cpu, record, row_settings, status_short, system_label, variant_label, _fail_handle, _finish,
                    _legend, _line_panel, _log2_ticks, _mark_failures, _mfu_axis, _new_figure, _ordered_systems,
                    _safe_max, _series_key, _style)



SETUP_HATCHES = ("", "//", "..", "xx")  # the ablation figure: one hatching per setup

def _system_bars(ax, df, ycol: str, ylabel: str, fmt: str = "{:,.0f}"):
    """One bar per system (value of ``ycol`` of its ok row); failed systems get an × and their status."""
    systems = _ordered_systems(df)
    top = _safe_max(df.loc[df["status"] == "ok", ycol])
    for i, s in enumerate(systems):
        label, color, _ = _style(s, df)
        rows = df[df["system"] == s]
        r = rows[rows["status"] == "ok"]
        if not r.empty and pd.notna(r[ycol].iloc[0]):
            v = float(r[ycol].iloc[0])
            ax.bar(i, v, color=color, width=0.65, zorder=3)
            ax.annotate(fmt.format(v), (i, v), xytext=(0, 3), textcoords="offset points", ha="center",
                        fontsize=8)
        else:
            st = status_short(rows.iloc[0]) if not rows.empty else "?"
            ax.plot([i], [top * 0.04], marker="x", color=color, ms=10, mew=2.5, zorder=4)
            ax.annotate(st, (i, top * 0.04), xytext=(0, 8), textcoords="offset points",
                        ha="center", fontsize=8, color=color, fontweight="bold")
    ax.set_xticks(list(range(len(systems))))
    ax.set_xticklabels([system_label(s, df, short=True) for s in systems])
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("system")
    ax.grid(axis="x", visible=False)


def fig_smoke(df, out, formats):
    fig, (ax,) = _new_figure(width=6.4, height=4.2)
    _system_bars(ax, df, "tokens_per_s", "throughput (tokens/s)")
    models = ", ".join(dict.fromkeys(df["model"].astype(str)))
    ax.set_title(f"model {models}; × = failed / not run", fontsize=9.5)
    return _finish(fig, df, "Smoke test: training throughput per system",
                   "tokens/s = tokens per step / median step time (after warm-up).", out, "smoke_tokens_per_s",
                   formats)


def fig_baselines(df, out, formats):
    """The five systems side by side on one model and batch (issue: baselines table)."""
    fig, axes = _new_figure(ncols=3, width=13.5, height=4.4)
    _system_bars(axes[0], df, "tflops", "training throughput (TFLOPS)", "{:.0f}")
    _system_bars(axes[1], df, "gpu_peak_allocated_gib", "GPU peak allocated (GiB)", "{:.1f}")
    _system_bars(axes[2], df, "host_peak_rss_gib", "host peak RSS (GiB)", "{:.1f}")
    models = ", ".join(dict.fromkeys(df["model"].astype(str)))
    shape = ", ".join(dict.fromkeys(f"{int(b)}×{int(s)}" for b, s in zip(df["batch_size"], df["seq_len"])))
    axes[0].set_title(f"model {models}, batch {shape}", fontsize=9.5)
    return _finish(fig, df, "All systems side by side", FORMULA_NOTE, out, "baselines", formats)


def fig_size_throughput(df, out, formats):
    df = df.copy()
    df["params_b"] = fill_x_from_point(df, "num_params") / 1e9
    fig, (ax,) = _new_figure(width=7.6, height=5.0)
    _line_panel(ax, df, "params_b", "tflops", "training throughput (TFLOPS)")
    for system in ("megatrain", "zero3"):  # the paper's GH200 values beside ours, at our models' sizes
        _paper_curve(ax, "size", system, snap_to=set(df["params_b"].dropna()))
    ax.set_xscale("log")
    _params_ticks(ax, df["params_b"])
    ax.set_xlabel("model size (billion parameters, log scale)")
    _mfu_axis(ax, df)
    _legend(ax, [_fail_handle()])
    return _finish(fig, df, "Throughput vs model size (size sweep)", FORMULA_NOTE, out, "size_throughput", formats)


def _params_ticks(ax, params_b):
    vals = sorted({float(v) for v in params_b.dropna()})
    if vals:
        ax.set_xticks(vals)
        ax.set_xticklabels([fmt_params(v * 1e9) for v in vals], rotation=0)
        ax.minorticks_off()
        ax.set_xlim(vals[0] / 1.3, vals[-1] * 1.45)


def _engine_bytes_per_param(df) -> float | None:
    m = df[df["system"] == "megatrain"]
    bpp = m["host_bytes_per_param"].dropna()
    if bpp.empty:
        ratio = (m["host_estimate_gib"] * 2**30 / m["num_params"]).dropna()
        bpp = ratio
    return float(bpp.median()) if not bpp.empty else None


def _host_memory_panel(ax, df, xcol, *, show_12=True, show_lines=True):
    """Host peak RSS per system (log y), engine estimates, 12 B/param, host RAM and 1.5 TB lines."""
    df = df.copy()
    df[xcol] = fill_x_from_point(df, xcol)
    ok = df[(df["status"] == "ok") & df["host_peak_rss_gib"].notna()]
    systems = _ordered_systems(df)
    ymax = [float(ok["host_peak_rss_gib"].max()) if not ok.empty else 1.0]
    ymin = [float(ok["host_peak_rss_gib"].min()) if not ok.empty else 1.0]
    keys = ok.apply(_series_key, axis=1) if not ok.empty else pd.Series(dtype=str)
    for key in dict.fromkeys(keys):  # one measured line per system and variant (variants dashed)
        s, _, variant = key.partition(":")
        label, color, marker = _style(s, df)
        part = ok[keys == key].sort_values(xcol)
        ax.plot(part[xcol], part["host_peak_rss_gib"], marker=marker, color=color, lw=1.8, ms=6,
                ls="--" if variant else "-", zorder=3,
                label=f"{system_label(s, df, short=True)}{f' ({variant})' if variant else ''}: peak RSS (measured)")
    for s in systems:
        label, color, marker = _style(s, df)
        est = df[(df["system"] == s) & df["host_estimate_gib"].notna()
                 & df["variant"].isin(["default", "full", ""])].sort_values(xcol)
        if not est.empty:
            ax.plot(est[xcol], est["host_estimate_gib"], marker=marker, mfc="white", color=color, lw=1,
                    ls=":", ms=7, label=f"{system_label(s, df, short=True)}: engine estimate",
                    zorder=2)
            ymax.append(float(est["host_estimate_gib"].max()))
            ymin.append(float(est["host_estimate_gib"].min()))
    pcol = fill_x_from_point(df, "num_params")
    if show_12 and pcol.notna().any():
        line = df.assign(_p=pcol).dropna(subset=["_p"]).groupby(xcol)["_p"].first().sort_index()
        y12 = line * ADAM_BYTES_PER_PARAM / 2**30
        ax.plot(line.index, y12, color="black", ls="--", lw=1.2, zorder=2,
                label="12 B/param (fp32 master + Adam m, v)")
        ymin.append(float(y12.min()))
        ymax.append(float(y12.max()))
    host_ram = df["host_ram_gib"].dropna()
    ax.set_yscale("log")
    if show_lines:
        if not host_ram.empty:
            hr = float(host_ram.max())
            ax.axhline(hr, color="#E69F00", lw=1.5, ls="-.", label=f"this host's RAM ({hr:,.0f} GiB)")
            ymax.append(hr)
        ax.axhline(TB_1_5_GIB, color="#56B4E9", lw=1.5, ls="-.",
                   label=f"a 1.5 TB host, as in the paper ({TB_1_5_GIB:,.0f} GiB)")
        ymax.append(TB_1_5_GIB)
    lo, hi = min(ymin), max(ymax)
    fails = {s: df[(df["system"] == s) & (df["status"] != "ok")] for s in systems}
    fails = {s: f for s, f in fails.items() if not f.empty}
    n = len(fails)
    # leave the bottom fraction of the log axis free for the failure marks
    frac = min(0.055 * n + 0.02, 0.32) if n else 0.0
    span = math.log10(hi * 1.6) - math.log10(lo / 1.3)
    lo_ax = 10 ** (math.log10(lo / 1.3) - span * frac / max(1 - frac, 0.1))
    ax.set_ylim(lo_ax, hi * 1.6)
    if n:
        ax.axhspan(lo_ax, 10 ** (math.log10(lo_ax) + (math.log10(hi * 1.6) - math.log10(lo_ax)) * frac),
                   color="#f0f0f0", zorder=0, lw=0)
        _mark_failures(ax, fails, xcol, systems)
    ax.set_ylabel("host memory (GiB, log scale)")
    return host_ram


def fig_size_host_memory(df, out, formats):
    df = df.copy()
    df["params_b"] = fill_x_from_point(df, "num_params") / 1e9
    fig, (ax,) = _new_figure(width=8.4, height=5.8)
    host_ram = _host_memory_panel(ax, df, "params_b")
    ax.set_xscale("log")
    _params_ticks(ax, df["params_b"])
    ax.set_xlabel("model size (billion parameters, log scale)")
    bpp = _engine_bytes_per_param(df)
    notes = []
    if bpp:
        import matplotlib.transforms as mtransforms  # noqa: PLC0415
        trans = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
        for cap, name, color in ((TB_1_5_GIB, "1.5 TB host", "#56B4E9"),
                                 (float(host_ram.max()) if not host_ram.empty else None, "this host", "#E69F00")):
            if not cap:
                continue
            pmax = cap * 2**30 / bpp / 1e9
            lo, hi = ax.get_xlim()
            if lo < pmax < hi:
                ax.axvline(pmax, color=color, lw=1, ls=":")
                ax.annotate(f"{name}: ≤{pmax:,.0f}B", (pmax, 0.97), xycoords=trans, xytext=(-3, 0),
                            textcoords="offset points", rotation=90, ha="right", va="top", fontsize=7.5,
                            color=color, bbox=dict(fc="white", ec="none", alpha=0.85, pad=1))
            notes.append(f"{name} ({cap:,.0f} GiB) fits MegaTrain models up to ≈{pmax:,.0f}B params")
        floor = TB_1_5_GIB * 2**30 / ADAM_BYTES_PER_PARAM / 1e9
        notes = [f"At the engine's median {bpp:.1f} host bytes/param: " + "; ".join(notes) +
                 f". The 12 B/param floor alone would allow ≈{floor:,.0f}B in 1.5 TB."]
    _legend(ax, [_fail_handle()], fontsize=7.5)
    note = "\n".join(notes + ["Host memory = peak resident set size of the training process "
                              "(pinned buffers included); hollow markers = engine's own estimate, drawn for "
                              "skipped points too."])
    return _finish(fig, df, "Host memory vs model size (size sweep)", note, out, "size_host_memory", formats)


def _snap(x: float, ours, tol: float = 0.15) -> float:
    """Our nearest x within ``tol`` of the paper's nominal x (the paper's "7B" is the 7.6B Qwen2.5-7B)."""
    near = [v for v in ours if pd.notna(v) and abs(v - x) <= tol * x]
    return min(near, key=lambda v: abs(v - x)) if near else x


def _paper_curve(ax, sweep: str, system: str = "megatrain", snap_to=()) -> list[float]:
    """The paper's TFLOPS of ``system`` along the sweep (analysis/data/paper_claims.yaml) as a dotted
    line with hollow markers (grey for MegaTrain, the system's colour otherwise), each x moved to the nearest
    of ``snap_to`` within 15 %; the y range grows to show it. Returns its x values (for the ticks)."""
    from .claims import paper_points

    pts, hw = paper_points(sweep, system=system)
    if not pts:
        return []
    pts = {_snap(x, snap_to): v for x, v in pts.items()}
    xs = sorted(pts)
    who = record(system).short
    color = "#555555" if system == "megatrain" else _style(system)[1]
    ax.plot(xs, [pts[x] for x in xs], ls=":", lw=1.6, color=color, marker="D", mfc="white", ms=6, zorder=2,
            label=f"paper: {who} on a {hw}" if hw else f"paper: {who}")
    lo, hi = ax.get_ylim()
    new_hi = max(hi, 1.12 * max(pts.values()))
    if new_hi > hi and ax.get_yscale() == "linear":
        from matplotlib.ticker import MaxNLocator  # noqa: PLC0415
        ax.set_yticks([t for t in MaxNLocator(nbins=6).tick_values(0.0, new_hi) if 0.0 <= t <= new_hi])
    ax.set_ylim(lo, new_hi)
    return xs


def _throughput_pair(df, xcol, sweep: str = "", ratios: tuple = (1, 1)):
    """One panel per entry of ``ratios`` (their relative widths); the left one: throughput over ``xcol``
    (the paper's curve beside ours) with an MFU axis and the legend. Returns the figure and the axes."""
    fig, axes = _new_figure(ncols=len(ratios), width=5.75 * sum(ratios), height=5.0,
                            gridspec_kw={"width_ratios": list(ratios)})
    ax1 = axes[0]
    _line_panel(ax1, df, xcol, "tflops", "training throughput (TFLOPS)")
    ax1.paper_xs = _paper_curve(ax1, sweep)
    _mfu_axis(ax1, df)
    _legend(ax1, [_fail_handle()], fontsize=7.5)
    return (fig, *axes)


def fig_depth(df, out, formats):
    """Throughput, GPU memory (the paper's point: flat with depth when every layer streams) and host memory
    per depth; variants (e.g. pure_streaming) are dashed series of their own."""
    fig, ax1, ax_gpu, ax2 = _throughput_pair(df, "num_layers", "depth", ratios=(1, 0.75, 1.4))
    _line_panel(ax_gpu, df, "num_layers", "gpu_peak_allocated_gib",
                "GPU peak allocated (GiB)", band=False)
    ax_gpu.set_ylim(0, max(ax_gpu.get_ylim()[1], 1.0) * 1.12)
    _legend(ax_gpu, fontsize=7, ncol=1)
    _host_memory_panel(ax2, df, "num_layers")
    _legend(ax2, fontsize=7)
    for ax in (ax1, ax_gpu, ax2):
        _layer_ticks(ax, df)
        ax.set_xlabel("number of layers (model size; log2 scale)")
    h = ", ".join(str(int(v)) for v in df["hidden_size"].dropna().unique()[:2])
    f = ", ".join(str(int(v)) for v in df["intermediate_size"].dropna().unique()[:2])
    return _finish(fig, df, f"Depth sweep: hidden {h}, FFN {f}", FORMULA_NOTE, out, "depth", formats)


def _layer_ticks(ax, df):
    d = df.assign(_p=fill_x_from_point(df, "num_params"))
    per = d.dropna(subset=["num_layers"]).groupby("num_layers")["_p"].first().sort_index()
    if per.empty:
        return
    ax.set_xscale("log", base=2)  # 4 .. 180 layers: a linear axis piles the small depths' labels together
    ax.set_xticks(list(per.index))
    ax.set_xticklabels([f"{int(l)}\n{fmt_params(p) if pd.notna(p) else ''}" for l, p in per.items()], fontsize=7.5)
    ax.minorticks_off()
    ax.set_xlim(per.index.min() / 1.25, per.index.max() * 1.3)


def fig_width(df, out, formats):
    fig, (ax,) = _new_figure(width=7.6, height=5.0)
    _line_panel(ax, df, "width_mult", "tflops", "training throughput (TFLOPS)")
    d = df.assign(_p=fill_x_from_point(df, "num_params"))
    per = d.dropna(subset=["width_mult"]).groupby("width_mult")["_p"].first().sort_index()
    ax.set_xticks(list(per.index))
    ax.set_xticklabels([f"{w:g}×\n{fmt_params(p) if pd.notna(p) else ''}" for w, p in per.items()], fontsize=8.5)
    if len(per):
        span = per.index.max() - per.index.min()
        ax.set_xlim(per.index.min() - 0.06 * span - 0.1, per.index.max() + 0.15 * span + 0.1)
    ax.set_xlabel("width multiplier (hidden and FFN size × m; model size below)")
    _paper_curve(ax, "width")
    _mfu_axis(ax, df)
    _legend(ax, [_fail_handle()])
    return _finish(fig, df, "Throughput vs width (width sweep)", FORMULA_NOTE, out, "width", formats)


def fig_context(df, out, formats):
    fig, ax1, ax2 = _throughput_pair(df, "seq_len", "context")
    cap = df["gpu_mem_cap_gib"].dropna()
    _line_panel(ax2, df, "seq_len", "gpu_peak_allocated_gib", "GPU peak allocated memory (GiB)",
                band=True, extra_top=float(cap.max()) if not cap.empty else 0.0)
    if not cap.empty:
        ax2.axhline(float(cap.max()), color="#B00020", ls="--", lw=1.2,
                    label=f"GPU memory cap {float(cap.max()):g} GiB")
    _legend(ax2, fontsize=7.5)
    for ax in (ax1, ax2):  # the paper's lengths too, where it went further than these rows
        _log2_ticks(ax, list(fill_x_from_point(df, "seq_len")) + list(ax1.paper_xs))
        ax.set_xlabel("sequence length (tokens, log2 scale)")
    models = ", ".join(dict.fromkeys(m for m in df["model"] if m))
    return _finish(fig, df, f"Context length sweep ({models})",
                   FORMULA_NOTE + "\nGPU memory: gpu_peak_allocated_gib (peak memory allocated by PyTorch during the run).", out, "context", formats)


def knee_point(part):
    """The first point of one system's tokens curve (sorted by tokens per step) reaching 90 % of its max, or
    None when that is its last measured point: a curve still rising at its end shows no plateau to reach."""
    knee = part[part["tflops"] >= 0.9 * float(part["tflops"].max())].iloc[0]
    return None if knee.name == part.index[-1] else knee


def fig_tokens(df, out, formats):
    fig, (ax,) = _new_figure(width=7.8, height=5.0)
    info = _line_panel(ax, df, "tokens_per_step", "tflops", "training throughput (TFLOPS)")
    ok = info["ok"]
    drawn = 0  # annotations stacked downwards: two systems often share a knee
    for s in info["systems"]:
        part = ok[ok["system"] == s].sort_values("tokens_per_step")
        if part.empty:
            continue
        knee = knee_point(part)
        if knee is None:
            continue
        _, color, marker = _style(s)
        mx = float(part["tflops"].max())
        ax.plot([knee["tokens_per_step"]], [knee["tflops"]], marker="*", ms=17, color=color, mec="black",
                mew=0.8, ls="none", zorder=6)
        ax.annotate(f"knee: {fmt_tokens(knee['tokens_per_step'])} tokens\n(≥90% of max {mx:.0f})",
                    (knee["tokens_per_step"], knee["tflops"]), xytext=(10, -22 - 26 * drawn),
                    textcoords="offset points", fontsize=7.5, color=color,
                    arrowprops=dict(arrowstyle="-", color=color, lw=0.6))
        drawn += 1
    _log2_ticks(ax, fill_x_from_point(df, "tokens_per_step"))
    ax.set_xlabel("tokens per optimizer step (batch × seq len, log2 scale)")
    _mfu_axis(ax, df)
    from matplotlib.lines import Line2D  # noqa: PLC0415
    knee_h = Line2D([], [], marker="*", ms=12, color="white", mec="black", ls="none",
                    label="knee: first point reaching 90% of the system's max")
    _legend(ax, [knee_h, _fail_handle()])
    models = ", ".join(dict.fromkeys(m for m in df["model"] if m))
    return _finish(fig, df, f"Throughput vs tokens per step ({models})", FORMULA_NOTE, out, "tokens", formats)


def _bar_fail(ax, x, top, row, color, label_above: float | None = None):
    """× at the bottom of a bar's slot, its status written upwards from it (or from ``label_above``, to
    clear something drawn in the slot, e.g. the paper's value)."""
    ax.plot([x], [top * 0.03], marker="x", color=color, ms=9, mew=2.2, zorder=4)
    y, dy = (top * 0.03, 6) if label_above is None else (label_above, 16)
    ax.annotate(status_short(row), (x, y), xytext=(0, dy), textcoords="offset points",
                ha="center", va="bottom", fontsize=7, color=color, fontweight="bold", rotation=90)


def fig_hardware(df, out, formats):
    df = df.copy()
    df["_p"] = fill_x_from_point(df, "num_params")
    models = list(df.sort_values("_p")["point"].drop_duplicates()) if df["_p"].notna().any() else \
        list(dict.fromkeys(df["point"]))
    # one panel per model size
    groups = []
    for pt in models:
        g = df[df["point"] == pt]
        p = g["_p"].dropna()
        name = next((m for m in g["model"] if m), pt)
        groups.append((pt, g, f"{name} ({float(p.iloc[0]) / 1e9:.1f}B params)" if not p.empty else name))
    # merge points of the same model (point names may encode hardware)
    merged = {}
    for pt, g, label in groups:
        merged.setdefault(label, []).append(g)
    panels = [(label, pd.concat(gs)) for label, gs in merged.items()]
    fig, axes = _new_figure(ncols=len(panels), width=max(6.5, 4.6 * len(panels)), height=5.0, sharey=True)
    top = _safe_max(df.loc[df["status"] == "ok", "tflops"])
    systems = _ordered_systems(df)
    paper = _paper_hardware(df)
    for ax, (label, g) in zip(axes, panels):
        hws = [h for h in HARDWARE_ORDER if h in set(g["hardware"])] + \
              [h for h in dict.fromkeys(g["hardware"]) if h not in HARDWARE_ORDER]
        width = 0.8 / max(len(systems), 1)
        for j, s in enumerate(systems):
            _, color, _ = _style(s)
            for i, hw in enumerate(hws):
                x = i - 0.4 + width * (j + 0.5)
                r = g[(g["system"] == s) & (g["hardware"] == hw)]
                if r.empty:
                    continue
                r = r.iloc[-1]
                pv = paper.get((r["_p"], hw, s))
                if r["status"] == "ok" and pd.notna(r["tflops"]):
                    ax.bar(x, r["tflops"], width=width * 0.92, color=color, zorder=3,
                           hatch="//" if r["emulated"] else None, edgecolor="white", lw=0.5)
                    ax.annotate(f"{r['tflops']:.0f}", (x, r["tflops"]), xytext=(0, 2), textcoords="offset points",
                                ha="center", fontsize=6.5)
                else:
                    _bar_fail(ax, x, top, r, color, label_above=pv)
                if pv is not None:  # the paper's value for this system, model and GPU, on our bar's slot
                    ax.plot([x - width * 0.46, x + width * 0.46], [pv, pv], color="black", lw=2.2, zorder=5,
                            solid_capstyle="butt", label="paper")
                    ax.annotate(f"{pv:.0f}", (x, pv), xytext=(0, 2), textcoords="offset points", ha="center",
                                va="bottom", fontsize=6.5, color="black", fontweight="bold", zorder=6,
                                bbox=dict(fc="white", ec="none", alpha=0.85, pad=0.4))
        ax.set_xticks(range(len(hws)))
        emu = {h: bool(g.loc[g["hardware"] == h, "emulated"].any()) for h in hws}
        ax.set_xticklabels([f"{h}\n(emulated)" if emu[h] else f"{h}\n(real)" for h in hws], fontsize=8)
        ax.text(0.02, 0.98, label, transform=ax.transAxes, fontweight="bold", va="top", ha="left", fontsize=10)
        ax.grid(axis="x", visible=False)
        ax.set_ylim(0, top * 1.2)
        ax.set_xlabel("hardware profile")
    axes[0].set_ylabel("training throughput (TFLOPS)")
    from matplotlib.patches import Patch  # noqa: PLC0415
    handles = [Patch(color=_style(s)[1], label=system_label(s, df)) for s in systems]
    handles += [Patch(facecolor="#bbbbbb", hatch="//", edgecolor="white", label="emulated profile"),
                _fail_handle()]
    if paper:
        from matplotlib.lines import Line2D  # noqa: PLC0415
        handles.insert(-1, Line2D([], [], color="black", lw=2.2, label="the paper's value on the real GPU"))
    handles[-1].set_label("× failed / not run (reason above the mark)")

    note = (FORMULA_NOTE + "\nEmulated GPU profiles run on the H200 with the GPU memory capped to the profile's "
            "size; compute and the host link are still the H200's (a profile slows the link only where it says "
            "host_link_gbps), so absolute TFLOPS overstate the real card.")
    return _finish(fig, df, "Throughput per hardware profile", note, out, "hardware", formats,
                   fig_legend=(handles, min(len(handles), 4)))


def _paper_hardware(df) -> dict[tuple[float, str, str], float]:
    """{(num_params of our row, hardware, system): the paper's TFLOPS} for the rows of ``df`` that a paper
    value of the hardware section matches (model size within 15 %, as the claims match)."""
    from .claims import paper_hardware_points

    pts = paper_hardware_points()
    out = {}
    for p, hw, system in {(r["_p"], r["hardware"], r["system"]) for _, r in df.iterrows() if pd.notna(r["_p"])}:
        for (pb, phw, psys), v in pts.items():
            if phw == hw and psys == system and abs(p / 1e9 - pb) <= 0.15 * pb:
                out[(p, hw, system)] = v
    return out


def _streaming_tag(settings) -> str:
    """" · pure streaming" for rows whose engine settings put no layer on the GPU tier (gpu_resident 0),
    " · tiered" for rows that let the plan fill the GPU tier; nothing for rows without engine settings."""
    resident = row_settings(settings).get("gpu_resident")
    if resident is None:
        return ""
    return " · pure streaming" if str(resident) == "0" else " · tiered"


def fig_ablation(df, out, formats, name: str = "ablation"):
    """One panel: the variants as bars, "full" first, each other bar with its difference to full.
    Several setups (model × shape × hardware) become groups of bars side by side. ``name``: the sweep folder
    (another machine's ablation rows, ``ablation_<suffix>``, get a figure of their own)."""
    df = df.copy()
    df["_setup"] = (df["model"].astype(str) + " " + df["batch_size"].map(lambda v: f"{int(v)}" if pd.notna(v) else "?")
                    + "×" + df["seq_len"].map(lambda v: f"{int(v)}" if pd.notna(v) else "?") + " " + df["hardware"]
                    + df.get("settings", pd.Series("", index=df.index)).map(_streaming_tag))
    size = df.groupby("_setup")["num_params"].max().fillna(0) if "num_params" in df else {}
    setups = sorted(dict.fromkeys(df["_setup"]), key=lambda s: size.get(s, 0))  # smallest model first
    variants = list(dict.fromkeys(df["variant"]))
    variants = [v for v in variants if v == "full"] + [v for v in variants if v != "full"]
    fig, (ax,) = _new_figure(width=min(16.0, max(7.5, 0.7 * len(variants) * len(setups) + 2.5)), height=5.4)
    top = _safe_max(df.loc[df["status"] == "ok", "tflops"])
    width = 0.8 / max(len(setups), 1)
    for j, setup in enumerate(setups):
        g = df[df["_setup"] == setup]
        full = g[(g["variant"] == "full") & (g["status"] == "ok")]["tflops"]
        full_v = float(full.iloc[-1]) if not full.empty and pd.notna(full.iloc[-1]) else None
        for i, v in enumerate(variants):
            rows = g[g["variant"] == v]
            if rows.empty:
                continue
            r = rows.iloc[-1]
            x = i - 0.4 + width * (j + 0.5)
            _, color, _ = _style(r["system"], df)
            hatch = SETUP_HATCHES[j % len(SETUP_HATCHES)]  # setups told apart by hatching, not by colour
            if r["status"] == "ok" and pd.notna(r["tflops"]):
                val = float(r["tflops"])
                ax.bar(x, val, width=width * 0.9, color=color, alpha=1.0 if v == "full" else 0.55, zorder=3,
                       edgecolor="#333333" if hatch else color, hatch=hatch, lw=1.2,
                       label=setup if i == 0 and len(setups) > 1 else None)
                txt = f"{val:.1f}"
                if full_v and v != "full":
                    txt += f"\n{(val / full_v - 1) * 100:+.1f}%"
                ax.annotate(txt, (x, val), xytext=(0, 3), textcoords="offset points", ha="center",
                            fontsize=8 if len(setups) < 3 else 6.5, zorder=7,  # over the paper's tick
                            bbox=dict(fc="white", ec="none", alpha=0.8, pad=0.2))
            else:
                _bar_fail(ax, x, top, r, color)
    from .claims import paper_ablation_points

    paper = paper_ablation_points()
    for i, v in enumerate(variants):  # the paper's value for the variant: a black tick across its group
        if v not in paper:
            continue
        pv, pfull = paper[v], paper.get("full")
        ax.plot([i - 0.42, i + 0.42], [pv, pv], color="black", lw=1.6, ls="--", zorder=6,
                label="the paper (14B, GH200)" if not any(vv in paper for vv in variants[:i]) else None)
        txt = f"paper {pv:.0f}" + (f" ({(pv / pfull - 1) * 100:+.1f}%)" if pfull and v != "full" else "")
        ax.annotate(txt, (i + 0.42, pv), xytext=(2, 0), textcoords="offset points", ha="left", va="center",
                    fontsize=7, zorder=6, bbox=dict(fc="white", ec="none", alpha=0.85, pad=0.3))
    top = max(top, max((paper[v] for v in variants if v in paper), default=0.0))
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels([variant_label(v) for v in variants], fontsize=8.5)
    ax.set_ylim(0, top * 1.25)
    ax.grid(axis="x", visible=False)
    ax.set_ylabel("training throughput (TFLOPS)")
    ax.set_xlabel("MegaTrain variant (one optimisation switched off); % = difference to full")
    if len(setups) > 1 or paper:
        _legend(ax, ncol=min(4, len(setups) + bool(paper)))
    title = "Ablation: MegaTrain optimisations" + ("" if name == "ablation" else f" ({name})")
    if len(setups) == 1:  # the one setup in the title: a panel title would sit under the legend
        title += f"\n{setups[0]}"
    return _finish(fig, df, title, FORMULA_NOTE, out, name, formats)


def fig_generic(df, out, formats, name: str):
    """Any sweep without a figure of its own: throughput per system, one group per point setup."""
    df = df.copy()
    metric, unit = ("tokens_per_s", "tokens/s") if on_cpu(df) else ("tflops", "TFLOPS")
    df["_setup"] = df["point"].map(lambda p: "__".join(p.split("__")[1:]) or p)
    setups = list(dict.fromkeys(df["_setup"]))
    systems = _ordered_systems(df)
    fig, (ax,) = _new_figure(width=max(7.0, 1.0 * len(setups) * len(systems) + 2.0), height=5.0)
    top = _safe_max(df.loc[df["status"] == "ok", metric])
    width = 0.8 / max(len(systems), 1)
    for j, s in enumerate(systems):
        label, color, _ = _style(s, df)
        for i, setup in enumerate(setups):
            rows = df[(df["system"] == s) & (df["_setup"] == setup)]
            if rows.empty:
                continue
            r = rows.iloc[-1]
            x = i - 0.4 + width * (j + 0.5)
            if r["status"] == "ok" and pd.notna(r[metric]):
                # the legend names a system at its first bar, whichever setup that is
                val = float(r[metric])
                ax.bar(x, val, width=width * 0.9, color=color, zorder=3, label=label)
                ax.annotate(f"{val:,.1f}" if val < 1000 else f"{val:,.0f}", (x, val), xytext=(0, 3),
                            textcoords="offset points", ha="center", fontsize=8, zorder=7)
                label = None
            else:
                _bar_fail(ax, x, top, r, color)
    ax.set_xticks(range(len(setups)))
    ax.set_xticklabels([s.replace("__", "\n") for s in setups], fontsize=7)
    ax.set_ylim(0, top * 1.2)
    ax.set_ylabel(f"training throughput ({unit})")
    _legend(ax, [_fail_handle()])
    return _finish(fig, df, f"Sweep {name}", FORMULA_NOTE, out, name, formats)


FIGURES = {
    "smoke": [("smoke_tokens_per_s", fig_smoke)],
    "baselines": [("baselines", fig_baselines)],
    "size": [("size_throughput", fig_size_throughput), ("size_host_memory", fig_size_host_memory)],
    "depth": [("depth", fig_depth)],
    "width": [("width", fig_width)],
    "context": [("context", fig_context)],
    "hardware": [("hardware", fig_hardware)],
    "ablation": [("ablation", fig_ablation)],
    "tokens": [("tokens", fig_tokens)],
    "host_side": [("host_side", fig_host_side)],
}


FIGURES["accuracy_sft"] = []  # drawn from its point folders by analysis/sft_report.py (plots.make_plots)


def figures_for(sweep: str) -> list:
    """[(figure name, function(df, out, formats))] of a sweep: its own, or the generic one."""
    if sweep in FIGURES:
        return FIGURES[sweep]
    if sweep.startswith("ablation_"):  # another machine's ablation rows: drawn like ablation's, under their name
        return [(sweep, lambda df, out, formats, _n=sweep: fig_ablation(df, out, formats, _n))]
    if sweep.startswith("accuracy_sft_"):  # another machine's SFT rows: drawn like accuracy_sft's, by sft_report
        return FIGURES["accuracy_sft"]
    if same_run.is_sweep(sweep) or sweep == "activations" or sweep.startswith("activations_"):
        # baselines2026 (and its machine folders): the same-run table drawn; the activations sweeps (MegaTrain's
        # kept blocks against recompute-all and all-on-GPU's best) read the same way: per shape, against MegaTrain
        return [(sweep, lambda df, out, formats, _n=sweep: fig_same_run(df, out, formats, _n))]
    if update_path._is_sweep(sweep):  # update_path*: CPU path vs GPU update path per shape (the REPORT's tables)
        return [(sweep, lambda df, out, formats, _n=sweep: fig_update_path(df, out, formats, _n))]
    return [(sweep, lambda df, out, formats, _n=sweep: fig_generic(df, out, formats, _n))]


def expected_figures(sweeps=SWEEPS) -> list[str]:
    return [name for s in sweeps for name, _ in figures_for(s)]
