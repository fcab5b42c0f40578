"""Guided rounding (TRACE) and guidance records: exactness, encodings, bytes, cache policies."""

import pytest
import torch

from tracerl import fp4
from tracerl.guidance import CachePolicy, GuidanceRecord, near_midpoint, pack_bits, record, unpack_bits


def _acts(seed=0, shape=(64, 256), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # activation-like: per-token scale, a few outlier channels
    x = torch.randn(shape, generator=g) * (0.5 + torch.rand(*shape[:-1], 1, generator=g))
    x[..., :4] *= 8
    return x.to(dtype)


def _perturb(x, rel=2e-3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return x + x * rel * torch.randn(x.shape, generator=g)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_codes_record_of_x_itself_reproduces_rollout_exactly(fmt):
    x = _acts()
    rec, q = record(x, fmt, "codes")
    rollout = fp4.dequantize(q, torch.float32)
    assert torch.equal(fp4.fake_quantize(x, fmt, guidance=rec, per_row_global=True), rollout)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("fields", ["codes+scales", "codes"])
def test_guided_rounding_matches_rollout_wherever_its_code_is_a_neighbour(fmt, fields):
    x = _acts()
    x_train = _perturb(x)
    rec, q = record(x, fmt, "codes", fields=fields)
    roll_codes = fp4.unpack_codes(q)
    rtn = fp4.quantize(x_train, fmt, per_row_global=True)
    guided = fp4.quantize(x_train, fmt, "guided", per_row_global=True, guide=rec.rounding_guide())
    # neighbours of the trainer's value under the scales the guided quantizer used
    gq, scaled = fp4._quantize_with_values(x_train, fmt, "guided", per_row_global=True, guide=rec.rounding_guide())
    lo, hi = fp4.grid_neighbours(scaled.abs())
    roll_mag = (roll_codes & 7).long()
    neighbour = (roll_mag == lo) | (roll_mag == hi)
    same_guided = fp4.unpack_codes(guided) == roll_codes
    same_rtn = fp4.unpack_codes(rtn) == roll_codes
    n_nb = int(neighbour.sum())
    assert n_nb > 0.99 * x.numel()
    # where the rollout's code is a neighbour, guidance reproduces it on every element
    assert bool(same_guided[neighbour].all())
    # round-to-nearest flips some of them (the mismatch TRACE removes)
    flips_rtn = int((~same_rtn).sum())
    flips_guided = int((~same_guided).sum())
    print(f"{fmt} {fields}: rtn flips {flips_rtn}, guided flips {flips_guided} of {x.numel()}")
    assert flips_rtn > 20 and flips_guided <= int((~neighbour).sum())
    if fields == "codes+scales":  # with the rollout's scales nearly every code is a neighbour
        assert flips_guided < flips_rtn / 5
    # never further from the rollout than RTN (in value, when both use the rollout's scales)
    if fields == "codes":
        return
    rv = fp4.dequantize(q, torch.float32)
    assert ((fp4.dequantize(guided, torch.float32) - rv).abs() <= (fp4.dequantize(rtn, torch.float32) - rv).abs() + 1e-6).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_lsb_and_ties_agree_with_codes_where_they_carry_information(fmt):
    x = _acts(seed=3)
    x_train = _perturb(x, rel=1e-3)
    out = {}
    for enc in ("codes", "lsb", "ties"):
        rec, q = record(x, fmt, enc, delta=0.05)
        out[enc] = fp4.fake_quantize(x_train, fmt, guidance=rec, per_row_global=True)
    # lsb picks the same neighbour as codes whenever the rollout code is adjacent (virtually all)
    assert (out["lsb"] == out["codes"]).float().mean() > 0.999
    rec_t, q = record(x, fmt, "ties", delta=0.05)
    guided_pos = rec_t.rounding_guide().mask
    assert bool((out["ties"] == out["codes"])[guided_pos].all())
    # at the unguided positions, ties rounds to nearest (under the rollout's scales)
    plain = fp4.fake_quantize(x_train, fmt, guidance=fp4.RoundingGuide(scales=q.scales, global_scale=q.global_scale), per_row_global=True)
    assert torch.equal(out["ties"][~guided_pos], plain[~guided_pos])
    rollout = fp4.dequantize(q, torch.float32)
    mism = {k: int((v != rollout).sum()) for k, v in out.items()}
    mism["rtn"] = int((fp4.fake_quantize(x_train, fmt, per_row_global=True) != rollout).sum())
    print(fmt, "elements differing from rollout:", mism)
    assert mism["ties"] < mism["rtn"] / 3


def test_nbytes_order_codes_lsb_ties_and_serialization_roundtrip():
    x = _acts(seed=4, shape=(32, 512), dtype=torch.bfloat16)
    sizes = {}
    for enc in ("codes", "lsb", "ties"):
        rec, _ = record(x, "nvfp4", enc, delta=0.02)
        blob = rec.to_bytes()
        assert rec.nbytes == len(blob)
        back = GuidanceRecord.from_bytes(blob)
        assert back.to_bytes() == blob
        g1, g2 = rec.rounding_guide(), back.rounding_guide()
        for name in ("target", "bit", "mask"):
            a, b = getattr(g1, name), getattr(g2, name)
            assert (a is None and b is None) or torch.equal(a, b)
        assert torch.equal(g1.scales.view(torch.uint8), g2.scales.view(torch.uint8))
        sizes[enc] = rec.payload_nbytes
    print("payload bytes:", sizes)
    assert sizes["codes"] > sizes["lsb"] > sizes["ties"]
    n = x.numel()
    scales = n // 16 + 32 * 4
    assert sizes["codes"] == n // 2 + scales and sizes["lsb"] == n // 8 + scales
    with pytest.raises(ValueError, match="magic"):
        GuidanceRecord.from_bytes(b"garbage")


def test_rows_slicing_keeps_alignment():
    x = _acts(seed=5, shape=(6, 4, 64))
    for enc in ("codes", "lsb", "ties"):
        rec, _ = record(x, "nvfp4", enc, delta=0.1)
        sub = rec.rows(slice(2, 5))
        direct, _ = record(x[2:5], "nvfp4", enc, delta=0.1)
        x_t = _perturb(x[2:5])
        a = fp4.fake_quantize(x_t, "nvfp4", guidance=sub, per_row_global=True)
        b = fp4.fake_quantize(x_t, "nvfp4", guidance=direct, per_row_global=True)
        assert torch.equal(a, b)
        idx = torch.tensor([0, 5])
        assert rec.rows(idx).shape == (2, 4, 64)


def test_bit_packing_roundtrip():
    bits = torch.randint(0, 2, (3, 21), dtype=torch.uint8)
    assert torch.equal(unpack_bits(pack_bits(bits), 21), bits)
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8)).item() == 0x81


def test_near_midpoint():
    v = torch.tensor([0.25, 0.26, 0.5, 2.5, 2.6, 5.0, 5.3, 6.0])
    assert near_midpoint(v, 0.05).tolist() == [True, True, False, True, False, True, False, False]


def test_cache_policy_parsing_and_site_selection():
    assert CachePolicy("all").layer_set(4) == {0, 1, 2, 3}
    assert CachePolicy("fraction:0.5").layer_set(48) == set(range(24, 48))
    assert CachePolicy("fraction:0.5").layer_set(5) == {2, 3, 4}
    assert CachePolicy("deepest:2").layer_set(6) == {4, 5}
    assert CachePolicy("1,3").layer_set(4) == {1, 3}
    assert CachePolicy("none").layer_set(4) == set()
    p = CachePolicy("deepest:1", encoding="ties", delta=0.02)
    assert p.records("layers.3.mlp.experts.down.input", 4)
    assert p.records("layers.3.attn.k_cache", 4)
    assert not p.records("layers.2.mlp.experts.down.input", 4)
    assert not p.records("layers.3.mlp.experts.down.weight", 4)  # weights are bit-identical anyway
    with pytest.raises(ValueError, match="bad guidance layers"):
        CachePolicy("deepest:x")
    with pytest.raises(ValueError, match="do not exist"):
        CachePolicy("7").layer_set(4)
    with pytest.raises(ValueError, match="unknown guidance encoding"):
        CachePolicy(encoding="bits")
    with pytest.raises(ValueError, match="resolve"):
        CachePolicy("auto:100").layer_set(4)
    r = CachePolicy("auto:100").resolve({0: 1.0, 1: 50.0, 2: 80.0, 3: 10.0}, {i: 40.0 for i in range(4)})
    assert r.layer_set(4) == {1, 2}
