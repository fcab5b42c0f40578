"""DenseKVCache: a minimal preallocated KV cache implementing the model's cache protocol.

The protocol (what `MoEModel.forward(kv_cache=...)` calls): for every layer,
    k_all, v_all = kv_cache.update(layer_idx, k_BSHD, v_BSHD)
with the new tokens' K (after k-norm and RoPE) and V, shaped (B, S_new, Hkv, Dh); it returns all
cached positions so far, (B, S_total, Hkv, Dh), the new ones last. The caller's attention_mask
has S_total columns (1 = real token, 0 = padding; left or right padding both work).

Write position: one per cache (all rows share it; padding is expressed by the mask). Layers write
at `seq_len` and read up to `seq_len + S_new`; the position moves on by S_new after the update of
the last layer (`auto_advance=True`, the default) or when the owner calls `advance(n)`
(`auto_advance=False`, e.g. when a forward runs only some layers). The rollout engine owns its own
cache (BF16 or FP4, recording what it stores); this one is the plain reference used in tests.
"""

from __future__ import annotations

import torch


class DenseKVCache:
    """Preallocated K/V buffers (n_layers, batch, max_len, n_kv_heads, head_dim) in `dtype`."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        auto_advance: bool = True,
    ) -> None:
        shape = (n_layers, batch, max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_layers = n_layers
        self.max_len = max_len
        self.auto_advance = auto_advance
        self.seq_len = 0  # positions written by completed steps

    @classmethod
    def for_model(cls, model, batch: int, max_len: int | None = None, dtype: torch.dtype | None = None,
                  device=None, auto_advance: bool = True) -> DenseKVCache:
        """A cache sized for `model` (max_len defaults to its config's max_seq_len)."""
        cfg = model.config
        p = next(model.parameters())
        return cls(batch, max_len or cfg.max_seq_len, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                   dtype or p.dtype, device or p.device, auto_advance)

    def update(self, layer_idx: int, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V of `layer_idx` at the current position; return all positions so far."""
        if not 0 <= layer_idx < self.n_layers:
            raise IndexError(f"DenseKVCache: layer {layer_idx} out of range 0..{self.n_layers - 1}")
        B, S = k_BSHD.shape[:2]
        if B != self.k.shape[1] or k_BSHD.shape[2:] != self.k.shape[3:]:
            raise ValueError(
                f"DenseKVCache: got K of shape {tuple(k_BSHD.shape)}, the cache holds "
                f"(batch={self.k.shape[1]}, *, heads={self.k.shape[3]}, head_dim={self.k.shape[4]})"
            )
        end = self.seq_len + S
        if end > self.max_len:
            raise ValueError(f"DenseKVCache: {end} positions exceed max_len={self.max_len}; allocate a longer cache")
        self.k[layer_idx, :, self.seq_len:end] = k_BSHD.detach()
        self.v[layer_idx, :, self.seq_len:end] = v_BSHD.detach()
        k_all, v_all = self.k[layer_idx, :, :end], self.v[layer_idx, :, :end]
        if self.auto_advance and layer_idx == self.n_layers - 1:
            self.seq_len = end
        return k_all, v_all

    def advance(self, n: int) -> None:
        """Move the write position on by n (when auto_advance is False)."""
        if self.seq_len + n > self.max_len:
            raise ValueError(f"DenseKVCache.advance: {self.seq_len + n} positions exceed max_len={self.max_len}")
        self.seq_len += n

    def reset(self) -> None:
        """Forget all positions (buffers are reused)."""
        self.seq_len = 0

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
