"""Triton kernels: NVFP4 / MXFP4 quantize (rtn, guided), fused recording, dequantize.

Each kernel is an alternative implementation of `tracerl.fp4` and reproduces it bit for bit,
including its operation order (the numerics and why they are exact: fp4_numerics.py). The input
is viewed as x_MK (M rows = all leading dims, K = last dim). A program owns BM rows x BK columns,
held as x_MNPE (BM rows, NB blocks of B = P*8 elements, as P parts of 8). Triton vectorises the
8 contiguous elements and, for the other dims, places threads along the first ones (rows, then
blocks) and repeats the last (parts) in registers, so each thread holds whole FP4 blocks: block
maxima and scales need no shuffles and no thread repeats another's per-block work. The two (or
four) 16-byte loads of a block's parts are merged by L1.

Kernels are compiled with enable_fp_fusion=False: every FMA the numerics need is an explicit
tl.fma, and a contracted `x * s + 0.0` would keep the -0.0 of an underflowed negative product
(the reference's sign test sees +0). NVFP4 tiles take the FMA-division path unless a block is out of its exact range (tiny or huge
scales, saturation, or a nonzero |x| < 2**-89); such a tile redoes the division with div.rn.
Known differences from the reference: non-finite inputs are not rejected (no host sync; the
public wrapper has `check_finite=True`); NaN E8M0/E4M3 scale bytes are not reproduced.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tracerl import fp4
from tracerl.kernels import pdl
from tracerl.kernels.fp4_numerics import (
    DTYPE_CODE,
    _bits,
    _div_fast,
    _e2m1_decode_bytes,
    _e2m1_nibble_value,
    _e4m3_value,
    _f32,
    _global_scale,
    _mx_inv_mult,
    _mx_mult,
    _mx_scale_byte,
    _neighbours,
    _nv_fast_scales,
    _nv_scale_byte,
    _recip_parts,
    _rtn_g,
    _tiny_nonzero,
    probe,  # noqa: F401  (tests reach the numerics through this module)
)
from tracerl.kernels.record_sink import NO_PLANES, RecordSink

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_DTYPE_CODE = DTYPE_CODE
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
FAST_DIV = True  # NVFP4 divisions by FMA where exact; False: div.rn everywhere (for A/B benchmarks)


# ----------------------------------------------------------------------------- tile I/O


@triton.jit
def _offs(rows, c0, stride, M, K, P: tl.constexpr, NB: tl.constexpr, B: tl.constexpr, PER: tl.constexpr):
    """Offsets and mask of the (BM, NB, P, 8 // PER) tile of a row-major (M, K // PER) array."""
    W: tl.constexpr = 8 // PER
    cols = (c0 // PER + tl.arange(0, NB)[None, :, None, None] * (B // PER)
            + tl.arange(0, P)[None, None, :, None] * W + tl.arange(0, W)[None, None, None, :])
    offs = rows.to(tl.int64)[:, None, None, None] * stride + cols
    return offs, (rows[:, None, None, None] < M) & (cols < K // PER)


@triton.jit
def _load_x(x_ptr, rows, c0, sx, M, K, P: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
            IN_DTYPE: tl.constexpr):
    """x tile (BM, NB, P, 8) as fp32. bf16 arrives as int32 words of two (row stride sx in words):
    the low element is the word << 16, the high one the word with its low half cleared."""
    if IN_DTYPE == 1:
        offs, m = _offs(rows, c0, sx, M, K, P, NB, B, 2)
        w = tl.load(x_ptr + offs, mask=m, other=0)
        x = tl.reshape(tl.join(_f32(w << 16), _f32(w & -65536)), (w.shape[0], w.shape[1], P, 8))
    else:
        offs, m = _offs(rows, c0, sx, M, K, P, NB, B, 1)
        x = tl.load(x_ptr + offs, mask=m, other=0).to(tl.float32)
    return x


@triton.jit
def _block_max(t):
    """(BM, NB, P, 8) -> (BM, NB) maximum."""
    return tl.max(tl.max(t, axis=3), axis=2)


@triton.jit
def _unpack_nibbles(p):
    """uint8 (BM, NB, P, 4) packed codes -> int32 (BM, NB, P, 8) (low nibble first)."""
    p = p.to(tl.int32)
    return tl.reshape(tl.join(p & 15, p >> 4), (p.shape[0], p.shape[1], p.shape[2], 8))


@triton.jit
def _unpack_bits(p):
    """uint8 (BM, NB, P, 1) -> int32 (BM, NB, P, 8) bits; bit i of the byte is element i."""
    return (p.to(tl.int32) >> tl.arange(0, 8)[None, None, None, :]) & 1


@triton.jit
def _load_guide(ptr, rows, c0, stride, M, K, P: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
                PER: tl.constexpr):
    """A guide field as int32 (BM, NB, P, 8): per element (PER 1), nibble-packed (2) or bit-packed (8)."""
    offs, m = _offs(rows, c0, stride, M, K, P, NB, B, PER)
    t = tl.load(ptr + offs, mask=m, other=0)
    if PER == 2:
        t = _unpack_nibbles(t)
    elif PER == 8:
        t = _unpack_bits(t)
    else:
        t = t.to(tl.int32)
    return t


@triton.jit
def _sink_rows(rows, M, src_ptr, flat_ptr, G, PR, PS, SRC: tl.constexpr):
    """Record row of each x row (int64): s = src[row] (SRC) or the row itself, then
    (s // PR) * PS + flat[(s % PR) // G] * G + s % PR % G, as `RecordSink.dest_rows`."""
    live = rows < M
    if SRC:
        s = tl.load(src_ptr + rows, mask=live, other=0).to(tl.int64)
    else:
        s = rows.to(tl.int64)
    r = s % PR
    f = tl.load(flat_ptr + r // G, mask=live, other=0).to(tl.int64)
    return (s // PR) * PS + f * G + r % G


@triton.jit
def _quant_tile(
    x, gs, rows, c0, M, K,
    codes_ptr, scales_ptr, tgt_ptr, mask_ptr, rec_ptr,
    sc, ss, st, sm, sr,
    k_codes, k_scales, k_gs, k_src, k_flat, k_sc, k_ss, k_G, k_PR, k_PS, dq_ptr, sdq,
    IN_DTYPE: tl.constexpr, NV: tl.constexpr, GUIDE_SCALES: tl.constexpr,
    ROUND: tl.constexpr, MASK: tl.constexpr, RECORD: tl.constexpr, FAST: tl.constexpr,
    SINK: tl.constexpr, SINK_SRC: tl.constexpr, DQ: tl.constexpr,
    BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
):
    """Quantize one x tile (BM, NB, P, 8) with per-row global scales gs (BM,) and store its outputs
    (with SINK, also codes, scales and gs at each row's record row: see `_sink_rows`; with DQ, also
    e2m1 * block scale, the global scale not applied, at dq_ptr)."""
    P: tl.constexpr = B // 8
    s_cols = c0 // B + tl.arange(0, NB)[None, :]
    s_offs = rows.to(tl.int64)[:, None] * ss + s_cols
    s_mask = (rows[:, None] < M) & (s_cols < K // B)
    ax = tl.abs(x)
    amax_b = _block_max(ax)  # (BM, NB)
    if GUIDE_SCALES:
        sbyte = tl.load(scales_ptr + s_offs, mask=s_mask, other=0x20).to(tl.int32)
    else:
        sbyte = amax_b.to(tl.int32)  # placeholder, computed below
    clamp = GUIDE_SCALES  # computed MXFP4 scales and the NVFP4 fast path keep |v| < 7
    if NV:
        if FAST:
            if IN_DTYPE == 2:  # fp16 has no nonzero value below 2**-89
                tiny_b = tl.zeros(amax_b.shape, tl.float32)
            else:
                tiny_b = _block_max(_tiny_nonzero(ax))
            sbyte, mult, slow = _nv_fast_scales(amax_b, tiny_b, gs, sbyte, GUIDE_SCALES, IN_DTYPE)
            if slow != 0:  # a rare tile outside the FMA division's exact range
                if not GUIDE_SCALES:
                    sbyte = _nv_scale_byte(amax_b, gs[:, None], IN_DTYPE)
                mult = tl.math.div_rn(_e4m3_value(sbyte), gs[:, None])
                v = tl.math.div_rn(x, mult[:, :, None, None])
                v = tl.minimum(tl.maximum(v, -6.0), 6.0)
            else:
                y_hi, y_lo = _recip_parts(mult)
                v = _div_fast(x, mult[:, :, None, None], y_hi[:, :, None, None], y_lo[:, :, None, None])
        else:
            if not GUIDE_SCALES:
                sbyte = _nv_scale_byte(amax_b, gs[:, None], IN_DTYPE)
            mult = tl.math.div_rn(_e4m3_value(sbyte), gs[:, None])
            v = tl.math.div_rn(x, mult[:, :, None, None])
            clamp = True
    else:
        if not GUIDE_SCALES:
            sbyte = _mx_scale_byte(amax_b)
        v = x * _mx_inv_mult(sbyte)[:, :, None, None]  # exact: a power of two
    if not GUIDE_SCALES:
        tl.store(scales_ptr + s_offs, sbyte.to(tl.uint8), mask=s_mask)
    if SINK:
        d = _sink_rows(rows, M, k_src, k_flat, k_G, k_PR, k_PS, SINK_SRC)
        tl.store(k_scales + d[:, None] * k_ss + s_cols, sbyte.to(tl.uint8), mask=s_mask)
        if NV:
            tl.store(k_gs + d, gs, mask=rows < M)

    v = v + 0.0  # -0.0 -> +0.0, so the sign bit is set exactly where v < 0
    a = tl.abs(v)
    if clamp or ROUND != C_RTN:
        a = tl.minimum(a, 6.0)
    g = _rtn_g(a)  # 2**23 + round-to-nearest index
    if ROUND == C_RTN:
        idx = _bits(g)  # 0x4B000000 + index (see the packing below)
    else:
        lo, hi = _neighbours(g, a)
        if ROUND == C_TARGET:
            t = _load_guide(tgt_ptr, rows, c0, st, M, K, P, NB, B, 1)
            idx = tl.where(t >= hi, hi, lo)
        elif ROUND == C_TARGET_NIBBLES:
            t = _load_guide(tgt_ptr, rows, c0, st, M, K, P, NB, B, 2) & 7
            idx = tl.where(t >= hi, hi, lo)
        elif ROUND == C_BIT:
            t = _load_guide(tgt_ptr, rows, c0, st, M, K, P, NB, B, 1) & 1
            idx = tl.where((hi & 1) == t, hi, lo)
        else:  # BIT_PACKED
            t = _load_guide(tgt_ptr, rows, c0, st, M, K, P, NB, B, 8)
            idx = tl.where((hi & 1) == t, hi, lo)
        if MASK == C_MASK_BYTES:
            keep = _load_guide(mask_ptr, rows, c0, sm, M, K, P, NB, B, 1) != 0
            idx = tl.where(keep, idx, _bits(g) & 7)
        elif MASK == C_MASK_BITS:
            keep = _load_guide(mask_ptr, rows, c0, sm, M, K, P, NB, B, 8) != 0
            idx = tl.where(keep, idx, _bits(g) & 7)

    # code = index + 8 * (v < 0) (v's sign bit, as v is never -0.0 here). For rtn, idx is the
    # bits of g, 0x4B000000 + index: the constant sits above bit 23 and never reaches the low byte
    # of lo + (hi << 4), so the packing's truncation to uint8 drops it (saves two masks).
    code = idx + ((_bits(v).to(tl.uint32, bitcast=True) >> 31).to(tl.int32, bitcast=True) << 3)
    lo_c, hi_c = tl.split(tl.reshape(code, (BM, NB, P, 4, 2)))
    c_offs, c_mask = _offs(rows, c0, sc, M, K, P, NB, B, 2)
    tl.store(codes_ptr + c_offs, (lo_c + (hi_c << 4)).to(tl.uint8), mask=c_mask)
    if SINK:
        k_offs, _ = _offs(d, c0, k_sc, M, K, P, NB, B, 2)
        tl.store(k_codes + k_offs, (lo_c + (hi_c << 4)).to(tl.uint8), mask=c_mask)
    if RECORD:
        lsb = tl.sum((idx & 1) << tl.arange(0, 8)[None, None, None, :], axis=3)
        r_offs, r_mask = _offs(rows, c0, sr, M, K, P, NB, B, 8)
        tl.store(rec_ptr + tl.reshape(r_offs, (BM, NB, P)), lsb.to(tl.uint8), mask=tl.reshape(r_mask, (BM, NB, P)))
    if DQ:  # what _dequant_kernel gives for these codes with unit global scales, bit for bit
        if NV:
            mult = _e4m3_value(sbyte)
        else:
            mult = _mx_mult(sbyte)
        val = _e2m1_nibble_value((code & 15).to(tl.float32)) * mult[:, :, None, None]
        d_offs, d_mask = _offs(rows, c0, sdq, M, K, P, NB, B, 1)
        tl.store(dq_ptr + d_offs, val.to(dq_ptr.dtype.element_ty), mask=d_mask)


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
        if IN_DTYPE == 1:  # int32 words of two bf16
            acc = tl.maximum(acc, tl.maximum(tl.abs(_f32(raw << 16)), tl.abs(_f32(raw & -65536))))
        else:
            acc = tl.maximum(acc, tl.abs(raw.to(tl.float32)))
    tl.atomic_max(amax_ptr, _bits(tl.max(acc, axis=0)))


@triton.jit(do_not_specialize=["M", "sg"])
def _quant_kernel(
    x_ptr, codes_ptr, scales_ptr, gs_ptr, gs_out_ptr, tgt_ptr, mask_ptr, rec_ptr,
    M, K, sx, sc, ss, sg, st, sm, sr,
    k_codes, k_scales, k_gs, k_src, k_flat, k_sc, k_ss, k_G, k_PR, k_PS, dq_ptr, sdq,
    IN_DTYPE: tl.constexpr, NV: tl.constexpr, GS: tl.constexpr, GUIDE_SCALES: tl.constexpr,
    ROUND: tl.constexpr, MASK: tl.constexpr, RECORD: tl.constexpr, FAST: tl.constexpr,
    SINK: tl.constexpr, SINK_SRC: tl.constexpr, DQ: tl.constexpr,
    BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """FP4 quantize of x_MK. Grid (M/BM, K/BK); with GS == GS_ROW (M/BM,) and a loop over K."""
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    BK: tl.constexpr = NB * B
    P: tl.constexpr = B // 8
    pid_m = tl.program_id(0)
    rows = pid_m * BM + tl.arange(0, BM)
    if GS == C_GS_ROW:  # per-row global scale, fused: pass 1 row amax, pass 2 quantize
        amax = tl.zeros((BM,), tl.float32)
        for c0 in range(0, K, BK):
            x = _load_x(x_ptr, rows, c0, sx, M, K, P, NB, B, IN_DTYPE)
            amax = tl.maximum(amax, tl.max(_block_max(tl.abs(x)), axis=1))
        gs = _global_scale(amax, IN_DTYPE)
        tl.store(gs_out_ptr + rows, gs, mask=rows < M)
        for c0 in range(0, K, BK):
            x = _load_x(x_ptr, rows, c0, sx, M, K, P, NB, B, IN_DTYPE)
            _quant_tile(x, gs, rows, c0, M, K, codes_ptr, scales_ptr, tgt_ptr, mask_ptr, rec_ptr,
                        sc, ss, st, sm, sr, k_codes, k_scales, k_gs, k_src, k_flat, k_sc, k_ss, k_G, k_PR, k_PS,
                        dq_ptr, sdq, IN_DTYPE, NV, GUIDE_SCALES, ROUND, MASK, RECORD, FAST, SINK, SINK_SRC, DQ,
                        BM, NB, B)
    else:
        pid_k = tl.program_id(1)
        c0 = pid_k * BK
        x = _load_x(x_ptr, rows, c0, sx, M, K, P, NB, B, IN_DTYPE)
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
                    sc, ss, st, sm, sr, k_codes, k_scales, k_gs, k_src, k_flat, k_sc, k_ss, k_G, k_PR, k_PS,
                    dq_ptr, sdq, IN_DTYPE, NV, GUIDE_SCALES, ROUND, MASK, RECORD, FAST, SINK, SINK_SRC, DQ, BM, NB, B)


@triton.jit(do_not_specialize=["M", "sg"])
def _dequant_kernel(
    codes_ptr, scales_ptr, gs_ptr, out_ptr,
    M, K, sc, ss, sg, so,
    NV: tl.constexpr, FAST: tl.constexpr,
    BM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out_MK = e2m1(code) * block multiplier in fp32, rounded (RNE) to out's dtype."""
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    BK: tl.constexpr = NB * B
    P: tl.constexpr = B // 8
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    c0 = tl.program_id(1) * BK
    c_offs, c_mask = _offs(rows, c0, sc, M, K, P, NB, B, 2)
    lo, hi = _e2m1_decode_bytes(tl.load(codes_ptr + c_offs, mask=c_mask, other=0).to(tl.int32))
    e2m1 = tl.reshape(tl.join(lo, hi), (BM, NB, P, 8))  # signed E2M1 values, fp32
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
    val = e2m1 * mult[:, :, None, None]  # exact sign: (+-mag) * mult rounds like +-(mag * mult)
    o_offs, o_mask = _offs(rows, c0, so, M, K, P, NB, B, 1)
    tl.store(out_ptr + o_offs, val.to(out_ptr.dtype.element_ty), mask=o_mask)


# ----------------------------------------------------------------------------- Python wrappers


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tile(M: int, K: int, B: int, cfg: tuple[int, int, int] | None, row_fused: bool) -> tuple[int, int, int]:
    """(BM, BK, num_warps): about 4096 elements a program, few rows and long column spans (threads
    go along rows first, then blocks: few rows keep a warp's loads on contiguous memory)."""
    if cfg is not None:
        bm, bk, nw = cfg
        return bm, max(B, min(bk, _pow2(K))), nw
    if row_fused:  # one row a program, the row in registers when it fits
        if M >= 4096 and 256 < K <= 1024:
            # many short rows (the down GEMM's input, 8 per token): 8 rows x 256 columns a program won on
            # the H100 (2026-12-08, scratch/quant_tiles.py: 14208 x 768 40.6 -> 34.0 us, 4352 x 768 13.7
            # -> 12.7 us, outputs bit-identical); at K = 2048 or fewer rows one row a program stays best
            return 8, 256, 4
        bk = max(B, min(_pow2(K), 8192))
        return 1, bk, 8 if bk >= 4096 else 4
    bk = max(B, min(_pow2(K), 2048))
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
    sink: RecordSink | None = None,
    dequant_out: torch.Tensor | None = None,
) -> tuple[fp4.FP4Tensor, torch.Tensor | None]:
    """Triton FP4 quantize of x (bf16/fp16/fp32, blocks along the last dim) -> (FP4Tensor, record).

    Semantics are those of `fp4.quantize` (mx_rule 'even'). `record` = None | 'codes' | 'lsb':
    'codes' returns the packed codes as the record, 'lsb' also writes one bit per element (bit i of
    byte j = lsb of element 8j+i's magnitude index, (..., K//8) uint8) into `record_out` or a new
    tensor. `config` = (BM, BK, num_warps) overrides the tile heuristic (benchmarks). `sink`: also
    store each row's codes, scales and global scale at its record row (kernels/record_sink.py).
    `dequant_out`: a BF16/fp16/fp32 (..., K) tensor that also receives e2m1 * block scale, the global
    scale not applied (`dequantize` of the result with unit global scales, bit for bit), in the same
    pass: what fp4_gemm's FP4-activation GEMMs read (their epilogue divides by the global scale).
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
    if x.dtype == torch.bfloat16:  # int32 words of two elements (needs 4-byte aligned rows)
        if x2.storage_offset() % 2 or (x2.shape[0] > 1 and x2.stride(0) % 2):
            x2 = x2.contiguous()
        xk, sx = x2.view(torch.int32), x2.stride(0) // 2
    else:
        xk, sx = x2, x2.stride(0)

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

    dq, sdq = dummy, 0
    if dequant_out is not None:
        if tuple(dequant_out.shape) != tuple(shape) or dequant_out.dtype not in _DTYPE_CODE:
            raise ValueError(f"dequant_out must be float32/bfloat16/float16 {tuple(shape)}, got "
                             f"{dequant_out.dtype} {tuple(dequant_out.shape)}")
        dq = dequant_out.view(-1, K)  # a view, so the kernel writes into dequant_out
        if dq.stride(-1) != 1 or dq.device != dev:
            raise ValueError("dequant_out needs a unit stride along its last dim, on x's device")
        sdq = dq.stride(0)

    k_args = (dummy, dummy, dummy, dummy, dummy, 0, 0, 1, NO_PLANES, 0)
    if sink is not None:
        sink.check(M, K, spec)
        k_args = (sink.codes, sink.scales, dummy if sink.gscale is None else sink.gscale,
                  dummy if sink.src is None else sink.src, sink.flat, sink.codes.stride(0), sink.scales.stride(0),
                  sink.group, sink.plane_rows, sink.plane_stride)

    bm, bk, nw = _tile(M, K, B, config, gs_mode == GS_ROW)
    grid = (triton.cdiv(M, bm),) if gs_mode == GS_ROW else (triton.cdiv(M, bm), triton.cdiv(K, bk))
    if M > 0:
        _quant_kernel[grid](
            xk, codes, scales, gs_in, gs_out, tgt, msk, rec,
            M, K, sx, codes.stride(0), scales.stride(0), sg, st, sm, sr, *k_args, dq, sdq,
            IN_DTYPE=in_code, NV=spec.has_global_scale, GS=gs_mode, GUIDE_SCALES=guide_scales,
            ROUND=round_mode, MASK=mask_mode, RECORD=record == "lsb", FAST=FAST_DIV,
            SINK=sink is not None, SINK_SRC=sink is not None and sink.src is not None, DQ=dequant_out is not None,
            BM=bm, NB=bk // B, B=B, num_warps=nw, enable_fp_fusion=False,
            **pdl.launch(xk.device),
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
        sms = torch.cuda.get_device_properties(xk.device).multi_processor_count if xk.is_cuda else 8
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
    bm, bk, nw = _tile(M, K, B, config, False)
    if M > 0:
        _dequant_kernel[(triton.cdiv(M, bm), triton.cdiv(K, bk))](
            codes, scales, gs, out, M, K, codes.stride(0), scales.stride(0), sg, out.stride(0),
            NV=spec.has_global_scale, FAST=FAST_DIV, BM=bm, NB=bk // B, B=B, num_warps=nw, enable_fp_fusion=False,
            **pdl.launch(codes.device),
        )
    return out.reshape(shape)
