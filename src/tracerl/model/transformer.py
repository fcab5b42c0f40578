"""MoEModel: the decoder-only MoE transformer (Qwen3-MoE / Mixtral / OLMoE variants) with named quant sites.

Forward (B rows, S new tokens, T = attention_mask.shape[1] total positions, V vocab):

    model(input_ids (B, S), attention_mask (B, T) of 1/0 = None, *, position_ids (B, S) = None,
          quant = NoQuant(), routing_replay = None, return_routing = False, kv_cache = None,
          compute_dtype = None) -> logits (B, S, V) float32, or ModelOutput(logits, routing)

- Without a cache T == S. Position ids default to attention_mask.cumsum(-1) - 1 clamped at 0
  (left-padded rows count from their first real token), the last S columns with a cache.
- compute_dtype (default: the parameters' dtype): weights are cast to it where used; norms,
  softmax, RoPE tables and the router run in float32; logits are float32 (the lm_head matmul runs
  in float32 when config.logits_fp32, else in compute_dtype and is upcast).
- quant: a `tracerl.qat.QuantHandler`, called at every site (`site_names()` lists them).
- routing_replay: a RoutingRecord (L, B, S, K) for these tokens; the experts are taken from it and
  the gate weights recomputed from this forward's router logits (the router keeps its gradient).
- kv_cache: an object with `update(layer_idx, k_BSHD, v_BSHD) -> (k_all, v_all)` (see kvcache.py);
  the new tokens are the last S of the T positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tracerl import qat
from tracerl.model.config import ModelConfig, get_config
from tracerl.model.layers import Attention, DenseMLP, RMSNorm, causal_padding_mask, rope_cos_sin
from tracerl.model.moe import MoE
from tracerl.model.routing import RoutingRecord


@dataclass
class ModelOutput:
    """logits (B, S, V) float32 and, when asked for, the routing of these tokens."""

    logits: torch.Tensor
    routing: RoutingRecord | None = None


class Block(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)) with mlp = MoE or dense SwiGLU."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp = MoE(cfg, layer_idx) if self.is_moe else DenseMLP(cfg, layer_idx)

    def forward(self, h_BSD, cos, sin, mask, quant, kv_cache, replay_ids_BSK):
        h_BSD = h_BSD + self.attn(self.attn_norm(h_BSD), cos, sin, mask, quant, kv_cache)
        x_BSD = self.mlp_norm(h_BSD)
        if self.is_moe:
            y_BSD, ids_BSK = self.mlp(x_BSD, quant, replay_ids_BSK)
            return h_BSD + y_BSD, ids_BSK
        return h_BSD + self.mlp(x_BSD, quant), None


class MoEModel(nn.Module):
    """Decoder-only MoE LM. Parameter names (state_dict):

    embed.weight (V, D); layers.{i}.attn_norm.weight; layers.{i}.attn.{q,k,v,o}_proj.weight;
    layers.{i}.attn.{q,k}_norm.weight (qk_norm != none); layers.{i}.mlp_norm.weight;
    MoE layers: layers.{i}.mlp.router.weight (E, D), layers.{i}.mlp.experts.w_gate_up (E, 2F, D),
    layers.{i}.mlp.experts.w_down (E, D, F); dense layers: layers.{i}.mlp.gate_up.weight (2F, D),
    layers.{i}.mlp.down.weight (D, F); norm.weight; lm_head.weight (V, D) unless tied.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    # ------------------------------------------------------------------ init / names

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> MoEModel:
        """Random init, deterministic per seed (and device): N(0, init_std) matrices, ones for norms."""
        g = torch.Generator(device=self.embed.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, self.config.init_std, generator=g)
        return self

    def weight_sites(self) -> dict[str, str]:
        """Weight quant site -> parameter name, for every linear weight (experts: the stacked tensors)."""
        out: dict[str, str] = {}
        for i, blk in enumerate(self.layers):
            for n in ("q", "k", "v", "o"):
                out[f"layers.{i}.attn.{n}_proj.weight"] = f"layers.{i}.attn.{n}_proj.weight"
            if blk.is_moe:
                out[f"layers.{i}.mlp.router.weight"] = f"layers.{i}.mlp.router.weight"
                out[f"layers.{i}.mlp.experts.gate_up.weight"] = f"layers.{i}.mlp.experts.w_gate_up"
                out[f"layers.{i}.mlp.experts.down.weight"] = f"layers.{i}.mlp.experts.w_down"
            else:
                out[f"layers.{i}.mlp.gate_up.weight"] = f"layers.{i}.mlp.gate_up.weight"
                out[f"layers.{i}.mlp.down.weight"] = f"layers.{i}.mlp.down.weight"
        out["lm_head.weight"] = "embed.weight" if self.lm_head is None else "lm_head.weight"
        return out

    def site_names(self) -> list[str]:
        """Every quant site the forward calls (weights, linear inputs, K/V cache), in call order."""
        sites: list[str] = []
        for i, blk in enumerate(self.layers):
            a = f"layers.{i}.attn"
            sites += [f"{a}.{n}_proj.input" for n in "qkv"] + [f"{a}.{n}_proj.weight" for n in "qkv"]
            sites += [f"{a}.k_cache", f"{a}.v_cache", f"{a}.o_proj.input", f"{a}.o_proj.weight"]
            m = f"layers.{i}.mlp"
            if blk.is_moe:
                sites += [f"{m}.router.input", f"{m}.router.weight"]
                sites += [f"{m}.experts.gate_up.input", f"{m}.experts.gate_up.weight", f"{m}.experts.down.weight",
                          f"{m}.experts.down.input"]
            else:
                sites += [f"{m}.gate_up.input", f"{m}.gate_up.weight", f"{m}.down.input", f"{m}.down.weight"]
        return sites + ["lm_head.input", "lm_head.weight"]

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        quant: qat.QuantHandler | None = None,
        routing_replay: RoutingRecord | None = None,
        return_routing: bool = False,
        kv_cache=None,
        compute_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | ModelOutput:
        cfg = self.config
        quant = qat.NoQuant() if quant is None else quant
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        B, S = input_ids.shape
        dtype = compute_dtype or self.embed.weight.dtype
        valid_BT = self._check_mask(attention_mask, B, S, kv_cache)
        if position_ids is None:
            if valid_BT is None:
                position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
            else:
                position_ids = (valid_BT.long().cumsum(-1) - 1).clamp(min=0)[:, -S:]
        elif position_ids.shape != (B, S):
            raise ValueError(f"position_ids must be (batch, seq) = {(B, S)}, got {tuple(position_ids.shape)}")
        mask = None if valid_BT is None else causal_padding_mask(valid_BT, S)
        replay = self._check_replay(routing_replay, B, S)

        h_BSD = F.embedding(input_ids, self.embed.weight).to(dtype)
        cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, dtype)
        ids_per_layer = []
        for i, blk in enumerate(self.layers):
            replay_ids = None if replay is None or not blk.is_moe else replay.layer(i)
            h_BSD, ids_BSK = blk(h_BSD, cos, sin, mask, quant, kv_cache, replay_ids)
            if ids_BSK is not None:
                ids_per_layer.append(ids_BSK)
        h_BSD = self.norm(h_BSD)

        x = quant.act("lm_head.input", h_BSD)
        w_head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        w = quant.weight("lm_head.weight", w_head.to(dtype))
        logits = F.linear(x.float(), w.float()) if cfg.logits_fp32 else F.linear(x, w).float()
        if not return_routing:
            return logits
        record = RoutingRecord.from_layers([t.detach() for t in ids_per_layer], cfg.moe_layers, cfg.num_experts)
        return ModelOutput(logits, record)

    def _check_mask(self, attention_mask, B: int, S: int, kv_cache) -> torch.Tensor | None:
        if attention_mask is None:
            if kv_cache is not None:
                raise ValueError("forward with kv_cache needs attention_mask (B, S_total) covering cached + new tokens")
            return None
        if attention_mask.dim() != 2 or attention_mask.shape[0] != B:
            raise ValueError(f"attention_mask must be (batch, total_len) with batch={B}, got {tuple(attention_mask.shape)}")
        T = attention_mask.shape[1]
        if kv_cache is None and T != S:
            raise ValueError(f"attention_mask has {T} columns but input_ids has {S} tokens (no kv_cache given)")
        if T < S:
            raise ValueError(f"attention_mask has {T} columns, fewer than the {S} new tokens")
        return attention_mask.bool()

    def _check_replay(self, rec: RoutingRecord | None, B: int, S: int) -> RoutingRecord | None:
        if rec is None:
            return None
        cfg = self.config
        if rec.layers != cfg.moe_layers:
            raise ValueError(f"routing_replay covers layers {rec.layers}, this model's MoE layers are {cfg.moe_layers}")
        want = (len(cfg.moe_layers), B, S, cfg.top_k)
        if tuple(rec.shape) != want:
            raise ValueError(f"routing_replay has shape {tuple(rec.shape)}, expected (L, B, S, K) = {want}; "
                             "slice the record to this micro-batch's rows and positions")
        ids = rec.expert_ids.to(self.embed.weight.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.num_experts):
            raise ValueError(f"routing_replay holds expert ids outside 0..{cfg.num_experts - 1}")
        return RoutingRecord(ids, rec.layers, rec.num_experts)

    # ------------------------------------------------------------------ weights out

    def pack_weights(self, recipe: qat.Recipe, dtype: torch.dtype = torch.bfloat16):
        """PackedWeights for the rollout engine: FP4 where `recipe` quantizes, `dtype` copies elsewhere."""
        from tracerl.model.packed import pack_weights

        return pack_weights(self, recipe, dtype)

    def save_pretrained(self, path, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
        """Write a Hugging Face folder (config.json + safetensors) that transformers loads; see hf.py."""
        from tracerl.model.hf import save_pretrained

        save_pretrained(self, path, dtype=dtype, max_shard_bytes=max_shard_bytes)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @staticmethod
    def from_pretrained(path, *, dtype: torch.dtype | None = None, device=None) -> MoEModel:
        """Load a Hugging Face checkpoint folder (see hf.from_pretrained)."""
        from tracerl.model.hf import from_pretrained

        return from_pretrained(path, dtype=dtype, device=device)


def build(
    preset: str | ModelConfig = "tiny",
    seed: int = 0,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> MoEModel:
    """A randomly initialised model (deterministic per seed and device) from a preset name or a ModelConfig.

    `overrides` replace config fields, e.g. `build("small", vocab_size=151936)`.
    """
    cfg = get_config(preset, **overrides)
    with torch.device(device or "cpu"):
        model = MoEModel(cfg)
    model.to(dtype)
    return model.init_weights(seed)
