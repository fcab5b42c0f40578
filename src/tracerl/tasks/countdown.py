"""`countdown`: reach a target from given numbers with + - * / and parentheses (each number at most once).

Problems come from reasoning-gym's countdown generator (offline, reproducible: item i of a dataset with
seed s is a pure function of s + i). Prompt `"7,3,9 to 12:"`, completion an expression such as `"9+7-3"`.
Checking never uses `eval`: the expression is parsed to an AST, only integer literals, + - * / and
parentheses are accepted, and it is evaluated exactly with `fractions.Fraction`.
"""

from __future__ import annotations

import ast
import itertools
import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Any

from tracerl.tasks.base import Prompt, Reward, draw, zero
from tracerl.tokenizer import CharTokenizer

_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
MAX_EXPR_CHARS = 200  # a longer completion is rejected before parsing (deep nesting would blow the parser's stack)


@dataclass(frozen=True)
class CountdownOptions:
    """numbers: how many given; values and target drawn from the inclusive ranges."""

    numbers: int = 3
    min_value: int = 1
    max_value: int = 20
    min_target: int = 1
    max_target: int = 50
    test_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not 2 <= self.numbers <= 6:
            raise ValueError(f"countdown: numbers must be in 2..6, got {self.numbers}")
        if not 1 <= self.min_value <= self.max_value:
            raise ValueError("countdown: need 1 <= min_value <= max_value")
        if not 1 <= self.min_target <= self.max_target:
            raise ValueError("countdown: need 1 <= min_target <= max_target")


class CountdownError(ValueError):
    """Why an expression is not a valid countdown answer; `reason` is a short stable code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def evaluate_expression(expr: str, numbers: list[int]) -> Fraction:
    """Exactly evaluate `expr`, allowing only the given numbers (each at most once), + - * / and parentheses."""
    if len(expr) > MAX_EXPR_CHARS:
        raise CountdownError("too_long", f"{len(expr)} chars")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CountdownError("syntax_error", str(e)[:80]) from None
    available = Counter(numbers)

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if right == 0:
                raise CountdownError("division_by_zero")
            return left / right
        # bool is a subclass of int: `True` must not sneak in as a 1.
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if available[node.value] <= 0:
                reason = "number_reused" if node.value in numbers else "number_not_given"
                raise CountdownError(reason, str(node.value))
            available[node.value] -= 1
            return Fraction(node.value)
        what = type(node.op).__name__ if isinstance(node, ast.BinOp | ast.UnaryOp) else type(node).__name__
        raise CountdownError("disallowed", what)

    return walk(tree.body)


def find_expression(numbers: list[int], target: int) -> str | None:
    """Exhaustively search for an expression over a subset of numbers reaching target (fine for <= 4 numbers)."""
    # Each entry maps a multiset of used indices to {value: expression}; built bottom-up by subset size.
    n = len(numbers)
    best: dict[frozenset[int], dict[Fraction, str]] = {frozenset([i]): {Fraction(v): str(v)} for i, v in enumerate(numbers)}
    for size in range(2, n + 1):
        for combo in itertools.combinations(range(n), size):
            s = frozenset(combo)
            vals: dict[Fraction, str] = {}
            for k in range(1, size):
                for left in itertools.combinations(combo, k):
                    ls = frozenset(left)
                    for lv, le in best[ls].items():
                        for rv, re_ in best[s - ls].items():
                            vals.setdefault(lv + rv, f"({le}+{re_})")
                            vals.setdefault(lv - rv, f"({le}-{re_})")
                            vals.setdefault(lv * rv, f"({le}*{re_})")
                            if rv != 0:
                                vals.setdefault(lv / rv, f"({le}/{re_})")
            best[s] = vals
    for s in sorted(best, key=len):
        if Fraction(target) in best[s]:
            return _strip_outer(best[s][Fraction(target)])
    return None


def _strip_outer(expr: str) -> str:
    return expr[1:-1] if expr.startswith("(") and expr.endswith(")") and _balanced(expr[1:-1]) else expr


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += ch == "("
        depth -= ch == ")"
        if depth < 0:
            return False
    return depth == 0


class CountdownTask:
    """Countdown numbers game; reward 1 iff the expression is valid and equals the target exactly."""

    name = "countdown"
    multi_turn = False

    def __init__(self, numbers: int = 3, min_value: int = 1, max_value: int = 20, min_target: int = 1,
                 max_target: int = 50, test_fraction: float = 0.1) -> None:
        self.options = CountdownOptions(numbers, min_value, max_value, min_target, max_target, test_fraction)
        self.tokenizer = CharTokenizer()
        width = len(str(max_value))
        # numbers, operators, a pair of parentheses per operator, eos, slack.
        self.max_new_tokens = numbers * width + (numbers - 1) * 3 + 1 + 3

    @cached_property
    def _generator(self) -> Any:
        import reasoning_gym  # imported lazily: it loads every reasoning-gym dataset (~1.5 s)

        o = self.options
        return reasoning_gym.create_dataset(
            "countdown", seed=0, size=2**31 - 1, min_numbers=o.numbers, max_numbers=o.numbers,
            min_value=o.min_value, max_value=o.max_value, min_target=o.min_target, max_target=o.max_target,
        )

    def _make(self, rng: random.Random) -> tuple[str, Prompt]:
        # Our rng picks the item index; the item itself is reasoning-gym's pure function of that index.
        idx = rng.randrange(2**30)
        item = self._generator[idx]
        nums = list(item["metadata"]["numbers"])
        target = int(item["metadata"]["target"])
        key = f"{sorted(nums)}->{target}"
        text = f"{','.join(map(str, nums))} to {target}:"
        meta = {"numbers": nums, "target": target, "expression": item["metadata"]["expression"], "source_index": idx}
        return key, Prompt(text, meta, self.name, key)

    def prompts(self, split: str = "train", n: int = 64, seed: int = 0) -> list[Prompt]:
        """n seeded problems of one split; the split is decided by the (numbers, target) pair."""
        return draw(self.name, split, n, seed, self._make, self.options.test_fraction)

    def solve(self, prompt: Prompt) -> str:
        """A correct expression (reasoning-gym's own, else one found by search), without spaces."""
        nums, target = prompt.meta["numbers"], prompt.meta["target"]
        expr = str(prompt.meta.get("expression", "")).replace(" ", "")
        if expr and self.reward(prompt, expr).value == 1.0:
            return expr
        # reasoning-gym prints through sympy, which can produce a unary minus we do not accept.
        found = find_expression(nums, target)
        if found is None:
            raise ValueError(f"countdown: no expression reaches {target} from {nums}")
        return found

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """1.0 iff the completion is a valid expression over the given numbers equal to the target."""
        nums, target = list(prompt.meta["numbers"]), int(prompt.meta["target"])
        expr = completion.strip()
        if not expr:
            return zero("empty", target=target)
        try:
            value = evaluate_expression(expr, nums)
        except CountdownError as e:
            return zero(e.reason, detail=e.detail, target=target)
        if value != target:
            return zero("wrong_value", value=str(value), target=target)
        return Reward(1.0, {"value": str(value), "target": target})
