"""tracerl.model: config checks, forward contract, padding, KV cache, grouped experts, routing replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tracerl import model as M
from tracerl.model.config import ModelConfig, get_config
from tracerl.model.moe import experts_matmul, experts_matmul_loop

V = 128


@pytest.fixture(scope="module")
def tiny():
    return M.build("tiny", seed=0, init_std=0.1)


def _ids(B=3, S=16, seed=0):
    return torch.randint(3, V, (B, S), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- config


def test_presets():
    tiny, small, big = (M.PRESETS[n] for n in ("tiny", "small", "qwen3-30b-a3b"))
    assert 1e6 <= tiny.num_params() <= 5e6
    assert (tiny.vocab_size, tiny.num_layers, tiny.num_experts, tiny.top_k, tiny.head_dim, tiny.max_seq_len) == (
        128, 4, 8, 2, 32, 256)
    assert 128 <= tiny.hidden_size <= 192
    assert 100e6 <= small.num_params() <= 300e6
    assert (big.num_layers, big.hidden_size, big.num_experts, big.top_k, big.expert_size, big.num_heads,
            big.num_kv_heads, big.head_dim, big.vocab_size, big.rope_theta) == (
        48, 2048, 128, 8, 768, 32, 4, 128, 151936, 1e6)
    # the published sizes of Qwen3-30B-A3B: 30.5B total, 3.3B active
    assert abs(big.num_params() / 1e9 - 30.5) < 0.1 and abs(big.num_params(active=True) / 1e9 - 3.3) < 0.1
    assert M.build("tiny").num_params() == tiny.num_params()


@pytest.mark.parametrize("bad, match", [
    (dict(hidden_size=100), "hidden_size=100 is not a multiple of 32"),
    (dict(expert_size=48), "expert_size=48"),
    (dict(head_dim=16), "head_dim=16"),
    (dict(num_heads=3), "not a multiple of num_kv_heads"),
    (dict(top_k=9), "top_k=9 exceeds num_experts=8"),
    (dict(dense_layers=(7,)), "outside 0..3"),
    (dict(dense_layers=(1,)), "dense_size must be a positive multiple of 32"),
    (dict(dense_layers=(0, 1, 2, 3), dense_size=64), "every layer is dense"),
    (dict(qk_norm="per_head"), "qk_norm"),
    (dict(router="topk_softmax", norm_topk_prob=False), "normalised by construction"),
    (dict(vocab_size=0), "vocab_size must be positive"),
])
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        get_config("tiny", **bad)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'huge'.*tiny"):
        M.build("huge")


def test_build_is_deterministic_per_seed():
    a, b, c = M.build("tiny", seed=1), M.build("tiny", seed=1), M.build("tiny", seed=2)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["layers.0.mlp.experts.w_gate_up"], pc["layers.0.mlp.experts.w_gate_up"])
    assert pa["layers.0.mlp.experts.w_gate_up"].shape == (8, 256, 128)
    assert pa["layers.0.mlp.experts.w_down"].shape == (8, 128, 128)
    assert torch.equal(pa["layers.0.attn.q_norm.weight"], torch.ones(32))


# ----------------------------------------------------------------------------- forward contract


@torch.no_grad()
def test_forward_outputs(tiny):
    ids = _ids()
    logits = tiny(ids)
    assert logits.shape == (3, 16, V) and logits.dtype == torch.float32
    out = tiny(ids, return_routing=True)
    assert isinstance(out, M.ModelOutput) and torch.equal(out.logits, logits)
    r = out.routing
    assert r.expert_ids.shape == (4, 3, 16, 2) and r.expert_ids.dtype == torch.uint8
    assert r.layers == (0, 1, 2, 3) and r.nbytes == 4 * 3 * 16 * 2
    assert int(r.expert_ids.max()) < 8
    # top-k ids are distinct per token
    assert bool((r.expert_ids[..., 0] != r.expert_ids[..., 1]).all())
    bf = tiny(ids, compute_dtype=torch.bfloat16)
    assert bf.dtype == torch.float32
    assert float((bf - logits).abs().mean() / logits.abs().mean()) < 0.05  # routing flips dominate


def test_padding_does_not_affect_real_tokens(tiny):
    ids = _ids(B=1, S=10, seed=3)
    alone = tiny(ids)
    pad = torch.zeros(1, 6, dtype=torch.long)
    junk = _ids(B=1, S=6, seed=4)
    left = tiny(torch.cat([junk, ids], 1), torch.cat([pad, torch.ones_like(ids)], 1))
    right = tiny(torch.cat([ids, junk], 1), torch.cat([torch.ones_like(ids), pad], 1))
    torch.testing.assert_close(left[:, 6:], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(right[:, :10], alone, rtol=0, atol=1e-5)
    # other rows of a batch (different pads, different junk) change nothing either
    batch = torch.cat([torch.cat([junk, ids], 1), _ids(B=1, S=16, seed=5)])
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :6] = 0
    mask[1, 11:] = 0
    torch.testing.assert_close(tiny(batch, mask)[0, 6:], alone[0], rtol=0, atol=1e-5)
    assert torch.isfinite(tiny(batch, mask)).all()


def test_position_ids_default_and_explicit(tiny):
    ids = _ids(B=2, S=12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    torch.testing.assert_close(tiny(ids, mask), tiny(ids, mask, position_ids=pos), rtol=0, atol=0)
    base = tiny(ids, mask)
    # RoPE is relative: a constant shift changes (almost) nothing, a stretch changes the logits
    torch.testing.assert_close(tiny(ids, mask, position_ids=pos + 5), base, rtol=0, atol=1e-4)
    assert not torch.allclose(tiny(ids, mask, position_ids=pos * 2)[1], base[1], atol=1e-2)


def test_forward_input_errors(tiny):
    ids = _ids(B=2, S=8)
    with pytest.raises(ValueError, match="attention_mask has 9 columns but input_ids has 8"):
        tiny(ids, torch.ones(2, 9))
    with pytest.raises(ValueError, match="needs attention_mask"):
        tiny(ids, kv_cache=M.DenseKVCache.for_model(tiny, 2, 16))
    with pytest.raises(ValueError, match="input_ids must be"):
        tiny(ids[0])


def test_kv_cache_decode_matches_full_forward(tiny):
    B, P, G = 3, 9, 7
    ids = _ids(B=B, S=P + G, seed=7)
    mask = torch.ones(B, P + G, dtype=torch.long)
    mask[0, :3] = 0  # left-padded prompts
    mask[2, :6] = 0
    with torch.no_grad():
        full = tiny(ids, mask, return_routing=True)
        cache = M.DenseKVCache.for_model(tiny, B, max_len=32)
        steps = [tiny(ids[:, :P], mask[:, :P], kv_cache=cache, return_routing=True)]
        assert cache.seq_len == P
        for t in range(P, P + G):
            steps.append(tiny(ids[:, t:t + 1], mask[:, :t + 1], kv_cache=cache, return_routing=True))
    inc = torch.cat([s.logits for s in steps], dim=1)
    valid = mask.bool()
    torch.testing.assert_close(inc[valid], full.logits[valid], rtol=0, atol=1e-5)
    rec = M.RoutingRecord.cat([s.routing for s in steps], dim="seq")
    assert rec.shape == full.routing.shape
    assert rec.mismatch_frac(full.routing, valid) == 0.0


def test_kv_cache_explicit_advance_and_errors(tiny):
    ids = _ids(B=1, S=6)
    mask = torch.ones(1, 6, dtype=torch.long)
    cache = M.DenseKVCache.for_model(tiny, 1, max_len=8, auto_advance=False)
    with torch.no_grad():
        a = tiny(ids[:, :4], mask[:, :4], kv_cache=cache)
        assert cache.seq_len == 0
        cache.advance(4)
        b = tiny(ids[:, 4:], mask, kv_cache=cache)
        cache.advance(2)
    torch.testing.assert_close(torch.cat([a, b], 1), tiny(ids), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="exceed max_len=8"):
        tiny(_ids(B=1, S=3), torch.ones(1, 9), kv_cache=cache)
    cache.reset()
    with pytest.raises(ValueError, match="attention_mask has 5 columns"):
        tiny(ids[:, :4], torch.ones(1, 5), kv_cache=cache)


# ----------------------------------------------------------------------------- experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_matmul_grouped_equals_loop(dtype):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1, 0, 7])  # empty groups included
    x = torch.randn(int(counts.sum()), 64, generator=g).to(dtype).requires_grad_()
    w = torch.randn(6, 32, 64, generator=g).to(dtype).requires_grad_()
    offs = counts.cumsum(0).to(torch.int32)
    y = experts_matmul(x, w, offs)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = experts_matmul_loop(x2, w2, offs)
    ref = torch.cat([x[s:e] @ w[i].T for i, (s, e) in enumerate(zip([0, *offs[:-1].tolist()], offs.tolist()))])
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y, ref, **tol)
    torch.testing.assert_close(y2, ref, **tol)
    y.sum().backward()  # an expanded (stride-0) gradient: torch._grouped_mm needs it made contiguous
    y2.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, **tol)
    torch.testing.assert_close(w.grad, w2.grad, **tol)
    assert float(w.grad[1].abs().sum()) == 0.0  # an expert with no tokens gets no gradient


def _moe_reference(moe, x_BSD):
    """Per-token MoE straight from the definition (a token loop, test only)."""
    B, S, D = x_BSD.shape
    logits = F.linear(x_BSD.reshape(-1, D), moe.router.weight)
    probs = torch.softmax(logits, -1)
    ids = torch.topk(probs, moe.top_k, -1).indices
    w = probs.gather(-1, ids)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros(B * S, D)
    for t in range(B * S):
        for k in range(moe.top_k):
            e = int(ids[t, k])
            gate, up = (moe.experts.w_gate_up[e] @ x_BSD.reshape(-1, D)[t]).chunk(2)
            out[t] += w[t, k] * (moe.experts.w_down[e] @ (F.silu(gate) * up))
    return out.reshape(B, S, D), ids.reshape(B, S, -1)


def test_moe_layer_matches_per_token_definition(tiny):
    moe = tiny.layers[1].mlp
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, ids = moe(x, M.transformer.qat.NoQuant())
        ref, ref_ids = _moe_reference(moe, x)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_experts_matmul_seam_is_used(tiny):
    calls = []
    moe = tiny.layers[0].mlp

    def spy(x, w, offs):
        calls.append((tuple(x.shape), tuple(w.shape), offs.dtype))
        return experts_matmul_loop(x, w, offs)

    moe.experts_matmul = spy
    try:
        ids = _ids(B=2, S=4)
        with torch.no_grad():
            tiny(ids)
    finally:
        del moe.experts_matmul
    assert calls == [((16, 128), (8, 256, 128), torch.int32), ((16, 128), (8, 128, 128), torch.int32)]


# ----------------------------------------------------------------------------- routing replay


def test_replay_of_own_record_reproduces_forward_and_router_gets_gradient(tiny):
    ids = _ids(seed=11)
    out = tiny(ids, return_routing=True)
    tiny.zero_grad()
    replayed = tiny(ids, routing_replay=out.routing, return_routing=True)
    assert torch.equal(replayed.logits, out.logits)
    assert torch.equal(replayed.routing.expert_ids, out.routing.expert_ids)
    replayed.logits.logsumexp(-1).mean().backward()
    for i in range(4):
        g = tiny.layers[i].mlp.router.weight.grad
        assert g is not None and torch.isfinite(g).all() and float(g.abs().sum()) > 0
    tiny.zero_grad()


def test_replay_of_other_record_uses_those_experts(tiny):
    ids = _ids(seed=12)
    other = tiny(_ids(seed=13), return_routing=True).routing
    own = tiny(ids, return_routing=True)
    tiny.zero_grad()
    out = tiny(ids, routing_replay=other, return_routing=True)
    assert torch.equal(out.routing.expert_ids, other.expert_ids)
    assert own.routing.mismatch_frac(other) > 0.5
    assert not torch.allclose(out.logits, own.logits, atol=1e-3)
    out.logits.logsumexp(-1).mean().backward()
    g = tiny.layers[2].mlp.router.weight.grad
    assert torch.isfinite(g).all() and float(g.abs().sum()) > 0
    tiny.zero_grad()


def test_replay_gate_weights_follow_the_rules():
    from tracerl.model.moe import gate_weights

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    ids = torch.tensor([[2, 0]])  # a replayed pair, not this token's top-2
    p = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(gate_weights(logits, ids, "softmax_topk", False), torch.stack([p[2], p[0]])[None])
    torch.testing.assert_close(gate_weights(logits, ids, "softmax_topk", True),
                               (torch.stack([p[2], p[0]]) / (p[2] + p[0]))[None])
    torch.testing.assert_close(gate_weights(logits, ids, "topk_softmax", True), torch.softmax(torch.tensor([[0.0, 2.0]]), -1))


def test_replay_errors(tiny):
    ids = _ids(B=2, S=8)
    rec = tiny(ids, return_routing=True).routing
    with pytest.raises(ValueError, match="expected \\(L, B, S, K\\)"):
        tiny(ids[:, :6], routing_replay=rec)
    bad = M.RoutingRecord(rec.expert_ids.clone(), rec.layers, 8)
    bad.expert_ids[0, 0, 0, 0] = 9
    with pytest.raises(ValueError, match="outside 0..7"):
        tiny(ids, routing_replay=bad)


def test_routing_record_ops(tiny):
    out = tiny(_ids(B=4, S=6), return_routing=True).routing
    assert out[1:3].shape == (4, 2, 6, 2) and torch.equal(out[1:3].expert_ids, out.expert_ids[:, 1:3])
    assert out[-1].shape == (4, 1, 6, 2) and torch.equal(out[-1].expert_ids, out.expert_ids[:, 3:])
    assert torch.equal(out[torch.tensor([True, False, True, False])].expert_ids, out.expert_ids[:, [0, 2]])
    assert out.seq_slice(2, 5).shape == (4, 4, 3, 2)
    assert out.to("cpu").nbytes == out.nbytes == 4 * 4 * 6 * 2
    both = M.RoutingRecord.cat([out[:2], out[2:]], dim="batch")
    assert torch.equal(both.expert_ids, out.expert_ids)
    assert torch.equal(out.layer(2), out.expert_ids[2])
    with pytest.raises(KeyError, match="layer 7"):
        out.layer(7)
    from tracerl.model.routing import ids_dtype

    assert (ids_dtype(8), ids_dtype(256), ids_dtype(257), ids_dtype(40000)) == (
        torch.uint8, torch.uint8, torch.int16, torch.int32)


def test_dense_layers(tiny):
    m = M.build("tiny", seed=0, dense_layers=(0, 2), dense_size=96)
    out = m(_ids(), return_routing=True)
    assert out.routing.layers == (1, 3) and out.routing.shape[0] == 2
    assert dict(m.named_parameters())["layers.0.mlp.gate_up.weight"].shape == (192, 128)
    assert M.ModelConfig(dense_layers=(0,), dense_size=64).moe_layers == (1, 2, 3)
    assert isinstance(ModelConfig().replace(num_layers=2), ModelConfig)
