"""Policy-gradient losses: GRPO advantages, PPO/DAPO clipped objective, k3 KL, aggregation.

Shapes: N sequences, T token columns; `mask_NT` marks the policy's tokens (the loss never sees
prompt, padding or environment tokens).
"""

from __future__ import annotations

import torch


def group_advantages(rewards_N: torch.Tensor, group_N: torch.Tensor, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: reward minus its group mean, divided by the group std (unbiased=False) if `scale`."""
    groups, inv = torch.unique(group_N, return_inverse=True)
    inv = inv.to(rewards_N.device)
    zeros = dict(dtype=rewards_N.dtype, device=rewards_N.device)
    n_g = torch.zeros(len(groups), **zeros).index_add_(0, inv, torch.ones_like(rewards_N))
    mean_g = torch.zeros(len(groups), **zeros).index_add_(0, inv, rewards_N) / n_g
    centred = rewards_N - mean_g[inv]
    if not scale:
        return centred
    var_g = torch.zeros(len(groups), **zeros).index_add_(0, inv, centred**2) / n_g
    return centred / (var_g.sqrt()[inv] + eps)


def zero_variance_groups(rewards_N: torch.Tensor, group_N: torch.Tensor) -> torch.Tensor:
    """Bool (N,): sequences whose group has identical rewards (no learning signal; DAPO dynamic sampling drops them)."""
    out = torch.zeros_like(group_N, dtype=torch.bool)
    for g in torch.unique(group_N):
        sel = group_N == g
        r = rewards_N[sel]
        out[sel] = bool((r == r[0]).all())
    return out


def clipped_pg_loss_NT(
    logp_NT: torch.Tensor, old_logp_NT: torch.Tensor, adv_NT: torch.Tensor, *, clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss with DAPO clip-higher: -min(r A, clip(r, 1-lo, 1+hi) A); also the clipped-token indicator."""
    ratio = torch.exp(logp_NT - old_logp_NT)
    unclipped = ratio * adv_NT
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv_NT
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).detach()
    return loss, was_clipped


def k3_kl_NT(logp_NT: torch.Tensor, ref_logp_NT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: r - 1 - log r with r = ref / pi."""
    log_r = ref_logp_NT - logp_NT
    return torch.exp(log_r) - 1 - log_r


def aggregate(loss_NT: torch.Tensor, mask_NT: torch.Tensor, agg: str = "token-mean", *,
              n_tokens: int | None = None, n_seqs: int | None = None) -> torch.Tensor:
    """Reduce a per-token loss over masked tokens.

    token-mean: sum over all tokens / number of tokens (DAPO); seq-mean: mean over sequences of
    each sequence's token mean (GRPO's original). `n_tokens` / `n_seqs` give the global counts
    when the batch is split into micro-batches, so the micro-batch losses add up to the full one.
    """
    m = mask_NT.to(loss_NT.dtype)
    if agg == "token-mean":
        denom = n_tokens if n_tokens is not None else m.sum().clamp(min=1)
        return (loss_NT * m).sum() / denom
    if agg == "seq-mean":
        per_seq = (loss_NT * m).sum(-1) / m.sum(-1).clamp(min=1)
        has = (m.sum(-1) > 0).to(loss_NT.dtype)
        denom = n_seqs if n_seqs is not None else has.sum().clamp(min=1)
        return (per_seq * has).sum() / denom
    raise ValueError(f"unknown loss aggregation {agg!r}; use token-mean or seq-mean")
