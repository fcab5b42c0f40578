"""tracerl.model against transformers: Qwen3-MoE, Mixtral and OLMoE checkpoints load and give the same logits.

Tolerances (measured on these tiny random models, init std 0.1):
- float32: max |logit diff| / max |logit| below 1e-6 (asserted 1e-4), with and without padding.
- bfloat16: the max error is dominated by near-tie routing flips (one flipped expert changes a
  token's logits by ~10-30%), so we compare means: mean |diff| / mean |logit| against
  transformers' bf16 forward was 0.8-2.7% over 9 models (asserted < 5%), and our bf16 forward is
  as close to the float32 logits as transformers' own bf16 forward is.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tracerl import model as M
from tracerl.model.hf import ARCH_CLASS

V = 96
COMMON = dict(vocab_size=V, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, attn_implementation="eager", initializer_range=0.1, max_position_embeddings=512)
ARCHS = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(num_experts=8, moe_intermediate_size=32, intermediate_size=64, head_dim=32, mlp_only_layers=[1],
                       norm_topk_prob=True, rope_theta=1e6)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=8, intermediate_size=32, head_dim=32)),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM, dict(num_experts=8, intermediate_size=32, norm_topk_prob=False,
                                                   clip_qkv=2.0, pad_token_id=0, eos_token_id=1)),
}


def _rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _rel_mean(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean() / b.abs().mean())


def make_hf(arch: str, path, seed: int = 0, **overrides):
    """A tiny random transformers model of `arch`, saved to `path`."""
    cfg_cls, model_cls, kw = ARCHS[arch]
    torch.manual_seed(seed)
    hf = model_cls(cfg_cls(**{**COMMON, **kw, **overrides})).eval()
    hf.save_pretrained(path)
    return hf


def _padded_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (3, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    mask[1, 17:] = 0  # right padding
    return ids, mask


def _hf_router_ids(hf_out, top_k: int, shape) -> list[torch.Tensor]:
    """transformers' top-k experts per MoE layer, from output_router_logits (its own rule: top-k of softmax)."""
    return [torch.topk(torch.softmax(r.float(), -1), top_k, dim=-1).indices.reshape(*shape, top_k)
            for r in hf_out.router_logits]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_and_routing_match_transformers_fp32(arch, tmp_path):
    hf = make_hf(arch, tmp_path)
    m = M.from_pretrained(tmp_path)
    assert m.config.arch == arch
    assert next(m.parameters()).dtype == torch.float32
    ids, mask = _padded_batch()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, output_router_logits=True)
        out = m(ids, return_routing=True)
        ref_pad = hf(ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
        out_pad = m(ids, mask, return_routing=True)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (3, 24, V)
    assert _rel_max(out.logits, ref.logits) < 1e-4
    valid = mask.bool()
    assert _rel_max(out_pad.logits[valid], ref_pad.logits[valid]) < 1e-4
    # routing: transformers reports router logits for MoE layers only, in order
    assert len(ref.router_logits) == len(m.config.moe_layers)
    for r, hf_ids in zip([out, out_pad], [_hf_router_ids(ref, 2, ids.shape), _hf_router_ids(ref_pad, 2, ids.shape)]):
        for j, layer in enumerate(m.config.moe_layers):
            ours = r.routing.layer(layer).long()
            assert torch.equal(ours[valid], hf_ids[j][valid])


def test_config_variants_are_read(tmp_path):
    make_hf("qwen3_moe", tmp_path / "q")
    make_hf("mixtral", tmp_path / "m")
    make_hf("olmoe", tmp_path / "o")
    q, mx, o = (M.from_pretrained(tmp_path / n).config for n in "qmo")
    assert (q.qk_norm, q.router, q.norm_topk_prob, q.dense_layers, q.dense_size, q.rope_theta) == (
        "head", "softmax_topk", True, (1,), 64, 1e6)
    assert (mx.qk_norm, mx.router, mx.norm_topk_prob, mx.dense_layers) == ("none", "topk_softmax", True, ())
    assert (o.qk_norm, o.norm_topk_prob, o.clip_qkv) == ("full", False, 2.0)
    assert q.moe_layers == (0, 2)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_close_to_transformers(arch, tmp_path):
    hf = make_hf(arch, tmp_path, seed=1)
    m = M.from_pretrained(tmp_path, dtype=torch.bfloat16)
    m32 = M.from_pretrained(tmp_path)
    assert next(m.parameters()).dtype == torch.bfloat16
    ids = torch.randint(3, V, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref32 = hf(ids).logits
        ref16 = hf.to(torch.bfloat16)(ids).logits.float()
        out16 = m(ids)
        out_master = m32(ids, compute_dtype=torch.bfloat16)  # fp32 masters cast where used == bf16 weights
    assert out16.dtype == torch.float32
    assert torch.equal(out16, out_master)
    assert _rel_mean(out16, ref16) < 0.05
    assert _rel_mean(out16, ref32) < 2 * _rel_mean(ref16, ref32) + 0.01


@pytest.mark.parametrize("arch", list(ARCHS))
def test_save_pretrained_round_trip_through_transformers(arch, tmp_path):
    cfg_overrides = {
        "qwen3_moe": dict(dense_layers=(2,), dense_size=64, norm_topk_prob=False, tie_word_embeddings=True),
        "mixtral": dict(qk_norm="none", router="topk_softmax"),
        "olmoe": dict(qk_norm="full", norm_topk_prob=False, clip_qkv=0.5),
    }[arch]
    m = M.build("tiny", seed=3, arch=arch, num_layers=3, init_std=0.1, **cfg_overrides)
    m.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [ARCH_CLASS[arch]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == ARCH_CLASS[arch]
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = m(ids)
        theirs = hf(ids).logits
    assert _rel_max(ours, theirs) < 1e-4
    # and back into tracerl: identical parameters
    m2 = M.from_pretrained(tmp_path)
    assert m2.config.replace(name="x") == m.config.replace(name="x")
    for (n1, p1), (n2, p2) in zip(m.named_parameters(), m2.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_sharded_save_and_load(tmp_path):
    m = M.build("tiny", seed=0)
    m.save_pretrained(tmp_path, dtype=torch.bfloat16, max_shard_bytes=400_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    m2 = M.from_pretrained(tmp_path)
    assert next(m2.parameters()).dtype == torch.bfloat16
    for p1, p2 in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p1.to(torch.bfloat16), p2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        assert _rel_max(m2.float()(ids), hf(ids).logits) < 1e-4
    # saving again unsharded replaces the shards and keeps unrelated files (a tokenizer)
    (tmp_path / "tokenizer.json").write_text("{}")
    m.save_pretrained(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json"]


def test_fused_expert_layout_is_accepted(tmp_path):
    """A checkpoint storing experts stacked (transformers' in-memory names) loads the same."""
    from safetensors.torch import load_file, save_file

    make_hf("qwen3_moe", tmp_path / "a")
    ref = M.from_pretrained(tmp_path / "a")
    sd = load_file(tmp_path / "a" / "model.safetensors")
    for i in (0, 2):
        p = f"model.layers.{i}.mlp.experts"
        gate = torch.stack([sd.pop(f"{p}.{e}.gate_proj.weight") for e in range(8)])
        up = torch.stack([sd.pop(f"{p}.{e}.up_proj.weight") for e in range(8)])
        sd[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        sd[f"{p}.down_proj"] = torch.stack([sd.pop(f"{p}.{e}.down_proj.weight") for e in range(8)])
    (tmp_path / "b").mkdir()
    save_file(sd, tmp_path / "b" / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(tmp_path / "a" / "config.json", tmp_path / "b" / "config.json")
    m = M.from_pretrained(tmp_path / "b")
    for p1, p2 in zip(ref.parameters(), m.parameters()):
        assert torch.equal(p1, p2)


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        M.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        M.from_pretrained(tmp_path / "empty")

    good = tmp_path / "good"
    make_hf("qwen3_moe", good)
    cfg = json.loads((good / "config.json").read_text())

    def variant(name, cfg_changes=None, drop_weights=False):
        d = tmp_path / name
        shutil.copytree(good, d)
        if cfg_changes is not None:
            (d / "config.json").write_text(json.dumps({**cfg, **cfg_changes}))
        if drop_weights:
            (d / "model.safetensors").unlink()
        return d

    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        M.from_pretrained(variant("noweights", drop_weights=True))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*not supported"):
        M.from_pretrained(variant("llama", {"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="moe_intermediate_size|has shape .* the config implies"):
        M.from_pretrained(variant("shape", {"moe_intermediate_size": 64}))
    with pytest.raises(ValueError, match="tensors missing"):
        M.from_pretrained(variant("layers", {"num_hidden_layers": 4}))
    with pytest.raises(ValueError, match="no place in the model"):
        M.from_pretrained(variant("fewer", {"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="rope_type"):
        M.from_pretrained(variant("yarn", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                               "rope_theta": 1e6, "original_max_position_embeddings": 128}}))
    shard_dir = tmp_path / "shards"
    M.build("tiny").save_pretrained(shard_dir, max_shard_bytes=400_000)
    next(shard_dir.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        M.from_pretrained(shard_dir)


def test_save_errors_for_variants_without_hf_equivalent(tmp_path):
    m = M.build("tiny", arch="mixtral")  # tiny has per-head qk-norm, which Mixtral does not
    with pytest.raises(ValueError, match="cannot be saved as MixtralForCausalLM.*qk_norm"):
        m.save_pretrained(tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
