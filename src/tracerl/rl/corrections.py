"""Importance-sampling corrections for the rollout/trainer mismatch (off-policy from FP4 rollouts).

r = pi_train / pi_rollout per token (the trainer's detached logprob over the rollout's).
- `tis` (truncated IS, FlashRL): weight min(r, C); token-level by default (C = 2).
- `mis` (masked IS): weight r where r <= C, else the token (or sequence) is dropped (weight 0).
Sequence level uses the product of the sequence's token ratios.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Correction:
    """Which correction, at which level, with which threshold."""

    kind: str = "none"  # none | tis | mis
    level: str = "token"  # token | sequence
    threshold: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "tis", "mis"):
            raise ValueError(f"unknown correction {self.kind!r}; use none, tis or mis")
        if self.level not in ("token", "sequence"):
            raise ValueError(f"unknown correction level {self.level!r}; use token or sequence")
        if self.threshold <= 0:
            raise ValueError(f"correction threshold must be > 0, got {self.threshold}")

    def weights(self, train_logp_NT: torch.Tensor, rollout_logp_NT: torch.Tensor, mask_NT: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights_NT detached, affected_NT bool: tokens truncated or masked)."""
        log_r = (train_logp_NT - rollout_logp_NT).detach() * mask_NT
        if self.kind == "none":
            return torch.ones_like(log_r), torch.zeros_like(mask_NT, dtype=torch.bool)
        if self.level == "sequence":
            log_r = log_r.sum(-1, keepdim=True).expand_as(log_r)
        r = torch.exp(log_r.clamp(max=50.0))
        over = (r > self.threshold) & mask_NT
        if self.kind == "tis":
            w = r.clamp(max=self.threshold)
        else:
            w = torch.where(over, torch.zeros_like(r), r)
        return w * mask_NT, over
