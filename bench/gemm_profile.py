"""One MoE layer's expert GEMMs on the GPU: a tile x pipeline-depth sweep, and a launch list for ncu.

Why: the decode step's FP4 expert GEMMs stream packed weights at about a quarter of the copy
bandwidth while the same kernel on BF16 weights reaches 0.7 (bench/RESULTS.md). Counting SASS
on CPU (tests/hopper_compile.py) puts the kernel's issue work at ~0.18 warp-instructions per
weight element, a third of what the measured time allows, so the stall is latency, not issue
slots; this script measures which tiles and pipeline depths hide it, and hands single launches
to Nsight Compute for the stall reasons.

    # timing sweep (device): prints one JSON line per (kind, format, batch, config), writes --out
    PYTHONPATH=src python3 bench/gemm_profile.py --sweep --out $OUT/gemm_sweep.json
    # large batches over row tiles (what fp4_gemm.LARGE was read from; bench/results/gemm_large_h100.json)
    PYTHONPATH=src python3 bench/gemm_profile.py --sweep --batches 1776,544 --bms 32,64,128 \
        --fmts w4a4s,w4a16s --full w4a4s --workers 14 --out $OUT/gemm_large.json
    # one launch per (kind, format, batch) between cudaProfilerStart/Stop, for ncu:
    ncu --clock-control none --profile-from-start off --section WarpStateStats ... \\
        python3 bench/gemm_profile.py --ncu

Shapes: `qwen3-30b-a3b` (hidden 2048, expert width 768, 128 experts, top-8), random weights and
routing (uniform over experts); gate_up is the fused SwiGLU GEMM (E, 1536, 2048), down (E, 2048, 768)
with the gated scatter. Bytes = the touched experts' weights (packed codes + scales for FP4).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout import copy_bandwidth  # noqa: E402  (bench/rollout.py: the same copy bandwidth)

from tracerl import kernels  # noqa: E402
from tracerl.kernels import fp4_gemm as fg  # noqa: E402
from tracerl.kernels.fp4_swizzle import SwizzledFP4  # noqa: E402
from tracerl.model.config import get_config  # noqa: E402
from tracerl.rollout.gpu import quantize_weight  # noqa: E402

# (BN, BK, num_warps, num_stages): the shipped default first
SWEEP = [(64, 128, 4, 3)] + [c for c in itertools.product((32, 64, 128), (128, 256), (4, 8), (2, 3, 4))
                             if c != (64, 128, 4, 3) and not (c[0] == 128 and c[1] == 256)]


class Layer:
    """One layer's expert weights (BF16 and NVFP4) and a batch's routed activations."""

    def __init__(self, batch: int, seed: int = 0, bm: int | None = None):
        cfg = get_config("qwen3-30b-a3b")
        dev = "cuda"
        g = torch.Generator(device=dev).manual_seed(seed)
        D, E, F, K = cfg.hidden_size, cfg.num_experts, cfg.expert_size, cfg.top_k
        self.wgu = (torch.randn(E, 2 * F, D, device=dev, generator=g) * 0.02).bfloat16()
        self.wdn = (torch.randn(E, D, F, device=dev, generator=g) * 0.02).bfloat16()
        self.qgu, self.qdn = quantize_weight(self.wgu), quantize_weight(self.wdn)
        self.sgu, self.sdn = SwizzledFP4.of(self.qgu), SwizzledFP4.of(self.qdn)
        self.x = torch.randn(batch, D, device=dev, generator=g).bfloat16()
        ids, gates = fg.route(torch.randn(batch, E, device=dev, generator=g), K)
        self.offs, self.tok, self.pair, self.gs = fg.dispatch(ids, gates, E)
        frac = int((torch.diff(self.offs, prepend=self.offs[:1] * 0) > 0).sum()) / E
        self.bm = bm or fg.pick_bm(batch * K / E)
        self.y = torch.zeros(batch * K, D, device=dev)
        self.h = torch.randn(batch * K, F, device=dev, generator=g).bfloat16()
        self.xq = kernels.quantize(self.x, "nvfp4", per_row_global=True)
        self.hq = kernels.quantize(self.h, "nvfp4", per_row_global=True)
        self.bytes = {("gu", "bf16"): frac * self.wgu.numel() * 2, ("dn", "bf16"): frac * self.wdn.numel() * 2,
                      ("gu", "fp4"): frac * self.qgu.nbytes, ("dn", "fp4"): frac * self.qdn.nbytes}
        self.tiles = (*fg.row_tiles(self.offs, self.bm, fg.max_row_tiles(E, batch * K, self.bm)), self.bm)

    def call(self, kind: str, fmt: str, config: tuple[int, ...] | None):
        """A zero-argument launch of one GEMM at `config`: kind gu|dn, fmt bf16|w4a16|w4a4, with
        suffix 's' for swizzled weights (fp4_swizzle.py) and 'l' for w4a4 dequantizing its
        activations in the K loop (fg.DEQUANT_A off)."""
        cfg = None if config is None else (self.bm, *config)
        base = fmt.rstrip("sl")
        gu = kind == "gu"
        w = (self.wgu if gu else self.wdn) if base == "bf16" else (
            (self.sgu if gu else self.sdn) if "s" in fmt[4:] else (self.qgu if gu else self.qdn))
        a = (self.xq if gu else self.hq) if base == "w4a4" else (self.x if gu else self.h)
        in_loop = "l" in fmt[4:]

        def run(fn):
            fg.DEQUANT_A = not in_loop
            try:
                return fn()
            finally:
                fg.DEQUANT_A = True
        if gu:
            return lambda: run(lambda: fg.grouped_gemm(a, w, self.offs, row_idx=self.tok, swiglu=True,
                                                       n_rows=self.tok.numel(), tiles=self.tiles, config=cfg))
        return lambda: run(lambda: fg.grouped_gemm(a, w, self.offs, dst_idx=self.pair, gate=self.gs, out=self.y,
                                                   tiles=self.tiles, config=cfg))

    def nbytes(self, kind: str, fmt: str) -> float:
        return self.bytes[(kind, "bf16" if fmt == "bf16" else "fp4")]


def graph_ms(fn, reps: int = 10, replays: int = 5) -> float:
    """Device time of one call: `reps` calls captured in a CUDA graph, replayed `replays` times (no
    host launch cost in the figure, as in the decoder's captured step)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / (reps * replays)


def _compile_some(jobs: list[tuple[int, str, str, tuple[int, ...]]]) -> int:
    """Worker: launch each job once at batch 16 so Triton's disk cache holds its binary (the row
    tile BM is a constexpr: one compile serves every batch run at that BM)."""
    layers: dict[int, Layer] = {}
    failed = 0
    for bm, kind, fmt, c in jobs:
        try:
            layer = layers.get(bm) or layers.setdefault(bm, Layer(16, bm=bm))
            layer.call(kind, fmt, c)()
        except Exception:  # noqa: BLE001 - the timing pass reports it
            failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(fmts: list[str], configs: list[tuple[int, ...]], workers: int, full: set[str],
               bms: list[int]) -> None:
    """Compile every (BM, kind, fmt, config) in `workers` processes first: Triton compiles one kernel
    at a time per process (about a second each here), and the cache is shared through the disk."""
    import concurrent.futures as cf
    import multiprocessing as mp

    jobs = [(bm, k, f, c) for bm in bms for k in ("gu", "dn") for f in fmts
            for c in (configs if f in full else configs[:1])]
    chunks = [jobs[i::workers] for i in range(workers)]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        failed = sum(ex.map(_compile_some, chunks))
    print(f"precompiled {len(jobs)} kernels in {workers} processes ({failed} failed)", flush=True)


def sweep(batches: list[int], fmts: list[str], configs: list[tuple[int, ...]], out: str | None,
          full: set[str], bms: list[int] | None = None) -> list[dict]:
    """Time every (kind, fmt, config) at each batch (formats not in `full`: the first config only),
    at `pick_bm`'s row tile or at each of `bms`; the fastest config per (kind, fmt, batch) is marked."""
    bw = copy_bandwidth()
    rows: list[dict] = []

    def save():
        if out:
            with open(out + ".tmp", "w") as f:
                json.dump({"copy_GBps": bw / 1e9, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
            os.replace(out + ".tmp", out)

    for batch in batches:
        layers = [Layer(batch, bm=bm) for bm in bms] if bms else [Layer(batch)]
        todo = [(layer, kind, fmt, configs if fmt in full else configs[:1])
                for layer in layers for kind, fmt in itertools.product(("gu", "dn"), fmts)]
        if not bms and layers[0].bm == 16 and batch >= 64:  # larger row tiles: one weight pass for more experts
            big = Layer(batch, bm=32)
            todo += [(big, kind, fmt, configs[:1]) for kind, fmt in itertools.product(("gu", "dn"), fmts) if fmt in full]
        best_of: dict[tuple[str, str], dict] = {}
        for lay, kind, fmt, cfgs in todo:
            nb = lay.nbytes(kind, fmt)
            best = None
            for c in cfgs:
                r = {"kind": kind, "fmt": fmt, "batch": batch, "config": list(c), "bm": lay.bm}
                try:
                    ms = graph_ms(lay.call(kind, fmt, c))
                    r.update(ms=ms, GBps=nb / ms / 1e6, roofline_frac=nb / bw / (ms * 1e-3))
                    if best is None or ms < best["ms"]:
                        best = r
                except Exception as e:  # a tile that does not fit (shared memory, registers): report, go on
                    r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(r)
                print(json.dumps(r), flush=True)
            prev = best_of.get((kind, fmt))
            if best is not None and (prev is None or best["ms"] < prev["ms"]):
                if prev is not None:
                    del prev["best"]
                best["best"] = True
                best_of[(kind, fmt)] = best
            save()
        del layers, todo
        torch.cuda.empty_cache()
    return rows


def ncu_launches(batches: list[int], fmts: list[str]) -> None:
    """Compile and warm every (kind, fmt, batch) at the shipped config, then launch each once inside
    cudaProfilerStart/Stop (run under `ncu --profile-from-start off`)."""
    layers = {b: Layer(b) for b in batches}
    calls = [(b, k, f, layers[b].call(k, f, None)) for b in batches for k in ("gu", "dn") for f in fmts]
    for *_, fn in calls:
        fn()
    torch.cuda.synchronize()
    for b, k, f, fn in calls:
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled batch={b} kind={k} fmt={f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="time the tile x pipeline-depth sweep")
    ap.add_argument("--ncu", action="store_true", help="one launch per (batch, kind, format) for ncu")
    ap.add_argument("--batches", default="16,256")
    ap.add_argument("--fmts", default="bf16,w4a16,w4a4,w4a16s,w4a4s,w4a4l",
                    help="s: swizzled weights; l: w4a4 activations dequantized in the K loop")
    ap.add_argument("--full", default="w4a16s,w4a4s", help="formats swept over every config (others: the default)")
    ap.add_argument("--bms", default=None, help="row tiles BM to sweep, e.g. 64,128 (default: pick_bm's)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--workers", type=int, default=8, help="processes that compile the sweep's kernels first")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    fmts = args.fmts.split(",")
    print("nibble conversion:", fg.selfcheck(), flush=True)
    if args.sweep:
        full = set(args.full.split(","))
        bms = [int(b) for b in args.bms.split(",")] if args.bms else None
        if args.workers > 1:
            cfg = get_config("qwen3-30b-a3b")
            precompile(fmts, SWEEP, args.workers, full,
                       bms or sorted({fg.pick_bm(b * cfg.top_k / cfg.num_experts) for b in batches}))
        sweep(batches, fmts, SWEEP, args.out, full, bms)
    if args.ncu:
        ncu_launches(batches, fmts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
