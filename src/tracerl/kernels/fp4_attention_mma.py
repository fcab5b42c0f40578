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
def _mma_attn_kernel(
    q_ptr, sqb, kc_ptr, ks_ptr, kg_ptr, vc_ptr, vs_ptr, vg_ptr, scb4, sct4, ssb, sst, sgb, sgt,
    len_ptr, po_ptr, pml_ptr, out_ptr, permk_ptr, permv_ptr, sm_scale, S, SPLIT_LEN,
    H: gl.constexpr, G: gl.constexpr, BT: gl.constexpr,
    LK: gl.constexpr, LV: gl.constexpr, LKS: gl.constexpr, LVS: gl.constexpr, L8: gl.constexpr,
    FINAL: gl.constexpr,
):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    GS: gl.constexpr = gl.SliceLayout(0, MMA)  # (BT,) along the score columns
    b = gl.program_id(0)
    hk = gl.program_id(1)
    sp = gl.program_id(2)
    L = gl.load(len_ptr + b)
    t0 = sp * SPLIT_LEN
    t1 = gl.minimum(t0 + SPLIT_LEN, L)
    b64 = b.to(gl.int64)

    # q (16, 128) in the A fragments, the head dim gathered in k_perm order, rows >= G zero
    gq = gl.arange(0, 16, layout=gl.SliceLayout(1, OPA))
    pk = gl.load(permk_ptr + gl.arange(0, 128, layout=gl.SliceLayout(0, OPA)))
    qrow = q_ptr + b64 * sqb + (hk * G + gl.where(gq < G, gq, 0)) * 128
    q = gl.load(qrow[:, None] + pk[None, :], mask=(gq < G)[:, None], other=0.0)

    kcw = kc_ptr.to(gl.pointer_type(gl.int32)) + b64 * scb4 + hk * 16
    vcw = vc_ptr.to(gl.pointer_type(gl.int32)) + b64 * scb4 + hk * 16
    ksp = ks_ptr + b64 * ssb + hk * 8
    vsp = vs_ptr + b64 * ssb + hk * 8
    kgp = kg_ptr + b64 * sgb + hk
    vgp = vg_ptr + b64 * sgb + hk

    m_i = gl.full([8], float("-inf"), gl.float32, layout=gl.SliceLayout(1, L8))
    l_i = gl.full([8], 0.0, gl.float32, layout=gl.SliceLayout(1, L8))
    acc = gl.full([128, 8], 0.0, gl.float32, layout=MMA)
    # two tiles an iteration, the next tile's bytes loaded before the current one is used: tile A is
    # carried by the loop and reloaded once it is consumed, so no register copies (the split is a whole
    # number of tile pairs; a pair's second tile past t1 is all masked and changes nothing)
    t = t0
    ka = _load_tile(kcw, ksp, kgp, t, t1, sct4, sst, sgt, BT, LK, LKS, GS)
    va = _load_tile(vcw, vsp, vgp, t, t1, sct4, sst, sgt, BT, LV, LVS, GS)
    while t < t1:
        kb = _load_tile(kcw, ksp, kgp, t + BT, t1, sct4, sst, sgt, BT, LK, LKS, GS)
        vb = _load_tile(vcw, vsp, vgp, t + BT, t1, sct4, sst, sgt, BT, LV, LVS, GS)
        m_i, l_i, acc = _attend_tile(q, ka[0], ka[1], ka[2], va[0], va[1], va[2], t, t1, m_i, l_i, acc,
                                     sm_scale, BT, LK, LV, L8)
        ka = _load_tile(kcw, ksp, kgp, t + 2 * BT, t1, sct4, sst, sgt, BT, LK, LKS, GS)
        va = _load_tile(vcw, vsp, vgp, t + 2 * BT, t1, sct4, sst, sgt, BT, LV, LVS, GS)
        m_i, l_i, acc = _attend_tile(q, kb[0], kb[1], kb[2], vb[0], vb[1], vb[2], t + BT, t1, m_i, l_i, acc,
                                     sm_scale, BT, LK, LV, L8)
        t += 2 * BT

    acc = acc * 512.0  # swizzled V: c * s8 * 2**-9
    go = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    pv_ = gl.load(permv_ptr + gl.arange(0, 128, layout=gl.SliceLayout(1, MMA)))
    orow = b64 * H + hk * G + gl.where(go < G, go, 0)  # (row, query head) of each output column
    if FINAL:  # one split: the BF16 output o / l (what the merge computes at S = 1)
        lo = gl.convert_layout(l_i, gl.SliceLayout(0, MMA))
        gl.store(out_ptr + orow[None, :] * 128 + pv_[:, None], (acc / lo[None, :]).to(gl.bfloat16),
                 mask=(go < G)[None, :])
    else:
        prow = orow * S + sp
        gl.store(po_ptr + prow[None, :] * 128 + pv_[:, None], acc, mask=(go < G)[None, :])
        gm = gl.arange(0, 8, layout=gl.SliceLayout(1, L8))
        mrow = (b64 * H + hk * G + gl.where(gm < G, gm, 0)) * S + sp
        gl.store(pml_ptr + mrow * 2, m_i, mask=gm < G)
        gl.store(pml_ptr + mrow * 2 + 1, l_i, mask=gm < G)


@gluon.jit
def _rows8(x, L8: gl.constexpr):
    """Rows 0-7 of a (16, BT) accumulator tensor, pinned to L8 (a register relabelling, no data movement)."""
    BT: gl.constexpr = x.shape[1]
    x = gl.permute(gl.reshape(x, [2, 8, BT]), [1, 2, 0])
    lo, hi = gl.split(x)
    return gl.convert_layout(lo, L8, assert_trivial=True)


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def supported(n_heads: int, n_kv_heads: int, head_dim: int, swizzled: bool) -> bool:
    """Whether this kernel handles the shape: swizzled FP4 cache, head dim 128, <= 8 query heads a KV head."""
    return swizzled and head_dim == DH and n_heads % n_kv_heads == 0 and n_heads // n_kv_heads <= 8


def launch(q, kc, ks, kg, vc, vs, vg, lens, po, pml, sm_scale: float, split_len: int, block_t: int,
           S: int | None = None, out: torch.Tensor | None = None, maxnreg: int | None = None) -> None:
    """The partial (o, m, l) of every (row, KV head, split), as fp4_attention's `_decode_attn_kernel`
    writes them; with `out` (one split, S = 1) the BF16 output (B, H * 128) instead."""
    B, H, Dh = q.shape
    Hkv = kc.shape[2]
    S = po.shape[2] if S is None else S
    if out is not None and S != 1:
        raise ValueError(f"the output is written in-kernel only with one split, not {S}")
    dev = q.device
    if dev not in _TABLES:
        _TABLES[dev] = (torch.tensor(k_perm(), dtype=torch.int32, device=dev),
                        torch.tensor(v_perm(), dtype=torch.int32, device=dev))
    permk, permv = _TABLES[dev]
    _mma_attn_kernel[(B, Hkv, S)](
        q, q.stride(0), kc, ks, kg, vc, vs, vg, kc.stride(0) // 4, kc.stride(1) // 4, ks.stride(0), ks.stride(1),
        kg.stride(0), kg.stride(1), lens, po, pml, out if out is not None else po, permk, permv, sm_scale, S,
        split_len, H=H, G=H // Hkv, BT=block_t, LK=k_layout(block_t), LV=v_layout(block_t),
        LKS=k_scale_layout(block_t), LVS=v_scale_layout(block_t), L8=s8_layout(block_t), FINAL=out is not None,
        num_warps=1, **({"maxnreg": maxnreg} if maxnreg else {}),
    )
