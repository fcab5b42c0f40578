"""RecordSink (kernels/record_sink.py): the quantize kernel's second store at each row's record row.

The record row formula is checked against a plain Python loop (an independent statement of where
the graph engine keeps (slot, column[, k | kv head]) records); the Triton kernel's in-pass store is
checked bit for bit against the reference (`RecordSink.write` after `fp4.quantize`), in Triton's
interpreter on CPU and natively on the GPU, for the three row layouts the decoder uses.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from test_gpu_kernels import HAS_TRITON, _run_interpreter  # noqa: E402 (tests/ is on sys.path)
from test_kernels import _INTERP_SHIM  # noqa: E402 (the interpreter fixes the quantize kernel needs)
from tracerl import fp4, kernels
from tracerl.kernels.record_sink import RecordSink

CUDA = torch.cuda.is_available()
SLOTS, T = 3, 5  # record grid: slots x max_len
FLAT = [0 * T + 2, 1 * T + 4, 2 * T + 0]  # this step's column of each slot


def _buffers(n: int, K: int, dev: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # sentinels: rows the sink must not touch keep them
    return (torch.full((n, K // 2), 0xAB, dtype=torch.uint8, device=dev),
            torch.full((n, K // 16), 0xCD, dtype=torch.uint8, device=dev),
            torch.full((n,), -7.0, device=dev))


def _cases(dev: str):
    """(name, x, sink keyword args, record rows the grid has, expected record row per x row)."""
    g = torch.Generator().manual_seed(0)
    flat = torch.tensor(FLAT, device=dev)
    top_k, hkv = 2, 2
    tok = torch.randn(SLOTS, 64, generator=g).to(dev, torch.bfloat16)
    yield "token", tok, {"flat": flat}, SLOTS * T, [FLAT[r] for r in range(SLOTS)]
    # expert-sorted (token, k) pairs: x row r holds pair src[r] = token * top_k + k
    src = torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32)
    pairs = torch.randn(6, 64, generator=g).to(dev, torch.bfloat16) * 40
    yield ("pairs", pairs, {"flat": flat, "src": src.to(dev), "group": top_k}, SLOTS * T * top_k,
           [FLAT[int(p) // top_k] * top_k + int(p) % top_k for p in src])
    # the KV cache: rows (k|v, slot, kv head), two record buffers laid end to end
    kv = torch.randn(2, SLOTS, hkv, 32, generator=g).to(dev, torch.bfloat16)
    kv[1, 2, 1] *= 1e-3  # a row of another magnitude: its own global scale
    per = SLOTS * T * hkv
    yield ("kv", kv, {"flat": flat, "group": hkv, "plane_rows": SLOTS * hkv, "plane_stride": per}, 2 * per,
           [j * per + FLAT[s] * hkv + h for j in range(2) for s in range(SLOTS) for h in range(hkv)])


def check_sinks(dev: str, use_triton: bool) -> None:
    """Every layout: the sink's rows equal the quantized rows, at the expected record rows only (on
    Triton also with the BF16 c * s8 written in the same pass, as the graph engine's expert inputs)."""
    for (name, x, kw, n, expect), dq in itertools.product(_cases(dev), (False, True) if use_triton else (False,)):
        K = x.shape[-1]
        codes, scales, gs = _buffers(n, K, dev)
        sink = RecordSink(codes=codes, scales=scales, gscale=gs, **kw)
        assert sink.dest_rows(len(expect)).tolist() == expect, name
        deq = torch.full(x.shape, 3.0, dtype=torch.bfloat16, device=dev) if dq else None
        if use_triton:
            from tracerl.kernels import fp4_quant

            q, _ = fp4_quant.quantize(x, "nvfp4", per_row_global=True, sink=sink, dequant_out=deq)
        else:
            q = kernels.quantize(x, "nvfp4", per_row_global=True, sink=sink)
        want = fp4.quantize(x, "nvfp4", per_row_global=True)
        assert torch.equal(q.codes, want.codes) and torch.equal(q.scales.view(torch.uint8), want.scales.view(torch.uint8))
        if dq:
            unit = fp4.FP4Tensor(want.codes, want.scales, torch.ones_like(want.global_scale), "nvfp4", want.shape)
            assert torch.equal(deq, fp4.dequantize(unit, torch.bfloat16)), name
        M = len(expect)
        d = torch.tensor(expect, device=dev)
        assert torch.equal(codes[d], want.codes.reshape(M, -1)), name
        assert torch.equal(scales[d], want.scales.view(torch.uint8).reshape(M, -1)), name
        assert torch.equal(gs[d], want.global_scale.reshape(M)), name
        rest = torch.ones(n, dtype=torch.bool, device=dev)
        rest[d] = False
        assert (codes[rest] == 0xAB).all() and (scales[rest] == 0xCD).all() and (gs[rest] == -7.0).all(), name


def test_reference_sink_writes_each_row_at_its_record_row():
    check_sinks("cpu", use_triton=False)


def test_sink_errors_name_the_field():
    x = torch.randn(3, 64)
    codes, scales, gs = _buffers(15, 64, "cpu")
    flat = torch.tensor(FLAT)
    with pytest.raises(ValueError, match="RecordSink.codes"):
        kernels.quantize(x, "nvfp4", per_row_global=True, sink=RecordSink(codes[:, :8], scales, gs, flat))
    with pytest.raises(ValueError, match="RecordSink.gscale"):
        kernels.quantize(x, "nvfp4", per_row_global=True, sink=RecordSink(codes, scales, None, flat))
    with pytest.raises(ValueError, match="RecordSink.flat"):
        kernels.quantize(x, "nvfp4", per_row_global=True, sink=RecordSink(codes, scales, gs, flat.int()))
    with pytest.raises(ValueError, match="RecordSink.src"):
        kernels.quantize(x, "nvfp4", per_row_global=True, sink=RecordSink(codes, scales, gs, flat, src=flat[:2]))


@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="needs triton and no CUDA (the interpreter runs on CPU)")
def test_triton_sink_in_interpreter():
    p = _run_interpreter(_INTERP_SHIM + "import test_record_sink as t; t.check_sinks('cpu', True); print('checks ok')")
    assert p.returncode == 0 and "checks ok" in p.stdout, p.stdout[-3000:] + p.stderr[-6000:]


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and HAS_TRITON), reason="needs CUDA and triton")
def test_triton_sink_gpu():
    check_sinks("cuda", use_triton=True)
