"""Swizzled NVFP4 weights (kernels/fp4_swizzle.py): the storage the decode GEMMs read.

Torch only (no Triton): the PTX's bit operations are replayed by `decode_swizzled`, so these tests
fix the encoding the kernel relies on; tests/test_gpu_kernels.py runs the kernels themselves on it
(interpreter on CPU, PTX on the GPU) against natural weights, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tracerl import fp4, qat
from tracerl.kernels import decode_reference as ref
from tracerl.kernels import fp4_swizzle as S

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _every_byte_at_every_position(n_random: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (1024 + n_random, 4), dtype=torch.uint8, generator=g)
    for i in range(4):
        w[256 * i:256 * (i + 1), i] = torch.arange(256, dtype=torch.uint8)
    return w


def test_swizzle_is_a_bijection_on_words():
    w = _every_byte_at_every_position()
    s = S.swizzle_codes(w)
    assert torch.equal(S.unswizzle_codes(s), w)
    # a permutation of bits per word: as many set bits as the natural word, and not the identity
    def pop(x):
        return sum(((x >> i) & 1) for i in range(8)).sum()
    assert int(pop(s.to(torch.int64))) == int(pop(w.to(torch.int64)))
    assert not torch.equal(s, w)


def test_ptx_arithmetic_yields_the_natural_values():
    """The kernel's masks and shifts give every code's E2M1 value (sign of zero included), with the
    even-index codes in the 'even' tile and the odd ones in the 'odd' tile, in column order."""
    w = _every_byte_at_every_position()
    even, odd = S.decode_swizzled(S.swizzle_codes(w))
    want_even, want_odd = E2M1[(w & 15).long()], E2M1[(w >> 4).long()]
    assert torch.equal(even, want_even) and torch.equal(odd, want_odd)
    assert torch.equal(torch.signbit(even), torch.signbit(want_even))
    assert torch.equal(torch.signbit(odd), torch.signbit(want_odd))


def test_scale_bytes_round_trip_every_e4m3_scale():
    raw = torch.arange(1, 0x7F, dtype=torch.uint8)  # every positive, finite, nonzero E4M3 value
    sc = raw.view(torch.float8_e4m3fn)
    b = S.scale_bytes(sc)
    assert torch.equal(S.e4m3_scales(b).view(torch.uint8), raw)
    # the kernel's one multiply-add: b * 16 + 30080 is the BF16 of s8 * 2**117
    bits = (b.to(torch.int32) * 16 + 30080) << 16
    assert torch.equal(bits.view(torch.float32), sc.to(torch.float32) * 2.0**117)
    assert int(b.max()) < 256 and len(set(b.tolist())) == raw.numel()


@pytest.mark.parametrize("byte", [0x00, 0x7F, 0x80, 0xB8, 0xFF])
def test_scale_bytes_refuse_zero_negative_and_nan(byte):
    sc = torch.tensor([0x38, byte], dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="zero, negative or NaN"):
        S.scale_bytes(sc)


def test_swizzled_weight_keeps_values_and_bytes():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(3, 48, 256, generator=g) * 0.02).bfloat16()
    q = qat.quantize_weight(w, "nvfp4")
    s = S.SwizzledFP4.of(q)
    assert isinstance(s, fp4.FP4Tensor) and s.nbytes == q.nbytes and s.shape == q.shape
    assert S.SwizzledFP4.of(s) is s
    n = s.natural()
    assert torch.equal(n.codes, q.codes) and torch.equal(n.scales.view(torch.uint8), q.scales.view(torch.uint8))
    assert torch.equal(ref.exact_values(s), ref.exact_values(q))
    assert torch.equal(fp4.dequantize(n, torch.float32), fp4.dequantize(q, torch.float32))


def test_zero_scale_blocks_keep_their_zero_values():
    """A foreign checkpoint's all-zero block may carry scale 0 (no kernel byte): swizzled, it reads
    as zero codes under the smallest scale, the same values; a NaN scale is still refused."""
    g = torch.Generator().manual_seed(4)
    q = fp4.quantize(torch.randn(2, 8, 64, generator=g), "nvfp4", global_scale=torch.tensor([7.0, 300.0]).reshape(2, 1, 1))
    raw = q.scales.view(torch.uint8).clone()
    raw[0, 3, 1] = 0
    raw[1, 0, 0] = 0
    q = fp4.FP4Tensor(q.codes, raw.view(torch.float8_e4m3fn), q.global_scale, q.fmt, q.shape)
    s = S.SwizzledFP4.of(q)
    assert torch.equal(ref.exact_values(s), ref.exact_values(q))
    assert float(fp4.dequantize(s.natural(), torch.float32)[0, 3, 16:32].abs().sum()) == 0.0
    raw[0, 0, 0] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        S.SwizzledFP4.of(fp4.FP4Tensor(q.codes, raw.view(torch.float8_e4m3fn), q.global_scale, q.fmt, q.shape))


def test_swizzle_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 4"):
        S.swizzle_codes(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        S.swizzle_codes(torch.zeros(2, 8, dtype=torch.int32))
    q = fp4.quantize(torch.randn(4, 64), "mxfp4")
    with pytest.raises(ValueError, match="NVFP4"):
        S.SwizzledFP4.of(q)


def test_cache_scale_bytes_are_total_and_keep_nan():
    raw = torch.arange(256, dtype=torch.uint8)
    b = S.cache_scale_bytes(raw)
    ok = (raw > 0) & (raw < 0x7F)
    assert torch.equal(b[ok], S.scale_bytes(raw[ok].view(torch.float8_e4m3fn)))
    assert int(b[0]) == 0 and float(S.e4m3_scales(b[:1]).float()) == 2.0**-9  # a zero block's scale
    assert bool((b[raw >= 0x7F] == S.NAN_BYTE).all())
    # the kernel's multiplier from that byte (b * 16 + 30080, BF16 bits) is a NaN
    bits = torch.tensor([S.NAN_BYTE * 16 + 30080], dtype=torch.int32) << 16
    assert bool(bits.view(torch.float32).isnan().all())
    assert torch.equal(S.cache_scale_bytes(raw[1:0x7F].view(torch.float8_e4m3fn)), b[1:0x7F])
    with pytest.raises(ValueError, match="uint8 or float8_e4m3fn"):
        S.cache_scale_bytes(raw.to(torch.int32))


def test_swizzle_blocks_keep_the_values_of_a_kv_row():
    q = fp4.quantize(torch.randn(3, 5, 2, 64), "nvfp4", per_row_global=True)
    q.scales.view(torch.uint8)[1, 2] = 0  # zero scales over nonzero codes (a foreign cache): zero values
    codes, sb = S.swizzle_blocks(q.codes, q.scales)
    even, odd = S.decode_swizzled(codes)
    s8 = S.e4m3_scales(sb).float().repeat_interleave(8, -1)
    got = torch.stack([even, odd], -1).flatten(-2) * s8.repeat_interleave(2, -1)
    want = fp4.dequantize(fp4.FP4Tensor(q.codes, q.scales, torch.ones(()), "nvfp4", q.shape), torch.float32)
    assert float(want[1, 2].abs().sum()) == 0 and float(q.codes[1, 2].float().sum()) > 0
    assert torch.equal(got, want)
    assert torch.equal(S.unswizzle_codes(codes)[0], q.codes[0])
