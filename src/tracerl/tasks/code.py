"""`code`: write the body of a small Python function from a one-line spec; reward = share of hidden tests passed.

Prompt (the policy continues it):      Reference completion:
    # f(list): sum of items above 3         return sum(v for v in x if v>3)
    def f(x):
Specs are procedurally generated from templates over ints, int lists and short strings. The program
(prompt + completion) runs in the `Sandbox`; the child gets only the test inputs, the parent compares
outputs with expected values computed here by a reference implementation.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tracerl.tasks.base import Prompt, Reward, draw, zero
from tracerl.tasks.sandbox import Sandbox, SandboxLimits, SandboxResult
from tracerl.tokenizer import CharTokenizer

LETTERS = "abcde"


@dataclass(frozen=True)
class Template:
    """A family of specs: `spec`/`body` are format strings over params; `ref` is the trusted reference."""

    name: str
    kind: str  # int | list | str: the type of x
    spec: str
    body: str
    ref: Callable[[Any, dict[str, Any]], Any]
    params: Callable[[random.Random], dict[str, Any]]


def _a(lo: int, hi: int) -> Callable[[random.Random], dict[str, Any]]:
    return lambda r: {"a": r.randint(lo, hi)}


def _c(r: random.Random) -> dict[str, Any]:
    return {"c": r.choice(LETTERS)}


TEMPLATES: tuple[Template, ...] = (
    Template("affine", "int", "x times {a} plus {b}", "return x*{a}+{b}", lambda x, p: x * p["a"] + p["b"],
             lambda r: {"a": r.randint(2, 9), "b": r.randint(0, 9)}),
    Template("mod", "int", "x mod {a}", "return x%{a}", lambda x, p: x % p["a"], _a(2, 9)),
    Template("max", "int", "larger of x and {a}", "return max(x,{a})", lambda x, p: max(x, p["a"]), _a(-9, 20)),
    Template("dist", "int", "distance from x to {a}", "return abs(x-{a})", lambda x, p: abs(x - p["a"]), _a(-9, 20)),
    Template("divisible", "int", "x is divisible by {a}", "return x%{a}==0", lambda x, p: x % p["a"] == 0, _a(2, 9)),
    Template("sum_above", "list", "sum of items above {a}", "return sum(v for v in x if v>{a})",
             lambda x, p: sum(v for v in x if v > p["a"]), _a(-5, 9)),
    Template("count", "list", "count of {a}", "return x.count({a})", lambda x, p: x.count(p["a"]), _a(0, 5)),
    Template("scale", "list", "items times {a}", "return [v*{a} for v in x]", lambda x, p: [v * p["a"] for v in x],
             _a(2, 9)),
    Template("head", "list", "first {a} items", "return x[:{a}]", lambda x, p: x[: p["a"]], _a(1, 5)),
    Template("desc", "list", "items sorted descending", "return sorted(x,reverse=True)",
             lambda x, p: sorted(x, reverse=True), lambda r: {}),
    Template("max_default", "list", "largest item, {a} if empty", "return max(x,default={a})",
             lambda x, p: max(x, default=p["a"]), _a(-9, 0)),
    Template("evens", "list", "the even items", "return [v for v in x if v%2==0]",
             lambda x, p: [v for v in x if v % 2 == 0], lambda r: {}),
    Template("reverse", "str", "x reversed", "return x[::-1]", lambda x, p: x[::-1], lambda r: {}),
    Template("upper", "str", "x in uppercase", "return x.upper()", lambda x, p: x.upper(), lambda r: {}),
    Template("count_char", "str", "count of '{c}' in x", "return x.count('{c}')", lambda x, p: x.count(p["c"]), _c),
    Template("repeat", "str", "x repeated {a} times", "return x*{a}", lambda x, p: x * p["a"], _a(2, 4)),
    Template("drop_char", "str", "x without '{c}'", "return x.replace('{c}','')", lambda x, p: x.replace(p["c"], ""),
             _c),
)
_BY_NAME = {t.name: t for t in TEMPLATES}


def _input(kind: str, rng: random.Random, k: int) -> Any:
    # The first two tests of a list/str spec are the edge cases (empty, one element) where bodies often break.
    if kind == "int":
        return rng.randint(-20, 50)
    n = 0 if k == 0 else 1 if k == 1 else rng.randint(2, 6)
    if kind == "list":
        return [rng.randint(-9, 20) for _ in range(n)]
    return "".join(rng.choice(LETTERS) for _ in range(n))


def same(a: Any, b: Any) -> bool:
    """Equality that also requires equal types (so True != 1 and 1 != 1.0), recursively for lists and dicts."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def _json_roundtrip(v: Any) -> Any:
    # Outputs come back through JSON (tuples become lists); compare expected values in the same form.
    return json.loads(json.dumps(v))


def score_outputs(result: SandboxResult, expected: Sequence[Any]) -> Reward:
    """Share of calls whose output equals the expected value; reason when none does."""
    passed = 0
    errors = 0
    first_error = None
    for out, want in zip(result.outputs, expected):
        if out is None:
            continue
        if not out.ok:
            errors += 1
            first_error = first_error or out.error
        elif same(out.value, _json_roundtrip(want)):
            passed += 1
    n = len(expected)
    info: dict[str, Any] = {"passed": passed, "total": n, "status": result.status, "detail": result.detail}
    if first_error:
        info["first_error"] = first_error
    if passed == 0:
        if result.status != "ok":
            reason = result.status
        elif errors == n:
            reason = "runtime_error"
        else:
            reason = "wrong_answer"
        return Reward(0.0, {"reason": reason, **info})
    return Reward(passed / n if n else 0.0, info)


class CodeTask:
    """Procedurally generated function-writing problems checked by hidden unit tests in the sandbox."""

    name = "code"
    multi_turn = False

    def __init__(self, n_tests: int = 5, templates: Sequence[str] | None = None, test_fraction: float = 0.2,
                 limits: SandboxLimits | None = None, sandbox: Sandbox | None = None, workers: int | None = None) -> None:
        unknown = set(templates or ()) - set(_BY_NAME)
        if unknown:
            raise ValueError(f"code: unknown templates {sorted(unknown)}; known: {sorted(_BY_NAME)}")
        if n_tests < 1:
            raise ValueError("code: n_tests must be >= 1")
        self.templates = [_BY_NAME[n] for n in templates] if templates else list(TEMPLATES)
        self.n_tests = n_tests
        self.test_fraction = test_fraction
        # Small limits: correct bodies take microseconds; a bad one should cost at most about a second.
        self.limits = limits or SandboxLimits(cpu_s=1.0, wall_s=5.0, call_cpu_s=0.25, memory_mb=256)
        self.sandbox = sandbox or Sandbox(self.limits)
        self.workers = workers
        self.tokenizer = CharTokenizer()
        self.max_new_tokens = 48

    def _make(self, rng: random.Random) -> tuple[str, Prompt]:
        t = rng.choice(self.templates)
        p = t.params(rng)
        key = f"{t.name}:{json.dumps(p, sort_keys=True)}"
        args = [_input(t.kind, rng, k) for k in range(self.n_tests)]
        tests = [{"args": [x], "expected": t.ref(x, p)} for x in args]
        text = f"# f({t.kind}): {t.spec.format(**p)}\ndef f(x):\n"
        return key, Prompt(text, {"template": t.name, "params": p, "tests": tests}, self.name, key)

    def prompts(self, split: str = "train", n: int = 64, seed: int = 0) -> list[Prompt]:
        """n seeded problems of one split; the split is decided by the spec (template and parameters)."""
        return draw(self.name, split, n, seed, self._make, self.test_fraction)

    def solve(self, prompt: Prompt) -> str:
        """The reference body (one-space indent), used for the supervised warm start."""
        return " " + _BY_NAME[prompt.meta["template"]].body.format(**prompt.meta["params"])

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """Run prompt + completion in the sandbox on the hidden inputs; reward = share of tests passed."""
        return self.rewards([prompt], [completion])[0]

    def rewards(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[Reward]:
        """Score a batch concurrently in the sandbox (what a trainer should call)."""
        if len(prompts) != len(completions):
            raise ValueError("prompts and completions differ in length")
        out: list[Reward | None] = [None] * len(prompts)
        todo = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            if c.strip():
                todo.append(i)
            else:
                out[i] = zero("empty", passed=0, total=len(p.meta["tests"]))  # not worth a process
        jobs = [(prompts[i].text + completions[i], [t["args"] for t in prompts[i].meta["tests"]]) for i in todo]
        for i, r in zip(todo, self.sandbox.run_many(jobs, self.limits, self.workers)):
            out[i] = score_outputs(r, [t["expected"] for t in prompts[i].meta["tests"]])
        return out  # type: ignore[return-value]
