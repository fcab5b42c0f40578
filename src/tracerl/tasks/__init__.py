"""RL environments: reasoning (`arith`, `countdown`), coding (`code`, `humaneval`), long-horizon (`maze`) and
user datasets (`dataset`), behind one small interface (see `base.Task`). Formats: docs/tasks.md.

    task = tasks.get("arith")
    prompts = task.prompts("train", n=64, seed=0)
    rewards = tasks.rewards(task, prompts, completions)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tracerl.tasks.base import (
    Episode,
    MultiTurnTask,
    Prompt,
    Reward,
    Task,
    Turn,
    build_multiturn_sequence,
    encode_transcript,
)

__all__ = [
    "Episode", "MultiTurnTask", "Prompt", "Reward", "Task", "Turn", "build_multiturn_sequence",
    "encode_transcript", "get", "names", "register", "rewards", "sft_dataset",
]


def _arith(**kw: Any) -> Task:
    from tracerl.tasks.arith import ArithTask

    return ArithTask(**kw)


def _countdown(**kw: Any) -> Task:
    from tracerl.tasks.countdown import CountdownTask

    return CountdownTask(**kw)


def _code(**kw: Any) -> Task:
    from tracerl.tasks.code import CodeTask

    return CodeTask(**kw)


def _maze(**kw: Any) -> Task:
    from tracerl.tasks.maze import MazeTask

    return MazeTask(**kw)


def _humaneval(**kw: Any) -> Task:
    from tracerl.tasks.humaneval import HumanEvalTask

    return HumanEvalTask(**kw)


def _dataset(**kw: Any) -> Task:
    from tracerl.tasks.dataset import DatasetTask

    if "path" not in kw:
        raise TypeError("tasks.get('dataset', ...) needs path=<.jsonl or .parquet file>")
    return DatasetTask(**kw)


# Factories import lazily: `code` pulls in the sandbox, `countdown` reasoning-gym, `dataset` math-verify.
_REGISTRY: dict[str, Callable[..., Task]] = {
    "arith": _arith, "countdown": _countdown, "code": _code, "maze": _maze,
    "humaneval": _humaneval, "dataset": _dataset,
}


def names() -> list[str]:
    """Names `get` accepts."""
    return list(_REGISTRY)


def register(name: str, factory: Callable[..., Task]) -> None:
    """Add a task factory under a new name."""
    if name in _REGISTRY:
        raise ValueError(f"task {name!r} is already registered")
    _REGISTRY[name] = factory


def get(name: str, **options: Any) -> Task:
    """Build a task by name with its options (e.g. get("arith", digits=3, ops="+-"))."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(names())}") from None
    return factory(**options)


def _as_task(task: Task | str) -> Task:
    return get(task) if isinstance(task, str) else task


def rewards(task: Task, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[Reward]:
    """Score a batch; tasks that can (code, humaneval) run it concurrently."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    batch = getattr(task, "rewards", None)
    if callable(batch):
        return list(batch(prompts, completions))
    return [task.reward(p, c) for p, c in zip(prompts, completions)]


def sft_dataset(task: Task | str, n: int, seed: int = 0) -> list[tuple[str, Any]]:
    """Warm-start pairs (prompt text, target) from the train split's reference solutions.

    Single-turn tasks give the target completion text (no eos; append the tokenizer's eos when
    tokenizing). Multi-turn tasks (maze) give the list of `Turn`s after the prompt, policy and env
    alternating and ending with the policy's last move; tokenize with `encode_transcript`, which adds
    the eos after each policy turn and masks the env turns.
    """
    task = _as_task(task)
    solve = getattr(task, "solve", None)
    if not callable(solve):
        raise TypeError(f"task {task.name!r} has no reference solver (solve) for a warm start")
    return [(p.text, solve(p)) for p in task.prompts("train", n, seed)]
