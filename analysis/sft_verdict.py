"""Judging the SFT accuracy sweep: every run against all-on-GPU training at its own compute dtype, held
against all-on-GPU's own run-to-run spread where the sweep measured it. Pure functions on the run dicts of
``analysis.sft_report.collect`` (no torch, no files), so the rules are tested on synthetic rows.

A run: ``{"system", "variant", "label", "status", "dtype", "evals": [{"step", "eval_loss", "exact_match"?}],
"steps": [{"step", "loss", "grad_norm"}], "summary": {"exact_match_after", ...}}``.

* **Reference** of a dtype: the all-on-GPU (``native``) run of that dtype that is not a repeat (variant
  ``default`` first). A run is compared with the reference of its own dtype: an fp32 run with fp32
  all-on-GPU, a bf16 run with bf16 all-on-GPU.
* **Spread** of a dtype: the repeats of the reference (variants ``rerun*``: the same run again, or
  perturbed at the size of rounding) compared with it the same way: how far all-on-GPU lands from itself
  (GPU nondeterminism, or an ulp, amplified by training); with several, the farthest.
* **Verdict** of an exact system: ``agree`` when its held-out loss is within ``LOSS_TOL`` nats of the
  reference at every evaluation and its final exact match within ``ACC_TOL`` (the issue's target);
  else ``agree within run-to-run spread`` when its accuracy gap is within 1 point or the spread's and
  either its largest held-out gap is no larger than the reference's against itself, or its **whole-run**
  gap is: the RMS over every step of (its training loss − the reference's), no larger than the largest such
  RMS of a repeat (``train_rms``; 100 paired steps against the 4 evaluations of the held-out test, which
  can catch a transient bump that repeats show at other steps; a bit-identical repeat, RMS 0, measures
  determinism, not a spread, and does not count); else ``disagree``. Every number is always stated, and
  which test passed. A system that is not exact AdamW (``NOT_EXACT``) gets no verdict, only where it lands.
* **Arithmetic** (``run["arithmetic"]``, a key of ``ARITHMETIC``, from the row's fields:
  ``analysis.sft_report.run_arithmetic``): how the run computed at its dtype. It does not change the rule;
  it says what a gap can come from. A bf16 run whose arithmetic is the reference's own (MegaTrain with
  ``mixed_precision=autocast`` against all-on-GPU under autocast) computes the same function, so its expected
  gap is 0 up to GPU nondeterminism and rounding-size kernel differences amplified by training: it is held
  against the issue's target and against the reruns' spread like every exact run, and both outcomes are
  stated (``target``, ``within_spread``). The fp32 points put every system in one arithmetic.
"""
from __future__ import annotations

import math

REF_SYSTEM = "native"
REPEAT_PREFIX = "rerun"  # a variant named rerun* repeats a run unchanged (``repeat:`` in the sweep yaml)
LOSS_TOL, ACC_TOL = 0.01, 0.01  # nats; accuracy as a fraction (1 point)
NOT_EXACT = frozenset({"zenflow", "superoffload_noclip"})  # other update rules: where they land, no verdict
AGREE, WITHIN_SPREAD, DISAGREE = "agree", "agree within run-to-run spread", "disagree"
FAILED, INCOMPLETE = "failed", "not comparable"  # no row / evaluations or step count unlike the reference's
# How a run computed at its dtype (what ``run["arithmetic"]`` may say), for the report's legend.
ARITHMETIC = {
    "fp32": "fp32 throughout: weights, activations, residual stream and matmuls",
    "autocast": "HF's mixed precision: fp32 weights, residual stream, norms and embedding, matmuls in bf16 under "
                "torch.autocast (all-on-GPU; MegaTrain with mixed_precision=autocast)",
    "bf16 layers": "each layer wholly in bf16: weights cast to bf16 on the GPU, bf16 residual stream (MegaTrain's "
                   "default, mixed_precision=layer)",
    "bf16 model": "DeepSpeed bf16: bf16 parameters (fp32 master partitions), every layer and the residual stream "
                  "in bf16",
}


def is_repeat(run: dict) -> bool:
    return str(run.get("variant", "")).startswith(REPEAT_PREFIX)


def curve(run: dict, key: str) -> dict[int, float]:
    """``{step: value}`` of the run's evaluations that have ``key``."""
    return {int(e["step"]): float(e[key]) for e in run.get("evals", []) if e.get(key) is not None}


def references(runs: list[dict]) -> dict[str, dict]:
    """``{dtype: reference run}``: the all-on-GPU run of each dtype that is not a repeat (``default`` first)."""
    refs: dict[str, dict] = {}
    for run in sorted(runs, key=lambda r: r.get("variant") != "default"):
        if run["system"] == REF_SYSTEM and not is_repeat(run) and run.get("evals"):
            refs.setdefault(run["dtype"], run)
    return refs


def _step0(run: dict, base: dict) -> tuple[float | None, float | None]:
    """Training loss and relative gradient-norm difference at the first step: same weights, same batch, so
    this is the two systems' arithmetic alone (no training dynamics yet)."""
    a, b = (run.get("steps") or [None])[0], (base.get("steps") or [None])[0]
    if not a or not b or a.get("loss") is None or b.get("loss") is None:
        return None, None
    dloss = abs(float(a["loss"]) - float(b["loss"]))
    na, nb = a.get("grad_norm"), b.get("grad_norm")
    dnorm = abs(float(na) - float(nb)) / abs(float(nb)) if (na is not None and nb) else None
    return dloss, dnorm


def train_gap(run: dict, base: dict) -> tuple[float | None, float | None]:
    """(RMS, mean) over the steps both ran of (run's training loss − base's): how far the two trajectories are
    apart along the whole run, and whether one trains systematically better or worse (None: no common step)."""
    bl = {int(r["step"]): float(r["loss"]) for r in base.get("steps") or [] if r.get("loss") is not None}
    d = [float(r["loss"]) - bl[int(r["step"])] for r in run.get("steps") or []
         if r.get("loss") is not None and int(r["step"]) in bl]
    d = [x for x in d if math.isfinite(x)]
    if not d:
        return None, None
    return math.sqrt(sum(x * x for x in d) / len(d)), sum(d) / len(d)


def compare(run: dict, base: dict) -> dict:
    """``run`` against ``base`` over their common evaluations: the largest |held-out loss difference| and its
    step, the final exact-match difference (run − base), the base's evaluations the run lacks, and the
    first step's training-loss and gradient-norm differences."""
    bl, loss = curve(base, "eval_loss"), curve(run, "eval_loss")
    devs = {s: abs(loss[s] - bl[s]) for s in bl if s in loss}
    worst = max(devs, key=lambda s: (not math.isfinite(devs[s]), devs[s], s), default=None)  # ties: the latest
    acc, bacc = run.get("summary", {}).get("exact_match_after"), base.get("summary", {}).get("exact_match_after")
    d0, n0 = _step0(run, base)
    rms, bias = train_gap(run, base)
    return {"max_loss_dev": devs[worst] if worst is not None else None, "at_step": worst,
            "train_rms": rms, "train_bias": bias,
            "acc_dev": (acc - bacc) if (acc is not None and bacc is not None) else None,
            "missing_steps": sorted(set(bl) - set(loss)), "step0_loss_dev": d0, "step0_norm_rel": n0,
            "steps": len(run.get("steps") or []), "ref_steps": len(base.get("steps") or [])}


def comparable(cmp: dict) -> bool:
    """Same evaluations, same step count, a finite gap and both accuracies: the two runs can be judged."""
    return not (cmp["max_loss_dev"] is None or cmp["missing_steps"] or cmp["acc_dev"] is None
                or cmp["steps"] != cmp["ref_steps"] or not math.isfinite(cmp["max_loss_dev"]))


def meets_target(cmp: dict) -> bool | None:
    """The issue's absolute target: held-out loss within ``LOSS_TOL`` nats at every evaluation and final exact
    match within ``ACC_TOL`` (None: not comparable)."""
    if not comparable(cmp):
        return None
    return cmp["max_loss_dev"] <= LOSS_TOL and abs(cmp["acc_dev"]) <= ACC_TOL + 1e-12


def spread_tests(cmp: dict, spread: dict | None) -> dict:
    """The two spread tests of an exact run: ``heldout`` (its largest held-out gap no larger than all-on-GPU's
    from itself), ``whole_run`` (its training-loss RMS no larger than a repeat's largest; None where no repeat
    moved) and ``accuracy`` (its accuracy gap within 1 point or the spread's). None: not comparable or no
    spread measured at this dtype."""
    none = {"heldout": None, "whole_run": None, "accuracy": None}
    if not comparable(cmp) or spread is None or spread.get("max_loss_dev") is None or spread.get("acc_dev") is None:
        return none
    sr, r = spread.get("train_rms"), cmp.get("train_rms")
    return {"heldout": cmp["max_loss_dev"] <= spread["max_loss_dev"],
            "whole_run": (r <= sr) if (sr and r is not None) else None,
            "accuracy": abs(cmp["acc_dev"]) <= max(ACC_TOL, abs(spread["acc_dev"])) + 1e-12}


def within_spread(cmp: dict, spread: dict | None) -> bool | None:
    """No farther from the reference than all-on-GPU from itself, by the held-out test or the whole-run one,
    with its accuracy gap within 1 point or the spread's (None: not comparable, or no spread measured at
    this dtype)."""
    t = spread_tests(cmp, spread)
    if t["heldout"] is None:
        return None
    return bool(t["accuracy"] and (t["heldout"] or t["whole_run"]))


def judge(cmp: dict, spread: dict | None, status: str = "ok") -> str:
    """The verdict of one exact run from its comparison and its dtype's spread (None: not measured)."""
    if status != "ok":
        return FAILED
    if not comparable(cmp):
        return INCOMPLETE
    if meets_target(cmp):
        return AGREE
    if within_spread(cmp, spread):
        return WITHIN_SPREAD
    return DISAGREE


def same_arithmetic(run: dict, base: dict) -> bool | None:
    """Whether ``run`` computed as its reference did (None: either run does not say)."""
    a, b = run.get("arithmetic"), base.get("arithmetic")
    return (a == b) if (a and b) else None


def agreement(runs: list[dict]) -> dict:
    """Every run judged against the reference of its dtype.

    Returns ``{"verdict", "refs": {dtype: label}, "spread": {dtype: comparison of the repeat}, "runs":
    {label: comparison + "dtype", "role" (reference / spread / exact / not exact), "verdict", and for the
    judged runs "arithmetic", "same_arithmetic" (as the reference's), "target" (the issue's 0.01 nats / 1
    point met), "within_spread" (no farther than all-on-GPU from itself; None: not measured)}}``; the
    overall verdict is over the exact runs: ``agree`` if all agree, ``agree within run-to-run spread`` if
    all agree or are within it, else ``disagree`` (``no reference`` without an all-on-GPU run)."""
    refs = references(runs)
    if not refs:
        return {"verdict": "no reference", "refs": {}, "spread": {}, "runs": {}}
    spread: dict[str, dict] = {}
    whole_run: dict[str, list[tuple[float, str]]] = {}  # dtype: (training-loss RMS, label) of each repeat
    out: dict[str, dict] = {}
    for run in runs:  # the repeats first: every exact run of the dtype is held against them
        base = refs.get(run["dtype"])
        if run["system"] == REF_SYSTEM and is_repeat(run) and base is not None:
            cmp = compare(run, base)
            if run["status"] == "ok" and not cmp["missing_steps"] and cmp["steps"] == cmp["ref_steps"] \
                    and cmp["max_loss_dev"] is not None and cmp["acc_dev"] is not None:
                # several repeats: the spread is the farthest all-on-GPU landed from itself (loss and accuracy)
                old = spread.get(run["dtype"])
                if old is None or cmp["max_loss_dev"] > old["max_loss_dev"]:
                    spread[run["dtype"]] = dict(cmp, label=run["label"],
                                                acc_dev=max(cmp["acc_dev"], old["acc_dev"] if old else 0.0, key=abs))
                else:
                    old["acc_dev"] = max(old["acc_dev"], cmp["acc_dev"], key=abs)
                whole_run.setdefault(run["dtype"], []).append((cmp["train_rms"] or 0.0, run["label"]))
            out[run["label"]] = dict(cmp, dtype=run["dtype"], role="spread", verdict="")
    for dtype, sp in spread.items():  # the whole-run spread: the largest RMS of any repeat, whichever it is
        sp["train_rms"], sp["train_label"] = max(whole_run[dtype])
    for run in runs:
        base = refs.get(run["dtype"])
        if run is base or run["label"] in out:
            continue
        if base is None:
            out[run["label"]] = {"dtype": run["dtype"], "role": "exact", "verdict": "no reference",
                                 "max_loss_dev": None, "at_step": None, "acc_dev": None}
            continue
        cmp = dict(compare(run, base), arithmetic=run.get("arithmetic") or "",
                   same_arithmetic=same_arithmetic(run, base))
        if run["system"] in NOT_EXACT:
            out[run["label"]] = dict(cmp, dtype=run["dtype"], role="not exact", verdict="not exact AdamW",
                                     target=None, within_spread=None)
        else:
            sp = spread.get(run["dtype"])
            ok = run["status"] == "ok"
            out[run["label"]] = dict(cmp, dtype=run["dtype"], role="exact",
                                     verdict=judge(cmp, sp, run["status"]),
                                     target=meets_target(cmp) if ok else None,
                                     within_spread=within_spread(cmp, sp) if ok else None,
                                     spread_tests=spread_tests(cmp, sp) if ok else None)
    for dtype, base in refs.items():
        out[base["label"]] = {"dtype": dtype, "role": "reference", "verdict": "reference", "max_loss_dev": None,
                              "at_step": None, "acc_dev": None, "arithmetic": base.get("arithmetic") or ""}
    # Overall, over the exact runs that ran: a failed one is named, not counted as agreeing or disagreeing.
    judged = [v["verdict"] for v in out.values() if v["role"] == "exact" and v["verdict"] != FAILED]
    failed = [label for label, v in out.items() if v["role"] == "exact" and v["verdict"] == FAILED]
    if judged and all(v == AGREE for v in judged):
        verdict = AGREE
    elif judged and all(v in (AGREE, WITHIN_SPREAD) for v in judged):
        verdict = WITHIN_SPREAD
    else:
        verdict = DISAGREE if judged else "nothing to judge"
    return {"verdict": verdict, "failed": failed, "refs": {d: r["label"] for d, r in refs.items()},
            "spread": spread, "runs": out}


def _nats(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _tiny(x) -> str:  # first-step differences: fp32 ones are ~1e-6, bf16 ones ~1e-3
    return "n/a" if x is None else f"{x:.1e}"


def arithmetic_name(dtype: str, arithmetic: str) -> str:
    """``bf16 autocast``, ``bf16 layers``, ``fp32``: the dtype and the arithmetic in one name."""
    if not arithmetic:
        return dtype
    return arithmetic if arithmetic.startswith(dtype) else f"{dtype} {arithmetic}"


def _yes(x, yes: str, no: str, unknown: str) -> str:
    return unknown if x is None else (yes if x else no)


def _spread_words(t: dict) -> str:
    """``: within it`` / ``: held-out beyond it, the whole run within it`` / ``: beyond it ...``, plus the
    accuracy where it fails (``""`` where no spread test ran)."""
    if t.get("heldout") is None:
        return ""
    loss_ok = t["heldout"] or t.get("whole_run")
    if t["heldout"]:
        words = "within it"
    elif t.get("whole_run"):
        words = "held-out beyond it, the whole run within it"
    else:
        words = "beyond it" + (" (held-out and whole run)" if t.get("whole_run") is False else "")
    if not t.get("accuracy"):
        words += ", but accuracy beyond it" if loss_ok else ", accuracy beyond it too"
    return ": " + words


def explain(result: dict, runs: list[dict]) -> list[str]:
    """One sentence per exact run: its dtype and arithmetic, its gap (nats, at which step; accuracy points),
    whether that meets the issue's target, beside all-on-GPU's own spread at that dtype (or that none was
    measured) and whether it is within it, and its verdict; then what bf16 alone does to all-on-GPU, what
    the fp32 points say of each system's bf16 gap, and what all-on-GPU's own arithmetic (autocast) does to it,
    where the sweep ran those."""
    lines = []
    for run in runs:
        v = result["runs"].get(run["label"])
        if not v or v["role"] not in ("exact", "not exact"):
            continue
        if v["verdict"] == FAILED:
            lines.append(f"- {run['label']} ({v['dtype']}): {run['status']}"
                         f"{': ' + run.get('error', '')[:120] if run.get('error') else ''} → not judged.")
            continue
        sp = result["spread"].get(v["dtype"])
        how = arithmetic_name(v["dtype"], v.get("arithmetic") or "")
        if v.get("same_arithmetic") and v["dtype"] != "fp32":
            how += ": all-on-GPU's own arithmetic, expected gap 0 up to GPU nondeterminism"
        gap = f"max |Δ held-out loss| {_nats(v['max_loss_dev'])} nats" + (
            f" (step {v['at_step']})" if v.get("at_step") is not None else "")
        acc = "" if v.get("acc_dev") is None else f", Δ exact match {100 * v['acc_dev']:+.1f} points"
        target = ""
        if v["role"] == "exact":
            target = "; issue target (≤ {} nats, ≤ 1 point) {}".format(
                LOSS_TOL, _yes(v.get("target"), "met", "missed", "not comparable"))
        whole = ""
        if v.get("train_rms") is not None:
            whole = (f", training loss {_nats(v['train_rms'])} RMS from all-on-GPU's over the run "
                     f"(mean {v['train_bias']:+.4f})")
        if sp is None:
            against = f"all-on-GPU vs itself not measured at {v['dtype']}"
        else:
            against = (f"all-on-GPU vs all-on-GPU {_nats(sp['max_loss_dev'])} nats (step {sp['at_step']}, "
                       f"{sp['label']}), {100 * sp['acc_dev']:+.1f} points")
            if sp.get("train_rms"):
                against += f", training loss {_nats(sp['train_rms'])} RMS ({sp['train_label']})"
            if v["role"] == "exact":
                against += _spread_words(v.get("spread_tests") or {})
        lines.append(f"- {run['label']} ({how}): {gap}{acc}{whole}{target}; {against} → **{v['verdict']}**.")
    # What bf16 itself does to all-on-GPU (a yardstick for the bf16 gaps above)
    refs = {r["dtype"]: r for r in runs if result["refs"].get(r["dtype"]) == r["label"]}
    if "bf16" in refs and "fp32" in refs:
        c = compare(refs["bf16"], refs["fp32"])
        lines.append(f"- All-on-GPU bf16 vs all-on-GPU fp32 (what bf16 alone does to the reference): max |Δ held-out "
                     f"loss| {_nats(c['max_loss_dev'])} nats (step {c['at_step']}), first step "
                     f"{_tiny(c['step0_loss_dev'])}.")
    # The same system (and tier) in several arithmetics: its own bf16 one, fp32, all-on-GPU's (autocast).
    by: dict[tuple, dict[str, tuple[str, dict]]] = {}
    for run in runs:
        v = result["runs"].get(run["label"])
        if v and v["role"] == "exact" and v["verdict"] != FAILED:
            kind = "fp32" if v["dtype"] == "fp32" else ("ref" if v.get("same_arithmetic") else "own")
            if v["dtype"] in ("fp32", "bf16"):  # the first of a kind (collect's order: variant default first)
                by.setdefault((run["system"], run.get("tier", "")), {}).setdefault(kind, (run["label"], v))
    for d in by.values():
        if "own" not in d:
            continue
        lb, vb = d["own"]
        own = f"{_nats(vb['max_loss_dev'])}; first step {_tiny(vb['step0_loss_dev'])}"
        if "fp32" in d:
            lf, vf = d["fp32"]
            if vf["verdict"] == AGREE and vb["verdict"] != AGREE:
                lines.append(f"- With one arithmetic (fp32) {lf} stays within {LOSS_TOL} nats of all-on-GPU "
                             f"({_nats(vf['max_loss_dev'])}; first step {_tiny(vf['step0_loss_dev'])}), where in "
                             f"bf16 it does not ({own}): the bf16 gap comes from bf16 arithmetic, not from "
                             f"the system's schedule or update.")
            elif vf["verdict"] != AGREE:
                lines.append(f"- With one arithmetic (fp32) {lf} is still {_nats(vf['max_loss_dev'])} nats from "
                             f"all-on-GPU (first step {_tiny(vf['step0_loss_dev'])}; bf16: {own}): the gap is "
                             f"not bf16's alone"
                             + (" but within all-on-GPU's own fp32 spread." if vf["verdict"] == WITHIN_SPREAD
                                else "."))
        if "ref" in d:
            la, va = d["ref"]
            head = (f"- With all-on-GPU's own bf16 arithmetic ({va.get('arithmetic')}) {la} is "
                    f"{_nats(va['max_loss_dev'])} nats from all-on-GPU (first step {_tiny(va['step0_loss_dev'])}; "
                    f"→ {va['verdict']}), with its own ({vb.get('arithmetic') or 'bf16'}) {own} "
                    f"(→ {vb['verdict']})")
            if va["verdict"] in (AGREE, WITHIN_SPREAD) and vb["verdict"] not in (AGREE, WITHIN_SPREAD):
                lines.append(head + ": in bf16 the gap was the choice of arithmetic, not the system's schedule "
                                    "or update.")
            elif va["verdict"] not in (AGREE, WITHIN_SPREAD):
                lines.append(head + ": the same arithmetic does not close the gap, so it is not the arithmetic "
                                    "alone.")
            else:
                lines.append(head + ".")
    return lines


def by_arithmetic(result: dict) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """``{(dtype, arithmetic): [(label, verdict), ...]}`` of the judged runs, in the result's order."""
    out: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for label, v in result["runs"].items():
        if v["role"] in ("exact", "not exact"):
            out.setdefault((v["dtype"], v.get("arithmetic") or ""), []).append((label, v["verdict"]))
    return out
