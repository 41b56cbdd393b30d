"""Accuracy parity (the paper's Table 3 at a size we can run): one model, three systems, one loss curve.

    python scripts/accuracy_parity.py --out runs/accuracy_parity             # Qwen2.5-0.5B shape, 300 steps, CUDA
    python scripts/accuracy_parity.py --device cpu --model tiny-qwen2 --steps 6 --eval-every 3 --out /tmp/ap

Split over calls (a per-command time limit): the same arguments but ``--systems``, one ``--cache``
(or the same seed: the init weights are a deterministic function of it), then merge:

    python scripts/accuracy_parity.py --systems native,megatrain --cache C --out A
    python scripts/accuracy_parity.py --systems zero3 --cache C --out B
    python scripts/accuracy_parity.py --merge A/accuracy_parity.jsonl B/accuracy_parity.jsonl --out DIR

ZenFlow (issue 24; not exact AdamW: top-k columns on the GPU every step, the rest on the CPU every
update_interval steps) runs as one more system, its knobs from ``--zenflow`` (JSON over the tutorial's
defaults); it is evaluated on the weights it trains with (its GPU parameters: the host masters miss the
GPU-side column updates between selections), and needs ``--micro-batches 1``:

    python scripts/accuracy_parity.py --systems zenflow --cache C --out Z   # then --merge with the others

Every system (``--systems``, default native,megatrain,zero3; built through ``baselines.build_system``)
loads the same initial weights (one HF folder written once into the init cache, ``experiments.cache``)
and trains ``--steps`` AdamW steps on the same batches: byte-level tokens of the Python standard
library's sources, the last ``--held-out`` fraction of the byte stream kept out of training. Batch i is
``text_batch(train_bytes, ..., seed, step=i)`` for every system. bf16 compute on CUDA, fp32 on CPU.

Held-out loss, at step 0, every ``--eval-every`` steps and at the end: mean token cross-entropy (nats)
over ``--eval-batches`` fixed held-out batches. It is the same computation for every system: the
system's fp32 master weights (``state_dict()``: native's parameters, ZeRO-3's gathered fp32 partitions,
the engine's host store) are copied into one plain HF model kept for evaluation and run forward under
``no_grad`` (bf16 autocast on CUDA); no system's own forward or state is touched. So step 0 is identical
across systems exactly when they start from the same weights.

Output: DIR/accuracy_parity.jsonl (rewritten per run; one line per system and eval point, kind "eval":
system, step, train_loss, eval_loss, wall_s; one kind "summary" line per system with final losses,
steps/s and the environment; kind "error" for a system that failed or was skipped), flushed line by
line. Then the agreement verdict (``agreement``: |eval - eval_native| <= max(0.02, 2 % of eval_native)
at every eval point) and DIR/accuracy_parity.png/.pdf. Exit status 1 when no system produced a row.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from analysis.accuracy import agreement, eval_curves, format_agreement, plot_accuracy, read_rows  # noqa: E402,F401
from megatrain.sft import ReferenceModel  # noqa: E402
from megatrain.spec import PRESETS, get_preset  # noqa: E402
from megatrain.system import IGNORE_INDEX, OptimConfig, shift_labels  # noqa: E402

# The reference first; DeepSpeed, which patches the most global state, last.
DEFAULT_SYSTEMS = ("native", "megatrain", "zero3")
JSONL = "accuracy_parity.jsonl"


# -- arguments ------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="comma-separated registry names")
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--gpu-resident", default="0",
                   help="the engine's gpu_resident: '0' = every layer streamed, host AdamW (the paper's mode)")
    p.add_argument("--zenflow", default=None, metavar="JSON",
                   help='ZenFlow knobs over its defaults (baselines/zenflow.py), e.g. \'{"topk_ratio": 0.1}\'')
    p.add_argument("--held-out", type=float, default=0.1, help="fraction of the byte stream kept for evaluation")
    p.add_argument("--text-bytes", type=int, default=4 << 20, help="bytes of stdlib source to use")
    p.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    p.add_argument("--cache", default=None, help="init-weights cache (default $MEGATRAIN_CACHE or OUT/.init_cache)")
    p.add_argument("--out", default="runs/accuracy_parity")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSONL",
                   help="train nothing: merge these result files into OUT, print the verdict, draw the figure")
    args = p.parse_args(argv)
    for flag in ("steps", "eval_every", "eval_batches", "batch_size", "seq_len", "micro_batches"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not 0 < args.held_out < 1:
        p.error("--held-out must be in (0, 1)")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.zenflow is not None:
        try:
            args.zenflow = json.loads(args.zenflow)
        except ValueError as e:
            p.error(f"--zenflow: not JSON ({e})")
        if not isinstance(args.zenflow, dict):
            p.error("--zenflow: a JSON object of ZenFlow knobs")
    if "zenflow" in args.systems and args.micro_batches != 1:
        p.error("--micro-batches must be 1 with zenflow (its update_interval is DeepSpeed's gradient accumulation)")
    from baselines.registry import SYSTEMS

    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not (args.systems or args.merge):
        p.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    return args


# -- data -----------------------------------------------------------------------------------------
def split_text(text: bytes, held_out: float) -> tuple[bytes, bytes]:
    """(train, held-out): the last ``held_out`` fraction of the byte stream is never trained on."""
    cut = int(len(text) * (1 - held_out))
    return text[:cut], text[cut:]


def train_batch(train: bytes, args, step: int) -> dict:
    from megatrain.data import text_batch

    return text_batch(train, args.batch_size, args.seq_len, args.seed, step)


def held_out_batches(held: bytes, args) -> list[dict]:
    from megatrain.data import text_batch

    return [text_batch(held, args.batch_size, args.seq_len, args.seed, j) for j in range(args.eval_batches)]


# -- evaluation -----------------------------------------------------------------------------------
class Evaluator(ReferenceModel):
    """Mean token CE of fp32 weights on fixed batches, through one plain HF model shared by all systems
    (``megatrain.sft.ReferenceModel``: the same model and weight loading as the SFT sweep's evaluation)."""

    def __init__(self, init_dir, batches: list[dict], device: str, chunk_tokens: int = 4096):
        super().__init__(init_dir, device)
        self.batches = batches
        self.chunk_tokens = chunk_tokens

    @torch.no_grad()
    def __call__(self, weights: dict[str, torch.Tensor]) -> float:
        self.load(weights)
        on_cuda = self.device.type == "cuda"
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_cuda else contextlib.nullcontext()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for batch in self.batches:
            ids = batch["input_ids"].to(self.device)
            targets = shift_labels(batch["labels"]).to(self.device).reshape(-1)
            with autocast:
                hidden = self.model.model(input_ids=ids).last_hidden_state.reshape(-1, self.model.config.hidden_size)
                for s in range(0, hidden.shape[0], self.chunk_tokens):  # never the full [tokens x vocab] logits
                    logits = self.model.lm_head(hidden[s:s + self.chunk_tokens]).float()
                    total += torch.nn.functional.cross_entropy(logits, targets[s:s + self.chunk_tokens],
                                                               ignore_index=IGNORE_INDEX, reduction="sum")
            count += int((targets != IGNORE_INDEX).sum())
        return float(total) / count  # one sync per evaluation


# -- one system -----------------------------------------------------------------------------------
def run_system(name: str, args, init_dir, train: bytes, evaluate: Evaluator, write, env: dict) -> bool:
    """Build ``name``, train it, write its eval rows and summary; False (and an error row) if it failed."""
    from baselines import build_system
    from baselines.registry import record

    base = dict(system=name, model=args.model_name, device=args.device)
    if args.device == "cpu" and not record(name).runs_on_cpu:
        print(f"[{name}] skipped: does not run on a CPU", flush=True)
        write(dict(base, kind="error", status="skipped", error="does not run on a CPU"))
        return False
    optim = OptimConfig(lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm)
    options = {"gpu_resident": args.gpu_resident} if name == "megatrain" else {}
    if name == "zenflow" and args.zenflow:
        options["zenflow"] = args.zenflow
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    t_build = time.perf_counter()
    system = None
    try:
        system = build_system(name, init_dir=init_dir, optim=optim, micro_batches=args.micro_batches,
                              device=args.device, dtype=dtype, options=options,
                              step_shape=(args.batch_size, args.seq_len))
        build_s = time.perf_counter() - t_build
        t0, train_s, losses, last_eval = time.perf_counter(), 0.0, [], 0
        for step in range(args.steps + 1):
            if step % args.eval_every == 0 or step == args.steps:
                eval_loss = evaluate(system.state_dict())  # fp32 masters
                row = dict(base, kind="eval", step=step, train_loss=losses[-1] if losses else None,
                           eval_loss=eval_loss, wall_s=time.perf_counter() - t0, train_s=train_s,
                           train_losses=losses[last_eval:])
                write(row)
                last_eval = len(losses)
                train_txt = "-" if row["train_loss"] is None else f"{row['train_loss']:.4f}"
                print(f"[{name}] step {step}/{args.steps}  train {train_txt}  held-out {eval_loss:.4f}  "
                      f"({row['wall_s']:.1f} s)", flush=True)
            if step == args.steps:
                break
            batch = train_batch(train, args, step)
            t = time.perf_counter()
            losses.append(float(system.step(batch).loss))
            train_s += time.perf_counter() - t
        # steps/s is indicative (step() wall time; the engine's last overlapped update before an eval
        # lands in the eval's sync), not a throughput benchmark.
        # ZenFlow is not exact AdamW: its notes and knobs go with its row
        extra = {k: system.info[k] for k in ("notes", "zenflow", "zenflow_effective") if k in system.info}
        write(dict(base, kind="summary", label=system.name, optimizer=system.info.get("optimizer"), **extra,
                   steps=args.steps, final_train_loss=losses[-1], final_eval_loss=eval_loss,
                   steps_per_s=args.steps / train_s, train_s=train_s, build_s=build_s,
                   wall_s=time.perf_counter() - t0, **env))
        return True
    except Exception as exc:  # noqa: BLE001  (one system failing must not lose the others' rows)
        traceback.print_exc()
        print(f"[{name}] failed: {type(exc).__name__}: {exc}", flush=True)
        write(dict(base, kind="error", status="error", error=f"{type(exc).__name__}: {str(exc)[:500]}"))
        return False
    finally:
        if system is not None:
            system.close()


# -- main -----------------------------------------------------------------------------------------
def open_writer(path: Path):
    """``write(row)``: one JSON line, flushed and fsynced (a dying run keeps every row written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "w")

    def write(row: dict) -> None:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return write, f


def finish(out: Path) -> int:
    """Verdict and figure from OUT/accuracy_parity.jsonl; exit status 1 without any eval row."""
    rows = read_rows(out / JSONL)
    if not eval_curves(rows):
        print("no system produced a row", file=sys.stderr)
        return 1
    print(format_agreement(agreement(rows)), flush=True)
    paths = plot_accuracy(out / JSONL, out / "accuracy_parity.png")
    print("wrote " + ", ".join(str(p) for p in [out / JSONL, *paths]), flush=True)
    return 0


def environment(args, argv, spec, text: bytes) -> dict:
    import hashlib

    from experiments.envinfo import collect

    env = collect(args.device)
    keep = ("gpu_name", "driver", "torch_version", "transformers_version", "deepspeed_version", "git_sha",
            "python", "hostname", "date")
    return dict({k: env[k] for k in keep}, cuda=torch.version.cuda,
                command="python scripts/accuracy_parity.py " + shlex.join(argv),
                num_params=spec.num_params(), num_layers=spec.num_layers,
                tokens_per_step=args.batch_size * args.seq_len,
                batch_size=args.batch_size, seq_len=args.seq_len, micro_batches=args.micro_batches, lr=args.lr,
                weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, gpu_resident=args.gpu_resident,
                eval_batches=args.eval_batches, held_out=args.held_out, seed=args.seed,
                text_bytes=len(text), text_sha1=hashlib.sha1(text).hexdigest()[:12])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = Path(args.out)
    if args.merge:
        write, f = open_writer(out / JSONL)
        with f:
            for path in args.merge:
                for row in read_rows(path):
                    write(row)
        return finish(out)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda but CUDA is not available (use --device cpu)", file=sys.stderr)
        return 2

    from experiments.cache import cache_root, ensure_init_dir
    from megatrain.data import stdlib_text_bytes

    spec = get_preset(args.model).scaled(depth=args.layers)
    args.model_name = spec.name + (f"-L{spec.num_layers}" if args.layers else "")
    init_dir = ensure_init_dir(spec.to_dict(), args.seed, cache_root(out, args.cache))
    text = stdlib_text_bytes(args.text_bytes)
    train, held = split_text(text, args.held_out)
    print(f"{args.model_name}: {spec.num_params() / 1e6:.1f}M params; {len(train)} train / {len(held)} held-out "
          f"bytes of stdlib source; {args.steps} steps of {args.batch_size}x{args.seq_len} on {args.device}",
          flush=True)
    env = environment(args, argv, spec, text)
    evaluate = Evaluator(init_dir, held_out_batches(held, args), args.device)
    write, f = open_writer(out / JSONL)
    with f:
        for name in args.systems:
            run_system(name, args, init_dir, train, evaluate, write, env)
    return finish(out)


if __name__ == "__main__":
    sys.exit(main())
