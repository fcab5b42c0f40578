"""KV caches of the rollout engine: BF16, or FP4 (packed codes + block scales).

The engine owns the cache; the model's attention calls `cache.update(layer, k, v)` with the new
tokens' K/V (B, S_new, Hkv, D) and attends the returned (B, S_total, Hkv, D). Before each forward
the engine says which slots (rows) are running and at which column the new tokens go
(`cache.set_step(rows, start)`), so finished sequences stop consuming compute.

The FP4 cache quantizes K/V per token x head with blocks along head_dim (DESIGN.md) exactly as
`tracerl.fp4.quantize(..., per_row_global=True)` does, stores only codes and scales, and
dequantizes on read; a `SiteRecorder` may observe each quantization to build guidance records.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tracerl import fp4
from tracerl.rollout.attention import split_kv_attention
from tracerl.rollout.recorder import FiniteWatch, site_dequantize, site_quantize


class KVObserver(Protocol):
    """Receives each layer's quantized K/V (for guidance recording)."""

    def needs_scaled(self, site: str) -> bool: ...

    def observe(self, site: str, q: fp4.FP4Tensor, scaled: torch.Tensor | None) -> None: ...


class _SlotCache:
    """Shared slot/step bookkeeping, and the engine's attention kernel over the cache."""

    def __init__(self, n_slots: int, max_len: int, attention_split: int = 16) -> None:
        self.n_slots = n_slots
        self.max_len = max_len
        self.rows = torch.arange(n_slots)
        self.start = 0
        self.attention_split = attention_split

    def attention(self, q_BSHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor,
                  mask_B1ST: torch.Tensor | None) -> torch.Tensor:
        """Split-KV attention of the new queries over the cached keys/values (see rollout/attention.py)."""
        return split_kv_attention(q_BSHD, k_BTHD, v_BTHD, mask_B1ST, self.attention_split)

    def set_step(self, rows: torch.Tensor, start: int) -> None:
        """The next forward runs slots `rows` and writes its new tokens from column `start`."""
        self.rows = rows
        self.start = start

    def _check(self, s_new: int) -> None:
        if self.start + s_new > self.max_len:
            raise ValueError(
                f"KV cache overflow: writing up to column {self.start + s_new} of a cache of {self.max_len}; "
                "raise the engine's max_len or shorten prompts/max_new_tokens"
            )


class DenseKVCache(_SlotCache):
    """A BF16 (or any dtype) KV cache: (L, slots, max_len, Hkv, D) for K and V."""

    def __init__(self, n_layers: int, n_slots: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> None:
        super().__init__(n_slots, max_len)
        shape = (n_layers, n_slots, max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache."""
        return 2 * self.k.numel() * self.k.element_size()

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, S_new, Hkv, D) for the running slots; return all K/V up to the new tokens."""
        s_new = k.shape[1]
        self._check(s_new)
        end = self.start + s_new
        self.k[layer, self.rows, self.start:end] = k.to(self.k.dtype)
        self.v[layer, self.rows, self.start:end] = v.to(self.v.dtype)
        return self.k[layer, self.rows, :end], self.v[layer, self.rows, :end]

    def expand(self, index: torch.Tensor) -> None:
        """Re-slot: slot i becomes a copy of old slot index[i] (GRPO groups share a prefill)."""
        self.k = self.k[:, index].contiguous()
        self.v = self.v[:, index].contiguous()
        self.n_slots = len(index)


class FP4KVCache(_SlotCache):
    """An FP4 KV cache: packed E2M1 codes + block scales (+ NVFP4 per-row global scales)."""

    def __init__(self, n_layers: int, n_slots: int, max_len: int, n_kv_heads: int, head_dim: int,
                 fmt: str = "nvfp4", dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 observer: KVObserver | None = None, finite: FiniteWatch | None = None) -> None:
        super().__init__(n_slots, max_len)
        spec = fp4.format_spec(fmt)
        if head_dim % spec.block:
            raise ValueError(f"head_dim {head_dim} is not divisible by the {fmt} block {spec.block}")
        # with a FiniteWatch inf/NaN K/V are flagged on the device instead of checked with a host sync
        self.fmt, self.dtype, self.observer, self.finite = fmt, dtype, observer, finite
        lead = (2, n_layers, n_slots, max_len, n_kv_heads)
        self.codes = torch.zeros(*lead, head_dim // 2, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(*lead, head_dim // spec.block, dtype=torch.uint8, device=device)
        self.gscale = torch.ones(*lead, 1, dtype=torch.float32, device=device) if spec.has_global_scale else None
        self.head_dim = head_dim

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache (codes + scales + global scales)."""
        n = self.codes.numel() + self.scales.numel()
        return n + (self.gscale.numel() * 4 if self.gscale is not None else 0)

    def _store(self, kv: int, layer: int, x: torch.Tensor) -> None:
        site = f"layers.{layer}.attn.{'kv'[kv]}_cache"
        need = self.observer is not None and self.observer.needs_scaled(site)
        q, scaled = site_quantize(x, self.fmt, need_scaled=need, name=site, finite=self.finite)
        end = self.start + x.shape[1]
        self.codes[kv, layer, self.rows, self.start:end] = q.codes
        self.scales[kv, layer, self.rows, self.start:end] = q.scales.view(torch.uint8)
        if self.gscale is not None:
            self.gscale[kv, layer, self.rows, self.start:end] = q.global_scale
        if self.observer is not None:
            self.observer.observe(site, q, scaled)

    def _load(self, kv: int, layer: int, end: int) -> torch.Tensor:
        spec = fp4.FORMATS[self.fmt]
        codes = self.codes[kv, layer, self.rows, :end]
        q = fp4.FP4Tensor(
            codes=codes,
            scales=self.scales[kv, layer, self.rows, :end].view(spec.scale_dtype),
            global_scale=None if self.gscale is None else self.gscale[kv, layer, self.rows, :end],
            fmt=self.fmt,
            shape=torch.Size((*codes.shape[:-1], self.head_dim)),
        )
        return site_dequantize(q, self.dtype)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize and store k, v (B, S_new, Hkv, D); return all K/V (dequantized) up to the new tokens."""
        self._check(k.shape[1])
        self._store(0, layer, k)
        self._store(1, layer, v)
        end = self.start + k.shape[1]
        return self._load(0, layer, end), self._load(1, layer, end)

    def expand(self, index: torch.Tensor) -> None:
        """Re-slot: slot i becomes a copy of old slot index[i]."""
        self.codes = self.codes[:, :, index].contiguous()
        self.scales = self.scales[:, :, index].contiguous()
        if self.gscale is not None:
            self.gscale = self.gscale[:, :, index].contiguous()
        self.n_slots = len(index)
