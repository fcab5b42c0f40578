"""FP4-weight GEMMs for decode: a grouped (MoE experts) GEMM and a dense linear, weights kept packed.

Shape legend: R rows of A (tokens), N sorted (token, slot) rows, E experts, O / NOUT output
features, K the reduction (input) dim. Weights are nn.Linear-shaped per expert, (E, O, K).

Formats (DESIGN.md "FP4 conventions"; fp4.FP4Tensor):
- W: NVFP4 codes uint8 (E, O, K//2) (element 2i low nibble), E4M3 block scales (E, O, K//16)
  as uint8 bits, one float32 global scale per expert (E,): w = e2m1 * s8 / gs. Or BF16 (E, O, K).
- A: BF16 (R, K) (w4a16), or NVFP4 with per-row global scales (w4a4): codes (R, K//2),
  scales (R, K//16), gs (R,), as `kernels.quantize(x, per_row_global=True)` makes them.

The kernel never writes weights back to memory in BF16. In registers each code becomes its exact
E2M1 value in BF16 and is multiplied by its block's E4M3 scale: the product has at most 6
significant bits, so it is exact in BF16 and the tensor-core dot (BF16 x BF16, float32
accumulate) sees exactly c * s8. The per-expert 1/gs (and for FP4 activations the per-row 1/gs_a)
is applied to the float32 accumulator in the epilogue. So the only differences from the exact
product of the dequantized operands are float32 accumulation order and the final rounding; the
engine's CPU path (fp4.dequantize to BF16, then a BF16 matmul) rounds c*s8/gs to BF16 first, so
the two agree to BF16 rounding, not bit for bit (tests/test_gpu_kernels.py states the tolerances).

The packed bytes are split into low / high nibbles instead of being interleaved: A's even columns
meet the low nibbles and its odd columns the high ones (two dots of K/2), which needs no shuffle.
On CUDA the nibble -> BF16 conversion is 4 codes per PTX snippet (prmt/and/shift, then one
bf16x2 FMA by 2**126 per pair: the nibble's bits placed in a BF16 are e2m1 * 2**-126); the
portable path (interpreter, fallback) builds float32 bits. `selfcheck()` compares both once.

Grouped layout (model/moe.py): rows sorted by expert, `offsets` int32 (E,) cumulative ends. One
program per (expert, BN output columns) loops over its expert's row tiles; experts with no rows
exit at once and read no weights. Options:
- gather (row_idx): A row of sorted row i is row_idx[i] (the token), so the sorted copy of the
  activations is never written;
- swiglu: the program computes gate columns j and up columns F + j of the fused (E, 2F, K) weight
  and writes silu(gate) * up (each rounded to BF16 as the model's ops are): (N, F);
- scatter (dst_idx, gate): row i is rounded to BF16, multiplied by gate[i] (float32) and written
  as float32 to row dst_idx[i] (the token x slot pair), ready for the top-k sum.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tracerl import fp4
from tracerl.kernels import fp4_quant, pdl
from tracerl.kernels.decode_reference import (  # noqa: F401  (re-exported: the kernels' references)
    dispatch_reference,
    exact_values,
    grouped_gemm_reference,
    route_reference,
)
from tracerl.kernels.fp4_numerics import _e4m3_value
from tracerl.kernels.fp4_swizzle import SwizzledFP4

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The interpreter's BF16 arithmetic is broken (Triton 3.6: NaN products, wrong BF16 dots), so under
# it the kernels compute in float32; every product here is exact in BF16, so the results agree.
USE_ASM = not INTERPRET  # the PTX nibble conversion; `selfcheck` turns it off if it disagrees
C_INTERPRET = tl.constexpr(INTERPRET)
# load the next K tile's packed weights before dequantizing this one; off: on the H200 it slowed all
# four FP4 GEMM kinds in two sessions (more registers, fewer CTAs per SM; bench/RESULTS.md)
PREFETCH = False
# Swap A and B for FP4 weights: the dequantized weight tile (BN rows) is the dot's left operand and the
# few token rows (BM) its right one, so the tensor-core M dimension is filled by weight rows (decode
# has ~1-16 rows per expert) and the big operand can stay in registers; the (BN, BM) accumulator is
# transposed once in the epilogue. Same products and float32 accumulation; A/B in the bench.
SWAP_AB = False
# Load the packed weight codes with the tensor-memory accelerator (a host TensorDescriptor over the
# (E*O, K/2) codes): TMA copies land in shared memory asynchronously and Triton pipelines them over
# num_stages (Triton 3.6 also pipelines the plain loads, as cp.async: both forms are timed). Scales (1/8
# of the bytes, rows of K/16 < TMA's 16-byte minimum box at BK=128) keep plain loads. A/B in the bench.
TMA_W = False
# Per GEMM kind, (PREFETCH, SWAP_AB, TMA_W) chosen by `bench/rollout.py --micro`, keyed like TUNED by
# (FP4 weights, FP4 activations, swiglu); a kind not listed uses the three module flags. On the H200
# no variant won everywhere (bench/RESULTS.md, fourth session): TMA_W won only the w4a16 down GEMM
# (-12%); elsewhere the plain kernel won or tied within 1%, so the default lists that one kind.
KERNEL_VARIANT: dict[tuple[bool, bool, bool], tuple[bool, bool, bool]] = {(True, False, False): (False, False, True)}
# w4a4: dequantize the FP4 activations once to their exact BF16 c * s8 (one small kernel) and run
# the BF16-activation GEMM with the per-row 1 / gs_a in the epilogue, instead of dequantizing them
# inside the K loop. The loop's A tile is a dot operand every warp holds whole, so in-loop each of
# the 4-8 warps redid it (Nsight Compute: the w4a4 GEMMs at 71-82% of issue slots). Same products.
DEQUANT_A = True

# 4 packed bytes ($4) -> low nibbles as 4 bf16 ($0, $1) and high nibbles ($2, $3), exact E2M1 values
_NIBBLES_TO_BF16 = tl.constexpr("""
{
.reg .b32 t0, t1, a, b, k, z;
mov.b32 k, 0x7E807E80;
mov.b32 z, 0x80008000;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
and.b32 a, t0, 0x00070007;
shl.b32 a, a, 6;
and.b32 b, t0, 0x00080008;
shl.b32 b, b, 12;
or.b32 a, a, b;
fma.rn.bf16x2 $0, a, k, z;
and.b32 a, t1, 0x00070007;
shl.b32 a, a, 6;
and.b32 b, t1, 0x00080008;
shl.b32 b, b, 12;
or.b32 a, a, b;
fma.rn.bf16x2 $1, a, k, z;
and.b32 a, t0, 0x00700070;
shl.b32 a, a, 2;
and.b32 b, t0, 0x00800080;
shl.b32 b, b, 8;
or.b32 a, a, b;
fma.rn.bf16x2 $2, a, k, z;
and.b32 a, t1, 0x00700070;
shl.b32 a, a, 2;
and.b32 b, t1, 0x00800080;
shl.b32 b, b, 8;
or.b32 a, a, b;
fma.rn.bf16x2 $3, a, k, z;
}
""")


# 4 swizzled bytes ($4, kernels/fp4_swizzle.py) and 4 BF16 scales*2**117 ($5: elements 0-1, $6: 2-3) ->
# even codes c*s8*2**-9 ($0, $1) and odd ones ($2, $3): three and-masks (two after a shift), one
# three-part gather, and one bf16x2 multiply per pair that also applies the block scale
_SWZ_TO_BF16 = tl.constexpr("""
{
.reg .b32 a, b, c, z;
mov.b32 z, 0x80008000;
and.b32 a, $4, 0x81C081C0;
fma.rn.bf16x2 $0, a, $5, z;
shl.b32 a, $4, 3;
and.b32 a, a, 0x81C081C0;
fma.rn.bf16x2 $1, a, $6, z;
shl.b32 a, $4, 6;
and.b32 a, a, 0x81C081C0;
fma.rn.bf16x2 $2, a, $5, z;
shl.b32 a, $4, 1;
and.b32 a, a, 0x80008000;
shr.b32 b, $4, 3;
and.b32 b, b, 0x01800180;
shr.b32 c, $4, 7;
and.b32 c, c, 0x00400040;
or.b32 a, a, b;
or.b32 a, a, c;
fma.rn.bf16x2 $3, a, $6, z;
}
""")
# As _SWZ_TO_BF16, for one 32-bit word of swizzled codes and its block scale as a BF16 pair, handed in
# as one 64-bit register $4 (low: codes, high: scale; `_swz_word_dequant`): no byte packing around the
# decode, and one operand, so codes and scales share a register layout. $5-$7 are $4 again (the pack of
# 4 is one word's 4 output lanes).
_SWZ_WORD_TO_BF16 = tl.constexpr("""
{
.reg .b32 w, s, a, b, c, z;
mov.b64 {w, s}, $4;
mov.b32 z, 0x80008000;
and.b32 a, w, 0x81C081C0;
fma.rn.bf16x2 $0, a, s, z;
shl.b32 a, w, 3;
and.b32 a, a, 0x81C081C0;
fma.rn.bf16x2 $1, a, s, z;
shl.b32 a, w, 6;
and.b32 a, a, 0x81C081C0;
fma.rn.bf16x2 $2, a, s, z;
shl.b32 a, w, 1;
and.b32 a, a, 0x80008000;
shr.b32 b, w, 3;
and.b32 b, b, 0x01800180;
shr.b32 c, w, 7;
and.b32 c, c, 0x00400040;
or.b32 a, a, b;
or.b32 a, a, c;
fma.rn.bf16x2 $3, a, s, z;
}
""")

C_SWZ_PORTABLE = tl.constexpr(1.1754943508222875e-38)  # 2**-126: S * 2**-126 = s8 * 2**-9, as the PTX makes
C_SWZ_MASK = tl.constexpr(0x81C081C0 - 2**32)  # fp4_swizzle.MASK as int32
C_SWZ_SIGNS = tl.constexpr(0x80008000 - 2**32)


# ----------------------------------------------------------------------------- register dequant


@triton.jit
def _bf16(x):
    """float32 -> BF16 rounded to nearest even (the interpreter's cast truncates: round by bits there)."""
    if C_INTERPRET:
        b = x.to(tl.int32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        x = ((b >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _e2m1_f32(c):
    """int32 E2M1 code (0..15) -> its float32 value, from the bits (no table, no division)."""
    i = c & 7
    mag = tl.where(i >= 2, (i + 252) << 22, tl.where(i == 1, 0x3F000000, 0))
    return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _nibbles(p, ASM: tl.constexpr, F32: tl.constexpr):
    """uint8 packed codes (any shape) -> (low, high) nibble values, exact, BF16 (float32 if F32)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_NIBBLES_TO_BF16, "=r,=r,=r,=r,r", [p],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        c = p.to(tl.int32)
        lo = _e2m1_f32(c & 15)
        hi = _e2m1_f32(c >> 4)
        if not F32:
            lo, hi = lo.to(tl.bfloat16), hi.to(tl.bfloat16)
    return lo, hi


@triton.jit
def _block_scales(s_bytes, R: tl.constexpr, NB: tl.constexpr, W: tl.constexpr, F32: tl.constexpr):
    """uint8 E4M3 scale bytes (R, NB) -> BF16 (float32 if F32) (R, NB * W), each scale repeated W times."""
    s = _e4m3_value(s_bytes.to(tl.int32))
    if not F32:
        s = s.to(tl.bfloat16)
    return tl.reshape(tl.broadcast_to(s[:, :, None], (R, NB, W)), (R, NB * W))


@triton.jit
def _swz_half_value(h):
    """BF16-positioned bits (sign 15, e1 e0 m at 8 7 6) of an int32 half -> the E2M1 value (float32)."""
    return _e2m1_f32(((h >> 12) & 8) | ((h >> 6) & 7))


@triton.jit
def _swz_nibbles(p, R: tl.constexpr, C: tl.constexpr):
    """Swizzled packed bytes (R, C) -> (even, odd) E2M1 values float32 (R, C), by the PTX's own bit
    operations on each 4-byte word (the portable path: interpreter, or the PTX switched off)."""
    b = tl.reshape(p.to(tl.int32), (R, C // 4, 2, 2))  # [.., i1, i0]: byte 2*i1 + i0 of a word
    x0, x1 = tl.split(b)  # bytes (0, 2), (1, 3)
    b0, b2 = tl.split(x0)
    b1, b3 = tl.split(x1)
    w = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    r0 = w & C_SWZ_MASK
    r1 = (w << 3) & C_SWZ_MASK
    r2 = (w << 6) & C_SWZ_MASK
    r3 = ((w << 1) & C_SWZ_SIGNS) | ((w >> 3) & 0x01800180) | ((w >> 7) & 0x00400040)
    # lane order within a word: (r0 low, r0 high, r1 low, r1 high) are the even codes k0, k2, k4, k6
    ev = tl.join(tl.join(_swz_half_value(r0), _swz_half_value(r1)),
                 tl.join(_swz_half_value(r0 >> 16), _swz_half_value(r1 >> 16)))
    od = tl.join(tl.join(_swz_half_value(r2), _swz_half_value(r3)),
                 tl.join(_swz_half_value(r2 >> 16), _swz_half_value(r3 >> 16)))
    return tl.reshape(ev, (R, C)), tl.reshape(od, (R, C))


@triton.jit
def _w_dequant(p, sb, R: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr, SWZ: tl.constexpr):
    """(even, odd) tiles (R, BK//2) of a weight: c * s8, or with SWZ (swizzled codes) c * s8 * 2**-9."""
    if SWZ:
        sbits = sb.to(tl.int32) * 16 + 30080  # BF16 bits of s8 * 2**117 (fp4_swizzle.scale_bytes)
        if ASM:
            s = tl.reshape(tl.broadcast_to(sbits.to(tl.int16).to(tl.bfloat16, bitcast=True)[:, :, None],
                                           (R, BK // 16, 8)), (R, BK // 2))
            ev, od = tl.inline_asm_elementwise(_SWZ_TO_BF16, "=r,=r,=r,=r,r,r,r", [p, s],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            sv = (sbits << 16).to(tl.float32, bitcast=True) * C_SWZ_PORTABLE
            s = tl.reshape(tl.broadcast_to(sv[:, :, None], (R, BK // 16, 8)), (R, BK // 2))
            ev, od = _swz_nibbles(p, R, BK // 2)
            ev, od = ev * s, od * s
            if not F32:
                ev, od = ev.to(tl.bfloat16), od.to(tl.bfloat16)
    else:
        ev, od = _fp4_dequant(p, sb, R, BK, ASM, F32)
    return ev, od


@triton.jit
def _four(x):
    """x (R, W) -> (R, W, 2, 2), each element four times, the copies adjacent in one thread (joins
    always add an in-thread dimension, where a broadcast's layout is the compiler's choice)."""
    x2 = tl.join(x, x)
    return tl.join(x2, x2)


@triton.jit
def _swz_word_dequant(w, sw):
    """(even, odd) BF16 tiles (R, 4W) of c * s8 * 2**-9 from swizzled code words w int32 (R, W) and
    each word's scale byte sw (R, W), by the PTX on whole words (`_w_dequant`'s SWZ path, unpacked)."""
    R: tl.constexpr = w.shape[0]
    W: tl.constexpr = w.shape[1]
    sbits = sw.to(tl.int64) * 16 + 30080  # BF16 bits of s8 * 2**117 (fp4_swizzle.scale_bytes)
    ws = (w.to(tl.int64) & 0xFFFFFFFF) | (sbits << 32) | (sbits << 48)
    ev, od = tl.inline_asm_elementwise(_SWZ_WORD_TO_BF16, "=r,=r,=r,=r,l,l,l,l", [_four(ws)],
                                       dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return tl.reshape(ev, (R, 4 * W)), tl.reshape(od, (R, 4 * W))


@triton.jit
def _fp4_load_words(c_ptr, s_ptr, rows, m2, sc, ss, k0, BK: tl.constexpr):
    """As `_fp4_load`, the codes as int32 words (R, BK//8) and the scale byte of each word (R, BK//8)
    (a block of 16 codes is two words; rows 4-byte aligned: sc, c_ptr multiples of 4 bytes)."""
    j = tl.arange(0, BK // 8)
    w = tl.load(c_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (sc // 4) + (k0 // 8 + j)[None, :],
                mask=m2, other=0)
    sb = _scale_load(s_ptr, rows, m2, ss, k0, BK)
    return w, tl.reshape(tl.join(sb, sb), (sb.shape[0], BK // 8))


@triton.jit
def _fp4_load(c_ptr, s_ptr, rows, m2, sc, ss, k0, BK: tl.constexpr):
    """Packed codes (R, BK//2) and scale bytes (R, BK//16) of columns k0..k0+BK of rows `rows` (mask m2 (R, 1))."""
    j = tl.arange(0, BK // 2)
    p = tl.load(c_ptr + rows[:, None] * sc + (k0 // 2 + j)[None, :], mask=m2, other=0)
    return p, _scale_load(s_ptr, rows, m2, ss, k0, BK)


@triton.jit
def _scale_load(s_ptr, rows, m2, ss, k0, BK: tl.constexpr):
    """E4M3 scale bytes (R, BK//16) of columns k0..k0+BK of rows `rows` (mask m2 (R, 1))."""
    jb = tl.arange(0, BK // 16)
    return tl.load(s_ptr + rows[:, None] * ss + (k0 // 16 + jb)[None, :], mask=m2, other=0)


@triton.jit
def _w_load(c_ptr, s_ptr, rows, m2, sc, ss, k0, BK: tl.constexpr, WORDS: tl.constexpr):
    """A weight tile's codes and scales as `_w_decode` takes them: `_fp4_load_words`' with WORDS, else `_fp4_load`'s."""
    if WORDS:
        p, sb = _fp4_load_words(c_ptr, s_ptr, rows, m2, sc, ss, k0, BK)
    else:
        p, sb = _fp4_load(c_ptr, s_ptr, rows, m2, sc, ss, k0, BK)
    return p, sb


@triton.jit
def _w_decode(p, sb, R: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr, SWZ: tl.constexpr,
              WORDS: tl.constexpr):
    """(even, odd) tiles of `_w_load`'s codes and scales: `_swz_word_dequant` with WORDS, else `_w_dequant`."""
    if WORDS:
        ev, od = _swz_word_dequant(p, sb)
    else:
        ev, od = _w_dequant(p, sb, R, BK, ASM, F32, SWZ)
    return ev, od


@triton.jit
def _fp4_load_tma(wd, s_ptr, row0, rows, m2, ss, k0, BK: tl.constexpr):
    """As `_fp4_load`, the codes by one TMA block load of rows row0..row0+R of the (E*O, K/2) descriptor."""
    return wd.load([row0, k0 // 2]), _scale_load(s_ptr, rows, m2, ss, k0, BK)


@triton.jit
def _fp4_dequant(p, sb, R: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr):
    """(even, odd) BF16 tiles (R, BK//2) of c * s8 from `_fp4_load`'s bytes."""
    s = _block_scales(sb, R, BK // 16, 8, F32)
    lo, hi = _nibbles(p, ASM, F32)
    return lo * s, hi * s


@triton.jit
def _mma(a, w, acc, SWAP: tl.constexpr):
    """acc += a @ w.T, or with SWAP the transposed product acc.T += w @ a.T (acc held as (BN, BM))."""
    # if/else, not an early return: the compiler also lowers the code after a constexpr-if's return
    if SWAP:
        acc = tl.dot(w, tl.trans(a), acc)
    else:
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _fp4_tile(c_ptr, s_ptr, rows, rmask, sc, ss, k0, BK: tl.constexpr, R: tl.constexpr, ASM: tl.constexpr,
              F32: tl.constexpr):
    """(even, odd) BF16 tiles (R, BK//2) of c * s8 for columns k0..k0+BK of packed rows `rows`."""
    p, sb = _fp4_load(c_ptr, s_ptr, rows, rmask[:, None], sc, ss, k0, BK)
    return _fp4_dequant(p, sb, R, BK, ASM, F32)


# ----------------------------------------------------------------------------- grouped GEMM


@triton.jit(do_not_specialize=["NOUT"])
def _grouped_gemm_kernel(
    a_ptr, as_ptr, ag_ptr, sa, sas,
    row_ptr,
    w_ptr, ws_ptr, wg_ptr, swe, swn, sse, ssn, wd, OW,
    offs_ptr, te_ptr, tm_ptr,
    out_ptr, so, sos, dst_ptr, gate_ptr,
    NOUT, K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, KSPAN: tl.constexpr,
    W_FP4: tl.constexpr, A_FP4: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr,
    SCATTER: tl.constexpr, OUT_F32: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr, PF: tl.constexpr,
    SWAP: tl.constexpr, TMA: tl.constexpr, SWZ: tl.constexpr, A_GS: tl.constexpr, GATE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    n0 = tl.program_id(0) * BN
    t = tl.program_id(1)
    if SPLIT > 1:  # split K: this program's KSPAN columns, its float32 partial to out[split] (see split_k_for)
        k_lo = tl.program_id(2) * KSPAN
        out_ptr += tl.program_id(2).to(tl.int64) * sos
    else:
        k_lo = 0
    e = tl.load(te_ptr + t)  # this program's (expert, row tile) from `row_tiles`; -1: no work
    m0 = tl.load(tm_ptr + t)
    end = tl.load(offs_ptr + tl.maximum(e, 0))
    cols = n0 + tl.arange(0, BN)
    cmask = cols < NOUT
    wrow = tl.where(cmask, cols, 0)  # int32 offsets inside one expert (64-bit pointers per element cost registers)
    w_e = w_ptr + e.to(tl.int64) * swe
    ws_e = ws_ptr + e.to(tl.int64) * sse
    if W_FP4:
        inv_gw = 1.0 / tl.load(wg_ptr + e)
        if SWZ:
            inv_gw = inv_gw * 512.0  # swizzled weights enter the dot as c * s8 * 2**-9
    else:
        inv_gw = 1.0
    if e >= 0:
        rows = m0 + tl.arange(0, BM)
        rmask = rows < end
        if GATHER:
            arow = tl.load(row_ptr + rows, mask=rmask, other=0)
        else:
            arow = tl.where(rmask, rows, 0)
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            acc2 = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc2 = tl.zeros((BM, BN), dtype=tl.float32)
        if W_FP4 and PF and not TMA:  # (TMA loads are pipelined by the compiler: no software prefetch)
            # software prefetch: the next K tile's packed bytes are loaded before this tile's dequant
            # (a memory-bound loop whose loads feed register math, not a dot, is not pipelined by Triton)
            cm2 = cmask[:, None]
            pw, sw = _fp4_load(w_e, ws_e, wrow, cm2, swn, ssn, k_lo, BK)
            pu, su = pw, sw
            if SWIGLU:
                pu, su = _fp4_load(w_e, ws_e, wrow + NOUT, cm2, swn, ssn, k_lo, BK)
        for kk in range(0, KSPAN, BK):  # (constant bounds: K - k_lo is not, and the interpreter wants ints)
            k0 = k_lo + kk
            if W_FP4:
                if TMA:
                    pw, sw = _fp4_load_tma(wd, ws_e, e * OW + n0, wrow, cmask[:, None], ssn, k0, BK)
                    pu, su = pw, sw
                    if SWIGLU:
                        pu, su = _fp4_load_tma(wd, ws_e, e * OW + NOUT + n0, wrow + NOUT, cmask[:, None], ssn, k0, BK)
                elif PF:
                    nxt = cm2 & (kk + BK < KSPAN)
                    pw_n, sw_n = _fp4_load(w_e, ws_e, wrow, nxt, swn, ssn, k0 + BK, BK)
                    pu_n, su_n = pw_n, sw_n
                    if SWIGLU:
                        pu_n, su_n = _fp4_load(w_e, ws_e, wrow + NOUT, nxt, swn, ssn, k0 + BK, BK)
                else:
                    pw, sw = _fp4_load(w_e, ws_e, wrow, cmask[:, None], swn, ssn, k0, BK)
                    pu, su = pw, sw
                    if SWIGLU:
                        pu, su = _fp4_load(w_e, ws_e, wrow + NOUT, cmask[:, None], swn, ssn, k0, BK)
                if A_FP4:
                    a_ev, a_od = _fp4_tile(a_ptr, as_ptr, arow, rmask, sa, sas, k0, BK, BM, ASM, F32)
                else:
                    kk = k0 + tl.arange(0, BK)
                    a = tl.load(a_ptr + arow[:, None] * sa + kk[None, :], mask=rmask[:, None], other=0.0)
                    if F32:
                        a = a.to(tl.float32)
                    a_ev, a_od = tl.split(tl.reshape(a, (BM, BK // 2, 2)))
                w_ev, w_od = _w_dequant(pw, sw, BN, BK, ASM, F32, SWZ)
                acc = _mma(a_ev, w_ev, acc, SWAP)
                acc = _mma(a_od, w_od, acc, SWAP)
                if SWIGLU:
                    u_ev, u_od = _w_dequant(pu, su, BN, BK, ASM, F32, SWZ)
                    acc2 = _mma(a_ev, u_ev, acc2, SWAP)
                    acc2 = _mma(a_od, u_od, acc2, SWAP)
                if PF and not TMA:
                    pw, sw, pu, su = pw_n, sw_n, pu_n, su_n
            else:
                kk = k0 + tl.arange(0, BK)
                a = tl.load(a_ptr + arow[:, None] * sa + kk[None, :], mask=rmask[:, None], other=0.0)
                wt = tl.load(w_e + wrow[:, None] * swn + kk[None, :], mask=cmask[:, None], other=0.0)
                if F32:
                    a, wt = a.to(tl.float32), wt.to(tl.float32)
                acc = tl.dot(a, tl.trans(wt), acc)
                if SWIGLU:
                    ut = tl.load(w_e + (wrow + NOUT)[:, None] * swn + kk[None, :], mask=cmask[:, None], other=0.0)
                    if F32:
                        ut = ut.to(tl.float32)
                    acc2 = tl.dot(a, tl.trans(ut), acc2)
        if SWAP:
            acc = tl.trans(acc)
            acc2 = tl.trans(acc2)
        scale = tl.zeros((BM,), dtype=tl.float32) + inv_gw
        if A_FP4 or A_GS:  # (A_GS: BF16 c * s8 activations whose per-row global scale is still to divide)
            scale = scale / tl.load(ag_ptr + arow, mask=rmask, other=1.0)
        acc = acc * scale[:, None]
        omask = rmask[:, None] & cmask[None, :]
        if SWIGLU:
            g = _bf16(acc).to(tl.float32)
            u = _bf16(acc2 * scale[:, None]).to(tl.float32)
            sg = _bf16(g / (1.0 + tl.exp(-g))).to(tl.float32)
            y = sg * u
        elif SCATTER:  # the expert output in BF16 (the model's rounding), times its gate in float32
            y = _bf16(acc).to(tl.float32)
            if GATE:
                y = y * tl.load(gate_ptr + rows, mask=rmask, other=0.0)[:, None]
        else:
            y = acc
        if SCATTER:
            orow = tl.load(dst_ptr + rows, mask=rmask, other=0)
        else:
            orow = rows
        optr = out_ptr + orow[:, None] * so + cols[None, :]
        if OUT_F32:
            tl.store(optr, y, mask=omask)
        else:
            tl.store(optr, _bf16(y), mask=omask)


@triton.jit
def _tiles_kernel(offs_ptr, te_ptr, tm_ptr, MAXT, E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr,
                  CH: tl.constexpr, PDL: tl.constexpr = False):
    """Program e < E lists (e, first row) of group e's BM-row tiles; program E writes -1 past the end.

    One program per group (not one for all): a single program's (tiles x groups) search took ~15 us
    a layer on the H100, a twentieth of a small-batch decode step over 48 layers."""
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    pid = tl.program_id(0)
    er = tl.arange(0, EP)
    ends = tl.load(offs_ptr + er, mask=er < E, other=0)
    starts = tl.load(offs_ptr + er - 1, mask=(er > 0) & (er < E), other=0)
    nt = tl.where(er < E, (ends - starts + BM - 1) // BM, 0)
    tend = tl.cumsum(nt, axis=0)
    c = tl.arange(0, CH)
    if pid < E:
        mine = er == pid
        n = tl.sum(tl.where(mine, nt, 0), axis=0)
        t0 = tl.sum(tl.where(mine, tend - nt, 0), axis=0)
        m0 = tl.sum(tl.where(mine, starts, 0), axis=0)
        i = 0
        while i < n:
            ok = i + c < n
            tl.store(te_ptr + t0 + i + c, tl.full((CH,), 0, tl.int32) + pid, mask=ok)
            tl.store(tm_ptr + t0 + i + c, m0 + (i + c) * BM, mask=ok)
            i += CH
    else:
        t = tl.sum(nt, axis=0)
        while t < MAXT:
            ok = t + c < MAXT
            tl.store(te_ptr + t + c, tl.full((CH,), -1, tl.int32), mask=ok)
            tl.store(tm_ptr + t + c, tl.full((CH,), 0, tl.int32), mask=ok)
            t += CH


def max_row_tiles(num_experts: int, n_rows: int, bm: int) -> int:
    """Static bound on the row tiles of `n_rows` rows in `num_experts` groups."""
    return min(num_experts, n_rows) + triton.cdiv(n_rows, bm)


def row_tiles(offsets: torch.Tensor, bm: int, max_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert int32 (max_tiles,), first row int32 (max_tiles,)) of the BM-row tiles of the groups
    `offsets` delimits, in expert order; entries past the last tile have expert -1. On the device,
    no host sync (so a CUDA graph can hold it); `max_tiles` from `max_row_tiles`."""
    E = offsets.numel()
    te = torch.empty(max_tiles, dtype=torch.int32, device=offsets.device)
    tm = torch.empty(max_tiles, dtype=torch.int32, device=offsets.device)
    _tiles_kernel[(E + 1,)](offsets, te, tm, max_tiles, E=E, EP=triton.next_power_of_2(E), BM=bm, CH=64,
                            num_warps=1 if E <= 256 else 4, **pdl.launch(offsets.device))
    return te, tm


# (w_fp4, a_fp4, swiglu) -> (BN, BK, num_warps[, num_stages]); benchmarks may fill it from a sweep
# (bench/rollout.py --micro, bench/gemm_profile.py)
TUNED: dict[tuple[bool, bool, bool], tuple[int, ...]] = {}
STAGES = 3  # software pipeline depth of the K loop when a config names none


def pick_bm(rows_per_group: float) -> int:
    """Row tile from the mean rows per expert: 16 at decode batches, larger when groups are large."""
    if rows_per_group <= 16:
        return 16
    if rows_per_group <= 40:
        return 32
    return 64


# FP4-weight GEMMs at large batches, per kind like TUNED: [(from rows per expert, (BM, BN, BK, num_warps,
# num_stages)), ...] ascending; below the first threshold pick_bm and TUNED hold. From the H100 sweep at
# 34 and 111 rows per expert (1k positions, 544 / 1776 rows; bench/results/gemm_large_h100.json): there
# wide weight tiles (BN 128) won every FP4 kind, and the fused SwiGLU GEMM wanted one 128-row tile per
# expert at 111 rows (its weights decoded once), the down GEMM 64 (-10% / -11% against the shipped
# tiles; BF16 weights keep theirs). The activations' format changes only the epilogue, so w4a16 takes
# w4a4's tiles.
_GU_LARGE = [(24.0, (32, 128, 128, 4, 2)), (80.0, (128, 128, 128, 8, 4))]
_DN_LARGE = [(24.0, (64, 128, 128, 4, 3))]
LARGE: dict[tuple[bool, bool, bool], list[tuple[float, tuple[int, ...]]]] = {
    (True, False, True): _GU_LARGE, (True, True, True): _GU_LARGE,
    (True, False, False): _DN_LARGE, (True, True, False): _DN_LARGE,
}


def gemm_config(kind: tuple[bool, bool, bool], rows_per_group: float) -> tuple[int, ...]:
    """(BM, BN, BK, num_warps, num_stages) of a GEMM of `kind` = (FP4 weights, FP4 activations, swiglu)
    at this mean of rows per expert: LARGE's last entry it reaches, else pick_bm's tile with TUNED's."""
    chosen = None
    for from_rows, config in LARGE.get(kind, ()):
        if rows_per_group > from_rows:
            chosen = config
    return chosen if chosen is not None else (pick_bm(rows_per_group), *_tuned_tile(kind))


def _tuned_tile(kind: tuple[bool, bool, bool]) -> tuple[int, int, int, int]:
    """(BN, BK, num_warps, num_stages) of `kind` from TUNED, else the shipped (64, 128, 4, STAGES)."""
    bn, bk, nw, *ns = TUNED.get(kind, (64, 128, 4))
    return bn, bk, nw, ns[0] if ns else STAGES


def grouped_gemm(
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
    rows_per_group: float | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    config: tuple[int, int, int, int] | None = None,
    a_dequant: torch.Tensor | None = None,
    split_k: int | None = 1,
) -> torch.Tensor:
    """Grouped GEMM of sorted rows against per-expert weights (see the module docstring).

    a: BF16 (R, K) or an NVFP4 FP4Tensor with per-row global scales (R, K). w: BF16 (E, O, K) or
    an NVFP4 FP4Tensor (E, O, K) with global scale (E,) / (E, 1, 1). offsets: int32 (E,).
    n_rows: sorted rows N (default R, or len(row_idx)). Returns (N, O) (swiglu: (N, O // 2)), or
    with dst_idx the `out` it scattered row n into at row dst_idx[n]: with gate (N,) float32 the float32
    BF16(y) * gate, without the BF16 y (half the bytes, for a consumer that applies the gates:
    `rollout.gpu.add_rmsnorm(gates=)` makes the same float32 products). tiles: (expert, first row, BM) from
    `row_tiles` (made here if None or of another BM than `config`'s; the decoder makes them once a
    layer for each BM its two GEMMs use).
    config = (BM, BN, BK, num_warps[, num_stages]) (default: `gemm_config` at rows_per_group, or with
    `tiles` of another BM, TUNED or (64, 128, 4) at theirs).
    a_dequant: with FP4 `a` and DEQUANT_A, its BF16 e2m1 * block scale (R, K) already made (by
    `fp4_quant.quantize(dequant_out=)` in the quantize pass), so no dequantize pass runs here.
    split_k: programs a (column tile, row tile) splits K over; each writes a float32 partial and
    `_split_sum_kernel` adds them in split order (deterministic; not with swiglu or dst_idx). None:
    `split_k_for` this launch, with the partials at most half the packed weights' bytes.
    """
    w_fp4 = isinstance(w, fp4.FP4Tensor)
    a_fp4 = isinstance(a, fp4.FP4Tensor)
    if a_fp4 and not w_fp4:
        raise ValueError("FP4 activations need FP4 weights (the w4a4 recipe)")
    E, O, K = w.shape
    if w_fp4:
        if w.fmt != "nvfp4":
            raise ValueError("grouped_gemm takes NVFP4 weights (blocks of 16, E4M3 scales)")
        wc = w.codes
        ws = w.scales.view(torch.uint8)  # (SwizzledFP4: already uint8 kernel scale bytes)
        wg = w.global_scale.reshape(E).to(torch.float32).contiguous()
        if wc.stride(-1) != 1 or ws.stride(-1) != 1:
            raise ValueError("weight codes and scales need a unit stride along K")
        swe, swn, sse, ssn = wc.stride(0), wc.stride(1), ws.stride(0), ws.stride(1)
    else:
        wc, ws, wg = w, w, w
        if w.stride(-1) != 1:
            raise ValueError("BF16 weights need a unit stride along K")
        swe, swn, sse, ssn = w.stride(0), w.stride(1), 0, 0
    kind = (w_fp4, a_fp4, swiglu)  # TUNED / KERNEL_VARIANT key: the formats as called
    prefetch, swap, tma = KERNEL_VARIANT.get(kind, (PREFETCH, SWAP_AB, TMA_W))
    swz = isinstance(w, SwizzledFP4)
    if swap and swz and USE_ASM:
        # the swizzled PTX decodes 4 bytes a thread holds as one 32-bit word; as the dot's left
        # operand the weight tile takes the MMA operand layout, whose 4 bytes a thread holds are not
        # one word (H100: outputs unrelated to the natural weights'), so the pair is refused
        raise ValueError("SWAP_AB does not run on swizzled FP4 weights: pass the natural FP4Tensor "
                         "(SwizzledFP4.natural()) or drop SWAP_AB for this GEMM kind (fp4_gemm.KERNEL_VARIANT)")
    a_gs = False
    if a_dequant is not None and not (a_fp4 and DEQUANT_A):
        raise ValueError("a_dequant goes with FP4 activations `a` while fp4_gemm.DEQUANT_A is on")
    if a_fp4 and DEQUANT_A:
        ag = a.global_scale.reshape(-1).to(torch.float32)
        if a_dequant is None:
            a = fp4_quant.dequantize(fp4.FP4Tensor(a.codes, a.scales, _ones(a.codes.device), a.fmt, a.shape))
        elif a_dequant.dtype != torch.bfloat16 or tuple(a_dequant.shape) != tuple(a.shape):
            raise ValueError(f"a_dequant must be BF16 {tuple(a.shape)}, got {a_dequant.dtype} {tuple(a_dequant.shape)}")
        else:
            a = a_dequant
        a = a.reshape(-1, K)
        a_fp4, a_gs = False, True
    if a_fp4:
        ac = a.codes.reshape(-1, K // 2)
        asc = a.scales.view(torch.uint8).reshape(-1, K // 16)
        ag = a.global_scale.reshape(-1).to(torch.float32)
        sa, sas = ac.stride(0), asc.stride(0)
    else:
        if a.dtype != torch.bfloat16 or a.shape[-1] != K or a.stride(-1) != 1:
            raise ValueError(f"a must be BF16 (R, {K}) with unit stride, got {a.dtype} {tuple(a.shape)}")
        ac, asc, sa, sas = a, a, a.stride(0), 0
        if not a_gs:
            ag = a
    R = ac.shape[0]
    N = n_rows if n_rows is not None else (row_idx.numel() if row_idx is not None else R)
    NOUT = O // 2 if swiglu else O
    scatter = dst_idx is not None
    if scatter:
        want = torch.float32 if gate is not None else torch.bfloat16
        if out is None or out.dtype != want:
            raise ValueError("scatter writes into `out`: float32 with gate (N,) float32 (BF16(y) * gate), BF16 "
                             f"without (y), got {None if out is None else out.dtype}")
        out_f32 = gate is not None
    elif out is None:
        out = torch.empty(N, NOUT, device=ac.device, dtype=torch.float32 if out_f32 else torch.bfloat16)
    if rows_per_group is None:
        rows_per_group = N / max(E, 1)
    if config is None:
        bm, bn, bk, nw, *ns = gemm_config(kind, rows_per_group)
        if tiles is not None and tiles[2] != bm:  # the caller's row tiles decide BM: TUNED's tiles at it
            bm, (bn, bk, nw, *ns) = tiles[2], _tuned_tile(kind)
        bk = bk if K % bk == 0 else 64
    else:
        bm, bn, bk, nw, *ns = config
    ns = ns[0] if ns else STAGES
    if K % bk or K % 16:
        raise ValueError(f"K={K} must be a multiple of the K tile {bk}")
    if tiles is None or tiles[2] != bm:
        tiles = (*row_tiles(offsets, bm, max_row_tiles(E, N, bm)), bm)
    steps = K // bk
    if split_k is None:
        w_bytes = E * O * K * 9 // 16 if w_fp4 else E * O * K * 2
        split_k = 1 if swiglu or scatter else split_k_for(
            triton.cdiv(NOUT, bn) * triton.cdiv(N, bm), steps, max_split=w_bytes // (8 * max(N, 1) * NOUT))
    if split_k < 1 or steps % split_k:
        raise ValueError(f"split_k={split_k}: choose a divisor of the {steps} K tiles of {bk} columns")
    kspan = K // split_k
    final = out
    if split_k > 1:
        if swiglu or scatter:
            raise ValueError("split_k > 1 is for plain products (no swiglu, no dst_idx): their epilogues "
                             "need the whole sum")
        out = torch.empty(split_k, N, NOUT, device=ac.device, dtype=torch.float32)
    dummy = offsets
    tma = tma and w_fp4
    wd = dummy
    if tma:
        if not wc.is_contiguous():
            raise ValueError("TMA weight loads need contiguous weight codes")
        from triton.tools.tensor_descriptor import TensorDescriptor
        wd = TensorDescriptor.from_tensor(wc.view(E * O, K // 2), [bn, bk // 2])
    grid = (triton.cdiv(NOUT, bn), tiles[0].numel(), split_k)
    _grouped_gemm_kernel[grid](
        ac, asc, ag, sa, sas,
        row_idx if row_idx is not None else dummy,
        wc, ws, wg, swe, swn, sse, ssn, wd, O,
        offsets, tiles[0], tiles[1],
        out, out.stride(-2), out.stride(0) if split_k > 1 else 0,
        dst_idx if scatter else dummy, gate if gate is not None and scatter else dummy,
        NOUT, K,
        BM=bm, BN=bn, BK=bk, SPLIT=split_k, KSPAN=kspan, W_FP4=w_fp4, A_FP4=a_fp4, GATHER=row_idx is not None,
        SWIGLU=swiglu, SCATTER=scatter, OUT_F32=out_f32 or split_k > 1, ASM=USE_ASM and w_fp4, F32=INTERPRET,
        PF=prefetch,
        SWAP=swap and w_fp4, TMA=tma, SWZ=swz, A_GS=a_gs, GATE=scatter and gate is not None, num_warps=nw,
        num_stages=ns,
        **pdl.launch(ac.device),
    )
    if split_k > 1:
        _split_sum_kernel[(N, triton.cdiv(NOUT, SPLIT_SUM_BLOCK))](
            out, out.stride(0), final, final.stride(0), NOUT, SPLIT=split_k, BLOCK=SPLIT_SUM_BLOCK,
            OUT_F32=final.dtype == torch.float32, num_warps=4, **pdl.launch(out.device))
    return final


SPLIT_SUM_BLOCK = 1024


@triton.jit
def _split_sum_kernel(ws_ptr, sws, out_ptr, so, NOUT, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                      OUT_F32: tl.constexpr, PDL: tl.constexpr = False):
    """out[r, c] = the split-K partials ws[:, r, c] summed in split order (float32), rounded once."""
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < NOUT
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + s * sws + r * NOUT + c, mask=m, other=0.0)
    if OUT_F32:
        tl.store(out_ptr + r * so + c, acc, mask=m)
    else:
        tl.store(out_ptr + r * so + c, _bf16(acc), mask=m)


# fp4_linear splits K where its output tiles alone leave most SMs idle: at decode batches a dense
# projection is one row tile, so o_proj (2048 outputs, BN 64) was 32 programs on 132 SMs streaming
# 4096 columns each, and the all-linear recipe ran slower than cuBLAS's BF16 (which splits K itself,
# `splitKreduce_kernel` in the profile). SPLIT_K switches it off for A/B.
SPLIT_K = True
SPLIT_K_PROGRAMS = 256  # the programs a split launch aims at (2 CTAs on each of the H100's 132 SMs)


def split_k_for(programs: int, k_steps: int, target: int | None = None, max_split: int | None = None) -> int:
    """K splits for a launch of `programs` (column tiles x row tiles) over `k_steps` K tiles: the largest
    divisor of k_steps that keeps programs x splits within `target` (default SPLIT_K_PROGRAMS), two K
    tiles a split and at most `max_split` splits; 1 if SPLIT_K is off."""
    if not SPLIT_K:
        return 1
    target = SPLIT_K_PROGRAMS if target is None else target
    cap = k_steps if max_split is None else max_split
    want = max(1, min(k_steps // 2, target // max(programs, 1), cap))
    return next(s for s in range(want, 0, -1) if k_steps % s == 0)


_ONES: dict[torch.device, torch.Tensor] = {}


def _ones(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on `device` (the global scale that makes `dequantize` return c * s8), made once."""
    if device not in _ONES:
        _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return _ONES[device]


def fp4_linear(x: torch.Tensor | fp4.FP4Tensor, w: fp4.FP4Tensor | torch.Tensor, out_f32: bool = False,
               split_k: int | None = None, a_dequant: torch.Tensor | None = None) -> torch.Tensor:
    """Dense y = x @ w.T with w NVFP4 (O, K) kept packed (one group); x BF16 (M, K) or NVFP4 per row.
    split_k: K splits (default `split_k_for` this launch: decode batches split, large ones do not);
    a_dequant: as `grouped_gemm`'s (FP4 x's c * s8, written by its quantize pass)."""
    w3 = w
    if isinstance(w, fp4.FP4Tensor):
        O, K = w.shape
        w3 = type(w)(w.codes.reshape(1, O, K // 2), w.scales.reshape(1, O, K // 16),  # (stays swizzled)
                     w.global_scale.reshape(1), w.fmt, torch.Size((1, O, K)))
    else:
        w3 = w.unsqueeze(0)
    M = x.shape[0]
    dev = x.codes.device if isinstance(x, fp4.FP4Tensor) else x.device
    offsets = torch.full((1,), M, dtype=torch.int32, device=dev)
    return grouped_gemm(x, w3, offsets, out_f32=out_f32, rows_per_group=M, split_k=split_k, a_dequant=a_dequant)


# ----------------------------------------------------------------------------- self-check


def selfcheck(device: torch.device | str = "cuda") -> str:
    """Run the PTX nibble path against the portable one once on `device`; disable it if they differ.

    Returns a short status line ('asm ok', 'asm off: <reason>', 'portable (interpreter)').
    """
    global USE_ASM
    if INTERPRET:
        return "portable (interpreter)"
    if not USE_ASM:
        return "asm off"
    g = torch.Generator(device="cpu").manual_seed(1)
    E, O, K, R = 3, 64, 256, 40
    w = fp4.quantize(torch.randn(E, O, K, generator=g), "nvfp4", global_scale=torch.ones(E, 1, 1))
    w = fp4.FP4Tensor(w.codes.to(device), w.scales.to(device), torch.ones(E, device=device), "nvfp4", w.shape)
    a = torch.randn(R, K, generator=g).to(device=device, dtype=torch.bfloat16)
    offs = torch.tensor([10, 25, 40], dtype=torch.int32, device=device)
    try:
        y_asm = grouped_gemm(a, w, offs, out_f32=True)
        USE_ASM = False
        y_ref = grouped_gemm(a, w, offs, out_f32=True)
    except Exception as e:  # a PTX or lowering error: keep the portable path
        USE_ASM = False
        return f"asm off: {type(e).__name__}: {str(e)[:200]}"
    if torch.equal(y_asm, y_ref):
        USE_ASM = True
        return "asm ok"
    return f"asm off: differs from the portable path (max abs diff {(y_asm - y_ref).abs().max().item():.3g})"


SWIZZLE = True  # the decoder stores FP4 weights swizzled (fp4_swizzle.py) where `swizzle_check` passes
_SWIZZLE_STATUS: dict[str, str] = {}


def swizzle_check(device: torch.device | str = "cuda") -> str:
    """Run the GEMM on swizzled weights against the same GEMM on natural ones, once per device type.

    'swizzle ok' when every output is equal bit for bit (float32 and SwiGLU outputs, the current
    nibble path, each kernel variant a tuner may pick); else 'swizzle off: <reason>', and
    `for_kernels` keeps weights natural. The PTX assumes each 4-byte group it is handed is one word
    of the row (the compiler's register layout): this is what catches a compiler that groups bytes
    otherwise (as it does for SWAP_AB's MMA operand layout, which grouped_gemm therefore refuses).
    """
    kind = torch.device(device).type
    if kind in _SWIZZLE_STATUS:
        return _SWIZZLE_STATUS[kind]
    if kind == "cpu" and not INTERPRET:
        return "swizzle off: the kernels run on CUDA or in the interpreter"
    g = torch.Generator(device="cpu").manual_seed(2)
    E, O, K, R = 3, 64, 256, 40
    w = fp4.quantize(torch.randn(E, O, K, generator=g) * 0.02, "nvfp4",
                     global_scale=torch.tensor([900.0, 3000.0, 17.0]).reshape(E, 1, 1)).to(device)
    sw = SwizzledFP4.of(w)
    a = torch.randn(R, K, generator=g).to(device=device, dtype=torch.bfloat16)
    offs = torch.tensor([10, 25, 40], dtype=torch.int32, device=device)
    saved = dict(KERNEL_VARIANT)
    try:
        same = True
        # every variant a tuner may pick for swizzled weights (SWAP_AB refuses them: grouped_gemm)
        for flags in ((False, False, False), (True, False, False), (False, False, True)):
            KERNEL_VARIANT[(True, False, False)] = KERNEL_VARIANT[(True, False, True)] = flags
            same = same and all(torch.equal(grouped_gemm(a, w, offs, **kw), grouped_gemm(a, sw, offs, **kw))
                                for kw in ({"out_f32": True}, {"swiglu": True}))
    except Exception as e:  # a PTX or lowering error: keep natural weights
        status = f"swizzle off: {type(e).__name__}: {str(e)[:200]}"
    else:
        status = "swizzle ok" if same else "swizzle off: differs from natural weights"
    finally:
        KERNEL_VARIANT.clear()
        KERNEL_VARIANT.update(saved)
    _SWIZZLE_STATUS[kind] = status
    return status


def for_kernels(w):
    """A weight as the decode GEMMs read it fastest: NVFP4 swizzled when SWIZZLE and `swizzle_check`
    passed on its device; anything else unchanged."""
    if (not SWIZZLE or not isinstance(w, fp4.FP4Tensor) or isinstance(w, SwizzledFP4) or w.fmt != "nvfp4"
            or w.codes.shape[-1] % 4):
        return w
    if swizzle_check(w.codes.device) != "swizzle ok":
        return w
    try:
        return SwizzledFP4.of(w)
    except ValueError:  # a negative or NaN block scale (a broken checkpoint): keep the natural layout
        return w


# ----------------------------------------------------------------------------- routing and dispatch


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, gate_ptr, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                  NORM: tl.constexpr, PDL: tl.constexpr = False):
    """One token: softmax over E router logits (float32), top-K by repeated argmax, gate weights."""
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    lg = tl.load(logits_ptr + t * E + e, mask=e < E, other=float("-inf"))
    p = tl.exp(lg - tl.max(lg, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < E, p, -1.0)
    total = 0.0
    for k in tl.static_range(K):
        i = tl.argmax(p, axis=0)
        v = tl.max(p, axis=0)
        tl.store(ids_ptr + t * K + k, i.to(tl.int32))
        tl.store(gate_ptr + t * K + k, v)
        total += v
        p = tl.where(e == i, -1.0, p)
    if NORM:
        kk = tl.arange(0, K)
        g = tl.load(gate_ptr + t * K + kk)
        tl.store(gate_ptr + t * K + kk, g / total)


@triton.jit
def _dispatch_kernel(ids_ptr, gate_ptr, offs_ptr, tok_ptr, pair_ptr, gsort_ptr, N, NCH,
                     K: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, C: tl.constexpr, NP: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Sort (token, slot) pairs by expert, stably; program p places chunk p of C pairs.

    Every program histograms all pairs, so it knows each expert's start and how many of its pairs
    earlier chunks hold; within the chunk the rank comes from a one-hot cumsum. NP > 0: all N <= NP
    pairs in one tile (two histograms); 0: chunk by chunk (a serial loop of NCH steps per program,
    which at N = 2048 already took ~13 us a call on the H100).
    """
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    p = tl.program_id(0)
    er = tl.arange(0, EP)
    if NP > 0:
        i = tl.arange(0, NP)
        m = i < N
        ids = tl.load(ids_ptr + i, mask=m, other=0)
        tot = tl.histogram(ids, EP, mask=m)
        before = tl.histogram(ids, EP, mask=m & (i < p * C))
    else:
        tot = tl.zeros((EP,), tl.int32)
        before = tl.zeros((EP,), tl.int32)
        c = 0
        while c < NCH:  # (the interpreter cannot range() over runtime bounds)
            i = c * C + tl.arange(0, C)
            m = i < N
            ids = tl.load(ids_ptr + i, mask=m, other=0)
            h = tl.histogram(ids, EP, mask=m)
            tot += h
            before += h * (c < p).to(tl.int32)
            c += 1
    ends = tl.cumsum(tot, axis=0)
    if p == 0:
        tl.store(offs_ptr + er, ends, mask=er < E)
    i = p * C + tl.arange(0, C)
    m = i < N
    ids = tl.load(ids_ptr + i, mask=m, other=0)
    onehot = ((ids[:, None] == er[None, :]) & m[:, None]).to(tl.int32)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    base = tl.sum(onehot * (ends - tot + before)[None, :], axis=1)
    dst = base + rank
    tl.store(tok_ptr + dst, i // K, mask=m)
    tl.store(pair_ptr + dst, i, mask=m)
    tl.store(gsort_ptr + dst, tl.load(gate_ptr + i, mask=m, other=0.0), mask=m)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int32 (T, K), gate weights float32 (T, K)) from router logits float32 (T, E).

    Experts by the top-k of softmax(logits), in descending order (as torch.topk); gates are those
    probabilities, renormalised to sum 1 when norm_topk_prob (model/moe.py `gate_weights`).
    """
    T, E = logits.shape
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    gates = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T:
        # one warp a token up to 256 experts: the 2 + 2K reductions of a row then stay in warp shuffles
        # (four warps meet in shared memory at each; 0.73 ms of a 1776-row step on the H100 with four)
        ep = triton.next_power_of_2(E)
        _route_kernel[(T,)](logits.contiguous(), ids, gates, E=E, EP=ep, K=top_k, NORM=norm_topk_prob,
                            num_warps=1 if ep <= 256 else 4, **pdl.launch(logits.device))
    return ids, gates


# dispatch: every program histograms all pairs in one tile up to this many (2048 slots x top-8), not
# chunk by chunk; DISPATCH_ONE_TILE off: the chunk loop (kept for N above the tile and for A/B)
DISPATCH_ONE_TILE = True
DISPATCH_TILE_MAX = 16384


def dispatch(ids: torch.Tensor, gates: torch.Tensor, num_experts: int, offsets: torch.Tensor | None = None):
    """Group (token, slot) pairs by expert: (offsets int32 (E,), token of each sorted row int32 (N,),
    pair index t*K+k of each sorted row int32 (N,), gate of each sorted row float32 (N,)).

    Stable (pairs of one expert keep their order), like argsort(stable=True) in model/moe.py.
    `offsets` may be a preallocated (E,) int32 view (e.g. one row of a per-layer record).
    """
    T, K = ids.shape
    N = T * K
    dev = ids.device
    if offsets is None:
        offsets = torch.empty(num_experts, dtype=torch.int32, device=dev)
    tok = torch.empty(N, dtype=torch.int32, device=dev)
    pair = torch.empty(N, dtype=torch.int32, device=dev)
    gsort = torch.empty(N, dtype=torch.float32, device=dev)
    C = 64 if N <= 4096 else (128 if N <= 16384 else 256)
    nch = triton.cdiv(N, C)
    if N:
        np_ = triton.next_power_of_2(N) if DISPATCH_ONE_TILE and N <= DISPATCH_TILE_MAX else 0
        _dispatch_kernel[(nch,)](ids.reshape(-1), gates.reshape(-1), offsets, tok, pair, gsort, N, nch,
                                 K=K, E=num_experts, EP=triton.next_power_of_2(num_experts), C=C, NP=np_,
                                 num_warps=4 if C <= 64 else 8, **pdl.launch(ids.device))
    return offsets, tok, pair, gsort
