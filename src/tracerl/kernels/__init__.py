"""FP4 kernels behind the `tracerl.fp4` API: Triton on CUDA, the PyTorch reference elsewhere.

    from tracerl import kernels
    q = kernels.quantize(x, "nvfp4")                       # FP4Tensor, == fp4.quantize(x, "nvfp4")
    y = kernels.dequantize(q, torch.bfloat16)              # == fp4.dequantize(q, torch.bfloat16)
    q, rec = kernels.quantize_record(x, "nvfp4", "lsb", per_row_global=True)   # rollout recording

Backend, chosen once at import from TRACERL_KERNELS (auto | triton | reference; `set_backend`
changes it): `auto` runs Triton for CUDA tensors when Triton imports and the reference otherwise;
`triton` fails loudly when Triton or CUDA is missing; `reference` always runs `tracerl.fp4`.
Importing this package never needs Triton.

Accepted guides (`fp4.RoundingGuide`, or anything with `.rounding_guide()`), fields by shape:
- target: uint8 (..., K) magnitude indices 0..7, or uint8 (..., K//2) packed codes in the
  FP4Tensor.codes layout (the rollout's `codes` record as is; nibble & 7 is used).
- bit: uint8 (..., K) with the lsb in bit 0, or uint8 (..., K//8) packed bits (the `lsb` record).
- mask: bool (..., K), or uint8 (..., K//8) packed bits (1 = follow the record).
- scales / global_scale: as FP4Tensor.scales (float8, (..., K//block)) and its global scale
  (float32, one value or one per row) on the tensor's device.
Packed bits: bit i (1 << i) of byte j belongs to element 8j+i of the row (as
`guidance.pack_bits`, so a GuidanceRecord's `codes` / `lsb` fields can be passed as they are:
`RoundingGuide(bit=rec.lsb, scales=rec.scales, global_scale=rec.global_scale)`).

Differences of the Triton path from the reference: no host-synchronising finiteness check unless
`check_finite=True` (non-finite inputs give garbage instead of an error); NaN scale bytes (E8M0
0xFF, E4M3 0x7F) are not reproduced; rounding='stochastic', mx_rule='floor' and dtypes other than
float32/bfloat16/float16 run the reference. Triton kernels, numerics and layouts:
kernels/fp4_quant.py and kernels/fp4_numerics.py.
"""

from __future__ import annotations

import os

import torch

from tracerl import fp4
from tracerl.kernels import reference
from tracerl.kernels.record_sink import RecordSink
from tracerl.kernels.reference import pack_bits, unpack_bits

__all__ = ["quantize", "dequantize", "quantize_record", "set_backend", "backend", "triton_available",
           "pack_bits", "unpack_bits", "RecordSink"]

_BACKENDS = ("auto", "triton", "reference")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _load_triton():
    """The Triton implementation module, or the reason it cannot be used."""
    try:
        from tracerl.kernels import fp4_quant
    except Exception as e:  # ImportError, or a broken Triton install
        return None, f"triton could not be imported ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    return fp4_quant, None


_triton_mod, _triton_why = _load_triton()
_backend = os.environ.get("TRACERL_KERNELS", "auto")
if _backend not in _BACKENDS:
    raise ValueError(f"TRACERL_KERNELS={_backend!r}: unknown kernel backend; choose one of {_BACKENDS}")


def triton_available() -> bool:
    """True when the Triton kernels can run (Triton importable and a CUDA device present)."""
    return _triton_mod is not None


def set_backend(name: str) -> None:
    """Choose 'auto', 'triton' (raises now if it cannot run) or 'reference'."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {_BACKENDS}")
    if name == "triton" and _triton_mod is None:
        raise RuntimeError(f"the triton FP4 backend was forced but cannot run: {_triton_why}. "
                           "Install triton on a CUDA machine or use TRACERL_KERNELS=auto/reference.")
    _backend = name


def backend() -> str:
    """The configured backend name."""
    return _backend


def _use_triton(t: torch.Tensor, *, supported: bool = True) -> bool:
    if _backend == "reference":
        return False
    if _backend == "triton":
        if _triton_mod is None:
            raise RuntimeError(f"the triton FP4 backend is forced (TRACERL_KERNELS / set_backend) but cannot "
                               f"run: {_triton_why}")
        if not t.is_cuda:
            raise RuntimeError(f"the triton FP4 backend is forced but the tensor is on {t.device}; "
                               "move it to CUDA or use the 'auto' backend")
        if not supported:
            raise RuntimeError("the triton FP4 backend is forced but this call (dtype, rounding "
                               "'stochastic' or mx_rule 'floor') has no Triton kernel")
        return True
    return supported and t.is_cuda and _triton_mod is not None


def _as_guide(guidance) -> fp4.RoundingGuide | None:
    if guidance is None or isinstance(guidance, fp4.RoundingGuide):
        return guidance
    return guidance.rounding_guide()


def _check_finite(x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"x: {int((~torch.isfinite(x)).sum())} non-finite values (inf/NaN) in a tensor to be FP4-quantized")


def quantize(
    x: torch.Tensor,
    fmt: str = "nvfp4",
    rounding: str = "rtn",
    *,
    global_scale: torch.Tensor | None = None,
    per_row_global: bool = False,
    guide=None,
    generator: torch.Generator | None = None,
    mx_rule: str = "even",
    check_finite: bool = False,
    sink: RecordSink | None = None,
    dequant_out: torch.Tensor | None = None,
) -> fp4.FP4Tensor:
    """`fp4.quantize` (same arguments and result, bit for bit) on the selected backend; with `sink`,
    the result's rows are also stored at their record rows (in the same pass on Triton); with
    `dequant_out` (x's shape), it also receives e2m1 * block scale, the global scale not applied
    (`dequantize` of the result at unit global scales; in the same pass on Triton)."""
    guide = _as_guide(guide)
    ok = x.dtype in _TRITON_DTYPES and rounding != "stochastic" and mx_rule == "even"
    if _use_triton(x, supported=ok):
        if check_finite:
            _check_finite(x)
        q, _ = _triton_mod.quantize(x, fmt, rounding, global_scale=global_scale,
                                    per_row_global=per_row_global, guide=guide, sink=sink, dequant_out=dequant_out)
        return q
    if dequant_out is not None and (tuple(dequant_out.shape) != tuple(x.shape) or not dequant_out.is_floating_point()):
        raise ValueError(f"dequant_out must be a float tensor {tuple(x.shape)}, got {dequant_out.dtype} "
                         f"{tuple(dequant_out.shape)}")
    q = reference.quantize(x, fmt, rounding, global_scale=global_scale, per_row_global=per_row_global,
                           guide=guide, generator=generator, mx_rule=mx_rule)
    if sink is not None:
        sink.check(x[..., :1].numel(), x.shape[-1], fp4.format_spec(fmt))
        sink.write(q)
    if dequant_out is not None:
        unit = None if q.global_scale is None else torch.ones_like(q.global_scale)
        dequant_out.copy_(reference.dequantize(fp4.FP4Tensor(q.codes, q.scales, unit, fmt, q.shape), dequant_out.dtype))
    return q


def quantize_record(
    x: torch.Tensor,
    fmt: str = "nvfp4",
    record: str = "codes",
    rounding: str = "rtn",
    *,
    global_scale: torch.Tensor | None = None,
    per_row_global: bool = False,
    guide=None,
    out: torch.Tensor | None = None,
    check_finite: bool = False,
) -> tuple[fp4.FP4Tensor, torch.Tensor]:
    """Quantize and return the rollout's record of it in the same pass.

    record='codes': the record is q.codes itself (packed codes, no extra bytes written).
    record='lsb': uint8 (..., K//8), bit i of byte j = lsb of element 8j+i's magnitude index;
    written into `out` (uint8 (..., K//8), e.g. a slice of a preallocated record buffer) if given.
    Scales and the global scale of the record are q.scales and q.global_scale.
    """
    guide = _as_guide(guide)
    ok = x.dtype in _TRITON_DTYPES
    if _use_triton(x, supported=ok):
        if check_finite:
            _check_finite(x)
        return _triton_mod.quantize(x, fmt, rounding, global_scale=global_scale, per_row_global=per_row_global,
                                    guide=guide, record=record, record_out=out)
    q = reference.quantize(x, fmt, rounding, global_scale=global_scale, per_row_global=per_row_global, guide=guide)
    rec = reference.record_of(q, record)
    if out is not None and record == "lsb":
        out.copy_(rec)
        rec = out
    return q, rec


def dequantize(q: fp4.FP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`fp4.dequantize` (bit for bit) on the selected backend."""
    if _use_triton(q.codes, supported=dtype in _TRITON_DTYPES):
        return _triton_mod.dequantize(q, dtype)
    return reference.dequantize(q, dtype)


