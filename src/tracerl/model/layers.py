"""Transformer building blocks: RMSNorm, rotary embeddings, GQA attention, the dense SwiGLU MLP.

Precision (as real trainers run it): parameters may be float32 masters; every weight is cast to
the compute dtype where it is used (differentiably, before the quant handler sees it); norms,
softmax and RoPE tables are computed in float32 and cast back.

Quant sites: every linear goes through `quant.act(f"{site}.input", x)` and
`quant.weight(f"{site}.weight", w)`; K and V as written to the cache go through
`quant.act("layers.{i}.attn.k_cache", k_BSHD)` after the k-norm and RoPE (blocks along head_dim,
rows token x head). When a KV cache object is passed, it is the cache's job to quantize/record
what it stores, so those two sites are not called.

Shapes: B batch, S new tokens, T total positions (cache + new), D hidden, H query heads,
Hkv key/value heads, Dh head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tracerl import qat
from tracerl.model.config import ModelConfig


class RMSNorm(nn.Module):
    """y = weight * (x / rms(x)) with the normalisation in float32, output in x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * h.to(x.dtype)


def rope_cos_sin(
    position_ids_BS: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (B, S, Dh) for positions (B, S); computed in float32 (HF's order), cast to dtype."""
    dev = position_ids_BS.device
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=dev).float() / head_dim))
    freqs = position_ids_BS[..., None].float() * inv_freq  # (B, S, Dh/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    """Rotate (B, S, H, Dh) by the tables (B, S, Dh) (the half-split convention of HF Llama/Qwen)."""
    cos, sin = cos_BSD.unsqueeze(2), sin_BSD.unsqueeze(2)
    return x_BSHD * cos + _rotate_half(x_BSHD) * sin


def linear(x: torch.Tensor, weight: torch.Tensor, site: str, quant: qat.QuantHandler, dtype: torch.dtype) -> torch.Tensor:
    """A quant-site linear: y = act(site.input, x) @ weight(site.weight, W.to(dtype)).T."""
    x = quant.act(f"{site}.input", x)
    w = quant.weight(f"{site}.weight", weight.to(dtype))
    return F.linear(x, w)


def causal_padding_mask(valid_BT: torch.Tensor, s_new: int) -> torch.Tensor:
    """Boolean SDPA mask (B, 1, S_new, T): query i (absolute index T-S_new+i) sees key j <= it if valid.

    Causality is by index in the padded layout, so left and right padding both work. A query with
    no visible key at all (a pad token before the first real one) is allowed to see itself only,
    so its (unused) output stays finite; real tokens never see pad keys.
    """
    T = valid_BT.shape[1]
    dev = valid_BT.device
    q_idx = torch.arange(T - s_new, T, device=dev)
    k_idx = torch.arange(T, device=dev)
    causal_QT = k_idx[None, :] <= q_idx[:, None]
    allowed_BQT = causal_QT[None] & valid_BT[:, None, :]
    none_BQ1 = ~allowed_BQT.any(-1, keepdim=True)
    diag_QT = k_idx[None, :] == q_idx[:, None]
    allowed_BQT = allowed_BQT | (none_BQ1 & diag_QT[None])
    return allowed_BQT[:, None]


class Attention(nn.Module):
    """GQA self-attention with optional q/k RMSNorm ("head": per head over Dh, "full": over the projection)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.prefix = f"layers.{layer_idx}.attn"
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.clip_qkv = cfg.clip_qkv
        self.qk_norm = cfg.qk_norm
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, cfg.q_size, bias=False)
        self.k_proj = nn.Linear(d, cfg.kv_size, bias=False)
        self.v_proj = nn.Linear(d, cfg.kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, d, bias=False)
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(cfg.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.kv_size, cfg.rms_norm_eps)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos_BSD: torch.Tensor,
        sin_BSD: torch.Tensor,
        mask_B1ST: torch.Tensor | None,
        quant: qat.QuantHandler,
        kv_cache=None,
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        dtype = x_BSD.dtype
        p = self.prefix
        sites = [f"{p}.{n}_proj" for n in "qkv"]
        xs = [quant.act(f"{s}.input", x_BSD) for s in sites]
        # q/k/v are one fused group (one NVFP4 global scale) in vLLM and compressed-tensors checkpoints
        ws = qat.weight_group(quant, [(f"{s}.weight", m.weight.to(dtype))
                                      for s, m in zip(sites, (self.q_proj, self.k_proj, self.v_proj))])
        q, k, v = (F.linear(x, w) for x, w in zip(xs, ws))
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q_BSHD = q.view(B, S, self.num_heads, self.head_dim)
        k_BSHD = k.view(B, S, self.num_kv_heads, self.head_dim)
        v_BSHD = v.view(B, S, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q_BSHD, k_BSHD = self.q_norm(q_BSHD), self.k_norm(k_BSHD)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q_BSHD, k_BSHD, v_BSHD = q_BSHD.clamp(-c, c), k_BSHD.clamp(-c, c), v_BSHD.clamp(-c, c)
        q_BSHD = apply_rope(q_BSHD, cos_BSD, sin_BSD)
        k_BSHD = apply_rope(k_BSHD, cos_BSD, sin_BSD)

        if kv_cache is not None:
            k_BTHD, v_BTHD = kv_cache.update(self.layer_idx, k_BSHD, v_BSHD)
            if mask_B1ST is not None and k_BTHD.shape[1] != mask_B1ST.shape[-1]:
                raise ValueError(
                    f"layer {self.layer_idx}: the KV cache holds {k_BTHD.shape[1]} positions after this update but "
                    f"attention_mask has {mask_B1ST.shape[-1]} columns; pass the mask of all positions so far"
                )
            k_BTHD, v_BTHD = k_BTHD.to(dtype), v_BTHD.to(dtype)
        else:
            k_BTHD = quant.act(f"{p}.k_cache", k_BSHD)
            v_BTHD = quant.act(f"{p}.v_cache", v_BSHD)

        attend = getattr(kv_cache, "attention", None)
        if attend is not None:  # the engine's own attention kernel over its cache (e.g. split-KV decode)
            o_BHSD = attend(q_BSHD, k_BTHD, v_BTHD, mask_B1ST)
        else:
            o_BHSD = F.scaled_dot_product_attention(
                q_BSHD.transpose(1, 2), k_BTHD.transpose(1, 2), v_BTHD.transpose(1, 2),
                attn_mask=mask_B1ST, is_causal=mask_B1ST is None and kv_cache is None,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
        o_BSD = o_BHSD.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim)
        return linear(o_BSD, self.o_proj.weight, f"{p}.o_proj", quant, dtype)


class DenseMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)); gate and up are one fused (2F, D) weight, gate first."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.prefix = f"layers.{layer_idx}.mlp"
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.dense_size, bias=False)
        self.down = nn.Linear(cfg.dense_size, cfg.hidden_size, bias=False)

    def forward(self, x_BSD: torch.Tensor, quant: qat.QuantHandler) -> torch.Tensor:
        dtype = x_BSD.dtype
        h = linear(x_BSD, self.gate_up.weight, f"{self.prefix}.gate_up", quant, dtype)
        gate, up = h.chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down.weight, f"{self.prefix}.down", quant, dtype)
