"""The host_side sweep's figure: MegaTrain's speed against the host (CPU cores, host link, host RAM), three
panels sharing the throughput axis, the real host the right-most point of each (``analysis.figures``
registers it)."""
from __future__ import annotations

import re

import pandas as pd

from .claims import _num
from .style import (FORMULA_NOTE, SYSTEM_COLOR, fmt_params, on_cpu, short_sha, status_short, _band_positions,
                    _fail_handle, _finish, _legend, _new_figure, _safe_max, _set_band_ylim)

HOST_SIDE_PANELS = (  # (kind, hardware-profile prefix, x-axis label)
    ("cores", "cores-", "CPU cores (capped; log₂ axis)"),
    ("link", "link-", "host link (GB/s; slowed by emulation; log₂ axis)"),
    ("ram", "host-", "host RAM cap (GiB; log₂ axis)"),
)
# what the real host's x is in each panel, for the words "not measured" where no row says it
REAL_FACT = {"cores": "CPU cores", "link": "host link", "ram": "host RAM"}
# both series are MegaTrain: MegaTrain's colour first, then Okabe-Ito colours the other systems do not lead with
SERIES_COLORS = (SYSTEM_COLOR["megatrain"], "#0072B2", "#009E73", "#CC79A7", "#E69F00", "#555555")
SERIES_MARKERS = ("o", "s", "^", "D", "v", "P")


def _profile_number(hardware: str, prefix: str) -> float | None:
    """'cores-8' -> 8, 'link-16GBps' -> 16, 'host-64GB' -> 64 (None if the name is not of that form)."""
    m = re.match(re.escape(prefix) + r"(\d+(?:\.\d+)?)", str(hardware))
    return float(m.group(1)) if m else None


def _host_side_kind(r) -> str | None:
    """'real' for the real host (not emulated), else the panel of the capped resource (None: unknown)."""
    if not bool(r["emulated"]):
        return "real"
    for kind, prefix, _ in HOST_SIDE_PANELS:
        if str(r["hardware"]).startswith(prefix):
            return kind
    if _num(r.get("host_link_gbps")):
        return "link"
    return None


def _series_name(model: str, variant: str, num_params) -> str:
    """('qwen2.5-14b', 'tiered') -> '14B tiered'."""
    m = re.search(r"(\d+(?:\.\d+)?)[bB]$", str(model))
    size = f"{m.group(1)}B" if m else (fmt_params(num_params) if _num(num_params) else str(model))
    mode = "" if variant in ("default", "full", "") else " " + str(variant).replace("_", " ")
    return f"{size}{mode}"


def _fail_reason(r) -> str:
    """'skip: needs 102.6 GiB' (a point not launched for memory: the report's rule, claims.memory_limit) or
    the status' short name."""
    short = "no value" if r["status"] == "ok" else status_short(r)
    need = _num(r.get("need_host_gib")) if r.get("reason") == "host_memory" else None
    return f"{short}: needs {need:.1f} GiB" if need is not None else short


def _real_host_facts(df) -> dict:
    """The real host's x in each panel, from typed row fields only (None: no row measured it).

    * cores: ``cpu_cores`` of a real-host row, else of a row whose profile caps something else (it ran on
      the same node, one CSV being one machine's, with all of its cores);
    * RAM: ``host_ram_gib`` of a real-host row (the node's total, as the row records it);
    * link: never in a row (``host_link_gbps`` is the emulated link only; the real one is not a column)."""
    real = df[df["_kind"] == "real"]
    uncapped = df[df["_kind"].isin(["real", "link", "ram"])]
    cores = [c for c in (_num(v) for v in uncapped["cpu_cores"]) if c]
    ram = [r for r in (_num(v) for v in real["host_ram_gib"]) if r]
    return {"cores": max(cores) if cores else None, "ram": max(ram) if ram else None, "link": None}


def _host_side_rows(df):
    """The rows with their panel kind, series and x value per panel; the real host's measured facts (None:
    not measured), and its x per panel: the fact, or one log₂ step right of the panel's profiles where the
    rows do not measure it."""
    df = df.copy().reset_index(drop=True)
    df["_kind"] = df.apply(_host_side_kind, axis=1)
    df["_series"] = list(zip(df["model"].astype(str), df["variant"].astype(str)))
    df = df.drop_duplicates(subset=["_series", "hardware"], keep="last")
    facts = _real_host_facts(df)

    def x_of(r, kind):
        prefix = dict((k, p) for k, p, _ in HOST_SIDE_PANELS)[kind]
        if kind == "cores":
            return _num(r.get("cpu_cores")) or _profile_number(r["hardware"], prefix)
        if kind == "link":
            return _num(r.get("host_link_gbps")) or _profile_number(r["hardware"], prefix)
        return _num(r["host_ram_gib"]) or _profile_number(r["hardware"], prefix)

    real_x = {}
    for kind, _, _ in HOST_SIDE_PANELS:
        xs = [x for x in (x_of(r, kind) for _, r in df[df["_kind"] == kind].iterrows()) if x]
        real_x[kind] = facts[kind] or (2 * max(xs) if xs else 1.0)
        df[f"_x_{kind}"] = [(real_x[kind] if r["_kind"] == "real" else x_of(r, kind)) if r["_kind"] in (kind, "real")
                            else None for _, r in df.iterrows()]
    return df, real_x, facts


def fig_host_side(df, out, formats):
    """Three panels sharing the throughput axis: CPU cores, host link, host RAM cap; the real host is the
    right-most point of each. One line per model/mode, every point with its value and ratio to the same
    series on the real host; a point that did not run is an × in the grey band with its reason."""
    from matplotlib.lines import Line2D  # noqa: PLC0415
    import matplotlib.transforms as mtransforms  # noqa: PLC0415

    rows, real_x, facts = _host_side_rows(df)
    ok_mask = rows["status"] == "ok"
    metric, unit, fmt = "tflops", "TFLOPS", "{:.0f}"
    if on_cpu(rows) or (not rows.loc[ok_mask, "tflops"].notna().any()
                        and rows.loc[ok_mask, "tokens_per_s"].notna().any()):
        metric, unit, fmt = "tokens_per_s", "tokens/s", "{:,.0f}"
    rows["_ok"] = ok_mask & rows[metric].notna()
    series = list(dict.fromkeys(rows["_series"]))
    names = {}
    for i, key in enumerate(series):
        p = rows.loc[rows["_series"] == key, "num_params"].dropna()
        names[key] = (_series_name(key[0], key[1], p.iloc[0] if not p.empty else None),
                      SERIES_COLORS[i % len(SERIES_COLORS)], SERIES_MARKERS[i % len(SERIES_MARKERS)])
    real_val, real_sha = {}, {}
    for key in series:
        r = rows[(rows["_series"] == key) & (rows["_kind"] == "real") & rows["_ok"]]
        real_val[key] = float(r[metric].iloc[-1]) if not r.empty else None
        real_sha[key] = short_sha(r.iloc[-1]) if not r.empty else ""
    across = []  # (series, hardware, its commit, the real host's commit): ratios across code versions
    drawn = rows[rows["_kind"].notna()]
    fail_series = [k for k in series if ((drawn["_series"] == k) & ~drawn["_ok"]).any()]
    # two band rows per series with failures: its × in the lower one, the reason above it
    band_y = dict(zip(fail_series, _band_positions(2 * len(fail_series))[::2]))
    top = _safe_max(rows.loc[rows["_ok"], metric]) * 1.1  # room for the labels above the highest point

    fig, axes = _new_figure(ncols=3, width=15.0, height=6.6, sharey=True)
    for ax, (kind, _, xlabel) in zip(axes, HOST_SIDE_PANELS):
        xcol = f"_x_{kind}"
        part = drawn[drawn["_kind"].isin([kind, "real"])]
        _set_band_ylim(ax, top, 2 * len(fail_series))
        trans = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
        okp = part[part["_ok"] & part[xcol].notna()]
        for key in series:
            name, color, marker = names[key]
            s = okp[okp["_series"] == key].sort_values(xcol)
            if s.empty:
                continue
            ax.plot(s[xcol], s[metric], color=color, marker=marker, lw=1.8, ms=7, ls="none", zorder=3)
            gaps = part.loc[(part["_series"] == key) & ~part["_ok"], xcol].dropna()
            for (x0, y0), (x1, y1) in zip(s[[xcol, metric]].values[:-1], s[[xcol, metric]].values[1:]):
                gap = ((gaps > x0) & (gaps < x1)).any()  # a point between them did not run: dotted
                ax.plot([x0, x1], [y0, y1], color=color, lw=1.2 if gap else 1.8, ls=":" if gap else "-",
                        zorder=3)
            r = s[s["_kind"] == "real"]
            if not r.empty:  # the real host: black-edged, larger
                ax.plot(r[xcol], r[metric], color=color, marker=marker, ms=10, mec="black", mew=1.3, ls="none",
                        zorder=4)
        for x, at_x in okp.groupby(xcol):  # per x: the highest label above its point, the others below
            at_x = at_x.sort_values(metric, ascending=False)
            for j, (_, r) in enumerate(at_x.iterrows()):
                v, base = float(r[metric]), real_val[r["_series"]]
                sha, ref_sha = short_sha(r), real_sha[r["_series"]]
                mark = "‡" if base and r["_kind"] != "real" and sha and ref_sha and sha != ref_sha else ""
                if mark:
                    across.append((r["_series"], r["hardware"], sha, ref_sha))
                txt = fmt.format(v) + (f" ({v / base:.2f}×{mark})" if base else "")
                _, color, _ = names[r["_series"]]
                ax.annotate(txt, (x, v), xytext=(0, 8 if j == 0 else -9), textcoords="offset points",
                            ha="center", va="bottom" if j == 0 else "top", fontsize=8, color=color,
                            fontweight="bold", zorder=6, bbox=dict(fc="white", ec="none", alpha=0.8, pad=0.6))
        xs = sorted({float(v) for v in part[xcol].dropna()})
        ax.set_xscale("log", base=2)
        if xs:
            real_xs = {float(v) for v in part.loc[part["_kind"] == "real", xcol].dropna()}
            labels = []
            for v in xs:
                if v not in real_xs:
                    labels.append(f"{v:g}")
                elif facts[kind] is None:  # placed right of the profiles: no row says the real value
                    labels.append(f"real host\n({REAL_FACT[kind]}\nnot measured)")
                else:
                    labels.append(f"{v:.3g}\n(real host)")
            ax.set_xticks(xs)
            ax.set_xticklabels(labels)
            ax.minorticks_off()
            ax.set_xlim(xs[0] / 1.45, xs[-1] * 1.45)
        else:
            ax.set_xticks([])
        fails = part[~part["_ok"]]
        unplaced, marks = [], []
        for _, r in fails.iterrows():
            name, color, _ = names[r["_series"]]
            if pd.isna(r[xcol]):
                unplaced.append(f"{name} {r['hardware']} ({_fail_reason(r)})")
            else:
                marks.append((r["_series"], float(r[xcol]), _fail_reason(r), color))
        for m in marks:
            key, x, reason, color = m
            y = band_y[key]
            ax.plot([x], [y], transform=trans, marker="x", color=color, markersize=8, mew=2.2, ls="none",
                    clip_on=False, zorder=5)
            # "skip:\nneeds 102.6 GiB" on two lines: neighbours in the same band row never run into each other
            ax.annotate(reason.replace(": ", ":\n", 1), (x, y), xycoords=trans,
                        xytext=(0, 6), textcoords="offset points", fontsize=7,
                        color=color, ha="center", va="bottom", zorder=5, linespacing=0.95,
                        bbox=dict(fc="#f0f0f0", ec="none", alpha=0.9, pad=0.3))
        if okp.empty:
            ax.text(0.5, 0.6, "no successful runs for this resource" if xs else "no rows for this resource",
                    transform=ax.transAxes, ha="center", va="center", fontsize=10, color="#777777")
        if unplaced:
            ax.text(0.01, 0.98, "× without an x value: " + ", ".join(unplaced), transform=ax.transAxes,
                    fontsize=7, va="top", ha="left", color="#B00020", wrap=True,
                    bbox=dict(fc="white", ec="#B00020", alpha=0.9, lw=0.6))
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", visible=False)
    axes[0].set_ylabel(f"training throughput ({unit})")
    handles = [Line2D([], [], color=c, marker=m, lw=1.8, ms=7, label=n) for n, c, m in names.values()]
    handles.append(Line2D([], [], ls="none", marker="o", color="white", mec="black", mew=1.3, ms=10,
                          label="black edge: real host"))
    handles.append(_fail_handle())
    _legend(axes[0], handles, ncol=2, fontsize=8)

    hw = rows.loc[rows["_kind"] == "real", "hardware"]
    host = hw.iloc[0] if not hw.empty else "real host"
    known = {"cores": lambda v: f"{v:g} CPU cores", "ram": lambda v: f"{v:.0f} GiB RAM"}
    said = ", ".join(known[k](facts[k]) if facts[k] is not None else f"{REAL_FACT[k]} not measured in these rows"
                     for k, _, _ in HOST_SIDE_PANELS)
    lines = [(FORMULA_NOTE if metric == "tflops" else "tokens/s = tokens per step / median step time.")
             + f"  Label: {unit} (ratio to the same model/mode on the real host)."]
    lines.append(f"Real host ({host}): {said}. Emulated profiles run on the same machine with one resource "
                 "capped: cores-N limits the training process (and torch threads) to N cores, link-N slows "
                 "host↔GPU copies to N GB/s, host-N caps host RAM at N GiB. Series: "
                 + "; ".join(f"{names[k][0]} = {k[0]}" for k in series)
                 + " (tiered: GPU tier filled first; pure streaming: no layer resident on the GPU). "
                 "Dotted segment: a point between did not run.")
    if across:
        lines.append("‡ ratio across code versions (the point's commit vs the real host row's): "
                     + "; ".join(f"{names[k][0]} {hw} {a} vs {b}" for k, hw, a, b in dict.fromkeys(across)))
    failed = drawn[~drawn["_ok"]]
    for _, r in failed.head(6).iterrows():
        err = str(r.get("error") or ("ran, but recorded no " + unit if r["status"] == "ok" else r["status"]))
        err = err.replace("skipped: ", "")
        lines.append(f"× {names[r['_series']][0]} on {r['hardware']}: "
                     f"{err[:150] + ('…' if len(err) > 150 else '')}")
    if len(failed) > 6:
        lines.append(f"× … and {len(failed) - 6} more not run (their reasons: the error column of results.csv)")
    lost = rows[rows["_kind"].isna()]
    if not lost.empty:
        lines.append("not drawn (unknown profile): " + ", ".join(dict.fromkeys(lost["hardware"].astype(str))))
    return _finish(fig, rows, "How MegaTrain's speed depends on the host (host_side sweep)", "\n".join(lines),
                   out, "host_side", formats)
