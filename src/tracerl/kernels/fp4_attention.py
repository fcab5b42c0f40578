"""Decode attention (one new query per row) over a BF16 or an FP4 KV cache, GQA, split-KV.

Shapes: B rows (cache slots 0..B-1), H query heads, Hkv key/value heads, G = H // Hkv query heads
per KV head, Dh head_dim, T cache positions, S splits of the positions.

Cache layouts (those of rollout/kvcache.py, one layer):
- BF16: k, v (slots, T, Hkv, Dh).
- FP4 (FP4KVCache.codes/scales/gscale[kv, layer]): codes uint8 (slots, T, Hkv, Dh//2), E4M3 scale
  bytes uint8 (slots, T, Hkv, Dh//16), per-row global scales float32 (slots, T, Hkv, 1): the
  value is e2m1 * s8 / gs, blocks of 16 along Dh, as `fp4.quantize(..., per_row_global=True)`.

One program per (row, KV head, split) attends all G query heads of the group to its split's
positions [split * split_len, min(len, (split + 1) * split_len)) with an online softmax in float32
and writes a partial (o, m, l); a merge kernel combines the splits by their log-sum-exp
(flash-decoding, as rollout/attention.py does on CPU). With one split (`FUSE_SINGLE_SPLIT`) the
program writes o / l itself. For an FP4 cache the K/V tiles are
dequantized in registers to exact c * s8 (BF16) and never written out; 1/gs of a position is
folded into its score (K) and into its probability before the PV dot (V). Against the engine's
CPU path (K/V dequantized to BF16, then float32 softmax) the result agrees to BF16 rounding:
that path rounds c * s8 / gs to BF16 and this kernel feeds P to the PV dot in BF16.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tracerl import fp4
from tracerl.kernels import fp4_gemm, fp4_swizzle, pdl

try:
    from tracerl.kernels import fp4_attention_mma
except ImportError:  # a Triton without Gluon's mma_v2 and linear layouts (< 3.6): the Triton kernel runs everywhere
    fp4_attention_mma = None
from tracerl.kernels.decode_reference import (  # noqa: F401  (re-exported: the kernels' references)
    decode_attention_reference,
    fp4_rows,
    qkv_post_reference,
)
from tracerl.kernels.fp4_gemm import INTERPRET, _bf16, _w_decode, _w_load

# Where a launch has one split per (row, KV head) (large batches), the attention kernel normalizes and
# writes the BF16 output itself, with no partials and no merge; the same values as the merge's (at one
# split its weight is exp(0) = 1, so it computes o / l as well). Off: always partials + merge (A/B).
FUSE_SINGLE_SPLIT = True
# Launch the KV heads of a row next to each other (grid (Hkv, B, S), not (B, Hkv, S)). An FP4 cache
# keeps a position's block scales (8 B a head) and global scales (4 B a head) of all heads in one
# 32-byte sector, so a program reading its head's fetches the whole sector; with the row index
# fastest, a row's heads run waves apart at large batches (1k B=1776: 7104 programs, ~4 waves) and
# each refetches the sector from DRAM (~112 fetched for 76 useful bytes a position and head). Run
# together, they share it through L2. The same results bit for bit (only the launch order moves);
# 2026-12-08: not yet timed on a GPU (scratch/dev13.sh times both orders).
HEADS_FIRST = True


@triton.jit
def _softmax_update(s, tmask, m_i, l_i):
    """Online-softmax step over one tile's scores s (GP, BT): (p, alpha, new max, new sum)."""
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _fp4_tile(q_ev, q_od, pk, sk, pv_, sv, gk, gv, tmask, m_i, l_i, acc_ev, acc_od, sm_scale,
              BT: tl.constexpr, DH: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr, SWZ: tl.constexpr,
              WORDS: tl.constexpr):
    """One BT-position tile of an FP4 cache from its loaded bytes: the updated (m, l, even acc, odd acc)."""
    k_ev, k_od = _w_decode(pk, sk, BT, DH, ASM, F32, SWZ, WORDS)
    s = tl.dot(q_ev, tl.trans(k_ev))
    s = tl.dot(q_od, tl.trans(k_od), s)
    if SWZ:  # swizzled K enters the dot as c * s8 * 2**-9: a power of two, so bit for bit the same
        s = s * ((sm_scale * 512.0) / gk)[None, :]
    else:
        s = s * (sm_scale / gk)[None, :]
    p, alpha, m_i, l_i = _softmax_update(s, tmask, m_i, l_i)
    v_ev, v_od = _w_decode(pv_, sv, BT, DH, ASM, F32, SWZ, WORDS)
    pv = p / gv[None, :]
    if not F32:
        pv = _bf16(pv)
    acc_ev = tl.dot(pv, v_ev, acc_ev * alpha[:, None])
    acc_od = tl.dot(pv, v_od, acc_od * alpha[:, None])
    return m_i, l_i, acc_ev, acc_od


@triton.jit
def _bf16_tile(q, kt, vt, tmask, m_i, l_i, acc, sm_scale, F32: tl.constexpr):
    """One BT-position tile of a BF16 cache: the updated (m, l, acc)."""
    if F32:
        kt = kt.to(tl.float32)
    s = tl.dot(q, tl.trans(kt)) * sm_scale
    p, alpha, m_i, l_i = _softmax_update(s, tmask, m_i, l_i)
    if F32:
        pv = p
        vt = vt.to(tl.float32)
    else:
        pv = _bf16(p)
    return m_i, l_i, tl.dot(pv, vt, acc * alpha[:, None])


@triton.jit
def _fp4_kv_load(kc, ks, vc, vs, kg, vg, t, t1, sct, sst, sgt, BT: tl.constexpr, DH: tl.constexpr,
                 WORDS: tl.constexpr):
    """Packed K and V codes (int32 words with WORDS), scale bytes and row global scales of positions
    t..t+BT (masked at t1)."""
    ts = t + tl.arange(0, BT)
    tmask = ts < t1
    ts = tl.where(tmask, ts, 0)  # int32: offsets inside one slot
    pk, sk = _w_load(kc, ks, ts, tmask[:, None], sct, sst, 0, DH, WORDS)
    pv, sv = _w_load(vc, vs, ts, tmask[:, None], sct, sst, 0, DH, WORDS)
    gk = tl.load(kg + ts * sgt, mask=tmask, other=1.0)
    gv = tl.load(vg + ts * sgt, mask=tmask, other=1.0)
    return pk, sk, pv, sv, gk, gv


@triton.jit
def _bf16_kv_load(kb, vb, t, t1, skt, BT: tl.constexpr, DH: tl.constexpr):
    """BF16 K and V rows of positions t..t+BT (masked at t1)."""
    ts = t + tl.arange(0, BT)
    tmask = ts < t1
    off = tl.where(tmask, ts, 0)[:, None] * skt + tl.arange(0, DH)[None, :]
    return tl.load(kb + off, mask=tmask[:, None], other=0.0), tl.load(vb + off, mask=tmask[:, None], other=0.0)


@triton.jit
def _decode_attn_kernel(
    q_ptr, sqb,
    k_ptr, v_ptr, skb, skt,
    kc_ptr, ks_ptr, kg_ptr, vc_ptr, vs_ptr, vg_ptr, scb, sct, ssb, sst, sgb, sgt,
    len_ptr, po_ptr, pml_ptr, out_ptr,
    sm_scale, S, SPLIT_LEN,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DH: tl.constexpr, BT: tl.constexpr,
    KV_FP4: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr, SWZ: tl.constexpr, WORDS: tl.constexpr,
    FINAL: tl.constexpr, HEADS_FIRST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    if HEADS_FIRST:  # grid (Hkv, B, S): see HEADS_FIRST
        hk = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        hk = tl.program_id(1)
    sp = tl.program_id(2)
    L = tl.load(len_ptr + b)
    t0 = sp * SPLIT_LEN
    t1 = tl.minimum(t0 + SPLIT_LEN, L)
    g = tl.arange(0, GP)
    gmask = g < G
    heads = hk * G + tl.where(gmask, g, 0)
    b64 = b.to(tl.int64)
    qrow = q_ptr + b64 * sqb + heads[:, None] * DH
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    if KV_FP4:
        j = tl.arange(0, DH // 2)
        q_ev = tl.load(qrow + 2 * j[None, :], mask=gmask[:, None], other=0.0)
        q_od = tl.load(qrow + 2 * j[None, :] + 1, mask=gmask[:, None], other=0.0)
        if F32:
            q_ev, q_od = q_ev.to(tl.float32), q_od.to(tl.float32)
        acc_ev = tl.zeros((GP, DH // 2), tl.float32)
        acc_od = tl.zeros((GP, DH // 2), tl.float32)
        kc = kc_ptr + b64 * scb + hk * (DH // 2)
        ks = ks_ptr + b64 * ssb + hk * (DH // 16)
        vc = vc_ptr + b64 * scb + hk * (DH // 2)
        vs = vs_ptr + b64 * ssb + hk * (DH // 16)
        kg = kg_ptr + b64 * sgb + hk
        vg = vg_ptr + b64 * sgb + hk
    else:
        d = tl.arange(0, DH)
        q = tl.load(qrow + d[None, :], mask=gmask[:, None], other=0.0)
        if F32:
            q = q.to(tl.float32)
        acc = tl.zeros((GP, DH), tl.float32)
        kb = k_ptr + b64 * skb + hk * DH
        vb = v_ptr + b64 * skb + hk * DH
    t = t0
    if KV_FP4:  # software prefetch of the next tile's packed K/V in registers (see fp4_gemm's K loop)
        pk, sk, pv_, sv, gk, gv = _fp4_kv_load(kc, ks, vc, vs, kg, vg, t, t1, sct, sst, sgt, BT, DH, WORDS)
    while t < t1:
        tmask = t + tl.arange(0, BT) < t1
        if KV_FP4:
            nxt = _fp4_kv_load(kc, ks, vc, vs, kg, vg, t + BT, t1, sct, sst, sgt, BT, DH, WORDS)
            m_i, l_i, acc_ev, acc_od = _fp4_tile(q_ev, q_od, pk, sk, pv_, sv, gk, gv, tmask, m_i, l_i, acc_ev,
                                                 acc_od, sm_scale, BT, DH, ASM, F32, SWZ, WORDS)
            pk, sk, pv_, sv, gk, gv = nxt
        else:
            kt, vt = _bf16_kv_load(kb, vb, t, t1, skt, BT, DH)
            m_i, l_i, acc = _bf16_tile(q, kt, vt, tmask, m_i, l_i, acc, sm_scale, F32)
        t += BT
    if KV_FP4 and SWZ:  # swizzled V: c * s8 * 2**-9 (exact power of two)
        acc_ev, acc_od = acc_ev * 512.0, acc_od * 512.0
    if FINAL:  # one split: the output itself, o / l in BF16 (the merge's value at S = 1: its weight is exp(0))
        orow = b64 * H + heads
        if KV_FP4:
            optr = out_ptr + orow[:, None] * DH + 2 * j[None, :]
            tl.store(optr, _bf16(acc_ev / l_i[:, None]), mask=gmask[:, None])
            tl.store(optr + 1, _bf16(acc_od / l_i[:, None]), mask=gmask[:, None])
        else:
            tl.store(out_ptr + orow[:, None] * DH + d[None, :], _bf16(acc / l_i[:, None]), mask=gmask[:, None])
    else:
        prow = ((b64 * H + heads) * S + sp)
        if KV_FP4:
            optr = po_ptr + prow[:, None] * DH + 2 * j[None, :]
            tl.store(optr, acc_ev, mask=gmask[:, None])
            tl.store(optr + 1, acc_od, mask=gmask[:, None])
        else:
            tl.store(po_ptr + prow[:, None] * DH + d[None, :], acc, mask=gmask[:, None])
        tl.store(pml_ptr + prow * 2, m_i, mask=gmask)
        tl.store(pml_ptr + prow * 2 + 1, l_i, mask=gmask)


@triton.jit
def _merge_kernel(po_ptr, pml_ptr, out_ptr, S, DH: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr = False):
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SP)
    smask = sp < S
    m = tl.load(pml_ptr + (bh * S + sp) * 2, mask=smask, other=float("-inf"))
    l = tl.load(pml_ptr + (bh * S + sp) * 2 + 1, mask=smask, other=0.0)
    mx = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - mx), 0.0)
    d = tl.arange(0, DH)
    o = tl.load(po_ptr + (bh * S + sp)[:, None] * DH + d[None, :], mask=smask[:, None], other=0.0)
    num = tl.sum(o * w[:, None], axis=0)
    den = tl.sum(l * w, axis=0)
    tl.store(out_ptr + bh * DH + d, _bf16(num / den))


class AttentionConfig(NamedTuple):
    """How the decode attention is launched: positions per tile, warps, the programs per launch the
    split aims at (`split_len_for`), a register cap per thread (None: the compiler's choice), and
    whether a swizzled FP4 cache is decoded by whole 32-bit words (`fp4_gemm._swz_word_dequant`:
    the PTX path; the same values bit for bit, fewer instructions and registers than by bytes), and
    which kernel runs a swizzled FP4 cache: "triton" (`_decode_attn_kernel`), "mma" or "mma-pos"
    (`fp4_attention_mma`: one warp a program, K/V decoded straight into the MMA fragments, with the query
    heads or the positions on the QK dot's MMA rows: MMA_KERNELS; num_warps, words do not apply to them;
    maxnreg caps their registers as the Triton kernel's)."""

    block_t: int = 64
    num_warps: int = 4
    programs: int = 256
    maxnreg: int | None = None
    words: bool = False
    kernel: str = "triton"

    @property
    def split_block(self) -> int:
        """Positions the split rounds to: the mma kernel walks its split two tiles at a time."""
        return self.block_t * (2 if self.kernel in MMA_KERNELS else 1)


# The split runs as a `while` loop with the next tile prefetched in registers. A compiler-pipelined
# `for` form (async copies into shared memory, 2-3 tiles in flight) was timed on the H100 on 2026-12-07
# and taken out: it gained nothing (FP4 0.258 vs 0.258 ms, BF16 0.262 vs 0.264 at B=256, 1k) and its
# swizzled-cache output was wrong on the GPU (bench/RESULTS.md).
#
# Programs per launch: the best target follows the tile (bench/attention_profile.py, H100 2026-12-07):
# at BT=64 256 programs won at every point and format (FP4 1k B=16 15.8 vs 22.1 us at 1024; 256 is one
# wave of 2 CTAs on each of 132 SMs), at BT=32 512-1024 won (BF16 8k B=16 94 vs 125 us at 256). So the
# target is part of the tuned config, and the default is the BT=64 one.
DEFAULT_CONFIG = AttentionConfig()
SPLIT_PROGRAMS = DEFAULT_CONFIG.programs

# KV_FP4 -> AttentionConfig; benchmarks fill it from a sweep at decode batch sizes (bench/rollout.py micro).
# TUNED_LARGE: KV_FP4 -> (from this many row positions up, the config there) or None (one config for
# every launch), where long launches want another kernel. A launch's work per KV head is batch x
# cache length ("row positions"), and that, not the batch, decides between the kernels: on the H100
# the mma kernel lost at 1k B=16 (16k row positions: 0.025 vs 0.015 ms, its split of 64 positions too
# short for its per-program setup) and won at 8k B=16 (131k: 0.063 vs 0.072 ms) and at 1k from B=64
# (65k; 1k B=256: 0.107 vs 0.141 ms) (bench/RESULTS.md). Until 2026-12-08 the switch was by batch
# alone (from B=64), which kept 8k B=16 on the slower kernel. Untuned, an FP4 cache runs the mma
# kernel from 65536 row positions (DEFAULT_LARGE: 1k B=64, 8k B=8; `effective_config` falls back to
# the Triton kernel where it cannot run).
LARGE_ROW_POSITIONS = 65536
TUNED: dict[bool, AttentionConfig] = {}
TUNED_LARGE: dict[bool, tuple[int, AttentionConfig] | None] = {}  # (row positions, config)

# AttentionConfig.kernel -> fp4_attention_mma.launch(rows=): "mma" puts the query heads on the MMA rows
# (padded 8 -> 16), "mma-pos" the positions (~25% fewer instructions a tile in the sm_90 SASS, 144
# registers without spills). Both pass the GPU tests (H100, 2026-12-08); one layer at 1k B=1776 0.720 vs
# 0.722 ms, at 8k B=240 0.618 vs 0.671 ms (bench/RESULTS.md), so the positions kernel is the default.
MMA_KERNELS = {"mma": "heads", "mma-pos": "positions"}
KERNELS = ("triton", *MMA_KERNELS)
MMA_DEFAULTS = {"mma": AttentionConfig(16, 1, 1024, None, True, "mma"),  # each kernel's best on the H100
                "mma-pos": AttentionConfig(16, 1, 1024, 144, True, "mma-pos")}
MMA_DEFAULT = MMA_DEFAULTS["mma-pos"]
DEFAULT_LARGE: dict[bool, tuple[int, AttentionConfig]] = {True: (LARGE_ROW_POSITIONS, MMA_DEFAULT)}


def attention_config(fp4_kv: bool, batch: int | None = None, max_len: int | None = None) -> AttentionConfig:
    """The tuned launch config for a BF16 (False) or FP4 (True) cache of `max_len` positions at this decode
    batch (the large-launch one from TUNED_LARGE's row positions up), else the default."""
    large = TUNED_LARGE[fp4_kv] if fp4_kv in TUNED_LARGE else DEFAULT_LARGE.get(fp4_kv)
    if batch is not None and max_len is not None and large is not None and batch * max_len >= large[0]:
        return large[1]
    return TUNED.get(fp4_kv, DEFAULT_CONFIG)


def mma_usable(fp4_kv: bool, n_heads: int, n_kv_heads: int, head_dim: int, swizzled: bool,
               device: torch.device | str) -> bool:
    """Whether the mma kernel can run this cache: FP4, swizzled, a shape it handles, on CUDA (Gluon has no
    interpreter), with a Triton that has Gluon's mma_v2 (3.6)."""
    return (fp4_kv and fp4_attention_mma is not None and not INTERPRET and torch.device(device).type == "cuda"
            and n_kv_heads > 0 and fp4_attention_mma.supported(n_heads, n_kv_heads, head_dim, swizzled)
            and mma_selfcheck(device) == "mma ok")


_MMA_STATUS: dict[str, str] = {}


def mma_selfcheck(device: torch.device | str = "cuda") -> str:
    """Each mma kernel against the Triton kernel on a small swizzled FP4 cache, once per device.

    'mma ok' when every kernel in MMA_KERNELS agrees with the Triton kernel (rel < 1e-2, with several
    splits and with one split's in-kernel output), else 'mma off: <reason>', and `mma_usable` is False
    so the decoder runs the Triton kernel. Gluon has no interpreter, so this first launch on a user's
    GPU is where a miscompile or a wrong launch would show; it must not reach their rollouts."""
    key = str(torch.device(device))
    if key in _MMA_STATUS:
        return _MMA_STATUS[key]
    if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "mma off: first use inside a CUDA graph capture (not checked, not cached)"
    _MMA_STATUS[key] = "mma ok"  # provisional: the check's own launches run the mma kernels
    g = torch.Generator(device="cpu").manual_seed(8)
    B, H, Hkv, Dh, T = 3, 32, 4, 128, 96
    kv = torch.randn(2, B, T, Hkv, Dh, generator=g) * torch.rand(2, B, T, Hkv, 1, generator=g) * 4
    nat = fp4.quantize(kv, "nvfp4", per_row_global=True)
    sc, ss = fp4_swizzle.swizzle_blocks(nat.codes, nat.scales)  # as kv_store_fp4(swizzle=True) stores them
    sc, ss, gs = sc.to(device), ss.to(device), nat.global_scale.to(device)
    q = torch.randn(B, H, Dh, generator=g).bfloat16().to(device)
    lens = torch.tensor([T, 1, T - 37], dtype=torch.int32, device=device)
    kf, vf = (sc[0], ss[0], gs[0]), (sc[1], ss[1], gs[1])

    def first_mismatch() -> str:
        for split in (32, T):  # partials + merge, and one split (the kernel writes the output)
            ref = decode_attention(q, lens, k_fp4=kf, v_fp4=vf, swizzled=True, split_len=split, kernel="triton")
            for kernel in MMA_KERNELS:
                o = decode_attention(q, lens, k_fp4=kf, v_fp4=vf, swizzled=True, split_len=split, kernel=kernel)
                rel = float((o.float() - ref.float()).norm() / ref.float().norm())
                if not rel < 1e-2:
                    return f"mma off: {kernel} differs from the Triton kernel (rel {rel:.2e}, split {split})"
        return "mma ok"

    try:
        status = first_mismatch()
    except Exception as e:  # a PTX or lowering error: the Triton kernel runs instead
        status = f"mma off: {type(e).__name__}: {str(e)[:200]}"
    _MMA_STATUS[key] = status
    return status


def effective_config(fp4_kv: bool, batch: int, max_len: int, kernel: str | None = None,
                     mma_ok: bool = True) -> AttentionConfig:
    """The config a launch runs: the tuned one at this batch and cache length, with `kernel` forced if
    given; where the mma kernel cannot run (`mma_ok` False) the Triton kernel at its default config, not
    at the mma config's one warp."""
    tuned = attention_config(fp4_kv, batch, max_len)
    kernel = kernel or tuned.kernel
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: choose one of {KERNELS}")
    if kernel in MMA_KERNELS and not mma_ok:
        kernel = "triton"
    if kernel != tuned.kernel:  # the tuned config belongs to another kernel
        if kernel in MMA_KERNELS:  # the two mma kernels share launch parameters, not the register cap
            tuned = tuned._replace(kernel=kernel, maxnreg=MMA_DEFAULTS[kernel].maxnreg) \
                if tuned.kernel in MMA_KERNELS else MMA_DEFAULTS[kernel]
        else:
            tuned = TUNED.get(fp4_kv, DEFAULT_CONFIG)
            if tuned.kernel != kernel:
                tuned = DEFAULT_CONFIG
    return tuned


def split_len_for(max_len: int, batch: int, n_kv_heads: int, block_t: int = 64,
                  target_programs: int | None = None) -> int:
    """Positions per split: enough splits that B * Hkv * S programs fill the GPU, whole BT tiles."""
    if target_programs is None:
        target_programs = SPLIT_PROGRAMS
    tiles = triton.cdiv(max_len, block_t)
    splits = max(1, min(tiles, target_programs // max(1, batch * n_kv_heads)))
    return triton.cdiv(tiles, splits) * block_t


def decode_attention(
    q: torch.Tensor,
    lens: torch.Tensor,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    k_fp4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    v_fp4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    split_len: int | None = None,
    out: torch.Tensor | None = None,
    block_t: int | None = None,
    num_warps: int | None = None,
    swizzled: bool = False,
    maxnreg: int | None = None,
    asm: bool | None = None,
    words: bool | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh)) v for q (B, H, Dh) BF16 over positions [0, lens[b]) of slot b.

    Give either BF16 `k`, `v` (slots, T, Hkv, Dh), or `k_fp4`, `v_fp4` = (codes, scale bytes,
    global scales) of one layer as FP4KVCache stores them (`swizzled`: codes and scale bytes as
    `kv_store_fp4(swizzle=True)` stores them). lens: int32 (B,), every entry >= 1.
    Returns (B, H * Dh) BF16 (in `out` if given). split_len: positions per split (static, so
    that a CUDA graph can replay it for any lens); default from the cache length and the tuned
    config at this batch and cache length (`attention_config`), as are block_t, num_warps, maxnreg and words where not given. asm:
    the inline-PTX nibble decode (default fp4_gemm.USE_ASM) or the portable one. kernel: one of KERNELS
    (AttentionConfig.kernel; the mma ones where `fp4_attention_mma.supported`, else "triton").
    """
    B, H, Dh = q.shape
    fp4_kv = k_fp4 is not None
    _, T, hkv = (k_fp4[0] if fp4_kv else k).shape[:3]
    tuned = effective_config(fp4_kv, B, T, kernel, mma_usable(fp4_kv, H, hkv, Dh, swizzled, q.device))
    kernel = tuned.kernel
    programs = tuned.programs if block_t in (None, tuned.block_t) else None
    block_t = block_t or tuned.block_t
    num_warps = num_warps or tuned.num_warps
    maxnreg = maxnreg or tuned.maxnreg
    asm = fp4_gemm.USE_ASM if asm is None else asm
    words = (tuned.words if words is None else words) and swizzled and asm and fp4_kv and not INTERPRET
    if fp4_kv:
        kc, ks, kg = k_fp4
        vc, vs, vg = v_fp4
        T, Hkv = kc.shape[1], kc.shape[2]
        for t in (kc, ks, vc, vs):
            if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
                raise ValueError("FP4 cache codes/scales must be contiguous over (Hkv, last dim)")
        if kc.stride() != vc.stride() or ks.stride() != vs.stride() or kg.stride() != vg.stride():
            raise ValueError("K and V FP4 views must share strides")
        if words and (kc.data_ptr() % 4 or vc.data_ptr() % 4 or any(st % 4 for st in kc.stride()[:-1])):
            words = False  # word loads need 4-byte aligned rows; the byte path reads any layout
        ks, vs = ks.view(torch.uint8), vs.view(torch.uint8)
    else:
        T, Hkv = k.shape[1], k.shape[2]
        if k.stride() != v.stride() or k.stride(-1) != 1 or k.stride(-2) != Dh:
            raise ValueError("k and v must share strides, contiguous over (Hkv, Dh)")
    if H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} KV heads")
    G = H // Hkv
    if q.stride(-1) != 1 or q.stride(-2) != Dh:
        q = q.contiguous()
    split_len = split_len or split_len_for(T, B, Hkv, block_t * (2 if kernel in MMA_KERNELS else 1), programs)
    S = triton.cdiv(T, split_len)
    if out is None:
        out = torch.empty(B, H * Dh, device=q.device, dtype=torch.bfloat16)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (B, H * Dh) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous BF16 ({B}, {H * Dh}), got {out.dtype} {tuple(out.shape)}")
    # one split a (row, KV head): the kernel writes the output itself and no merge runs (at large
    # batches, e.g. 1k positions x 1776 rows: the float32 partials were 4x the output's bytes)
    final = S == 1 and FUSE_SINGLE_SPLIT
    heads_first = HEADS_FIRST and B <= 65535  # (a grid's y extent is at most 65535)
    pb, ph, ps = (1, 1, 1) if final else (B, H, S)  # (final: the partials' pointers are never read)
    po = torch.empty(pb, ph, ps, Dh, device=q.device, dtype=torch.float32)
    pml = torch.empty(pb, ph, ps, 2, device=q.device, dtype=torch.float32)
    if kernel in MMA_KERNELS:
        if kc.data_ptr() % 16 or vc.data_ptr() % 16 or any(st % 16 for st in kc.stride()[:-1]):
            raise ValueError("the mma attention kernel loads code rows as 16-byte vectors: the FP4 cache's "
                             "codes must be 16-byte aligned (FP4KVCache's are)")
        fp4_attention_mma.launch(q, kc, ks, kg, vc, vs, vg, lens, po, pml, 1.0 / math.sqrt(Dh), split_len, block_t,
                                 S=S, out=out if final else None, maxnreg=maxnreg, rows=MMA_KERNELS[kernel],
                                 heads_first=heads_first)
        if not final:
            _merge_kernel[(B * H,)](po, pml, out, S, DH=Dh, SP=triton.next_power_of_2(S), num_warps=4,
                                **pdl.launch(po.device))
        return out
    d = q  # placeholder for unused pointers
    if fp4_kv:
        args = (d, d, 0, 0, kc, ks, kg, vc, vs, vg, kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1),
                kg.stride(0), kg.stride(1))
    else:
        args = (k, v, k.stride(0), k.stride(1), d, d, d, d, d, d, 0, 0, 0, 0, 0, 0)
    _decode_attn_kernel[(Hkv, B, S) if heads_first else (B, Hkv, S)](
        q, q.stride(0), *args, lens, po, pml, out, 1.0 / math.sqrt(Dh), S, split_len,
        H=H, G=G, GP=max(16, triton.next_power_of_2(G)), DH=Dh, BT=block_t, KV_FP4=fp4_kv,
        ASM=asm and fp4_kv, F32=INTERPRET, SWZ=swizzled and fp4_kv, WORDS=words, FINAL=final, HEADS_FIRST=heads_first,
        num_warps=num_warps, num_stages=2, **({"maxnreg": maxnreg} if maxnreg and not INTERPRET else {}),
        **pdl.launch(q.device),
    )
    if not final:
        _merge_kernel[(B * H,)](po, pml, out, S, DH=Dh, SP=triton.next_power_of_2(S), num_warps=4,
                                **pdl.launch(po.device))
    return out


# ----------------------------------------------------------------------------- reference


# ----------------------------------------------------------------------------- new K/V: norm, RoPE, store


@triton.jit
def _rb(x):
    """Round float32 to BF16 and back (the model's BF16 ops round every result)."""
    return _bf16(x).to(tl.float32)


@triton.jit
def _norm_rope(row, j0, n, NP: tl.constexpr, w_ptr, c, s, eps, DH: tl.constexpr, QK_NORM: tl.constexpr):
    """Heads j0..j0+n of a qkv row (NP >= n, a power of two): per-head RMSNorm over Dh (weights w_ptr)
    and RoPE (c, s: this position's cos / sin); (y (NP, DH) BF16, head index, head mask)."""
    j = tl.arange(0, NP)
    jm = j < n
    d = tl.arange(0, DH)
    rot = (d + DH // 2) % DH
    x = tl.load(row + (j0 + j)[:, None] * DH + d[None, :], mask=jm[:, None], other=0.0).to(tl.float32)
    xr = tl.load(row + (j0 + j)[:, None] * DH + rot[None, :], mask=jm[:, None], other=0.0).to(tl.float32)
    if QK_NORM:
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / DH + eps)
        x = _rb(_rb(x * r[:, None]) * tl.load(w_ptr + d).to(tl.float32)[None, :])
        xr = _rb(_rb(xr * r[:, None]) * tl.load(w_ptr + rot).to(tl.float32)[None, :])
    xr = tl.where((d < DH // 2)[None, :], -xr, xr)
    return _bf16(_rb(x * c[None, :]) + _rb(xr * s[None, :])), j, jm


@triton.jit
def _qkv_post_kernel(qkv_ptr, sqkv, normw_ptr, cos_ptr, sin_ptr, scs, pos_ptr, q_ptr,
                     kd_ptr, vd_ptr, sdb, sdt, eps,
                     H: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, HP: tl.constexpr, KP: tl.constexpr,
                     QK_NORM: tl.constexpr, PDL: tl.constexpr = False):
    """Row b, every head: q/k RMSNorm over Dh (qk_norm 'head'), RoPE at pos[b]; q to q_ptr, k/v stored.
    One program a row, not a head: the cos/sin row is read once, and a 1776-row batch launches 1776
    programs instead of 64k one-warp ones (the per-head form took ~40 us a layer there on the H100)."""
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    d = tl.arange(0, DH)
    c = tl.load(cos_ptr + pos * scs + d).to(tl.float32)
    s = tl.load(sin_ptr + pos * scs + d).to(tl.float32)
    row = qkv_ptr + b * sqkv
    y, j, jm = _norm_rope(row, 0, H, HP, normw_ptr, c, s, eps, DH, QK_NORM)
    tl.store(q_ptr + (b * H + j)[:, None] * DH + d[None, :], y, mask=jm[:, None])
    y, j, jm = _norm_rope(row, H, HKV, KP, normw_ptr + DH, c, s, eps, DH, QK_NORM)
    dst = b * sdb + pos * sdt + j[:, None] * DH + d[None, :]
    tl.store(kd_ptr + dst, y, mask=jm[:, None])
    v = tl.load(row + (H + HKV + j)[:, None] * DH + d[None, :], mask=jm[:, None])
    tl.store(vd_ptr + dst, v, mask=jm[:, None])


def qkv_post(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             norm_w: torch.Tensor | None, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
             k_dst: torch.Tensor, v_dst: torch.Tensor, q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Split the fused q/k/v projection (B, (H + 2 Hkv) Dh), apply the per-head q/k RMSNorm
    (norm_w = stack([q_norm, k_norm]) (2, Dh), or None for qk_norm 'none') and RoPE (cos/sin
    tables (positions, Dh) BF16, as layers.rope_cos_sin), return q (B, H, Dh) and store k, v.

    k_dst / v_dst: (B, T, Hkv, Dh) BF16 views (a cache layer: row b's token goes to column
    pos[b]) or (B, Hkv, Dh) buffers (stride 0 along T: one new token per row).
    """
    B = qkv.shape[0]
    if q_out is None:
        q_out = torch.empty(B, n_heads, head_dim, device=qkv.device, dtype=torch.bfloat16)
    if k_dst.dim() == 3:
        sdb, sdt = k_dst.stride(0), 0
    else:
        sdb, sdt = k_dst.stride(0), k_dst.stride(1)
    if k_dst.stride() != v_dst.stride() or k_dst.stride(-1) != 1 or k_dst.stride(-2) != head_dim:
        raise ValueError("k_dst and v_dst must share strides and be contiguous over (Hkv, Dh)")
    if B:
        _qkv_post_kernel[(B,)](
            qkv, qkv.stride(0), norm_w if norm_w is not None else qkv, cos, sin, cos.stride(0), pos, q_out,
            k_dst, v_dst, sdb, sdt, eps, H=n_heads, HKV=n_kv_heads, DH=head_dim, HP=triton.next_power_of_2(n_heads),
            KP=triton.next_power_of_2(n_kv_heads), QK_NORM=norm_w is not None, num_warps=4,
            **pdl.launch(qkv.device),
        )
    return q_out



@triton.jit
def _cache_scale_byte(r):
    """Raw E4M3 scale byte (int32) -> its kernel scale byte (fp4_swizzle.cache_scale_bytes)."""
    e = r >> 3
    m = r & 7
    p = (m >= 2).to(tl.int32) + (m >= 4).to(tl.int32)  # a subnormal's leading bit
    b = tl.where(e > 0, ((e + 2) << 3) | m, (p << 3) | ((m << (3 - p)) & 7))
    return tl.where(r >= 0x7F, 161, b)  # NaN / negative: fp4_swizzle.NAN_BYTE


@triton.jit
def _swizzle_word(w):
    """int64 word of 8 natural codes -> the same codes re-placed (fp4_swizzle.swizzle_codes)."""
    n0, n1, n2, n3 = w & 15, (w >> 4) & 15, (w >> 8) & 15, (w >> 12) & 15
    n4, n5, n6, n7 = (w >> 16) & 15, (w >> 20) & 15, (w >> 24) & 15, (w >> 28) & 15
    r0 = (((n0 & 8) << 12) | ((n0 & 7) << 6)) | ((((n2 & 8) << 12) | ((n2 & 7) << 6)) << 16)
    r1 = (((n4 & 8) << 12) | ((n4 & 7) << 6)) | ((((n6 & 8) << 12) | ((n6 & 7) << 6)) << 16)
    r2 = (((n1 & 8) << 12) | ((n1 & 7) << 6)) | ((((n3 & 8) << 12) | ((n3 & 7) << 6)) << 16)
    r3 = (((n5 & 8) << 11) | ((n5 & 6) << 9) | ((n5 & 1) << 13)) | \
        ((((n7 & 8) << 11) | ((n7 & 6) << 9) | ((n7 & 1) << 13)) << 16)
    return r0 | (r1 >> 3) | (r2 >> 6) | r3


@triton.jit
def _kv_store_kernel(c_ptr, s_ptr, g_ptr, pos_ptr, cc_ptr, cs_ptr, cg_ptr,
                     ckv, cb, ct, skv, sb, st, gkv, gb, gt,
                     B, HKV: tl.constexpr, DH: tl.constexpr, SWZ: tl.constexpr, PDL: tl.constexpr = False):
    """Copy one quantized (kv, row, head) of the new token to the FP4 cache at column pos[row]
    (SWZ: codes swizzled, zero-scale blocks' codes zeroed, scales as kernel scale bytes)."""
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    r = tl.program_id(0)
    kv = (r // (B * HKV)).to(tl.int64)
    b = ((r // HKV) % B).to(tl.int64)
    h = r % HKV
    pos = tl.load(pos_ptr + b).to(tl.int64)
    dst = cc_ptr + kv * ckv + b * cb + pos * ct + h * (DH // 2)
    jb = tl.arange(0, DH // 16)
    sraw = tl.load(s_ptr + r * (DH // 16) + jb)
    if SWZ:
        jw = tl.arange(0, DH // 8)  # words: 8 codes, half a 16-element block
        src = c_ptr + r * (DH // 2) + 4 * jw
        w = tl.zeros((DH // 8,), tl.int64)
        for i in tl.static_range(4):
            w = w | (tl.load(src + i).to(tl.int64) << (8 * i))
        zero = tl.load(s_ptr + r * (DH // 16) + jw // 2) == 0
        w = tl.where(zero, 0, _swizzle_word(w))
        for i in tl.static_range(4):
            tl.store(dst + 4 * jw + i, ((w >> (8 * i)) & 255).to(tl.uint8))
        sout = _cache_scale_byte(sraw.to(tl.int32)).to(tl.uint8)
    else:
        j = tl.arange(0, DH // 2)
        tl.store(dst + j, tl.load(c_ptr + r * (DH // 2) + j))
        sout = sraw
    tl.store(cs_ptr + kv * skv + b * sb + pos * st + h * (DH // 16) + jb, sout)
    tl.store(cg_ptr + kv * gkv + b * gb + pos * gt + h, tl.load(g_ptr + r))


def kv_store_fp4(q: fp4.FP4Tensor, pos: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 gscale: torch.Tensor, swizzle: bool = False) -> None:
    """Write quantized new K and V, q of shape (2, B, Hkv, Dh) (per-row global scales), into one
    layer of an FP4 cache: codes (2, slots, T, Hkv, Dh//2), scales (uint8, .., Dh//16), gscale
    (.., 1) (FP4KVCache.codes[:, layer] etc.), row b at column pos[b]. `swizzle`: as
    fp4_swizzle.swizzle_blocks stores them, for `decode_attention(swizzled=True)`."""
    _, B, HKV, DH = q.shape
    if not q.codes.is_contiguous() or not q.scales.is_contiguous():
        raise ValueError("the quantized new K/V must be contiguous (2, B, Hkv, Dh//2) codes and (.., Dh//16) scales")
    if B:
        _kv_store_kernel[(2 * B * HKV,)](
            q.codes, q.scales.view(torch.uint8), q.global_scale, pos, codes, scales, gscale,
            codes.stride(0), codes.stride(1), codes.stride(2), scales.stride(0), scales.stride(1), scales.stride(2),
            gscale.stride(0), gscale.stride(1), gscale.stride(2), B, HKV=HKV, DH=DH, SWZ=swizzle, num_warps=1,
            **pdl.launch(q.codes.device),
        )


SWIZZLE_KV = True  # the decoder stores its FP4 KV cache swizzled where `kv_swizzle_check` passes
_KV_SWIZZLE_STATUS: dict[str, str] = {}


def kv_swizzle_check(device: torch.device | str = "cuda") -> str:
    """The FP4 store and attention on a swizzled cache against a natural one, once per device type.

    'swizzle ok' when the stored bytes equal `fp4_swizzle.swizzle_blocks` and the attention output
    is equal bit for bit (zero-scale blocks included); else 'swizzle off: <reason>', and the decoder
    keeps its cache natural. Like fp4_gemm.swizzle_check, it catches a compiler whose register
    layout does not hand the PTX one row word per 4 bytes."""
    kind = torch.device(device).type
    if kind in _KV_SWIZZLE_STATUS:
        return _KV_SWIZZLE_STATUS[kind]
    if kind == "cpu" and not INTERPRET:
        return "swizzle off: the kernels run on CUDA or in the interpreter"
    g = torch.Generator(device="cpu").manual_seed(7)
    B, H, Hkv, Dh, T = 2, 8, 2, 128, 48
    kv = torch.randn(2, B, T, Hkv, Dh, generator=g) * torch.rand(2, B, T, Hkv, 1, generator=g) * 4
    nat = fp4.quantize(kv, "nvfp4", per_row_global=True)
    nat.scales.view(torch.uint8)[:, 1, 5] = 0  # zero scales (the quantizer writes none; a foreign cache may)
    q = torch.randn(B, H, Dh, generator=g).bfloat16().to(device)
    lens = torch.tensor([T, T - 9], dtype=torch.int32, device=device)
    try:
        from tracerl.rollout.kvcache import FP4KVCache

        cache = FP4KVCache(2, B, T, Hkv, Dh, device=device)
        pos = torch.zeros(B, dtype=torch.int32, device=device)
        for t in range(T):  # the store kernel writes every column
            pos.fill_(t)
            col = fp4.FP4Tensor(nat.codes[:, :, t].contiguous(), nat.scales[:, :, t].contiguous(),
                                nat.global_scale[:, :, t].contiguous(), "nvfp4", torch.Size((2, B, Hkv, Dh)))
            kv_store_fp4(col.to(device), pos, cache.codes[:, 0], cache.scales[:, 0], cache.gscale[:, 0], swizzle=True)
        sc, ss = fp4_swizzle.swizzle_blocks(nat.codes, nat.scales)
        stored = torch.equal(cache.codes[:, 0].cpu(), sc) and torch.equal(cache.scales[:, 0].cpu(), ss)
        gs = nat.global_scale.to(device)
        n = [(nat.codes[i].to(device), nat.scales[i].view(torch.uint8).to(device), gs[i]) for i in (0, 1)]
        o0 = decode_attention(q, lens, k_fp4=n[0], v_fp4=n[1])
        o1 = decode_attention(q, lens, k_fp4=(cache.codes[0, 0], cache.scales[0, 0], cache.gscale[0, 0]),
                              v_fp4=(cache.codes[1, 0], cache.scales[1, 0], cache.gscale[1, 0]), swizzled=True)
        same = torch.equal(o0, o1)
    except Exception as e:  # a PTX or lowering error: keep the cache natural
        status = f"swizzle off: {type(e).__name__}: {str(e)[:200]}"
    else:
        status = ("swizzle ok" if stored and same else
                  f"swizzle off: {'the stored bytes differ' if not stored else 'the attention output differs'}"
                  " from the natural cache's")
    _KV_SWIZZLE_STATUS[kind] = status
    return status
