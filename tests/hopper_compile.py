"""Compile every Triton kernel for the H200 (sm_90) on a machine without a GPU.

The interpreter checks run the kernels' Python on CPU, but the GPU compiler rejects code the
interpreter accepts (an early `return` under a constexpr `if` is lowered together with the code
after it; inline PTX is never seen), and the device machine is lent 30 minutes a session. Triton
compiles to a cubin with its bundled ptxas and needs no GPU: `compile_only` installs a driver
that names an sm_90 target and turns every launch into a compile (`warmup`), so the real host
wrappers run on CPU tensors with the exact arguments and constexprs they pass on the GPU. The
outputs are left unwritten; only compilation is checked (values are the interpreter's and the
GPU tests' job).

Run as a script (a fresh process: the module-level driver swap must not leak into other tests):
    PYTHONPATH=src python tests/hopper_compile.py   -> prints one line per kernel variant, then 'compiled N'
    PYTHONPATH=src python tests/hopper_compile.py --regs   -> each line also gets the cubin's registers
        per thread (cuobjdump) and Triton's dynamic shared memory: both limit CTAs per SM, so tiles
        and variants can be weighed on CPU before a device call times them
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys

import torch


class _Sm90Driver:
    """The little of Triton's driver interface that compiling (not launching) needs."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def resource_usage(kernel) -> str:
    """'REG:n STACK:n LOCAL:n SMEM:n' of a compiled kernel: registers per thread, the stack frame that
    register spills go to (bytes; LOCAL is only static local arrays), from cuobjdump (which ships with
    Triton), and the dynamic shared memory Triton allocates (bytes)."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    usage = next((line.strip() for line in out.splitlines() if "REG:" in line), "")
    # Triton's shared memory is dynamic (in the metadata); cuobjdump's SHARED is only the static part
    return " ".join(w for w in usage.split() if w.startswith(("REG:", "STACK:", "LOCAL:"))) + f" SMEM:{kernel.metadata.shared}"


@contextlib.contextmanager
def compile_only(log: list, regs: bool = False):
    """Make every launch a compile for sm_90, appending (kernel, constexprs, error or None) to `log`; with
    `regs`, the constexprs also carry the cubin's resource usage under 'usage'."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    run = JITFunction.run
    previous = driver._active  # None on a machine without a GPU driver (reset_active would raise)

    def compile_instead(self, *args, grid, warmup, **kw):
        const = {k: v for k, v in kw.items() if k.isupper()}
        try:
            k = run(self, *args, grid=grid, warmup=True, **kw)
        except Exception as e:  # noqa: BLE001 - reported per variant, the caller fails on any
            log.append((self.fn.__name__, const, f"{type(e).__name__}: {_cause(e)}"))
            raise
        if regs:
            const["usage"] = resource_usage(k) + f" warps:{kw.get('num_warps', 4)}"
        log.append((self.fn.__name__, const, None))
        return k

    driver.set_active(_Sm90Driver(GPUTarget("cuda", 90, 32)))
    JITFunction.run = compile_instead
    try:
        yield
    finally:
        JITFunction.run = run
        driver.set_active(previous)


def _cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    return str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__


def _experts(E: int, O: int, K: int):
    from tracerl import qat

    w = (torch.randn(E, O, K, generator=torch.Generator().manual_seed(E + O + K)) * 0.02).bfloat16()
    return w, qat.quantize_weight(w, "nvfp4")


def compile_variants(log: list, regs: bool = False) -> None:
    """Call every kernel wrapper in every variant the GPU path can take, logging each compile in `log`."""
    from tracerl import fp4
    from tracerl.kernels import fp4_attention as fa
    from tracerl.kernels import fp4_gemm as fg
    from tracerl.kernels import fp4_numerics, fp4_quant
    from tracerl.rollout import gpu
    from tracerl.rollout.kvcache import FP4KVCache

    saved = fg.SWAP_AB, fg.TMA_W, fg.PREFETCH, fg.USE_ASM, dict(fg.KERNEL_VARIANT)
    fg.KERNEL_VARIANT.clear()  # the loop below sets the module flags: no per-kind default may override them
    g = torch.Generator().manual_seed(0)
    E, F, D, T, K = 4, 768, 2048, 24, 2  # qwen3-30b-a3b widths: K is a constexpr, and registers depend on it
    with compile_only(log, regs):
        try:
            w_gu, q_gu = _experts(E, 2 * F, D)
            w_dn, q_dn = _experts(E, D, F)
            x = torch.randn(T, D, generator=g).bfloat16()
            ids, gates = fg.route_reference(torch.randn(T, E, generator=g), K)
            offs, tok, pair, gs = fg.dispatch_reference(ids, gates, E)
            xq = fp4.quantize(x, "nvfp4", per_row_global=True)
            from tracerl.kernels.fp4_swizzle import SwizzledFP4
            s_gu, s_dn = SwizzledFP4.of(q_gu), SwizzledFP4.of(q_dn)
            h = torch.randn(T * K, F, generator=g).bfloat16()
            out = torch.zeros(T * K, D)
            for fg.USE_ASM in (True, False):
                for fg.PREFETCH in (True, False):
                    for fg.SWAP_AB, fg.TMA_W in ((False, False), (True, False), (False, True), (True, True)):
                        for w in (w_gu, q_gu):
                            fg.grouped_gemm(x, w, offs, row_idx=tok, n_rows=T * K, out_f32=True)
                            fg.grouped_gemm(x, w, offs, row_idx=tok, n_rows=T * K, swiglu=True)
                        fg.grouped_gemm(xq, q_gu, offs, row_idx=tok, n_rows=T * K, swiglu=True)
                        for w in (w_dn, q_dn):
                            fg.grouped_gemm(h, w, offs, dst_idx=pair, gate=gs, out=out)
                        if fg.SWAP_AB and fg.USE_ASM:
                            continue  # grouped_gemm refuses swizzled weights as the dot's left operand
                        # swizzled weights (fp4_swizzle.py), and w4a4 with its activations dequantized in the loop
                        fg.grouped_gemm(h, s_dn, offs, dst_idx=pair, gate=gs, out=out)
                        fg.grouped_gemm(h, s_dn, offs, dst_idx=pair, out=out.bfloat16())
                        fg.grouped_gemm(x, s_gu, offs, row_idx=tok, n_rows=T * K, swiglu=True)
                        fg.DEQUANT_A = False
                        fg.grouped_gemm(xq, s_gu, offs, row_idx=tok, n_rows=T * K, swiglu=True)
                        fg.DEQUANT_A = True
            # the large-batch tiles (fg.LARGE) on the decoder's swizzled weights, w4a16 and w4a4
            fg.PREFETCH = fg.SWAP_AB = fg.TMA_W = False
            for kind, entries in fg.LARGE.items():
                for _, c in entries:
                    a = (xq if kind[2] else fp4.quantize(h, "nvfp4", per_row_global=True)) if kind[1] else \
                        (x if kind[2] else h)
                    if kind[2]:
                        fg.grouped_gemm(a, s_gu, offs, row_idx=tok, n_rows=T * K, swiglu=True, config=c)
                    else:  # as the decoder calls it: the BF16 outputs, gated by the residual kernel
                        fg.grouped_gemm(a, s_dn, offs, dst_idx=pair, out=out.bfloat16(), config=c)
            # a per-kind choice (what bench/rollout.py --micro stores) overrides the module flags
            fg.PREFETCH = fg.SWAP_AB = fg.TMA_W = False
            fg.KERNEL_VARIANT[(True, True, True)] = (False, True, True)
            fg.grouped_gemm(xq, q_gu, offs, row_idx=tok, n_rows=T * K, swiglu=True)
            last = next(c for n, c, _ in reversed(log) if n == "_grouped_gemm_kernel")
            if not (last["SWAP"] and last["TMA"] and not last["PF"]):
                raise AssertionError(f"KERNEL_VARIANT was not applied: {last}")
            wl = fp4.FP4Tensor(q_dn.codes[0], q_dn.scales[0], q_dn.global_scale[0].reshape(1), "nvfp4",
                               torch.Size((D, F)))
            fg.fp4_linear(h, wl, out_f32=True)
            # K split over programs (decode batches): float32 partials, then their sum in BF16 / float32
            fg.fp4_linear(h, wl, split_k=3)
            fg.fp4_linear(fp4.quantize(h, "nvfp4", per_row_global=True), wl, out_f32=True, split_k=2)
            fg.row_tiles(offs, 16, fg.max_row_tiles(E, T * K, 16))
            fg.route(torch.randn(T, 16, generator=g), 4)
            fg.dispatch(ids, gates, E)
            fg.DISPATCH_ONE_TILE = False  # the chunk loop too
            fg.dispatch(ids, gates, E)
            fg.DISPATCH_ONE_TILE = True

            B, H, Hkv, Dh, L = 3, 32, 4, 128, 80
            q = torch.randn(B, H, Dh, generator=g).bfloat16()
            k, v = (torch.randn(B, L, Hkv, Dh, generator=g).bfloat16() for _ in range(2))
            lens = torch.tensor([1, 40, L], dtype=torch.int32)
            kq, vq = (fp4.quantize(t, "nvfp4", per_row_global=True) for t in (k, v))
            for asm in (True, False):
                fg.USE_ASM = asm
                # split_len L: one split, the kernel writes the output itself (fa.FUSE_SINGLE_SPLIT)
                for split in (32, L):
                    fa.decode_attention(q, lens, k=k, v=v, split_len=split)
                    # natural and swizzled (the decoder's) FP4 caches; the swizzled one also decoded by words
                    for swz, words in ((False, False), (True, False), (True, True)):
                        fa.decode_attention(q, lens, k_fp4=(kq.codes, kq.scales.view(torch.uint8), kq.global_scale),
                                            v_fp4=(vq.codes, vq.scales.view(torch.uint8), vq.global_scale),
                                            split_len=split, swizzled=swz, words=words)
            # the mma kernel (Gluon; decode_attention picks it on CUDA tensors only, so launched directly)
            from tracerl.kernels import fp4_attention_mma as fm

            S_ = 3
            po, pml = torch.empty(B, H, S_, Dh), torch.empty(B, H, S_, 2)
            from tracerl.kernels import fp4_swizzle as fs

            sc, ss = fs.swizzle_blocks(kq.codes, kq.scales.view(torch.uint8))
            for bt, rows in itertools.product((16, 32), fm.ROWS):
                fm.launch(q, sc, ss, kq.global_scale, sc, ss, kq.global_scale, lens, po, pml, 0.088, 32, bt,
                          rows=rows)
                fm.launch(q, sc, ss, kq.global_scale, sc, ss, kq.global_scale, lens, po, pml, 0.088, L, bt, S=1,
                          out=torch.empty(B, H * Dh, dtype=torch.bfloat16), rows=rows)
            # the register cap the tuner tries on the positions kernel (bench/attention_profile.MMA_MAXNREG)
            fm.launch(q, sc, ss, kq.global_scale, sc, ss, kq.global_scale, lens, po, pml, 0.088, L, 16, S=1,
                      out=torch.empty(B, H * Dh, dtype=torch.bfloat16), rows="positions", maxnreg=144)
            from tracerl.model.layers import rope_cos_sin

            qkv = torch.randn(B, (H + 2 * Hkv) * Dh, generator=g).bfloat16()
            cos, sin = rope_cos_sin(torch.arange(L)[None], Dh, 1e6, torch.bfloat16)
            pos = torch.tensor([0, 4, 9], dtype=torch.int32)
            kc = torch.zeros(B, L, Hkv, Dh, dtype=torch.bfloat16)
            fa.qkv_post(qkv, pos, cos[0].contiguous(), sin[0].contiguous(), torch.ones(2, Dh, dtype=torch.bfloat16),
                        H, Hkv, Dh, 1e-6, kc, torch.zeros_like(kc))
            cache = FP4KVCache(2, B, L, Hkv, Dh, device="cpu")
            kv = fp4.quantize(torch.randn(2, B, Hkv, Dh, generator=g), "nvfp4", per_row_global=True)
            for swz in (False, True):
                fa.kv_store_fp4(kv, pos, cache.codes[:, 1], cache.scales[:, 1], cache.gscale[:, 1], swizzle=swz)

            xs = torch.randn(B, D, generator=g).bfloat16()
            gpu.add_rmsnorm(xs.clone(), torch.randn(B, 3, D, generator=g), torch.ones(D, dtype=torch.bfloat16), 1e-6,
                            torch.empty_like(xs))
            gpu.add_rmsnorm(xs.clone(), torch.randn(B, 8, D, generator=g).bfloat16(), torch.ones(D, dtype=torch.bfloat16),
                            1e-6, torch.empty_like(xs), gates=torch.rand(B, 8, generator=g))
            for temp, V, ns in ((0.0, 300, None), (0.7, 300, None), (0.7, 5000, 1), (0.7, 5000, 2), (0.0, 5000, 2)):
                # BV 512 and 4096 (the 30B vocabulary's); one program a row, and spans + merge
                logits = torch.randn(B, V, generator=g)
                gpu.sample_tokens(logits, temp, torch.zeros(1, dtype=torch.long), torch.empty(B, dtype=torch.long),
                                  torch.empty(B), splits=ns)

            a = torch.randn(8, 256, generator=g)
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                for fmt in ("nvfp4", "mxfp4"):
                    fp4_quant.quantize(a.to(dt), fmt)
                qr, rec = fp4_quant.quantize(a.to(dt), "nvfp4", per_row_global=True, record="lsb")
                fp4_quant.quantize(a.to(dt), "nvfp4", global_scale=torch.tensor(448.0 * 6 / 4))
                fp4_quant.quantize(a.to(dt), "nvfp4", per_row_global=True, record="codes")
                guide = fp4.RoundingGuide(bit=rec, scales=qr.scales, global_scale=qr.global_scale)
                fp4_quant.quantize(a.to(dt), "nvfp4", "guided", guide=guide)
                fp4_quant.dequantize(qr, dt)
                # with the BF16 c * s8 written in the same pass (the decoder's FP4 expert inputs)
                fp4_quant.quantize(a.to(dt), "nvfp4", per_row_global=True,
                                   dequant_out=torch.empty(8, 256, dtype=torch.bfloat16))
            # the graph engine's recording: a second store at each row's record row (with and
            # without a source index: token / KV rows and expert-sorted pairs)
            from tracerl.kernels.record_sink import RecordSink
            for src in (None, torch.arange(8, dtype=torch.int32)):
                sink = RecordSink(torch.empty(64, 128, dtype=torch.uint8), torch.empty(64, 16, dtype=torch.uint8),
                                  torch.empty(64), torch.zeros(4, dtype=torch.long), src=src, group=2)
                fp4_quant.quantize(a.to(torch.bfloat16), "nvfp4", per_row_global=True, sink=sink)
                # recorded and dequantized in the same pass (the graph engine's FP4 expert inputs)
                fp4_quant.quantize(a.to(torch.bfloat16), "nvfp4", per_row_global=True, sink=sink,
                                   dequant_out=torch.empty(8, 256, dtype=torch.bfloat16))
            # many short rows: 8 rows a program (the down GEMM's input at large batches), recorded
            many = torch.randn(4096, 768, generator=g).bfloat16()
            sink = RecordSink(torch.empty(4096, 384, dtype=torch.uint8), torch.empty(4096, 48, dtype=torch.uint8),
                              torch.empty(4096), torch.arange(4096, dtype=torch.long))
            fp4_quant.quantize(many, "nvfp4", per_row_global=True, sink=sink, dequant_out=torch.empty_like(many))
            # the probes as test_kernels.check_probes calls them: these decode integer inputs
            int_in = {"e2m1_magnitude", "e2m1_decode_bytes", "e4m3_value", "mx_mult", "mx_inv_mult"}
            for what in fp4_numerics.PROBES:
                vals = torch.arange(64, dtype=torch.int32) if what in int_in else torch.rand(64, generator=g)
                fp4_numerics.probe(what, vals)
            # programmatic dependent launch (kernels/pdl.py): the decode step's kernels with PDL=True
            from tracerl.kernels import pdl

            pdl.ENABLED = pdl.ASSUME_SM90 = fg.USE_ASM = True
            fg.KERNEL_VARIANT.clear()
            fg.SWAP_AB = fg.TMA_W = fg.PREFETCH = False
            fg.fp4_linear(h, wl, split_k=3)
            fg.grouped_gemm(xq, s_gu, offs, row_idx=tok, n_rows=T * K, swiglu=True)
            fg.grouped_gemm(h, s_dn, offs, dst_idx=pair, out=out.bfloat16())
            fg.row_tiles(offs, 16, fg.max_row_tiles(E, T * K, 16))
            fg.route(torch.randn(T, 16, generator=g), 4)
            fg.dispatch(ids, gates, E)
            for split in (32, L):
                fa.decode_attention(q, lens, k_fp4=(sc, ss, kq.global_scale), v_fp4=(sc, ss, kq.global_scale),
                                    split_len=split, swizzled=True, words=True)
            fa.qkv_post(qkv, pos, cos[0].contiguous(), sin[0].contiguous(), torch.ones(2, Dh, dtype=torch.bfloat16),
                        H, Hkv, Dh, 1e-6, kc, torch.zeros_like(kc))
            fa.kv_store_fp4(kv, pos, cache.codes[:, 1], cache.scales[:, 1], cache.gscale[:, 1], swizzle=True)
            gpu.add_rmsnorm(xs.clone(), torch.randn(B, 8, D, generator=g).bfloat16(), torch.ones(D, dtype=torch.bfloat16),
                            1e-6, torch.empty_like(xs), gates=torch.rand(B, 8, generator=g))
            gpu.sample_tokens(torch.randn(B, 5000, generator=g), 0.7, torch.zeros(1, dtype=torch.long),
                              torch.empty(B, dtype=torch.long), torch.empty(B), splits=2)
            qr, _ = fp4_quant.quantize(a.bfloat16(), "nvfp4", per_row_global=True,
                                       dequant_out=torch.empty(8, 256, dtype=torch.bfloat16))
            fp4_quant.dequantize(qr, torch.bfloat16)
        finally:
            fg.SWAP_AB, fg.TMA_W, fg.PREFETCH, fg.USE_ASM, fg.KERNEL_VARIANT = saved
            from tracerl.kernels import pdl

            pdl.ENABLED = pdl.ASSUME_SM90 = False


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("hopper_compile compiles for the GPU: run it without TRITON_INTERPRET=1")
    failed, entries = 0, []
    try:
        compile_variants(entries, regs="--regs" in sys.argv[1:])
    except Exception as e:  # noqa: BLE001 - the log names the variant that broke
        print("stopped:", type(e).__name__, _cause(e))
        failed = 1
    for name, const, err in entries:
        usage = const.pop("usage", "")
        print("FAIL" if err else "ok", name, ",".join(f"{k}={v}" for k, v in sorted(const.items())), err or usage)
    print("compiled", sum(1 for *_, err in entries if err is None))
    sys.exit(1 if failed or any(err for *_, err in entries) else 0)
