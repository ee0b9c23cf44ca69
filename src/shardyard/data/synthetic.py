"""A task whose answers can be checked, generated here (nothing downloaded): arithmetic with a stated answer
format, the R1-Zero-style recipe's data.

A problem is ``a op b`` with operands of at most ``digits`` digits (``0 <= a, b < 10**digits``; ``a >= b`` for
``-``, so no answer is negative) and ``op`` one of ``ops`` (``+``, ``-``, ``*``). Its conversation:

    user:      What is 23 + 58? Give the final answer after 'Answer:'.
    assistant: 23 + 58 = 81. Answer: 81

The problem space is split once by a stable hash of the problem (``held_out``): ``HELD_OUT_PERCENT`` percent of
it is never in the SFT set (``data=arithmetic``) nor in the generated preference pairs (``data=preference``
without paths); the GRPO prompts (``data=prompts`` without paths) come from that part only, so a rise of the
held-out reward is generalisation, not recall. The split depends on the problem alone (not on the seed, the
digits or the operations), so it holds between runs with other settings. Everything is a pure function of
``seed``, ``digits``, ``ops`` and the count.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from shardyard.core.errors import UserError
from shardyard.data.sft import SFTData

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
"""The operations a problem may use, by symbol."""
HELD_OUT_PERCENT = 10
"""Share of the problem space (by a stable hash of the problem) kept for the held-out prompts."""
INSTRUCTION = "Give the final answer after 'Answer:'."
"""The answer format every question states (``objectives.rewards.NumericAnswer`` reads the number after it)."""
MAX_DIGITS = 9
_ENUMERATE = 400_000
"""A problem space up to this size is listed whole and shuffled; a larger one is sampled without repeats."""


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def key(self) -> str:
        """The problem as a stable string (its name, and what the held-out split hashes)."""
        return f"{self.a}{self.op}{self.b}"

    @property
    def answer(self) -> int:
        return OPS[self.op](self.a, self.b)

    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}? {INSTRUCTION}"

    def solution(self, value: int | None = None, worked: bool = False, slip: bool = False) -> str:
        """The assistant's reply in the stated format (``value``: another, e.g. wrong, answer). ``worked``: an
        addition written out column by column first, ones first, each with its carry (``worked_sum``): the
        reasoning-then-answer form of R1, which a small model learns far sooner than the bare sum. ``slip``: the
        worked addition of a teacher who forgets every carry, and the (wrong) answer it then states."""
        if worked and self.op == "+" and value is None:
            text, v = worked_sum(self.a, self.b, forget_carries=slip)
            return f"{text} Answer: {v}"
        v = self.answer if value is None else value
        return f"{self.a} {self.op} {self.b} = {v}. Answer: {v}"

    def messages(self, worked: bool = False, slip: bool = False) -> list[dict]:
        return [{"role": "user", "content": self.question()},
                {"role": "assistant", "content": self.solution(worked=worked, slip=slip)}]


def worked_sum(a: int, b: int, forget_carries: bool = False) -> tuple[str, int]:
    """``a + b`` column by column and the number it writes: ``47 + 85: 7 + 5 = 12, write 2 carry 1; 4 + 8 + 1 = 13,
    write 3 carry 1; write 1.`` and 132. ``forget_carries``: a teacher's slip, every carry dropped (``7 + 5 = 12,
    write 2; 4 + 8 = 12, write 2.`` and 22): each column is right, the answer is not."""
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry, written = [], 0, []
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        s = x + y + carry
        terms = f"{x} + {y}" + (f" + {carry}" if carry else "")
        carry = 0 if forget_carries else s // 10
        written.append(s % 10)
        steps.append(f"{terms} = {s}, write {s % 10}" + (f" carry {carry}" if carry else ""))
    if carry:
        steps.append(f"write {carry}")
        written.append(carry)
    return f"{a} + {b}: " + "; ".join(steps) + ".", int("".join(map(str, reversed(written))))


def held_out(p: Problem) -> bool:
    """Whether the problem belongs to the held-out part of the space (``HELD_OUT_PERCENT``), by a stable hash."""
    h = int.from_bytes(hashlib.sha1(f"arithmetic|{p.key}".encode()).digest()[:8], "little")
    return h % 100 < HELD_OUT_PERCENT


def check(digits: int, ops: str, max_examples: int) -> None:
    """The knobs, or exit 2 naming the key."""
    if not isinstance(digits, int) or isinstance(digits, bool) or not 1 <= digits <= MAX_DIGITS:
        raise UserError("data.digits", digits, f"Operands have 1 to {MAX_DIGITS} digits.", "Use e.g. data.digits=2.")
    if not isinstance(ops, str) or not ops or any(o not in OPS for o in ops) or len(set(ops)) != len(ops):
        raise UserError("data.ops", ops, f"It is a string of distinct operation symbols out of {''.join(OPS)}.",
                        "Use e.g. data.ops=+- or data.ops='+-*'.")
    if not isinstance(max_examples, int) or max_examples < 1:
        raise UserError("data.max_examples", max_examples, "It must be at least 1.", "Use e.g. 3000.")


def problems(n: int, digits: int, ops: str, seed: int, held: bool, stream: int = 0) -> list[Problem]:
    """``n`` distinct problems of the held-out part (``held``) or of the rest, in a seeded order (fewer when the
    part has fewer). ``stream``: another sequence from the same seed (the preference pairs draw their own)."""
    check(digits, ops, n)
    rng = np.random.default_rng([seed, stream, digits, *map(ord, ops)])
    top = 10 ** digits
    if top * top * len(ops) <= _ENUMERATE:
        space = [Problem(a, o, b) for o in ops for a in range(top) for b in range(top) if o != "-" or a >= b]
        part = [p for p in space if held_out(p) == held]
        return [part[i] for i in rng.permutation(len(part))[:n]]
    out: list[Problem] = []
    seen: set[str] = set()
    draws = 0
    while len(out) < n:  # the space is large (>= 400k), each part >= 10% of it: this ends quickly unless n nears it
        draws += 1
        if draws > 50 * n + 10_000:  # the part holds fewer distinct problems than asked: never spin
            raise UserError("data.max_examples", n, f"The {'held-out' if held else 'training'} part of the problem "
                            f"space ({digits}-digit operands, ops {ops!r}) has too few distinct problems for it.",
                            "Use a smaller data.max_examples, or more data.digits or data.ops.")
        a, b = (int(x) for x in rng.integers(0, top, size=2))
        o = ops[int(rng.integers(0, len(ops)))]
        p = Problem(max(a, b), o, min(a, b)) if o == "-" else Problem(a, o, b)
        if p.key not in seen and held_out(p) == held:
            seen.add(p.key)
            out.append(p)
    return out


def wrong_answer(p: Problem, rng: np.random.Generator) -> int:
    """A plausible wrong answer: off by 1-9 or by a power of ten (a dropped or extra carry), never negative."""
    right = p.answer
    while True:
        delta = int(rng.integers(1, 10)) if rng.random() < 0.5 else 10 ** int(rng.integers(1, max(2, len(str(right)) + 1)))
        v = right + delta if rng.random() < 0.5 or right - delta < 0 else right - delta
        if v != right and v >= 0:
            return v


def preference_pairs(n: int, digits: int, ops: str, seed: int) -> Iterator[tuple[str, Problem, int]]:
    """``(name, problem, wrong answer)`` for generated preference pairs (from the part that is not held out)."""
    rng = np.random.default_rng([seed, 2, 7])
    for p in problems(n, digits, ops, seed, held=False, stream=2):
        yield f"arithmetic:{p.key}", p, wrong_answer(p, rng)


class ArithmeticData(SFTData):
    """``data=arithmetic``: SFT on generated arithmetic conversations (``max_examples`` distinct problems from
    the part of the space that is not held out), tokenized, labelled and packed exactly as ``data=sft``."""

    def __init__(self, max_examples: int = 3000, digits: int = 2, ops: str = "+-", seed: int = 0,
                 chat_template: str | None = None, packing: bool = True, truncation: str = "truncate",
                 worked: bool = False, slip: float = 0.0):
        check(digits, ops, max_examples)
        if isinstance(slip, bool) or not isinstance(slip, (int, float)) or not 0 <= slip <= 1:
            raise UserError("data.slip", slip, "It is the fraction of worked solutions whose carries the teacher "
                            "forgets, between 0 and 1.", "Use e.g. data.slip=0.6, or 0 for a teacher without slips.")
        if slip and not worked:
            raise UserError("data.slip", slip, "Only a worked solution (data.worked=true) has carries to forget.",
                            "Add data.worked=true, or drop data.slip.")
        super().__init__([], chat_template=chat_template, packing=packing, truncation=truncation,
                         max_examples=max_examples)
        self.digits, self.ops, self.seed, self.worked, self.slip = digits, ops, seed, worked, float(slip)

    def conversations(self) -> Iterator[tuple[str, list[dict]]]:
        for p in problems(self.max_examples, self.digits, self.ops, self.seed, held=False):
            yield f"arithmetic:{p.key}", p.messages(self.worked, slip=self.slips(p))

    def slips(self, p: Problem) -> bool:
        """Whether the teacher forgets the carries of this problem's worked solution: a stable hash of the problem
        and the seed below ``slip`` (the same problems at every run with the same settings)."""
        h = int.from_bytes(hashlib.sha1(f"slip|{self.seed}|{p.key}".encode()).digest()[:8], "little")
        return h % 1_000_000 < self.slip * 1_000_000

    def fingerprint(self) -> str:
        worked = "|worked" if self.worked else ""  # absent: the key of caches made before the option
        worked += f"|slip{self.slip}" if self.slip else ""
        settings = (f"arithmetic-v1|{self.digits}|{self.ops}|{self.seed}|{self.max_examples}|{self.chat_template}|"
                    f"{self.packing}|{self.truncation}|{HELD_OUT_PERCENT}{worked}")
        return hashlib.sha256(settings.encode()).hexdigest()[:16]
