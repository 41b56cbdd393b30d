"""Accuracy parity (the paper's Table 3 at a size we can run): reading the rows of
``scripts/accuracy_parity.py``, judging whether the held-out loss curves agree, and drawing them. Used by
the script and by ``analysis.report`` (no torch)."""
from __future__ import annotations

import json
import math
from pathlib import Path

# Curves "agree" when every eval point is within max(ABS_TOL, REL_TOL * reference) of the reference:
# bf16 compute gives each system its own rounding, and training amplifies it a little over the steps.
ABS_TOL, REL_TOL = 0.02, 0.02


# -- agreement ------------------------------------------------------------------------------------
def eval_curves(rows) -> dict[str, dict[int, float]]:
    """system -> {step: held-out loss} from the eval rows."""
    curves: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.get("kind") == "eval":
            curves.setdefault(r["system"], {})[int(r["step"])] = float(r["eval_loss"])
    return curves


def is_exact(name: str) -> bool:
    """Whether a system's update is exact AdamW (the registry's ``exact_adamw``; unknown names count as exact)."""
    from baselines.registry import SYSTEM_RECORDS

    rec = SYSTEM_RECORDS.get(name)
    return True if rec is None else bool(rec.exact_adamw)


def agreement(rows, ref: str = "native", abs_tol: float = ABS_TOL, rel_tol: float = REL_TOL) -> dict:
    """Per system: the largest |eval - eval_ref| over the reference's eval points, where it happened,
    ``agree``: within max(abs_tol, rel_tol * eval_ref) at every point, none missing or non-finite, and
    ``exact`` (its update is AdamW's). The verdict is over the exact systems only: one that is not exact
    AdamW (ZenFlow) is not held to the rule, only measured against it (``times_tol``: its largest
    difference over the tolerance at that point).
    ``{"ref": ref, "rule": ..., "systems": {...}, "verdict": "agree" | "disagree" | "no reference"}``."""
    curves = eval_curves(rows)
    rule = f"|eval - eval_{ref}| <= max({abs_tol}, {rel_tol:.0%} of eval_{ref}) at every eval point"
    if ref not in curves:
        return {"ref": ref, "rule": rule, "systems": {}, "verdict": "no reference"}
    base = curves[ref]
    out = {}
    for name, curve in curves.items():
        if name == ref:
            continue
        missing = sorted(set(base) - set(curve))
        devs = {s: abs(curve[s] - base[s]) for s in base if s in curve}
        worst = max(devs, key=lambda s: (not math.isfinite(devs[s]), devs[s]), default=None)
        ok = not missing and all(math.isfinite(d) and d <= max(abs_tol, rel_tol * abs(base[s]))
                                 for s, d in devs.items())
        out[name] = {"max_abs_dev": devs[worst] if worst is not None else None, "at_step": worst,
                     "max_rel_dev": max((d / abs(base[s]) for s, d in devs.items()), default=None),
                     "times_tol": max((d / max(abs_tol, rel_tol * abs(base[s])) for s, d in devs.items()),
                                      default=None),
                     "missing_steps": missing, "agree": ok, "exact": is_exact(name)}
    judged = [v["agree"] for v in out.values() if v["exact"]]
    verdict = "agree" if judged and all(judged) else "disagree" if judged else "no exact system"
    return {"ref": ref, "rule": rule, "systems": out, "verdict": verdict}


def format_agreement(result: dict) -> str:
    lines = [f"agreement with {result['ref']}: {result['rule']}"]
    for name, v in result["systems"].items():
        dev = ("n/a" if v["max_abs_dev"] is None
               else f"{v['max_abs_dev']:.4f} (step {v['at_step']}, {v['max_rel_dev']:.2%})")
        miss = f", missing steps {v['missing_steps']}" if v["missing_steps"] else ""
        mark = ("agree" if v["agree"] else "DISAGREE") if v.get("exact", True) else \
            f"not exact AdamW, not judged ({'within' if v['agree'] else 'outside'} the tolerance)"
        lines.append(f"  {name:<10} max |dev| {dev}{miss}  -> {mark}")
    lines.append(f"verdict: {result['verdict']}")
    return "\n".join(lines)


# -- figure ---------------------------------------------------------------------------------------
def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def legend_label(name: str, summary: dict, hardware: str) -> str:
    """The registry's label, plus what ran when it differs from the name (``zero3[torch-adamw]``)."""
    from baselines.registry import record

    ran = summary.get(name, {}).get("label") or name
    extra = ran[len(name):].strip("[]") if ran.startswith(name) else ran
    return record(name).label_for(hardware) + (f" [{extra}]" if extra else "")


def plot_accuracy(jsonl, png, ref: str = "native") -> list[Path]:
    """Held-out loss vs step, one line per system (and, with the reference present, each system's
    difference to it with the tolerance band). Writes ``png`` and the PDF beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from baselines.registry import SYSTEMS, record

    rows = read_rows(jsonl)
    curves = eval_curves(rows)
    if not curves:
        raise ValueError(f"{jsonl}: no eval rows to plot")
    summary = {r["system"]: r for r in rows if r.get("kind") == "summary"}
    first = next(r for r in rows if r.get("kind") == "eval")
    hardware = "cpu" if first.get("device") == "cpu" else "gpu"
    order = [s for s in SYSTEMS if s in curves] + [s for s in curves if s not in SYSTEMS]
    with_diff = ref in curves and len(curves) > 1
    fig, axes = plt.subplots(2 if with_diff else 1, 1, figsize=(7.2, 6.4 if with_diff else 4.4), sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [3, 2]} if with_diff else None)
    ax = axes[0, 0]
    for i, name in enumerate(order):  # earlier lines wider: curves that coincide stay visible
        steps = sorted(curves[name])
        rec = record(name)
        ax.plot(steps, [curves[name][s] for s in steps], marker=rec.marker, color=rec.colour, ms=4,
                lw=1.2 + 1.2 * (len(order) - 1 - i), label=legend_label(name, summary, hardware))
    ax.set_ylabel("held-out loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    if with_diff:
        dx = axes[1, 0]
        base = curves[ref]
        steps = sorted(base)
        band = [max(ABS_TOL, REL_TOL * abs(base[s])) for s in steps]
        dx.fill_between(steps, [-b for b in band], band, color="#cccccc", alpha=0.5,
                        label=f"tolerance max({ABS_TOL}, {REL_TOL:.0%})")
        for name in order:
            if name == ref:
                continue
            rec = record(name)
            pts = [s for s in steps if s in curves[name]]
            dx.plot(pts, [curves[name][s] - base[s] for s in pts], marker=rec.marker, color=rec.colour, ms=4,
                    lw=1.2, label=legend_label(name, summary, hardware))
        dx.axhline(0, color="#555555", lw=0.8)
        dx.set_ylabel(f"difference to {record(ref).label_for(hardware, short=True)}\n(nats/token)")
        dx.legend(fontsize=8)
        dx.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    env = next(iter(summary.values()), {})
    parts = [first.get("model", ""), f"{env['num_params'] / 1e6:.1f}M params" if "num_params" in env else "",
             f"{env['tokens_per_step']} tokens/step" if "tokens_per_step" in env else "",
             env.get("gpu_name") or first.get("device", "")]
    ax.set_title("Accuracy parity: held-out loss, same init and batches\n" + ", ".join(p for p in parts if p),
                 fontsize=10)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    paths = [png, png.with_suffix(".pdf")]
    for p in paths:
        from .style import save  # noqa: PLC0415

        save(fig, p, dpi=150)
    plt.close(fig)
    return paths




# -- report section -------------------------------------------------------------------------------
def report_lines(jsonl, figure: str | None = None, machine_in_title: bool = False) -> list[str]:
    """The report's "Accuracy parity" section from ``accuracy_parity.jsonl``: held-out loss per eval
    step and system, the agreement rule and verdict, the run's setup, the figure's link."""
    rows = read_rows(jsonl)
    curves = eval_curves(rows)
    if not curves:
        return []
    summary = {r["system"]: r for r in rows if r.get("kind") == "summary"}
    result = agreement(rows)
    env = next(iter(summary.values()), {})
    first = next(r for r in rows if r.get("kind") == "eval")
    setup = ", ".join(x for x in [
        first.get("model", ""), f"{env['num_params'] / 1e6:.0f}M params" if "num_params" in env else "",
        f"{env['steps']} steps" if "steps" in env else "",
        f"{env['tokens_per_step']} tokens/step" if "tokens_per_step" in env else "",
        env.get("gpu_name", ""), f"git {str(env.get('git_sha', ''))[:10]}" if env.get("git_sha") else "",
        str(env.get("date", ""))[:10]] if x)
    names = list(curves)
    steps = sorted(set().union(*(set(c) for c in curves.values())))
    machine = f" — {env['gpu_name']} (`{Path(jsonl).parent.name}`)" if machine_in_title and env.get("gpu_name") else ""
    lines = [f"## Accuracy parity (the paper's Table 3, at a size we can run){machine}", "",
             f"Same initial weights and the same batches of real text (Python standard-library sources, byte "
             f"tokens; the last 10 % held out) for every system: {setup}. Held-out loss (nats/token) every "
             f"evaluation step:", "",
             "| step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for st in steps:
        lines.append(f"| {st} | " + " | ".join(f"{curves[n][st]:.4f}" if st in curves[n] else "" for n in names) + " |")
    lines += ["", f"Rule: {result['rule']} (bf16 compute: each system rounds differently).", ""]
    for name, v in result["systems"].items():
        dev = "n/a" if v["max_abs_dev"] is None else f"{v['max_abs_dev']:.4f} at step {v['at_step']} ({v['max_rel_dev']:.2%})"
        speed = summary.get(name, {}).get("steps_per_s")
        if v.get("exact", True):
            mark = f"**{'agree' if v['agree'] else 'disagree'}**"
        else:  # measured against the rule, not judged by it
            final = summary.get(name, {}).get("final_eval_loss")
            ref_final = summary.get(result["ref"], {}).get("final_eval_loss")
            knobs = summary.get(name, {}).get("zenflow_effective") or summary.get(name, {}).get("zenflow")
            mark = (f"*not exact AdamW, not judged*: {v['times_tol']:.1f}× the tolerance at its farthest"
                    + (f"; final held-out loss {final:.4f} against {ref_final:.4f} ({final - ref_final:+.4f})"
                       if final is not None and ref_final is not None else "")
                    + (f"; settings as run: {', '.join(f'{k} {x}' for k, x in knobs.items())}" if knobs else "")
                    + (f" ({summary[name]['notes']})" if summary.get(name, {}).get("notes") else ""))
        lines.append(f"- **{name}** vs {result['ref']}: largest difference {dev} → {mark}"
                     + (f"; {speed:.2f} steps/s ({summary[name].get('optimizer', '')})" if speed else ""))
    lines += ["", f"Verdict (over the exact systems): **{result['verdict']}**." + (f" Figure: [{Path(figure).stem}]({figure})" if figure else ""), ""]
    return lines
