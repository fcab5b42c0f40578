"""Triton kernels: NVFP4 / MXFP4 quantize (rtn, guided), fused recording, dequantize.

Each kernel is an alternative implementation of `tracerl.fp4` and reproduces it bit for bit,
including its operation order. Shapes: the input is viewed as x_MK (M rows = all leading dims,
K = last dim); a program owns BM rows x BK columns seen as x_BM_NB_B (NB FP4 blocks of B elements).

How bit-exactness is kept (everything below is checked by tests/test_kernels.py on the GPU and, in
the Triton interpreter, on CPU):
- Divisions are IEEE round-to-nearest. Plain `/` on fp32 compiles to the approximate
  `div.full.f32` in Triton and would move exact ties, so they use either `tl.math.div_rn` or,
  on the hot path, Markstein's FMA division with a per-block reciprocal (`_div_fast`: q0 =
  a*(y_hi + y_lo) is faithful, r = a - b*q0 is exact, RN(q0 + r*y_hi) = RN(a/b); exact barring
  underflow/overflow, also checked on ~2e9 cases incl. every float / 6). A tile whose scales or
  values leave the range where that holds (tiny/huge scales, an element 2**60 below its block
  max, saturation, or an exact zero beside nonzeros) redoes the division with div_rn.
- Casts that round are done with integer ops: fp32 -> bf16 (add 0x7FFF + lsb, truncate),
  fp32 -> e4m3 (round the mantissa to 3 bits; subnormals as an integer multiple of 2**-9),
  e4m3 / e8m0 -> fp32 by assembling the bits. fp32 -> fp16 uses `.to(tl.float16)` (RNE).
- The E2M1 index is computed from float32 bits (a >= 1: round the mantissa to one bit;
  a < 1: 2a + 2**23 rounds to an integer in RNE), never through division or log2.
- MXFP4 divides by a power of two, so x / 2**e == x * 2**-e exactly: one multiply.
- No libdevice calls (Triton links libdevice with flush-to-zero on).
- bf16 tensors travel as int16 (loads widen by a 16-bit shift, stores narrow with the integer
  rounding above), so no conversion depends on the backend.
Known differences from the reference: non-finite inputs are not rejected (no host sync; pass
`check_finite=True` to the public wrapper); a NaN E8M0 scale byte (0xFF) is not reproduced.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tracerl import fp4

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# element rounding modes (ROUND)
RTN, TARGET, TARGET_NIBBLES, BIT, BIT_PACKED = 0, 1, 2, 3, 4
# guide mask kinds (MASK)
MASK_NONE, MASK_BYTES, MASK_BITS = 0, 1, 2
# NVFP4 global-scale source (GS): load from a pointer (per tensor: row stride 0; per row: 1),
# compute from a whole-tensor amax cell (two-pass), or compute per row in the kernel (fused)
GS_LOAD, GS_FROM_AMAX, GS_ROW = 0, 1, 2
# the same values as constexpr globals, the only kind a @triton.jit function may read
C_TARGET, C_TARGET_NIBBLES, C_BIT = tl.constexpr(TARGET), tl.constexpr(TARGET_NIBBLES), tl.constexpr(BIT)
C_RTN, C_MASK_BYTES, C_MASK_BITS = tl.constexpr(RTN), tl.constexpr(MASK_BYTES), tl.constexpr(MASK_BITS)
C_GS_FROM_AMAX, C_GS_ROW = tl.constexpr(GS_FROM_AMAX), tl.constexpr(GS_ROW)
# RN(1/6) and the fp32 value of (1 - 6 * RN(1/6)) * RN(1/6), for dividing block amaxes by 6
C_Y6_HI, C_Y6_LO = tl.constexpr(0.1666666716337204), tl.constexpr(-4.967053879312289e-09)
FAST_DIV = True  # NVFP4 divisions by FMA (exact, see above); False: div.rn everywhere (for A/B)


# ----------------------------------------------------------------------------- numeric helpers


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
    """Round an fp32 value to the input dtype (kept as fp32), as torch does for bf16/fp16 math."""
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
        a = tl.maximum(amax, 6.103515625e-05)
    else:
        a = tl.maximum(amax, 1.1754943508222875e-38)
    r = _round_to_dtype(tl.math.div_rn(1.0, a), IN_DTYPE)
    g = _round_to_dtype(r * 2688.0, IN_DTYPE)
    return tl.where(g > 3.4028234663852886e38, 1.0, g)


@triton.jit
def _e4m3_byte(s):
    """E4M3 byte of s in [0, 448], round to nearest even (torch's float8_e4m3fn cast)."""
    b = _bits(s)
    r = b + 0x7FFFF + ((b >> 20) & 1)  # round the mantissa to 3 bits
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    t = s * 512.0  # subnormals: multiples of 2**-9; t < 8 here
    n = t.to(tl.int32)
    frac = t - n.to(tl.float32)
    n = n + ((frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))).to(tl.int32)
    return tl.where(s < 0.015625, n, normal)


@triton.jit
def _e4m3_value(byte):
    """fp32 value of an E4M3 byte (int32 0..255); 0x7F/0xFF (NaN) decode as 480."""
    e = (byte >> 3) & 0xF
    m = byte & 7
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, _f32(((e + 120) << 23) | (m << 20)))
    return _f32(_bits(v) | ((byte & 0x80) << 24))


@triton.jit
def _nv_scale_byte(amax_b, gs, IN_DTYPE: tl.constexpr):
    """fp4.nvfp4_block_scales: e4m3(clamp(gs * (amax_b / 6 in the input dtype), 448)), 0 -> 0.125."""
    s = _round_to_dtype(tl.math.div_rn(amax_b, 6.0), IN_DTYPE)
    s = tl.minimum(gs * s, 448.0)
    byte = _e4m3_byte(s)
    return tl.where(byte == 0, 0x20, byte)


@triton.jit
def _nv_fast_scales(amax_b, min_b, gs, sbyte, GUIDE_SCALES: tl.constexpr, IN_DTYPE: tl.constexpr):
    """Block scale bytes and multipliers s8 / gs by FMA division (tile (BM, NB), gs (BM,)).

    Also returns whether the tile must redo them with div_rn (any block outside the exact range).
    """
    g = gs[:, None]
    yg_hi, yg_lo = _recip_parts(gs)
    if not GUIDE_SCALES:
        s = _round_to_dtype(_div_fast(amax_b, 6.0, C_Y6_HI, C_Y6_LO), IN_DTYPE)
        byte = _e4m3_byte(tl.minimum(g * s, 448.0))
        sbyte = tl.where(byte == 0, 0x20, byte)
    mult = _div_fast(_e4m3_value(sbyte), g, yg_hi[:, None], yg_lo[:, None])
    slow = (g < 8.673617379884035e-19) | (g > 1.152921504606847e18)  # 2**-60, 2**60
    slow = slow | (mult < 9.313225746154785e-10) | (mult > 1.152921504606847e18)  # 2**-30, 2**60
    slow = slow | (amax_b > mult * 8.0)  # saturating elements
    # an element more than 2**60 below the multiplier (its quotient may be subnormal), or an exact
    # zero beside nonzero values (min |x| is taken over zeros too: cheaper than excluding them)
    slow = slow | ((amax_b > 0.0) & (min_b < mult * 8.673617379884035e-19))
    if not GUIDE_SCALES:
        slow = slow | ((amax_b > 0.0) & (amax_b < 8.077935669463161e-28))  # 2**-90: amax / 6
    return sbyte, mult, tl.max(tl.max(slow.to(tl.int32), axis=1), axis=0)


@triton.jit
def _nv_exact(x, amax_b, gs, sbyte, GUIDE_SCALES: tl.constexpr, IN_DTYPE: tl.constexpr):
    """Block scale bytes and the scaled values x / (s8 / gs) with div.rn throughout."""
    if not GUIDE_SCALES:
        sbyte = _nv_scale_byte(amax_b, gs[:, None], IN_DTYPE)
    mult = tl.math.div_rn(_e4m3_value(sbyte), gs[:, None])
    return sbyte, tl.math.div_rn(x, mult[:, :, None])


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
def _rtn_index(a):
    """fp4.rtn_magnitude_index for a in [0, 6]: nearest E2M1 magnitude index, ties to even."""
    b = _bits(a)
    hi = ((b + 0x1FFFFF + ((b >> 22) & 1)) >> 22) - 252  # a >= 1: 1-bit mantissa RNE
    lo = _bits(a * 2.0 + 8388608.0) - 0x4B000000  # a < 1: round(2a), RNE by the 2**23 shift
    return tl.where(a < 1.0, lo, hi)


@triton.jit
def _neighbours(a):
    """fp4.grid_neighbours for a in [0, 6]: (floor index, ceil index) on the E2M1 grid."""
    b = _bits(a)
    t = a * 2.0
    n = t.to(tl.int32)
    lo = tl.where(a < 1.0, n, (b >> 22) - 252)
    on_grid = tl.where(a < 1.0, t == n.to(tl.float32), (b & 0x3FFFFF) == 0)
    return lo, lo + 1 - on_grid.to(tl.int32)


@triton.jit
def _unpack_nibbles(p, BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr):
    """uint8 (BM, NB, B//2) packed codes -> int32 (BM, NB, B) codes (low nibble first)."""
    p = p.to(tl.int32)
    return tl.reshape(tl.join(p & 15, p >> 4), (BM, NB, B))


@triton.jit
def _unpack_bits(p, BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr):
    """uint8 (BM, NB, B//8) -> int32 (BM, NB, B) bits; bit i of byte j is element 8j+i."""
    sh = tl.arange(0, 8)
    bits = (p.to(tl.int32)[:, :, :, None] >> sh[None, None, None, :]) & 1
    return tl.reshape(bits, (BM, NB, B))


# ----------------------------------------------------------------------------- tile I/O


@triton.jit
def _offsets(rows, c0, stride, M, K, NB: tl.constexpr, B: tl.constexpr, PER: tl.constexpr):
    """Pointer offsets and mask of a (BM, NB, B // PER) tile of a row-major (M, K // PER) array."""
    W: tl.constexpr = B // PER
    cols = c0 // PER + tl.arange(0, NB)[None, :, None] * W + tl.arange(0, W)[None, None, :]
    offs = rows.to(tl.int64)[:, None, None] * stride + cols
    return offs, (rows[:, None, None] < M) & (cols < K // PER)


@triton.jit
def _load_x(x_ptr, rows, c0, sx, M, K, NB: tl.constexpr, B: tl.constexpr, IN_DTYPE: tl.constexpr):
    """x tile (BM, NB, B) as fp32; bf16 arrives as int16 bits."""
    offs, m = _offsets(rows, c0, sx, M, K, NB, B, 1)
    raw = tl.load(x_ptr + offs, mask=m, other=0)
    if IN_DTYPE == 1:
        x = _f32(raw.to(tl.int32) << 16)
    else:
        x = raw.to(tl.float32)
    return x


@triton.jit
def _quant_tile(
    x, gs, rows, c0, M, K,
    codes_ptr, scales_ptr, tgt_ptr, mask_ptr, rec_ptr,
    sc, ss, st, sm, sr,
    IN_DTYPE: tl.constexpr, NV: tl.constexpr, GUIDE_SCALES: tl.constexpr,
    ROUND: tl.constexpr, MASK: tl.constexpr, RECORD: tl.constexpr, FAST: tl.constexpr,
    BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
):
    """Quantize one x tile (BM, NB, B) with per-row global scales gs (BM,) and store its outputs."""
    s_cols = c0 // B + tl.arange(0, NB)[None, :]
    s_offs = rows.to(tl.int64)[:, None] * ss + s_cols
    s_mask = (rows[:, None] < M) & (s_cols < K // B)
    ax = tl.abs(x)
    amax_b = tl.max(ax, axis=2)  # (BM, NB)
    if GUIDE_SCALES:
        sbyte = tl.load(scales_ptr + s_offs, mask=s_mask, other=0x20).to(tl.int32)
    else:
        sbyte = amax_b.to(tl.int32)  # placeholder, computed below
    if NV:
        if FAST:
            sbyte, mult, slow = _nv_fast_scales(amax_b, tl.min(ax, axis=2), gs, sbyte, GUIDE_SCALES, IN_DTYPE)
            if slow != 0:  # a rare tile outside the FMA division's exact range
                sbyte, v = _nv_exact(x, amax_b, gs, sbyte, GUIDE_SCALES, IN_DTYPE)
            else:
                y_hi, y_lo = _recip_parts(mult)
                v = _div_fast(x, mult[:, :, None], y_hi[:, :, None], y_lo[:, :, None])
        else:
            sbyte, v = _nv_exact(x, amax_b, gs, sbyte, GUIDE_SCALES, IN_DTYPE)
    else:
        if not GUIDE_SCALES:
            sbyte = _mx_scale_byte(amax_b)
        v = x * _mx_inv_mult(sbyte)[:, :, None]  # exact: a power of two
    if not GUIDE_SCALES:
        tl.store(scales_ptr + s_offs, sbyte.to(tl.uint8), mask=s_mask)
    v = tl.minimum(tl.maximum(v, -6.0), 6.0)
    a = tl.abs(v)

    if ROUND == C_RTN:
        idx = _rtn_index(a)
    else:
        lo, hi = _neighbours(a)
        if ROUND == C_TARGET:
            t_offs, t_mask = _offsets(rows, c0, st, M, K, NB, B, 1)
            t = tl.load(tgt_ptr + t_offs, mask=t_mask, other=0).to(tl.int32)
            idx = tl.where(t >= hi, hi, lo)
        elif ROUND == C_TARGET_NIBBLES:
            t_offs, t_mask = _offsets(rows, c0, st, M, K, NB, B, 2)
            t = _unpack_nibbles(tl.load(tgt_ptr + t_offs, mask=t_mask, other=0), BM, NB, B) & 7
            idx = tl.where(t >= hi, hi, lo)
        elif ROUND == C_BIT:
            t_offs, t_mask = _offsets(rows, c0, st, M, K, NB, B, 1)
            t = tl.load(tgt_ptr + t_offs, mask=t_mask, other=0).to(tl.int32) & 1
            idx = tl.where((hi & 1) == t, hi, lo)
        else:  # BIT_PACKED
            t_offs, t_mask = _offsets(rows, c0, st, M, K, NB, B, 8)
            t = _unpack_bits(tl.load(tgt_ptr + t_offs, mask=t_mask, other=0), BM, NB, B)
            idx = tl.where((hi & 1) == t, hi, lo)
        if MASK == C_MASK_BYTES:
            m_offs, m_mask = _offsets(rows, c0, sm, M, K, NB, B, 1)
            keep = tl.load(mask_ptr + m_offs, mask=m_mask, other=0) != 0
            idx = tl.where(keep, idx, _rtn_index(a))
        elif MASK == C_MASK_BITS:
            m_offs, m_mask = _offsets(rows, c0, sm, M, K, NB, B, 8)
            keep = _unpack_bits(tl.load(mask_ptr + m_offs, mask=m_mask, other=0), BM, NB, B) != 0
            idx = tl.where(keep, idx, _rtn_index(a))

    # the sign bit is set for every strictly negative scaled value, also when it rounds to 0
    code = idx | ((v < 0.0).to(tl.int32) << 3)
    lo_c, hi_c = tl.split(tl.reshape(code, (BM, NB, B // 2, 2)))
    c_offs, c_mask = _offsets(rows, c0, sc, M, K, NB, B, 2)
    tl.store(codes_ptr + c_offs, (lo_c | (hi_c << 4)).to(tl.uint8), mask=c_mask)
    if RECORD:
        sh = tl.arange(0, 8)[None, None, None, :]
        lsb = tl.reshape(idx & 1, (BM, NB, B // 8, 8))
        r_offs, r_mask = _offsets(rows, c0, sr, M, K, NB, B, 8)
        tl.store(rec_ptr + r_offs, tl.sum(lsb << sh, axis=3).to(tl.uint8), mask=r_mask)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _absmax_kernel(x_ptr, amax_ptr, N, ITERS, BLOCK: tl.constexpr, IN_DTYPE: tl.constexpr):
    """Whole-tensor max |x| of a contiguous tensor, as int32 bits (|x| >= 0 orders like its bits)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(ITERS):
        offs = (pid + i * nprog).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        raw = tl.load(x_ptr + offs, mask=offs < N, other=0)
        if IN_DTYPE == 1:
            x = _f32(raw.to(tl.int32) << 16)
        else:
            x = raw.to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    tl.atomic_max(amax_ptr, _bits(tl.max(acc, axis=0)))


@triton.jit(do_not_specialize=["M", "ss", "sg", "st", "sm", "sr"])
def _quant_kernel(
    x_ptr, codes_ptr, scales_ptr, gs_ptr, gs_out_ptr, tgt_ptr, mask_ptr, rec_ptr,
    M, K, sx, sc, ss, sg, st, sm, sr,
    IN_DTYPE: tl.constexpr, NV: tl.constexpr, GS: tl.constexpr, GUIDE_SCALES: tl.constexpr,
    ROUND: tl.constexpr, MASK: tl.constexpr, RECORD: tl.constexpr, FAST: tl.constexpr,
    BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
):
    """FP4 quantize of x_MK. Grid (M/BM, K/BK); with GS == C_GS_ROW (M/BM,) and a loop over K."""
    BK: tl.constexpr = NB * B
    pid_m = tl.program_id(0)
    rows = pid_m * BM + tl.arange(0, BM)
    if GS == C_GS_ROW:  # per-row global scale, fused: pass 1 row amax, pass 2 quantize
        amax = tl.zeros((BM,), tl.float32)
        for c0 in range(0, K, BK):
            x = _load_x(x_ptr, rows, c0, sx, M, K, NB, B, IN_DTYPE)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x), axis=2), axis=1))
        gs = _global_scale(amax, IN_DTYPE)
        tl.store(gs_out_ptr + rows, gs, mask=rows < M)
        for c0 in range(0, K, BK):
            x = _load_x(x_ptr, rows, c0, sx, M, K, NB, B, IN_DTYPE)
            _quant_tile(x, gs, rows, c0, M, K, codes_ptr, scales_ptr, tgt_ptr, mask_ptr, rec_ptr,
                        sc, ss, st, sm, sr, IN_DTYPE, NV, GUIDE_SCALES, ROUND, MASK, RECORD, FAST, BM, NB, B)
    else:
        pid_k = tl.program_id(1)
        c0 = pid_k * BK
        x = _load_x(x_ptr, rows, c0, sx, M, K, NB, B, IN_DTYPE)
        if NV:
            if GS == C_GS_FROM_AMAX:
                g = _global_scale(_f32(tl.load(gs_ptr)), IN_DTYPE)
                if (pid_m == 0) & (pid_k == 0):
                    tl.store(gs_out_ptr, g)
                gs = tl.zeros((BM,), tl.float32) + g
            else:
                gs = tl.load(gs_ptr + rows.to(tl.int64) * sg, mask=rows < M, other=1.0)
        else:
            gs = tl.full((BM,), 1.0, tl.float32)
        _quant_tile(x, gs, rows, c0, M, K, codes_ptr, scales_ptr, tgt_ptr, mask_ptr, rec_ptr,
                    sc, ss, st, sm, sr, IN_DTYPE, NV, GUIDE_SCALES, ROUND, MASK, RECORD, FAST, BM, NB, B)


@triton.jit(do_not_specialize=["M", "ss", "sg"])
def _dequant_kernel(
    codes_ptr, scales_ptr, gs_ptr, out_ptr,
    M, K, sc, ss, sg, so,
    NV: tl.constexpr, OUT_DTYPE: tl.constexpr, FAST: tl.constexpr,
    BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
):
    """out_MK = e2m1(code) * block multiplier, in fp32, rounded to the output dtype."""
    BK: tl.constexpr = NB * B
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    c0 = tl.program_id(1) * BK
    c_offs, c_mask = _offsets(rows, c0, sc, M, K, NB, B, 2)
    code = _unpack_nibbles(tl.load(codes_ptr + c_offs, mask=c_mask, other=0), BM, NB, B)
    s_cols = c0 // B + tl.arange(0, NB)[None, :]
    s_mask = (rows[:, None] < M) & (s_cols < K // B)
    sbyte = tl.load(scales_ptr + rows.to(tl.int64)[:, None] * ss + s_cols, mask=s_mask, other=0x20)
    sbyte = sbyte.to(tl.int32)
    if NV:
        gs = tl.load(gs_ptr + rows.to(tl.int64) * sg, mask=rows < M, other=1.0)
        s8 = _e4m3_value(sbyte)
        # 2**-60 <= gs <= 2**60: FMA division by gs is exact (s8 is at least 2**-9)
        bad = (gs < 8.673617379884035e-19) | (gs > 1.152921504606847e18)
        if FAST:
            if tl.max(bad.to(tl.int32), axis=0) == 0:
                yg_hi, yg_lo = _recip_parts(gs)
                mult = _div_fast(s8, gs[:, None], yg_hi[:, None], yg_lo[:, None])
            else:
                mult = tl.math.div_rn(s8, gs[:, None])
        else:
            mult = tl.math.div_rn(s8, gs[:, None])
    else:
        mult = _mx_mult(sbyte)
    idx = code & 7
    fi = idx.to(tl.float32)
    mag = tl.where(idx < 4, fi * 0.5, tl.where(idx < 6, fi - 2.0, (fi - 4.0) * 2.0))
    # the sign by bit (unary minus is 0 - x in Triton and would turn -0.0 into +0.0)
    val = _f32(_bits(mag * mult[:, :, None]) | ((code & 8) << 28))
    o_offs, o_mask = _offsets(rows, c0, so, M, K, NB, B, 1)
    if OUT_DTYPE == 1:  # bf16 bits, RNE; NaN -> 0x7FC0 as torch
        b = _bits(val)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        tl.store(out_ptr + o_offs, r.to(tl.int16), mask=o_mask)
    elif OUT_DTYPE == 2:
        tl.store(out_ptr + o_offs, val.to(tl.float16), mask=o_mask)
    else:
        tl.store(out_ptr + o_offs, val, mask=o_mask)


@triton.jit
def _probe_kernel(in_ptr, in2_ptr, out_ptr, N, WHAT: tl.constexpr, IN_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """Apply one numeric helper elementwise (tests check each against torch exhaustively)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    v = tl.load(in_ptr + offs, mask=m, other=0)
    w = tl.load(in2_ptr + offs, mask=m, other=1)
    if WHAT == 0:
        r = _rtn_index(v)
    elif WHAT == 1:
        lo, hi = _neighbours(v)
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
    else:
        r = _bits(tl.math.div_rn(v, w))
    tl.store(out_ptr + offs, r, mask=m)


PROBES = {"rtn": 0, "neighbours": 1, "e4m3": 2, "bf16": 3, "e4m3_value": 4, "global_scale": 5,
          "mx_scale": 6, "mx_mult": 7,
          "mx_inv_mult": 8, "div_fast": 9, "div_rn": 10}


def probe(what: str, values: torch.Tensor, in_dtype: torch.dtype = torch.float32,
          divisor: torch.Tensor | None = None) -> torch.Tensor:
    """int32 results of numeric helper `what` on float32 (or int32 byte) values; for tests."""
    out = torch.empty(values.shape, dtype=torch.int32, device=values.device)
    n = values.numel()
    w = divisor if divisor is not None else torch.ones_like(values)
    _probe_kernel[(triton.cdiv(n, 1024),)](values, w, out, n, WHAT=PROBES[what], IN_DTYPE=_DTYPE_CODE[in_dtype],
                                          BLOCK=1024)
    return out


# ----------------------------------------------------------------------------- Python wrappers


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tile(M: int, K: int, B: int, cfg: tuple[int, int, int] | None, row_fused: bool) -> tuple[int, int, int]:
    """(BM, BK, num_warps): about 4096 elements a program; BK a power of two multiple of B."""
    if cfg is not None:
        bm, bk, nw = cfg
        bk = max(B, min(bk, _pow2(K)))
        return bm, bk, nw
    if row_fused:  # one row a program, the row in registers when it fits
        bk = max(B, min(_pow2(K), 8192))
        return 1, bk, 8 if bk >= 4096 else 4
    bk = max(B, min(_pow2(K), 256))
    bm = max(1, min(4096 // bk, _pow2(M)))
    return bm, bk, 4


def _rows(t: torch.Tensor, width: int, name: str) -> torch.Tensor:
    """View t as (M, width) with a unit last stride (copying only if it has to)."""
    t2 = t.reshape(-1, width)
    if t2.stride(-1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < width):
        t2 = t2.contiguous()
    return t2


def _gs_rows(gs: torch.Tensor, M: int, device: torch.device, name: str) -> tuple[torch.Tensor, int]:
    """A global scale as float32 on device plus its row stride: one value (stride 0) or one a row."""
    g = gs.to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    if g.numel() == 1:
        return g, 0
    if g.numel() == M:
        return g, 1
    raise ValueError(f"{name}: global scale has {g.numel()} values; expected 1 or one per row ({M})")


def _guide_tensor(t: torch.Tensor, M: int, K: int, dev: torch.device, what: str):
    """(tensor (M, w), packing divisor) for a guide field given unpacked (..., K) or packed."""
    w = t.shape[-1]
    for per in (1, 2, 8):
        if w * per == K:
            return _rows(t.to(dev), w, what), per
    raise ValueError(f"guide {what} has last dim {w}; expected {K} (unpacked), {K // 2} or {K // 8} (packed)")


def quantize(
    x: torch.Tensor,
    fmt: str = "nvfp4",
    rounding: str = "rtn",
    *,
    global_scale: torch.Tensor | None = None,
    per_row_global: bool = False,
    guide: fp4.RoundingGuide | None = None,
    record: str | None = None,
    record_out: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
) -> tuple[fp4.FP4Tensor, torch.Tensor | None]:
    """Triton FP4 quantize of x (bf16/fp16/fp32, blocks along the last dim) -> (FP4Tensor, record).

    Semantics are those of `fp4.quantize` (mx_rule 'even'). `record` = None | 'codes' | 'lsb':
    'codes' returns the packed codes as the record, 'lsb' also writes one bit per element (bit i of
    byte j = lsb of element 8j+i's magnitude index, (..., K//8) uint8) into `record_out` or a new
    tensor. `config` = (BM, BK, num_warps) overrides the tile heuristic (benchmarks).
    See tracerl.kernels for the accepted guide forms.
    """
    spec = fp4.format_spec(fmt)
    B = spec.block
    if x.dtype not in _DTYPE_CODE:
        raise TypeError(f"triton FP4 quantize takes float32/bfloat16/float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % B:
        raise ValueError(f"x: last dim of shape {tuple(x.shape)} is not a positive multiple of the block size {B}")
    if rounding not in ("rtn", "guided"):
        raise ValueError(f"triton FP4 quantize supports rounding 'rtn' and 'guided', got {rounding!r}")
    if rounding == "guided" and guide is None:
        raise ValueError("rounding='guided' needs a RoundingGuide (the rollout's record)")
    if record not in (None, "codes", "lsb"):
        raise ValueError(f"unknown record encoding {record!r}; use 'codes' or 'lsb'")
    dev, shape, K = x.device, x.shape, x.shape[-1]
    lead = shape[:-1]
    x2 = _rows(x, K, "x")
    M = x2.shape[0]
    in_code = _DTYPE_CODE[x.dtype]
    xk = x2.view(torch.int16) if x.dtype == torch.bfloat16 else x2

    codes = torch.empty(M, K // 2, dtype=torch.uint8, device=dev)
    dummy = codes
    gs_in, sg, gs_out, gs_ret = dummy, 0, dummy, None
    guide_scales = guide is not None and guide.scales is not None
    if guide_scales:
        if tuple(guide.scales.shape) != (*lead, K // B):
            raise ValueError(f"x: guide scales have shape {tuple(guide.scales.shape)}, expected {(*lead, K // B)}")
        if spec.has_global_scale and guide.global_scale is None:
            raise ValueError("x: nvfp4 scale guidance needs the rollout's global scale too")
        scales_ret = guide.scales
        scales = _rows(guide.scales.to(dev).view(torch.uint8), K // B, "guide scales")
        gs_ret = guide.global_scale
        gs_mode = GS_LOAD
        if spec.has_global_scale:
            gs_in, sg = _gs_rows(guide.global_scale, M, dev, "guide")
    else:
        scales = torch.empty(M, K // B, dtype=torch.uint8, device=dev)
        scales_ret = scales.view(spec.scale_dtype).reshape(*lead, K // B)
        gs_mode = GS_LOAD
        if spec.has_global_scale:
            if global_scale is not None:
                gs_ret = global_scale.to(device=dev, dtype=torch.float32)
                if not per_row_global and guide is None and gs_ret.dim() == 1:
                    gs_ret = gs_ret.reshape(1)
                gs_in, sg = _gs_rows(gs_ret, M, dev, "global_scale")
            elif per_row_global:
                gs_mode = GS_ROW
                gs_out = torch.empty(M, dtype=torch.float32, device=dev)
                gs_ret = gs_out.reshape(*lead, 1)
            else:
                gs_mode = GS_FROM_AMAX
                gs_in = _absmax(xk, in_code)
                gs_out = torch.empty(1, dtype=torch.float32, device=dev)
                gs_ret = gs_out

    round_mode, tgt, st = RTN, dummy, 0
    mask_mode, msk, sm = MASK_NONE, dummy, 0
    if rounding == "guided" and (guide.target is not None or guide.bit is not None):
        if guide.target is not None:
            tgt, per = _guide_tensor(guide.target, M, K, dev, "target")
            round_mode = {1: TARGET, 2: TARGET_NIBBLES}.get(per)
            if round_mode is None:
                raise ValueError("guide target must be (..., K) indices or (..., K//2) packed codes")
        else:
            tgt, per = _guide_tensor(guide.bit, M, K, dev, "bit")
            round_mode = {1: BIT, 8: BIT_PACKED}.get(per)
            if round_mode is None:
                raise ValueError("guide bit must be (..., K) bits or (..., K//8) packed bits")
        tgt = tgt.view(torch.uint8) if tgt.dtype in (torch.bool, torch.int8) else tgt
        st = tgt.stride(0)
        if guide.mask is not None:
            msk, per = _guide_tensor(guide.mask, M, K, dev, "mask")
            mask_mode = {1: MASK_BYTES, 8: MASK_BITS}.get(per)
            if mask_mode is None:
                raise ValueError("guide mask must be (..., K) bool or (..., K//8) packed bits")
            msk = msk.view(torch.uint8) if msk.dtype in (torch.bool, torch.int8) else msk
            sm = msk.stride(0)

    rec, sr = dummy, 0
    if record == "lsb":
        if record_out is not None:
            if tuple(record_out.shape) != (*lead, K // 8) or record_out.dtype != torch.uint8:
                raise ValueError(f"record_out must be uint8 {(*lead, K // 8)}, got {record_out.dtype} {tuple(record_out.shape)}")
            rec = record_out.view(-1, K // 8)  # a view, so the kernel writes into record_out
            if rec.stride(-1) != 1:
                raise ValueError("record_out needs a unit stride along its last dim")
        else:
            rec = torch.empty(M, K // 8, dtype=torch.uint8, device=dev)
        sr = rec.stride(0)

    bm, bk, nw = _tile(M, K, B, config, gs_mode == GS_ROW)
    grid = (triton.cdiv(M, bm),) if gs_mode == GS_ROW else (triton.cdiv(M, bm), triton.cdiv(K, bk))
    if M > 0:
        _quant_kernel[grid](
            xk, codes, scales, gs_in, gs_out, tgt, msk, rec,
            M, K, x2.stride(0), codes.stride(0), scales.stride(0), sg, st, sm, sr,
            IN_DTYPE=in_code, NV=spec.has_global_scale, GS=gs_mode, GUIDE_SCALES=guide_scales,
            ROUND=round_mode, MASK=mask_mode, RECORD=record == "lsb", FAST=FAST_DIV,
            BM=bm, NB=bk // B, B=B, num_warps=nw,
        )
    q = fp4.FP4Tensor(codes=codes.reshape(*lead, K // 2), scales=scales_ret, global_scale=gs_ret,
                      fmt=fmt, shape=shape)
    if record == "codes":
        return q, q.codes
    if record == "lsb":
        return q, record_out if record_out is not None else rec.reshape(*lead, K // 8)
    return q, None


def _absmax(xk: torch.Tensor, in_code: int) -> torch.Tensor:
    """int32 cell holding the bits of max |x| over the whole tensor (pass 1 of NVFP4's two)."""
    flat = xk.reshape(-1) if xk.is_contiguous() else xk.contiguous().reshape(-1)
    cell = torch.zeros(1, dtype=torch.int32, device=xk.device)
    n = flat.numel()
    if n:
        block = 4096 if n >= 4096 else _pow2(n)
        sms = 8 if INTERPRET else torch.cuda.get_device_properties(xk.device).multi_processor_count
        nblocks = triton.cdiv(n, block)
        grid = (max(1, min(nblocks, sms * 4)),)
        _absmax_kernel[grid](flat, cell, n, triton.cdiv(nblocks, grid[0]), BLOCK=block, IN_DTYPE=in_code,
                             num_warps=8)
    return cell


def dequantize(q: fp4.FP4Tensor, dtype: torch.dtype = torch.bfloat16,
               config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Triton `fp4.dequantize`: values in fp32, rounded to dtype (float32/bfloat16/float16)."""
    spec = fp4.format_spec(q.fmt)
    B = spec.block
    if dtype not in _DTYPE_CODE:
        raise TypeError(f"triton FP4 dequantize writes float32/bfloat16/float16, got {dtype}")
    shape, K = q.shape, q.shape[-1]
    dev = q.codes.device
    codes = _rows(q.codes, K // 2, "codes")
    M = codes.shape[0]
    scales = _rows(q.scales.view(torch.uint8), K // B, "scales")
    gs, sg = codes, 0
    if spec.has_global_scale:
        if q.global_scale is None:
            raise ValueError("an nvfp4 FP4Tensor needs its global scale to be dequantized")
        gs, sg = _gs_rows(q.global_scale, M, dev, "q")
    out = torch.empty(M, K, dtype=dtype, device=dev)
    outk = out.view(torch.int16) if dtype == torch.bfloat16 else out
    bm, bk, nw = _tile(M, K, B, config, False)
    if M > 0:
        _dequant_kernel[(triton.cdiv(M, bm), triton.cdiv(K, bk))](
            codes, scales, gs, outk, M, K, codes.stride(0), scales.stride(0), sg, out.stride(0),
            NV=spec.has_global_scale, OUT_DTYPE=_DTYPE_CODE[dtype], FAST=FAST_DIV, BM=bm, NB=bk // B, B=B, num_warps=nw,
        )
    return out.reshape(shape)
