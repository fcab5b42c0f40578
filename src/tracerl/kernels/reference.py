"""PyTorch reference of the kernel ops: `tracerl.fp4` plus the packed guide / record layouts.

The Triton kernels in fp4_quant.py are tested bit for bit against these functions; on CPU (or
without Triton) `tracerl.kernels` runs them.

Layouts (shared with the kernels):
- packed codes: FP4Tensor.codes, uint8 (..., K//2), element 2i in the low nibble. As a guide
  target only the magnitude index (nibble & 7) is used.
- packed bits: uint8 (..., K//8), bit i (value 1 << i) of byte j belongs to element 8j+i. Used
  for the `lsb` record, for a bit guide and for a guide mask.
"""

from __future__ import annotations

import torch

from tracerl import fp4


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(..., K) 0/1 (any integer dtype or bool) -> uint8 (..., K//8); element 8j+i is bit i of byte j."""
    if bits.shape[-1] % 8:
        raise ValueError(f"cannot pack {bits.shape[-1]} bits per row into bytes (need a multiple of 8)")
    b = (bits.to(torch.uint8) & 1).reshape(*bits.shape[:-1], -1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    return (b * weights).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_bits: uint8 (..., K//8) -> uint8 (..., K) of 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def unpacked_guide(guide: fp4.RoundingGuide | None, K: int) -> fp4.RoundingGuide | None:
    """The guide with packed fields expanded to the (..., K) forms fp4.quantize takes.

    target: (..., K) magnitude indices, or (..., K//2) packed codes (magnitude = nibble & 7);
    bit: (..., K) bits, or (..., K//8) packed bits; mask: (..., K) bool, or (..., K//8) packed bits.
    """
    if guide is None:
        return None
    target, bit, mask = guide.target, guide.bit, guide.mask
    if target is not None and K % 2 == 0 and target.shape[-1] == K // 2 and K != K // 2:
        target = fp4.unpack_nibbles(target.to(torch.uint8)) & 7
    if bit is not None and bit.shape[-1] * 8 == K:
        bit = unpack_bits(bit.to(torch.uint8))
    if mask is not None and mask.shape[-1] * 8 == K:
        mask = unpack_bits(mask.view(torch.uint8) if mask.dtype == torch.bool else mask).bool()
    return fp4.RoundingGuide(target=target, bit=bit, mask=mask, scales=guide.scales,
                             global_scale=guide.global_scale)


def quantize(x, fmt="nvfp4", rounding="rtn", *, global_scale=None, per_row_global=False, guide=None,
             generator=None, mx_rule="even") -> fp4.FP4Tensor:
    """fp4.quantize, also accepting packed guide fields."""
    return fp4.quantize(x, fmt, rounding, global_scale=global_scale, per_row_global=per_row_global,
                        generator=generator, guide=unpacked_guide(guide, x.shape[-1]), mx_rule=mx_rule)


def record_of(q: fp4.FP4Tensor, record: str) -> torch.Tensor:
    """The rollout record of a quantized tensor: packed codes ('codes') or packed lsb bits ('lsb')."""
    if record == "codes":
        return q.codes
    if record == "lsb":
        return pack_bits(fp4.magnitude_index(q) & 1)
    raise ValueError(f"unknown record encoding {record!r}; use 'codes' or 'lsb'")


dequantize = fp4.dequantize
