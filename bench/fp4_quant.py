"""FP4 quantize / dequantize throughput of the Triton kernels on one GPU.

An 8192x8192 bf16 tensor, NVFP4 and MXFP4: rtn quantize (NVFP4 with the whole-tensor global
scale, which needs two passes over x, with a given global scale, and with per-row global scales
fused into one kernel), guided quantize (packed lsb or codes record + recorded scales), the fused
recording kernel (codes + lsb record), and dequantize to bf16; plus NVFP4 with div.rn for every
division instead of the exact FMA division (A/B). Every figure is measured in the
same run as a device-to-device copy of x (`torch.empty_like(x).copy_(x)`): GB/s counts the bytes
an ideal kernel must read + write; `frac_copy` is that over the copy's GB/s; `traffic_frac`
counts the bytes actually moved (the NVFP4 two-pass case reads x twice). Each Triton result is
checked bit for bit against the PyTorch reference on the same GPU, which is also timed (speedup).
Timing: CUDA events around each call, warmup, median of --iters.

    PYTHONPATH=src python3 bench/fp4_quant.py --out out/fp4_quant.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from tracerl import fp4
from tracerl.kernels import fp4_quant as fq
from tracerl.kernels import reference

# (BM, BK, num_warps) candidates tried for the tiled and the row-fused kernels (each is a compile)
TILE_CONFIGS = [(2, 2048, 4), (4, 1024, 4), (1, 4096, 4), (4, 2048, 8), (8, 1024, 8)]
ROW_CONFIGS = [(1, 8192, 8), (1, 8192, 16), (1, 4096, 4), (2, 4096, 8), (1, 2048, 4)]


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() by CUDA events (wall clock on CPU, for the interpreter smoke run)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def same_q(q: fp4.FP4Tensor, r: fp4.FP4Tensor) -> bool:
    gs_ok = (r.global_scale is None) == (q.global_scale is None) and (
        r.global_scale is None or torch.equal(q.global_scale.view(torch.int32), r.global_scale.view(torch.int32)))
    return bool(torch.equal(q.codes, r.codes) and torch.equal(q.scales.view(torch.uint8), r.scales.view(torch.uint8))
                and gs_ok)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--ref-iters", type=int, default=5)
    ap.add_argument("--no-sweep", action="store_true", help="use the default tile heuristic only")
    args = ap.parse_args()
    if torch.cuda.is_available():
        dev, name = "cuda", torch.cuda.get_device_name()
    elif fq.INTERPRET:  # smoke run of this script on CPU: TRITON_INTERPRET=1, small --rows/--cols
        dev, name = "cpu", "cpu (triton interpreter)"
    else:
        print("fp4_quant bench needs a CUDA device (or TRITON_INTERPRET=1 for a CPU smoke run)", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    M, K = args.rows, args.cols
    N = M * K
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    xin = 2 * N  # bytes of x
    copy_ms = time_ms(lambda: torch.empty_like(x).copy_(x), args.iters)
    copy_gbps = 2 * xin / copy_ms / 1e6

    # the rollout's side, recorded once with the reference (the trainer's guide inputs)
    xr = (x.float() * (1 + 0.01 * torch.randn_like(x, dtype=torch.float32))).to(torch.bfloat16)
    rec = {}
    for fmt in ("nvfp4", "mxfp4"):
        qr = fp4.quantize(xr, fmt, per_row_global=fmt == "nvfp4")
        rec[fmt] = (qr, reference.record_of(qr, "lsb"))
    gs_given = fp4.nvfp4_global_scale(x)

    def nb(fmt: str) -> int:  # bytes of the block scales
        return N // fp4.format_spec(fmt).block

    codes_b = N // 2
    cases = []  # name, fmt, kind (tile|row|deq), call(config), ref(), bytes, traffic, check

    def add(name, fmt, kind, call, ref, nbytes, traffic=None, check="q"):
        cases.append(dict(name=name, fmt=fmt, kind=kind, call=call, ref=ref, bytes=nbytes,
                          traffic=traffic or nbytes, check=check))

    add("nvfp4 rtn, tensor gs (2 passes)", "nvfp4", "tile",
        lambda c: fq.quantize(x, "nvfp4", config=c)[0], lambda: fp4.quantize(x, "nvfp4"),
        xin + codes_b + nb("nvfp4") + 4, 2 * xin + codes_b + nb("nvfp4") + 4)
    add("nvfp4 rtn, given gs", "nvfp4", "tile",
        lambda c: fq.quantize(x, "nvfp4", global_scale=gs_given, config=c)[0],
        lambda: fp4.quantize(x, "nvfp4", global_scale=gs_given), xin + codes_b + nb("nvfp4"))
    def exact_div(c):  # the same kernel with div.rn for every division (A/B for the FMA division)
        fq.FAST_DIV = False
        try:
            return fq.quantize(x, "nvfp4", global_scale=gs_given, config=c)[0]
        finally:
            fq.FAST_DIV = True

    add("nvfp4 rtn, given gs, div.rn", "nvfp4", "tile", exact_div,
        lambda: fp4.quantize(x, "nvfp4", global_scale=gs_given), xin + codes_b + nb("nvfp4"))
    add("nvfp4 rtn, per-row gs (fused)", "nvfp4", "row",
        lambda c: fq.quantize(x, "nvfp4", per_row_global=True, config=c)[0],
        lambda: fp4.quantize(x, "nvfp4", per_row_global=True), xin + codes_b + nb("nvfp4") + 4 * M)
    add("mxfp4 rtn", "mxfp4", "tile", lambda c: fq.quantize(x, "mxfp4", config=c)[0],
        lambda: fp4.quantize(x, "mxfp4"), xin + codes_b + nb("mxfp4"))
    for fmt in ("nvfp4", "mxfp4"):
        qr, lsb = rec[fmt]
        gsb = 4 * M if fmt == "nvfp4" else 0
        g_lsb = fp4.RoundingGuide(bit=lsb, scales=qr.scales, global_scale=qr.global_scale)
        g_codes = fp4.RoundingGuide(target=qr.codes, scales=qr.scales, global_scale=qr.global_scale)
        add(f"{fmt} guided lsb+scales", fmt, "tile",
            lambda c, g=g_lsb, f=fmt: fq.quantize(x, f, "guided", guide=g, config=c)[0],
            lambda g=g_lsb, f=fmt: reference.quantize(x, f, "guided", guide=g),
            xin + N // 8 + nb(fmt) + gsb + codes_b)
        add(f"{fmt} guided codes+scales", fmt, "tile",
            lambda c, g=g_codes, f=fmt: fq.quantize(x, f, "guided", guide=g, config=c)[0],
            lambda g=g_codes, f=fmt: reference.quantize(x, f, "guided", guide=g),
            xin + codes_b + nb(fmt) + gsb + codes_b)
    add("nvfp4 record lsb, per-row gs (fused)", "nvfp4", "row",
        lambda c: fq.quantize(x, "nvfp4", per_row_global=True, record="lsb", config=c),
        lambda: (lambda q: (q, reference.record_of(q, "lsb")))(fp4.quantize(x, "nvfp4", per_row_global=True)),
        xin + codes_b + nb("nvfp4") + 4 * M + N // 8, check="rec")
    add("mxfp4 record lsb", "mxfp4", "tile",
        lambda c: fq.quantize(x, "mxfp4", record="lsb", config=c),
        lambda: (lambda q: (q, reference.record_of(q, "lsb")))(fp4.quantize(x, "mxfp4")),
        xin + codes_b + nb("mxfp4") + N // 8, check="rec")
    for fmt in ("nvfp4", "mxfp4"):
        q = fp4.quantize(x, fmt)
        add(f"{fmt} dequantize -> bf16", fmt, "deq",
            lambda c, q=q: fq.dequantize(q, torch.bfloat16, config=c),
            lambda q=q: fp4.dequantize(q, torch.bfloat16), codes_b + nb(fmt) + xin, check="deq")

    # pick the tile config per (kind, fmt) on the plain rtn / dequantize case, reuse it for the rest
    best: dict[tuple[str, str], tuple] = {}
    sweep_log = []
    for case in cases:
        key = (case["kind"], case["fmt"])
        if key in best:
            continue
        configs = [None] if args.no_sweep else (ROW_CONFIGS if case["kind"] == "row" else TILE_CONFIGS)
        results = []
        for c in configs:
            try:
                ms = time_ms(lambda c=c, f=case["call"]: f(c), max(10, args.iters // 3))
            except Exception as e:  # a config that does not compile (e.g. out of registers/shared memory)
                sweep_log.append(dict(case=case["name"], config=c, error=f"{type(e).__name__}: {e}"[:300]))
                continue
            results.append((ms, c))
            sweep_log.append(dict(case=case["name"], config=c, ms=ms))
        best[key] = min(results, key=lambda t: t[0])[1] if results else None

    rows = []
    for case in cases:
        cfg = best[(case["kind"], case["fmt"])]
        out = case["call"](cfg)
        ref = case["ref"]()
        if case["check"] == "q":
            exact = same_q(out, ref)
        elif case["check"] == "rec":
            exact = same_q(out[0], ref[0]) and bool(torch.equal(out[1], ref[1]))
        else:
            exact = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
        del out, ref
        ms = time_ms(lambda f=case["call"], c=cfg: f(c), args.iters)
        ref_ms = time_ms(case["ref"], args.ref_iters, warmup=1)
        gbps = case["bytes"] / ms / 1e6
        rows.append(dict(
            name=case["name"], ms=ms, GBps=gbps, frac_copy=gbps / copy_gbps,
            traffic_frac=case["traffic"] / ms / 1e6 / copy_gbps, bytes=case["bytes"], traffic_bytes=case["traffic"],
            ref_ms=ref_ms, speedup=ref_ms / ms, bit_exact=exact, config=cfg,
        ))
        if dev == "cuda":
            torch.cuda.empty_cache()

    head = f"{'case':40s} {'ms':>8s} {'GB/s':>8s} {'x copy':>7s} {'traffic':>8s} {'ref ms':>8s} {'speedup':>8s} exact  config"
    print(f"device: {name}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"x: {M}x{K} bf16; copy {copy_ms:.4f} ms = {copy_gbps:.0f} GB/s (read + write)")
    print(head)
    for r in rows:
        print(f"{r['name']:40s} {r['ms']:8.4f} {r['GBps']:8.0f} {r['frac_copy']:7.2f} {r['traffic_frac']:8.2f} "
              f"{r['ref_ms']:8.3f} {r['speedup']:8.1f} {str(r['bit_exact']):5s}  {r['config']}")
    result = dict(
        device=name, torch=torch.__version__, triton=triton.__version__,
        shape=[M, K], dtype="bfloat16", copy=dict(ms=copy_ms, GBps=copy_gbps), cases=rows, sweep=sweep_log,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
