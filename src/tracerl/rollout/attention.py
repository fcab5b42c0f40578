"""The engine's attention over its KV cache: split-KV ("flash-decoding") with a log-sum-exp merge.

Inference engines do not run the trainer's attention kernel. Decode kernels (FlashDecoding,
FlashInfer, vLLM's paged attention) split the keys into chunks, compute each chunk's partial
softmax and output in float32, and merge the partials by their log-sum-exp. The result equals
exact attention up to float rounding, but the accumulation order differs from the trainer's
full-sequence kernel, so the BF16 outputs differ in the last bit now and then: one of the
upstream numeric differences that make an FP4 rounding decision flip between rollout and
trainer. Using the engine's own kernel keeps that difference honest on CPU, where the same
PyTorch kernel would otherwise be bit-identical for short sequences.
"""

from __future__ import annotations

import torch


def split_kv_attention(q_BSHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor,
                       mask_B1ST: torch.Tensor | None, split: int = 16) -> torch.Tensor:
    """Softmax attention of q (B, S, H, D) over k, v (B, T, Hkv, D) in chunks of `split` keys; returns (B, H, S, D)."""
    B, S, H, D = q_BSHD.shape
    T, Hkv = k_BTHD.shape[1], k_BTHD.shape[2]
    if H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} KV heads")
    rep = H // Hkv
    q = q_BSHD.transpose(1, 2).float() * D**-0.5  # (B, H, S, D)
    k = k_BTHD.transpose(1, 2).float().repeat_interleave(rep, dim=1)  # (B, H, T, D)
    v = v_BTHD.transpose(1, 2).float().repeat_interleave(rep, dim=1)
    m_run = torch.full((B, H, S, 1), float("-inf"), device=q.device)
    l_run = torch.zeros(B, H, S, 1, device=q.device)
    o_run = torch.zeros(B, H, S, D, device=q.device)
    for t0 in range(0, T, split):
        s = q @ k[:, :, t0:t0 + split].transpose(-1, -2)  # (B, H, S, c)
        if mask_B1ST is not None:
            s = s.masked_fill(~mask_B1ST[..., t0:t0 + split], float("-inf"))
        m_c = s.amax(-1, keepdim=True)
        m_new = torch.maximum(m_run, m_c)
        # chunks fully masked for a query keep m_new = -inf: guard the exp against nan
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - safe)
        alpha = torch.exp(torch.where(torch.isinf(m_run), torch.full_like(m_run, float("-inf")), m_run - safe))
        l_run = l_run * alpha + p.sum(-1, keepdim=True)
        o_run = o_run * alpha + p @ v[:, :, t0:t0 + split]
        m_run = m_new
    return (o_run / l_run.clamp(min=1e-30)).to(q_BSHD.dtype)
