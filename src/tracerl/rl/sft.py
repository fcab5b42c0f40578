"""Supervised warm start: teach a freshly initialised model the task format before RL.

A tiny random model earns zero reward and RL has nothing to learn from; a short supervised pass
on the task's reference solutions (tracerl.tasks.sft_dataset) gives it a non-zero start, as the
SFT stage before RL does for real models. Loss: cross-entropy on the policy's tokens only.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from tracerl import tasks as T


def sft_examples(task, n: int, seed: int = 0) -> list[tuple[list[int], list[bool]]]:
    """Tokenized (ids, policy-token mask) warm-start sequences for `task`."""
    tok = task.tokenizer
    out = []
    for prompt_text, target in T.sft_dataset(task, n, seed=seed):
        if isinstance(target, str):
            p = tok.encode(prompt_text, add_bos=True)
            c = tok.encode(target) + [tok.eos_id]
            out.append((p + c, [False] * len(p) + [True] * len(c)))
        else:  # multi-turn transcript
            out.append(T.encode_transcript(tok, prompt_text, target))
    return out


def _pad(batch: list[tuple[list[int], list[bool]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    L = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    att = torch.zeros(len(batch), L, dtype=torch.bool)
    pol = torch.zeros(len(batch), L, dtype=torch.bool)
    for i, (x, m) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        att[i, : len(x)] = True
        pol[i, : len(m)] = torch.tensor(m)
    return ids, att, pol


def warm_start(model: torch.nn.Module, task, *, steps: int, batch_size: int, lr: float, examples: int,
               seed: int = 0, compute_dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
               on_step: Callable[[int, float], None] | None = None,
               stop: Callable[[int], bool] | None = None, check_every: int = 0) -> list[float]:
    """Run up to `steps` AdamW steps of next-token cross-entropy on the policy tokens; return the losses.

    With `stop` and `check_every` > 0, `stop(steps_done)` is asked every `check_every` steps (in eval
    mode, without gradients) and the warm start ends when it says so.
    """
    if steps <= 0:
        return []
    data = sft_examples(task, examples, seed=seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10)))
    losses = []
    model.train()
    for step in range(steps):
        ids, att, pol = (t.to(device) for t in _pad(rng.sample(data, min(batch_size, len(data))), task.tokenizer.pad_id))
        logits = model(ids, attention_mask=att, compute_dtype=compute_dtype).float()
        target_mask = pol[:, 1:]
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * target_mask).sum() / target_mask.sum().clamp(min=1)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"warm start diverged at step {step} (loss {loss.item()}); lower warm_start.lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = float(loss.detach())
        losses.append(value)
        if on_step is not None:
            on_step(step, value)
        if stop is not None and check_every > 0 and (step + 1) % check_every == 0 and step + 1 < steps:
            model.eval()
            with torch.no_grad():
                done = stop(step + 1)
            model.train()
            if done:
                break
    return losses
