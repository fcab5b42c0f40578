"""`dataset`: a user's prompts from a JSONL or Parquet file, rewarded by math-verify or by their own function.

Each row needs a `prompt` column and either an answer column (checked with math-verify: numerically and
symbolically equivalent answers match, e.g. `\\frac{1}{2}` and `0.5`) or a reward function given as
`"module:function"` (or a callable) called as `fn(prompt_text, completion, row)` and returning a float in
[0, 1], a bool or a `Reward`. Rows with a `split` column of "train"/"test" keep it; otherwise the split is a
stable hash of the prompt text.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracerl.tasks.base import Prompt, Reward, check_split, split_of, zero
from tracerl.tokenizer import load_tokenizer

RewardFn = Callable[[str, str, dict[str, Any]], Any]
MAX_ANSWER_CHARS = 4000  # math-verify parses with sympy; bound the text it sees from a runaway completion


def load_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of a .jsonl/.json-lines or .parquet file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset: no file at {str(p)!r}")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        rows = []
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"dataset: {p}:{lineno} is not valid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"dataset: {p}:{lineno} is not a JSON object")
                rows.append(row)
        return rows
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("dataset: reading Parquet needs pyarrow: pip install 'tracerl[data]'") from None
        return pq.read_table(p).to_pylist()
    raise ValueError(f"dataset: unsupported file type {suffix!r} for {str(p)!r}; use .jsonl or .parquet")


def resolve_reward_fn(spec: str | RewardFn) -> RewardFn:
    """Import `module:function` (or pass a callable through)."""
    if callable(spec):
        return spec
    module, sep, attr = str(spec).partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"dataset: reward_fn must look like 'module:function', got {spec!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"dataset: cannot import module {module!r} for reward_fn {spec!r}: {e}") from e
    fn = getattr(mod, attr, None)
    if fn is None:
        raise ImportError(f"dataset: module {module!r} has no attribute {attr!r} (reward_fn {spec!r})")
    if not callable(fn):
        raise TypeError(f"dataset: reward_fn {spec!r} is not callable")
    return fn


def math_reward(answer: Any, completion: str) -> Reward:
    """1.0 iff math-verify finds the completion's final answer equivalent to `answer`."""
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_text = str(answer)
    gold = parse(gold_text, parsing_timeout=timeout)
    if not gold and re.search(r"[\d\\]", gold_text):
        # Bare LaTeX such as \frac{1}{2} needs math delimiters; plain words must not get them (they would
        # parse as a product of variables).
        gold = parse(f"${gold_text}$", parsing_timeout=timeout)
    text = completion[-MAX_ANSWER_CHARS:]
    if not text.strip():
        return zero("empty", expected=gold_text)
    pred = parse(text, parsing_timeout=timeout)
    if not gold:
        # Not mathematics (e.g. a word): compare the completion's last line with the answer exactly.
        last = text.strip().splitlines()[-1].strip()
        ok = last == gold_text.strip()
        return Reward(1.0, {"expected": gold_text, "mode": "exact"}) if ok else zero(
            "wrong_answer", expected=gold_text, got=last[:80], mode="exact")
    if not pred:
        return zero("no_answer_found", expected=gold_text)
    if verify(gold, pred, timeout_seconds=timeout):
        return Reward(1.0, {"expected": gold_text, "got": str(pred[-1])[:80]})
    return zero("wrong_answer", expected=gold_text, got=str(pred[-1])[:80])


class DatasetTask:
    """Prompts from a user file; reward by math-verify against an answer column, or by a user function."""

    name = "dataset"
    multi_turn = False

    def __init__(self, path: str, answer_column: str | None = "answer", reward_fn: str | RewardFn | None = None,
                 prompt_column: str = "prompt", test_fraction: float = 0.1, tokenizer: str = "char",
                 max_new_tokens: int = 256) -> None:
        self.path = str(path)
        self.rows = load_rows(path)
        if not self.rows:
            raise ValueError(f"dataset: {self.path!r} has no rows")
        columns = set().union(*(r.keys() for r in self.rows))
        if prompt_column not in columns:
            raise ValueError(f"dataset: {self.path!r} has no {prompt_column!r} column (columns: {sorted(columns)})")
        self.reward_fn = resolve_reward_fn(reward_fn) if reward_fn is not None else None
        if self.reward_fn is None and (answer_column is None or answer_column not in columns):
            raise ValueError(f"dataset: {self.path!r} has no {answer_column!r} column (columns: {sorted(columns)}); "
                             "pass answer_column=... or reward_fn='module:function'")
        missing = [i for i, r in enumerate(self.rows) if not isinstance(r.get(prompt_column), str)]
        if missing:
            raise ValueError(f"dataset: row {missing[0]} of {self.path!r} has no text in {prompt_column!r}")
        self.prompt_column, self.answer_column = prompt_column, answer_column
        self.test_fraction = test_fraction
        self.tokenizer = load_tokenizer(tokenizer)
        self.max_new_tokens = max_new_tokens
        self._splits: dict[str, list[int]] = {"train": [], "test": []}
        for i, r in enumerate(self.rows):
            s = r.get("split")
            s = s if s in ("train", "test") else split_of(f"dataset/{r[prompt_column]}", test_fraction)
            self._splits[s].append(i)

    def prompts(self, split: str = "train", n: int = 64, seed: int = 0) -> list[Prompt]:
        """n rows of a split in a seeded order; more than the split holds cycles through reshuffled passes."""
        idx = self._splits[check_split(split)]
        if not idx:
            raise ValueError(f"dataset: {self.path!r} has no {split} rows")
        rng = random.Random(f"dataset/{split}/{seed}")
        order: list[int] = []
        while len(order) < n:
            epoch = list(idx)
            rng.shuffle(epoch)
            order.extend(epoch)
        return [self._prompt(i) for i in order[:n]]

    def _prompt(self, i: int) -> Prompt:
        row = self.rows[i]
        meta = {"row": row, "index": i}
        if self.answer_column and self.answer_column in row:
            meta["answer"] = row[self.answer_column]
        return Prompt(row[self.prompt_column], meta, self.name, str(i))

    def solve(self, prompt: Prompt) -> str:
        """The answer column's text, the only reference a generic dataset has."""
        if "answer" not in prompt.meta:
            raise ValueError("dataset: no answer column, so no reference completion for a warm start")
        return str(prompt.meta["answer"])

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """The user's reward_fn if given, else math-verify against the answer column."""
        if self.reward_fn is None:
            if "answer" not in prompt.meta or prompt.meta["answer"] is None:
                return zero("no_reference_answer")
            return math_reward(prompt.meta["answer"], completion)
        got = self.reward_fn(prompt.text, completion, prompt.meta["row"])
        if isinstance(got, Reward):
            return got
        value = float(got)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"dataset: reward_fn returned {value}, outside [0, 1]")
        return Reward(value) if value > 0 else zero("reward_fn_returned_zero")
