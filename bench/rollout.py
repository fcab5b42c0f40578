"""Decode throughput of the GPU decode backend (rollout/gpu.py) on one GPU, FP4 vs BF16, vs transformers.

Model: the `qwen3-30b-a3b` preset (48 layers, 128 experts, top-8) with random weights built on the
GPU (DecoderWeights.random; never a full BF16 copy of FP4 parts). For each recipe (bf16, w4a16,
w4a4, w4a4kv4), context (the KV cache filled with random K/V to that length: `fill_random`) and
batch (the given ones plus the largest that fits in memory, from the measured free memory), a
decode step is captured as one CUDA graph and replayed: `--warmup` replays, then `--steps`
replays timed together with CUDA events. Reported per point: decode tokens/s (batch / step
time), ms per step, bytes a step must move (touched experts' weights from the step's own
routing + attention/router/norm weights + the whole KV cache read + lm_head: see
GPUDecoder.bytes_per_step), the fraction of the bandwidth roofline (bytes / copy bandwidth,
over the step time; the copy bandwidth is a device-to-device copy measured in the same run,
bytes read + written), and peak memory. Speedups FP4/BF16 at equal batch and at each recipe's
largest batch. Peer: transformers' `generate()` (Qwen3MoeForCausalLM, BF16, random weights,
default attention/experts implementation) with --peer-layers layers (48 does not fit a quick
run); its per-step decode time is measured at two layer counts and extrapolated linearly to 48
layers (t = a + b * layers), and stated as such.

    PYTHONPATH=src python3 bench/rollout.py --out out/rollout.json            # full sweep (device)
    PYTHONPATH=src python3 bench/rollout.py --micro --recipes bf16,w4a4kv4 --batches 64 --contexts 1024
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

from tracerl import qat
from tracerl.kernels import fp4_attention as fa
from tracerl.kernels import fp4_gemm as fg
from tracerl.kernels import pdl
from tracerl.kernels.fp4_swizzle import SwizzledFP4
from tracerl.model.config import get_config
from tracerl.rollout import gpu as gpu_mod
from tracerl.rollout.gpu import DecoderWeights, GPUDecoder, quantize_weight

GiB = 2**30


def events_ms(fn, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (4 GiB source)."""
    src = torch.randn(GiB, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    src = torch.cat([src, src])
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src), 10, 3)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def kv_bytes_per_token(cfg, kv4: bool) -> int:
    per_head = cfg.head_dim // 2 + cfg.head_dim // 16 + 4 if kv4 else cfg.head_dim * 2
    return cfg.num_layers * 2 * cfg.num_kv_heads * per_head


def max_batch(cfg, kv4: bool, max_len: int, cap: int, margin_gib: float = 4.0) -> int:
    """Largest multiple of 16 whose KV cache + per-row workspace fits the free memory now."""
    free, _ = torch.cuda.mem_get_info()
    per_row = kv_bytes_per_token(cfg, kv4) * max_len + 3 * cfg.vocab_size * 4 + 4 * cfg.top_k * cfg.hidden_size * 4
    b = int((free - margin_gib * GiB) // per_row) // 16 * 16
    return max(0, min(b, cap))


def kernel_profile(step, n: int) -> dict:
    """Device time per step of each kernel name over n replays of `step` (torch.profiler/CUPTI sees
    the kernels inside a CUDA graph): where the step's time goes, and how much of it is idle."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = ev.self_cuda_time_total
        if us > 0:
            rows.append({"kernel": ev.key[:120], "calls_per_step": ev.count / n, "us_per_step": us / n})
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"kernel_ms_per_step": sum(r["us_per_step"] for r in rows) / 1e3, "kernels": rows[:25]}


def run_point(w: DecoderWeights, B: int, ctx: int, steps: int, warmup: int, bw: float, bf16_experts: str,
              profile_steps: int = 0) -> dict:
    cfg = w.cfg
    max_len = ctx + warmup + steps + 2
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    dec = GPUDecoder(w, batch=B, max_len=max_len, temperature=1.0, bf16_experts=bf16_experts)
    dec.fill_random(ctx)
    dec.capture()
    setup_s = time.perf_counter() - t0
    for _ in range(warmup):
        dec.step()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        dec.step()
    b.record()
    b.synchronize()
    ms = a.elapsed_time(b) / steps
    by = dec.bytes_per_step(ctx + warmup + steps / 2)
    ok = bool(torch.isfinite(dec.logprobs).all()) and int(dec.next_tokens.min()) >= 0 \
        and int(dec.next_tokens.max()) < cfg.vocab_size
    res = {
        "batch": B, "context": ctx, "ms_per_step": ms, "tok_per_s": B / (ms * 1e-3),
        "bytes_per_step": by["total"], "bytes": by, "roofline_ms": by["total"] / bw * 1e3,
        "roofline_frac": by["total"] / bw / (ms * 1e-3), "achieved_GBps": by["total"] / (ms * 1e-3) / 1e9,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / GiB, "setup_s": setup_s, "outputs_ok": ok,
        "graph": dec.graph is not None,
    }
    if profile_steps:
        try:
            res["profile"] = kernel_profile(dec.step, profile_steps)
        except Exception as e:  # a profiler failure must not lose the timing
            res["profile"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    del dec
    gc.collect()
    torch.cuda.empty_cache()
    return res


GEMM_CONFIGS = [(64, 64, 4), (64, 128, 8), (64, 128, 4), (32, 64, 4), (32, 128, 4), (64, 64, 8)]
# FP4 GEMM variants as (PREFETCH, SWAP_AB, TMA_W) of kernels/fp4_gemm.py (TMA loads are pipelined by
# the compiler, so they take no software prefetch)
VARIANTS = {"prefetch": (True, False, False), "plain": (False, False, False), "swap": (False, True, False),
            "swap+prefetch": (True, True, False), "tma": (False, False, True), "swap+tma": (False, True, True)}
def tune_attention(bw: float, batch: int, ctx: int) -> list[dict]:
    """Pick fa.TUNED and fa.TUNED_LARGE per cache format: attention_profile's sweep (kernel, tile, program
    target, word decode) timed at decode points below fa.LARGE_ROW_POSITIONS (batch x context: B=16 at
    1k and at `ctx`) for TUNED and at the points above it (`batch` at `ctx`, B=16 and 64 at 8k) for the
    large-launch config, each config kept by its summed time relative to each point's best (the
    program target matters only where B * Hkv is below it: small batches). Register caps are left
    out: they lost at every point (bench/results/attention_sweep_h100.json)."""
    from attention_profile import sweep  # here, not at import: it imports this module

    points = list(dict.fromkeys([(1024, 16), (ctx, 16), (ctx, batch), (8192, 16), (8192, 64)]))
    small = [p for p in points if p[0] * p[1] < fa.LARGE_ROW_POSITIONS]
    large = [p for p in points if p[0] * p[1] >= fa.LARGE_ROW_POSITIONS]
    swz = fa.SWIZZLE_KV and fa.kv_swizzle_check("cuda") == "swizzle ok"
    fmts = {False: "bf16", True: "fp4-swizzled" if swz else "fp4"}
    rows = sweep(small + large, list(fmts.values()), None, maxnregs=[None], bw=bw)
    if swz:  # the swizzle's own gain: the natural cache at the default config
        rows += sweep([(ctx, batch)], ["fp4"], None, [fa.SPLIT_PROGRAMS], [(64, 4)], [None], bw=bw)

    def pick(fmt: str, points: list[tuple[int, int]]) -> fa.AttentionConfig | None:
        times: dict[tuple[int, int], dict[fa.AttentionConfig, float]] = {}
        for r in rows:  # a config whose output strays from the default's is never picked (a broken kernel)
            if r["format"] == fmt and (r["ctx"], r["batch"]) in points and r["rel_to_default"] < 1e-2:
                c = fa.AttentionConfig(*r["tile"], r["programs"], r["maxnreg"], r["words"], r.get("kernel", "triton"))
                times.setdefault((r["ctx"], r["batch"]), {})[c] = r["ms"]
        common = set.intersection(*(set(t) for t in times.values())) if times else set()
        return min(common, key=lambda c: sum(t[c] / min(t.values()) for t in times.values())) if common else None

    for fp4_kv, fmt in fmts.items():
        c_small, c_large = pick(fmt, small), pick(fmt, large)
        if c_small is not None:
            fa.TUNED[fp4_kv] = c_small
            print(f"tuned attention {fmt}: {c_small}", flush=True)
        if c_large is not None and c_large != c_small:
            fa.TUNED_LARGE[fp4_kv] = (fa.LARGE_ROW_POSITIONS, c_large)
            print(f"tuned attention {fmt} from {fa.LARGE_ROW_POSITIONS} row positions: {c_large}", flush=True)
        elif c_small is not None:
            fa.TUNED_LARGE[fp4_kv] = None  # one config at every batch (not fa.DEFAULT_LARGE)
    return [{"kernel": f"attention {r['format']} kv", **r} for r in rows]


def micro(cfg, bw: float, batch: int, ctx: int) -> list[dict]:
    """One layer's expert GEMMs and attention at `batch`, per kernel and tile config.

    Sweeps (BN, BK, num_warps) of each grouped GEMM (CUDA-graph replays) and keeps the fastest in fg.TUNED,
    times the vendor BF16 grouped GEMM (torch._grouped_mm) as the BF16 alternative, and tunes the
    attention (`tune_attention`: fa.TUNED, fa.TUNED_LARGE) for the decode sweep."""
    from tracerl import kernels

    out = []
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    D, E, Fw, K = cfg.hidden_size, cfg.num_experts, cfg.expert_size, cfg.top_k
    wgu = (torch.randn(E, 2 * Fw, D, device=dev, generator=g) * 0.02).bfloat16()
    wdn = (torch.randn(E, D, Fw, device=dev, generator=g) * 0.02).bfloat16()
    # the layout the decoder runs (swizzled where fp4_gemm.swizzle_check passed), so the tiles and
    # variants tuned here are the ones the decode sweep's weights want
    qgu, qdn = fg.for_kernels(quantize_weight(wgu)), fg.for_kernels(quantize_weight(wdn))
    x = torch.randn(batch, D, device=dev, generator=g).bfloat16()
    ids, gates = fg.route(torch.randn(batch, E, device=dev, generator=g), K)
    offs, tok, pair, gs = fg.dispatch(ids, gates, E)
    touched = int((torch.diff(offs, prepend=offs[:1] * 0) > 0).sum())
    bm = fg.pick_bm(batch * K / E)
    tiles = (*fg.row_tiles(offs, bm, fg.max_row_tiles(E, batch * K, bm)), bm)
    y = torch.zeros(batch * K, D, device=dev)
    h = torch.randn(batch * K, Fw, device=dev, generator=g).bfloat16()
    xq = kernels.quantize(x, "nvfp4", per_row_global=True)
    hq = kernels.quantize(h, "nvfp4", per_row_global=True)
    frac = touched / E

    from gemm_profile import graph_ms  # here, not at import: it imports this module

    def rec(name, fn, nbytes, **extra):
        try:
            # replayed from a CUDA graph, as the decoder runs it: timed call by call, each launch's
            # host-side wrapper (~0.1 ms, jittery) sat inside the events and moved the pick between runs
            # by up to 1.6x for one config (two H100 runs, 2026-12-07)
            ms = graph_ms(fn)
            r = {"kernel": name, "batch": batch, "ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6,
                 "roofline_frac": nbytes / bw / (ms * 1e-3), **extra}
        except Exception as e:  # keep going: report what failed
            r = {"kernel": name, "error": f"{type(e).__name__}: {str(e)[:300]}", **extra}
        out.append(r)
        print("micro", json.dumps(r), flush=True)
        return r.get("ms", float("inf"))

    def gu(w, a, c):
        return lambda: fg.grouped_gemm(a, w, offs, row_idx=tok, swiglu=True, n_rows=tok.numel(), tiles=tiles,
                                       config=(bm, *c))

    def dn(w, a, c):
        return lambda: fg.grouped_gemm(a, w, offs, dst_idx=pair, gate=gs, out=y, tiles=tiles, config=(bm, *c))

    b16 = {"gu": frac * wgu.numel() * 2, "dn": frac * wdn.numel() * 2}
    b4 = {"gu": frac * qgu.nbytes, "dn": frac * qdn.nbytes}
    def fastest(name: str) -> float:
        return min((r["ms"] for r in out if r.get("kernel") == name and "ms" in r), default=float("inf"))

    # every (variant, tile) per GEMM kind and activation format; the fastest pair is kept in
    # fg.KERNEL_VARIANT / fg.TUNED for the decode sweep (no variant won everywhere on the H200)
    chosen: dict[str, dict] = {}
    for kind, mk, w4, wb, a16, a4 in (("gu", gu, qgu, wgu, x, xq), ("dn", dn, qdn, wdn, h, hq)):
        bestb = min(GEMM_CONFIGS[:4], key=lambda c: rec(f"{kind} bf16 triton", mk(wb, a16, c), b16[kind], config=c))
        fg.TUNED[(False, False, kind == "gu")] = bestb
        for a4_, act, cfgs in ((False, a16, GEMM_CONFIGS), (True, a4, GEMM_CONFIGS[:4])):
            key, fmt = (True, a4_, kind == "gu"), "w4a4" if a4_ else "w4a16"
            found = {}
            for var, flags in VARIANTS.items():
                if flags[1] and isinstance(w4, SwizzledFP4) and fg.USE_ASM:
                    continue  # SWAP_AB refuses swizzled weights (fp4_gemm.grouped_gemm says why)
                fg.KERNEL_VARIANT[key] = flags
                name = f"{kind} {fmt} triton {var}"
                cfg_v = min(cfgs, key=lambda c: rec(name, mk(w4, act, c), b4[kind], config=c))
                found[var] = (fastest(name), cfg_v)
            var = min(found, key=lambda v: found[v][0])
            fg.KERNEL_VARIANT[key], fg.TUNED[key] = VARIANTS[var], found[var][1]
            chosen[f"{kind} {fmt}"] = {"variant": var, "ms": found[var][0],
                                       "ms_per_variant": {v: t for v, (t, _) in found.items()}}

    def moe_grouped_mm():
        xs = x[tok.long()]
        h2 = torch._grouped_mm(xs, wgu.transpose(-2, -1), offs=offs)
        hm = torch.nn.functional.silu(h2[:, :Fw]) * h2[:, Fw:]
        yy = torch._grouped_mm(hm, wdn.transpose(-2, -1), offs=offs)
        y.index_copy_(0, pair.long(), yy.float() * gs[:, None])

    def moe_triton(wa, wb):
        return lambda: (fg.grouped_gemm(x, wa, offs, row_idx=tok, swiglu=True, n_rows=tok.numel(), tiles=tiles),
                        fg.grouped_gemm(h, wb, offs, dst_idx=pair, gate=gs, out=y, tiles=tiles))

    rec("experts bf16 torch._grouped_mm", moe_grouped_mm, b16["gu"] + b16["dn"], touched_experts=touched)
    rec("experts bf16 triton (tuned)", moe_triton(wgu, wdn), b16["gu"] + b16["dn"], touched_experts=touched)
    rec("experts w4a16 triton (tuned)", moe_triton(qgu, qdn), b4["gu"] + b4["dn"], touched_experts=touched)
    out += tune_attention(bw, batch, ctx)
    out.append({"tuned_gemm": {str(k_): v_ for k_, v_ in fg.TUNED.items()}, "gemm_variant": chosen,
                "tuned_attention": {str(k_): v_._asdict() for k_, v_ in fa.TUNED.items()},
                "tuned_attention_large": {str(k_): v_ and {"from_batch": v_[0], **v_[1]._asdict()}
                                          for k_, v_ in fa.TUNED_LARGE.items()}})
    print("tuned", out[-1], flush=True)
    return out


def peer_transformers(cfg, batches: list[int], ctx: int, layer_counts: list[int], new_tokens: int) -> list[dict]:
    """transformers generate() decode ms/step at each batch and layer count, and the 48-layer extrapolation."""
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    rows = []
    per = {}
    for nl in layer_counts:
        kw = dict(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=6144,
            moe_intermediate_size=cfg.expert_size, num_hidden_layers=nl, num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.top_k, norm_topk_prob=True,
            max_position_embeddings=max(4096, ctx * 2), mlp_only_layers=[], decoder_sparse_step=1,
            rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False,
        )
        try:  # transformers 5: rope_parameters; 4.x: rope_theta
            hc = Qwen3MoeConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
        except TypeError:
            hc = Qwen3MoeConfig(**kw, rope_theta=cfg.rope_theta)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen3MoeForCausalLM(hc).to(torch.bfloat16).eval()
        impl = {"attn": getattr(model.config, "_attn_implementation", None),
                "experts": getattr(model.config, "_experts_implementation", None)}
        for B in batches:
            ids = torch.randint(0, cfg.vocab_size, (B, ctx), device="cuda")
            mask = torch.ones_like(ids)

            def gen(n, model=model, ids=ids, mask=mask):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, pad_token_id=0)
                torch.cuda.synchronize()
                return time.perf_counter() - t0

            gen(2)  # warm up
            t1 = min(gen(1) for _ in range(2))
            tn = min(gen(1 + new_tokens) for _ in range(2))
            ms = (tn - t1) / new_tokens * 1e3
            per[(nl, B)] = ms
            rows.append({"layers": nl, "batch": B, "context": ctx, "ms_per_step": ms, "tok_per_s": B / (ms * 1e-3),
                         "transformers": transformers.__version__, "impl": impl})
            print(f"peer layers={nl} B={B}: {ms:.1f} ms/step", flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if len(layer_counts) >= 2:
        l0, l1 = layer_counts[0], layer_counts[-1]
        for B in batches:
            b = (per[(l1, B)] - per[(l0, B)]) / (l1 - l0)
            a = per[(l1, B)] - b * l1
            ms48 = a + b * cfg.num_layers
            rows.append({"layers": cfg.num_layers, "batch": B, "context": ctx, "ms_per_step": ms48,
                         "tok_per_s": B / (ms48 * 1e-3), "extrapolated_from_layers": [l0, l1]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="override num_layers (default: the preset's)")
    ap.add_argument("--recipes", default="w4a4kv4,w4a4,w4a16,bf16",
                    help="comma list; NAME or NAME:SITES (e.g. w4a4kv4:all-linear also puts the attention "
                         "projections in FP4; the default site set is the reference method's experts+kv)")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--max-batch-cap", type=int, default=2048)
    ap.add_argument("--no-max-batch", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bf16-experts", default="auto", help="triton | grouped_mm | auto (faster in --micro)")
    ap.add_argument("--micro", action="store_true", help="per-kernel timings at --micro-batch first")
    ap.add_argument("--micro-batch", type=int, default=256)
    ap.add_argument("--peer", action="store_true", help="transformers generate() peer rows")
    ap.add_argument("--peer-batches", default="16,64")
    ap.add_argument("--peer-layers", default="3,6")
    ap.add_argument("--peer-context", type=int, default=1024)
    ap.add_argument("--peer-new-tokens", type=int, default=8)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also time each kernel of the step over N replays (torch.profiler); prints the top ones")
    ap.add_argument("--profile-batches", default="", help="profile only these batches (default: every point)")
    ap.add_argument("--sample-programs-per-sm", type=int, default=None, metavar="N",
                    help="gpu.SAMPLE_PROGRAMS_PER_SM: split the sampler's vocabulary until N programs an SM "
                         "(0 = one program a row; default: the module's)")
    ap.add_argument("--split-k", type=int, choices=(0, 1), default=None,
                    help="fp4_gemm.SPLIT_K: split K of the dense FP4 projections at decode batches (1) or not (0)")
    ap.add_argument("--pdl", type=int, choices=(0, 1), default=None,
                    help="kernels.pdl.ENABLED: programmatic dependent launch of the step's Triton kernels")
    ap.add_argument("--heads-first", type=int, choices=(0, 1), default=None,
                    help="fp4_attention.HEADS_FIRST: a row's KV heads launched together (1) or the rows first (0)")
    ap.add_argument("--time-budget", type=float, default=1e9, help="seconds; later sweep points are skipped")
    ap.add_argument("--out", default="out/rollout.json")
    ap.add_argument("--merge", nargs="+", help="combine result JSONs of one session (sweep + peer) into --out")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if not torch.cuda.is_available():
        print("bench/rollout.py needs a CUDA device", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    if args.sample_programs_per_sm is not None:
        gpu_mod.SAMPLE_PROGRAMS_PER_SM = args.sample_programs_per_sm
    if args.split_k is not None:
        fg.SPLIT_K = bool(args.split_k)
    if args.heads_first is not None:
        fa.HEADS_FIRST = bool(args.heads_first)
    if args.pdl is not None:
        pdl.ENABLED = bool(args.pdl)
    cfg = get_config(args.model) if args.layers is None else get_config(args.model, num_layers=args.layers)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": cfg.name,
           "layers": cfg.num_layers, "selfcheck": fg.selfcheck("cuda"),
           "swizzle": fg.swizzle_check("cuda"), "kv_swizzle": fa.kv_swizzle_check("cuda"), "mma_check": fa.mma_selfcheck("cuda"),
           "sample_programs_per_sm": gpu_mod.SAMPLE_PROGRAMS_PER_SM, "split_k": fg.SPLIT_K,
           "heads_first": fa.HEADS_FIRST, "pdl": pdl.on("cuda")}
    import triton

    env["triton"] = triton.__version__
    bw = copy_bandwidth()
    torch.cuda.empty_cache()
    env["copy_GBps"] = bw / 1e9
    print(f"env: {env}", flush=True)
    result = {"env": env, "args": vars(args), "points": [], "micro": [], "peer_transformers": []}

    def save():
        # Rename over the old file so that a run killed by its time limit leaves the last whole JSON.
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)

    bf16_experts = args.bf16_experts if args.bf16_experts != "auto" else "triton"
    if args.micro:
        result["micro"] = micro(cfg, bw, args.micro_batch, 1024)
        if args.bf16_experts == "auto":
            t = {r["kernel"]: r.get("ms", 1e9) for r in result["micro"] if "kernel" in r}
            if t.get("experts bf16 torch._grouped_mm", 1e9) < t.get("experts bf16 triton (tuned)", 1e9):
                bf16_experts = "grouped_mm"
        save()
        gc.collect()
        torch.cuda.empty_cache()
    env["bf16_experts"] = bf16_experts
    batches = [int(b) for b in args.batches.split(",") if b]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    prof_batches = {int(b) for b in args.profile_batches.split(",") if b}
    for rname in [r for r in args.recipes.split(",") if r]:
        recipe = qat.Recipe.parse(rname)
        t0 = time.perf_counter()
        w = DecoderWeights.random(cfg, recipe, "cuda")
        torch.cuda.synchronize()
        print(f"[{rname}] weights {w.nbytes / GiB:.1f} GiB built in {time.perf_counter() - t0:.1f}s", flush=True)
        for ctx in contexts:
            pts = list(batches)
            if not args.no_max_batch:
                mb = max_batch(cfg, recipe.kv, ctx + args.warmup + args.steps + 2, args.max_batch_cap)
                if mb not in pts and mb > 0:
                    pts.append(mb)
                mb_fit = mb
            for B in pts:
                base = {"recipe": rname, "batch": B, "context": ctx, "largest": not args.no_max_batch and B == mb_fit}
                if time.perf_counter() - t_start > args.time_budget:
                    result["points"].append({**base, "skipped": "time budget"})
                    continue
                if not args.no_max_batch and B > mb_fit:
                    result["points"].append({**base, "fits": False})
                    print(f"[{rname}] ctx={ctx} B={B}: does not fit (largest {mb_fit})", flush=True)
                    continue
                try:
                    prof_n = args.profile if not prof_batches or B in prof_batches else 0
                    r = run_point(w, B, ctx, args.steps, args.warmup, bw, bf16_experts, prof_n)
                    r.update(base)
                    print(f"[{rname}] ctx={ctx} B={B}: {r['ms_per_step']:.2f} ms/step {r['tok_per_s']:.0f} tok/s "
                          f"roofline {r['roofline_frac']:.2f} ({r['achieved_GBps']:.0f} GB/s) "
                          f"peak {r['peak_mem_gib']:.1f} GiB setup {r['setup_s']:.1f}s ok={r['outputs_ok']}", flush=True)
                    prof = r.get("profile", {})
                    if "kernels" in prof:
                        print(f"    kernels {prof['kernel_ms_per_step']:.2f} ms/step of {r['ms_per_step']:.2f}:", flush=True)
                        for k in prof["kernels"][:14]:
                            print(f"    {k['us_per_step']:8.0f} us {k['calls_per_step']:6.0f}x  {k['kernel'][:90]}", flush=True)
                    elif prof:
                        print(f"    profile: {prof}", flush=True)
                except Exception as e:
                    r = {**base, "error": f"{type(e).__name__}: {str(e)[:500]}"}
                    print(f"[{rname}] ctx={ctx} B={B}: ERROR {r['error']}", flush=True)
                    gc.collect()
                    torch.cuda.empty_cache()
                result["points"].append(r)
                save()
        del w
        gc.collect()
        torch.cuda.empty_cache()
    if args.peer and time.perf_counter() - t_start < args.time_budget:
        try:
            result["peer_transformers"] = peer_transformers(
                cfg, [int(b) for b in args.peer_batches.split(",")], args.peer_context,
                [int(x) for x in args.peer_layers.split(",")], args.peer_new_tokens)
        except Exception as e:
            result["peer_transformers"] = [{"error": f"{type(e).__name__}: {str(e)[:500]}"}]
            print("peer ERROR", result["peer_transformers"], flush=True)
    summarize(result)
    result["wall_s"] = time.perf_counter() - t_start
    save()
    return 0


def merge(paths: list[str], out: str) -> int:
    """One result from several runs' JSONs (e.g. the sweep and the peer run of one device session)."""
    parts = [json.load(open(p)) for p in paths]
    result = {"env": parts[0]["env"], "args": [p["args"] for p in parts], "points": [], "micro": [],
              "peer_transformers": [], "sources": paths}
    for p in parts:
        for k in ("points", "micro", "peer_transformers"):
            result[k] += p.get(k, [])
    result["env"]["copy_GBps_runs"] = [p["env"]["copy_GBps"] for p in parts]
    summarize(result)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def summarize(result: dict) -> None:
    """Speedups vs BF16 (equal batch; each recipe's largest batch) and vs the peer; print a table."""
    pts = [p for p in result["points"] if "ms_per_step" in p]
    by = {(p["recipe"], p["context"], p["batch"]): p for p in pts}
    speed = []
    for p in pts:
        if p["recipe"] == "bf16":
            continue
        ref = by.get(("bf16", p["context"], p["batch"]))
        if ref:
            speed.append({"recipe": p["recipe"], "context": p["context"], "batch": p["batch"], "vs": "bf16 equal batch",
                          "speedup": p["tok_per_s"] / ref["tok_per_s"]})
    for ctx in sorted({p["context"] for p in pts}):
        big = {r: max((p for p in pts if p["recipe"] == r and p["context"] == ctx), key=lambda p: p["batch"])
               for r in {p["recipe"] for p in pts if p["context"] == ctx}}
        if "bf16" in big:
            for r, p in big.items():
                if r != "bf16":
                    speed.append({"recipe": r, "context": ctx, "batch": p["batch"], "vs": f"bf16 largest batch {big['bf16']['batch']}",
                                  "speedup": p["tok_per_s"] / big["bf16"]["tok_per_s"]})
    peer = {(r["batch"]): r for r in result.get("peer_transformers", []) if r.get("layers") == 48}
    for p in pts:
        if p["batch"] in peer and p["context"] == 1024:
            speed.append({"recipe": p["recipe"], "context": p["context"], "batch": p["batch"],
                          "vs": "transformers generate (48-layer extrapolation)",
                          "speedup": p["tok_per_s"] / peer[p["batch"]]["tok_per_s"]})
    result["speedups"] = speed
    # the committed summary: one entry per recipe x batch x context
    result["summary"] = {f"{p['recipe']}/b{p['batch']}/ctx{p['context']}": {
        k: p[k] for k in ("tok_per_s", "ms_per_step", "roofline_frac", "peak_mem_gib", "bytes_per_step", "largest")}
        for p in pts}
    print(f"\ncopy bandwidth {result['env']['copy_GBps']:.0f} GB/s; {result['env']['selfcheck']}; {result['env'].get('swizzle', '')}; "
          f"kv cache {result['env'].get('kv_swizzle', '')}")
    print(f"{'recipe':8} {'ctx':>5} {'batch':>5} {'ms/step':>8} {'tok/s':>9} {'GB/step':>8} {'roofline':>8} {'peak GiB':>8}")
    for p in result["points"]:
        if "ms_per_step" in p:
            print(f"{p['recipe']:8} {p['context']:5d} {p['batch']:5d} {p['ms_per_step']:8.2f} {p['tok_per_s']:9.0f} "
                  f"{p['bytes_per_step'] / 1e9:8.2f} {p['roofline_frac']:8.2f} {p['peak_mem_gib']:8.1f}"
                  + ("  (largest)" if p.get("largest") else ""))
        else:
            print(f"{p['recipe']:8} {p['context']:5d} {p['batch']:5d} {p.get('error') or p.get('skipped') or 'does not fit'}")
    for r in result.get("peer_transformers", []):
        if "ms_per_step" in r:
            print(f"transformers L={r['layers']:2d} B={r['batch']:4d}: {r['ms_per_step']:.1f} ms/step {r['tok_per_s']:.0f} tok/s"
                  + (" (extrapolated)" if "extrapolated_from_layers" in r else ""))
    for s in speed:
        print(f"speedup {s['recipe']:8} ctx={s['context']:5d} B={s['batch']:4d} vs {s['vs']}: {s['speedup']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
