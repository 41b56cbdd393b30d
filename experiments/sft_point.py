"""One point of an SFT sweep (``sweep.sft`` set, e.g. ``sweep=accuracy_sft``), in its own process.

Started by ``experiments.point`` for a job whose ``sft`` is set. Every system of the sweep runs this same
code: the model (a GGUF converted once into ``<cache>/gguf/``, or an HF folder), the same generated
problems, the same batches in the same order (``megatrain.sft.batch_order`` from the run's seed), the same
optimizer settings; it trains ``steps`` steps and evaluates with ``megatrain.sft.Evaluator`` (one plain fp32
HF model that receives the system's fp32 masters) at step 0, every ``eval_every`` steps and at the end.

Files in the point folder: ``metrics.jsonl`` (one line per step: loss, grad_norm, lr, clipped, and for the
engine its speculation counters), ``sft.jsonl`` (kind "eval": step, eval_loss, exact/numeric match,
samples; kind "summary": accuracy before/after, clip fraction, speculation, timings) and ``result.json``
(the runner's row: status, step times, memory).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
import time
from pathlib import Path

from .point_frame import (build_measured, close_point, finite, open_point, record_failure, record_memory, start_point,
                          timed_step)
from .sft_config import SFTConfig
from .sweeps import Job

SPEC_KEYS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size",
             "vocab_size": "vocab_size", "tie_embeddings": "tie_word_embeddings"}


def sft_config(job: Job) -> SFTConfig:
    return SFTConfig(**(job.sft or {}))


# -- the model folder ----------------------------------------------------------------------------
def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def model_folder(cfg: SFTConfig, cache_dir: str, log=print) -> Path:
    """The HF folder every system of the sweep loads: ``model_dir``, or the GGUF converted once into
    ``<cache>/gguf/<name>-<sha12>`` (atomically: a killed conversion leaves nothing half-written)."""
    if cfg.model_dir:
        return Path(cfg.model_dir)
    from megatrain.gguf_import import convert

    src = Path(cfg.gguf)
    out = Path(cache_dir) / "gguf" / f"{src.stem}-{file_digest(src)[:12]}"
    if not (out / "config.json").is_file():
        t = time.time()
        convert(src, out)
        log(f"[sft] converted {src} -> {out} in {time.time() - t:.1f}s")
    return out


def check_spec(folder: Path, job: Job) -> None:
    """The run's model preset must describe this model (rows, FLOPs and memory rules come from it)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(folder))
    bad = [f"{k}: preset {job.spec[k]} vs model {getattr(hf, v)}" for k, v in SPEC_KEYS.items()
           if k in job.spec and job.spec[k] != getattr(hf, v)]
    if bad:
        raise ValueError(f"model preset {job.model!r} does not describe {folder}: " + "; ".join(bad))


# -- the run --------------------------------------------------------------------------------------
def _engine_counters(system) -> dict:
    """The engine's per-step speculation record (MegaTrain.stats), where the system has one."""
    phases = getattr(system, "phase_times", None)
    if phases is None:
        return {}
    st = phases()
    return {k: finite(st.get(k)) for k in ("speculated", "rollbacks", "clipped", "skipped", "early_groups")
            if k in st}


def summary(job: Job, records: list[dict], evals: list[dict]) -> dict:
    """Before/after accuracy and loss, clip fraction, gradient norms and speculation, per point."""
    max_norm = job.optim.max_grad_norm
    norms = [r["grad_norm"] for r in records if r.get("grad_norm") is not None]
    acc = [e for e in evals if "exact_match" in e]
    out = {"steps": len(records), "max_grad_norm": max_norm,
           "eval_loss_before": evals[0]["eval_loss"] if evals else None,
           "eval_loss_after": evals[-1]["eval_loss"] if evals else None,
           "exact_match_before": acc[0]["exact_match"] if acc else None,
           "exact_match_after": acc[-1]["exact_match"] if acc else None,
           "numeric_match_before": acc[0]["numeric_match"] if acc else None,
           "numeric_match_after": acc[-1]["numeric_match"] if acc else None,
           "train_loss_first": records[0]["loss"] if records else None,
           "train_loss_last": records[-1]["loss"] if records else None,
           "grad_norm_median": statistics.median(norms) if norms else None,
           "grad_norm_max": max(norms) if norms else None,
           # clipping fires when the pre-clip global norm exceeds max_grad_norm (the same rule in every system)
           "clip_fraction": (sum(n > max_norm for n in norms) / len(norms)) if (norms and max_norm) else 0.0}
    spec = [r["speculated"] for r in records if r.get("speculated") is not None]
    if spec:
        out["speculated_fraction"] = sum(s > 0 for s in spec) / len(spec)
        out["rollbacks"] = sum(r.get("rollbacks") or 0 for r in records)
    timed = [r["step_time_s"] for r in records[job.warmup_steps:]]
    if timed:
        out["step_time_median_s"] = statistics.median(timed)
    return out


def train(job: Job, applied: dict | None = None) -> int:
    """Body of an SFT point process. Always writes result.json; exit status 0 only for ok."""
    import torch

    from baselines.monitor import Monitor
    from megatrain import sft
    from transformers import AutoTokenizer

    from .sft_task import arithmetic

    pdir, result, log = open_point(job, applied)
    t_start, records, system, mon, cuda = time.time(), [], None, None, job.device.startswith("cuda")
    evals: list[dict] = []
    try:
        start_point(job, pdir, result)
        cfg = sft_config(job)
        folder = model_folder(cfg, job.cache_dir, log)
        check_spec(folder, job)
        result["model_dir"] = str(folder)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        fmt = sft.ChatFormat(tokenizer, system_prompt=cfg.system_prompt)
        train_set, held_out = arithmetic(cfg.op, cfg.digits, cfg.n_train, cfg.n_eval, cfg.task_seed, cfg.digits2)
        encoded = [fmt.encode(q, a) for q, a in train_set]
        longest = max(len(e) for e in encoded)
        if longest > job.seq_len:
            raise ValueError(f"the longest training example has {longest} tokens > seq_len {job.seq_len}")
        order = sft.batch_order(len(encoded), job.batch_size, job.steps, job.seed)
        log(f"[sft] {job.id}: {job.system} ({job.variant}) on {job.device}; {folder.name}; {len(train_set)} train / "
            f"{len(held_out)} held-out '{cfg.op}' problems ({cfg.digits} digits), {job.steps} steps of "
            f"{job.batch_size} examples (<= {longest} of {job.seq_len} tokens); torch {torch.__version__}")
        if cuda:
            result["gpu_name"] = torch.cuda.get_device_name(torch.device(job.device))
        evaluate = sft.Evaluator(folder, fmt, held_out, device=job.device, seq_len=job.seq_len,
                                 batch_size=cfg.eval_batch, gen_batch=cfg.gen_batch, max_new_tokens=cfg.max_new_tokens)
        mon = Monitor(interval=0.2, gpu=cuda).start()
        system = build_measured(dataclasses.replace(job, init_dir=str(folder)), pdir, result, log, "sft")
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        with open(pdir / "metrics.jsonl", "a") as mf, open(pdir / "sft.jsonl", "a") as ef:
            def write(f, row):
                f.write(json.dumps(row, default=str) + "\n")
                f.flush()

            def run_eval(step: int) -> None:
                with_acc = step in (0, job.steps) or (cfg.accuracy_every and step % cfg.accuracy_every == 0)
                t = time.time()
                row = {"kind": "eval", "step": step, **evaluate(system.state_dict(), accuracy=bool(with_acc))}
                row["eval_s"] = time.time() - t
                evals.append(row)
                write(ef, row)
                acc = f"  exact {row['exact_match']:.3f}  numeric {row['numeric_match']:.3f}" if with_acc else ""
                log(f"[sft] step {step:4d} held-out loss {row['eval_loss']:.4f}{acc}  ({row['eval_s']:.1f}s)")

            run_eval(0)
            for i, idx in enumerate(order):
                if cfg.pack:
                    batch, _ = sft.pack_batch([encoded[j] for j in idx], job.batch_size, job.seq_len, fmt.pad_id)
                else:
                    batch = sft.pad_batch([encoded[j] for j in idx], job.seq_len, fmt.pad_id)
                rec = {**timed_step(system, batch, i, job, mon, sync), **_engine_counters(system)}
                write(mf, rec)
                records.append(rec)
                if (i + 1) % cfg.eval_every == 0 or i + 1 == job.steps:
                    run_eval(i + 1)
            write(ef, {"kind": "summary", "system": job.system, "variant": job.variant, **summary(job, records, evals)})
        record_memory(system, result, cuda)
        result["sft"] = summary(job, records, evals)
        nonfinite = [r["step"] for r in records if r["loss"] is None or not math.isfinite(r["loss"])]
        result["status"] = "ok" if not nonfinite else "error"
        result["error"] = "" if not nonfinite else f"non-finite training loss at steps {nonfinite[:5]}"
    except BaseException as e:  # noqa: BLE001 - every failure becomes a row
        record_failure(result, e)
    finally:
        close_point(job, pdir, result, system, mon, records, t_start, log, "sft")
    return 0 if result["status"] == "ok" else 1
