"""Supervised fine-tuning on chat data: formatting, batches, and one evaluation for every system.

    fmt = ChatFormat(tokenizer, system_prompt="Answer with the number only.")
    examples = [fmt.encode(q, a) for q, a in pairs]            # labels -100 on the prompt
    batch = pad_batch(examples[:64], seq_len=64, pad_id=fmt.pad_id)  # or pack_batch(...)
    result = engine.step(batch)                                # any TrainSystem: the engine or a baseline
    ev = Evaluator(model_dir, fmt, held_out, device="cuda")
    ev(engine.state_dict())  # {"eval_loss", "exact_match", "numeric_match", ...}

The engine stays generic: an SFT batch is an ordinary batch (``input_ids``, ``labels`` with -100 where no
loss is wanted, ``attention_mask`` or packed ``position_ids``), and the engine's loss is already the mean
over labelled tokens (megatrain/system.py).

* ``ChatFormat``: the tokenizer's own chat template renders the prompt (system + user turn + the assistant
  header, ``add_generation_prompt=True``); the answer is the answer's tokens plus the end-of-turn token
  (``<|im_end|>`` for ChatML templates, else the tokenizer's EOS), which is exactly what greedy generation
  must produce. Loss only on the answer: the prompt's labels are -100.
* ``pad_batch``: one example per row, right-padded, ``attention_mask`` 0 and labels -100 on the padding.
  ``pack_batch``: several examples per row, ``position_ids`` restarting at 0 for each and no attention
  mask, so HF's mask builder (which the engine uses too) makes the block-diagonal causal mask (HF does so
  only without a KV cache: call a plain HF model on a packed batch with ``use_cache=False``, as in training).
* ``Evaluator``: the same code on the same weights for every system: the system's fp32 masters
  (``state_dict()``) are copied into one plain HF model, which computes the held-out loss on the answer
  tokens and greedy answers (``generate``, fp32), scored by exact match of the whole answer and by its last
  number.
"""
from __future__ import annotations

import contextlib
import random
import re
from dataclasses import dataclass

import torch

from .system import IGNORE_INDEX, shift_labels


@dataclass(frozen=True)
class Encoded:
    """One example: the prompt's token ids, then the answer's (end-of-turn token included)."""

    prompt: list[int]
    answer: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.answer

    @property
    def labels(self) -> list[int]:
        return [IGNORE_INDEX] * len(self.prompt) + self.answer

    def __len__(self) -> int:
        return len(self.prompt) + len(self.answer)


class ChatFormat:
    """Render (question, answer) pairs with the tokenizer's chat template."""

    def __init__(self, tokenizer, system_prompt: str | None = None, end_token: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template (tokenizer.chat_template is empty)")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        vocab = tokenizer.get_vocab()
        end_token = end_token or ("<|im_end|>" if "<|im_end|>" in vocab else tokenizer.eos_token)
        if end_token not in vocab:
            raise ValueError(f"end-of-turn token {end_token!r} is not in the vocabulary")
        self.end_token, self.end_id = end_token, vocab[end_token]
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.end_id)

    def messages(self, question: str) -> list[dict]:
        sys_turn = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return sys_turn + [{"role": "user", "content": question}]

    def prompt_text(self, question: str) -> str:
        return self.tokenizer.apply_chat_template(self.messages(question), tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, question: str) -> list[int]:
        # The template writes special tokens as text; the tokenizer maps them to their ids. No extra BOS:
        # whatever the template puts first is what generation sees too.
        return list(self.tokenizer(self.prompt_text(question), add_special_tokens=False)["input_ids"])

    def encode(self, question: str, answer: str) -> Encoded:
        answer_ids = list(self.tokenizer(answer, add_special_tokens=False)["input_ids"]) + [self.end_id]
        return Encoded(self.prompt_ids(question), answer_ids)

    def decode_answer(self, ids: list[int]) -> str:
        """Generated ids up to (not including) the end-of-turn token, as text."""
        if self.end_id in ids:
            ids = ids[:ids.index(self.end_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()


# -- batches --------------------------------------------------------------------------------------
def _too_long(n: int, seq_len: int) -> ValueError:
    return ValueError(f"an example has {n} tokens, more than seq_len {seq_len}: raise seq_len")


def pad_batch(examples: list[Encoded], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One example per row, right-padded to ``seq_len``: attention_mask 0 and labels -100 on padding."""
    ids = torch.full((len(examples), seq_len), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    mask = torch.zeros_like(ids)
    for r, ex in enumerate(examples):
        n = len(ex)
        if n > seq_len:
            raise _too_long(n, seq_len)
        ids[r, :n] = torch.tensor(ex.ids)
        labels[r, :n] = torch.tensor(ex.labels)
        mask[r, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pack_batch(examples: list[Encoded], rows: int, seq_len: int, pad_id: int) -> tuple[dict[str, torch.Tensor], int]:
    """Examples in order, several per row (a row is closed when the next one does not fit); positions
    restart at 0 for every example, so HF's mask builder keeps examples apart (no attention_mask: it
    detects packing from ``position_ids``). Padding at a row's end is its own segment with labels -100.
    Returns the batch and how many examples it holds (fewer than given when ``rows`` fill up)."""
    ids = torch.full((rows, seq_len), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    pos = torch.zeros_like(ids)
    fill = [0] * rows  # tokens placed in each row
    r = used = 0
    for ex in examples:
        n = len(ex)
        if n > seq_len:
            raise _too_long(n, seq_len)
        if fill[r] + n > seq_len:
            r += 1
            if r == rows:
                break
        c = fill[r]
        ids[r, c:c + n] = torch.tensor(ex.ids)
        labels[r, c:c + n] = torch.tensor(ex.labels)
        pos[r, c:c + n] = torch.arange(n)
        fill[r] += n
        used += 1
    for row in range(rows):  # trailing padding: positions 0.. again, a separate (unlabelled) segment
        pos[row, fill[row]:] = torch.arange(seq_len - fill[row])
    return {"input_ids": ids, "labels": labels, "position_ids": pos}, used


def batch_order(n: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Example indices of each step: epochs of a seeded shuffle, concatenated (the same for every system)."""
    if n < 1 or batch_size < 1:
        raise ValueError(f"need examples and a positive batch size, got {n} examples, batch {batch_size}")
    order: list[int] = []
    epoch = 0
    while len(order) < steps * batch_size:
        perm = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        order += perm
        epoch += 1
    return [order[i * batch_size:(i + 1) * batch_size] for i in range(steps)]


# -- scoring --------------------------------------------------------------------------------------
_NUMBER = re.compile(r"-?\d[\d,]*")


def last_number(text: str) -> str | None:
    """The last integer in ``text`` (thousands separators dropped), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def score(generated: list[str], answers: list[str]) -> dict:
    """``exact_match``: the whole generated answer equals the reference; ``numeric_match``: its last
    number does (fair to a model that answers in a sentence)."""
    n = len(answers)
    exact = sum(g.strip() == a.strip() for g, a in zip(generated, answers))
    numeric = sum(last_number(g) == last_number(a) for g, a in zip(generated, answers))
    return {"n": n, "exact_match": exact / n if n else float("nan"), "numeric_match": numeric / n if n else float("nan")}


# -- evaluation -----------------------------------------------------------------------------------
class ReferenceModel:
    """One plain fp32 HF model (``model_dir``'s architecture, SDPA attention, eval mode) into which any
    system's fp32 masters are copied, so that every system is evaluated by the same code on the same
    weights (here and in ``scripts/accuracy_parity.py``)."""

    def __init__(self, model_dir, device="cpu"):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                          attn_implementation="sdpa").to(self.device).eval()
        self.tied = bool(self.model.config.tie_word_embeddings)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in; every parameter must come from ``weights`` (a tied head may be absent)."""
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        allowed = {"lm_head.weight"} if self.tied else set()
        if unexpected or set(missing) - allowed:
            raise KeyError(f"weights do not match the model: missing {sorted(set(missing) - allowed)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")


class Evaluator(ReferenceModel):
    """Held-out loss and greedy accuracy of fp32 weights, through one plain HF model shared by all systems.

    ``held_out``: (question, answer) pairs. The loss is the mean cross-entropy over the answer tokens of
    every held-out example (the training loss's definition); generation is greedy (``generate`` with
    ``do_sample=False``), left-padded batches of ``gen_batch`` prompts, at most ``max_new_tokens``.
    Everything runs in fp32, so two systems with the same weights get the same numbers."""

    def __init__(self, model_dir, fmt: ChatFormat, held_out: list[tuple[str, str]], device="cpu",
                 seq_len: int = 64, batch_size: int = 64, gen_batch: int = 256, max_new_tokens: int = 32):
        super().__init__(model_dir, device)
        self.fmt, self.held_out = fmt, list(held_out)
        self.encoded = [fmt.encode(q, a) for q, a in self.held_out]
        self.seq_len, self.batch_size, self.gen_batch = seq_len, batch_size, gen_batch
        self.max_new_tokens = max_new_tokens

    @torch.no_grad()
    def loss(self) -> float:
        """Mean token cross-entropy over the held-out answers (nats)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for s in range(0, len(self.encoded), self.batch_size):
            b = pad_batch(self.encoded[s:s + self.batch_size], self.seq_len, self.fmt.pad_id)
            targets = shift_labels(b["labels"]).to(self.device)
            hidden = self.model.model(input_ids=b["input_ids"].to(self.device),
                                      attention_mask=b["attention_mask"].to(self.device)).last_hidden_state
            keep = targets != IGNORE_INDEX  # the head only where a loss is taken (no [tokens x vocab] logits)
            logits = self.model.lm_head(hidden[keep]).float()
            total += torch.nn.functional.cross_entropy(logits, targets[keep], reduction="sum")
            count += int(keep.sum())
        return float(total) / count

    @torch.no_grad()
    def generate(self) -> list[str]:
        """Greedy answers to the held-out questions, in order."""
        out = []
        prompts = [ex.prompt for ex in self.encoded]
        for s in range(0, len(prompts), self.gen_batch):
            chunk = prompts[s:s + self.gen_batch]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), self.fmt.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, p in enumerate(chunk):  # left padding: every prompt ends where generation starts
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            with _quiet():
                gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                          max_new_tokens=self.max_new_tokens, do_sample=False, num_beams=1,
                                          temperature=None, top_p=None, top_k=None, use_cache=True,
                                          eos_token_id=self.fmt.end_id, pad_token_id=self.fmt.pad_id)
            out += [self.fmt.decode_answer(row.tolist()) for row in gen[:, width:].cpu()]
        return out

    def __call__(self, weights: dict[str, torch.Tensor] | None = None, accuracy: bool = True) -> dict:
        """Load ``weights`` (if given) and evaluate: eval_loss, and with ``accuracy`` exact/numeric match
        plus a few samples."""
        if weights is not None:
            self.load(weights)
        # Full fp32 matmuls whatever the process set (a system's library may have enabled TF32): every
        # system's evaluation computes the same way.
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            result = {"eval_loss": self.loss()}
            if accuracy:
                generated = self.generate()
                answers = [a for _, a in self.held_out]
                result.update(score(generated, answers))
                result["samples"] = [{"q": q, "ref": a, "got": g}
                                     for (q, a), g in list(zip(self.held_out, generated))[:4]]
        finally:
            torch.set_float32_matmul_precision(precision)
        return result


@contextlib.contextmanager
def _quiet():
    """generate() warns about generation-config defaults it ignores; the arguments above are explicit."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
