"""Engine checks on the GPU machine, written up under results/engine/.

    python scripts/engine_bench.py parity --out DIR            # bf16: engine vs all-on-GPU HF, 20 steps
    python scripts/engine_bench.py throughput --model qwen2.5-3b --batch 16 --seq 1024 \
        --variant full --variant no_double_buffer --native --out DIR
    python scripts/engine_bench.py long_context --model qwen2.5-7b --batch 1 --seq 131072 --out DIR
        # one sequence length per process (host peak RSS is per process); appends DIR/long_context.jsonl

Every variant runs in this one process, one after the other, so ratios compare like with like. Results
are JSON lines in DIR/<mode>.jsonl plus the environment in DIR/env.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain import EngineConfig, MegaTrain, OptimConfig, get_preset, step_flops  # noqa: E402
from megatrain.data import synthetic_batch  # noqa: E402
from megatrain.system import IGNORE_INDEX, lr_multiplier, shift_labels  # noqa: E402

VARIANTS = {
    "full": {},
    "no_double_buffer": dict(num_slots=1),
    "no_slab_pool": dict(grad_slabs=0),
    "no_opt_overlap": dict(overlap_optimizer=False),
    "ckpt2": dict(checkpoint_interval=2),
    "ckpt4": dict(checkpoint_interval=4),
    "bf16_stream": dict(stream_dtype="bf16"),
    "slots3": dict(num_slots=3),
}


def env_info() -> dict:
    sha = os.environ.get("MEGATRAIN_GIT_SHA") or subprocess.run(
        ["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    import psutil
    import transformers

    info = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), git_sha=sha, torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version(),
                torch_threads=torch.get_num_threads(), command=" ".join(sys.argv),
                host_ram_gib=psutil.virtual_memory().total / 2**30, cpu_count=os.cpu_count())
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return info


def native_train(hf_config, state_dict, batches, optim: OptimConfig, checkpointing: bool):
    """All-on-GPU HF training: fp32 params, bf16 autocast, fused AdamW, HF activation checkpointing."""
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=False)
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_multiplier(s, optim.warmup_steps, optim.total_steps, optim.min_lr_ratio))
    torch.cuda.reset_peak_memory_stats()
    out = []
    for batch in batches:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids = batch["input_ids"].cuda()
        targets = shift_labels(batch["labels"]).cuda()
        denom = int((targets != IGNORE_INDEX).sum())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = model.model(input_ids=ids).last_hidden_state
        loss = torch.zeros((), device="cuda")
        # chunked head + CE, the same quantity the engine computes
        flat_h, flat_t = hidden.flatten(0, 1), targets.flatten()
        for s in range(0, flat_h.shape[0], 4096):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model.lm_head(flat_h[s:s + 4096])
            loss = loss + F.cross_entropy(logits.float(), flat_t[s:s + 4096], ignore_index=IGNORE_INDEX,
                                          reduction="sum") / denom
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        torch.cuda.synchronize()
        out.append(dict(loss=value, step_time_s=time.perf_counter() - t0, grad_norm=float(gn)))
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out, peak


def cmd_parity(args) -> None:
    spec = get_preset(args.model).scaled(depth=args.layers)
    hf = spec.to_hf_config("sdpa")
    optim = OptimConfig(lr=args.lr, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=2, total_steps=args.steps)
    data = [synthetic_batch(spec.vocab_size, args.batch, args.seq, 0, s) for s in range(args.steps)]
    engine = MegaTrain.from_config(hf, EngineConfig(device="cuda", optim=optim, checkpoint_interval=2))
    init = {k: v.clone() for k, v in engine.state_dict().items()}
    eng = [engine.step(b).to_dict() for b in data]
    engine.close()
    del engine
    gc.collect()
    nat, _ = native_train(hf, init, data, optim, checkpointing=True)
    rows = []
    for s, (e, n) in enumerate(zip(eng, nat)):
        rows.append(dict(step=s, engine=e["loss"], native=n["loss"], abs_diff=abs(e["loss"] - n["loss"]),
                         rel_diff=abs(e["loss"] - n["loss"]) / abs(n["loss"])))
        print(f"step {s:2d} engine {e['loss']:.5f} native {n['loss']:.5f} rel {rows[-1]['rel_diff']:.2e}")
    summary = dict(model=spec.to_dict(), steps=args.steps, batch=args.batch, seq=args.seq,
                   max_rel_diff=max(r["rel_diff"] for r in rows), max_abs_diff=max(r["abs_diff"] for r in rows),
                   loss_drop_engine=eng[0]["loss"] - eng[-1]["loss"], loss_drop_native=nat[0]["loss"] - nat[-1]["loss"])
    print(json.dumps(summary))
    _write(args.out, "parity", dict(rows=rows, summary=summary))


def measure_engine(spec, variant: str, args) -> dict:
    overrides = dict(VARIANTS[variant])
    overrides.setdefault("checkpoint_interval", args.checkpoint_interval)
    cfg = EngineConfig(device="cuda", optim=OptimConfig(lr=1e-5), micro_batches=args.micro_batches, **overrides)
    t0 = time.perf_counter()
    torch.cuda.reset_peak_memory_stats()
    engine = MegaTrain.from_config(spec.to_hf_config("sdpa"), cfg, tokens_per_step=args.batch * args.seq,
                                   seq_len=args.seq)  # the placement plan sizes activations for this step
    build_s = time.perf_counter() - t0
    steps = []
    try:
        for s in range(args.warmup + args.steps):
            r = engine.step(synthetic_batch(spec.vocab_size, args.batch, args.seq, 0, s))
            steps.append(dict(r.to_dict(), stats=dict(engine.stats)))
            phases = " ".join(f"{k}={v:.3f}" for k, v in engine.stats.items() if k.endswith("_s"))
            print(f"  [{variant}] step {s} loss {r.loss:.4f} {r.step_time_s:.3f}s | {phases}", flush=True)
        engine.synchronize()
        mem = engine.memory()
        loads_per_step = engine.pool.loads / len(steps)
    finally:
        home = getattr(engine, "_boundary_host", None)  # where the boundaries went (long_context reports it)
        _LAST_PLAN["plan"] = dict(home.plan) if home is not None else {}
        engine.close()
        del engine
        gc.collect()
    return summarize(spec, args, f"megatrain[{variant}]", steps, build_s,
                     gpu_peak=mem.gpu_peak_allocated, gpu_reserved=mem.gpu_peak_reserved, host_rss=mem.host_rss,
                     pinned=mem.host_pinned, extra=dict(mem.extra, loads_per_step=loads_per_step,
                                                        config=cfg.to_dict()))


def summarize(spec, args, system, steps, build_s, gpu_peak, host_rss, gpu_reserved=-1, pinned=-1, extra=None):
    import psutil

    timed = [s["step_time_s"] for s in steps[args.warmup:]]
    med = statistics.median(timed)
    tokens = args.batch * args.seq
    p = spec.num_params()
    tflops = step_flops(p, spec.num_layers, spec.hidden_size, args.seq, tokens) / med / 1e12
    row = dict(system=system, model=spec.name, num_params=p, batch=args.batch, seq=args.seq, tokens=tokens,
               step_time_median_s=med, step_times=timed, tflops=tflops, mfu=tflops / 797.5,
               gpu_peak_gib=gpu_peak / 2**30, gpu_reserved_gib=gpu_reserved / 2**30,
               host_peak_rss_gib=max(host_rss, psutil.Process().memory_info().rss) / 2**30,
               host_bytes_per_param=host_rss / p, pinned_gib=pinned / 2**30, build_s=build_s,
               loss_first=steps[0]["loss"], loss_last=steps[-1]["loss"], extra=extra or {})
    print(f"== {system}: {med:.3f} s/step, {tflops:.1f} TFLOPS, GPU peak {row['gpu_peak_gib']:.1f} GiB, "
          f"host RSS {row['host_peak_rss_gib']:.1f} GiB ({row['host_bytes_per_param']:.2f} B/param)", flush=True)
    return row


def cmd_throughput(args) -> None:
    spec = get_preset(args.model).scaled(depth=args.layers)
    rows = []
    for variant in args.variant or ["full"]:
        try:
            rows.append(measure_engine(spec, variant, args))
        except Exception as exc:  # record and go on: one failing variant must not lose the others
            rows.append(dict(system=f"megatrain[{variant}]", error=f"{type(exc).__name__}: {exc}"))
            print("FAILED", variant, rows[-1]["error"], flush=True)
        _write(args.out, "throughput", rows[-1], append=True)
    if args.native:
        try:
            data = [synthetic_batch(spec.vocab_size, args.batch, args.seq, 0, s) for s in range(args.warmup + args.steps)]
            nat, peak = native_train(spec.to_hf_config("sdpa"), None, data, OptimConfig(lr=1e-5), True)
            rows.append(summarize(spec, args, "native", nat, 0.0, gpu_peak=peak,
                                  host_rss=__import__("psutil").Process().memory_info().rss))
        except Exception as exc:
            rows.append(dict(system="native", error=f"{type(exc).__name__}: {exc}"))
            print("FAILED native", rows[-1]["error"], flush=True)
        _write(args.out, "throughput", rows[-1], append=True)
    print("\nsystem                         s/step   TFLOPS  GPU GiB  host GiB  B/param")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:30s} ERROR {r['error'][:80]}")
        else:
            print(f"{r['system']:30s} {r['step_time_median_s']:7.3f} {r['tflops']:8.1f} {r['gpu_peak_gib']:8.1f} "
                  f"{r['host_peak_rss_gib']:9.1f} {r['host_bytes_per_param']:8.2f}")


def cmd_long_context(args) -> None:
    """One long sequence: max_position_embeddings raised to it, chunked MLP and boundary offload as asked
    ("auto" by default). Records the K, MLP chunk and boundary-store choices with the usual columns; a
    run that does not fit records which memory ran out and the numbers the error gives."""
    from megatrain.chunked_mlp import resolve_chunk

    spec = get_preset(args.model).scaled(depth=args.layers)
    VARIANTS["long_context"] = dict(max_position_embeddings=max(args.seq, spec.max_position_embeddings),
                                    mlp_chunk_tokens=args.mlp_chunk_tokens, boundary_offload=args.boundary_offload)
    choices = dict(checkpoint_interval=args.checkpoint_interval, boundary_offload=args.boundary_offload,
                   mlp_chunk_tokens=args.mlp_chunk_tokens,
                   mlp_chunk_resolved=resolve_chunk(args.mlp_chunk_tokens, args.batch * args.seq // args.micro_batches))
    try:
        row = measure_engine(spec, "long_context", args)
        row.update(choices, boundary_plan=_LAST_PLAN.get("plan", {}))
        # "auto" is the placement plan's decision since the plan chooses the MLP chunk (megatrain/placement.py): the
        # value the layers ran with is the engine's, the threshold rule above is only what "auto" once meant
        row["mlp_chunk_resolved"] = row["extra"].get("mlp_chunk_tokens", row["mlp_chunk_resolved"])
    except (torch.cuda.OutOfMemoryError, MemoryError) as exc:  # which memory ran out, and by how much
        which = "gpu" if isinstance(exc, torch.cuda.OutOfMemoryError) else "host"
        row = dict(system="megatrain[long_context]", model=spec.name, batch=args.batch, seq=args.seq,
                   error=f"{type(exc).__name__}: {exc}", out_of=which, boundary_plan=_LAST_PLAN.get("plan", {}),
                   gpu_peak_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else -1,
                   **choices)
        print("FAILED", row["error"][:300], flush=True)
    _write(args.out, "long_context", row, append=True)


_LAST_PLAN: dict = {}  # the boundary plan of the engine's last step, kept past engine.close()


def _write(out, name, payload, append=False) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "env.json").write_text(json.dumps(env_info(), indent=2))
    with open(out / f"{name}.jsonl", "a" if append else "w") as f:
        f.write(json.dumps(payload) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["parity", "throughput", "long_context"])
    p.add_argument("--model", default="qwen2.5-3b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--checkpoint-interval", type=int, default=1)
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    p.add_argument("--native", action="store_true", help="also run all-on-GPU HF training in the same process")
    p.add_argument("--mlp-chunk-tokens", type=int, default=0, help="long_context: -1 never, 0 auto, N tokens")
    p.add_argument("--boundary-offload", default="auto", choices=["auto", "gpu", "host"], help="long_context")
    p.add_argument("--out", default="results/engine/run")
    args = p.parse_args()
    {"parity": cmd_parity, "throughput": cmd_throughput, "long_context": cmd_long_context}[args.mode](args)


if __name__ == "__main__":
    main()
