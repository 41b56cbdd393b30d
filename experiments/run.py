"""Sweep runner: ``python -m experiments.run sweep=<name> [overrides]``.

    python -m experiments.run sweep=smoke                        # CPU pipeline check (CI)
    python -m experiments.run sweep=size                         # every system, 7B..120B
    python -m experiments.run sweep=ablation system=megatrain model=qwen2.5-7b
    python -m experiments.run sweep=context only='[megatrain__*]' timeout_s=900
    python -m experiments.run sweep=depth dry_run=true            # list points and what would happen
    python -m experiments.run sweep=tokens redo=true              # re-run points already done

Every point runs in its own process (``experiments.point``) with a timeout; its row is appended to
``<results_dir>/<sweep>/results.csv`` as soon as it ends, whatever happened (ok, skipped, gpu_oom,
host_oom, timeout, error), and the sweep goes on. ``results_dir`` defaults to ``runs/<machine>/``: a run
never writes into the committed ``results/`` unless asked (``results_dir=results``), and never appends to
a CSV measured on another machine. Every point is validated before the first one starts. A rerun skips
points whose last row is ok/skipped (``redo=true`` re-runs them) and retries the others. Exit status 2
for a config error (one line), 1 when a point timed out or failed for a reason other than memory (the last
line names them) or when no point succeeded, else 0. See docs/runner.md.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import hydra
from omegaconf import OmegaConf

from baselines.registry import record

from . import config as C  # registers the schemas in hydra's ConfigStore
from . import schema
from .budget import Budget

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
TABLE_COLUMNS = ["point", "status", "step_time_median_s", "step_time_min_s", "step_time_max_s", "tokens_per_s",
                 "tflops", "mfu",
                 "gpu_peak_allocated_gib", "host_peak_rss_gib", "host_bytes_per_param", "error"]


def resolve_device(device: str) -> str:
    """``auto`` -> cuda if a GPU is usable, else cpu; ``cuda`` without a GPU is refused (SweepError)."""
    from .sweeps import SweepError

    if device != "auto" and not device.startswith("cuda"):
        return device
    import torch

    if torch.cuda.is_available():
        return "cuda" if device == "auto" else device
    if device == "auto":
        return "cpu"
    raise SweepError(f"device={device} but this machine has no usable CUDA GPU (torch {torch.__version__}, "
                     f"CUDA build: {torch.version.cuda or 'none'}); use device=cpu or device=auto")


def machine_label(device: str, gpu_name: str) -> str:
    """``<hardware>-<host>``: the folder a run on this machine writes to by default (runs/<label>/)."""
    import platform

    from .envinfo import short_gpu_name
    from .schema import sanitize

    hw = "cpu" if device == "cpu" else (short_gpu_name(gpu_name) if gpu_name else "gpu")
    return sanitize(f"{hw}-{platform.node() or 'host'}")


def results_root(cfg, device: str, gpu_name: str) -> Path:
    return Path(cfg.results_dir) if cfg.results_dir else Path("runs") / machine_label(device, gpu_name)


def check_same_machine(csv_path: Path, gpu_name: str, allow: bool) -> None:
    """Refuse to append to a results CSV measured on another GPU/CPU (e.g. CPU rows into the committed
    H200 results), unless ``mix_machines=true``."""
    from .sweeps import SweepError

    if allow or schema.read_header(csv_path) is None:
        return
    theirs = sorted({g for g in schema.read_results(csv_path)["gpu_name"] if g} - {gpu_name})
    if theirs:
        raise SweepError(f"{csv_path} holds rows measured on {', '.join(theirs)}; this machine is "
                         f"{gpu_name or '?'}. Leave results_dir unset (runs/<machine>/), pick another one, or "
                         f"pass mix_machines=true to add to it on purpose")


def hydra_option_loader():
    """``load(group, name)``: the config of a group option (e.g. system=zero3) as hydra composes it,
    through the same search path as this run (so configs added with hydra.searchpath are found)."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    base = [o for o in hc.overrides.hydra if o.split("=", 1)[0].lstrip("+~") == "hydra.searchpath"]
    sweep_choice = hc.runtime.choices.get("sweep")

    def load(group: str, name: str):
        overrides = base + ([f"sweep={sweep_choice}"] if sweep_choice else []) + [f"{group}={name}"]
        try:
            return compose(config_name=hc.job.config_name, overrides=overrides)[group]
        except Exception as e:
            from .sweeps import SweepError

            raise SweepError(f"the sweep needs {group}={name}, which does not compose:\n{str(e).strip()}") from None

    return load


def build_kernels_ahead(jobs) -> None:
    """Build the host AdamW C++ kernel once, before any point is timed (a first build inside a point would
    count the compiler's minutes and memory as the point's). ``megatrain.kernels`` builds it in a child
    process, bounded in time; a failure is one warning line and the engine falls back to torch's AdamW."""
    import os

    if not any(j.system == "megatrain" for j in jobs) or os.environ.get("MEGATRAIN_HOST_ADAMW") == "torch":
        return
    try:
        from megatrain import kernels
    except ImportError:  # an engine without the build-ahead module: the first point builds it
        return
    try:
        kernels.build()
    except Exception as exc:  # noqa: BLE001 - a failed build is the engine's fallback, not the sweep's end
        print(f"warning: {kernels.fallback_warning(exc)}", file=sys.stderr, flush=True)


def cli_option_keys() -> frozenset:
    """The ``system.options.<key>`` keys set on the command line (they must not lose to a sweep variant)."""
    from hydra.core.hydra_config import HydraConfig

    keys = [o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task if "=" in o]
    return frozenset(k.split(".", 2)[2] for k in keys if k.startswith("system.options.") and k.count(".") >= 2)


def human(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


def _table(df) -> str:
    import pandas as pd

    if df.empty:
        return "(no rows)"
    gpu_only = ("tflops", "mfu", "gpu_peak_allocated_gib")
    cols = [c for c in TABLE_COLUMNS if not ((df["hardware"] == "cpu").all() and c in gpu_only)]
    t = df[cols].copy()
    t["error"] = t["error"].fillna("").astype(str).str.slice(0, 60)
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 70):
        return t.to_string(index=False, float_format=lambda x: f"{x:.4g}", na_rep="")


def run(cfg) -> dict:
    """Run the sweep described by the composed config; returns counters (also printed)."""
    from tqdm import tqdm

    from . import cache as K, envinfo, launch as L, skips, sweeps

    t_start = time.time()
    device = resolve_device(cfg.device)
    env = envinfo.collect(device)
    jobs = sweeps.expand(cfg, hydra_option_loader(), device=device, gpu_name=env["gpu_name"],
                         cli_options=cli_option_keys())
    sweeps.validate(jobs)  # every point checked before anything runs
    results = results_root(cfg, device, env["gpu_name"])
    out = (results / cfg.sweep.name).resolve()
    csv_path = out / "results.csv"
    schema.check_header(csv_path)  # refuse before running anything
    check_same_machine(csv_path, env["gpu_name"], cfg.mix_machines)
    cache = K.cache_root(results, cfg.cache_dir)
    status = schema.point_status(csv_path)
    run_cfg = OmegaConf.to_container(cfg, resolve=True)

    estimates: dict[str, dict | None] = {}  # one host estimate per job (the plan is not cheap)
    print(f"sweep {cfg.sweep.name}: {len(jobs)} point(s) on {device}"
          f"{' (' + env['gpu_name'] + ')' if env['gpu_name'] and device != 'cpu' else ''}; "
          f"results in {csv_path}", flush=True)
    for job in jobs:
        job.point_dir, job.cache_dir = str(out / job.id), str(cache)
        engine_init = job.system == "megatrain" and not cfg.shared_init
        job.init_dir = "" if (engine_init or job.sft) else str(K.init_paths(job.spec, job.seed, cache)[1])
        est = skips.host_estimate(job, device, env.get("gpu_total_bytes"))
        job.host_estimate_bytes = est["total_bytes"] if est else None
        job.tiers = est.get("tiers") if est and job.system == "megatrain" else None
        estimates[job.id] = est
    if cfg.dry_run:
        for job in jobs:
            prev = status.get(job.id)
            if prev in schema.DONE_STATUSES and not cfg.redo:
                action = f"done ({prev})"
            else:
                est = estimates[job.id]
                action = str(skips.skip_reason(job, device=device, available_host=skips.available_host(job),
                                                gpu_total=env.get("gpu_total_bytes"), estimate=est) or "run")
                if est and action == "run" and not record(job.system).on_device:
                    action += f" (engine host estimate {est['total_bytes'] / GIB:.1f} GiB)"
            print(f"  {job.id}  P={human(job.num_params)}  {action}")
        return {"points": len(jobs), "launched": 0, "ok": 0, "done_ok": 0}

    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(schema.csv_readme(cfg.sweep.name))
    build_kernels_ahead(jobs)
    with open(out / "runs.jsonl", "a") as f:  # one line per invocation: environment and config
        f.write(json.dumps({"env": env, "config": run_cfg}, default=str) + "\n")

    budget = Budget(cfg.time_budget_s, start=t_start)
    counts = {"points": len(jobs), "launched": 0, "done": 0, "skipped": 0, "not_started": 0, "ok": 0,
              "done_ok": 0}
    statuses: dict[str, int] = {}
    # the bar on a terminal; in a log (not a TTY) the per-point lines below carry the progress
    bar = tqdm(jobs, desc=f"sweep {cfg.sweep.name}", unit="point", file=sys.stderr, dynamic_ncols=True,
               disable=not sys.stderr.isatty())
    width = len(str(len(jobs)))
    for i, job in enumerate(bar, 1):
        tag = f"{i:{width}d}/{len(jobs)}"
        bar.set_postfix_str(job.id, refresh=True)
        if not cfg.redo and status.get(job.id) in schema.DONE_STATUSES:
            counts["done"] += 1
            counts["done_ok"] += status[job.id] == "ok"
            bar.write(f"{tag} [done]    {job.id} ({status[job.id]}; redo=true re-runs it)")
            continue
        # the point's own view of host RAM: a host_ram_gib profile's cap, as its engine will plan with it
        skip = skips.skip_reason(job, device=device, available_host=skips.available_host(job),
                                  gpu_total=env.get("gpu_total_bytes"), estimate=estimates[job.id])
        if skip:
            result = {"status": "skipped", "error": skip.text, "skip": skip}
            counts["skipped"] += 1
        else:
            timeout, init_timeout = cfg.timeout_s, cfg.init_timeout_s
            why, left = budget.why_not_start(job), budget.left()
            if why and left <= 0:  # spent: nothing more starts
                counts["not_started"] += len(jobs) - i + 1
                bar.write(f"{tag} [budget]  {why}: {len(jobs) - i + 1} point(s) not started; rerun to continue")
                break
            if why:  # too little left for this shape: a smaller one further on may still fit
                counts["not_started"] += 1
                bar.write(f"{tag} [budget]  {job.id} not started: {why}; rerun to continue")
                continue
            if left is not None:
                timeout, init_timeout = min(timeout, left), min(init_timeout, left)
            bar.write(f"{tag} [run]     {job.id}")
            result = L.launch(job, timeout=timeout, init_timeout=init_timeout, log=lambda m: bar.write(m))
            if result.get("status") == "timeout" and timeout < cfg.timeout_s:
                result["reason"] = "budget_cut"
                result["error"] += L.rerun_note(clipped=True)
            elif result.get("reason") == "partial":  # an ok row from the steps it finished; not done
                result["error"] += L.rerun_note(clipped=timeout < cfg.timeout_s)
            counts["launched"] += 1
        row = schema.make_row(row=L.to_row(job, result, env))
        schema.append_row(csv_path, row)
        budget.record(job, row)  # its shape's wall time: what a later point of that shape needs of the budget
        statuses[row["status"]] = statuses.get(row["status"], 0) + 1
        counts["ok"] += row["status"] == "ok"
        if row["status"] in ("timeout", "error") and row["reason"] != "budget_cut":  # not a memory verdict
            counts.setdefault("failed", []).append(f"{job.id} ({row['status']})")
        bar.write(f"{tag} [{row['status']}]{' ' * max(1, 8 - len(row['status']))}{job.id}  {_tail(row, device)}")
    bar.close()

    ids = {job.id for job in jobs}
    df = schema.latest(schema.read_results(csv_path))
    df = df[df["point"].isin(ids)]
    print(f"\n{_table(df)}\n")
    summary = ", ".join(f"{k}={v}" for k, v in sorted(statuses.items())) or "none"
    print(f"sweep {cfg.sweep.name}: {counts['points']} points: {counts['launched']} launched, "
          f"{counts['skipped']} skipped, {counts['done']} already done"
          f"{'; ' + str(counts['not_started']) + ' not started (time budget)' if counts['not_started'] else ''}"
          f"; this run: {summary}; "
          f"{time.time() - t_start:.0f}s; results: {csv_path}", flush=True)
    if cfg.post:
        _post(results.resolve(), cfg.plots_dir)
    return counts


def _tail(row: dict, device: str) -> str:
    """What a finished point's line says: TFLOPS on a GPU, tokens/s on the CPU, else the error."""
    if row.get("status") == "ok" and row.get("tokens_per_s"):
        if device == "cpu":
            return f"{float(row['tokens_per_s']):,.0f} tokens/s"
        return f"{float(row['tflops']):.1f} TFLOPS"
    return (row.get("error") or "")[:120]


def failure_message(counts: dict, name: str) -> str | None:
    """One line saying why a sweep failed: a point timed out or raised (any failure but a memory verdict:
    skipped by the memory rules, GPU or host out of memory), naming those points; or points were launched
    and none succeeded. None when the sweep did its job."""
    failed = counts.get("failed") or []
    if failed:
        return (f"sweep {name}: {len(failed)} point(s) failed for a reason other than memory: {', '.join(failed)}; "
                f"see each point's log.txt")
    if counts.get("ok") or counts.get("done_ok") or not counts.get("launched"):
        return None
    return (f"sweep {name}: no point succeeded ({counts['launched']} launched, {counts['skipped']} skipped, "
            f"{counts['done']} done before without success); see the table above and each point's log.txt")


def _post(results: Path, plots_dir: str | None) -> None:
    """Figures and REPORT.md from this results folder's CSVs alone (the analysis package, in its own
    process: the runner never imports it), so every sweep leaves something a person can read. A failure
    here must not hide the sweep's results, which are already on disk."""
    import subprocess

    out = ["--out", plots_dir] if plots_dir else []
    for cmd in (["analysis.plots", "--results", str(results), *out],
                ["analysis.report", "--results", str(results), "--out", str(results / "REPORT.md"),
                 *(["--plots", plots_dir] if plots_dir else [])]):
        try:
            proc = subprocess.run([sys.executable, "-m", *cmd], cwd=REPO_ROOT, timeout=600)
        except subprocess.TimeoutExpired:
            print(f"warning: {cmd[0]} took over 600 s and was stopped", file=sys.stderr)
            continue
        if proc.returncode:
            print(f"warning: {cmd[0]} exited with {proc.returncode}; the sweep's rows are on disk", file=sys.stderr)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _hydra_main(cfg) -> None:
    from .sweeps import SweepError

    try:
        counts = run(cfg)
    except (SweepError, schema.SchemaError) as e:  # bad sweep definitions: a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    message = failure_message(counts, cfg.sweep.name)
    if message:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    message = C.check_overrides(sys.argv[1:])
    if message:
        print(message, file=sys.stderr)
        sys.exit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
