"""NVFP4 weight codes re-placed within each 32-bit word, so the GEMM turns 8 codes into BF16 in 14 ops.

The decode GEMMs are issue-bound on the nibble -> BF16 conversion (bench/RESULTS.md: Nsight Compute
puts the FP4 expert GEMMs at 64-82% of issue slots with the DRAM at 25-36%). Natural packing
(element 2i in the low nibble of byte i) needs a byte permute, two masks, two shifts and an OR per
pair of codes before the BF16 multiply. Here the 8 codes of one 4-byte word are stored pre-shifted
so that `w & M`, `(w << 3) & M` and `(w << 6) & M` (M = 0x81C081C0: a BF16 pair's sign and its two
low exponent bits + top mantissa bit) each leave two codes in BF16 position, and the last pair
takes three shift-and-masks: the bit layout of triton_kernels' Hopper MXFP4 value layout
(python/triton_kernels, `hopper_value.py`), here with no change to the tile order, so a kernel
still addresses bytes as before. A code's bits so placed read as BF16 are its E2M1 value times
2**-126; the kernel's one BF16x2 multiply by (block scale * 2**117) makes that exactly
e2m1 * s8 * 2**-9 (at most 6 significant bits), and the epilogue's power-of-two 2**9 is exact.

Which code lands in which BF16 lane follows the natural kernel's split: for a word holding codes
k0..k7 (k even in low nibbles), register 0 gets (k0, k2), 1 (k4, k6), 2 (k1, k3) and 3 (k5, k7), so
the kernel's "low" tile still holds the even columns and its "high" tile the odd ones.

The block scales get a kernel encoding too (`scale_bytes`): the multiplier the PTX needs is
S = s8 * 2**117 in BF16, whose exponent field lies in [235, 252] and whose mantissa has 3 bits
(every E4M3 value, subnormals included, normalizes so), so one byte b = (field - 235) << 3 | mantissa
holds it and the kernel rebuilds S's BF16 bits as b * 16 + 30080 (one integer multiply-add)
instead of decoding E4M3 (normal / subnormal paths, a select, two multiplies). Zero, negative and
NaN E4M3 scales have no such byte (`scale_bytes` refuses them; `SwizzledFP4.of` stores a zero-scale
block, whose values are all zero, as zero codes under the smallest byte, so `natural()` gives that
block scale 2**-9 and the same values).

An FP4 KV cache is stored the same way by the decoder (`swizzle_blocks`, `cache_scale_bytes`:
total on every byte the quantizer can write, since a cache cannot refuse a token): the attention
kernel's K/V tiles then decode as the GEMM's weight tiles do.

`swizzle_codes` / `unswizzle_codes` and `scale_bytes` / `e4m3_scales` are exact inverses;
`decode_swizzled` is the PTX's arithmetic in torch (the tests check both against the natural codes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracerl import fp4

MASK = 0x81C081C0  # per BF16 half: sign (bit 15), exponent bits 7-8 and mantissa bit 6
_CHUNK = 1 << 24  # words per step of the int64 arithmetic (bounds its temporaries)


def _place(n: torch.Tensor) -> torch.Tensor:
    """4-bit code -> its bits at BF16 positions (sign 15, e1 e0 m at 8 7 6)."""
    return ((n & 8) << 12) | ((n & 7) << 6)


def _place_fourth(n: torch.Tensor) -> torch.Tensor:
    """4-bit code -> the fourth pair's storage bits (sign 14, e1 e0 at 11 10, m 13)."""
    return ((n & 8) << 11) | ((n & 6) << 9) | ((n & 1) << 13)


def _words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 4n) -> int64 (..., n) little-endian words."""
    b = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4).to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _bytes(w: torch.Tensor) -> torch.Tensor:
    """int64 (..., n) words -> uint8 (..., 4n)."""
    return torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], dim=-1).flatten(-2).to(torch.uint8)


def _check(codes: torch.Tensor) -> None:
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 4:
        raise ValueError(f"the packed dim ({codes.shape[-1]} bytes) must be a multiple of 4 (K a multiple of 8)")


def _map_words(codes: torch.Tensor, fn) -> torch.Tensor:
    """Apply fn to the int64 words of `codes` chunk by chunk (rows of the flattened leading dims)."""
    _check(codes)
    flat = codes.reshape(-1, codes.shape[-1])
    out = torch.empty_like(flat)
    rows = max(1, _CHUNK // max(1, flat.shape[1] // 4))
    for i in range(0, flat.shape[0], rows):
        out[i:i + rows] = _bytes(fn(_words(flat[i:i + rows])))
    return out.reshape(codes.shape)


def _swizzle_words(w: torch.Tensor) -> torch.Tensor:
    n = [(w >> (4 * i)) & 15 for i in range(8)]  # n[2i] = code k_{2i} (low nibble of byte i), n[2i+1] = k_{2i+1}
    k = [n[0], n[2], n[4], n[6], n[1], n[3], n[5], n[7]]  # k0..k7 with even codes first: k[0..3] = k0,k2,k4,k6
    # pairs (lane 0, lane 1) per register: r0 (k0, k2), r1 (k4, k6), r2 (k1, k3), r3 (k5, k7)
    r0 = _place(k[0]) | (_place(k[1]) << 16)
    r1 = _place(k[2]) | (_place(k[3]) << 16)
    r2 = _place(k[4]) | (_place(k[5]) << 16)
    r3 = _place_fourth(k[6]) | (_place_fourth(k[7]) << 16)
    return r0 | (r1 >> 3) | (r2 >> 6) | r3


def _regs(w: torch.Tensor) -> list[torch.Tensor]:
    """The four BF16x2 registers the PTX builds from a word (int64 holding 32 bits)."""
    w = w & 0xFFFFFFFF
    r3 = ((w << 1) & 0x80008000) | ((w >> 3) & 0x01800180) | ((w >> 7) & 0x00400040)
    return [w & MASK, (w << 3) & MASK, (w << 6) & MASK, r3]


def _code(half: torch.Tensor) -> torch.Tensor:
    """BF16-positioned bits -> the 4-bit code."""
    return ((half >> 12) & 8) | ((half >> 6) & 7)


def _unswizzle_words(w: torch.Tensor) -> torch.Tensor:
    r = _regs(w)
    k0, k2, k4, k6 = _code(r[0]), _code(r[0] >> 16), _code(r[1]), _code(r[1] >> 16)
    k1, k3, k5, k7 = _code(r[2]), _code(r[2] >> 16), _code(r[3]), _code(r[3] >> 16)
    return k0 | (k1 << 4) | (k2 << 8) | (k3 << 12) | (k4 << 16) | (k5 << 20) | (k6 << 24) | (k7 << 28)


def swizzle_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 (..., K//2) natural NVFP4 codes -> the same shape with each word's codes re-placed."""
    return _map_words(codes, _swizzle_words)


def unswizzle_codes(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of `swizzle_codes`."""
    return _map_words(codes, _unswizzle_words)


def decode_swizzled(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(even, odd) float32 (..., K//2): E2M1 values of swizzled codes by the PTX's own bit operations
    (BF16 bits of value * 2**-126, times 2**126), for tests."""
    _check(codes)
    r = _regs(_words(codes))

    def vals(reg):
        lanes = torch.stack([reg & 0xFFFF, (reg >> 16) & 0xFFFF], dim=-1)  # (..., n, 2)
        return (lanes.to(torch.int32) << 16).view(torch.float32) * 2.0**126

    even = torch.stack([vals(r[0]), vals(r[1])], dim=-2).flatten(-3)  # (k0, k2), (k4, k6) per word
    odd = torch.stack([vals(r[2]), vals(r[3])], dim=-2).flatten(-3)
    return even, odd


FIELD0 = 235  # BF16 exponent field of the smallest S = 2**-9 * 2**117 (E4M3's smallest subnormal)


def scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn block scales -> uint8 kernel scale bytes (see the module docstring)."""
    if scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"scales must be float8_e4m3fn, got {scales.dtype}")
    raw = scales.view(torch.uint8)
    bad = (raw == 0) | (raw >= 0x7F)  # zero, NaN (0x7F), and every sign-bit byte
    if bool(bad.any()):
        raise ValueError(f"{int(bad.sum())} block scales are zero, negative or NaN: no kernel scale byte holds them")
    bits = (scales.to(torch.float32) * 2.0**117).view(torch.int32) >> 16  # BF16 bits (exact: 4 significant bits)
    return (((bits >> 7) - FIELD0) << 3 | ((bits >> 4) & 7)).to(torch.uint8)


def e4m3_scales(b: torch.Tensor) -> torch.Tensor:
    """Inverse of `scale_bytes`."""
    bits = (b.to(torch.int32) * 16 + FIELD0 * 128) << 16
    return (bits.view(torch.float32) * 2.0**-117).to(torch.float8_e4m3fn)


NAN_BYTE = 161  # kernel scale byte whose multiplier is a BF16 NaN: 161 * 16 + 30080 = 0x7F90


def cache_scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    """Raw E4M3 scale bytes (uint8 or float8_e4m3fn) of a KV cache -> kernel scale bytes, total:
    a zero scale (an all-zero block) -> 0 (2**-9: the block's codes must then be zero, as
    `swizzle_blocks` makes them); NaN and negative scales -> NAN_BYTE, so a NaN K/V row stays NaN."""
    raw = scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales
    if raw.dtype != torch.uint8:
        raise ValueError(f"scales must be uint8 or float8_e4m3fn, got {scales.dtype}")
    bad = raw >= 0x7F
    ok = raw.masked_fill((raw == 0) | bad, 1).view(torch.float8_e4m3fn)  # 1: the smallest scale, 2**-9
    return scale_bytes(ok).masked_fill(bad, NAN_BYTE)


def swizzle_blocks(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 rows (codes uint8 (..., D//2), raw E4M3 scale bytes (..., D//16)) -> (swizzled codes,
    `cache_scale_bytes`), zero-scale blocks' codes zeroed: what `kv_store_fp4(swizzle=True)` stores."""
    zero = scales.view(torch.uint8) == 0
    blocks = codes.reshape(*scales.shape, -1)
    codes = blocks.masked_fill(zero[..., None], 0).reshape(codes.shape)
    return swizzle_codes(codes), cache_scale_bytes(scales)


@dataclass
class SwizzledFP4(fp4.FP4Tensor):
    """An NVFP4 weight for the decode GEMMs only: codes `swizzle_codes`'d, scales as `scale_bytes`
    (uint8), global scale and shape as FP4Tensor's. Other consumers take `natural()`."""

    @classmethod
    def of(cls, t: fp4.FP4Tensor) -> SwizzledFP4:
        """Swizzle an NVFP4 FP4Tensor (codes re-placed; nothing else copied)."""
        if isinstance(t, SwizzledFP4):
            return t
        if t.fmt != "nvfp4":
            raise ValueError(f"only NVFP4 weights are swizzled, got {t.fmt}")
        codes, scales = t.codes, t.scales
        zero = scales.view(torch.uint8) == 0
        if bool(zero.any()):
            # a zero-scale block (an all-zero block in a foreign checkpoint) is zero whatever its
            # codes: zero codes under the smallest scale byte give the same values, bit for bit
            blocks = codes.reshape(*scales.shape, -1)
            codes = blocks.masked_fill(zero[..., None], 0).reshape(codes.shape)
            scales = scales.view(torch.uint8).masked_fill(zero, 1).view(torch.float8_e4m3fn)  # 1: 2**-9
        return cls(swizzle_codes(codes), scale_bytes(scales), t.global_scale, t.fmt, t.shape)

    def natural(self) -> fp4.FP4Tensor:
        """The plain FP4Tensor of the same values (the same codes and scales unless a block scale was zero)."""
        return fp4.FP4Tensor(unswizzle_codes(self.codes), e4m3_scales(self.scales), self.global_scale, self.fmt,
                             self.shape)

    def to(self, device: torch.device | str) -> SwizzledFP4:
        """Move to `device` (still swizzled)."""
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return SwizzledFP4(self.codes.to(device), self.scales.to(device), gs, self.fmt, self.shape)
