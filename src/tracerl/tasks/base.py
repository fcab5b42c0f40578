"""The task interface: prompts, rewards, multi-turn episodes, and the helpers every task shares."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from tracerl.tokenizer import Tokenizer

Split = Literal["train", "test"]
Role = Literal["policy", "env"]


@dataclass(frozen=True)
class Prompt:
    """One problem: `text` is what the policy sees, `meta` what the reward needs (never shown)."""

    text: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    task: str = ""
    id: str = ""


@dataclass(frozen=True)
class Reward:
    """A scalar in [0, 1] and diagnostics; `info["reason"]` says why when the value is 0."""

    value: float
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.value <= 1.0:
            raise ValueError(f"reward {self.value} outside [0, 1]")
        if self.value == 0.0 and "reason" not in self.info:
            raise ValueError("a zero reward must say why (info['reason'])")


def zero(reason: str, **info: Any) -> Reward:
    """A zero reward with its reason."""
    return Reward(0.0, {"reason": reason, **info})


@dataclass(frozen=True)
class Turn:
    """One turn of a multi-turn transcript: who produced `text` (the policy's text excludes eos)."""

    role: Role
    text: str


@runtime_checkable
class Episode(Protocol):
    """A running multi-turn interaction."""

    total_reward: float
    done: bool

    def step(self, action_text: str) -> tuple[str, float, bool]:
        """Apply the policy's action; return (observation text, reward for this step, done)."""
        ...


@runtime_checkable
class Task(Protocol):
    """An RL environment: reproducible prompts and a reward for a completion."""

    name: str
    tokenizer: Tokenizer
    max_new_tokens: int
    multi_turn: bool

    def prompts(self, split: Split = "train", n: int = 64, seed: int = 0) -> list[Prompt]:
        """n seeded prompts from a split; train and test never share a problem."""
        ...

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """Score the policy's completion (text decoded up to eos)."""
        ...


@runtime_checkable
class MultiTurnTask(Task, Protocol):
    """A task whose episodes alternate environment observations and policy actions."""

    def reset(self, prompt: Prompt) -> Episode:
        """Start an episode; the first observation is `prompt.text`."""
        ...


def split_of(key: str, test_fraction: float) -> Split:
    """Assign a problem to a split by a stable hash of its canonical key (same on every machine)."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return "test" if h / 2**64 < test_fraction else "train"


def check_split(split: str) -> Split:
    """Validate a split name."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return split  # type: ignore[return-value]


def draw(
    task: str,
    split: str,
    n: int,
    seed: int,
    make: Callable[[random.Random], tuple[Hashable, Prompt]],
    test_fraction: float,
    max_tries_per_item: int = 400,
) -> list[Prompt]:
    """Draw n prompts of one split by rejection on the hashed key; no repeats unless the split runs dry.

    `make(rng)` returns (canonical key, prompt). Rejection on the key's hash is what keeps train and
    test disjoint for every seed, while the seed fixes which problems (and their order) come out.
    """
    split = check_split(split)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    # String seeds hash with SHA-512 inside `random`, so they are stable across processes.
    rng = random.Random(f"{task}/{split}/{seed}")
    out: list[Prompt] = []
    seen: set[Hashable] = set()
    tries = repeats_in_a_row = 0
    allow_repeats = False
    while len(out) < n:
        tries += 1
        if tries > max_tries_per_item * max(n, 1):
            raise RuntimeError(f"{task}: could not draw {n} {split} prompts; the problem space is too small")
        key, prompt = make(rng)
        if split_of(f"{task}/{key}", test_fraction) != split:
            continue
        if key in seen and not allow_repeats:
            # A long run of repeats means the split is (nearly) exhausted: small spaces must still fill n.
            repeats_in_a_row += 1
            allow_repeats = repeats_in_a_row >= 200
            continue
        repeats_in_a_row = 0
        seen.add(key)
        out.append(prompt)
    return out


def build_multiturn_sequence(
    prompt_ids: Sequence[int], turns: Sequence[tuple[Role, Sequence[int]]]
) -> tuple[list[int], list[bool]]:
    """Concatenate a prompt and interleaved (role, ids) turns; the mask is True exactly on policy tokens.

    The policy's ids must include the eos it generated, so the loss also teaches it to stop.
    """
    ids = list(prompt_ids)
    mask = [False] * len(ids)
    for role, turn_ids in turns:
        if role not in ("policy", "env"):
            raise ValueError(f"turn role must be 'policy' or 'env', got {role!r}")
        ids.extend(int(i) for i in turn_ids)
        mask.extend([role == "policy"] * len(turn_ids))
    return ids, mask


def encode_transcript(
    tokenizer: Tokenizer, prompt_text: str, turns: Sequence[Turn], add_bos: bool = True
) -> tuple[list[int], list[bool]]:
    """Tokenize a text transcript (policy turns get an eos) and mark the policy's tokens."""
    prompt_ids = tokenizer.encode(prompt_text, add_bos=add_bos)
    id_turns: list[tuple[Role, list[int]]] = []
    for t in turns:
        ids = tokenizer.encode(t.text)
        if t.role == "policy":
            ids.append(tokenizer.eos_id)
        id_turns.append((t.role, ids))
    return build_multiturn_sequence(prompt_ids, id_turns)
