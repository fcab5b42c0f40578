"""Held-out evaluation: greedy decoding on the test split, in the precision the policy is deployed in."""

from __future__ import annotations

from tracerl.rl.collect import collect
from tracerl.rollout import Engine


def evaluate(engine: Engine, task, *, n: int = 64, max_new_tokens: int | None = None, seed: int = 0) -> dict[str, float]:
    """Accuracy (share of full-reward answers) and mean reward over n test prompts, greedy."""
    prompts = task.prompts("test", n, seed=seed)
    col = collect(engine, task, prompts, samples_per_prompt=1, max_new_tokens=max_new_tokens or task.max_new_tokens,
                  temperature=0.0, seed=seed)
    r = col.rewards
    return {"acc": float((r >= 1.0 - 1e-6).float().mean()), "reward": float(r.mean()), "n": len(prompts)}
