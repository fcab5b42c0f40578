"""Triton device functions for exact FP4 numerics (used by fp4_quant.py), and a probe kernel.

Every function reproduces one step of `tracerl.fp4` bit for bit; `probe` applies one of them
elementwise so tests can compare it with torch on dense sweeps (on the GPU and, in the Triton
interpreter, on CPU). They are written for the GPU's throughput as well: compares, min/max and
integer/logic ops run at half the rate of fp32 add/mul/fma there, so the per-element work leans
on fp32 arithmetic. How each stays exact:
- E2M1 index of a in [0, 7): the three binades round with one fp32 add each (2a, a and a/2 plus
  2**23 round to an integer, ties to even), and the index is the smallest of the three
  candidates: g = min(2a + 2**23, a + 2**23 + 2, a/2 + 2**23 + 4) = 2**23 + index (exhaustively
  checked over every float in [0, 7)). Its grid value and neighbours follow from g.
- Division: IEEE round-to-nearest. Plain `/` on fp32 compiles to the approximate div.full.f32
  in Triton. `tl.math.div_rn` is exact but costs a reciprocal, a branch and 5 FMAs per element,
  so the hot path uses Markstein's FMA division with the divisor's reciprocal computed once per
  block (`_div_fast`): q0 = a*(y_hi + y_lo) is faithful, r = a - b*q0 is exact, and
  RN(q0 + r*y_hi) = RN(a/b), barring underflow/overflow (checked on ~2e9 cases, including every
  float / 6). Callers use it only where no intermediate can underflow or overflow.
- Casts that round are integer ops: fp32 -> bf16 (add 0x7FFF + lsb, truncate) and fp32 -> e4m3
  (round the mantissa to 3 bits; subnormals via a 2**23 shift); e4m3 / e8m0 -> fp32 assemble bits.
- No libdevice calls (Triton links libdevice with flush-to-zero on), and no unary minus on values
  that may be zero (Triton's -x is 0 - x, which turns -0.0 into +0.0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

C_2P23 = tl.constexpr(8388608.0)  # 2**23
C_M2P89 = tl.constexpr(-6.1897001964269014e26)  # -2**89
# RN(1/6) and the fp32 value of (1 - 6 * RN(1/6)) * RN(1/6): dividing block amaxes by 6
C_Y6_HI, C_Y6_LO = tl.constexpr(0.1666666716337204), tl.constexpr(-4.967053879312289e-09)
C_TINY_F16, C_TINY_F32 = tl.constexpr(6.103515625e-05), tl.constexpr(1.1754943508222875e-38)


@triton.jit
def _f32(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _bits(f):
    return f.to(tl.int32, bitcast=True)


@triton.jit
def _round_bf16(f):
    """fp32 -> the fp32 value of its bf16 rounding (RNE, overflow to inf), by integer ops."""
    b = _bits(f)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return _f32((b >> 16) << 16)


@triton.jit
def _round_to_dtype(f, IN_DTYPE: tl.constexpr):
    """Round fp32 to the input dtype (kept as fp32), as torch's bf16/fp16 arithmetic does."""
    if IN_DTYPE == 1:
        f = _round_bf16(f)
    elif IN_DTYPE == 2:
        f = f.to(tl.float16).to(tl.float32)
    return f


@triton.jit
def _recip_parts(b):
    """y_hi = RN(1/b) and y_lo ~ 1/b - y_hi (1 - b*y_hi is exact in an FMA)."""
    y_hi = tl.math.div_rn(1.0, b)
    return y_hi, tl.fma(-b, y_hi, 1.0) * y_hi


@triton.jit
def _div_fast(a, b, y_hi, y_lo):
    """RN(a / b) from b's reciprocal parts by FMAs (Markstein); exact barring under/overflow."""
    q = tl.fma(a, y_hi, a * y_lo)
    r = tl.fma(-b, q, a)
    return tl.fma(r, y_hi, q)


@triton.jit
def _global_scale(amax, IN_DTYPE: tl.constexpr):
    """fp4.nvfp4_global_scale from an amax (the input dtype's value, as fp32).

    torch computes 2688 / amax as reciprocal(amax) * 2688, each rounded to the input dtype,
    after clamping amax to the dtype's smallest normal; overflow (inf) falls back to 1.
    """
    if IN_DTYPE == 2:
        a = tl.maximum(amax, C_TINY_F16)
    else:
        a = tl.maximum(amax, C_TINY_F32)
    r = _round_to_dtype(tl.math.div_rn(1.0, a), IN_DTYPE)
    g = _round_to_dtype(r * 2688.0, IN_DTYPE)
    return tl.where(g > 3.4028234663852886e38, 1.0, g)


@triton.jit
def _e4m3_byte(s):
    """E4M3 byte of s in [0, 448], round to nearest even (torch's float8_e4m3fn cast)."""
    b = _bits(s)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - 960  # 3-bit mantissa RNE, rebias 127 -> 7
    sub = _bits(tl.fma(s, 512.0, C_2P23)) - 0x4B000000  # multiples of 2**-9, RNE by the 2**23 shift
    return tl.where(s < 0.015625, sub, normal)


@triton.jit
def _e4m3_value(byte):
    """fp32 value of an E4M3 byte (int32 0..255); 0x7F/0xFF (NaN) decode as 480."""
    mag = byte & 0x7F
    normal = _f32((mag << 20) + 0x3C000000)  # exponent + 120 lands in place
    sub = (_f32(mag | 0x4B000000) - C_2P23) * 0.001953125
    return _f32(_bits(tl.where(mag < 8, sub, normal)) | ((byte & 0x80) << 24))


@triton.jit
def _nv_scale_byte(amax_b, gs, IN_DTYPE: tl.constexpr):
    """fp4.nvfp4_block_scales with div.rn: e4m3(min(gs * (amax_b / 6 in the dtype), 448)), 0 -> 0.125."""
    s = _round_to_dtype(tl.math.div_rn(amax_b, 6.0), IN_DTYPE)
    byte = _e4m3_byte(tl.minimum(gs * s, 448.0))
    return tl.where(byte == 0, 0x20, byte)


@triton.jit
def _nv_fast_scales(amax_b, tiny_b, gs, sbyte, GUIDE_SCALES: tl.constexpr, IN_DTYPE: tl.constexpr):
    """NVFP4 block scale bytes and multipliers s8 / gs by FMA division, for a (BM, NB) tile.

    Also returns whether the tile must redo everything with div.rn: a global scale or multiplier
    outside [2**-60, 2**60] / [2**-30, 2**60], an element beyond 6.5 multipliers (saturation), or
    a nonzero |x| < 2**-89 (tiny_b > 0: its quotient could round to zero).
    """
    g = gs[:, None]
    yg_hi, yg_lo = _recip_parts(gs)
    if not GUIDE_SCALES:
        s = _round_to_dtype(_div_fast(amax_b, 6.0, C_Y6_HI, C_Y6_LO), IN_DTYPE)
        byte = _e4m3_byte(tl.minimum(g * s, 448.0))
        sbyte = tl.where(byte == 0, 0x20, byte)
    mult = _div_fast(_e4m3_value(sbyte), g, yg_hi[:, None], yg_lo[:, None])
    slow = (g < 8.673617379884035e-19) | (g > 1.152921504606847e18)
    slow = slow | (mult < 9.313225746154785e-10) | (mult > 1.152921504606847e18)
    slow = slow | (amax_b > mult * 6.5) | (tiny_b > 0.0)
    return sbyte, mult, tl.max(tl.max(slow.to(tl.int32), axis=1), axis=0)


@triton.jit
def _tiny_nonzero(ax):
    """Positive exactly where 0 < ax < 2**-89: ax - ax**2 * 2**89 in one FMA (no compare)."""
    return tl.fma(ax * C_M2P89, ax, ax)


@triton.jit
def _mx_scale_byte(amax_b):
    """fp4.mxfp4_block_scales, rule 'even': biased exponent of amax rounded to 1 mantissa bit, - 2."""
    e = ((_bits(amax_b) + 0x200000) >> 23) & 0xFF
    return tl.where(e == 255, 254, tl.maximum(e - 2, 0))


@triton.jit
def _mx_inv_mult(e):
    """2**(127 - e) exactly (the inverse of the E8M0 multiplier); 0 for the NaN byte 255."""
    inv = _f32((254 - e) << 23)
    inv = tl.where(e == 254, _f32(tl.full(e.shape, 0x400000, tl.int32)), inv)
    return tl.where(e == 255, 0.0, inv)


@triton.jit
def _mx_mult(e):
    """2**(e - 127) exactly, as fp4.block_scale_values (255 -> inf)."""
    return tl.where(e == 0, _f32(tl.full(e.shape, 0x400000, tl.int32)), _f32(e << 23))


@triton.jit
def _rtn_g(a):
    """2**23 + the E2M1 index of a in [0, 7) rounded to nearest, ties to even (see module doc)."""
    g = tl.minimum(tl.fma(a, 2.0, C_2P23), a + 8388610.0)
    return tl.minimum(g, tl.fma(a, 0.5, 8388612.0))


@triton.jit
def _neighbours(g, a):
    """fp4.grid_neighbours of a in [0, 6] from g = _rtn_g(a): (floor index, ceil index)."""
    idx = _bits(g) & 7
    f = g - C_2P23
    val = tl.maximum(tl.maximum(f * 0.5, f - 2.0), f * 2.0 - 8.0)  # the grid value of idx
    return idx - (val > a).to(tl.int32), idx + (val < a).to(tl.int32)


@triton.jit
def _e2m1_magnitude(code):
    """|value| of E2M1 codes (int32, sign ignored): index i -> max(i/2, i - 2, 2i - 8)."""
    f = _f32((code & 7) | 0x4B000000) - C_2P23
    return tl.maximum(tl.maximum(f * 0.5, f - 2.0), f * 2.0 - 8.0)


@triton.jit
def _floor_div(n, inv_d: tl.constexpr, off: tl.constexpr):
    """floor(n / d) of small non-negative integers n (fp32), as fp32: n/d - off rounds to it
    (off = (d - 1) / (2d) keeps the fraction inside (-1/2, 1/2)), by the 1.5 * 2**23 shift
    (the sum stays in [2**23, 2**24), where the spacing is 1, also for negative n/d - off)."""
    return (tl.fma(n, inv_d, -off) + 12582912.0) - 12582912.0


@triton.jit
def _e2m1_decode_bytes(p):
    """Packed code bytes (int32 0..255) -> (low, high) E2M1 values as fp32, by fp32 arithmetic.

    Dequantization is bound by compare/logic throughput otherwise: here each byte costs one
    logic op, the rest are fp32 adds/multiplies (sign: -0.0 for code 8, as the reference).
    """
    fp = _f32(p | 0x4B000000) - C_2P23  # the byte as fp32
    hi = _floor_div(fp, 0.0625, 0.46875)
    lo = tl.fma(hi, -16.0, fp)
    return _e2m1_nibble_value(lo), _e2m1_nibble_value(hi)


@triton.jit
def _e2m1_nibble_value(n):
    """E2M1 value of a code 0..15 given as fp32: sign n >= 8, index n mod 8."""
    s = _floor_div(n, 0.125, 0.4375)
    i = tl.fma(s, -8.0, n)
    mag = tl.maximum(tl.maximum(i * 0.5, i - 2.0), tl.fma(i, 2.0, -8.0))
    return mag * tl.fma(s, -2.0, 1.0)


# ----------------------------------------------------------------------------- probe (tests)


@triton.jit
def _probe_kernel(in_ptr, in2_ptr, out_ptr, N, WHAT: tl.constexpr, IN_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """Apply one numeric helper elementwise."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    v = tl.load(in_ptr + offs, mask=m, other=0)
    w = tl.load(in2_ptr + offs, mask=m, other=1)
    if WHAT == 0:
        r = _bits(_rtn_g(v)) - 0x4B000000
    elif WHAT == 1:
        lo, hi = _neighbours(_rtn_g(v), v)
        r = lo * 8 + hi
    elif WHAT == 2:
        r = _e4m3_byte(v)
    elif WHAT == 3:
        r = _bits(_round_bf16(v))
    elif WHAT == 4:
        r = _bits(_e4m3_value(v))
    elif WHAT == 5:
        r = _bits(_global_scale(v, IN_DTYPE))
    elif WHAT == 6:
        r = _mx_scale_byte(v)
    elif WHAT == 7:
        r = _bits(_mx_mult(v))
    elif WHAT == 8:
        r = _bits(_mx_inv_mult(v))
    elif WHAT == 9:
        y_hi, y_lo = _recip_parts(w)
        r = _bits(_div_fast(v, w, y_hi, y_lo))
    elif WHAT == 10:
        r = _bits(tl.math.div_rn(v, w))
    elif WHAT == 11:
        r = _bits(_e2m1_magnitude(v))
    elif WHAT == 13:
        lo, hi = _e2m1_decode_bytes(v)
        r = (_bits(hi) & -65536) | ((_bits(lo) >> 16) & 65535)  # both values have <= 3 significant bits

    elif WHAT == 12:
        r = (_tiny_nonzero(tl.abs(v)) > 0.0).to(tl.int32)
    tl.store(out_ptr + offs, r, mask=m)


PROBES = {"rtn": 0, "neighbours": 1, "e4m3": 2, "bf16": 3, "e4m3_value": 4, "global_scale": 5,
          "mx_scale": 6, "mx_mult": 7, "mx_inv_mult": 8, "div_fast": 9, "div_rn": 10, "e2m1_magnitude": 11,
          "tiny_nonzero": 12, "e2m1_decode_bytes": 13}


def probe(what: str, values: torch.Tensor, in_dtype: torch.dtype = torch.float32,
          divisor: torch.Tensor | None = None) -> torch.Tensor:
    """int32 results of numeric helper `what` on float32 (or int32) values; for tests."""
    out = torch.empty(values.shape, dtype=torch.int32, device=values.device)
    n = values.numel()
    w = divisor if divisor is not None else torch.ones(values.shape, dtype=torch.float32, device=values.device)
    _probe_kernel[(triton.cdiv(n, 1024),)](values, w, out, n, WHAT=PROBES[what], IN_DTYPE=DTYPE_CODE[in_dtype],
                                          BLOCK=1024)
    return out
