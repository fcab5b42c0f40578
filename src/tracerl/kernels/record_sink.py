"""RecordSink: where a quantize call also writes its outcome, so recording costs no extra launch.

The graph engine stages each recorded site's FP4 codes, block scales and row global scales in
(slots, max_len, ...) buffers (`rollout.recorder.SiteRecorder`). Copying them there after the
quantize is three `index_copy_` launches per site plus the index arithmetic, a dozen tiny kernels
per site in a decode step: on the small preset that was 18% of the step with the default
CachePolicy (bench/RESULTS.md). With a sink the quantize kernel stores each row a second time,
at its record row, from the registers that already hold it.

Record row of x's row r (x viewed as (M, K)): s = src[r] if `src` is given else r; then
    (s // plane_rows) * plane_stride + flat[(s % plane_rows) // group] * group + (s % plane_rows) % group
- a token site (rows = the decode step's slots): flat = slot * max_len + column, group 1;
- an expert site whose rows are expert-sorted (token, k) pairs: src = the pair index
  token * top_k + k, group = top_k (the record keeps (slot, column, k));
- the KV cache (rows = (k|v, slot, kv head)): group = kv heads, plane_rows = slots * kv heads,
  plane_stride = the rows of one of the two (k, v) record buffers laid end to end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracerl import fp4

NO_PLANES = 1 << 30  # plane_rows when x has one plane (larger than any row index here)


@dataclass(frozen=True)
class RecordSink:
    """Record buffers (rows of packed codes, scale bytes, global scales) and each x row's record row."""

    codes: torch.Tensor  # (N, K//2) uint8, contiguous rows
    scales: torch.Tensor  # (N, K//block) uint8 (the scale bytes)
    gscale: torch.Tensor | None  # (N,) float32 for NVFP4's per-row global scales, else None
    flat: torch.Tensor  # (slots,) int64: slot * max_len + this step's column
    src: torch.Tensor | None = None  # (M,) int: x row -> source index (expert-sorted pairs)
    group: int = 1
    plane_rows: int = NO_PLANES
    plane_stride: int = 0

    def check(self, M: int, K: int, spec: fp4.FormatSpec) -> None:
        """Raise ValueError naming the field that does not fit an (M, K) quantize of format `spec`."""
        B = spec.block
        for name, t, width, dtype in (("codes", self.codes, K // 2, torch.uint8),
                                      ("scales", self.scales, K // B, torch.uint8)):
            if t.dim() != 2 or t.shape[1] != width or t.dtype != dtype or t.stride(1) != 1:
                raise ValueError(f"RecordSink.{name}: expected {dtype} (N, {width}) with unit column stride, "
                                 f"got {t.dtype} {tuple(t.shape)}")
        if spec.has_global_scale != (self.gscale is not None):
            raise ValueError(f"RecordSink.gscale: {spec.name} {'has' if spec.has_global_scale else 'has no'} "
                             "global scale; pass a (N,) float32 buffer exactly when it has one")
        if self.gscale is not None and (self.gscale.dim() != 1 or self.gscale.dtype != torch.float32):
            raise ValueError(f"RecordSink.gscale: expected float32 (N,), got {self.gscale.dtype} "
                             f"{tuple(self.gscale.shape)}")
        if self.flat.dim() != 1 or self.flat.dtype != torch.int64:
            raise ValueError(f"RecordSink.flat: expected int64 (slots,), got {self.flat.dtype} {tuple(self.flat.shape)}")
        if self.src is not None and tuple(self.src.shape) != (M,):
            raise ValueError(f"RecordSink.src: expected one index per row of x ({M},), got {tuple(self.src.shape)}")
        if self.group < 1 or self.plane_rows < 1 or self.plane_stride < 0:
            raise ValueError(f"RecordSink: group ({self.group}) and plane_rows ({self.plane_rows}) must be >= 1 "
                             f"and plane_stride ({self.plane_stride}) >= 0")

    def dest_rows(self, M: int) -> torch.Tensor:
        """The record row of each of x's M rows (int64), as the kernel computes it."""
        s = self.src.long() if self.src is not None else torch.arange(M, device=self.flat.device)
        r = s % self.plane_rows
        return (s // self.plane_rows) * self.plane_stride + self.flat[r // self.group] * self.group + r % self.group

    def write(self, q: fp4.FP4Tensor) -> None:
        """The reference: store q's rows at their record rows (what the Triton kernel does in-pass)."""
        K = q.shape[-1]
        codes = q.codes.reshape(-1, K // 2)
        d = self.dest_rows(codes.shape[0])
        self.codes.index_copy_(0, d, codes)
        self.scales.index_copy_(0, d, q.scales.reshape(codes.shape[0], -1).view(torch.uint8))
        if self.gscale is not None:
            gs = q.global_scale.reshape(-1).to(torch.float32)
            self.gscale.index_copy_(0, d, gs.expand(codes.shape[0]) if gs.numel() == 1 else gs)
