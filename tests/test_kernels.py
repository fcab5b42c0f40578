"""FP4 kernels (tracerl.kernels) against the tracerl.fp4 reference, bit for bit.

- CPU (CI): dispatch to the reference, packed guide/record layouts, backend errors, import
  without Triton.
- GPU (`-m gpu`, skipped without CUDA): every Triton kernel vs the reference on the same device:
  codes, scales, global scales and dequantized values, on random, heavy-tailed, tiny, huge,
  exact-tie, zero-block and all-zero inputs, both formats, fp32/bf16/fp16, rtn and guided
  (codes / lsb / mask / scales, packed and unpacked), the fused recording kernel, and the numeric
  helpers (E2M1 index, grid neighbours, E4M3 and bf16 rounding, global scale) swept densely.
- Interpreter (Triton installed, no CUDA; CI, whose test extra installs Triton): a subprocess with
  TRITON_INTERPRET=1 runs a reduced version of the GPU checks on CPU tensors.
Only torch, numpy and pytest are needed (the device has no hypothesis / ml_dtypes).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracerl import fp4, kernels
from tracerl.kernels import reference

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not (CUDA and kernels.triton_available()), reason="needs CUDA and triton")

FMTS = ["nvfp4", "mxfp4"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["normal", "student_t", "lognormal", "tiny", "huge", "ties", "near_ties", "zero_blocks", "zeros"]
GUIDES = ["target", "target_nibbles", "target_random", "bit", "bit_packed", "target_mask", "bit_mask_packed",
          "scales", "scales_target", "scales_bit_packed_mask"]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


# ----------------------------------------------------------------------------- inputs


def make_x(kind: str, shape: tuple[int, ...], dtype: torch.dtype, fmt: str, seed: int = 0) -> torch.Tensor:
    """A test input of one kind (CPU); see the module docstring."""
    g = torch.Generator().manual_seed(seed)
    B = fp4.format_spec(fmt).block
    K = shape[-1]

    def randn():
        return torch.randn(shape, generator=g)

    if kind == "normal":
        x = randn()
    elif kind == "student_t":  # 2 degrees of freedom
        x = randn() / ((randn() ** 2 + randn() ** 2) / 2).sqrt().clamp(min=1e-4)
    elif kind == "lognormal":
        x = torch.exp(randn() * 2.5) * torch.sign(randn())
    elif kind == "tiny":
        x = randn() * (1e-6 if dtype == torch.float16 else 1e-30)
        if dtype != torch.float16:
            x2 = x.reshape(-1, K)
            x2[0] *= 1e-10  # a row of fp32/bf16 subnormals
            # a row of normal blocks holding subnormals whose quotients straddle 2**-150 (round to
            # zero or not): the tiles the FMA division must leave to div.rn
            emin = -149 if dtype == torch.float32 else -133
            xb = x2[1].reshape(-1, B)
            xb[:] = torch.randn(xb.shape, generator=g) * 4096.0
            j = torch.arange(2, B) % 16
            xb[:, 2:] = -(2.0 ** (emin + j.float())) * (1 + torch.randint(0, 3, (xb.shape[0], B - 2), generator=g))
    elif kind == "huge":
        x = randn() * (1e4 if dtype == torch.float16 else 1e30)
        if dtype != torch.float16:  # x / scale underflows: to a subnormal, and to -0.0 (code 0)
            xb = x.reshape(-1, K // B, B)
            xb[..., 5] = -1e-12
            xb[..., 6] = -1e-20
    elif kind == "near_ties":  # the tie inputs moved by -2..2 ulps of the dtype: quotients next to ties
        x = make_x("ties", shape, dtype, fmt, seed)
        bits = x.view(torch.int32 if dtype == torch.float32 else torch.int16)
        step = torch.randint(-2, 3, shape, generator=g).to(bits.dtype) * (x != 0)
        return (bits + step).view(dtype)
    elif kind == "ties":
        # exact E2M1 midpoints (and grid points) times an exactly representable block scale; the
        # first element of every block is 6 * scale, so the block scale is that scale (for nvfp4
        # with global_scale 1: the e4m3 value itself)
        rows = int(torch.tensor(shape[:-1]).prod()) if len(shape) > 1 else 1
        pts = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        v = pts[torch.randint(0, len(pts), (rows, K // B, B), generator=g)]
        v = v * (torch.randint(0, 2, v.shape, generator=g) * 2 - 1)
        v[..., 0] = 6.0
        if fmt == "mxfp4":
            scale = 2.0 ** torch.randint(-6, 7, (rows, K // B, 1), generator=g).float()
        else:
            s8 = torch.tensor([0.25, 0.5, 0.625, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0])
            scale = s8[torch.randint(0, len(s8), (rows, K // B, 1), generator=g)]
        v[0, 0, 3] = 0.0  # a zero beside nonzeros: the tile holding row 0 takes the div.rn path
        x = (v * scale).reshape(shape)
    elif kind == "zero_blocks":
        xb = randn().reshape(-1, K // B, B)
        xb[torch.rand(xb.shape[:2], generator=g) < 0.3] = 0.0
        xb[..., 1] = -xb.abs().amax(-1) * 1e-3  # negative, rounds to zero: sign bit kept
        xb[..., 2] = -0.0  # exact -0.0: code 0
        xb[0] = 0.0  # a whole zero row (per-row global scale falls back to 1)
        xb[0, :, 3] = -0.0
        x = xb.reshape(shape)
    elif kind == "zeros":
        x = torch.zeros(shape)
    else:
        raise ValueError(kind)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    return x.to(dtype)


def given_global_scale(x: torch.Tensor, kind: str) -> torch.Tensor:
    """A caller-supplied global scale: 1 for the tie inputs (exact scales), else 0.75 * 2688/amax."""
    if kind in ("ties", "near_ties"):
        return torch.ones(1, device=x.device)
    return fp4.nvfp4_global_scale(x) * 0.75


def make_guide(kind: str, x: torch.Tensor, fmt: str, per_row: bool, seed: int = 1) -> fp4.RoundingGuide:
    """A guide as a rollout would record it: the reference quantization of a perturbed x."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(x.shape, generator=g).to(x.device)
    xr = (x.float() * (1 + 0.02 * noise)).to(x.dtype)
    qr = fp4.quantize(xr, fmt, per_row_global=per_row)
    target = fp4.magnitude_index(qr)
    mask = (torch.rand(x.shape, generator=g) < 0.5).to(x.device)
    guide = fp4.RoundingGuide()
    if "target" in kind:
        guide.target = target
    if kind == "target_nibbles":
        guide.target = qr.codes  # the packed `codes` record as is
    if kind == "target_random":
        guide.target = torch.randint(0, 8, x.shape, generator=g, dtype=torch.uint8).to(x.device)
    if kind.startswith("bit") or "_bit" in kind:
        guide.bit = kernels.pack_bits(target & 1) if "packed" in kind else target & 1
    if "mask" in kind:
        guide.mask = kernels.pack_bits(mask) if "packed_mask" in kind or "mask_packed" in kind else mask
    if kind.startswith("scales"):
        guide.scales, guide.global_scale = qr.scales, qr.global_scale
    return guide


# ----------------------------------------------------------------------------- comparisons


def assert_bits_equal(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    """Same dtype, shape and bytes (so -0.0 != 0.0 and NaN payloads count)."""
    if b is None:
        assert a is None, f"{what}: expected None"
        return
    assert a is not None, f"{what}: missing"
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    ia, ib = a.contiguous().view(_INT[a.element_size()]), b.contiguous().view(_INT[b.element_size()])
    bad = ia != ib
    if bool(bad.any()):
        at = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())}/{bad.numel()} differ, first at {at}: "
                             f"{ia[bad][:5].tolist()} vs {ib[bad][:5].tolist()}")


def assert_q_equal(q: fp4.FP4Tensor, r: fp4.FP4Tensor, what: str = "") -> None:
    assert q.fmt == r.fmt and q.shape == r.shape, f"{what}: {q.fmt}{q.shape} vs {r.fmt}{r.shape}"
    assert_bits_equal(q.codes, r.codes, f"{what} codes")
    assert_bits_equal(q.scales, r.scales, f"{what} scales")
    assert_bits_equal(q.global_scale, r.global_scale, f"{what} global scale")


def check_quantize(fq, fmt, dtype, kind, gs_mode, shape, device) -> None:
    """Triton quantize (gs_mode: tensor | row | given) == fp4.quantize, and so are the dequantized values."""
    x = make_x(kind, shape, dtype, fmt).to(device)
    kw = {"per_row_global": gs_mode == "row"}
    if gs_mode == "given":
        kw["global_scale"] = given_global_scale(x, kind)
    q, _ = fq.quantize(x, fmt, **kw)
    r = fp4.quantize(x, fmt, **kw)
    what = f"{fmt} {dtype} {kind} gs={gs_mode}"
    assert_q_equal(q, r, what)
    assert_bits_equal(fq.dequantize(q, dtype), fp4.dequantize(r, dtype), f"{what} dequantized")


def check_dequantize(fq, fmt, dtype, out_dtype, kind, per_row, shape, device) -> None:
    r = fp4.quantize(make_x(kind, shape, dtype, fmt).to(device), fmt, per_row_global=per_row)
    assert_bits_equal(fq.dequantize(r, out_dtype), fp4.dequantize(r, out_dtype),
                      f"dequantize {fmt} {dtype}->{out_dtype} {kind} per_row={per_row}")


def check_guided(fq, fmt, dtype, guide_kind, per_row, shape, device, kind="student_t") -> None:
    x = make_x(kind, shape, dtype, fmt).to(device)
    guide = make_guide(guide_kind, x, fmt, per_row)
    q, _ = fq.quantize(x, fmt, "guided", guide=guide, per_row_global=per_row)
    r = reference.quantize(x, fmt, "guided", guide=guide, per_row_global=per_row)
    assert_q_equal(q, r, f"guided {guide_kind} {fmt} {dtype} per_row={per_row}")


def check_record(fq, fmt, dtype, record, per_row, shape, device) -> None:
    x = make_x("lognormal", shape, dtype, fmt).to(device)
    q, rec = fq.quantize(x, fmt, per_row_global=per_row, record=record)
    r = fp4.quantize(x, fmt, per_row_global=per_row)
    assert_q_equal(q, r, f"record {record} {fmt}")
    assert_bits_equal(rec, reference.record_of(r, record), f"record {record} {fmt} {dtype}")
    if record == "lsb":  # into a slice of a preallocated buffer (rows strided)
        K = shape[-1]
        buf = torch.zeros(x.numel() // K, 3, K // 8, dtype=torch.uint8, device=device)
        out = buf[:, 1]
        _, rec2 = fq.quantize(x.reshape(-1, K), fmt, per_row_global=per_row, record="lsb", record_out=out)
        assert rec2 is out
        assert_bits_equal(buf[:, 1], reference.record_of(r, "lsb").reshape(-1, K // 8), "record_out")
        assert int(buf[:, 0].sum()) == 0 and int(buf[:, 2].sum()) == 0, "record_out wrote outside its slice"


def check_dequant_out(fq, fmt, dtype, kind, per_row, shape, device, out_dtype=torch.bfloat16, guided=False) -> None:
    """quantize(dequant_out=) writes dequantize's values at unit global scales, into a strided view, nothing else."""
    x = make_x(kind, shape, dtype, fmt).to(device)
    K = shape[-1]
    buf = torch.full((x.numel() // K, 3, K), 7.0, dtype=out_dtype, device=device)
    out = buf[:, 1].reshape(shape)
    kw = {"per_row_global": per_row}
    if guided:
        kw.update(rounding="guided", guide=make_guide("bit_packed", x, fmt, per_row))
    q, _ = fq.quantize(x, fmt, dequant_out=out, **kw)
    q0, _ = fq.quantize(x, fmt, **kw)
    what = f"dequant_out {fmt} {dtype}->{out_dtype} {kind} per_row={per_row} guided={guided}"
    assert_q_equal(q, q0, what + " (quantize unchanged)")
    gs1 = None if q.global_scale is None else torch.ones_like(q.global_scale)
    ref = fp4.dequantize(fp4.FP4Tensor(q.codes, q.scales, gs1, fmt, q.shape), out_dtype)
    assert_bits_equal(buf[:, 1].reshape(shape), ref, what)
    assert bool((buf[:, 0] == 7).all() and (buf[:, 2] == 7).all()), what + ": wrote outside its view"


def _e4m3_values() -> torch.Tensor:
    return torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _with_neighbours(v: torch.Tensor, n: int = 3) -> torch.Tensor:
    """v and the n float32 values either side of each."""
    b = v.float().contiguous().view(torch.int32)
    out = [b + d for d in range(-n, n + 1)]
    return torch.cat(out).view(torch.float32)


def check_probes(fq, device) -> None:
    """Each numeric helper against torch, on dense sweeps around every boundary."""
    g = torch.Generator().manual_seed(0)
    pts = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    a = torch.cat([torch.arange(0, 6 * 4096 + 1) / 4096.0, _with_neighbours(pts[1:]), pts,
                   torch.rand(20000, generator=g) * 6, torch.tensor([1e-45, 1e-38, 1e-30])]).clamp(0, 6)
    a_d = a.to(device)
    assert_bits_equal(fq.probe("rtn", a_d).cpu(), fp4.rtn_magnitude_index(a).int(), "rtn index")
    above = torch.cat([torch.linspace(6, 7, 4097)[:-1], _with_neighbours(torch.tensor([6.5]))])  # no clamp below 7
    assert_bits_equal(fq.probe("rtn", above.to(device)).cpu(), torch.full(above.shape, 7, dtype=torch.int32), "rtn > 6")
    codes = torch.arange(16, dtype=torch.int32)
    assert_bits_equal(fq.probe("e2m1_magnitude", codes.to(device)).cpu(), fp4.E2M1_MAGNITUDES[codes % 8].view(torch.int32),
                      "e2m1 magnitude")
    byte = torch.arange(256, dtype=torch.int32)
    lo, hi = fp4.E2M1_VALUES[byte & 15], fp4.E2M1_VALUES[byte >> 4]
    want = (hi.view(torch.int32) & -65536) | ((lo.view(torch.int32) >> 16) & 65535)
    assert_bits_equal(fq.probe("e2m1_decode_bytes", byte.to(device)).cpu(), want, "e2m1 byte decode")
    t = torch.cat([torch.tensor([0.0, -0.0, 2.0 ** -89, -(2.0 ** -89), 1e-45, 1e-30, 3e38, -3e38, 1.0]),
                   _with_neighbours(torch.tensor([2.0 ** -89]))])
    assert_bits_equal(fq.probe("tiny_nonzero", t.to(device)).cpu(), ((t.abs() > 0) & (t.abs() < 2.0 ** -89)).int(),
                      "tiny nonzero")
    lo, hi = fp4.grid_neighbours(a)
    assert_bits_equal(fq.probe("neighbours", a_d).cpu(), (lo * 8 + hi).int(), "grid neighbours")

    e4 = _e4m3_values()
    mids = (e4[1:] + e4[:-1]) / 2
    s = torch.cat([e4, _with_neighbours(e4[1:]), mids, _with_neighbours(mids),
                   torch.exp(torch.rand(50000, generator=g) * 30 - 24), torch.tensor([2.0 ** -10, 2.0 ** -11, 1e-30])])
    s = s.clamp(0, 448)
    assert_bits_equal(fq.probe("e4m3", s.to(device)).cpu(), s.to(torch.float8_e4m3fn).view(torch.uint8).int(), "e4m3")
    byte = torch.cat([torch.arange(0, 127), torch.arange(128, 255)]).int()
    want = byte.to(torch.uint8).view(torch.float8_e4m3fn).float().view(torch.int32)
    assert_bits_equal(fq.probe("e4m3_value", byte.to(device)).cpu(), want, "e4m3 decode")

    f = torch.randint(0, 0x7F7FFFFF, (100000,), generator=g, dtype=torch.int32)
    f = torch.cat([f, f | 0x8000, (f & ~0xFFFF) | 0x8000, (f & ~0x1FFFF) | 0x8000]).view(torch.float32)
    want = f.to(torch.bfloat16).float().view(torch.int32)
    assert_bits_equal(fq.probe("bf16", f.to(device)).cpu(), want, "bf16 rounding")

    for dt in DTYPES:
        amax = torch.cat([torch.exp(torch.rand(20000, generator=g) * 180 - 90), torch.tensor([0.0, 1e-45, 1e-38, 1e-8, 6e-5, 1.0, 2688.0, 6e4, 3e38])])
        amax = amax.to(dt).float().clamp(max=torch.finfo(dt).max)
        want = fp4.nvfp4_global_scale(amax.to(dt).reshape(-1, 1).to(device), per_row=True).reshape(-1).cpu()
        assert_bits_equal(fq.probe("global_scale", amax.to(device), dt).cpu(), want.view(torch.int32), f"global scale {dt}")

    # division: FMA (Markstein) and div.rn against IEEE division on the CPU, near E2M1 ties
    b = torch.exp(torch.rand(1000, generator=g) * 62 - 20) * 2.0 ** torch.randint(-10, 30, (1000,), generator=g)
    b = torch.cat([b, (b.view(torch.int32) | 0x7FFFFF).view(torch.float32), torch.tensor([6.0, 1.0, 0.625])])
    ratio = torch.cat([pts[1:], torch.rand(14, generator=g) * 8, 2.0 ** -torch.randint(0, 61, (14,), generator=g).float()])
    a = _with_neighbours((b[:, None] * ratio[None, :]).reshape(-1), 2)
    b = b[:, None].expand(-1, ratio.numel()).reshape(-1).repeat(5)
    keep = (a <= 8 * b) & (a >= b * 2.0 ** -61)
    a, b = a[keep], b[keep]
    want = (a / b).view(torch.int32)
    for what in ("div_fast", "div_rn"):
        got = fq.probe(what, a.to(device), divisor=b.to(device)).cpu()
        assert_bits_equal(got, want, what)
    a = torch.cat([a, -a, a * 2.0 ** -100, torch.tensor([1e-45, 1e-40, 0.0])])
    b = torch.cat([b, b, b, torch.tensor([1.0, 3.0, 5.0])])
    assert_bits_equal(fq.probe("div_rn", a.to(device), divisor=b.to(device)).cpu(), (a / b).view(torch.int32),
                      "div_rn incl. subnormal results")

    m = torch.cat([torch.exp(torch.rand(20000, generator=g) * 170 - 85), torch.tensor([0.0, 1e-45, 1e-40, 6.0, 7.0, 3e38, 3.4e38])])
    m = torch.cat([m, _with_neighbours(2.0 ** torch.arange(-126, 127).float() * 1.75, 1)]).clamp(0, 3.4e38)
    want = fp4.mxfp4_block_scales(m.reshape(-1, 1)).view(torch.uint8).int()
    assert_bits_equal(fq.probe("mx_scale", m.to(device)).cpu(), want, "mx scale")
    e = torch.arange(0, 256).int()
    want = torch.exp2((e - 127).float()).view(torch.int32)
    assert_bits_equal(fq.probe("mx_mult", e.to(device)).cpu(), want, "mx multiplier")
    want = torch.where(e == 255, 0.0, torch.exp2((127 - e).float())).view(torch.int32)
    assert_bits_equal(fq.probe("mx_inv_mult", e.to(device)).cpu(), want, "mx inverse multiplier")


# ----------------------------------------------------------------------------- CPU tests (CI)


def test_dispatch_cpu_runs_reference():
    x = make_x("student_t", (4, 64), torch.bfloat16, "nvfp4")
    assert_q_equal(kernels.quantize(x, "nvfp4", per_row_global=True), fp4.quantize(x, "nvfp4", per_row_global=True))
    q = kernels.quantize(x, "mxfp4")
    assert_bits_equal(kernels.dequantize(q, torch.float16), fp4.dequantize(q, torch.float16), "dequantize")
    with pytest.raises(ValueError, match="non-finite"):
        kernels.quantize(torch.tensor([float("inf")] * 16), "nvfp4")


@pytest.mark.parametrize("guide_kind", GUIDES)
def test_packed_guides_match_unpacked(guide_kind):
    x = make_x("normal", (3, 64), torch.float32, "nvfp4")
    guide = make_guide(guide_kind, x, "nvfp4", per_row=False)
    unpacked = reference.unpacked_guide(guide, 64)
    for f in ("target", "bit", "mask"):
        t = getattr(unpacked, f)
        assert t is None or t.shape == x.shape, f
    assert_q_equal(kernels.quantize(x, "nvfp4", "guided", guide=guide),
                   fp4.quantize(x, "nvfp4", "guided", guide=unpacked))


def test_pack_bits_layout():
    bits = torch.zeros(2, 16, dtype=torch.uint8)
    bits[0, 0] = bits[0, 9] = bits[1, 15] = 1
    packed = kernels.pack_bits(bits)
    assert packed.tolist() == [[1, 2], [0, 128]]
    assert torch.equal(kernels.unpack_bits(packed), bits)


@pytest.mark.parametrize("record", ["codes", "lsb"])
def test_quantize_record_cpu(record):
    x = make_x("lognormal", (2, 3, 64), torch.float32, "mxfp4")
    q, rec = kernels.quantize_record(x, "mxfp4", record)
    assert_q_equal(q, fp4.quantize(x, "mxfp4"))
    idx = fp4.magnitude_index(q)
    if record == "codes":
        assert rec is q.codes
    else:
        assert rec.shape == (2, 3, 8) and torch.equal(kernels.unpack_bits(rec), idx & 1)
    guide = fp4.RoundingGuide(bit=rec) if record == "lsb" else fp4.RoundingGuide(target=rec)
    assert torch.equal(kernels.quantize(x, "mxfp4", "guided", guide=guide).codes, q.codes)


@pytest.mark.parametrize("fmt", FMTS)
def test_dequant_out_cpu_reference(fmt):
    """The dispatcher's reference path fills dequant_out as the Triton pass does (unit global scales), and
    refuses a buffer of another shape."""
    x = make_x("student_t", (4, 96), torch.bfloat16, fmt)
    out = torch.full((4, 96), 7.0, dtype=torch.bfloat16)
    q = kernels.quantize(x, fmt, per_row_global=fmt == "nvfp4", dequant_out=out)
    assert_q_equal(q, fp4.quantize(x, fmt, per_row_global=fmt == "nvfp4"), "dequant_out reference")
    gs1 = None if q.global_scale is None else torch.ones_like(q.global_scale)
    assert_bits_equal(out, fp4.dequantize(fp4.FP4Tensor(q.codes, q.scales, gs1, fmt, q.shape), torch.bfloat16),
                      "dequant_out reference values")
    if fmt == "nvfp4":  # the global scale is not applied: the values differ from a plain dequantize
        assert not torch.equal(out, fp4.dequantize(q, torch.bfloat16))
    with pytest.raises(ValueError, match="dequant_out"):
        kernels.quantize(x, fmt, dequant_out=torch.empty(4, 95, dtype=torch.bfloat16))


def _run_py(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch; from tracerl import kernels, fp4\n"
            "assert not kernels.triton_available()\n"
            "x = torch.randn(2, 32)\n"
            "assert torch.equal(kernels.quantize(x).codes, fp4.quantize(x).codes)\n"
            "try:\n    kernels.set_backend('triton')\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    p = _run_py(code)
    assert p.returncode == 0, p.stderr
    assert "ERR the triton FP4 backend was forced but cannot run" in p.stdout


@pytest.mark.skipif(CUDA, reason="checks the error raised without CUDA")
def test_forced_triton_backend_fails_loudly():
    p = _run_py("import torch; from tracerl import kernels\nkernels.quantize(torch.randn(2, 32))\n",
                env={"TRACERL_KERNELS": "triton"})
    assert p.returncode != 0 and "triton FP4 backend is forced" in p.stderr, p.stderr
    with pytest.raises(RuntimeError, match="forced but cannot run"):
        kernels.set_backend("triton")
    assert kernels.backend() == "auto"


# ----------------------------------------------------------------------------- GPU tests

SHAPE = (2, 37, 320)  # rows not a multiple of the tile, K not a multiple of 256, a leading dim


def _fq():
    from tracerl.kernels import fp4_quant
    return fp4_quant


@pytest.mark.gpu
@gpu
def test_numeric_helpers_gpu():
    check_probes(_fq(), "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("gs_mode", ["tensor", "row", "given"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_gpu(fmt, dtype, kind, gs_mode):
    if fmt == "mxfp4" and gs_mode != "tensor":
        pytest.skip("mxfp4 has no global scale")
    check_quantize(_fq(), fmt, dtype, kind, gs_mode, SHAPE, "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(1, 16), (5, 48), (3, 4096), (2, 9000 // 16 * 16), (300, 64)])
@pytest.mark.parametrize("gs_mode", ["tensor", "row"])
def test_quantize_shapes_gpu(shape, gs_mode):
    fmt = "nvfp4" if shape[-1] % 32 else "mxfp4"
    for f in {fmt, "nvfp4"}:
        check_quantize(_fq(), f, torch.bfloat16, "student_t", gs_mode, shape, "cuda")


@pytest.mark.gpu
@gpu
def test_strided_inputs_gpu():
    fq = _fq()
    big = make_x("normal", (40, 512), torch.bfloat16, "nvfp4").cuda()
    for x in (big[:, :256], big[:, 128:384], big.t()[:64, :32].t()):
        for fmt in ("nvfp4", "mxfp4") if x.shape[-1] % 32 == 0 else ("nvfp4",):
            assert_q_equal(fq.quantize(x, fmt)[0], fp4.quantize(x, fmt), f"strided {fmt}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("kind", ["normal", "huge", "tiny", "zero_blocks"])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_gpu(fmt, out_dtype, kind, per_row):
    if fmt == "mxfp4" and per_row:
        pytest.skip("mxfp4 has no global scale")
    for dtype in DTYPES:
        check_dequantize(_fq(), fmt, dtype, out_dtype, kind, per_row, SHAPE, "cuda")


# every guide in bf16; a few in fp32/fp16 (the guide logic does not depend on the dtype, and
# each combination is a separate kernel compile)
GUIDED_CASES = [(g, torch.bfloat16) for g in GUIDES] + [
    (g, dt) for g in ("target", "bit_packed", "scales_bit_packed_mask") for dt in (torch.float32, torch.float16)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("guide_kind,dtype", GUIDED_CASES, ids=[f"{g}-{dt}" for g, dt in GUIDED_CASES])
@pytest.mark.parametrize("fmt", FMTS)
def test_guided_gpu(fmt, dtype, guide_kind, per_row):
    if per_row and (fmt == "mxfp4" or dtype != torch.bfloat16):
        pytest.skip("per-row global scales: nvfp4, bf16 cases")
    check_guided(_fq(), fmt, dtype, guide_kind, per_row, SHAPE, "cuda")
    check_guided(_fq(), fmt, dtype, guide_kind, per_row, SHAPE, "cuda", kind="ties")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("record", ["codes", "lsb"])
@pytest.mark.parametrize("fmt", FMTS)
def test_record_gpu(fmt, record, per_row):
    for dtype in DTYPES:
        check_record(_fq(), fmt, dtype, record, per_row, SHAPE, "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["normal", "huge", "tiny", "zero_blocks", "ties"])
@pytest.mark.parametrize("fmt", FMTS)
def test_dequant_out_gpu(fmt, kind):
    for dtype in DTYPES:
        for per_row in ((False, True) if fmt == "nvfp4" else (False,)):
            check_dequant_out(_fq(), fmt, dtype, kind, per_row, SHAPE, "cuda", out_dtype=DTYPES[(DTYPES.index(dtype) + 1) % 3])
    check_dequant_out(_fq(), fmt, torch.bfloat16, kind, fmt == "nvfp4", SHAPE, "cuda", guided=True)


@pytest.mark.gpu
@gpu
def test_dispatch_gpu_runs_triton():
    x = make_x("student_t", SHAPE, torch.bfloat16, "nvfp4").cuda()
    assert kernels.backend() == "auto"
    q = kernels.quantize(x, "nvfp4", per_row_global=True)
    assert_q_equal(q, fp4.quantize(x, "nvfp4", per_row_global=True), "dispatch")
    assert_bits_equal(kernels.dequantize(q), fp4.dequantize(q), "dispatch dequantize")
    q, rec = kernels.quantize_record(x, "nvfp4", "lsb", per_row_global=True)
    assert_bits_equal(rec, reference.record_of(q, "lsb"), "dispatch record")
    with pytest.raises(ValueError, match="non-finite"):
        kernels.quantize(torch.full((16,), float("nan"), device="cuda"), check_finite=True)


# ----------------------------------------------------------------------------- interpreter (CPU)

# Two fixes to triton 3.6's interpreter: it calls int() on 1-element arrays, which numpy >= 2.3
# refuses; and its fma is a*b + c rounded twice, where the GPU (and the kernels' exact division)
# round once: emulate a binary32 FMA exactly (binary64 product, sum rounded to odd, then to fp32).
_INTERP_SHIM = """
import numpy as np
import triton.runtime.interpreter as _interp
_orig = _interp._patch_lang_tensor
def _patched(tensor, scope):
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
_interp._patch_lang_tensor = _patched

def _fma32(x, y, z):
    p = x.astype(np.float64) * y.astype(np.float64)
    c = np.broadcast_to(z.astype(np.float64), p.shape)
    with np.errstate(all="ignore"):
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        odd = (err != 0) & ((s.view(np.int64) & 1) == 0) & np.isfinite(s)
        s = np.where(odd, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)
_interp.InterpreterBuilder.create_fma = lambda self, x, y, z: _interp.TensorHandle(
    _fma32(x.data, y.data, z.data), z.dtype.scalar)

# fp32 -> bf16 casts round to nearest even on the GPU; the interpreter truncates
import triton.language as _tl
_orig_convert = _interp._convert_float
def _convert(data, src, dst, rounding_mode):
    if src == _tl.float32 and dst == _tl.bfloat16:
        b = np.ascontiguousarray(data).view(np.uint32).astype(np.uint64)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
        return np.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r).astype(np.uint16)
    return _orig_convert(data, src, dst, rounding_mode)
_interp._convert_float = _convert
"""


def run_interpreter_suite() -> int:
    """Reduced GPU suite on CPU tensors in the Triton interpreter; returns the number of checks."""
    from tracerl.kernels import fp4_quant as fq
    shape, n = (3, 2, 96), 0
    check_probes(fq, "cpu")
    for i, kind in enumerate(KINDS):
        for j, fmt in enumerate(FMTS):
            dtype = DTYPES[(i + j) % 3]
            for gs_mode in (["tensor", "row", "given"] if fmt == "nvfp4" else ["tensor"]):
                check_quantize(fq, fmt, dtype, kind, gs_mode, shape, "cpu")
                n += 1
    for i, guide_kind in enumerate(GUIDES):
        fmt, dtype = FMTS[i % 2], DTYPES[i % 3]
        check_guided(fq, fmt, dtype, guide_kind, i % 4 == 0 and fmt == "nvfp4", shape, "cpu",
                     kind="ties" if i % 3 == 0 else "student_t")
        n += 1
    for fmt in FMTS:
        for dtype in DTYPES:
            check_dequantize(fq, fmt, dtype, DTYPES[(DTYPES.index(dtype) + 1) % 3], "zero_blocks",
                             fmt == "nvfp4", shape, "cpu")
            n += 1
        for record in ("codes", "lsb"):
            check_record(fq, fmt, torch.bfloat16, record, fmt == "nvfp4", shape, "cpu")
            n += 1
    for i, kind in enumerate(("zero_blocks", "huge", "student_t")):
        check_dequant_out(fq, FMTS[i % 2], DTYPES[i], kind, i != 1, shape, "cpu", out_dtype=DTYPES[(i + 1) % 3])
    check_dequant_out(fq, "nvfp4", torch.bfloat16, "student_t", True, shape, "cpu", guided=True)
    n += 4
    check_quantize(fq, "nvfp4", torch.bfloat16, "normal", "row", (2, 8192 + 64), "cpu")  # chunked rows
    for dtype in DTYPES:  # ties: tiles on both the FMA-division and the div.rn path
        check_quantize(fq, "nvfp4", dtype, "ties" if dtype != torch.float32 else "near_ties", "given", (40, 96), "cpu")
    return n + 4


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(CUDA, reason="the GPU tests cover the compiled kernels")
def test_triton_interpreter():
    here = Path(__file__).resolve().parent
    code = (_INTERP_SHIM + f"import sys; sys.path.insert(0, {str(here)!r})\n"
            "import test_kernels\nprint('checks', test_kernels.run_interpreter_suite())\n")
    p = _run_py(code, env={"TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    assert "checks" in p.stdout


def test_record_layout_matches_guidance():
    from tracerl import guidance

    x = make_x("student_t", (4, 96), torch.bfloat16, "nvfp4")
    q, lsb = kernels.quantize_record(x, "nvfp4", "lsb", per_row_global=True)
    rec = guidance.GuidanceRecord.from_quantized(q, "lsb")
    assert_bits_equal(lsb, rec.lsb, "lsb record vs guidance.pack_bits")
    packed = fp4.RoundingGuide(bit=lsb, scales=q.scales, global_scale=q.global_scale)
    y = make_x("normal", (4, 96), torch.bfloat16, "nvfp4", seed=3) * 0.01 + x
    assert_q_equal(kernels.quantize(y, "nvfp4", "guided", guide=packed),
                   kernels.quantize(y, "nvfp4", "guided", guide=rec.rounding_guide()), "packed lsb guide")
