"""The SFT path on the CPU with a tiny model: formatting and masks, padding vs packing, the shared evaluator,
the arithmetic task, and the accuracy_sft sweep end to end through the runner (native vs the engine)."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf", reason="pip install gguf (in the test extra)")

from gguf_tiny import random_model, write_gguf  # noqa: E402

from experiments.sft_task import arithmetic  # noqa: E402
from megatrain import EngineConfig, MegaTrain, OptimConfig  # noqa: E402
from megatrain import gguf_import  # noqa: E402
from megatrain.sft import (ChatFormat, Evaluator, batch_order, last_number, pack_batch, pad_batch,  # noqa: E402
                           score)
from megatrain.system import IGNORE_INDEX  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama (the tiny-llama preset's shape) as GGUF, imported: weights, tokenizer, chat template."""
    tmp = tmp_path_factory.mktemp("sft")
    path = write_gguf(random_model("llama", tied=False, layers=4), tmp / "tiny.gguf", "Q8_0")
    return gguf_import.convert(path, tmp / "hf"), path


@pytest.fixture(scope="module")
def fmt(model_dir):
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(str(model_dir[0])), system_prompt="Sum.")


def test_chat_format_masks_the_prompt(fmt):
    ex = fmt.encode("What is 12 + 30?", "42")
    text = fmt.tokenizer.decode(ex.ids)
    assert text.startswith("<|im_start|>system\nSum.<|im_end|>\n<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert text.endswith("42<|im_end|>")
    assert ex.prompt == fmt.tokenizer(fmt.prompt_text("What is 12 + 30?"), add_special_tokens=False)["input_ids"]
    assert ex.labels[:len(ex.prompt)] == [IGNORE_INDEX] * len(ex.prompt)
    assert ex.labels[len(ex.prompt):] == ex.answer and ex.answer[-1] == fmt.end_id
    assert fmt.decode_answer(ex.answer + [5, 6]) == "42"  # generation is cut at the end-of-turn token


def test_pad_batch_masks_padding(fmt):
    exs = [fmt.encode("What is 1 + 2?", "3"), fmt.encode("What is 100 + 200?", "300")]
    b = pad_batch(exs, 64, fmt.pad_id)
    for r, ex in enumerate(exs):
        n = len(ex)
        assert b["input_ids"][r, :n].tolist() == ex.ids and b["attention_mask"][r].sum() == n
        assert (b["labels"][r, n:] == IGNORE_INDEX).all() and b["labels"][r, :n].tolist() == ex.labels
    with pytest.raises(ValueError, match="raise seq_len"):
        pad_batch(exs, 10, fmt.pad_id)


def answer_token_losses(model, batch) -> torch.Tensor:
    """Per labelled target, its cross-entropy, in order (a plain HF forward; no KV cache: HF builds the
    packed block-diagonal mask from position_ids only without one, as in training)."""
    kw = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
    logits = model(input_ids=batch["input_ids"], use_cache=False, **kw).logits.float()
    targets = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], IGNORE_INDEX)], 1)
    keep = targets != IGNORE_INDEX
    return torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="none")


def test_packing_equals_padding(model_dir, fmt):
    """Packed rows (positions restart per example, no attention mask) give every answer token the loss it
    has alone in a padded row: the examples do not see each other."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir[0]), dtype=torch.float32).eval()
    train, _ = arithmetic("add", 2, 40, 4, seed=3)
    exs = [fmt.encode(q, a) for q, a in train[:6]]
    packed, used = pack_batch(exs, rows=3, seq_len=160, pad_id=fmt.pad_id)
    assert used == 6 and (packed["position_ids"] == 0).sum() > 3  # really several examples per row
    padded = pad_batch(exs, 80, fmt.pad_id)
    with torch.no_grad():
        torch.testing.assert_close(answer_token_losses(model, packed), answer_token_losses(model, padded),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_engine_sft_step_equals_pytorch(model_dir, fmt, layout):
    """The engine trains an SFT batch (padded with a mask, or packed) as plain PyTorch does."""
    from transformers import AutoModelForCausalLM

    train, _ = arithmetic("add", 2, 40, 4, seed=1)
    exs = [fmt.encode(q, a) for q, a in train[:8]]
    if layout == "pad":
        batch = pad_batch(exs, 64, fmt.pad_id)
    else:
        batch, used = pack_batch(exs, rows=4, seq_len=128, pad_id=fmt.pad_id)
        assert used == 8
    optim = OptimConfig(lr=1e-3, max_grad_norm=1.0)
    engine = MegaTrain.from_pretrained(str(model_dir[0]), EngineConfig(device="cpu", micro_batches=2, optim=optim),
                                       verbose=False)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir[0]), dtype=torch.float32).train()
    opt = torch.optim.AdamW(ref.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=0.0)
    try:
        losses = answer_token_losses(ref, batch)
        loss = losses.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), optim.max_grad_norm)
        opt.step()
        result = engine.step(batch)
        assert abs(result.loss - float(loss.detach())) < 1e-5
        for name, t in ref.state_dict().items():
            torch.testing.assert_close(engine.state_dict()[name], t, rtol=1e-5, atol=1e-5, msg=name)
    finally:
        engine.close()


def test_evaluator_same_weights_same_numbers(model_dir, fmt):
    from transformers import AutoModelForCausalLM

    _, held = arithmetic("add", 2, 40, 6, seed=0)
    a = Evaluator(model_dir[0], fmt, held, seq_len=80, batch_size=4, gen_batch=4, max_new_tokens=5)
    first = a()
    assert set(first) >= {"eval_loss", "exact_match", "numeric_match", "n", "samples"} and first["n"] == 6
    # The same weights handed over as a state dict (what every system's state_dict() gives) agree exactly.
    weights = AutoModelForCausalLM.from_pretrained(str(model_dir[0]), dtype=torch.float32).state_dict()
    again = a(weights)
    assert again["eval_loss"] == first["eval_loss"] and again["samples"] == first["samples"]
    # The loss is over answer tokens only (the prompt's are -100): it moves when only an answer changes.
    b = Evaluator(model_dir[0], fmt, [(q, "9" + ans) for q, ans in held], seq_len=80, batch_size=4)
    assert b(accuracy=False)["eval_loss"] != first["eval_loss"]
    with pytest.raises(KeyError, match="do not match"):
        a({"model.embed_tokens.weight": weights["model.embed_tokens.weight"]})


def test_scoring():
    assert last_number("The sum is 1,458.") == "1458" and last_number("no digits") is None
    s = score(["1458", "It is 506", "12"], ["1458", "506", "13"])
    assert s["exact_match"] == pytest.approx(1 / 3) and s["numeric_match"] == pytest.approx(2 / 3)


def test_arithmetic_task_and_order():
    train, held = arithmetic("add", 3, 500, 50, seed=7)
    assert (train, held) == arithmetic("add", 3, 500, 50, seed=7)
    assert len(train) == 500 and len(held) == 50 and not set(train) & set(held)
    for q, a in train[:20] + held[:20]:
        x, y = (int(t) for t in q.removeprefix("What is ").removesuffix("?").split(" + "))
        assert 100 <= x <= 999 and 100 <= y <= 999 and int(a) == x + y
    assert arithmetic("add", 3, 900, 50, seed=7)[1] == held  # held-out set stable when training grows
    with pytest.raises(ValueError, match="distinct problems"):
        arithmetic("add", 1, 60, 10)
    order = batch_order(10, 4, 5, seed=2)
    assert order == batch_order(10, 4, 5, seed=2) and len(order) == 5
    flat = [i for b in order for i in b]
    assert sorted(flat[:10]) == list(range(10))  # each epoch is a permutation


@pytest.mark.slow
def test_accuracy_sft_sweep_on_cpu(model_dir, tmp_path):
    """sweep=accuracy_sft through the runner: every point ok, same init -> identical step-0 evaluation,
    the rerun repeats all-on-GPU, the engine (tiered, fp32 variant, pure streaming) trains like plain
    PyTorch, report section (verdict with the rerun's spread) and figure written."""
    gguf_path = model_dir[1]
    cmd = [sys.executable, "-m", "experiments.run", "sweep=accuracy_sft", "model=tiny-llama", "device=cpu",
           f"sweep.sft.gguf={gguf_path}", "steps=4", "warmup_steps=1", "batch_size=4", "seq_len=96",
           "sweep.systems=[native,megatrain]", "sweep.sft.n_train=64", "sweep.sft.n_eval=8",
           "sweep.sft.eval_every=2", "sweep.sft.accuracy_every=2", "sweep.sft.max_new_tokens=4",
           "sweep.sft.gen_batch=8", f"results_dir={tmp_path}", "timeout_s=300", "torch_threads=1",
           "optim.total_steps=4", "optim.warmup_steps=1", f"cache_dir={tmp_path / 'cache'}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "MEGATRAIN_HOST_ADAMW": "torch"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sweep = tmp_path / "accuracy_sft"
    points = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name.split("__")[0] + "/" + p.name.split("__")[-2] for p in points] == [
        "megatrain/autocast", "megatrain/default", "megatrain/fp32", "megatrain/pure_streaming",
        "megatrain/streaming_autocast", "megatrain/streaming_fp32", "native/default", "native/fp32",
        "native/rerun", "native/rerun_mb2", "native/rerun_mb4", "native/rerun_ulp"]
    runs = {}
    for p in points:
        rows = [json.loads(line) for line in (p / "sft.jsonl").read_text().splitlines()]
        steps = [json.loads(line) for line in (p / "metrics.jsonl").read_text().splitlines()]
        assert json.loads((p / "result.json").read_text())["status"] == "ok"
        runs[p.name.split("__")[0] + "/" + p.name.split("__")[-2]] = (rows, steps)
    ref_rows, ref_steps = runs["native/default"]
    assert [r["step"] for r in ref_rows if r["kind"] == "eval"] == [0, 2, 4]
    assert ref_rows[-1]["kind"] == "summary" and ref_rows[-1]["clip_fraction"] is not None
    rerun_rows, rerun_steps = runs["native/rerun"]  # the same run again (on the CPU: bit for bit)
    assert [r["loss"] for r in rerun_steps] == [r["loss"] for r in ref_steps]
    assert [r["eval_loss"] for r in rerun_rows[:-1]] == [r["eval_loss"] for r in ref_rows[:-1]]
    # autocast: on the CPU the compute dtype is fp32, so mixed_precision=autocast is plain fp32 there
    # (native/rerun_mb2: the same step in 2 micro-batches, answer-token losses weighted by their tokens)
    for name in ("megatrain/default", "megatrain/fp32", "megatrain/pure_streaming", "megatrain/autocast",
                 "megatrain/streaming_autocast", "megatrain/streaming_fp32", "native/rerun_mb2",
                 "native/rerun_mb4"):
        rows, steps = runs[name]
        assert rows[0]["eval_loss"] == ref_rows[0]["eval_loss"]  # same weights in, same evaluation
        for a, b in zip(steps, ref_steps):
            assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4
        for a, b in zip(rows[:-1], ref_rows[:-1]):
            assert abs(a["eval_loss"] - b["eval_loss"]) < 1e-5
        if name.startswith("megatrain/"):
            assert "speculated" in steps[0] and "speculated_fraction" in rows[-1]
    report = (tmp_path / "REPORT.md").read_text()
    assert "## Table 3 on a pretrained model" in report and "Verdict: **agree**" in report
    assert re.search(r"all-on-GPU vs all-on-GPU 0\.\d{4} nats \(step \d+, .*\[rerun", report)  # the spread
    assert (tmp_path / "plots" / "accuracy_sft.png").is_file()
    assert (tmp_path / "cache" / "gguf").is_dir()  # converted once into the cache


def test_accuracy_sft_sweep_expands_to_its_fourteen_points(tmp_path):
    """Same data and optimizer for every point; the rerun (all-on-GPU again, nothing changed) and the fp32
    points (all-on-GPU, MegaTrain, ZeRO-3) are points of their own, run variant by variant; pure streaming and
    autocast (mixed_precision) only for MegaTrain; a bad variant dtype and a missing GGUF are refused before
    anything runs, the latter with the way to get it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from experiments import sweeps

    def expand(*overrides):
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(REPO / "experiments" / "conf"), version_base="1.3"):
                cfg = compose(config_name="config", overrides=["sweep=accuracy_sft", *overrides])
                return sweeps.expand(cfg, lambda g, n: compose(config_name="config",
                                                               overrides=["sweep=accuracy_sft", f"{g}={n}"])[g],
                                     device="cuda", gpu_name="NVIDIA H200")
        finally:
            GlobalHydra.instance().clear()

    jobs = expand("steps=120")
    assert [(j.system, j.variant, j.dtype) for j in jobs] == [
        ("native", "default", "auto"), ("megatrain", "default", "auto"), ("zero3", "default", "auto"),
        ("native", "rerun", "auto"), ("native", "rerun_ulp", "auto"), ("native", "fp32", "fp32"),
        ("megatrain", "fp32", "fp32"), ("zero3", "fp32", "fp32"), ("megatrain", "pure_streaming", "auto"),
        ("megatrain", "autocast", "auto"), ("megatrain", "streaming_autocast", "auto"),
        ("native", "rerun_mb2", "auto"), ("native", "rerun_mb4", "auto"), ("megatrain", "streaming_fp32", "fp32")]
    # rerun_mb2 / rerun_mb4: the same step in two halves / four quarters
    assert [j.micro_batches for j in jobs] == [1] * 11 + [2, 4, 1]
    assert jobs[11].options == jobs[0].options and jobs[11].optim == jobs[0].optim
    assert jobs[12].options == jobs[0].options and jobs[12].optim == jobs[0].optim
    assert jobs[13].options.gpu_resident == "0" and jobs[13].options.compute_dtype == jobs[6].options.compute_dtype
    assert jobs[10].options.gpu_resident == "0" and jobs[10].options.mixed_precision == "autocast"
    assert jobs[8].options.gpu_resident == "0" and jobs[1].options.gpu_resident == "auto"
    # autocast changes the engine's mixed precision only
    assert jobs[9].options.mixed_precision == "autocast" and jobs[1].options.mixed_precision == "layer"
    assert dataclasses.replace(jobs[9].options, mixed_precision="layer") == jobs[1].options
    # ZeRO-3 in fp32: the point's dtype only (the DeepSpeed options are the default point's)
    assert jobs[7].options == jobs[2].options and jobs[7].optim == jobs[2].optim
    assert jobs[6].options.compute_dtype != jobs[1].options.compute_dtype
    # fp32 changes the compute dtype only
    assert dataclasses.replace(jobs[6].options, compute_dtype=jobs[1].options.compute_dtype) == jobs[1].options
    assert jobs[3].options == jobs[0].options and jobs[3].id != jobs[0].id  # the same run again, its own point
    assert tuple(jobs[4].optim.betas) == (0.9, 0.9500001) and jobs[0].optim.betas == (0.9, 0.95)  # 2 fp32 ulps
    assert {(j.steps, j.optim.total_steps, j.optim.lr, j.batch_size, j.seq_len, j.seed) for j in jobs} == {
        (120, 120, 2e-4, 64, 48, 0)}
    assert all(j.sft["gguf"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and j.sft["n_eval"] == 500 for j in jobs)
    assert jobs[0].num_params == 134_515_008  # the smollm2-135m preset = the GGUF's model
    with pytest.raises(sweeps.SweepError, match="dtype=fp33"):
        expand("+sweep.variants.bad={dtype: fp33}")
    with pytest.raises(sweeps.SweepError, match="micro_batches=128; valid: 1 to the batch size"):
        expand("+sweep.variants.bad={micro_batches: 128}")

    missing = dataclasses.replace(jobs[0], sft=dict(jobs[0].sft, gguf=str(tmp_path / "none.gguf")))
    assert "ship_gguf.sh" in sweeps.invalid_reason(missing)
    both = dataclasses.replace(jobs[0], sft=dict(jobs[0].sft, model_dir=str(tmp_path)))
    assert "exactly one of gguf" in sweeps.invalid_reason(both)
