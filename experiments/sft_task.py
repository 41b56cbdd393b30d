"""A generated task with exact answers for the SFT accuracy sweep: multi-digit arithmetic.

``arithmetic(op, digits, n_train, n_eval, seed)`` draws distinct operand pairs from a seeded generator
(the same problems on every machine for a seed); the held-out problems are disjoint from the training
ones. Questions are plain English ("What is 347 + 589?"), answers the exact integer ("936").
"""
from __future__ import annotations

import operator
import random

OPS = {"add": ("+", operator.add), "sub": ("-", operator.sub), "mul": ("*", operator.mul)}


def arithmetic(op: str = "add", digits: int = 3, n_train: int = 20000, n_eval: int = 500, seed: int = 0,
               digits2: int | None = None) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held_out) lists of (question, answer). ``digits``: digits of the first operand; ``digits2``:
    of the second (default: the same)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    digits2 = digits if digits2 is None else digits2
    if digits < 1 or digits2 < 1:
        raise ValueError(f"digits must be >= 1, got {digits}, {digits2}")
    lo1, hi1 = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1
    lo2, hi2 = 10 ** (digits2 - 1) if digits2 > 1 else 0, 10 ** digits2 - 1
    space = (hi1 - lo1 + 1) * (hi2 - lo2 + 1)
    need = n_train + n_eval
    if need > space // 2:
        raise ValueError(f"{need} distinct problems asked of a space of {space}: use more digits")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    pairs = []
    while len(pairs) < need:
        a, b = rng.randint(lo1, hi1), rng.randint(lo2, hi2)
        if (a, b) not in seen:
            seen.add((a, b))
            pairs.append((a, b))
    sym, fn = OPS[op]
    items = [(f"What is {a} {sym} {b}?", str(fn(a, b))) for a, b in pairs]
    return items[n_eval:], items[:n_eval]  # held-out first: unchanged when n_train grows
