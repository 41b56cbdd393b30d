"""Sweep runner: ``python -m experiments.run sweep=<name> [overrides]``.

    python -m experiments.run sweep=smoke                        # CPU pipeline check (CI)
    python -m experiments.run sweep=size                         # every system, 7B..120B
    python -m experiments.run sweep=ablation system=megatrain model=qwen2.5-7b
    python -m experiments.run sweep=context only='[megatrain__*]' timeout_s=900
    python -m experiments.run sweep=depth dry_run=true            # list points and what would happen
    python -m experiments.run sweep=tokens redo=true              # re-run points already done

Every point runs in its own process (``experiments.point``) with a timeout; its row is appended to
``<results_dir>/<sweep>/results.csv`` as soon as it ends, whatever happened (ok, skipped, gpu_oom,
host_oom, timeout, error), and the sweep goes on. A rerun skips points whose last row is ok/skipped
(``redo=true`` re-runs them) and retries the others. See docs/runner.md.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import hydra
from omegaconf import OmegaConf

from . import config as C  # registers the schemas in hydra's ConfigStore
from . import schema

GIB = 2**30
TABLE_COLUMNS = ["point", "status", "step_time_median_s", "tokens_per_s", "tflops", "mfu",
                 "gpu_peak_allocated_gib", "host_peak_rss_gib", "host_bytes_per_param", "error"]


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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


def human(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


def _table(df) -> str:
    import pandas as pd

    if df.empty:
        return "(no rows)"
    t = df[TABLE_COLUMNS].copy()
    t["error"] = t["error"].fillna("").astype(str).str.slice(0, 60)
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 70):
        return t.to_string(index=False, float_format=lambda x: f"{x:.4g}", na_rep="")


def run(cfg) -> dict:
    """Run the sweep described by the composed config; returns counters (also printed)."""
    from tqdm import tqdm

    from . import envinfo, point as P, sweeps

    t_start = time.time()
    device = resolve_device(cfg.device)
    env = envinfo.collect(device)
    points = sweeps.expand(cfg, hydra_option_loader(), device=device, gpu_name=env["gpu_name"])
    out = (Path(cfg.results_dir) / cfg.sweep.name).resolve()
    csv_path = out / "results.csv"
    schema.check_header(csv_path)  # refuse before running anything
    cache = P.cache_root(cfg.results_dir, cfg.cache_dir)
    status = schema.point_status(csv_path)
    run_cfg = OmegaConf.to_container(cfg, resolve=True)

    print(f"sweep {cfg.sweep.name}: {len(points)} point(s) on {device}"
          f"{' (' + env['gpu_name'] + ')' if env['gpu_name'] and device != 'cpu' else ''}; "
          f"results in {csv_path}", flush=True)
    if cfg.dry_run:
        from megatrain.memory import available_host_bytes

        avail = available_host_bytes()
        for p in points:
            prev = status.get(p.id)
            if prev in schema.DONE_STATUSES and not cfg.redo:
                action = f"done ({prev})"
            else:
                est = sweeps.host_estimate(p, device)
                action = sweeps.skip_reason(p, device=device, available_host=avail,
                                            gpu_total=env.get("gpu_total_bytes"), estimate=est) or "run"
                if est and action == "run" and p.system not in sweeps.ON_GPU_SYSTEMS:
                    action += f" (engine host estimate {est['total_bytes'] / GIB:.1f} GiB)"
            print(f"  {p.id}  P={human(p.num_params)}  {action}")
        return {"points": len(points), "launched": 0}

    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(schema.csv_readme(cfg.sweep.name))
    with open(out / "runs.jsonl", "a") as f:  # one line per invocation: environment and config
        f.write(json.dumps({"env": env, "config": run_cfg}, default=str) + "\n")

    counts = {"points": len(points), "launched": 0, "done": 0, "skipped": 0, "not_started": 0}
    statuses: dict[str, int] = {}
    from megatrain.memory import available_host_bytes

    # the bar on a terminal; in a log (not a TTY) the per-point lines below carry the progress
    bar = tqdm(points, desc=f"sweep {cfg.sweep.name}", unit="point", file=sys.stderr, dynamic_ncols=True,
               disable=not sys.stderr.isatty())
    width = len(str(len(points)))
    for i, p in enumerate(bar, 1):
        tag = f"{i:{width}d}/{len(points)}"
        bar.set_postfix_str(p.id, refresh=True)
        if not cfg.redo and status.get(p.id) in schema.DONE_STATUSES:
            counts["done"] += 1
            bar.write(f"{tag} [done]    {p.id} ({status[p.id]}; redo=true re-runs it)")
            continue
        pt = p.to_dict()
        init_dir = P.init_paths(p.spec, cfg.seed, cache)[1]
        pt.update(point_dir=str(out / p.id), init_dir=str(init_dir), cache_dir=str(cache), steps=cfg.steps,
                  warmup_steps=cfg.warmup_steps, seed=cfg.seed, device=device, dtype=cfg.dtype,
                  torch_threads=cfg.torch_threads,
                  optim=run_cfg["optim"], timeout_s=cfg.timeout_s, run=run_cfg)
        est = sweeps.host_estimate(p, device)
        pt["host_estimate_bytes"] = est["total_bytes"] if est else None
        reason = sweeps.skip_reason(p, device=device, available_host=available_host_bytes(),
                                    gpu_total=env.get("gpu_total_bytes"), estimate=est)
        if reason:
            result = {"status": "skipped", "error": reason}
            counts["skipped"] += 1
        else:
            timeout, init_timeout = cfg.timeout_s, cfg.init_timeout_s
            if cfg.time_budget_s is not None:
                left = cfg.time_budget_s - (time.time() - t_start)
                if left <= 0:
                    counts["not_started"] = len(points) - i + 1
                    bar.write(f"{tag} [budget]  time_budget_s={cfg.time_budget_s:g} reached: "
                              f"{counts['not_started']} point(s) not started; rerun to continue")
                    break
                timeout, init_timeout = min(timeout, left), min(init_timeout, left)
            bar.write(f"{tag} [run]     {p.id}")
            result = P.launch(pt, timeout=timeout, init_timeout=init_timeout, log=lambda m: bar.write(m))
            if result.get("status") == "timeout" and timeout < cfg.timeout_s:
                result["error"] += " (clipped by time_budget_s; a rerun retries it)"
            counts["launched"] += 1
        row = P.to_row(pt, result, env)
        schema.append_row(csv_path, schema.make_row(**row))
        statuses[row["status"]] = statuses.get(row["status"], 0) + 1
        tail = f"{float(row['tflops']):.2f} TFLOPS" if row.get("tflops") else (row["error"] or "")[:120]
        bar.write(f"{tag} [{row['status']}]{' ' * max(1, 8 - len(row['status']))}{p.id}  {tail}")
    bar.close()

    ids = {p.id for p in points}
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
        results = Path(cfg.results_dir)
        _post(results, Path(cfg.plots_dir) if cfg.plots_dir else results.resolve().parent / "plots")
    return counts


def _post(results: Path, plots_dir: Path) -> None:
    """Figures and REPORT.md from the CSVs alone, so every sweep leaves something a person can read.
    A failure here must not hide the sweep's results, which are already on disk."""
    from . import plots, report

    try:
        plots.main(["--results", str(results), "--out", str(plots_dir)])
        report.main(["--results", str(results), "--out", str(results / "REPORT.md"), "--plots", str(plots_dir)])
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        print(f"warning: figures/report not regenerated: {type(exc).__name__}: {exc}", file=sys.stderr)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _hydra_main(cfg) -> None:
    from .sweeps import SweepError

    try:
        run(cfg)
    except (SweepError, schema.SchemaError) as e:  # bad sweep definitions: a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    message = C.check_overrides(sys.argv[1:])
    if message:
        print(message, file=sys.stderr)
        sys.exit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
