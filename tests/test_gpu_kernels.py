"""GPU decode kernels (kernels/fp4_gemm.py, kernels/fp4_attention.py) and the GPU decoder (rollout/gpu.py).

- CPU (CI): the PyTorch references against the model's and the engine's own ops.
- Interpreter (Triton installed, no CUDA): a subprocess with TRITON_INTERPRET=1 runs the kernel
  checks below on small shapes (the slow test also runs the tiny-model decoder end to end).
- GPU (`-m gpu`, skipped without CUDA): the same checks at realistic sizes, the PTX nibble path
  against the portable one (bit for bit), CUDA-graph replay against an eager step, and the
  decoder against the model's teacher-forced logits.

Tolerances (the kernels are not bit-exact with the CPU engine, see the module docstrings):
grouped GEMM with float32 output vs float64 of the same exact products: relative error < 1e-5;
BF16 outputs: within 1 BF16 ulp of the reference; attention vs float64 on exact K/V values:
relative error < 8e-3 (P enters the PV dot in BF16); route / dispatch / K/V store: exact.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracerl import fp4, qat
from tracerl.kernels import decode_reference as ref
from tracerl.kernels import fp4_swizzle as S

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:  # installed with the test extra on Linux x86-64; elsewhere only the CPU references run
    from tracerl.kernels import fp4_attention as fa
    from tracerl.kernels import fp4_gemm as fg
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not (CUDA and HAS_TRITON), reason="needs CUDA and triton")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _within_ulps(a: torch.Tensor, b: torch.Tensor, ulps: int = 1) -> bool:
    """BF16 tensors within `ulps` units in the last place (by the larger magnitude's exponent)."""
    a, b = a.float(), b.float()
    ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp(min=1e-30))) - 7)
    return bool(((a - b).abs() <= ulps * ulp + 1e-30).all())


# ----------------------------------------------------------------------------- checks (any device)


def _experts(E, O, K, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(E, O, K, generator=g) * 0.02).bfloat16()
    return w.to(dev), qat.quantize_weight(w, "nvfp4").to(dev)


def check_grouped_gemm(dev: str, **kw):
    """The grouped GEMM against its reference in every kernel variant (operand order, TMA weight loads, prefetch)."""
    saved = fg.SWAP_AB, fg.TMA_W, fg.PREFETCH, dict(fg.KERNEL_VARIANT)
    fg.KERNEL_VARIANT.clear()  # the module flags below choose the variant for every GEMM kind
    try:
        for fg.SWAP_AB, fg.TMA_W, fg.PREFETCH in ((False, False, False), (True, False, False), (False, True, False),
                                                 (True, True, False), (False, False, True)):
            _check_grouped_gemm(dev, **kw)
    finally:
        fg.SWAP_AB, fg.TMA_W, fg.PREFETCH = saved[:3]
        fg.KERNEL_VARIANT.clear()
        fg.KERNEL_VARIANT.update(saved[3])


def _check_grouped_gemm(dev: str, E=4, F=64, D=128, T=24, K=2):
    g = torch.Generator().manual_seed(1)
    w_gu, q_gu = _experts(E, 2 * F, D, dev, 1)
    w_dn, q_dn = _experts(E, D, F, dev, 2)
    x = torch.randn(T, D, generator=g).bfloat16().to(dev)
    ids, gates = fg.route_reference(torch.randn(T, E, generator=g).to(dev), K)
    offs, tok, pair, gs = fg.dispatch_reference(ids, gates, E)
    N = T * K
    for w in (w_gu, q_gu):
        y = fg.grouped_gemm(x, w, offs, row_idx=tok, n_rows=N, out_f32=True)
        r = fg.grouped_gemm_reference(x, w, offs, row_idx=tok, n_rows=N, out_f32=True)
        assert _rel(y, r) < 1e-5, ("f32", _rel(y, r))
        y = fg.grouped_gemm(x, w, offs, row_idx=tok, n_rows=N, swiglu=True)
        r = fg.grouped_gemm_reference(x, w, offs, row_idx=tok, n_rows=N, swiglu=True)
        # silu(g) * u: each factor may round the other way (the kernel's exp is approximate)
        assert _rel(y, r) < 4e-3, ("swiglu", _rel(y, r))
    xq = fp4.quantize(x.cpu(), "nvfp4", per_row_global=True).to(dev)
    y = fg.grouped_gemm(xq, q_gu, offs, row_idx=tok, n_rows=N, out_f32=True)
    r = fg.grouped_gemm_reference(xq, q_gu, offs, row_idx=tok, n_rows=N, out_f32=True)
    assert _rel(y, r) < 1e-5, ("w4a4", _rel(y, r))
    h = torch.randn(N, F, generator=g).bfloat16().to(dev)
    for w in (w_dn, q_dn):
        out = torch.full((N, D), float("nan"), device=dev)
        ref = torch.full((N, D), float("nan"), device=dev)
        fg.grouped_gemm(h, w, offs, dst_idx=pair, gate=gs, out=out)
        fg.grouped_gemm_reference(h, w, offs, dst_idx=pair, gate=gs, out=ref)
        assert not out.isnan().any()
        assert _rel(out, ref) < 4e-3
        # without the gate: the BF16 outputs, whose float32 products with the gates are `out` bit for bit
        out_b = torch.full((N, D), float("nan"), device=dev, dtype=torch.bfloat16)
        fg.grouped_gemm(h, w, offs, dst_idx=pair, out=out_b)
        g_pair = torch.empty(N, device=dev)
        g_pair[pair.long()] = gs
        assert torch.equal(out_b.float() * g_pair[:, None], out)
        with pytest.raises(ValueError, match="scatter writes into"):
            fg.grouped_gemm(h, w, offs, dst_idx=pair, out=out)  # float32 out without a gate
    wl = fp4.FP4Tensor(q_dn.codes[0], q_dn.scales[0], q_dn.global_scale[0].reshape(1), "nvfp4", torch.Size((D, F)))
    y = fg.fp4_linear(h, wl, out_f32=True)
    r = h.double() @ (fg.exact_values(wl).double() / wl.global_scale.double()).T
    assert _rel(y, r) < 1e-5


def check_fp4_linear_split_k(dev: str, M=5, O=96, K=768, splits=(2, 3, 6)):
    """fp4_linear with K split over programs (float32 partials added in split order): the reference's
    products to float32 rounding (BF16 outputs within one ulp), for BF16 and FP4 activations, natural
    and swizzled weights, 2, 3 and 6 splits of the 6 K tiles (`splits`), and the default split."""
    from tracerl.kernels.fp4_swizzle import SwizzledFP4

    g = torch.Generator().manual_seed(11)
    _, q = _experts(1, O, K, dev, 12)
    wl = fp4.FP4Tensor(q.codes[0], q.scales[0], q.global_scale[0].reshape(1), "nvfp4", torch.Size((O, K)))
    x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 3).bfloat16()
    xq = fp4.quantize(x, "nvfp4", per_row_global=True).to(dev)
    offs = torch.tensor([M], dtype=torch.int32, device=dev)
    for a in (x.to(dev), xq):
        ref = ref_f32 = fg.grouped_gemm_reference(a, q, offs, out_f32=True)
        for w in (wl, SwizzledFP4.of(wl)):
            y1 = fg.fp4_linear(a, w, out_f32=True, split_k=1)
            for split in (*splits, None):
                y = fg.fp4_linear(a, w, out_f32=True, split_k=split)
                assert _rel(y, ref_f32) < 1e-5 and _rel(y, y1) < 1e-6, (split, _rel(y, ref_f32))
                yb = fg.fp4_linear(a, w, split_k=split)
                assert yb.dtype == torch.bfloat16 and _within_ulps(yb, ref.bfloat16()), split
    steps = K // 128
    for bad in (0, steps + 1):
        with pytest.raises(ValueError, match=f"split_k={bad}: choose a divisor of the {steps} K tiles"):
            fg.fp4_linear(x.to(dev), wl, split_k=bad)
    n = 3
    with pytest.raises(ValueError, match="no swiglu"):
        fg.grouped_gemm(x.to(dev)[:n], q, torch.tensor([n], dtype=torch.int32, device=dev), swiglu=True, split_k=2)


def check_swizzled_gemm(dev: str, E=4, F=64, D=128, T=24, K=2):
    """Swizzled weights (kernels/fp4_swizzle.py) give the natural weights' outputs bit for bit, in every
    GEMM kind and kernel variant; and the device's swizzle check passes."""
    from tracerl.kernels.fp4_swizzle import SwizzledFP4

    g = torch.Generator().manual_seed(4)
    _, q_gu = _experts(E, 2 * F, D, dev, 5)
    _, q_dn = _experts(E, D, F, dev, 6)
    s_gu, s_dn = SwizzledFP4.of(q_gu), SwizzledFP4.of(q_dn)
    assert not torch.equal(s_gu.codes, q_gu.codes)
    x = torch.randn(T, D, generator=g).bfloat16().to(dev)
    xq = fp4.quantize(x.cpu(), "nvfp4", per_row_global=True).to(dev)
    ids, gates = fg.route_reference(torch.randn(T, E, generator=g).to(dev), K)
    offs, tok, pair, gs = fg.dispatch_reference(ids, gates, E)
    N = T * K
    h = torch.randn(N, F, generator=g).bfloat16().to(dev)
    saved = fg.SWAP_AB, fg.TMA_W, dict(fg.KERNEL_VARIANT)
    fg.KERNEL_VARIANT.clear()
    try:
        # SWAP_AB on swizzled weights is refused where the PTX nibble path runs (grouped_gemm says why)
        variants = ((False, False), (False, True)) if fg.USE_ASM else ((False, False), (True, False), (False, True))
        for fg.SWAP_AB, fg.TMA_W in variants:
            for a in (x, xq):
                for kw in ({"out_f32": True}, {"swiglu": True}):
                    y0 = fg.grouped_gemm(a, q_gu, offs, row_idx=tok, n_rows=N, **kw)
                    y1 = fg.grouped_gemm(a, s_gu, offs, row_idx=tok, n_rows=N, **kw)
                    assert torch.equal(y0, y1), (fg.SWAP_AB, fg.TMA_W, kw, _rel(y1, y0))
            outs = [torch.zeros(N, D, device=dev) for _ in range(2)]
            for w, out in zip((q_dn, s_dn), outs):
                fg.grouped_gemm(h, w, offs, dst_idx=pair, gate=gs, out=out)
            assert torch.equal(*outs)
            outs = [torch.zeros(N, D, device=dev, dtype=torch.bfloat16) for _ in range(2)]
            for w, out in zip((q_dn, s_dn), outs):
                fg.grouped_gemm(h, w, offs, dst_idx=pair, out=out)
            assert torch.equal(*outs)
        if fg.USE_ASM:
            fg.SWAP_AB, fg.TMA_W = True, False
            with pytest.raises(ValueError, match="SWAP_AB does not run on swizzled"):
                fg.grouped_gemm(x, s_gu, offs, row_idx=tok, n_rows=N, swiglu=True)
            fg.grouped_gemm(x, q_gu, offs, row_idx=tok, n_rows=N, swiglu=True)  # natural weights still swap
    finally:
        fg.SWAP_AB, fg.TMA_W = saved[:2]
        fg.KERNEL_VARIANT.clear()
        fg.KERNEL_VARIANT.update(saved[2])
    # w4a4: activations dequantized once before the GEMM (DEQUANT_A) or inside its K loop: same products
    hq = fp4.quantize(h.cpu(), "nvfp4", per_row_global=True).to(dev)
    try:
        for w, a, kw in ((q_gu, xq, {"row_idx": tok, "n_rows": N, "swiglu": True}),
                         (s_gu, xq, {"row_idx": tok, "n_rows": N, "out_f32": True}), (q_dn, hq, {"out_f32": True})):
            ys = []
            for fg.DEQUANT_A in (True, False):
                ys.append(fg.grouped_gemm(a, w, offs, **kw))
            assert torch.equal(*ys), (kw, _rel(*ys))
    finally:
        fg.DEQUANT_A = True
    wl = fp4.FP4Tensor(q_dn.codes[0], q_dn.scales[0], q_dn.global_scale[0].reshape(1), "nvfp4", torch.Size((D, F)))
    assert torch.equal(fg.fp4_linear(h, wl, out_f32=True), fg.fp4_linear(h, SwizzledFP4.of(wl), out_f32=True))
    # the references read swizzled weights through natural()
    r = fg.grouped_gemm_reference(x, s_gu, offs, row_idx=tok, n_rows=N, out_f32=True)
    assert torch.equal(r, fg.grouped_gemm_reference(x, q_gu, offs, row_idx=tok, n_rows=N, out_f32=True))
    assert fg.swizzle_check(dev) == "swizzle ok"


def check_row_tiles(dev: str):
    g = torch.Generator().manual_seed(5)
    cases = [[0, 5, 5, 40, 41, 41, 80, 100], [100] * 8, [0] * 7 + [100], [1, 2, 3],
             # many groups, more tiles in one group than a program writes per pass (CH)
             torch.multinomial(torch.ones(128), 1000, replacement=True, generator=g).bincount(minlength=128)
             .cumsum(0).tolist(), [0] * 127 + [5000]]
    for ends in cases:
        offs = torch.tensor(ends, dtype=torch.int32, device=dev)
        for bm in (16, 32):
            mt = fg.max_row_tiles(len(ends), ends[-1], bm)
            te, tm = fg.row_tiles(offs, bm, mt)
            want, s = [], 0
            for e, t in enumerate(ends):
                want += [(e, m) for m in range(s, t, bm)]
                s = t
            got = [(int(a), int(b)) for a, b in zip(te.tolist(), tm.tolist())]
            assert got[:len(want)] == want and all(a == -1 for a, _ in got[len(want):]), (ends[:8], bm)


def check_route_dispatch(dev: str, T=37, E=16, K=4):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(T, E, generator=g).to(dev)
    ids, gates = fg.route(logits, K)
    ir, gr = fg.route_reference(logits, K)
    assert torch.equal(ids, ir) and torch.allclose(gates, gr, rtol=1e-6, atol=1e-7)
    want = fg.dispatch_reference(ids, gates, E)
    saved = fg.DISPATCH_ONE_TILE
    for one_tile in (True, False):  # all pairs histogrammed in one tile, and chunk by chunk
        fg.DISPATCH_ONE_TILE = one_tile
        try:
            got = fg.dispatch(ids, gates, E)
        finally:
            fg.DISPATCH_ONE_TILE = saved
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), f"one_tile={one_tile}"


def _assert_launch_order_free(run, want: torch.Tensor | None) -> None:
    """run() gives the same bits with fa.HEADS_FIRST on and off (and equals `want` if given)."""
    saved = fa.HEADS_FIRST
    try:
        outs = []
        for hf in (True, False):
            fa.HEADS_FIRST = hf
            outs.append(run())
    finally:
        fa.HEADS_FIRST = saved
    assert torch.equal(outs[0], outs[1]), "the launch order changed the output"
    if want is not None:
        assert torch.equal(outs[0], want)


def check_attention(dev: str, B=3, H=8, Hkv=2, Dh=64, T=80, split_len=32, block_t=16):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, Dh, generator=g).bfloat16().to(dev)
    k = torch.randn(B, T, Hkv, Dh, generator=g).bfloat16()
    v = torch.randn(B, T, Hkv, Dh, generator=g).bfloat16()
    lens = torch.tensor(([1, T // 2 + 3, T] * B)[:B], dtype=torch.int32, device=dev)
    o = fa.decode_attention(q, lens, k=k.to(dev), v=v.to(dev), split_len=split_len, block_t=block_t)
    r = fa.decode_attention_reference(q, lens, k=k.to(dev), v=v.to(dev))
    assert _rel(o, r) < 8e-3, _rel(o, r)
    kq, vq = (fp4.quantize(t, "nvfp4", per_row_global=True).to(dev) for t in (k, v))
    kf = (kq.codes, kq.scales.view(torch.uint8), kq.global_scale)
    vf = (vq.codes, vq.scales.view(torch.uint8), vq.global_scale)
    o = fa.decode_attention(q, lens, k_fp4=kf, v_fp4=vf, split_len=split_len, block_t=block_t)
    r = fa.decode_attention_reference(q, lens, k_fp4=kf, v_fp4=vf)
    assert _rel(o, r) < 8e-3, _rel(o, r)
    # a swizzled cache (the decoder's) gives the same output bit for bit, zero-scale blocks included
    kq.scales.view(torch.uint8)[1, 7] = 0  # zero scales over nonzero codes (a foreign cache): zero K there
    n = [(t.codes.to(dev), t.scales.view(torch.uint8).to(dev), t.global_scale.to(dev)) for t in (kq, vq)]
    sw = [(*(x.to(dev) for x in S.swizzle_blocks(t.codes, t.scales)), t.global_scale.to(dev)) for t in (kq, vq)]
    o0 = fa.decode_attention(q, lens, k_fp4=n[0], v_fp4=n[1], split_len=split_len, block_t=block_t)
    o1 = fa.decode_attention(q, lens, k_fp4=sw[0], v_fp4=sw[1], split_len=split_len, block_t=block_t, swizzled=True)
    assert torch.equal(o0, o1)
    # neither a register cap (spills move no arithmetic) nor the portable nibble decode changes a bit
    o2 = fa.decode_attention(q, lens, k_fp4=sw[0], v_fp4=sw[1], split_len=split_len, block_t=block_t, swizzled=True,
                             maxnreg=128)
    o3 = fa.decode_attention(q, lens, k_fp4=sw[0], v_fp4=sw[1], split_len=split_len, block_t=block_t, swizzled=True,
                             asm=False)
    # the swizzled cache decoded by whole words (PTX; the interpreter runs the byte path) is the same too
    o4 = fa.decode_attention(q, lens, k_fp4=sw[0], v_fp4=sw[1], split_len=split_len, block_t=block_t, swizzled=True,
                             words=True)
    assert torch.equal(o1, o2) and torch.equal(o1, o3) and torch.equal(o1, o4)
    _assert_launch_order_free(lambda: fa.decode_attention(q, lens, k_fp4=sw[0], v_fp4=sw[1], split_len=split_len,
                                                          block_t=block_t, swizzled=True), o1)
    _assert_launch_order_free(lambda: fa.decode_attention(q, lens, k=k.to(dev), v=v.to(dev), split_len=T,
                                                          block_t=block_t), None)  # one split: in-kernel output
    assert fa.kv_swizzle_check(dev) == "swizzle ok"
    check_single_split_output(dev, q, lens, [dict(k=k.to(dev), v=v.to(dev)), dict(k_fp4=n[0], v_fp4=n[1]),
                                             dict(k_fp4=sw[0], v_fp4=sw[1], swizzled=True)], T, block_t=block_t)


def check_single_split_output(dev: str, q, lens, caches: list[dict], T: int, **kw) -> None:
    """With one split the kernel writes o / l itself (fa.FUSE_SINGLE_SPLIT): the same bits as its
    partials through the merge; with several splits the flag changes nothing."""
    saved = fa.FUSE_SINGLE_SPLIT
    try:
        for cache in caches:
            outs = {}
            for fa.FUSE_SINGLE_SPLIT in (True, False):
                outs[fa.FUSE_SINGLE_SPLIT] = fa.decode_attention(q, lens, split_len=T, **cache, **kw)
            assert torch.equal(outs[True], outs[False]), (list(cache), _rel(outs[True], outs[False]))
    finally:
        fa.FUSE_SINGLE_SPLIT = saved


def check_kv_store_swizzled(dev: str, B=8, Hkv=2, Dh=128):
    """The swizzling FP4 store writes fp4_swizzle.swizzle_blocks' bytes, for every one of the 256 scale bytes."""
    from tracerl.rollout.kvcache import FP4KVCache

    g = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 256, (2, B, Hkv, Dh // 2), generator=g, dtype=torch.uint8)
    scales = torch.randperm(256, generator=g).to(torch.uint8).reshape(2, B, Hkv, Dh // 16)
    gs = torch.rand(2, B, Hkv, 1, generator=g) * 1000 + 1
    qq = fp4.FP4Tensor(codes, scales.view(torch.float8_e4m3fn), gs, "nvfp4", torch.Size((2, B, Hkv, Dh))).to(dev)
    cache = FP4KVCache(2, B, 6, Hkv, Dh, device=dev)
    pos = torch.tensor([5, 0, 3, 1, 2, 4, 0, 5][:B], dtype=torch.int32, device=dev)
    fa.kv_store_fp4(qq, pos, cache.codes[:, 1], cache.scales[:, 1], cache.gscale[:, 1], swizzle=True)
    rows = torch.arange(B, device=dev)
    want_c, want_s = S.swizzle_blocks(codes, scales)
    assert torch.equal(cache.codes[:, 1][:, rows, pos.long()].cpu(), want_c)
    assert torch.equal(cache.scales[:, 1][:, rows, pos.long()].cpu(), want_s)
    assert torch.equal(cache.gscale[:, 1][:, rows, pos.long()].cpu(), gs)


def check_qkv_post_and_store(dev: str, B=3, H=4, Hkv=2, Dh=32, T=10, qk_norm=True):
    from tracerl.model.layers import rope_cos_sin

    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(B, (H + 2 * Hkv) * Dh, generator=g).bfloat16().to(dev)
    normw = (1 + 0.1 * torch.randn(2, Dh, generator=g)).bfloat16().to(dev) if qk_norm else None
    cos, sin = rope_cos_sin(torch.arange(T, device=dev)[None], Dh, 1e6, torch.bfloat16)
    cos, sin = cos[0].contiguous(), sin[0].contiguous()
    pos = torch.tensor([0, 4, 9][:B], dtype=torch.int32, device=dev)
    kc = torch.zeros(B, T, Hkv, Dh, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    q = fa.qkv_post(qkv, pos, cos, sin, normw, H, Hkv, Dh, 1e-6, kc, vc)
    qr, kr, vr = fa.qkv_post_reference(qkv, pos, cos, sin, normw, H, Hkv, Dh, 1e-6)
    rows = torch.arange(B, device=dev)
    # the kernel's sqrt/division are the fast ones, so a norm factor may differ in its last bits and
    # RoPE's x*cos + rot(x)*sin can round either way; where the sum cancels that is many ulps of a
    # tiny result, so the bound is relative to the vectors (on the CPU interpreter they agree exactly)
    assert _rel(q, qr) < 4e-3 and _rel(kc[rows, pos.long()], kr) < 4e-3
    if dev == "cpu":
        assert torch.equal(q, qr) and torch.equal(kc[rows, pos.long()], kr)
    assert torch.equal(vc[rows, pos.long()], vr)
    assert int(kc.count_nonzero()) == int(kr.count_nonzero()) and int(vc.count_nonzero()) == int(vr.count_nonzero())
    if H != 4 or not qk_norm:
        return
    # the FP4 store: quantized new K/V land at (row, pos[row]) bit for bit
    from tracerl.rollout.kvcache import FP4KVCache

    cache = FP4KVCache(2, B, T, Hkv, Dh, device=dev)
    kv = torch.stack([kr, vr]).contiguous()
    qq = fp4.quantize(kv.cpu(), "nvfp4", per_row_global=True).to(dev)
    fa.kv_store_fp4(qq, pos, cache.codes[:, 1], cache.scales[:, 1], cache.gscale[:, 1])
    assert torch.equal(cache.codes[:, 1][:, rows, pos.long()], qq.codes)
    assert torch.equal(cache.scales[:, 1][:, rows, pos.long()], qq.scales.view(torch.uint8))
    assert torch.equal(cache.gscale[:, 1][:, rows, pos.long()], qq.global_scale)
    assert int(cache.codes[:, 0].count_nonzero()) == 0


def check_norm_and_sample(dev: str, B=4, D=96, V=300):
    from tracerl.rollout import gpu

    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, D, generator=g).bfloat16().to(dev)
    y = torch.randn(B, 3, D, generator=g).to(dev)
    w = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16().to(dev)
    x1, h = x.clone(), torch.empty_like(x)
    gpu.add_rmsnorm(x1, y, w, 1e-6, h)
    xr = x + y.sum(1).bfloat16()
    hf = xr.float()
    hr = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(x1, xr) and _within_ulps(h, hr, 1)
    # BF16 expert outputs gated here: the same float32 products as gated outputs, the same bits out
    yb, gates = y.bfloat16(), torch.rand(B, 3, generator=g).to(dev)
    x2, h2, x3, h3 = x.clone(), torch.empty_like(x), x.clone(), torch.empty_like(x)
    gpu.add_rmsnorm(x2, yb, w, 1e-6, h2, gates=gates)
    gpu.add_rmsnorm(x3, yb.float() * gates[..., None], w, 1e-6, h3)
    assert torch.equal(x2, x3) and torch.equal(h2, h3) and not torch.equal(x2, x1)
    with pytest.raises(ValueError, match="gates go with BF16"):
        gpu.add_rmsnorm(x.clone(), y, w, 1e-6, h, gates=gates)
    with pytest.raises(ValueError, match="without gates must be float32"):
        gpu.add_rmsnorm(x.clone(), yb, w, 1e-6, h)
    logits = torch.randn(B, V, generator=g).to(dev)
    tok = torch.empty(B, dtype=torch.long, device=dev)
    lp = torch.empty(B, device=dev)
    seed = torch.zeros(1, dtype=torch.long, device=dev)
    gpu.sample_tokens(logits, 0.0, seed, tok, lp)
    ls = torch.log_softmax(logits, -1)
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(lp, ls.gather(-1, tok[:, None])[:, 0], atol=1e-5)
    gpu.sample_tokens(logits, 0.7, seed, tok, lp)
    assert torch.allclose(lp, torch.log_softmax(logits / 0.7, -1).gather(-1, tok[:, None])[:, 0], atol=1e-5)


def check_sampler_distribution(dev: str) -> None:
    """sample_tokens draws from softmax(logits / T): token counts over many rows (each row its own
    Philox counters) against the probabilities, within one vocabulary chunk and across two."""
    from tracerl.rollout import gpu

    B, V, T = 800, 6, 0.7
    logits = torch.tensor([0.3, -0.6, 1.1, 0.0, -0.2, 0.7]).expand(B, V).contiguous().to(dev)
    tok = torch.empty(B, dtype=torch.long, device=dev)
    lp = torch.empty(B, device=dev)
    gpu.sample_tokens(logits, T, torch.tensor([123], device=dev), tok, lp)
    p = torch.softmax(logits[0].double().cpu() / T, -1)
    counts = torch.bincount(tok.cpu(), minlength=V).double()
    chi2 = float(((counts - B * p) ** 2 / (B * p)).sum())
    assert chi2 < 25, (chi2, counts.tolist(), (B * p).tolist())  # 5 dof: P(chi2 > 25) ~ 1e-4
    # the same rows as if at temperature 1 would be another distribution: the test can tell them apart
    p1 = torch.softmax(logits[0].double().cpu(), -1)
    assert float(((counts - B * p1) ** 2 / (B * p1)).sum()) > 25
    # two BV chunks: the mass split 1:3 between a token in each; another seed, other draws
    B, V = 256, 5000
    lg = torch.full((B, V), -30.0)
    lg[:, 3], lg[:, 4500] = 0.0, math.log(3.0)
    tok = torch.empty(B, dtype=torch.long, device=dev)
    lp = torch.empty(B, device=dev)
    gpu.sample_tokens(lg.to(dev), 1.0, torch.tensor([7], device=dev), tok, lp)
    n_hi = int((tok == 4500).sum())
    assert int(((tok == 3) | (tok == 4500)).sum()) == B and abs(n_hi - 192) < 35, n_hi  # 5 sigma
    tok2 = torch.empty_like(tok)
    gpu.sample_tokens(lg.to(dev), 1.0, torch.tensor([8], device=dev), tok2, lp)
    assert not torch.equal(tok, tok2)


def check_sample_splits(dev: str) -> None:
    """The vocabulary split over programs (+ merge) draws the tokens one program a row draws; the
    logprobs agree to float32 rounding (log-sum-exp merged in another order)."""
    from tracerl.rollout import gpu

    g = torch.Generator().manual_seed(9)
    B, V = 3, 3 * 4096 + 1000  # four 4096-element tiles, the last ragged
    logits = (torch.randn(B, V, generator=g) * 3).to(dev)
    logits[0, 7] = logits[0, 3 * 4096 + 5] = logits[0].max() + 1  # a greedy tie across spans
    seed = torch.tensor([5], device=dev)
    for temp in (0.0, 0.7):
        want_t = torch.empty(B, dtype=torch.long, device=dev)
        want_lp = torch.empty(B, device=dev)
        gpu.sample_tokens(logits, temp, seed, want_t, want_lp, splits=1)
        for ns in (2, 3, 4, 9):
            tok = torch.empty_like(want_t)
            lp = torch.empty_like(want_lp)
            gpu.sample_tokens(logits, temp, seed, tok, lp, splits=ns)
            assert torch.equal(tok, want_t), (temp, ns, tok.tolist(), want_t.tolist())
            assert torch.allclose(lp, want_lp, rtol=0, atol=2e-5), (temp, ns)
        if temp == 0.0:
            assert int(want_t[0]) == 7  # the first of two equal maxima, as torch.argmax
    ls = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, want_t[:, None])[:, 0].float()
    assert torch.allclose(want_lp, ls, atol=2e-5)
    assert gpu.sample_splits(16, 151936, torch.device(dev)) > 1 and gpu.sample_splits(4096, 151936,
                                                                                       torch.device(dev)) == 1
    with pytest.raises(ValueError, match="splits"):
        gpu.sample_tokens(logits, 0.7, seed, want_t, want_lp, splits=0)


def check_quant_row_tiles(dev: str, M=4096, K=384) -> None:
    """The per-row-global quantize at many short rows (8 rows a program by default) against the torch
    reference bit for bit: codes, scales, global scales and the BF16 dequant output (K = 384: the
    second 256-column tile half masked)."""
    from tracerl.kernels import fp4_quant as fq
    from tracerl.kernels.record_sink import RecordSink

    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(11)) * 3).bfloat16()
    assert fq._tile(M, K, 16, None, True)[0] == 8 and fq._tile(M // 2, K, 16, None, True)[0] == 1
    dq = torch.empty(M, K, dtype=torch.bfloat16, device=dev)
    # recorded as the down GEMM's input is: expert-sorted (token, k) pairs, 8 a token
    src = torch.randperm(M, generator=torch.Generator().manual_seed(12)).to(device=dev, dtype=torch.int32)
    sink = RecordSink(torch.zeros(M, K // 2, dtype=torch.uint8, device=dev), torch.zeros(M, K // 16, dtype=torch.uint8,
                      device=dev), torch.zeros(M, device=dev), torch.arange(M // 8, device=dev), src=src, group=8)
    q = fq.quantize(x.to(dev), "nvfp4", per_row_global=True, dequant_out=dq, sink=sink)[0]
    rows = sink.dest_rows(M).long()
    assert torch.equal(sink.codes[rows], q.codes) and torch.equal(sink.scales[rows], q.scales.view(torch.uint8))
    assert torch.equal(sink.gscale[rows], q.global_scale.reshape(-1))
    r = fp4.quantize(x, "nvfp4", per_row_global=True)
    assert torch.equal(q.codes.cpu(), r.codes) and torch.equal(q.scales.view(torch.uint8).cpu(), r.scales.view(torch.uint8))
    assert torch.equal(q.global_scale.cpu(), r.global_scale)
    unit = fp4.FP4Tensor(r.codes, r.scales, torch.ones_like(r.global_scale), "nvfp4", r.shape)
    assert torch.equal(dq.cpu(), fp4.dequantize(unit, torch.bfloat16))


def check_all(dev: str) -> None:
    check_row_tiles(dev)
    check_grouped_gemm(dev)
    check_fp4_linear_split_k(dev)
    check_swizzled_gemm(dev)
    check_route_dispatch(dev)
    check_attention(dev)
    check_qkv_post_and_store(dev)
    # head counts that are not powers of two (masked head rows), no q/k norm, the 30B model's heads
    check_qkv_post_and_store(dev, H=6, Hkv=3)
    check_qkv_post_and_store(dev, qk_norm=False)
    check_qkv_post_and_store(dev, B=2, H=32, Hkv=4, Dh=128)
    check_kv_store_swizzled(dev)
    check_norm_and_sample(dev)
    check_sampler_distribution(dev)
    check_sample_splits(dev)


def _engine_reference(m, packed, recipe, prompts, record=None):
    """Teacher-forced logits of the engine's CPU path: the model with RolloutQuant (FP4 weights dequantized)."""
    from tracerl.rollout.recorder import RolloutQuant

    weights = {k: fp4.dequantize(v, torch.bfloat16) for k, v in packed.items() if isinstance(v, fp4.FP4Tensor)}
    em = copy.deepcopy(m).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in em.named_parameters():
            if name in packed.tensors and not isinstance(packed[name], fp4.FP4Tensor):
                p.copy_(packed[name])

    class Handler(RolloutQuant):
        def act(self, site, x):
            if record is not None and site.endswith("_cache"):
                record[site] = x.detach().clone()
            return super().act(site, x)

    with torch.no_grad():
        return em(prompts, quant=Handler(recipe, weights, None))


def check_decoder(dev: str, recipes=("bf16", "w4a16", "w4a4", "w4a4kv4"), B=2, P=5) -> None:
    """The tiny model through GPUDecoder vs the engine's CPU computation (teacher-forced logits)."""
    from tracerl import model as M
    from tracerl.rollout.gpu import DecoderWeights, GPUDecoder

    m = M.build("tiny", seed=0)
    prompts = torch.randint(0, m.config.vocab_size, (B, P), generator=torch.Generator().manual_seed(6))
    for spec in recipes:  # NAME or NAME:SITES
        recipe = qat.Recipe.parse(spec)
        packed = m.pack_weights(recipe, dtype=torch.bfloat16)
        dec = GPUDecoder(DecoderWeights.from_packed(m.config, packed, device=dev), batch=B, max_len=16,
                         temperature=0.0)
        got = dec.prefill(prompts.to(dev)).cpu()
        rec = {}
        ref = _engine_reference(m, packed, recipe, prompts, rec)
        # FP4 mismatches compound through depth (the effect TRACE removes), so the KV recipe gets a
        # looser end-to-end bound; its first layer's K/V codes may differ only where the GPU GEMM's
        # accumulation order moves a value across a rounding midpoint (exactly equal on the CPU)
        tol = 0.12 if recipe.kv else 0.03
        if recipe.acts and recipe.sites == "all-linear":
            # FP4 inputs of every attention projection: in the tiny random model the CPU reference
            # itself moves 0.21 (w4a4) / 0.25 (w4a4kv4) between BF16 and float32 compute; a wrong
            # scale or layout gives > 1
            tol = 0.3
            # their BF16 c * s8 came from the quantize pass (no dequantize launch): q/k/v and o inputs
            want = {(B, m.config.hidden_size), (B, m.config.num_heads * m.config.head_dim)} if dec.fused_dequant else set()
            assert set(dec.dq_linear) == want, sorted(dec.dq_linear)
        assert _rel(got, ref) < tol, (spec, _rel(got, ref))
        if recipe.kv:
            for kv, site in enumerate(("k_cache", "v_cache")):
                q = fp4.quantize(rec[f"layers.0.attn.{site}"], "nvfp4", per_row_global=True)
                mine = dec.cache.codes[kv, 0, :, :P].cpu()
                if dec.kv_swizzled:
                    mine = S.unswizzle_codes(mine)
                same = ((mine & 15) == (q.codes & 15)).float().mean() + ((mine >> 4) == (q.codes >> 4)).float().mean()
                # (FP4 q/k/v projections: their float32 sums are not the reference's BF16 matmul's, on CPU too)
                exact = dev == "cpu" and not (recipe.acts and recipe.sites == "all-linear")
                assert same / 2 >= (1.0 if exact else 0.97), (site, float(same / 2))
        toks, lps = dec.decode(3)
        assert toks.shape == (B, 3) and bool(torch.isfinite(lps).all())


# ----------------------------------------------------------------------------- CPU (references)


def test_exact_values_are_dequantize_times_global_scale():
    w = torch.randn(3, 32, 64).bfloat16()
    q = qat.quantize_weight(w, "nvfp4")
    assert torch.allclose(ref.exact_values(q) / q.global_scale, fp4.dequantize(q, torch.float32), rtol=1e-6, atol=0)


def test_grouped_reference_matches_model_experts_matmul():
    from tracerl.model.moe import experts_matmul_loop

    w = torch.randn(4, 48, 32)
    x = torch.randn(10, 32)
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    assert torch.allclose(ref.grouped_gemm_reference(x, w, offs, out_f32=True), experts_matmul_loop(x, w, offs), atol=1e-5)


def test_route_and_dispatch_reference_follow_the_model():
    from tracerl.model.moe import gate_weights

    logits = torch.randn(9, 8)
    ids, gates = ref.route_reference(logits, 2)
    assert torch.allclose(gates, gate_weights(logits, ids.long(), "softmax_topk", True))
    offs, tok, pair, gs = ref.dispatch_reference(ids, gates, 8)
    assert torch.equal(ids.reshape(-1)[pair.long()].sort().values, ids.reshape(-1)[pair.long()])
    assert torch.equal(tok, pair // 2) and int(offs[-1]) == 18


def test_attention_reference_matches_engine_split_kv():
    from tracerl.rollout.attention import split_kv_attention

    B, H, Hkv, Dh, T = 2, 4, 2, 32, 20
    q, k, v = torch.randn(B, H, Dh), torch.randn(B, T, Hkv, Dh), torch.randn(B, T, Hkv, Dh)
    lens = torch.tensor([7, 20])
    mask = (torch.arange(T)[None] < lens[:, None])[:, None, None]
    e = split_kv_attention(q[:, None], k, v, mask).transpose(1, 2).reshape(B, H * Dh)
    assert _rel(ref.decode_attention_reference(q, lens, k=k, v=v), e) < 1e-6


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_split_len_for_fills_the_target_programs_with_whole_tiles():
    """Splits are whole BT tiles covering the cache, about SPLIT_PROGRAMS programs, never fewer than one split."""
    assert fa.split_len_for(1024, 16, 4, target_programs=256) == 256  # 64 (slot, head) pairs x 4 splits
    assert fa.split_len_for(8192, 16, 4, target_programs=256) == 2048
    assert fa.split_len_for(1024, 256, 4) == 1024  # already 1024 pairs: one split each
    assert fa.split_len_for(1024, 16, 4) == 256  # the default target: 256 programs
    assert fa.split_len_for(1000, 1, 1, block_t=64) == 64  # capped at one tile per split: 16 splits
    assert fa.split_len_for(1024, 16, 4, target_programs=1024) == 64
    assert fa.split_len_for(1024, 16, 4) == fa.split_len_for(1024, 16, 4, target_programs=fa.SPLIT_PROGRAMS)
    for max_len, batch, bt in ((1, 1, 64), (100, 3, 32), (8192, 240, 64), (5000, 7, 128)):
        sl = fa.split_len_for(max_len, batch, 4, block_t=bt)
        assert sl % bt == 0 and sl >= bt and -(-max_len // sl) * sl >= max_len


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_decoder_split_follows_the_tuned_attention_config(monkeypatch):
    """The decoder's static split uses the tile and program target tuned for its cache format, not the default."""
    from tracerl import model as M
    from tracerl.rollout.gpu import DecoderWeights, GPUDecoder

    m = M.build("tiny", seed=0)
    packed = m.pack_weights(qat.Recipe("w4a4kv4"))
    w = DecoderWeights.from_packed(m.config, packed, device="cpu")
    # 4 slots x 2 KV heads = 8 (slot, head) pairs over 512 positions
    assert GPUDecoder(w, batch=4, max_len=512, use_graph=False).split_len == 64  # default: 256 programs, BT=64
    monkeypatch.setitem(fa.TUNED, True, fa.AttentionConfig(block_t=32, num_warps=4, programs=16))
    assert GPUDecoder(w, batch=4, max_len=512, use_graph=False).split_len == 256  # 2 splits of 8 BT=32 tiles
    # a BF16 cache reads its own entry, still the default here
    wb = DecoderWeights.from_packed(m.config, m.pack_weights(qat.Recipe("bf16")), device="cpu")
    assert GPUDecoder(wb, batch=4, max_len=512, use_graph=False).split_len == 64
    # from the large-launch threshold (batch x cache length) up, the large config; the mma kernel's
    # split is whole tile pairs
    monkeypatch.setitem(fa.TUNED_LARGE, True, (2048, fa.AttentionConfig(16, 1, 24, None, True, "mma")))
    assert fa.attention_config(True, 4, 512).kernel == "mma" and fa.attention_config(True, 3, 512).kernel == "triton"
    assert fa.attention_config(True, 2, 1024).kernel == "mma"  # a longer cache reaches it at a smaller batch
    assert fa.attention_config(True, 4).kernel == "triton"  # no cache length: the small-launch config
    # on CPU (and for shapes it lacks) the mma kernel cannot run: the decoder splits for the Triton kernel
    assert GPUDecoder(w, batch=4, max_len=512, use_graph=False).split_len == 256
    monkeypatch.setattr(fa, "mma_usable", lambda *a, **k: True)
    assert GPUDecoder(w, batch=3, max_len=512, use_graph=False).split_len == 256  # below it: TUNED
    assert GPUDecoder(w, batch=4, max_len=512, use_graph=False).split_len == 192  # 3 splits of 6 tile pairs


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_mma_selfcheck_turns_the_mma_kernels_off_when_they_disagree(monkeypatch):
    """The first-use check: a kernel whose output differs from the Triton kernel's, or that raises,
    switches the mma path off (cached per device); agreement keeps it on."""
    calls = []

    def fake(q, lens, *, kernel=None, split_len=None, **kw):
        calls.append((kernel, split_len))
        o = torch.ones(q.shape[0], q.shape[1] * q.shape[2])
        return o * (1.02 if kernel == bad else 1.0)

    monkeypatch.setattr(fa, "decode_attention", fake)
    for bad, want in ((None, "mma ok"), ("mma-pos", "mma off: mma-pos differs")):
        monkeypatch.setattr(fa, "_MMA_STATUS", {})
        calls.clear()
        assert fa.mma_selfcheck("cpu").startswith(want)
        assert fa.mma_selfcheck("cpu").startswith(want) and calls[0] == ("triton", 32)  # cached: no new calls
        if bad is None:
            assert {k for k, _ in calls} == {"triton", *fa.MMA_KERNELS} and {s for _, s in calls} == {32, 96}

    def boom(*a, **kw):
        raise RuntimeError("PTX lowering failed")

    monkeypatch.setattr(fa, "decode_attention", boom)
    monkeypatch.setattr(fa, "_MMA_STATUS", {})
    assert fa.mma_selfcheck("cpu") == "mma off: RuntimeError: PTX lowering failed"


@gpu
@pytest.mark.gpu
def test_mma_selfcheck_gpu():
    assert fa.mma_selfcheck("cuda") == "mma ok"
    assert fa.mma_usable(True, 32, 4, 128, True, "cuda")


def test_effective_attention_config(monkeypatch):
    """The config a launch runs: tuned per batch, a forced kernel at its own defaults, and the Triton
    kernel at its config (not the mma one's single warp) where the mma kernel cannot run."""
    small = fa.AttentionConfig(64, 2, 512, None, True, "triton")
    large = fa.AttentionConfig(16, 1, 2048, None, True, "mma")
    monkeypatch.setitem(fa.TUNED, True, small)
    monkeypatch.setitem(fa.TUNED_LARGE, True, (65536, large))
    assert fa.effective_config(True, 16, 1024) == small and fa.effective_config(True, 64, 1024) == large
    assert fa.effective_config(True, 64, 1024, mma_ok=False) == small
    assert fa.effective_config(True, 64, 1024, kernel="triton") == small
    assert fa.effective_config(True, 16, 1024, kernel="mma") == fa.MMA_DEFAULTS["mma"]
    assert fa.MMA_DEFAULT == fa.MMA_DEFAULTS["mma-pos"] and fa.MMA_DEFAULT.maxnreg == 144
    monkeypatch.setitem(fa.TUNED_LARGE, True, None)  # tuned: one config at every batch
    assert fa.effective_config(True, 64, 1024) == small
    monkeypatch.setitem(fa.TUNED, True, fa.MMA_DEFAULT)  # mma tuned everywhere, but not runnable here
    assert fa.effective_config(True, 16, 1024, mma_ok=False) == fa.DEFAULT_CONFIG
    # untuned: the Triton kernel's default, and for an FP4 cache the mma kernel from DEFAULT_LARGE's
    # row positions (1k B=64, 8k B=8)
    monkeypatch.delitem(fa.TUNED, True)
    monkeypatch.delitem(fa.TUNED_LARGE, True)
    assert fa.effective_config(True, 63, 1024) == fa.DEFAULT_CONFIG and fa.effective_config(False, 512, 1024) == fa.DEFAULT_CONFIG
    assert fa.effective_config(True, 64, 1024) == fa.MMA_DEFAULT
    assert fa.effective_config(True, 16, 8192) == fa.MMA_DEFAULT and fa.effective_config(True, 7, 8192) == fa.DEFAULT_CONFIG
    assert fa.DEFAULT_LARGE[True][0] == fa.LARGE_ROW_POSITIONS == 65536
    assert fa.effective_config(True, 64, 1024, mma_ok=False) == fa.DEFAULT_CONFIG
    with pytest.raises(ValueError, match="choose one of"):
        fa.effective_config(True, 16, 1024, kernel="cuda")
    # a forced mma kernel takes the tuned mma config's launch parameters with its own register cap
    # (the heads kernel spills at the positions kernel's 144), else its own default
    assert fa.effective_config(True, 64, 1024, kernel="mma-pos") == fa.MMA_DEFAULT
    assert fa.effective_config(True, 64, 1024, kernel="mma") == fa.MMA_DEFAULT._replace(kernel="mma", maxnreg=None)
    monkeypatch.setitem(fa.TUNED_LARGE, True, (65536, large))
    assert fa.effective_config(True, 64, 1024, kernel="mma-pos") == large._replace(kernel="mma-pos", maxnreg=144)
    assert fa.effective_config(True, 64, 1024, kernel="mma-pos", mma_ok=False) == fa.DEFAULT_CONFIG
    assert fa.AttentionConfig(16, 1, kernel="mma-pos").split_block == 32
    assert not fa.mma_usable(True, 32, 4, 128, True, "cpu")  # Gluon has no interpreter


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_pdl_applies_only_where_enabled_on_sm90(monkeypatch):
    """PDL is opt-in, never on CPU tensors or in the interpreter; the compile check may assume sm_90."""
    from tracerl.kernels import pdl

    assert pdl.ENABLED is False and pdl.launch("cpu") == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert not pdl.on("cpu")
    monkeypatch.setattr(pdl, "ASSUME_SM90", True)
    assert pdl.launch("cpu") == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_INTERPRET", True)
    assert not pdl.on("cpu")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_split_k_fills_idle_sms_at_decode_batches(monkeypatch):
    """K splits reach SPLIT_K_PROGRAMS at decode batches (o_proj at 16 rows: 32 column tiles -> 8 splits
    of 4 of its 32 K tiles), divide the K tiles, keep two a split, and stay off where the tiles already
    fill the GPU."""
    assert fg.SPLIT_K_PROGRAMS == 256
    assert fg.split_k_for(32, 32) == 8 and fg.split_k_for(80, 16) == 2  # (3 does not divide 16)
    assert fg.split_k_for(40, 12) == 6 and fg.split_k_for(50, 12) == 4
    assert fg.split_k_for(32, 4) == 2 and fg.split_k_for(1, 3) == 1  # at least two K tiles a split
    assert fg.split_k_for(896, 32) == 1 and fg.split_k_for(200, 32) == 1
    assert fg.split_k_for(32, 32, max_split=4) == 4 and fg.split_k_for(32, 32, max_split=0) == 1
    monkeypatch.setattr(fg, "SPLIT_K", False)
    assert fg.split_k_for(32, 32) == 1


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_gemm_config_follows_rows_per_expert(monkeypatch):
    """pick_bm + TUNED at decode batches; fg.LARGE's last reached entry past its thresholds; BF16 weights
    never take the FP4 tiles; row tiles a caller passes keep their BM."""
    monkeypatch.setattr(fg, "TUNED", {(True, True, True): (64, 64, 8, 2)})
    monkeypatch.setattr(fg, "LARGE", {(True, True, True): [(24.0, (32, 128, 128, 4, 2)), (80.0, (128, 128, 128, 8, 4))]})
    gu = (True, True, True)
    assert fg.gemm_config(gu, 4.0) == (16, 64, 64, 8, 2)
    assert fg.gemm_config(gu, 24.0) == (32, 64, 64, 8, 2)  # thresholds are exclusive
    assert fg.gemm_config(gu, 34.0) == (32, 128, 128, 4, 2)
    assert fg.gemm_config(gu, 111.0) == (128, 128, 128, 8, 4)
    assert fg.gemm_config((False, False, True), 111.0) == (64, 64, 128, 4, fg.STAGES)
    # grouped_gemm resolves its config by gemm_config: the row tiles it makes (before any launch) have its BM
    monkeypatch.setitem(fg.LARGE, (True, False, True), [(2.0, (48, 64, 128, 4, 2))])

    def tiles_at(offsets, bm, max_tiles):
        raise LookupError(f"row tiles of {bm}")

    monkeypatch.setattr(fg, "row_tiles", tiles_at)
    w = qat.quantize_weight(torch.randn(3, 64, 128).bfloat16(), "nvfp4")
    x, offs = torch.randn(9, 128).bfloat16(), torch.tensor([2, 5, 9], dtype=torch.int32)
    with pytest.raises(LookupError, match="row tiles of 48"):
        fg.grouped_gemm(x, w, offs, swiglu=True)
    with pytest.raises(LookupError, match="row tiles of 16"):  # 1.5 rows an expert: under the threshold
        fg.grouped_gemm(x, w, offs, swiglu=True, rows_per_group=1.5)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_swap_ab_is_refused_on_swizzled_weights(monkeypatch):
    """The refusal precedes any launch, so CPU tensors reach it: SWAP_AB with the PTX path on swizzled weights."""
    from tracerl.kernels.fp4_swizzle import SwizzledFP4

    w = qat.quantize_weight(torch.randn(3, 64, 128).bfloat16(), "nvfp4")
    sw, x, offs = SwizzledFP4.of(w), torch.randn(8, 128).bfloat16(), torch.tensor([2, 5, 8], dtype=torch.int32)
    monkeypatch.setattr(fg, "USE_ASM", True)
    monkeypatch.setattr(fg, "SWAP_AB", False)
    monkeypatch.setattr(fg, "KERNEL_VARIANT", {(True, False, True): (False, True, False)})  # tuned: swap
    with pytest.raises(ValueError, match="SWAP_AB does not run on swizzled"):
        fg.grouped_gemm(x, sw, offs, swiglu=True)
    monkeypatch.setattr(fg, "KERNEL_VARIANT", {})
    monkeypatch.setattr(fg, "SWAP_AB", True)
    with pytest.raises(ValueError, match="SwizzledFP4.natural"):
        fg.grouped_gemm(x, sw, offs, out_f32=True)


# ----------------------------------------------------------------------------- interpreter


def _run_interpreter(code: str) -> subprocess.CompletedProcess:
    here = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(here.parent / "src"), str(here), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="needs triton and no CUDA (the interpreter runs on CPU)")
def test_kernels_in_interpreter():
    p = _run_interpreter("import test_gpu_kernels as t; t.check_all('cpu'); print('checks ok')")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    assert "checks ok" in p.stdout


@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="needs triton; with CUDA the GPU tests compile the kernels")
def test_kernels_compile_for_hopper():
    """Every kernel, in every variant the decoder can pick, compiles to an sm_90 cubin (no GPU needed)."""
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent / "src"), os.environ.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, str(here / "hopper_compile.py")], capture_output=True, text=True, timeout=900,
                       env=env)
    failed = [line for line in p.stdout.splitlines() if not line.startswith("ok ")]
    assert p.returncode == 0, "\n".join(failed)[-4000:] + p.stderr[-3000:]
    compiled = {line.split()[1] for line in p.stdout.splitlines() if line.startswith("ok ")}
    # every launchable kernel of the package: a new one must be added to hopper_compile.compile_variants
    import importlib

    from triton.runtime.jit import JITFunction

    launchable = {name for mod in ("kernels.fp4_gemm", "kernels.fp4_attention", "kernels.fp4_attention_mma",
                                   "kernels.fp4_quant", "kernels.fp4_numerics", "rollout.gpu")
                  for name, obj in vars(importlib.import_module(f"tracerl.{mod}")).items()
                  if isinstance(obj, JITFunction) and name.endswith("_kernel")}
    assert len(launchable) >= 14 and compiled == launchable, launchable ^ compiled
    # the GEMM in all 16 (SWAP_AB, TMA_W, PREFETCH, PTX nibbles) combinations, FP4 weights
    combos = {tuple(kv for kv in line.split()[2].split(",") if kv.split("=")[0] in ("SWAP", "TMA", "PF", "ASM"))
              for line in p.stdout.splitlines() if line.startswith("ok _grouped_gemm_kernel") and "W_FP4=True" in line}
    assert len(combos) == 16, sorted(combos)
    # every decode-step kernel but the Gluon attention also in its programmatic-dependent-launch variant
    pdl_kernels = {line.split()[1] for line in p.stdout.splitlines() if line.startswith("ok ") and "PDL=True" in line}
    assert pdl_kernels == launchable - {"_mma_attn_kernel", "_absmax_kernel", "_probe_kernel"}, \
        launchable - pdl_kernels


@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="needs triton and no CUDA (the interpreter runs on CPU)")
def test_quant_row_tiles_in_interpreter():
    from test_kernels import _INTERP_SHIM

    p = _run_interpreter(_INTERP_SHIM + "import test_gpu_kernels as t; t.check_quant_row_tiles('cpu'); print('checks ok')")
    assert p.returncode == 0 and "checks ok" in p.stdout, p.stdout[-3000:] + p.stderr[-6000:]


@gpu
@pytest.mark.gpu
def test_quant_row_tiles_gpu():
    check_quant_row_tiles("cuda")
    check_quant_row_tiles("cuda", M=14208, K=768)  # the down GEMM's input at 1776 rows


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="needs triton and no CUDA (the interpreter runs on CPU)")
def test_decoder_in_interpreter():
    p = _run_interpreter("import test_gpu_kernels as t; t.check_decoder('cpu', ('bf16', 'w4a4kv4')); print('checks ok')")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="needs triton and no CUDA (the interpreter runs on CPU)")
def test_decoder_all_linear_in_interpreter():
    """FP4 attention projections (fp4_linear, their inputs' c * s8 from the quantize pass) end to end."""
    p = _run_interpreter("import test_gpu_kernels as t; t.check_decoder('cpu', ('w4a4kv4:all-linear',)); print('checks ok')")
    assert p.returncode == 0 and "checks ok" in p.stdout, p.stdout[-3000:] + p.stderr[-6000:]


# ----------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.gpu
def test_kernels_gpu_small():
    check_all("cuda")


@gpu
@pytest.mark.gpu
def test_grouped_gemm_gpu_realistic():
    check_grouped_gemm("cuda", E=16, F=768, D=2048, T=64, K=8)


@gpu
@pytest.mark.gpu
def test_fp4_linear_split_k_gpu_decode_shapes():
    """The 30B model's o_proj and qkv at 16 rows: the default splits (8 and 2) and others."""
    assert fg.split_k_for(2048 // 64, 4096 // 128) == 8
    check_fp4_linear_split_k("cuda", M=16, O=2048, K=4096, splits=(2, 8, 32))
    check_fp4_linear_split_k("cuda", M=16, O=5120, K=2048, splits=(2, 4, 16))


@gpu
@pytest.mark.gpu
def test_grouped_gemm_gpu_large_batch_tiles():
    """At 128 rows per expert the large-batch tiles run (fg.LARGE: one 128-row SwiGLU tile, BN 128)."""
    assert fg.gemm_config((True, True, True), 128.0)[0] == 128
    check_grouped_gemm("cuda", E=8, F=768, D=2048, T=256, K=4)
    check_swizzled_gemm("cuda", E=8, F=768, D=2048, T=256, K=4)


@gpu
@pytest.mark.gpu
def test_route_dispatch_gpu_largest_batch():
    check_route_dispatch("cuda", T=1776, E=128, K=8)  # 14208 pairs, 111 chunks of 128


@gpu
@pytest.mark.gpu
def test_attention_gpu_realistic():
    check_attention("cuda", B=4, H=32, Hkv=4, Dh=128, T=1500, split_len=512, block_t=64)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_mma_attention_permutations_are_bijections():
    """The head-dim orders the mma kernel gathers q by and stores o by cover each index once, and
    keep every 16-element scale block inside one thread's words (K: 4 words a thread, V: 2)."""
    from tracerl.kernels import fp4_attention_mma as fm

    kp, vp = fm.k_perm(), fm.v_perm()
    assert sorted(kp) == list(range(fm.DH)) and sorted(vp) == list(range(fm.DH))
    # K: lane j (k bits 1-2) reads words 4j..4j+3 = head dims 32j..32j+31
    assert all(kp[k] // 32 == (k // 2) % 4 for k in range(fm.DH))
    # V: lane group r (output-row bits 0-2) reads words 2r, 2r+1 = head dims 16r..16r+15
    assert all(vp[dd] // 16 == dd % 8 for dd in range(fm.DH))


def _emulate_mma_positions(q, lens, sw_k, sw_v, split_len: int, BT: int = 16, p_bf16: bool = True):
    """fp4_attention_mma's positions kernel ("mma-pos") op for op in torch, on the logical tensors its
    Gluon code builds (reshape / permute / split / join, the word decode from fp4_swizzle's own register
    arithmetic, prmt as byte selects): the partials (o, m, l) per (row, query head, split) as it stores
    them. Only movmatrix is taken as what it is documented to do (P arrives as the PV dot's B operand
    unchanged); the GPU tests check that and the rest on the hardware. p_bf16 False: P kept exact."""
    from tracerl.kernels import fp4_attention_mma as fm

    B, H, Dh = q.shape
    kc, ks, kg = sw_k
    vc, vs, vg = sw_v
    T, Hkv = kc.shape[1], kc.shape[2]
    G = H // Hkv
    S_ = -(-T // split_len)
    kperm, vperm = torch.tensor(fm.k_perm()), torch.tensor(fm.v_pair_perm())

    def words(c):  # int64 words (B, T, Hkv, 16), little-endian as the kernel's int32 loads
        c = c.to(torch.int64).reshape(*c.shape[:-1], 16, 4)
        return c[..., 0] | (c[..., 1] << 8) | (c[..., 2] << 16) | (c[..., 3] << 24)

    def scale2(sb):  # (.., 8) scale bytes -> per-word BF16 bit pairs (.., 16), as _load_tile builds them
        bits = sb.to(torch.int64) * 16 + 30080
        return (bits | (bits << 16)).repeat_interleave(2, dim=-1)

    def bf16x2(reg, scale_pair):  # the PTX's bf16x2 multiply of one register: (lo, hi) float64
        def half(x):
            return ((x & 0xFFFF).to(torch.int32) << 16).view(torch.float32).double()
        return torch.stack([half(reg) * half(scale_pair), half(reg >> 16) * half(scale_pair >> 16)], -1)

    def decode(w, s2):  # (..., 8) values of each word: register j // 2, half j % 2 (the pack=8 order)
        regs = S._regs(w)
        return torch.stack([bf16x2(r, s2) for r in regs], -2).flatten(-2)

    Kw, Vw, Ks2, Vs2 = words(kc), words(vc), scale2(ks), scale2(vs)
    po = torch.zeros(B, H, S_, Dh, dtype=torch.float64)
    pml = torch.zeros(B, H, S_, 2, dtype=torch.float64)
    log2e = 1.4426950408889634
    for b in range(B):
        L = int(lens[b])
        for hk in range(Hkv):
            qt = torch.zeros(Dh, 8, dtype=torch.float64)
            qt[:, :G] = q[b, hk * G:(hk + 1) * G, kperm].double().T
            for sp in range(S_):
                t0, t1 = sp * split_len, min(sp * split_len + split_len, L)
                m = torch.full((8,), float("-inf"), dtype=torch.float64)
                lacc = torch.zeros(BT, 8, dtype=torch.float64)
                acc = torch.zeros(Dh, 8, dtype=torch.float64)
                t = t0
                while t < t1:  # tile pairs: a pair's second tile past t1 is all masked
                    for tt in (t, t + BT):
                        pos = torch.arange(tt, tt + BT)
                        ok = pos < t1
                        pc = pos.clamp(max=T - 1)
                        zero = ~ok[:, None]
                        kw, vw = Kw[b, pc, hk].masked_fill(zero, 0), Vw[b, pc, hk].masked_fill(zero, 0)
                        ks2, vs2 = Ks2[b, pc, hk].masked_fill(zero, 0), Vs2[b, pc, hk].masked_fill(zero, 0)
                        gk = kg[b, pc, hk].reshape(BT).double().masked_fill(~ok, 1.0)
                        gv = vg[b, pc, hk].reshape(BT).double().masked_fill(~ok, 1.0)
                        kd = decode(kw, ks2).reshape(BT, 4, 4, 4, 2).permute(0, 2, 3, 1, 4).reshape(BT, Dh)
                        s = kd @ qt
                        s = torch.where(ok[:, None], s * (1 / math.sqrt(Dh) * 512.0 * log2e / gk)[:, None],
                                        float("-inf"))
                        m_new = torch.maximum(m, s.max(0).values)
                        alpha = torch.exp2(m - m_new)
                        p = torch.exp2(s - m_new[None, :])
                        lacc = lacc * alpha[None, :] + p
                        pt = p / gv[:, None]
                        pt = pt.float().bfloat16().double() if p_bf16 else pt
                        # _decode_pairs
                        we, wo = vw[0::2], vw[1::2]
                        se, so = vs2[0::2], vs2[1::2]
                        sp2 = (se & 0xFFFF) | (so & 0xFFFF0000)
                        lo = (we & 0xFFFF) | ((wo & 0xFFFF) << 16)  # prmt 0x5410
                        hi = ((we >> 16) & 0xFFFF) | (wo & 0xFFFF0000)  # prmt 0x7632
                        w4 = torch.stack([lo, hi], -1)  # (BT/2, 16, 2)
                        vd = decode(w4, sp2[..., None].expand_as(w4)).reshape(BT // 2, 8, 2, 2, 4, 2)
                        vt = vd.permute(4, 3, 2, 1, 0, 5).reshape(Dh, BT)
                        acc = acc * alpha[None, :] + vt @ pt
                        m = m_new
                    t += 2 * BT
                rows = hk * G + torch.arange(G)
                tmp = torch.zeros(G, Dh, dtype=torch.float64)
                tmp[:, vperm] = (acc * 512.0).T[:G]
                po[b, rows, sp] = tmp
                pml[b, rows, sp, 0] = m[:G] * math.log(2)
                pml[b, rows, sp, 1] = lacc.sum(0)[:G]
    return po, pml


def _merge_partials(po, pml):
    """What fp4_attention's `_merge_kernel` computes from the partials, in float64: (B, H * Dh)."""
    m, l = pml[..., 0], pml[..., 1]
    mx = m.max(-1, keepdim=True).values
    w = torch.where(torch.isfinite(m), torch.exp(m - mx), torch.zeros_like(m))
    o = (po * w[..., None]).sum(2) / (l * w).sum(-1)[..., None]
    return o.reshape(po.shape[0], -1)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("H,Hkv,T,split_len,BT", [(32, 4, 100, 64, 16), (16, 4, 70, 32, 16), (12, 2, 40, 1024, 16),
                                                   (32, 4, 150, 128, 32)])
def test_mma_positions_index_algebra(H, Hkv, T, split_len, BT):
    """The positions kernel's index algebra (K as the A operand through k_perm, V re-paired by position
    and stored through v_pair_perm, the log2-unit softmax, the partial sums, m back in natural-log
    units) emulated op for op on CPU: the merged partials are the reference attention."""
    from tracerl.kernels import fp4_attention_mma as fm

    vp = fm.v_pair_perm()
    assert sorted(vp) == list(range(fm.DH))
    # output-row bits 0-2 (the A fragments' lane rows) pick the word pair a lane group reads, as v_layout's
    assert all(vp[r] // 16 == r % 8 for r in range(fm.DH))
    g = torch.Generator().manual_seed(4)
    B = 3
    q = torch.randn(B, H, fm.DH, generator=g).bfloat16()
    kv = torch.randn(2, B, T, Hkv, fm.DH, generator=g) * torch.rand(2, B, T, Hkv, 1, generator=g) * 4
    lens = torch.tensor([1, T // 2 + 5, T], dtype=torch.int32)
    quant = fp4.quantize(kv, "nvfp4", per_row_global=True)
    sc, ss = S.swizzle_blocks(quant.codes, quant.scales.view(torch.uint8))
    sw = [(sc[i], ss[i], quant.global_scale[i]) for i in (0, 1)]
    nat = [(quant.codes[i], quant.scales[i].view(torch.uint8), quant.global_scale[i]) for i in (0, 1)]
    r = ref.decode_attention_reference(q, lens, k_fp4=nat[0], v_fp4=nat[1])
    po, pml = _emulate_mma_positions(q, lens, sw[0], sw[1], split_len, BT)
    o = _merge_partials(po, pml)
    assert _rel(o, r) < 8e-3, _rel(o, r)  # P in BF16, as the kernel rounds it
    # with exact P the emulation is the reference to float64 rounding: every index lands where it should
    exact = _merge_partials(*_emulate_mma_positions(q, lens, sw[0], sw[1], split_len, BT, p_bf16=False))
    # (the reference's float32 c * s8 / gs rounds at 6e-8: divide by the global scale in float64 here)
    k64, v64 = (ref.fp4_rows(c, sb, torch.ones_like(gs)).double() / gs.double() for c, sb, gs in nat)
    r64 = ref.decode_attention_reference(q, lens, k=k64, v=v64)
    assert _rel(exact, r64) < 1e-12, _rel(exact, r64)


def check_mma_attention(dev: str, B=5, H=32, Hkv=4, T=700, split_len=160, block_t=16, kernel="mma",
                        maxnreg=None) -> None:
    """fp4_attention_mma (K/V decoded into the MMA fragments; `kernel` one of fa.MMA_KERNELS) against the
    Triton kernel on the same swizzled cache and against the reference: the same products summed in
    another order."""
    from tracerl.kernels import fp4_attention_mma as fm

    Dh = fm.DH
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, Dh, generator=g).bfloat16().to(dev)
    kv = torch.randn(2, B, T, Hkv, Dh, generator=g) * torch.rand(2, B, T, Hkv, 1, generator=g) * 4
    lens = torch.tensor(([1, 7, T, T // 2 + 3, min(split_len + 1, T)] * B)[:B], dtype=torch.int32, device=dev)
    quant = fp4.quantize(kv, "nvfp4", per_row_global=True)
    quant.scales.view(torch.uint8)[0, 1, 5] = 0  # zero-scale blocks over nonzero codes: zero K there
    sc, ss = S.swizzle_blocks(quant.codes, quant.scales.view(torch.uint8))
    sw = [(sc[i].to(dev), ss[i].to(dev), quant.global_scale[i].to(dev)) for i in (0, 1)]
    nat = [(quant.codes[i].to(dev), quant.scales[i].view(torch.uint8).to(dev), quant.global_scale[i].to(dev))
           for i in (0, 1)]
    r = fa.decode_attention_reference(q, lens, k_fp4=nat[0], v_fp4=nat[1])
    t = fa.decode_attention(q, lens, k_fp4=sw[0], v_fp4=sw[1], split_len=split_len, swizzled=True, words=True,
                            kernel="triton", block_t=32)
    o = fa.decode_attention(q, lens, k_fp4=sw[0], v_fp4=sw[1], split_len=split_len, swizzled=True,
                            kernel=kernel, block_t=block_t, maxnreg=maxnreg)
    assert bool(torch.isfinite(o).all())
    assert _rel(o, t) < 2e-3, ("mma vs triton", _rel(o, t))
    assert _rel(o, r) < 8e-3, ("mma vs reference", _rel(o, r))
    # rows are independent: a row alone gives the same bits as in the batch
    o1 = fa.decode_attention(q[3:4], lens[3:4], k_fp4=tuple(x[3:4] for x in sw[0]),
                             v_fp4=tuple(x[3:4] for x in sw[1]),
                             split_len=split_len, swizzled=True, kernel=kernel, block_t=block_t, maxnreg=maxnreg)
    assert torch.equal(o1, o[3:4])
    # the launch order (a row's KV heads together, or the rows first) moves no bit
    _assert_launch_order_free(lambda: fa.decode_attention(q, lens, k_fp4=sw[0], v_fp4=sw[1], split_len=split_len,
                                                          swizzled=True, kernel=kernel, block_t=block_t,
                                                          maxnreg=maxnreg), o)
    check_single_split_output(dev, q, lens, [dict(k_fp4=sw[0], v_fp4=sw[1], swizzled=True)], T, kernel=kernel,
                              block_t=block_t, maxnreg=maxnreg)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "mma-pos"])
@pytest.mark.parametrize("block_t,split_len", [(16, 160), (32, 96), (16, 32), (32, 4096)])
def test_mma_attention_gpu(block_t, split_len, kernel):
    check_mma_attention("cuda", split_len=split_len, block_t=block_t, kernel=kernel)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "mma-pos"])
@pytest.mark.parametrize("H,Hkv", [(16, 4), (8, 4), (12, 2)])
def test_mma_attention_gpu_group_sizes(H, Hkv, kernel):
    check_mma_attention("cuda", B=3, H=H, Hkv=Hkv, T=300, split_len=64, kernel=kernel)


@gpu
@pytest.mark.gpu
def test_mma_positions_gpu_register_cap():
    """The positions kernel at the register cap the tuner tries on it (144: no spills) passes the same checks."""
    check_mma_attention("cuda", split_len=160, kernel="mma-pos", maxnreg=144)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "mma-pos"])
def test_decoder_gpu_with_mma_attention(monkeypatch, kernel):
    """The decoder with an mma attention tuned in: a head-dim-128 model against the engine's CPU path."""
    from tracerl import model as M
    from tracerl.rollout.gpu import DecoderWeights, GPUDecoder

    monkeypatch.setitem(fa.TUNED, True, fa.AttentionConfig(16, 1, 1024, None, True, kernel))
    m = M.build("tiny", seed=0, head_dim=128)
    prompts = torch.randint(0, m.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(6))
    recipe = qat.Recipe("w4a4kv4")
    packed = m.pack_weights(recipe, dtype=torch.bfloat16)
    dec = GPUDecoder(DecoderWeights.from_packed(m.config, packed, device="cuda"), batch=2, max_len=40,
                     temperature=0.0)
    assert dec.kv_swizzled
    got = dec.prefill(prompts.to("cuda")).cpu()
    ref = _engine_reference(m, packed, recipe, prompts, {})
    assert _rel(got, ref) < 0.12, _rel(got, ref)
    toks, lps = dec.decode(20)
    assert toks.shape == (2, 20) and bool(torch.isfinite(lps).all())
    monkeypatch.setitem(fa.TUNED, True, fa.AttentionConfig(32, 4, 256, None, True, "triton"))
    dec2 = GPUDecoder(DecoderWeights.from_packed(m.config, packed, device="cuda"), batch=2, max_len=40,
                      temperature=0.0)
    dec2.prefill(prompts.to("cuda"))
    toks2, lps2 = dec2.decode(20)
    # the two kernels' float32 sums differ in order only, but the FP4 cache turns such differences into
    # other codes for later tokens, so they grow along the sequence: greedy tokens agree, log-probs closely
    assert (toks2 == toks).float().mean() >= 0.9, (toks, toks2)
    assert float((lps2 - lps).abs().mean()) < 0.01 and float((lps2 - lps).abs().max()) < 0.2


@gpu
@pytest.mark.gpu
def test_ptx_nibbles_equal_portable_path():
    status = fg.selfcheck("cuda")
    assert status in ("asm ok",) or status.startswith("asm off"), status
    if status != "asm ok":
        pytest.skip(status)
    _, q = _experts(8, 256, 512, "cuda", 9)
    x = torch.randn(100, 512, device="cuda").bfloat16()
    offs = torch.tensor([0, 10, 10, 30, 55, 60, 99, 100], dtype=torch.int32, device="cuda")
    y_asm = fg.grouped_gemm(x, q, offs, swiglu=True)
    fg.USE_ASM = False
    try:
        y_port = fg.grouped_gemm(x, q, offs, swiglu=True)
    finally:
        fg.USE_ASM = True
    assert torch.equal(y_asm, y_port)


@gpu
@pytest.mark.gpu
def test_decoder_gpu_matches_engine():
    check_decoder("cuda")


@gpu
@pytest.mark.gpu
def test_decoder_gpu_all_linear_matches_engine():
    # the attention projections through fp4_linear (what bench/rollout.py's w4a4kv4:all-linear row runs)
    check_decoder("cuda", ("w4a16:all-linear", "w4a4kv4:all-linear"))


@gpu
@pytest.mark.gpu
def test_decoder_graph_replay_equals_eager():
    from tracerl import model as M
    from tracerl.rollout.gpu import DecoderWeights, GPUDecoder

    m = M.build("tiny", seed=0)
    w = DecoderWeights.from_packed(m.config, m.pack_weights(qat.Recipe("w4a4kv4")), device="cuda")
    outs = []
    for graph in (True, False):
        dec = GPUDecoder(w, batch=4, max_len=32, temperature=1.0, seed=3, use_graph=graph)
        dec.fill_random(8)
        outs.append(dec.decode(5))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["w4a4kv4", "w4a4kv4:all-linear"])
def test_decoder_gpu_pdl_equals_plain_launches(monkeypatch, recipe):
    """Programmatic dependent launch changes when kernels start, never what they compute: the same
    tokens and logprobs bit for bit, replayed from a CUDA graph, with and without it (also with the
    FP4 projections of all-linear sites)."""
    from tracerl import model as M
    from tracerl.kernels import pdl
    from tracerl.rollout.gpu import DecoderWeights, GPUDecoder

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90")
    m = M.build("tiny", seed=0)
    w = DecoderWeights.from_packed(m.config, m.pack_weights(qat.Recipe.parse(recipe)), device="cuda")
    outs = []
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        assert pdl.on("cuda") == on
        dec = GPUDecoder(w, batch=4, max_len=32, temperature=1.0, seed=3)
        dec.fill_random(8)
        outs.append(dec.decode(6))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
