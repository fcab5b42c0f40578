"""Decode attention over a swizzled FP4 KV cache, decoding K/V straight into tensor-core operands (Gluon).

Why: the Triton kernel in fp4_attention.py decodes each K/V tile in a blocked layout and the compiler
restages both dots' operands through shared memory (store, barrier, ldmatrix), which with the online
softmax is most of its ~780 instructions a tile: it streams 0.36-0.41 of the copy bandwidth at the
largest batches, where attention is most of the step (bench/RESULTS.md). Here the layouts are explicit
(Gluon): every thread loads exactly the code words whose values its `mma.sync` fragments hold, decodes
them in registers (fp4_gemm's word PTX) and feeds the MMAs with no shared memory and no barrier.

One warp per program (row, KV head, split), as fp4_attention's programs, writing the same partials
(o, m, l) for the same `_merge_kernel`. Orientation (m16n8k16, BF16 in, float32 accumulate):
- scores s (16, BT) = q (16 rows: the G <= 8 query heads, zero-padded) @ K^T (128, BT);
- o^T (128, 8) += V^T (128, BT) @ P^T (BT, 8): the score accumulator's rows 0-7 *are* the P^T
  operand's fragment layout (no data movement), and the 8 query heads fill N = 8 exactly.
The contraction order of q . k is free, so the head dim is permuted to the order in which the decoded
registers arrive (`k_perm`; q is gathered by it once a program); V's output dim likewise (`v_perm`,
undone at the store). Only V^T needs an in-thread repack (its operand pairs positions, the decode pairs
head-dim elements). Values are the same products as the Triton kernel's (exact c * s8 * 2**-9 in BF16),
summed in another order, and P is p * (1/gv) rounded to BF16 where the Triton kernel rounds p / gv:
the two agree to ~1e-3 relative, not bit for bit (both within 8e-3 of the reference).

Two orientations of the QK dot (`launch(rows=...)`):
- "heads" (above; run and checked on the H100): q's 8 heads are padded to the MMA's 16 rows, so half
  the QK MMAs and half the score registers are zeros, and the compiler rematerializes the zero rows before
  every MMA (~120 moves a tile pair in the sm_90 SASS).
- "positions": s^T (BT, 8) = K (BT, 128) @ q^T (128, 8): positions fill M, the heads N = 8 with no padding,
  K's decoded registers are the A fragments as they come (the same thread -> word assignment), q^T the B
  fragments (16 registers instead of 32). The scores then have positions on rows, so P is turned into
  the PV dot's B fragments by one `movmatrix.trans` an 8x8 block; the softmax runs in log2 units with the
  approximate MUFU rcp / ex2 (the IEEE division and exp2 add range checks: ~8 instructions each), the
  softmax sum stays a per-thread partial until the end, and V's code words are re-paired by position
  before the decode (two prmt a word pair instead of the repack after it: `_decode_pairs`). sm_90 SASS
  (`scratch/mma_sass.py`, BT = 16): 488 instructions a 16-position tile instead of 655, 154 registers
  (144 with no spills under maxnreg=144: 14 one-warp programs an SM instead of 12). Compiled for sm_90
  on CPU (tests/hopper_compile.py) and its index algebra emulated op for op in torch
  (test_mma_positions_index_algebra); not yet run on a GPU, so the decoder's default stays "heads" and the tuner
  (`bench/attention_profile.py --sweep`, `bench/rollout.py --micro`) takes "positions" only where its
  output agrees with the default kernel's (`rel_to_default`).

Limits (checked by `supported`): swizzled FP4 cache, head dim 128, G = H / Hkv <= 8, CUDA (Gluon has no
interpreter: the CPU tests compile it for sm_90, the GPU tests run it against the reference).
"""

from __future__ import annotations

import re

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from tracerl.kernels.fp4_gemm import _SWZ_WORD_TO_BF16

DH = 128  # head dim this kernel's bit layout is written for (16 code words a row)
WORDS = DH // 8
NV = (0, 2, 4, 6, 1, 3, 5, 7)  # natural code index of each of a word's 8 decoded values (fp4_swizzle)

# fp4_gemm._SWZ_WORD_TO_BF16 (derived from it, so the two decodes cannot drift apart) with the word and
# its scale (BF16 bits in both halves) as two operands instead of one 64-bit pair, and the 4 output
# registers as one 8-value output: pack=8, so $4..$11 are 8 copies of the word and $12..$19 of the
# scale (the copies are one register; only $4 and $12 are read)
def _two_operand_word_asm(src: str) -> str:
    """The word PTX with its 64-bit {w, s} operand $4 split into operands $4 (w) and $12 (s)."""
    lines = []
    for line in src.splitlines():
        if line.startswith("mov.b64"):
            continue  # w and s arrive as operands
        if line.startswith(".reg"):
            line = ".reg .b32 " + ", ".join(n for n in line[len(".reg .b32 "):].rstrip(";").split(", ")
                                            if n not in ("w", "s")) + ";"
        else:
            line = re.sub(r"\bs\b", "$12", re.sub(r"\bw\b", "$4", line))
        lines.append(line)
    return "\n".join(lines)


_WORD8_ASM = gl.constexpr(_two_operand_word_asm(_SWZ_WORD_TO_BF16.value))


def k_perm() -> list[int]:
    """Head-dim index of each contraction position k = 32 wl + 8 o + 2 j + e of the QK dot."""
    out = []
    for k in range(DH):
        wl, o, j, e = k // 32, (k // 8) % 4, (k // 2) % 4, k % 2
        out.append(8 * (4 * j + wl) + NV[2 * o + e])
    return out


def v_perm() -> list[int]:
    """Head-dim index of each output row dd = 64 wl + 16 o + 8 e + r of the PV dot."""
    out = []
    for dd in range(DH):
        wl, o, e, r = dd // 64, (dd // 16) % 4, (dd // 8) % 2, dd % 8
        out.append(8 * (2 * r + wl) + NV[2 * o + e])
    return out


def _bits(n: int) -> list[int]:
    return [1 << i for i in range(max(0, n.bit_length() - 1))]


def k_layout(bt: int) -> gl.DistributedLinearLayout:
    """(BT, 16 words, 8 values) of K: thread (r, j) holds words 4j..4j+3 of positions r + 8x; the
    values in the order the QK dot's B fragments take them."""
    v = [[0, 0, 1], [0, 0, 2], [0, 0, 4]]
    wl = [[0, 1, 0], [0, 2, 0]]
    t_reg = [[8 * b, 0, 0] for b in _bits(bt // 8)]
    lanes = [[0, 4, 0], [0, 8, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    return gl.DistributedLinearLayout(v + wl + t_reg, lanes, [], [], [bt, WORDS, 8])


def v_layout(bt: int) -> gl.DistributedLinearLayout:
    """(BT, 16 words, 8 values) of V: thread (r, j) holds words 2r, 2r+1 of positions 2j + {0, 1} + 8x."""
    v = [[0, 0, 1], [0, 0, 2], [0, 0, 4]]
    wl = [[0, 1, 0]]
    t_reg = [[1, 0, 0]] + [[8 * b, 0, 0] for b in _bits(bt // 8)]
    lanes = [[2, 0, 0], [4, 0, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0]]
    return gl.DistributedLinearLayout(v + wl + t_reg, lanes, [], [], [bt, WORDS, 8])


def v_pair_layout(bt: int) -> gl.DistributedLinearLayout:
    """(BT/2 position pairs, 16 words, 2 half-words, 8 values) of V in `_decode_pairs`: the threads
    of v_layout, each 32-bit register of the decode now two positions of one head-dim element."""
    v = [[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]]
    regs = [[0, 0, 1, 0], [0, 1, 0, 0]] + [[4 * b, 0, 0, 0] for b in _bits(bt // 8)]
    lanes = [[1, 0, 0, 0], [2, 0, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0], [0, 8, 0, 0]]
    return gl.DistributedLinearLayout(v + regs, lanes, [], [], [bt // 2, WORDS, 2, 8])


def v_pair_perm() -> list[int]:
    """Head-dim index of each output row R = 32 i + 16 h + 8 wl + wh of the paired PV dot (word 2 wh + wl,
    half-word h, its i-th code: NV[2 i + h])."""
    out = []
    for r in range(DH):
        wh, wl, h, i = r % 8, (r // 8) % 2, (r // 16) % 2, r // 32
        out.append(8 * (2 * wh + wl) + NV[2 * i + h])
    return out


def s8_layout(bt: int) -> gl.DistributedLinearLayout:
    """(8 heads, BT) of the score accumulator's rows 0-7 (= the P^T operand's fragments, transposed)."""
    t_reg = [[0, 1]] + [[0, 8 * b] for b in _bits(bt // 8)]
    lanes = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(t_reg, lanes, [], [], [8, bt])


def k_scale_layout(bt: int) -> gl.DistributedLinearLayout:
    """(BT, 8 blocks) of K's scale bytes: thread (r, j) holds blocks 2j, 2j+1 (its words' blocks)."""
    t_reg = [[8 * b, 0] for b in _bits(bt // 8)]
    return gl.DistributedLinearLayout([[0, 1]] + t_reg, [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [], [], [bt, 8])


def v_scale_layout(bt: int) -> gl.DistributedLinearLayout:
    """(BT, 8 blocks) of V's scale bytes: thread (r, j) holds block r of its positions."""
    t_reg = [[1, 0]] + [[8 * b, 0] for b in _bits(bt // 8)]
    return gl.DistributedLinearLayout(t_reg, [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], [], [], [bt, 8])


LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _rcp(x):
    """1 / x (float32, approximate: one MUFU.RCP; the IEEE division is ~8 instructions with its range checks)."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _ex2(x):
    """2 ** x (float32, one MUFU.EX2; results below 2**-126 flush to 0, far below what BF16 P or the sums see)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _transpose8(p, OPB: gl.constexpr):
    """P (BT, 8) BF16 in the score accumulator's layout (positions on rows) as the PV dot's B operand: one
    `movmatrix.trans` an 8x8 block, which turns the accumulator fragment (row lane/4, columns 2 (lane%4) + e)
    into the B fragment (k = 2 (lane%4) + e, n = lane/4)."""
    BT: gl.constexpr = p.shape[0]
    y = gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [p], dtype=gl.bfloat16,
                                  is_pure=True, pack=2)
    # y[8 b + i, j] holds P[8 b + j, i]: undo the transpose in the indices (a relabelling of registers)
    y = gl.permute(gl.reshape(y, [BT // 8, 8, 8]), [0, 2, 1])
    return gl.convert_layout(gl.reshape(y, [BT, 8]), OPB, assert_trivial=True)


@gluon.jit
def _decode_words(cw, s2, L3: gl.constexpr):
    """BF16 (BT, 16, 8) of c * s8 * 2**-9 from code words cw int32 (BT, 16) and their scales s2 (BF16
    bits in both halves, int32 (BT, 16))."""
    BT: gl.constexpr = cw.shape[0]
    w3 = gl.convert_layout(gl.expand_dims(cw, 2), L3).broadcast_to(BT, 16, 8)
    s3 = gl.convert_layout(gl.expand_dims(s2, 2), L3).broadcast_to(BT, 16, 8)
    return gl.inline_asm_elementwise(_WORD8_ASM, "=r,=r,=r,=r" + ",r" * 16, [w3, s3], dtype=gl.bfloat16,
                                     is_pure=True, pack=8)


@gluon.jit
def _prmt(a, b, SEL: gl.constexpr):
    """The bytes of a (0-3) and b (4-7) that SEL's four nibbles pick (PTX prmt, one instruction)."""
    return gl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SEL};", "=r,r,r", [a, b], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _decode_pairs(cw, s2, LP: gl.constexpr):
    """BF16 (BT/2, 16, 2, 8) of V from its code words cw and per-word scale pairs s2 (both int32 (BT, 16),
    v_layout's threads): each word pair (positions 2q, 2q+1) becomes one word of their low half-words and
    one of their high ones, each with the scale pair (s_2q, s_2q+1), so every decoded 32-bit register is
    (position 2q, position 2q+1) of one head-dim element."""
    BT: gl.constexpr = cw.shape[0]
    we, wo = gl.split(gl.permute(gl.reshape(cw, [BT // 2, 2, 16]), [0, 2, 1]))
    se, so = gl.split(gl.permute(gl.reshape(s2, [BT // 2, 2, 16]), [0, 2, 1]))
    sp = (se & 0xFFFF) | (so & -65536)  # s2 holds each scale in both halves
    w = gl.join(_prmt(we, wo, 0x5410), _prmt(we, wo, 0x7632))  # (BT/2, 16, 2): low, high half-words
    L3: gl.constexpr = gl.SliceLayout(3, LP)
    w4 = gl.convert_layout(gl.expand_dims(gl.convert_layout(w, L3), 3), LP).broadcast_to(BT // 2, 16, 2, 8)
    s4 = gl.convert_layout(gl.expand_dims(gl.convert_layout(gl.join(sp, sp), L3), 3), LP)
    s4 = s4.broadcast_to(BT // 2, 16, 2, 8)
    return gl.inline_asm_elementwise(_WORD8_ASM, "=r,=r,=r,=r" + ",r" * 16, [w4, s4], dtype=gl.bfloat16,
                                     is_pure=True, pack=8)


@gluon.jit
def _load_tile(cw_ptr, s_ptr, g_ptr, t, t1, sct4, sst, sgt, BT: gl.constexpr, L3: gl.constexpr,
               LS: gl.constexpr, GL: gl.constexpr):
    """Code words (BT, 16) int32, their scales as BF16 bit pairs (BT, 16) int32 (both in L3's slice) and
    row global scales (BT,) in GL of positions t..t+BT (masked at t1: codes 0, global scale 1)."""
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    ts = t + gl.arange(0, BT, layout=gl.SliceLayout(1, L2))
    tm = ts < t1
    w = gl.arange(0, 16, layout=gl.SliceLayout(0, L2))
    cw = gl.load(cw_ptr + gl.where(tm, ts, 0)[:, None] * sct4 + w[None, :], mask=tm[:, None], other=0)
    tb = t + gl.arange(0, BT, layout=gl.SliceLayout(1, LS))
    bm = tb < t1
    blk = gl.arange(0, 8, layout=gl.SliceLayout(0, LS))
    sb = gl.load(s_ptr + gl.where(bm, tb, 0)[:, None] * sst + blk[None, :], mask=bm[:, None], other=0)
    # kernel scale byte -> BF16 bits of s8 * 2**117 (fp4_swizzle.scale_bytes), in both halves
    sbits = sb.to(gl.uint32) * 16 + 30080
    s2 = (sbits | (sbits << 16)).to(gl.int32, bitcast=True)
    s2 = gl.convert_layout(gl.reshape(gl.join(s2, s2), [BT, 16]), L2, assert_trivial=True)
    tg = t + gl.arange(0, BT, layout=GL)
    gm = tg < t1
    gs = gl.load(g_ptr + gl.where(gm, tg, 0) * sgt, mask=gm, other=1.0)
    return cw, s2, gs


@gluon.jit
def _attend_tile(q, kw, ks2, gk, vw, vs2, gv, t, t1, m_i, l_i, acc, sm_scale, BT: gl.constexpr,
                 LK: gl.constexpr, LV: gl.constexpr, L8: gl.constexpr):
    """One BT-position tile: the updated (m, l, acc) of the online softmax."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    OPB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    GS: gl.constexpr = gl.SliceLayout(0, MMA)
    # K^T (128, BT): the decoded values land in the B fragments' registers as they are
    kd = gl.permute(gl.reshape(_decode_words(kw, ks2, LK), [BT, 4, 4, 4, 2]), [2, 3, 1, 4, 0])
    kt = gl.convert_layout(gl.reshape(kd, [128, BT]), OPB, assert_trivial=True)
    s = mma_v2(q, kt, gl.full([16, BT], 0.0, gl.float32, layout=MMA))
    tcol = t + gl.arange(0, BT, layout=GS)
    # swizzled K enters the dot as c * s8 * 2**-9: a power of two, so the scores are the Triton kernel's
    s = gl.where((tcol < t1)[None, :], s * ((sm_scale * 512.0) / gk)[None, :], float("-inf"))
    s8 = _rows8(s, L8)
    r8 = _rows8(gl.full([16, BT], 0.0, gl.float32, layout=MMA) + (1.0 / gv)[None, :], L8)
    m_new = gl.maximum(m_i, gl.max(s8, axis=1))
    alpha = gl.exp(m_i - m_new)
    p = gl.exp(s8 - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    pt = gl.convert_layout(gl.permute((p * r8).to(gl.bfloat16), [1, 0]), OPB, assert_trivial=True)
    # V^T (128, BT): the decode pairs head-dim values, the A fragments pair positions (an in-thread repack)
    vd = gl.permute(gl.reshape(_decode_words(vw, vs2, LV), [BT, 8, 2, 4, 2]), [2, 3, 4, 1, 0])
    vt = gl.convert_layout(gl.reshape(vd, [128, BT]), OPA)
    # rescale only when a row's running max moved (later tiles rarely move it): alpha is exactly 1 else
    if gl.max((m_new > m_i).to(gl.int32), axis=0) > 0:
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, MMA))[None, :]
    return m_new, l_i, mma_v2(vt, pt, acc)


@gluon.jit
def _attend_tile_pos(qt, kw, ks2, gk, vw, vs2, gv, t, t1, m_i, l_acc, acc, qk_scale, BT: gl.constexpr,
                     LK: gl.constexpr, LVP: gl.constexpr):
    """As `_attend_tile` with positions on the score rows: the updated (m (log2 units), partial l, acc)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    OPB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    # s^T (BT, 8) = K (BT, 128) @ q^T: positions fill M (no padded query rows), the <= 8 query heads N
    kd = gl.permute(gl.reshape(_decode_words(kw, ks2, LK), [BT, 4, 4, 4, 2]), [0, 2, 3, 1, 4])
    ka = gl.convert_layout(gl.reshape(kd, [BT, 128]), OPA, assert_trivial=True)
    s = mma_v2(ka, qt, gl.full([BT, 8], 0.0, gl.float32, layout=MMA))
    rows = t + gl.arange(0, BT, layout=ROW)
    # swizzled K enters the dot as c * s8 * 2**-9; the scores in log2 units
    s = gl.where((rows < t1)[:, None], s * (qk_scale * _rcp(gk))[:, None], float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = _ex2(m_i - m_new)
    p = _ex2(s - m_new[None, :])
    l_acc = l_acc * alpha[None, :] + p  # per-thread partial sums, reduced once after the loop
    pt = _transpose8((p * _rcp(gv)[:, None]).to(gl.bfloat16), OPB)
    # V^T (128, BT): the A fragments pair positions; the words are re-paired by position before the decode
    # (v_pair_layout), so its registers are those fragments (rows in v_pair_perm order)
    vd = gl.reshape(_decode_pairs(vw, vs2, LVP), [BT // 2, 8, 2, 2, 4, 2])  # (q, wh, wl, h, i, e)
    vt = gl.convert_layout(gl.reshape(gl.permute(vd, [4, 3, 2, 1, 0, 5]), [128, BT]), OPA, assert_trivial=True)
    # rescale only when a head's running max moved (later tiles rarely move it): alpha is exactly 1 else
    if gl.max((m_new > m_i).to(gl.int32), axis=0) > 0:
        acc = acc * alpha[None, :]
    return m_new, l_acc, mma_v2(vt, pt, acc)


@gluon.jit
def _mma_attn_kernel(
    q_ptr, sqb, kc_ptr, ks_ptr, kg_ptr, vc_ptr, vs_ptr, vg_ptr, scb4, sct4, ssb, sst, sgb, sgt,
    len_ptr, po_ptr, pml_ptr, out_ptr, permk_ptr, permv_ptr, sm_scale, S, SPLIT_LEN,
    H: gl.constexpr, G: gl.constexpr, BT: gl.constexpr,
    LK: gl.constexpr, LV: gl.constexpr, LKS: gl.constexpr, LVS: gl.constexpr, L8: gl.constexpr,
    LVP: gl.constexpr, FINAL: gl.constexpr, POS: gl.constexpr, HEADS_FIRST: gl.constexpr,
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    OPB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)  # along the accumulators' columns
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)  # along their rows
    if HEADS_FIRST:
        hk = gl.program_id(0)
        b = gl.program_id(1)
    else:
        b = gl.program_id(0)
        hk = gl.program_id(1)
    sp = gl.program_id(2)
    L = gl.load(len_ptr + b)
    t0 = sp * SPLIT_LEN
    t1 = gl.minimum(t0 + SPLIT_LEN, L)
    b64 = b.to(gl.int64)

    if POS:
        # q^T (128, 8) in the B fragments, the head dim gathered in k_perm order, columns >= G zero
        gq = gl.arange(0, 8, layout=gl.SliceLayout(0, OPB))
        pk = gl.load(permk_ptr + gl.arange(0, 128, layout=gl.SliceLayout(1, OPB)))
        qcol = q_ptr + b64 * sqb + (hk * G + gl.where(gq < G, gq, 0)) * 128
        q = gl.load(qcol[None, :] + pk[:, None], mask=(gq < G)[None, :], other=0.0)
        GL: gl.constexpr = ROW  # per-position scales along the score rows
        m_i = gl.full([8], float("-inf"), gl.float32, layout=COL)
        l_i = gl.full([BT, 8], 0.0, gl.float32, layout=MMA)  # per-thread partial sums until the end
        scale = sm_scale * 512.0 * LOG2E  # swizzled K is c * s8 * 2**-9; scores in log2 units
    else:
        # q (16, 128) in the A fragments, the head dim gathered in k_perm order, rows >= G zero
        gq = gl.arange(0, 16, layout=gl.SliceLayout(1, OPA))
        pk = gl.load(permk_ptr + gl.arange(0, 128, layout=gl.SliceLayout(0, OPA)))
        qrow = q_ptr + b64 * sqb + (hk * G + gl.where(gq < G, gq, 0)) * 128
        q = gl.load(qrow[:, None] + pk[None, :], mask=(gq < G)[:, None], other=0.0)
        GL: gl.constexpr = COL  # per-position scales along the score columns
        m_i = gl.full([8], float("-inf"), gl.float32, layout=gl.SliceLayout(1, L8))
        l_i = gl.full([8], 0.0, gl.float32, layout=gl.SliceLayout(1, L8))
        scale = sm_scale

    kcw = kc_ptr.to(gl.pointer_type(gl.int32)) + b64 * scb4 + hk * 16
    vcw = vc_ptr.to(gl.pointer_type(gl.int32)) + b64 * scb4 + hk * 16
    ksp = ks_ptr + b64 * ssb + hk * 8
    vsp = vs_ptr + b64 * ssb + hk * 8
    kgp = kg_ptr + b64 * sgb + hk
    vgp = vg_ptr + b64 * sgb + hk

    acc = gl.full([128, 8], 0.0, gl.float32, layout=MMA)
    # two tiles an iteration, the next tile's bytes loaded before the current one is used: tile A is
    # carried by the loop and reloaded once it is consumed, so no register copies (the split is a whole
    # number of tile pairs; a pair's second tile past t1 is all masked and changes nothing)
    t = t0
    ka = _load_tile(kcw, ksp, kgp, t, t1, sct4, sst, sgt, BT, LK, LKS, GL)
    va = _load_tile(vcw, vsp, vgp, t, t1, sct4, sst, sgt, BT, LV, LVS, GL)
    while t < t1:
        kb = _load_tile(kcw, ksp, kgp, t + BT, t1, sct4, sst, sgt, BT, LK, LKS, GL)
        vb = _load_tile(vcw, vsp, vgp, t + BT, t1, sct4, sst, sgt, BT, LV, LVS, GL)
        m_i, l_i, acc = _attend(q, ka, va, t, t1, m_i, l_i, acc, scale, BT, LK, LV, L8, LVP, POS)
        ka = _load_tile(kcw, ksp, kgp, t + 2 * BT, t1, sct4, sst, sgt, BT, LK, LKS, GL)
        va = _load_tile(vcw, vsp, vgp, t + 2 * BT, t1, sct4, sst, sgt, BT, LV, LVS, GL)
        m_i, l_i, acc = _attend(q, kb, vb, t + BT, t1, m_i, l_i, acc, scale, BT, LK, LV, L8, LVP, POS)
        t += 2 * BT

    acc = acc * 512.0  # swizzled V: c * s8 * 2**-9
    go = gl.arange(0, 8, layout=COL)
    pv_ = gl.load(permv_ptr + gl.arange(0, 128, layout=ROW))
    orow = b64 * H + hk * G + gl.where(go < G, go, 0)  # (row, query head) of each output column
    if POS:
        lo = gl.sum(l_i, axis=0)  # COL already
        mo = m_i * LN2  # the merge's m is in natural-log units
    else:
        lo = gl.convert_layout(l_i, COL)
        mo = gl.convert_layout(m_i, COL)
    if FINAL:  # one split: the BF16 output o / l (what the merge computes at S = 1)
        gl.store(out_ptr + orow[None, :] * 128 + pv_[:, None], (acc / lo[None, :]).to(gl.bfloat16),
                 mask=(go < G)[None, :])
    else:
        prow = orow * S + sp
        gl.store(po_ptr + prow[None, :] * 128 + pv_[:, None], acc, mask=(go < G)[None, :])
        gl.store(pml_ptr + prow * 2, mo, mask=go < G)
        gl.store(pml_ptr + prow * 2 + 1, lo, mask=go < G)


@gluon.jit
def _attend(q, k, v, t, t1, m_i, l_i, acc, scale, BT: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr,
            L8: gl.constexpr, LVP: gl.constexpr, POS: gl.constexpr):
    """One tile of loaded (words, scales, global scales) K and V in the kernel's orientation."""
    if POS:
        return _attend_tile_pos(q, k[0], k[1], k[2], v[0], v[1], v[2], t, t1, m_i, l_i, acc, scale, BT, LK, LVP)
    else:
        return _attend_tile(q, k[0], k[1], k[2], v[0], v[1], v[2], t, t1, m_i, l_i, acc, scale, BT, LK, LV, L8)


@gluon.jit
def _rows8(x, L8: gl.constexpr):
    """Rows 0-7 of a (16, BT) accumulator tensor, pinned to L8 (a register relabelling, no data movement)."""
    BT: gl.constexpr = x.shape[1]
    x = gl.permute(gl.reshape(x, [2, 8, BT]), [1, 2, 0])
    lo, hi = gl.split(x)
    return gl.convert_layout(lo, L8, assert_trivial=True)


ROWS = ("heads", "positions")
_TABLES: dict[tuple[torch.device, str], tuple[torch.Tensor, torch.Tensor]] = {}


def supported(n_heads: int, n_kv_heads: int, head_dim: int, swizzled: bool) -> bool:
    """Whether this kernel handles the shape: swizzled FP4 cache, head dim 128, <= 8 query heads a KV head."""
    return swizzled and head_dim == DH and n_heads % n_kv_heads == 0 and n_heads // n_kv_heads <= 8


def launch(q, kc, ks, kg, vc, vs, vg, lens, po, pml, sm_scale: float, split_len: int, block_t: int,
           S: int | None = None, out: torch.Tensor | None = None, maxnreg: int | None = None,
           rows: str = "heads", heads_first: bool = False) -> None:
    """The partial (o, m, l) of every (row, KV head, split), as fp4_attention's `_decode_attn_kernel`
    writes them; with `out` (one split, S = 1) the BF16 output (B, H * 128) instead. rows: what fills the
    QK dot's MMA rows, "heads" or "positions" (ROWS; the module docstring). heads_first: grid (Hkv, B, S),
    a row's KV heads launched together (fp4_attention.HEADS_FIRST says why)."""
    if rows not in ROWS:
        raise ValueError(f"rows={rows!r}: choose one of {ROWS}")
    B, H, Dh = q.shape
    Hkv = kc.shape[2]
    S = po.shape[2] if S is None else S
    if out is not None and S != 1:
        raise ValueError(f"the output is written in-kernel only with one split, not {S}")
    dev = q.device
    if (dev, rows) not in _TABLES:
        _TABLES[dev, rows] = (torch.tensor(k_perm(), dtype=torch.int32, device=dev),
                              torch.tensor(v_perm() if rows == "heads" else v_pair_perm(), dtype=torch.int32,
                                           device=dev))
    permk, permv = _TABLES[dev, rows]
    _mma_attn_kernel[(Hkv, B, S) if heads_first else (B, Hkv, S)](
        q, q.stride(0), kc, ks, kg, vc, vs, vg, kc.stride(0) // 4, kc.stride(1) // 4, ks.stride(0), ks.stride(1),
        kg.stride(0), kg.stride(1), lens, po, pml, out if out is not None else po, permk, permv, sm_scale, S,
        split_len, H=H, G=H // Hkv, BT=block_t, LK=k_layout(block_t), LV=v_layout(block_t),
        LKS=k_scale_layout(block_t), LVS=v_scale_layout(block_t), L8=s8_layout(block_t), LVP=v_pair_layout(block_t),
        FINAL=out is not None, POS=rows == "positions", HEADS_FIRST=heads_first, num_warps=1, **({"maxnreg": maxnreg} if maxnreg else {}),
    )
