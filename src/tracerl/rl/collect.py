"""Turn prompts into a scored RolloutBatch: single-turn completions or multi-turn episodes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracerl import tasks as T
from tracerl.rollout import Engine, RolloutBatch, SamplingParams


@dataclass
class Collected:
    """A RolloutBatch with one reward per row and what the task said about it."""

    batch: RolloutBatch
    rewards: torch.Tensor  # (B,) float32 in [0, 1]
    completions: list[str]
    infos: list[dict]
    turns: float = 1.0  # mean policy turns per sequence


def decode(tokenizer, ids: list[int]) -> str:
    """Text of generated ids; ids beyond the tokenizer (the model's padded vocab rows) decode to nothing."""
    return tokenizer.decode([i for i in ids if i < tokenizer.vocab_size], skip_special=True)


def _prompt_ids(task, prompts: list[T.Prompt]) -> list[list[int]]:
    return [task.tokenizer.encode(p.text, add_bos=True) for p in prompts]


def _turn_text(task, batch: RolloutBatch, i: int, skip: int) -> str:
    """Sequence i's policy tokens after its first `skip` (the latest turn's action).

    Counted in policy tokens, not columns: the reference engine starts every turn at one column,
    the graph engine each sequence right after its own last token."""
    ids = batch.tokens[i][batch.policy_mask[i]][skip:].tolist()
    return decode(task.tokenizer, ids)


def collect(engine: Engine, task, prompts: list[T.Prompt], *, samples_per_prompt: int, max_new_tokens: int,
            temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> Collected:
    """Generate `samples_per_prompt` rollouts per prompt and score them with the task."""
    tok = task.tokenizer
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            stop=(tok.eos_id,), n=samples_per_prompt)
    batch = engine.generate(_prompt_ids(task, prompts), params, seed=seed)
    rows = [prompts[j] for j in batch.prompt_index.tolist()]
    if not getattr(task, "multi_turn", False):
        completions = [decode(tok, batch.responses(i)) for i in range(len(batch))]
        rewards = T.rewards(task, rows, completions)
        return Collected(batch, torch.tensor([r.value for r in rewards]), completions, [r.info for r in rewards])
    return _episodes(engine, task, rows, batch, params, seed)


def _episodes(engine: Engine, task, rows: list[T.Prompt], batch: RolloutBatch, params: SamplingParams,
              seed: int) -> Collected:
    """Alternate policy turns and environment observations until every episode ends."""
    tok = task.tokenizer
    episodes = [task.reset(p) for p in rows]
    turn_start = [0] * len(batch)  # policy tokens before each sequence's latest turn
    transcripts: list[list[str]] = [[] for _ in rows]
    turn_params = SamplingParams(max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                                 top_p=params.top_p, stop=params.stop, n=1)
    live = [True] * len(rows)
    n_turns = 0
    while True:
        appended: list[list[int] | None] = []
        for i, ep in enumerate(episodes):
            if not live[i]:
                appended.append(None)
                continue
            action = _turn_text(task, batch, i, turn_start[i])
            transcripts[i].append(action)
            obs, _, done = ep.step(action)
            if done:
                live[i] = False
                appended.append(None)
            else:
                appended.append(tok.encode(obs))
        n_turns += 1
        if not any(live):
            break
        need = max(len(a) for a in appended if a is not None) + turn_params.max_new_tokens
        if batch.tokens.shape[1] + need > engine.max_len:
            break  # out of context: the episode ends here and is scored as it stands
        before = batch.policy_mask.sum(-1).tolist()
        batch = engine.continue_(batch, appended, turn_params, seed=seed + n_turns)
        for i, a in enumerate(appended):
            if a is not None:
                turn_start[i] = before[i]
    rewards = torch.tensor([min(max(float(ep.total_reward), 0.0), 1.0) for ep in episodes])
    infos = [{"turns": len(t), "done": bool(getattr(ep, "done", True))} for t, ep in zip(transcripts, episodes)]
    return Collected(batch, rewards, [" | ".join(t) for t in transcripts], infos,
                     turns=sum(len(t) for t in transcripts) / len(transcripts))
