"""Losses, IS corrections and mismatch metrics against hand-computed examples."""

import math

import pytest
import torch

from tracerl.rl.corrections import Correction
from tracerl.rl.losses import aggregate, clipped_pg_loss_NT, group_advantages, k3_kl_NT, zero_variance_groups
from tracerl.rl.metrics import mismatch_metrics


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    a = group_advantages(r, g)
    # group 0: mean .5, std .5 -> +-1 ; group 1: all equal -> 0
    assert torch.allclose(a, torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0]), atol=1e-5)
    assert torch.allclose(group_advantages(r, g, scale=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0]))
    assert zero_variance_groups(r, g).tolist() == [False] * 4 + [True] * 2


def test_clipped_loss_both_sides_by_hand():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]]))  # ratios
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, clipped = clipped_pg_loss_NT(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # A>0, r=1.5 -> clip at 1.28 -> -1.28 ; A>0, r=.5 -> min(.5, .8) = .5 -> -.5
    # A<0, r=1.5 -> min(-1.5, -1.28) = -1.5 -> 1.5 ; A<0, r=.5 -> min(-.5, -.8) = -.8 -> .8
    assert torch.allclose(loss, torch.tensor([[-1.28, -0.5, 1.5, 0.8]]), atol=1e-6)
    assert clipped.tolist() == [[True, False, False, True]]
    # gradient is zero where clipped, r * A where not
    logp = logp.clone().requires_grad_()
    loss, _ = clipped_pg_loss_NT(logp, old, adv)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.allclose(g, torch.tensor([[0.0, -0.5, 1.5, 0.0]]), atol=1e-6)


def test_k3_by_hand():
    logp = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    r = 0.5
    assert torch.allclose(k3_kl_NT(logp, ref), torch.tensor([r - 1 - math.log(r)]))


def test_aggregation_token_vs_sequence_mean():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean").item() == pytest.approx((2 + 4) / 2)
    # micro-batches with global counts add up to the full-batch loss
    a = aggregate(loss[:1], mask[:1], "token-mean", n_tokens=4) + aggregate(loss[1:], mask[1:], "token-mean", n_tokens=4)
    assert a.item() == pytest.approx(10 / 4)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(loss, mask, "sum")


def test_tis_truncates_and_mis_masks():
    train = torch.log(torch.tensor([[0.9, 0.3, 0.5]]))
    roll = torch.log(torch.tensor([[0.3, 0.3, 0.5]]))  # ratios 3, 1, 1
    mask = torch.tensor([[True, True, False]])
    w, hit = Correction("tis", "token", 2.0).weights(train, roll, mask)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.0]]))
    assert hit.tolist() == [[True, False, False]]
    w, hit = Correction("mis", "token", 2.0).weights(train, roll, mask)
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 0.0]]))
    # sequence level: product of ratios 3 * 1 = 3 > 2 -> truncated to 2 for every token / masked
    w, _ = Correction("tis", "sequence", 2.0).weights(train, roll, mask)
    assert torch.allclose(w, torch.tensor([[2.0, 2.0, 0.0]]))
    w, _ = Correction("mis", "sequence", 4.0).weights(train, roll, mask)
    assert torch.allclose(w, torch.tensor([[3.0, 3.0, 0.0]]))
    w, hit = Correction().weights(train, roll, mask)
    assert torch.equal(w, torch.ones_like(w)) and not hit.any()
    with pytest.raises(ValueError, match="unknown correction"):
        Correction("ppo")


def test_mismatch_metrics_by_hand():
    train = torch.log(torch.tensor([[0.38, 0.2, 0.9]]))
    roll = torch.log(torch.tensor([[0.2, 0.2, 0.1]]))
    mask = torch.tensor([[True, True, False]])
    m = mismatch_metrics(train, roll, mask)
    r = torch.tensor([1.9, 1.0], dtype=torch.float64)
    assert m["mismatch/kl_k3"] == pytest.approx(float((r - 1 - r.log()).mean()), rel=1e-5)
    assert m["mismatch/logp_abs_diff_mean"] == pytest.approx(math.log(1.9) / 2, rel=1e-5)
    assert m["mismatch/prob_abs_diff_mean"] == pytest.approx(0.09, rel=1e-5)
    assert m["mismatch/prob_abs_diff_max"] == pytest.approx(0.18, rel=1e-5)
    assert m["mismatch/ratio_max"] == pytest.approx(1.9, rel=1e-5)
    assert m["mismatch/frac_ratio_outside_0.5_2"] == 0.0
    # one ratio of 2.5 and one of 0.4 out of four tokens lie outside [0.5, 2]
    out = mismatch_metrics(torch.log(torch.tensor([[0.5, 0.2, 0.3, 0.3]])), torch.log(torch.tensor([[0.2, 0.5, 0.3, 0.3]])),
                           torch.ones(1, 4, dtype=torch.bool))
    assert out["mismatch/frac_ratio_outside_0.5_2"] == 0.5
    # k3 per token (hand): r = 1.9 -> 0.9 - ln 1.9 = 0.258146, r = 1 -> 0; the worst is all of it
    assert m["mismatch/kl_k3_top1_share"] == pytest.approx(1.0) and m["mismatch/tokens"] == 2
    assert math.isnan(m["mismatch/kl_k3_trim5"])  # fewer than 6 tokens
    ratios = torch.tensor([[3.0] + [1.1] * 9], dtype=torch.float64)
    big = mismatch_metrics(ratios.log(), torch.zeros(1, 10), torch.ones(1, 10, dtype=torch.bool))
    k_big, k_small = 2 - math.log(3), 0.1 - math.log(1.1)
    assert big["mismatch/kl_k3_top1_share"] == pytest.approx(k_big / (k_big + 9 * k_small), rel=1e-9)
    assert big["mismatch/kl_k3_trim5"] == pytest.approx(k_small, rel=1e-9)  # 5 of 10 dropped, the rest equal
    with pytest.raises(ValueError, match="empty"):
        mismatch_metrics(train, roll, torch.zeros_like(mask))
