"""Sampling parameters and the token sampler of the rollout engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the engine samples completions.

    temperature=0 means greedy. `stop` holds token ids that end a sequence (they are kept in the
    response, as the EOS an RL policy must learn to emit). `n` samples per prompt form a GRPO
    group and share the prompt's prefill.
    """

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[int, ...] = field(default_factory=tuple)
    n: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(int(t) for t in self.stop))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits (R, V); return (tokens, logprobs) as (R,) tensors.

    The logprob is log softmax(logits / T) at the sampled token: the tempered distribution the
    trainer recomputes. top-k / top-p only restrict which tokens may be drawn; they are off by
    default, as in RL rollouts, so that the recorded logprob is the sampling distribution's.
    logits must be finite: nothing here checks (on CUDA a check is a host sync); the engine flags
    non-finite logits on the device and raises at its once-per-step poll, before sampling from them.
    """
    logits = logits.float()
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    masked = scaled
    if params.top_k > 0:
        kth = torch.topk(masked, min(params.top_k, masked.shape[-1]), dim=-1).values[:, -1:]
        masked = masked.masked_fill(masked < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(masked, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        masked = masked.masked_fill(drop, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    tok = draw(probs, generator)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of probs (R, V), drawn as `torch.multinomial(probs, 1)` draws it, bit for bit.

    multinomial's one-sample path is argmax(p / q) with q ~ Exp(1) from the same generator, after a
    host-side check of the probabilities (an `.item()`: one device sync per decode step on CUDA).
    The engine checks the logits for inf/NaN once per step already (`FiniteWatch`), so the check is
    left out and the draw stays on the device.
    """
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q).argmax(dim=-1)
