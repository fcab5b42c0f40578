"""Train/rollout mismatch metrics (names fixed in DESIGN.md "Metrics")."""

from __future__ import annotations

import torch

TRIM = 5  # kl_k3_trim5: the mean k3 without the 5 largest tokens


def mismatch_metrics(train_logp_NT: torch.Tensor, rollout_logp_NT: torch.Tensor, mask_NT: torch.Tensor) -> dict[str, float]:
    """Compare the trainer's and the rollout's logprobs of the sampled tokens over `mask_NT`."""
    m = mask_NT.bool()
    # float64: k3 = r - 1 - log r cancels catastrophically when r is within 1e-7 of 1
    lt, lr = train_logp_NT.detach().double()[m], rollout_logp_NT.detach().double()[m]
    if lt.numel() == 0:
        raise ValueError("no response tokens to compare (empty mask)")
    log_r = lt - lr  # r = pi_train / pi_rollout
    r = torch.exp(log_r)
    dp = (torch.exp(lt) - torch.exp(lr)).abs()
    k3 = r - 1 - log_r
    n, total = k3.numel(), float(k3.sum())
    worst = torch.topk(k3, min(TRIM, n)).values
    return {
        "mismatch/kl_k3": float(k3.mean()),
        # how much of kl_k3 a handful of tokens carry: with low mismatch one low-probability token
        # can be most of it, and two alignments then differ by that token's noise, not by method
        "mismatch/kl_k3_top1_share": float(worst[0]) / total if total > 0 else 0.0,
        f"mismatch/kl_k3_trim{TRIM}": (total - float(worst.sum())) / (n - TRIM) if n > TRIM else float("nan"),
        "mismatch/tokens": float(n),
        "mismatch/logp_abs_diff_mean": float(log_r.abs().mean()),
        "mismatch/prob_abs_diff_mean": float(dp.mean()),
        "mismatch/prob_abs_diff_max": float(dp.max()),
        "mismatch/ratio_max": float(r.max()),
        "mismatch/frac_ratio_outside_0.5_2": float(((r < 0.5) | (r > 2)).float().mean()),
    }


def flip_metrics(flips: dict, n_layers: int) -> dict[str, float]:
    """`flips/act_frac` over all sites and `flips/layer_<i>` per layer, from FakeQuant.flips."""
    from tracerl.qat import SiteName

    out: dict[str, float] = {}
    tot_f = tot_n = 0
    per_layer: dict[int, list[int]] = {}
    for site, f in flips.items():
        tot_f += f.flipped
        tot_n += f.total
        layer = SiteName.parse(site).layer
        if layer is not None:
            acc = per_layer.setdefault(layer, [0, 0])
            acc[0] += f.flipped
            acc[1] += f.total
    if tot_n:
        out["flips/act_frac"] = tot_f / tot_n
    for i in range(n_layers):
        if i in per_layer and per_layer[i][1]:
            out[f"flips/layer_{i}"] = per_layer[i][0] / per_layer[i][1]
    return out


def entropy_mean(logits_NTV: torch.Tensor, mask_NT: torch.Tensor) -> float:
    """Mean token entropy of the policy over masked positions."""
    logp = torch.log_softmax(logits_NTV.detach().float(), -1)
    ent = -(logp.exp() * logp).sum(-1)
    return float(ent[mask_NT.bool()].mean()) if mask_NT.any() else 0.0
