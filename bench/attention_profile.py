"""One layer's decode attention on the GPU: a split x tile sweep, and a launch list for ncu.

Why: FP4-KV attention streams ~0.2-0.34 of the copy bandwidth where BF16 attention streams up to
0.95, and neither async copies (a pipelined loop) nor a decode-friendly nibble layout (the swizzled
cache) changed that (bench/RESULTS.md, 2026-12-07). This script measures how the work split (programs
per launch: `fp4_attention.split_len_for(target_programs=)`), the tile shape and the kernel (the
Triton one, or on a swizzled cache `fp4_attention_mma`, which decodes into the MMA fragments) move it,
and hands single launches to Nsight Compute for the stall reasons.

    # timing sweep (device): one JSON line per (format, ctx, batch, kernel, programs, tile), writes --out
    # (--mma-tiles '' leaves the mma kernel out; --mma-programs sets its program targets)
    PYTHONPATH=src python3 bench/attention_profile.py --sweep --out $OUT/attn_sweep.json
    # one launch per (format, ctx, batch) between cudaProfilerStart/Stop, for ncu:
    ncu --profile-from-start off --kernel-name regex:decode_attn ... python3 bench/attention_profile.py --ncu

Shapes: `qwen3-30b-a3b` (32 query heads, 4 KV heads, head dim 128), every slot filled to `ctx`,
random K/V quantized per row as the decoder's FP4 cache stores them. Bytes = K and V as stored.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_profile import graph_ms  # noqa: E402  (the same CUDA-graph timing as the GEMM sweep)

from tracerl import kernels  # noqa: E402
from tracerl.kernels import fp4_attention as fa  # noqa: E402
from tracerl.kernels import fp4_swizzle as fs  # noqa: E402
from tracerl.model.config import get_config  # noqa: E402

POINTS = [(1024, 16), (1024, 256), (8192, 16), (8192, 64), (1024, 1024)]
PROGRAMS = [256, 512, 1024]  # the shipped default target: fp4_attention.SPLIT_PROGRAMS
TILES = [(64, 4), (32, 4), (64, 2), (128, 8)]  # (block_t, num_warps); (64, 4) the shipped default
MAXNREG = [None, 168]  # registers per thread: 168 lets 3 CTAs of 4 warps share an SM (128: spills, slower)
MMA_PROGRAMS = [256, 512, 1024, 2048]  # fp4_attention_mma: one warp a program (more splits: more partials)
MMA_KERNELS = list(fa.MMA_KERNELS)  # its two orientations ("mma-pos" only where its output agrees: rel_to_default)
# positions a tile (a register tile of 64 spills; "mma-pos" at 32 takes 234 registers: 8 programs an SM)
MMA_TILES = {"mma": [16, 32], "mma-pos": [16]}
# register caps: "mma" at BT=16 takes 167 registers (12 one-warp programs an SM; 128 spilled and lost on
# the H100); "mma-pos" 154, and 144 without spills (14 programs an SM; tests/hopper_compile.py --regs)
MMA_MAXNREG = {"mma": [None], "mma-pos": [None, 144]}
FORMATS = ["bf16", "fp4-swizzled"]  # the decoder's layouts; "fp4" (natural) on request
ALL_FORMATS = ["bf16", "fp4", "fp4-swizzled"]


class Cache:
    """q, lens and one layer's K/V cache of `batch` slots filled to `ctx`, in every format."""

    def __init__(self, ctx: int, batch: int, dev: str = "cuda", seed: int = 0):
        cfg = get_config("qwen3-30b-a3b")
        self.ctx, self.batch, self.hkv = ctx, batch, cfg.num_kv_heads
        g = torch.Generator(device=dev).manual_seed(seed)
        H, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q = torch.randn(batch, H, Dh, device=dev, generator=g).bfloat16()
        self.lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        k = torch.randn(batch, ctx, Hkv, Dh, device=dev, generator=g).bfloat16()
        v = torch.randn(batch, ctx, Hkv, Dh, device=dev, generator=g).bfloat16()
        kq, vq = (kernels.quantize(t, "nvfp4", per_row_global=True) for t in (k, v))
        kf = (kq.codes, kq.scales.view(torch.uint8), kq.global_scale)
        vf = (vq.codes, vq.scales.view(torch.uint8), vq.global_scale)
        self.kv = {
            "bf16": {"k": k, "v": v},
            "fp4": {"k_fp4": kf, "v_fp4": vf},
            "fp4-swizzled": {"k_fp4": (*fs.swizzle_blocks(kf[0], kf[1]), kf[2]),
                             "v_fp4": (*fs.swizzle_blocks(vf[0], vf[1]), vf[2]), "swizzled": True},
        }
        self.nbytes = {"bf16": 2 * k.numel() * 2,
                       "fp4": 2 * (kq.codes.numel() + kq.scales.numel() + kq.global_scale.numel() * 4)}
        self.nbytes["fp4-swizzled"] = self.nbytes["fp4"]

    def call(self, fmt: str, programs: int | None = None, tile: tuple[int, int] = (64, 4),
             maxnreg: int | None = None, asm: bool | None = None, words: bool | None = None,
             kernel: str = "triton"):
        """A no-argument launch of the attention (+ merge) at this split, tile, register cap, decode and
        kernel ("mma": fp4_attention_mma, swizzled cache only; its tile's warps are 1)."""
        bt, nw = tile
        cfg = fa.AttentionConfig(bt, nw, programs or fa.SPLIT_PROGRAMS, maxnreg, bool(words), kernel)
        sl = fa.split_len_for(self.ctx, self.batch, self.hkv, cfg.split_block, target_programs=programs)
        kv = self.kv[fmt]
        return lambda: fa.decode_attention(self.q, self.lens, **kv, split_len=sl, block_t=bt, num_warps=nw,
                                           maxnreg=maxnreg, asm=asm, words=words, kernel=kernel)


def sweep(points: list[tuple[int, int]], formats: list[str], out: str | None,
          programs_list: list[int] | None = None, tiles: list[tuple[int, int]] | None = None,
          maxnregs: list[int | None] | None = None, words_list: list[bool] | None = None,
          bw: float | None = None, mma_tiles: list[int] | None = None,
          mma_programs: list[int] | None = None, mma_maxnregs: list[int | None] | None = None,
          mma_kernels: list[str] | None = None) -> list[dict]:
    """Time every (format, point, programs, tile, register cap, word decode), and on a swizzled cache
    each of the mma kernels at every (mma_programs, mma_tiles, mma_maxnregs) (default MMA_*; [] tiles for
    none); print one JSON line
    each, the best per (format, point) last, and write them all to `out` (if given). bw: the copy
    bandwidth (bytes/s) the roofline fractions use; measured here if None."""
    if bw is None:
        from rollout import copy_bandwidth  # here, not at import: bench/rollout.py imports this module

        bw = copy_bandwidth()
    rows: list[dict] = []
    for ctx, batch in points:
        cache = Cache(ctx, batch)
        ref = {f: cache.call(f)().float() for f in formats}
        for fmt in formats:
            wl = words_list if words_list is not None else [False, True]
            cands = [(p, t, n, w, "triton") for p, t, n, w in itertools.product(
                programs_list or PROGRAMS, tiles or TILES, maxnregs or MAXNREG,
                wl if fmt == "fp4-swizzled" else (False,))]
            if fmt == "fp4-swizzled":  # the mma kernels: one warp a program, so more programs a launch
                for kern in MMA_KERNELS if mma_kernels is None else mma_kernels:
                    cands += [(p, (bt, 1), n, True, kern) for p, bt, n in itertools.product(
                        mma_programs or MMA_PROGRAMS, MMA_TILES[kern] if mma_tiles is None else mma_tiles,
                        mma_maxnregs or MMA_MAXNREG[kern])]
            for programs, tile, nreg, words, kernel in cands:
                fn = cache.call(fmt, programs, tile, nreg, words=words, kernel=kernel)
                try:
                    rel = float((fn().float() - ref[fmt]).norm() / ref[fmt].norm())
                    ms = graph_ms(fn)
                except Exception as e:  # a config that does not compile or launch: say so, go on
                    print(json.dumps({"format": fmt, "ctx": ctx, "batch": batch, "programs": programs,
                                      "tile": tile, "maxnreg": nreg, "words": words, "kernel": kernel,
                                      "error": f"{type(e).__name__}: {str(e)[:200]}"}), flush=True)
                    continue
                row = {"format": fmt, "ctx": ctx, "batch": batch, "programs": programs, "tile": tile,
                       "maxnreg": nreg, "words": words, "kernel": kernel, "ms": ms,
                       "roofline_frac": cache.nbytes[fmt] / (ms * 1e-3) / bw, "rel_to_default": rel}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del cache
        torch.cuda.empty_cache()
    for ctx, batch in points:
        for fmt in formats:
            mine = [r for r in rows if (r["format"], r["ctx"], r["batch"]) == (fmt, ctx, batch)]
            if not mine:
                continue
            best = min(mine, key=lambda r: r["ms"])
            dflt = next((r for r in mine if r["programs"] == fa.SPLIT_PROGRAMS and tuple(r["tile"]) == (64, 4)
                         and r["maxnreg"] is None and not r["words"] and r["kernel"] == "triton"), best)
            print(f"best {fmt:13s} ctx={ctx:5d} B={batch:4d}: {best['ms'] * 1e3:7.1f} us "
                  f"({best['kernel']}, programs {best['programs']}, tile {tuple(best['tile'])}, maxnreg "
                  f"{best['maxnreg']}, words {best['words']}, roofline {best['roofline_frac']:.2f}) "
                  f"vs default {dflt['ms'] * 1e3:7.1f} us ({dflt['roofline_frac']:.2f})", flush=True)
    if out:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "heads_first": fa.HEADS_FIRST,
                       "rows": rows}, f, indent=1)
        os.replace(tmp, out)
    return rows


def ncu_launches(points: list[tuple[int, int]], formats: list[str], programs: int | None = None,
                 tile: tuple[int, int] = (64, 4), words: bool | None = None) -> None:
    """Warm every (format, point) at this split target, tile and decode (default: the shipped ones),
    then launch each once inside cudaProfilerStart/Stop (run under `ncu --profile-from-start off`)."""
    for ctx, batch in points:
        cache = Cache(ctx, batch)
        for fmt in formats:
            fn = cache.call(fmt, programs, tile, words=words if fmt == "fp4-swizzled" else None)
            fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"profiled fmt={fmt} ctx={ctx} batch={batch}", flush=True)
        del cache
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    """CLI: --sweep and/or --ncu over --points ctx:batch,..."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--points", default=",".join(f"{c}:{b}" for c, b in POINTS), help="ctx:batch,...")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"some of {','.join(ALL_FORMATS)}")
    ap.add_argument("--programs", default="", help="program targets to sweep, e.g. 256,1024 (default: PROGRAMS)")
    ap.add_argument("--tiles", default="", help="block_t:num_warps,... (default: TILES)")
    ap.add_argument("--maxnreg", default="", help="register caps, 0 = none (default: MAXNREG)")
    ap.add_argument("--words", default="", help="0,1: word decode of the swizzled cache (default: both)")
    ap.add_argument("--mma-tiles", default=None, help="mma kernel tiles, e.g. 16,32 (default: MMA_TILES; '' none)")
    ap.add_argument("--mma-programs", default="", help="mma kernel program targets (default: MMA_PROGRAMS)")
    ap.add_argument("--mma-maxnreg", default="", help="mma kernel register caps, 0 = none (default: MMA_MAXNREG)")
    ap.add_argument("--mma-kernels", default=None, help=f"some of {','.join(fa.MMA_KERNELS)} (default: both)")
    ap.add_argument("--heads-first", type=int, choices=(0, 1), default=None,
                    help="fa.HEADS_FIRST: a row's KV heads launched together (1) or the rows first (0)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.heads_first is not None:
        fa.HEADS_FIRST = bool(args.heads_first)
    if not torch.cuda.is_available():
        print("attention_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        points = [tuple(int(x) for x in p.split(":")) for p in args.points.split(",") if p]
    except ValueError:
        ap.error(f"--points {args.points!r}: give ctx:batch pairs, e.g. 8192:16,1024:256")
    formats = [f for f in args.formats.split(",") if f]
    if not formats or set(formats) - set(ALL_FORMATS):
        ap.error(f"--formats {args.formats!r}: choose from {','.join(ALL_FORMATS)}")
    def ints(v: str) -> list[int]:
        return [int(x) for x in v.split(",") if x]

    if args.sweep:
        tiles = [tuple(int(x) for x in t.split(":")) for t in args.tiles.split(",") if t] or None
        sweep(points, formats, args.out, ints(args.programs) or None, tiles,
              [n or None for n in ints(args.maxnreg)] or None, [bool(w) for w in ints(args.words)] or None,
              mma_tiles=None if args.mma_tiles is None else ints(args.mma_tiles),
              mma_programs=ints(args.mma_programs) or None,
              mma_maxnregs=[n or None for n in ints(args.mma_maxnreg)] or None,
              mma_kernels=None if args.mma_kernels is None else [k for k in args.mma_kernels.split(",") if k])
    if args.ncu:  # the first of --programs / --tiles / --words, if given
        tiles = [tuple(int(x) for x in t.split(":")) for t in args.tiles.split(",") if t]
        ncu_launches(points, formats, (ints(args.programs) or [None])[0], tiles[0] if tiles else (64, 4),
                     bool(ints(args.words)[0]) if ints(args.words) else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
