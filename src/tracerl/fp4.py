"""FP4 numerics: the E2M1 grid, NVFP4 and MXFP4 quantize/dequantize, packing, rounding modes.

This module is the single source of truth for FP4 rounding in tracerl; the trainer's fake-quant,
the rollout engine and the GPU kernels all reproduce it bit for bit.

Facts (see ../shared/FP4_REFERENCE.md, checked against ml_dtypes and compressed-tensors):
- E2M1 code = sign << 3 | magnitude index; magnitudes by index 0, 0.5, 1, 1.5, 2, 3, 4, 6.
  Round to nearest, ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4,
  5->4); saturate at +-6. Packing: element 2i in the low nibble, 2i+1 in the high nibble.
- NVFP4 (compressed-tensors "nvfp4-pack-quantized", what vLLM loads): blocks of 16, E4M3 block
  scale, FP32 global scale used as a *divisor*:
      gs  = 2688 / amax(tensor)                (computed in the input dtype, then float32)
      s8  = e4m3(clamp(gs * (amax_block / 6), -448, 448)), and 0.125 where that is 0
      q   = rne_e2m1(clamp(x / (s8 / gs), -6, 6));  value = q * (s8 / gs)
  For bf16 input compressed-tensors computes amax, 2688/amax and amax_block/6 in bf16 before
  promoting to float32; we follow that order, otherwise scales differ on most bf16 tensors.
- MXFP4 (OCP MX): blocks of 32, E8M0 scale 2**e. Default rule "even" (compressed-tensors,
  vLLM, torchao EVEN): round amax to one mantissa bit first, e = floor(log2(.)) - 2.
  Rule "floor" is the OCP spec's plain floor(log2(amax)) - 2 (torchao's FLOOR).
- Guided rounding (TRACE): given the trainer's value |v| and a rollout decision, choose between
  the two grid neighbours of |v| (floor and ceil on the grid); never further from the rollout
  than round-to-nearest. See `RoundingGuide`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Format = Literal["nvfp4", "mxfp4"]
Rounding = Literal["rtn", "stochastic", "guided"]

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
# by code: codes 8..15 are the negatives (code 8 is -0.0)
E2M1_VALUES = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_GLOBAL_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688: maps the tensor amax to e4m3 max * e2m1 max
NVFP4_ZERO_BLOCK_SCALE = 0.125  # compressed-tensors' replacement for a zero e4m3 scale
_ZERO_BLOCK_SCALE_BITS = int(torch.tensor(NVFP4_ZERO_BLOCK_SCALE).to(torch.float8_e4m3fn).view(torch.uint8))
MX_EXP_BIAS = 127
MX_E2M1_EMAX = 2  # floor(log2(6))


@dataclass(frozen=True)
class FormatSpec:
    """Static facts of one FP4 format."""

    name: str
    block: int
    scale_dtype: torch.dtype
    has_global_scale: bool


FORMATS: dict[str, FormatSpec] = {
    "nvfp4": FormatSpec("nvfp4", 16, torch.float8_e4m3fn, True),
    "mxfp4": FormatSpec("mxfp4", 32, torch.float8_e8m0fnu, False),
}


def format_spec(fmt: str) -> FormatSpec:
    """The FormatSpec for `fmt`, with a clear error for unknown names."""
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown FP4 format {fmt!r}; choose one of {sorted(FORMATS)}") from None


@dataclass
class FP4Tensor:
    """A quantized tensor: packed E2M1 codes, block scales, optional global scale."""

    codes: torch.Tensor  # uint8 (..., K//2), element 2i in the low nibble
    scales: torch.Tensor  # float8_e4m3fn (..., K//16) or float8_e8m0fnu (..., K//32)
    global_scale: torch.Tensor | None  # float32 () / (1,) / (..., 1) for nvfp4, a divisor; else None
    fmt: str
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        """Bytes of codes + scales + global scale as stored."""
        n = self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()
        if self.global_scale is not None:
            n += self.global_scale.numel() * 4
        return n

    def to(self, device: torch.device | str) -> FP4Tensor:
        """Move to `device`."""
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return FP4Tensor(self.codes.to(device), self.scales.to(device), gs, self.fmt, self.shape)


def select_rows(t: torch.Tensor, index) -> torch.Tensor:
    """t[index] (leading-dim rows); float8 tensors (block scales) are indexed through their uint8 bits,
    since not every torch release has CUDA index kernels for every float8 dtype."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        return t.view(torch.uint8)[index].view(t.dtype)
    return t[index]


@dataclass
class RoundingGuide:
    """Rollout-recorded decisions that steer rounding (TRACE guided rounding).

    Exactly one of `target` / `bit` may be given (or neither, for scale-only guidance):
    - target: uint8 (..., K) magnitude index (0..7) the rollout produced; of the two grid
      neighbours of |v| pick the one nearest it.
    - bit: uint8 (..., K) the lowest bit of the rollout's magnitude index; of the two adjacent
      neighbours exactly one carries it.
    - mask: bool (..., K); where False, round to nearest instead (sparse `ties` records).
    - scales / global_scale: the rollout's block scales (same dtype/shape as FP4Tensor.scales)
      and global scale, used instead of the ones computed from x.
    """

    target: torch.Tensor | None = None
    bit: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None


# ----------------------------------------------------------------------------- element rounding


def rtn_magnitude_index(a: torch.Tensor) -> torch.Tensor:
    """Magnitude index (uint8 0..7) of |a| rounded to nearest, ties to even; a >= 0, float32."""
    a = a.clamp(max=E2M1_MAX)
    # torch.round is round-half-even; on each binade of the grid that is ties-to-even code.
    idx_lo = torch.round(a * 2)  # a < 2: grid step 0.5, index = 2a
    idx_mid = torch.round(a) + 2  # 2 <= a < 4: step 1, value 2,3,4 -> index 4,5,6
    idx_hi = torch.round(a / 2) + 4  # a >= 4: step 2, value 4,6 -> index 6,7
    idx = torch.where(a < 2, idx_lo, torch.where(a < 4, idx_mid, idx_hi))
    return idx.to(torch.uint8)


def grid_neighbours(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (int64) of the grid points just below-or-at and just above-or-at |a| (a >= 0)."""
    a = a.clamp(max=E2M1_MAX).contiguous()
    mags = E2M1_MAGNITUDES.to(a.device)
    hi = torch.searchsorted(mags, a, right=False)
    lo = torch.searchsorted(mags, a, right=True) - 1
    return lo.clamp(0, 7), hi.clamp(0, 7)


def stochastic_magnitude_index(a: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Unbiased stochastic rounding of |a| onto the grid: P(hi) = (a - lo) / (hi - lo)."""
    a = a.clamp(max=E2M1_MAX)
    lo, hi = grid_neighbours(a)
    mags = E2M1_MAGNITUDES.to(a.device)
    lo_v, hi_v = mags[lo], mags[hi]
    step = (hi_v - lo_v).clamp(min=1e-30)
    p_hi = torch.where(hi > lo, (a - lo_v) / step, torch.zeros_like(a))
    u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
    return torch.where(u < p_hi, hi, lo).to(torch.uint8)


def guided_magnitude_index(a: torch.Tensor, guide: RoundingGuide) -> torch.Tensor:
    """Pick, between the two grid neighbours of |a|, the one the rollout's record points to."""
    lo, hi = grid_neighbours(a)
    if guide.target is not None:
        t = guide.target.to(torch.int64)
        # target <= lo -> lo; target >= hi -> hi (lo and hi are adjacent or equal)
        idx = torch.where(t >= hi, hi, lo)
    elif guide.bit is not None:
        b = guide.bit.to(torch.int64) & 1
        idx = torch.where((hi & 1) == b, hi, lo)
    else:
        return rtn_magnitude_index(a)
    if guide.mask is not None:
        idx = torch.where(guide.mask, idx, rtn_magnitude_index(a).to(torch.int64))
    return idx.to(torch.uint8)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes (..., K) two per byte: element 2i low nibble, 2i+1 high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of FP4 codes (last dim {codes.shape[-1]})")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_codes: uint8 (..., K//2) -> uint8 codes (..., K)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def unpack_codes(q: FP4Tensor) -> torch.Tensor:
    """The uint8 codes (..., K) of an FP4Tensor."""
    return unpack_nibbles(q.codes)


# ----------------------------------------------------------------------------- scales


def _check_input(x: torch.Tensor, block: int, name: str, check_finite: bool = True) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{name}: FP4 quantization needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name}: cannot quantize a 0-dim tensor; blocks run along the last dim")
    if x.shape[-1] % block:
        raise ValueError(
            f"{name}: last dim {x.shape[-1]} is not divisible by the block size {block}; "
            f"pad the hidden size to a multiple of {block} or choose a format whose block divides it"
        )
    # a host sync on CUDA: callers that flag inf/NaN on the device themselves pass check_finite=False
    if check_finite and not bool(torch.isfinite(x).all()):
        n_bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name}: {n_bad} non-finite values (inf/NaN) in a tensor to be FP4-quantized")


def nvfp4_global_scale(x: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """NVFP4 global scale 2688/amax (a divisor), in x's dtype then float32, as compressed-tensors."""
    absx = x.abs()
    amax = absx.amax(dim=-1, keepdim=True) if per_row else absx.amax().reshape(1)
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    gs = NVFP4_GLOBAL_NUMERATOR / amax
    # all-zero or tiny tensors overflow the division: compressed-tensors falls back to 1
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)


def nvfp4_block_scales(x_blocks: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales for x viewed as (..., nblocks, 16); global_scale broadcastable to (..., 1)."""
    amax_b = x_blocks.abs().amax(dim=-1)
    # a 0-dim device tensor made by a fill kernel: a tensor made from host data is a synchronous copy
    # on CUDA, and a Python-scalar divisor makes CUDA multiply by its reciprocal (one ulp off true
    # division in float32, where the Triton kernels divide exactly)
    s = amax_b / torch.full((), 6.0, dtype=amax_b.dtype, device=amax_b.device)  # input dtype, as compressed-tensors
    s = global_scale * s.to(torch.float32) if s.dtype != torch.float32 else global_scale * s
    s8 = s.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    # a zero block (or one whose scale underflows e4m3) gets 0.125 so dequantization never divides by 0
    zero = s8.view(torch.uint8) == 0
    return s8.view(torch.uint8).masked_fill(zero, _ZERO_BLOCK_SCALE_BITS).view(torch.float8_e4m3fn)


def mxfp4_block_scales(x_blocks: torch.Tensor, rule: str = "even") -> torch.Tensor:
    """E8M0 block scales (power-of-two) for x viewed as (..., nblocks, 32)."""
    amax_b = x_blocks.abs().amax(dim=-1).to(torch.float32)
    if rule == "even":
        bits = amax_b.view(torch.int32)
        # round to one mantissa bit (E2M1 has one) before taking the exponent: add half an ulp
        # of that 1-bit mantissa and keep sign+exponent only
        bits = (bits + (1 << 21)) & 0x7F800000 | (bits & ~0x7FFFFFFF)
        amax_b = bits.view(torch.float32)
    elif rule != "floor":
        raise ValueError(f"unknown MX scale rule {rule!r}; use 'even' (compressed-tensors/vLLM) or 'floor' (OCP)")
    e = torch.floor(torch.log2(amax_b)) + MX_EXP_BIAS - MX_E2M1_EMAX
    e = torch.nan_to_num(e, nan=0.0, neginf=0.0, posinf=254.0).clamp(0, 254)
    return e.to(torch.uint8).view(torch.float8_e8m0fnu)


def block_scale_values(q_scales: torch.Tensor, global_scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """Float32 per-block multiplier (s8 / gs for nvfp4, 2**e for mxfp4), shape (..., nblocks)."""
    if fmt == "nvfp4":
        return q_scales.to(torch.float32) / global_scale
    e = q_scales.view(torch.uint8).to(torch.int32) - MX_EXP_BIAS
    return torch.exp2(e.to(torch.float32))


# ----------------------------------------------------------------------------- quantize / dequantize


def quantize(
    x: torch.Tensor,
    fmt: Format = "nvfp4",
    rounding: Rounding = "rtn",
    *,
    global_scale: torch.Tensor | None = None,
    per_row_global: bool = False,
    generator: torch.Generator | None = None,
    guide: RoundingGuide | None = None,
    mx_rule: str = "even",
    name: str = "x",
    check_finite: bool = True,
) -> FP4Tensor:
    """Quantize x to FP4 in blocks along its last dim (see the module docstring for the rules).

    Non-finite input raises ValueError unless `check_finite=False`: then the caller must check
    on its own (the rollout engine flags inf/NaN on the device without a host sync), since the
    quantizer's saturation and NaN scale handling can turn them into finite garbage.
    """
    q, _ = _quantize_with_values(
        x, fmt, rounding, global_scale=global_scale, per_row_global=per_row_global,
        generator=generator, guide=guide, mx_rule=mx_rule, name=name, check_finite=check_finite,
    )
    return q


def _quantize_with_values(
    x: torch.Tensor,
    fmt: str,
    rounding: str,
    *,
    global_scale: torch.Tensor | None = None,
    per_row_global: bool = False,
    generator: torch.Generator | None = None,
    guide: RoundingGuide | None = None,
    mx_rule: str = "even",
    name: str = "x",
    check_finite: bool = True,
) -> tuple[FP4Tensor, torch.Tensor]:
    """Quantize and also return the float32 scaled values x/s (pre-rounding), for the STE mask."""
    spec = format_spec(fmt)
    _check_input(x, spec.block, name, check_finite)
    if rounding not in ("rtn", "stochastic", "guided"):
        raise ValueError(f"unknown rounding {rounding!r}; use 'rtn', 'stochastic' or 'guided'")
    if rounding == "guided" and guide is None:
        raise ValueError("rounding='guided' needs a RoundingGuide (the rollout's record)")
    shape = x.shape
    K = shape[-1]
    xb = x.reshape(*shape[:-1], K // spec.block, spec.block)

    gs = None
    if guide is not None and guide.scales is not None:
        scales = guide.scales
        if scales.shape != xb.shape[:-1]:
            raise ValueError(f"{name}: guide scales have shape {tuple(scales.shape)}, expected {tuple(xb.shape[:-1])}")
        gs = guide.global_scale
        if spec.has_global_scale and gs is None:
            raise ValueError(f"{name}: nvfp4 scale guidance needs the rollout's global scale too")
    elif spec.has_global_scale:
        gs = global_scale if global_scale is not None else nvfp4_global_scale(x, per_row=per_row_global)
        gs = gs.to(device=x.device, dtype=torch.float32)
        scales = nvfp4_block_scales(xb, gs)
    else:
        scales = mxfp4_block_scales(xb, mx_rule)

    mult = block_scale_values(scales, gs, fmt)  # (..., nblocks)
    v = xb.to(torch.float32) / mult.unsqueeze(-1)
    v = v.clamp(-E2M1_MAX, E2M1_MAX).reshape(shape)
    a = v.abs()
    if rounding == "rtn":
        idx = rtn_magnitude_index(a)
    elif rounding == "stochastic":
        idx = stochastic_magnitude_index(a, generator)
    else:
        idx = guided_magnitude_index(a, guide)
    # compressed-tensors sets the sign bit for every strictly negative input, also when it rounds
    # to zero (code 8, "-0"); an exact -0.0 input gets code 0
    sign = (v < 0).to(torch.uint8) << 3
    codes = pack_codes(idx | sign)
    q = FP4Tensor(codes=codes, scales=scales, global_scale=gs, fmt=fmt, shape=shape)
    unclamped = xb.to(torch.float32) / mult.unsqueeze(-1)
    return q, unclamped.reshape(shape)


def dequantize(q: FP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Values of an FP4Tensor: e2m1 * block multiplier, computed in float32, cast to dtype."""
    spec = format_spec(q.fmt)
    codes = unpack_nibbles(q.codes)
    vals = E2M1_VALUES.to(codes.device)[codes.to(torch.int64)]
    mult = block_scale_values(q.scales, q.global_scale, q.fmt)
    out = vals.reshape(*vals.shape[:-1], -1, spec.block) * mult.unsqueeze(-1)
    return out.reshape(q.shape).to(dtype)


def magnitude_index(q: FP4Tensor) -> torch.Tensor:
    """The magnitude index (0..7) of every element, uint8 (..., K)."""
    return unpack_codes(q) & 0x7


# ----------------------------------------------------------------------------- fake quant


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: dequantize(quantize(x)). Backward: straight-through, zero where |x| saturated.

    The scaled value x/s beyond +-6 is clamped by the quantizer, so the output does not depend
    on x there; everywhere else the gradient is the identity (STE). Scales are treated as
    constants (no gradient through amax), as in QAT practice.
    """

    @staticmethod
    def forward(ctx, x, fmt, rounding, guide, generator, per_row_global, global_scale, name):
        q, scaled = _quantize_with_values(
            x.detach(), fmt, rounding, guide=guide, generator=generator,
            per_row_global=per_row_global, global_scale=global_scale, name=name,
        )
        ctx.save_for_backward(scaled.abs() <= E2M1_MAX)
        return dequantize(q, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (inside,) = ctx.saved_tensors
        return grad_out * inside.to(grad_out.dtype), None, None, None, None, None, None, None


def fake_quantize(
    x: torch.Tensor,
    fmt: Format = "nvfp4",
    rounding: Rounding = "rtn",
    guidance: object | None = None,
    *,
    per_row_global: bool = False,
    global_scale: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    name: str = "x",
) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype with a straight-through gradient.

    `guidance` is a `RoundingGuide` or anything with `.rounding_guide()` (a GuidanceRecord);
    when given, rounding follows it (TRACE).
    """
    guide = None
    if guidance is not None:
        guide = guidance if isinstance(guidance, RoundingGuide) else guidance.rounding_guide()
        rounding = "guided"
    return _FakeQuantSTE.apply(x, fmt, rounding, guide, generator, per_row_global, global_scale, name)
