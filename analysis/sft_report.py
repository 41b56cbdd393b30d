"""The SFT accuracy sweep (``sweep=accuracy_sft``, the paper's Table 3 on a pretrained model): reading its
points, the figure and the report section. No torch. The rules that judge a run against all-on-GPU
training (at its own compute dtype, against all-on-GPU's own run-to-run spread where measured) are in
``analysis/sft_verdict.py``.

Each point folder holds ``sft.jsonl`` (eval rows, a summary row) and ``metrics.jsonl`` (one row per step),
written by ``experiments/sft_point.py``; the sweep's ``results.csv`` says which run of a point is the
latest.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .sft_verdict import (ARITHMETIC, LOSS_TOL, REF_SYSTEM, agreement, arithmetic_name, by_arithmetic, curve,
                          explain, is_repeat, references)

SWEEP = "accuracy_sft"  # the main machine's rows; another machine's go to ``accuracy_sft_<machine>`` beside it


def sweeps(results_dir) -> list[str]:
    """The SFT sweeps under ``results_dir``: ``accuracy_sft`` first, then ``accuracy_sft_<machine>`` folders
    (rows of one machine per folder: a run on one GPU never lands among another's, scripts/merge_results.py)."""
    root = Path(results_dir)
    found = sorted(p.parent.name for p in root.glob(f"{SWEEP}_*/results.csv"))
    return ([SWEEP] if (root / SWEEP / "results.csv").exists() else []) + found
# The same system in another variant: a shade of its colour and its own marker.
VARIANT_STYLE = {("megatrain", "pure_streaming"): ("#F0A35E", "D"), ("megatrain", "fp32"): ("#8B3A00", "x"),
                 ("megatrain", "autocast"): ("#C45C00", "P"), ("zero3", "fp32"): ("#1F3F7A", "x"),
                 ("native", "fp32"): ("#000000", "x"), ("native", "rerun"): ("#999999", "1")}
DEEPSPEED = frozenset({"zero3", "zero2", "superoffload", "superoffload_noclip", "zenflow"})
_DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


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


def run_dtype(row_dtype, job: dict, hardware: str) -> str:
    """The compute dtype a point ran with: the row's, else its job's; ``auto`` = fp32 on a CPU, else bf16."""
    for d in (row_dtype, job.get("dtype")):
        d = str(d or "").strip()
        if d and d not in ("auto", "nan"):
            return _DTYPE_NAMES.get(d, d)
    on_cpu = str(hardware).lower() == "cpu" or str(job.get("device", "")).startswith("cpu")
    return "fp32" if on_cpu else "bf16"


def run_arithmetic(system: str, dtype: str, info: dict, job: dict) -> str:
    """How the run computed at its dtype (a key of ``analysis.sft_verdict.ARITHMETIC``; "" if its fields do
    not say), from the row's fields: the dtype, the system's ``system_info`` (result.json: the engine's
    config, DeepSpeed's config, ``compute_dtype``) and the job's options. fp32 is one arithmetic for all;
    in bf16 all-on-GPU runs its fp32 model under autocast (``baselines/native.py``), MegaTrain as its
    ``mixed_precision`` says ("layer" when the row predates the option), DeepSpeed as its ``bf16`` section."""
    info = info or {}
    named = str(info.get("compute_dtype") or (info.get("config") or {}).get("compute_dtype") or "")
    if dtype == "fp32" or _DTYPE_NAMES.get(named, named) == "fp32":
        return "fp32"
    if dtype != "bf16":
        return ""
    if system == REF_SYSTEM:
        return "autocast"
    if system == "megatrain":
        mode = (info.get("config") or {}).get("mixed_precision") or (job.get("options") or {}).get("mixed_precision")
        return "autocast" if mode == "autocast" else "bf16 layers"
    if system in DEEPSPEED:
        bf16 = ((info.get("ds_config") or {}).get("bf16") or {}).get("enabled")
        return "bf16 model" if bf16 or (bf16 is None and named == "bfloat16") else ""
    return ""


def run_label(name: str, variant: str, tier: str, hardware: str) -> str:
    from baselines.registry import record

    label = record(name).label_for(str(hardware), short=True)
    if tier:
        label = f"{label} {tier}"
    if variant not in ("default", "pure_streaming"):
        label += f" [{variant}]"
    return label


def split_note(job: dict, result: dict) -> str:
    """`` (ran in 1 micro-batch, not 2)`` where a run trained in another micro-batch split than its job asked
    for (before 974d85b native's auto_config probe could override it: the H200's rerun_mb2 of 6727888 is a
    plain rerun), so that the row says what it ran, not what its variant's name asked for; else ``""``."""
    ran = ((result.get("system_info") or {}).get("settings") or {}).get("micro_batches")
    asked = job.get("micro_batches")
    if ran is None or asked is None or int(ran) == int(asked):
        return ""
    return f" (ran in {int(ran)} micro-batch{'es' if int(ran) > 1 else ''}, not {int(asked)})"


def collect(results_dir, sweep: str = SWEEP) -> list[dict]:
    """One dict per latest point of the sweep: system, variant, dtype, tier, status, evals, steps, summary,
    label. Ordered: the main dtype's runs first (all-on-GPU, MegaTrain, the rest), then the repeats, then
    the other dtypes."""
    from experiments.schema import latest, read_results

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
        job = _job(pdir)
        name, variant = str(row["system"]), str(row["variant"])
        tier = ""
        if name == "megatrain":
            resident = str((job.get("options") or {}).get("gpu_resident", "auto"))
            tier = "pure streaming" if (resident == "0" or variant == "pure_streaming") else "tiered"
        dtype = run_dtype(row.get("dtype"), job, row["hardware"])
        label = run_label(name, variant, tier, row["hardware"]) + split_note(job, result)
        runs.append({"system": name, "variant": variant, "tier": tier, "dtype": dtype,
                     "arithmetic": run_arithmetic(name, dtype, result.get("system_info") or {}, job),
                     "label": label, "status": row["status"],
                     "error": row.get("error") or "", "point": row["point"], "hardware": row["hardware"],
                     "gpu_name": row.get("gpu_name") or "", "git_sha": row.get("git_sha") or "",
                     "date": row.get("date") or "", "model": row["model"], "num_params": row.get("num_params"),
                     "batch_size": row.get("batch_size"), "seq_len": row.get("seq_len"),
                     "evals": [r for r in rows if r.get("kind") == "eval"],
                     "summary": next((r for r in rows if r.get("kind") == "summary"), result.get("sft") or {}),
                     "steps": _jsonl(pdir / "metrics.jsonl"), "config": result.get("system_info", {}),
                     "sft": job.get("sft") or {}})
    main = next((r["dtype"] for r in runs if r["system"] == REF_SYSTEM and r["variant"] == "default"),
                runs[0]["dtype"] if runs else "")
    order = {"native": 0, "megatrain": 1, "zero3": 3}
    return sorted(runs, key=lambda r: (r["dtype"] != main, is_repeat(r), order.get(r["system"], 9),
                                       r["variant"] != "default", r["variant"], r["system"]))


# -- figure ---------------------------------------------------------------------------------------
def _style(run: dict, i: int, n: int) -> dict:
    from baselines.registry import record

    rec = record(run["system"])
    colour, marker = VARIANT_STYLE.get((run["system"], run["variant"]), (rec.colour, rec.marker))
    # the first runs drawn widest, so that identical curves drawn later stay visible on top of them
    return dict(color=colour, marker=marker, ms=3.5, ls=["-", "--", ":", "-."][i % 4],
                lw=1.0 + 1.6 * (n - 1 - i) / max(1, n - 1), label=run["label"])


def plot(results_dir, out_dir, formats=("png", "pdf"), sweep: str = SWEEP) -> list[Path]:
    """``<out>/<sweep>.<fmt>``: held-out loss, exact-match accuracy, gradient norm (with the clipping
    threshold), the held-out loss difference to all-on-GPU at the run's dtype (the rerun's = all-on-GPU's
    own spread) and the per-step training-loss difference on the same batch (from the first step: the
    arithmetic alone), per system. [] when the sweep has no rows."""
    runs = [r for r in collect(results_dir, sweep) if r["evals"]]
    if not runs:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 7.5))
    (ax_loss, ax_acc, ax_step), (ax_norm, ax_diff, ax_text) = axes
    refs = references(runs)
    for i, run in enumerate(runs):
        kw = _style(run, i, len(runs))
        loss = curve(run, "eval_loss")
        ax_loss.plot(sorted(loss), [loss[s] for s in sorted(loss)], **kw)
        acc = curve(run, "exact_match")
        ax_acc.plot(sorted(acc), [100 * acc[s] for s in sorted(acc)], **kw)
        steps = [r for r in run["steps"] if r.get("grad_norm") is not None]
        ax_norm.plot([r["step"] + 1 for r in steps], [r["grad_norm"] for r in steps], color=kw["color"],
                     lw=0.9, ls=kw["ls"], label=run["label"], alpha=0.8)
        base = refs.get(run["dtype"])
        if base is None or run is base:
            continue
        bl = curve(base, "eval_loss")
        common = sorted(set(bl) & set(loss))
        ax_diff.plot(common, [loss[s] - bl[s] for s in common], **dict(kw, lw=1.2))
        mine = {r["step"]: r["loss"] for r in run["steps"] if r.get("loss") is not None}
        theirs = {r["step"]: r["loss"] for r in base["steps"] if r.get("loss") is not None}
        both = sorted(set(mine) & set(theirs))
        # |Δ| on a log axis: an exact 0 (bit-identical steps) is drawn at the axis floor
        ax_step.plot(both, [max(abs(mine[s] - theirs[s]), 1e-9) for s in both],
                     color=kw["color"], ls=kw["ls"], lw=1.0, label=f"{run['label']} ({run['dtype']})")
    clip = next((r["summary"].get("max_grad_norm") for r in runs if r["summary"].get("max_grad_norm")), None)
    if clip:
        ax_norm.axhline(clip, color="#555555", lw=0.8, ls="--", label=f"clipping threshold {clip:g}")
    ax_norm.set_yscale("log")
    ax_step.set_yscale("log")
    ax_diff.axhspan(-LOSS_TOL, LOSS_TOL, color="#cccccc", alpha=0.5, label=f"±{LOSS_TOL} nats")
    ax_diff.axhline(0, color="#555555", lw=0.8)
    ax_loss.set_ylabel("held-out loss on the answers (nats/token)")
    ax_acc.set_ylabel("held-out exact match (%)")
    ax_norm.set_ylabel("gradient norm before clipping")
    ax_diff.set_ylabel("held-out loss − all-on-GPU at its dtype (nats)")
    ax_step.set_ylabel("|Δ training loss| vs all-on-GPU, same batch")
    for ax in (ax_loss, ax_acc, ax_step, ax_norm, ax_diff):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    result = agreement(runs)
    ax_text.axis("off")
    text = [f"verdict: {result['verdict']}", "max |Δ held-out loss| vs all-on-GPU at the same dtype:", ""] + [
        f"{label}: {v['verdict'] or 'run-to-run spread'}"
        + (f" ({v['max_loss_dev']:.4f} nats)" if v.get("max_loss_dev") is not None else "")
        for label, v in result["runs"].items() if v["role"] in ("exact", "not exact", "spread")]
    ax_text.text(0.0, 1.0, "\n".join(text), va="top", ha="left", fontsize=8, family="monospace",
                 transform=ax_text.transAxes, wrap=True)
    first = runs[0]
    params = f"{float(first['num_params']) / 1e6:.1f}M params" if first.get("num_params") else ""
    fig.suptitle(f"SFT accuracy parity (Table 3 analogue): {first['model']} {params}, "
                 f"{first['batch_size']} examples/step, {first['gpu_name'] or first['hardware']}", fontsize=10)
    fig.tight_layout()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{sweep}.{f}" for f in formats]
    for p in paths:
        from .style import save  # noqa: PLC0415

        save(fig, p, dpi=150)
    plt.close(fig)
    return paths


# -- report section -------------------------------------------------------------------------------
def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}"


def _num(x, fmt=".4f") -> str:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _gap(v: dict) -> str:
    if v.get("role") == "reference":
        return "reference"
    return _num(v.get("max_loss_dev")) + (f" (step {v['at_step']})" if v.get("at_step") is not None else "")


def _train(v: dict) -> str:
    """The whole-run gap: RMS of the per-step training-loss difference to the reference, and its mean."""
    if v.get("train_rms") is None:
        return ""
    return f"{v['train_rms']:.4f} ({v['train_bias']:+.4f})"


def _examples_seen(run: dict) -> str:
    """Training examples the run's steps saw (steps x batch size), as text."""
    try:
        n = len(run["steps"]) * int(float(run["batch_size"]))
    except (TypeError, ValueError):
        return "?"
    n_train = (run.get("sft") or {}).get("n_train")
    epochs = f", {n / float(n_train):.2f} epochs" if n_train else ""
    return f"{n:,} ({len(run['steps'])} steps × {int(float(run['batch_size']))}{epochs})"


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
    machine = "" if sweep == SWEEP else f" — {first['gpu_name'] or first['hardware']} (`results/{sweep}`)"
    lines = [f"## Table 3 on a pretrained model: SFT accuracy parity{machine}", "",
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
             "| system | compute | arithmetic | status | exact match before → after (%) | "
             "last number before → after (%) | "
             "held-out loss before → after | max \\|Δ loss\\| vs all-on-GPU (same dtype) | "
             "training-loss RMS (mean) vs all-on-GPU | Δ accuracy (points) | "
             "first-step \\|Δ train loss\\| | clipped steps | median grad norm | speculated steps | rollbacks | "
             "s/step | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s, v = run["summary"], result["runs"].get(run["label"], {})
        dacc = "" if v.get("acc_dev") is None else f"{100 * v['acc_dev']:+.1f}"
        spec = _pct(s.get("speculated_fraction")) + " %" if s.get("speculated_fraction") is not None else "n/a"
        verdict = {"spread": "all-on-GPU vs itself", "reference": "reference"}.get(v.get("role"), v.get("verdict", ""))
        lines.append(f"| {run['label']} | {run['dtype']} | {run.get('arithmetic') or 'not recorded'} | {run['status']}"
                     f"{': ' + run['error'][:80] if run['error'] else ''} | "
                     f"{_pct(s.get('exact_match_before'))} → {_pct(s.get('exact_match_after'))} | "
                     f"{_pct(s.get('numeric_match_before'))} → {_pct(s.get('numeric_match_after'))} | "
                     f"{_num(s.get('eval_loss_before'))} → {_num(s.get('eval_loss_after'))} | {_gap(v)} | "
                     f"{_train(v)} | {dacc} | "
                     f"{_num(v.get('step0_loss_dev'), '.2e')} | "
                     f"{_pct(s.get('clip_fraction'))} % | {_num(s.get('grad_norm_median'), '.2f')} | {spec} | "
                     f"{s.get('rollbacks', 'n/a')} | {_num(s.get('step_time_median_s'), '.3f')} | {verdict} |")
    lines += ["", "Clipped steps: the pre-clipping global gradient norm above the clipping threshold (the same rule "
              "for every system). Speculated steps (MegaTrain): the host tier's AdamW ran during the backward, "
              "before the norm was known, undone and redone (rollbacks) where clipping then fired; a run whose "
              "layers all sit on the GPU tier (tiered, at this size) has no host tier to speculate with. First-step "
              "\\|Δ train loss\\|: the same weights and batch through each system's arithmetic, before any update.",
              "", "Arithmetic (column *arithmetic*, from each row's recorded configuration):", ""]
    used: dict[str, list[str]] = {}
    for run in runs:
        if run.get("arithmetic"):
            used.setdefault(run["arithmetic"], []).append(run["label"])
    lines += [f"- *{a}*: {ARITHMETIC.get(a, a)}. Ran it: {', '.join(labels)}." for a, labels in used.items()]
    lines += [""]
    lines += explain(result, runs)
    spread_note = ("; where the sweep reran all-on-GPU (variants `rerun*`: unchanged, perturbed at the size "
                   "of fp32 rounding, or the same step in 2 or 4 micro-batches), a larger gap is *agree within "
                   "run-to-run spread* when it is no larger than all-on-GPU's farthest from itself, by either of "
                   "two tests: the largest held-out gap over the evaluations, or the whole run's gap (the RMS over "
                   "every step of the training-loss difference, against the largest RMS of a rerun that moved: "
                   "100 paired steps, where the held-out test has 4 evaluations and can catch a transient bump "
                   "that reruns show at other steps), with the accuracy gap within 1 point or the spread's; every "
                   "number is stated above, and which test passed")
    classes = "; ".join(f"{arithmetic_name(dtype, arith or '(arithmetic not recorded)')}: "
                        + ", ".join(f"{label} {verdict}" for label, verdict in judged)
                        for (dtype, arith), judged in by_arithmetic(result).items())
    lines += ["", f"Rule: an exact system agrees with all-on-GPU training at the same compute dtype when its held-out "
              f"loss is within {LOSS_TOL} nats at every evaluation and its final exact-match accuracy within 1 "
              f"point (the issue's target){spread_note}. A run in all-on-GPU's own arithmetic (bf16 under autocast) "
              f"computes the same function as the reference, so its expected gap is 0 up to GPU nondeterminism; "
              f"it is held against the same target and the same spread. Verdict: **{result['verdict']}**"
              + (f" (not judged, failed: {', '.join(result['failed'])})." if result.get("failed") else ".")
              + (f" By arithmetic: {classes}." if classes else "")
              + (f" Figure: [{Path(figure).stem}]({figure})" if figure else ""), "",
              "What this reproduces of the paper's Table 3: its claim, that training a *pretrained* checkpoint with "
              "MegaTrain (tiered and pure streaming) ends at the same task accuracy and held-out loss as plain "
              "all-on-GPU training and ZeRO-3 offload (task accuracy before and after fine-tuning, every system from "
              "the same weights, batches and optimizer), with gradient clipping "
              "and (for the engine) speculative host updates active — the verdict above says whether it held on "
              "these rows. What it does not reproduce: the table's numbers. Model size: the paper's 7B and 14B "
              f"models, here {_num(float(first['num_params']) / 1e6 if first.get('num_params') else None, '.0f')}M "
              "(small enough that the tiered run holds every layer on the GPU tier; only pure streaming streams). "
              "Task: MetaMathQA fine-tuning scored on GSM8K, here generated "
              f"{task.get('digits', '?')}-digit addition scored by exact match on held-out problems. Data size: "
              f"MetaMathQA's training set, here {task.get('n_train', '?')} generated problems of which "
              f"{_examples_seen(first)} are seen. Training length: here {len(first['steps'])} steps. So the "
              "accuracies themselves are not comparable to the paper's; the comparison between systems is.", ""]
    return lines
