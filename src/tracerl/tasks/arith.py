"""`arith`: multi-digit integer arithmetic with a short scratchpad, sized so a ~2M-parameter char model learns it.

Prompt `"23+45="`; completion `"<scratchpad>#<answer>"` (or just `"<answer>"` without scratchpad), then eos.
Scratchpads (least significant digit first, which small transformers learn far more easily than
left-to-right sums; Lee et al. 2023, "Teaching Arithmetic to Small Transformers"):
  `+`, `-`: the digits of |result| reversed, then `-` if negative:  23+45= -> 86#68,  23-45= -> 22-#-22
  `*`: the partial products a*digit(b), least significant digit of b first:  23*45= -> 115,92#1035
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tracerl.tasks.base import Prompt, Reward, draw, zero
from tracerl.tokenizer import CharTokenizer

MARKER = "#"
OPS = ("+", "-", "*")
_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ArithOptions:
    """digits: operands are drawn from [0, 10**digits); ops: subset of + - *; scratchpad: emit one."""

    digits: int = 2
    ops: tuple[str, ...] = ("+",)
    scratchpad: bool = True
    test_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise ValueError(f"arith: digits must be in 1..9, got {self.digits}")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"arith: ops must be a non-empty subset of {OPS}, got {self.ops!r}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"arith: test_fraction must be in (0, 1), got {self.test_fraction}")


def evaluate(a: int, op: str, b: int) -> int:
    """The exact result of `a op b`."""
    return a + b if op == "+" else a - b if op == "-" else a * b


def scratchpad(a: int, op: str, b: int) -> str:
    """The scratchpad text for `a op b` (see the module docstring)."""
    if op == "*":
        return ",".join(str(a * int(d)) for d in reversed(str(b)))
    r = evaluate(a, op, b)
    return str(abs(r))[::-1] + ("-" if r < 0 else "")


class ArithTask:
    """Integer arithmetic `a op b`; reward 1 iff the answer after the marker equals the exact result."""

    name = "arith"
    multi_turn = False

    def __init__(self, digits: int = 2, ops: str | tuple[str, ...] | list[str] = ("+",), scratchpad: bool = True,
                 test_fraction: float = 0.1) -> None:
        ops_t = tuple(ops) if not isinstance(ops, str) else tuple(ops.replace(",", "").replace(" ", ""))
        self.options = ArithOptions(digits, ops_t, scratchpad, test_fraction)
        self.tokenizer = CharTokenizer()
        hi = 10**digits - 1
        longest = max(len(self.solve_text(x, op, y)) for op in ops_t for x, y in ((hi, hi), (0, hi)))
        self.max_new_tokens = longest + 1 + 2  # + eos, + slack so a near-miss is still scored, not truncated

    def solve_text(self, a: int, op: str, b: int) -> str:
        """The reference completion for `a op b` (without eos)."""
        ans = str(evaluate(a, op, b))
        return f"{scratchpad(a, op, b)}{MARKER}{ans}" if self.options.scratchpad else ans

    def _make(self, rng: random.Random) -> tuple[str, Prompt]:
        o = self.options
        a, b = rng.randrange(10**o.digits), rng.randrange(10**o.digits)
        op = rng.choice(o.ops)
        key = f"{a}{op}{b}"
        return key, Prompt(f"{key}=", {"a": a, "op": op, "b": b, "answer": evaluate(a, op, b)}, self.name, key)

    def prompts(self, split: str = "train", n: int = 64, seed: int = 0) -> list[Prompt]:
        """n seeded problems of one split (about test_fraction of all problems are test)."""
        return draw(self.name, split, n, seed, self._make, self.options.test_fraction)

    def solve(self, prompt: Prompt) -> str:
        """The reference completion, used for the supervised warm start."""
        m = prompt.meta
        return self.solve_text(m["a"], m["op"], m["b"])

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """1.0 iff the integer after the last marker (or the whole completion, without scratchpad) is exact."""
        expected = int(prompt.meta["answer"])
        text = completion.strip()
        if not text:
            return zero("empty", expected=expected)
        if MARKER in text:
            text = text.rsplit(MARKER, 1)[1].strip()
        elif self.options.scratchpad:
            return zero("no_marker", expected=expected)
        # The length cap keeps int() away from Python's digit-count limit on a runaway completion.
        if len(text) > 32 or not _INT.fullmatch(text):
            return zero("unparseable_answer", answer=text[:32], expected=expected)
        got = int(text)
        if got != expected:
            return zero("wrong_answer", answer=got, expected=expected)
        return Reward(1.0, {"answer": got, "expected": expected})
