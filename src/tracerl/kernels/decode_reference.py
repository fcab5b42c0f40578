"""PyTorch references of the decode kernels (fp4_gemm.py, fp4_attention.py), importable without Triton.

The Triton kernels are tested against these on the GPU and in the Triton interpreter (CI runs the
interpreter, and compiles the kernels for sm_90: tests/hopper_compile.py); these are also tested
against the model's and the engine's own ops.
"""

from __future__ import annotations

import math

import torch

from tracerl import fp4
from tracerl.kernels.fp4_swizzle import SwizzledFP4


def exact_values(q: fp4.FP4Tensor) -> torch.Tensor:
    """float32 c * s8 (the block-scaled code, without the global scale): what the kernel dots."""
    if isinstance(q, SwizzledFP4):
        q = q.natural()
    codes = fp4.unpack_codes(q).to(torch.int64)
    vals = fp4.E2M1_VALUES.to(codes.device)[codes]
    s = q.scales.to(torch.float32)
    return (vals.reshape(*vals.shape[:-1], -1, 16) * s.unsqueeze(-1)).reshape(vals.shape)


def grouped_gemm_reference(
    a: torch.Tensor | fp4.FP4Tensor,
    w: torch.Tensor | fp4.FP4Tensor,
    offsets: torch.Tensor,
    *,
    row_idx: torch.Tensor | None = None,
    swiglu: bool = False,
    dst_idx: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    n_rows: int | None = None,
    out_f32: bool = False,
) -> torch.Tensor:
    """PyTorch `grouped_gemm`: the same math in float64 (products exact), the same epilogue roundings."""
    if isinstance(w, fp4.FP4Tensor):
        E = w.shape[0]
        wv = exact_values(w).double() / w.global_scale.reshape(E, 1, 1).double()
    else:
        wv = w.double()
    if isinstance(a, fp4.FP4Tensor):
        K = a.shape[-1]
        av = exact_values(a).reshape(-1, K).double() / a.global_scale.reshape(-1, 1).double()
    else:
        av = a.double()
    if row_idx is not None:
        av = av[row_idx.long()]
    N = n_rows if n_rows is not None else av.shape[0]
    av = av[:N]
    ends = offsets.long().tolist()
    starts = [0] + ends[:-1]
    O = wv.shape[1]
    acc = torch.zeros(N, O, dtype=torch.float64, device=av.device)
    for e, (s, t) in enumerate(zip(starts, ends)):
        if t > s:
            acc[s:t] = av[s:t] @ wv[e].T
    acc = acc.float()
    if swiglu:
        F_ = O // 2
        g = acc[:, :F_].to(torch.bfloat16)
        u = acc[:, F_:].to(torch.bfloat16)
        return torch.nn.functional.silu(g) * u
    if dst_idx is not None:
        y = acc.to(torch.bfloat16).float() * gate.float()[:, None]
        out[dst_idx.long()] = y
        return out
    return acc if out_f32 else acc.to(torch.bfloat16)


def route_reference(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True):
    """PyTorch `route` (model/moe.py's rule)."""
    probs = torch.softmax(logits.float(), dim=-1)
    vals, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        vals = vals / vals.sum(-1, keepdim=True)
    return ids.to(torch.int32), vals


def dispatch_reference(ids: torch.Tensor, gates: torch.Tensor, num_experts: int):
    """PyTorch `dispatch`: stable argsort by expert, as model/moe.py does."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = counts.cumsum(0).to(torch.int32)  # as model/moe.py: no host sync (bincount has one)
    K = ids.shape[1]
    return offsets, (order // K).to(torch.int32), order.to(torch.int32), gates.reshape(-1)[order].float()


def fp4_rows(codes: torch.Tensor, scale_bytes: torch.Tensor, gs: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Values of FP4 cache rows (..., Dh//2) codes, (..., Dh//16) scale bytes, (..., 1) global scales."""
    q = fp4.FP4Tensor(codes, scale_bytes.view(torch.float8_e4m3fn), gs, "nvfp4",
                      torch.Size((*codes.shape[:-1], codes.shape[-1] * 2)))
    return fp4.dequantize(q, dtype)


def decode_attention_reference(q: torch.Tensor, lens: torch.Tensor, *, k=None, v=None, k_fp4=None, v_fp4=None,
                               kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`decode_attention` in float64 on K/V dequantized to `kv_dtype` (float32: exact c*s8/gs)."""
    B, H, Dh = q.shape
    if k_fp4 is not None:
        k = fp4_rows(*k_fp4, dtype=kv_dtype)
        v = fp4_rows(*v_fp4, dtype=kv_dtype)
    Hkv = k.shape[2]
    out = torch.empty(B, H, Dh, dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(lens[b])
        kb = k[b, :n].double().repeat_interleave(H // Hkv, dim=1)  # (n, H, Dh)
        vb = v[b, :n].double().repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("hd,thd->ht", q[b].double(), kb) / math.sqrt(Dh)
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(s, dim=-1), vb)
    return out.reshape(B, H * Dh)


def qkv_post_reference(qkv, pos, cos, sin, norm_w, n_heads, n_kv_heads, head_dim, eps):
    """PyTorch `qkv_post` with the model's own ops (RMSNorm, apply_rope): returns q, k, v (B, *, Dh)."""
    from tracerl.model.layers import apply_rope  # kernels never import model code at import time

    B = qkv.shape[0]
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    q = q.view(B, 1, n_heads, head_dim)
    k = k.view(B, 1, n_kv_heads, head_dim)
    if norm_w is not None:
        def norm(x, w):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return w.to(x.dtype) * h.to(x.dtype)
        q, k = norm(q, norm_w[0]), norm(k, norm_w[1])
    c, s = cos[pos.long()][:, None], sin[pos.long()][:, None]
    return apply_rope(q, c, s)[:, 0], apply_rope(k, c, s)[:, 0], v.view(B, n_kv_heads, head_dim)
