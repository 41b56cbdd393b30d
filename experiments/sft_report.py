"""The SFT accuracy sweep (``sweep=accuracy_sft``, the paper's Table 3 on a pretrained model): reading its
points, judging them against all-on-GPU training, the figure and the report section. No torch.

Each point folder holds ``sft.jsonl`` (eval rows, a summary row) and ``metrics.jsonl`` (one row per step),
written by ``experiments/sft_point.py``; the sweep's ``results.csv`` says which run of a point is the
latest. A system *agrees* with the reference when its held-out loss is within ``LOSS_TOL`` nats at every
evaluation and its final exact-match accuracy within ``ACC_TOL`` (the issue's target for exact systems).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

SWEEP = "accuracy_sft"
REF = ("native", "default")
LOSS_TOL, ACC_TOL = 0.01, 0.01  # nats; accuracy as a fraction (1 point)
# The same system in another variant: a lighter shade of its colour and its own marker.
VARIANT_STYLE = {"pure_streaming": ("#F0A35E", "D")}


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def _job(pdir: Path) -> dict:
    try:
        return json.loads((pdir / "job.json").read_text())
    except (OSError, ValueError):
        return {}


def collect(results_dir, sweep: str = SWEEP) -> list[dict]:
    """One dict per latest point of the sweep: system, variant, status, evals, steps, summary, label."""
    from baselines.registry import record

    from .schema import latest, read_results

    csv = Path(results_dir) / sweep / "results.csv"
    if not csv.exists():
        return []
    df = latest(read_results(csv))
    runs = []
    for _, row in df.iterrows():
        pdir = Path(results_dir) / sweep / str(row["point"])
        rows = _jsonl(pdir / "sft.jsonl")
        result = {}
        if (pdir / "result.json").exists():
            result = json.loads((pdir / "result.json").read_text())
        name = str(row["system"])
        variant = str(row["variant"])
        label = record(name).label_for(str(row["hardware"]), short=True)
        if name == "megatrain":
            tier = "pure streaming" if variant == "pure_streaming" else "tiered"
            label = f"{label} {tier}"
        elif variant != "default":
            label += f" [{variant}]"
        runs.append({"system": name, "variant": variant, "label": label, "status": row["status"],
                     "error": row.get("error") or "", "point": row["point"], "hardware": row["hardware"],
                     "gpu_name": row.get("gpu_name") or "", "git_sha": row.get("git_sha") or "",
                     "date": row.get("date") or "", "model": row["model"], "num_params": row.get("num_params"),
                     "batch_size": row.get("batch_size"), "seq_len": row.get("seq_len"),
                     "evals": [r for r in rows if r.get("kind") == "eval"],
                     "summary": next((r for r in rows if r.get("kind") == "summary"), result.get("sft") or {}),
                     "steps": _jsonl(pdir / "metrics.jsonl"), "config": result.get("system_info", {}),
                     "sft": _job(pdir).get("sft") or {}})
    order = {"native": 0, "megatrain": 1, "zero3": 3}
    return sorted(runs, key=lambda r: (order.get(r["system"], 9), r["variant"] != "default", r["system"]))


def _curve(run: dict, key: str) -> dict[int, float]:
    return {int(e["step"]): float(e[key]) for e in run["evals"] if e.get(key) is not None}


def agreement(runs: list[dict], ref=REF) -> dict:
    """Per run vs the reference (all-on-GPU): the largest |held-out loss difference| over common eval
    steps, the final accuracy difference, and ``agree``."""
    base = next((r for r in runs if (r["system"], r["variant"]) == ref and r["evals"]), None)
    if base is None:
        return {"ref": ref, "verdict": "no reference", "runs": {}}
    bl, ba = _curve(base, "eval_loss"), base["summary"].get("exact_match_after")
    out = {}
    for run in runs:
        if run is base:
            continue
        loss = _curve(run, "eval_loss")
        missing = sorted(set(bl) - set(loss))
        devs = {s: abs(loss[s] - bl[s]) for s in bl if s in loss}
        worst = max(devs, key=lambda s: (not math.isfinite(devs[s]), devs[s]), default=None)
        acc = run["summary"].get("exact_match_after")
        dacc = (acc - ba) if (acc is not None and ba is not None) else None
        ok = (run["status"] == "ok" and not missing and worst is not None and devs[worst] <= LOSS_TOL
              and dacc is not None and abs(dacc) <= ACC_TOL + 1e-12)
        out[run["label"]] = {"max_loss_dev": devs[worst] if worst is not None else None, "at_step": worst,
                             "acc_dev": dacc, "missing_steps": missing, "agree": ok}
    verdict = "agree" if out and all(v["agree"] for v in out.values()) else "disagree"
    return {"ref": base["label"], "verdict": verdict, "runs": out}


# -- figure ---------------------------------------------------------------------------------------
def plot(results_dir, out_dir, formats=("png", "pdf"), sweep: str = SWEEP) -> list[Path]:
    """``<out>/accuracy_sft.<fmt>``: held-out loss, exact-match accuracy, gradient norm (with the clipping
    threshold) and the held-out loss difference to all-on-GPU, per system. [] when the sweep has no rows."""
    runs = [r for r in collect(results_dir, sweep) if r["evals"]]
    if not runs:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from baselines.registry import record

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (ax_loss, ax_acc), (ax_norm, ax_diff) = axes
    base = next((r for r in runs if (r["system"], r["variant"]) == REF), None)
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        rec = record(run["system"])
        colour, marker = VARIANT_STYLE.get(run["variant"], (rec.colour, rec.marker))
        kw = dict(color=colour, marker=marker, ms=3.5, ls=styles[i % len(styles)],
                  lw=1.2 + 1.0 * (len(runs) - 1 - i), label=run["label"])
        loss = _curve(run, "eval_loss")
        ax_loss.plot(sorted(loss), [loss[s] for s in sorted(loss)], **kw)
        acc = _curve(run, "exact_match")
        ax_acc.plot(sorted(acc), [100 * acc[s] for s in sorted(acc)], **kw)
        steps = [r for r in run["steps"] if r.get("grad_norm") is not None]
        ax_norm.plot([r["step"] + 1 for r in steps], [r["grad_norm"] for r in steps], color=colour,
                     lw=0.9, ls=kw["ls"], label=run["label"], alpha=0.8)
        if base is not None and run is not base:
            bl = _curve(base, "eval_loss")
            common = sorted(set(bl) & set(loss))
            ax_diff.plot(common, [loss[s] - bl[s] for s in common], **dict(kw, lw=1.2))
    clip = next((r["summary"].get("max_grad_norm") for r in runs if r["summary"].get("max_grad_norm")), None)
    if clip:
        ax_norm.axhline(clip, color="#555555", lw=0.8, ls="--", label=f"clipping threshold {clip:g}")
    ax_norm.set_yscale("log")
    ax_diff.axhspan(-LOSS_TOL, LOSS_TOL, color="#cccccc", alpha=0.5, label=f"±{LOSS_TOL} nats")
    ax_diff.axhline(0, color="#555555", lw=0.8)
    ax_loss.set_ylabel("held-out loss on the answers (nats/token)")
    ax_acc.set_ylabel("held-out exact match (%)")
    ax_norm.set_ylabel("gradient norm before clipping")
    ax_diff.set_ylabel(f"held-out loss − {base['label'] if base else 'reference'} (nats)")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    first = runs[0]
    params = f"{float(first['num_params']) / 1e6:.1f}M params" if first.get("num_params") else ""
    fig.suptitle(f"SFT accuracy parity (Table 3 analogue): {first['model']} {params}, "
                 f"{first['batch_size']} examples/step, {first['gpu_name'] or first['hardware']}", fontsize=10)
    fig.tight_layout()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{SWEEP}.{f}" for f in formats]
    for p in paths:
        fig.savefig(p, dpi=150)
    plt.close(fig)
    return paths


# -- report section -------------------------------------------------------------------------------
def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}"


def _num(x, fmt=".4f") -> str:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def report_lines(results_dir, figure: str | None = None, sweep: str = SWEEP) -> list[str]:
    """The report's section for the SFT sweep ([] when it has no rows)."""
    runs = collect(results_dir, sweep)
    if not runs:
        return []
    result = agreement(runs)
    first = runs[0]
    task = first["sft"]
    source = Path(task.get("gguf") or task.get("model_dir") or "?").name
    n_eval = next((e.get("n") for e in first["evals"] if e.get("n")), task.get("n_eval"))
    lines = ["## Table 3 on a pretrained model: SFT accuracy parity", "",
             f"{first['model']} ({_num(float(first['num_params']) / 1e6 if first.get('num_params') else None, '.1f')}M "
             f"params; `{source}`{', de-quantized to fp32 masters' if task.get('gguf') else ''}) fine-tuned on "
             f"generated {task.get('digits', '?')}-digit '{task.get('op', '?')}' problems (\"What is 347 + 589?\" → "
             f"\"936\"; {task.get('n_train', '?')} training problems, loss on the answer tokens only, "
             f"{first['batch_size']} examples of ≤ {first['seq_len']} tokens per step, {len(first['steps'])} steps) by "
             f"every system from the same weights, on the same batches in the same order, with the same AdamW; one "
             f"evaluation for all: the system's fp32 masters copied into one plain fp32 HF model, held-out loss on "
             f"the {n_eval} held-out answers and greedy exact-match accuracy (\"last number\": the last integer of "
             f"the answer, fair to a model that answers in a sentence). {first['gpu_name'] or first['hardware']}, "
             f"git {str(first['git_sha'])[:10]}, {str(first['date'])[:10]}.", "",
             "| system | status | exact match before → after (%) | last number before → after (%) | held-out loss "
             "before → after | max \\|Δ loss\\| vs all-on-GPU | Δ accuracy (points) | clipped steps | median grad "
             "norm | speculated steps | rollbacks | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s, a = run["summary"], result["runs"].get(run["label"], {})
        dev = "reference" if not a else (_num(a.get("max_loss_dev")) + (f" (step {a['at_step']})" if a.get("at_step") is not None else ""))
        dacc = "" if not a else ("" if a.get("acc_dev") is None else f"{100 * a['acc_dev']:+.1f}")
        spec = _pct(s.get("speculated_fraction")) + " %" if s.get("speculated_fraction") is not None else "n/a"
        lines.append(f"| {run['label']} | {run['status']}{': ' + run['error'][:80] if run['error'] else ''} | "
                     f"{_pct(s.get('exact_match_before'))} → {_pct(s.get('exact_match_after'))} | "
                     f"{_pct(s.get('numeric_match_before'))} → {_pct(s.get('numeric_match_after'))} | "
                     f"{_num(s.get('eval_loss_before'))} → {_num(s.get('eval_loss_after'))} | {dev} | {dacc} | "
                     f"{_pct(s.get('clip_fraction'))} % | {_num(s.get('grad_norm_median'), '.2f')} | {spec} | "
                     f"{s.get('rollbacks', 'n/a')} | {_num(s.get('step_time_median_s'), '.3f')} |")
    lines += ["", "Clipped steps: the pre-clipping global gradient norm above the clipping threshold (the same rule "
              "for every system). Speculated steps (MegaTrain): the host tier's AdamW ran during the backward, "
              "before the norm was known, undone and redone (rollbacks) where clipping then fired; a run whose "
              "layers all sit on the GPU tier (tiered, at this size) has no host tier to speculate with."]
    lines += ["", f"Rule: a system agrees with {result['ref']} when its held-out loss is within {LOSS_TOL} nats at "
              f"every evaluation and its final exact-match accuracy within {100 * ACC_TOL:.0f} point "
              f"(bf16 compute: every system rounds differently). Verdict: **{result['verdict']}**."
              + (f" Figure: [{Path(figure).stem}]({figure})" if figure else ""), "",
              "What this reproduces of the paper's Table 3: fine-tuning a *pretrained* checkpoint with MegaTrain "
              "(tiered and pure streaming) reaches the same held-out loss and task accuracy as plain all-on-GPU "
              "training and ZeRO-3 offload, from the same weights and batches, with clipping and (for the engine) "
              "speculative host updates active. What it does not: the paper's models (Qwen2.5 7B-72B; here "
              "135M, so the whole model fits the GPU tier in the tiered run), its data (MetaMathQA → GSM8K; here "
              "generated 3-digit addition scored by exact match) and its training length (here a few hundred "
              "steps); accuracy differences of a fraction of a point are within what bf16 rounding alone moves.", ""]
    return lines
