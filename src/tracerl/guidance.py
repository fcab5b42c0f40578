"""Guidance records: what the rollout's quantizer did at a site, kept compactly, replayed by the trainer.

A `GuidanceRecord` holds, for one quant site and a batch of rows (tokens, or token x head for the
KV cache), the rollout's block scales (and per-row global scales) and its rounding decisions in
one of three encodings:
  - `codes`: the full 4-bit code per element (4 bits/element);
  - `lsb`: the lowest bit of the magnitude index (1 bit/element). Adjacent grid points differ in
    that bit, so of the trainer's two grid neighbours exactly one carries it;
  - `ties` (ours): sparse, only the elements whose rollout value lay within `delta` grid steps of
    a rounding midpoint (the only ones a small upstream difference can flip), each with its lsb;
    every other element rounds to nearest. Per row a uint16 count, per kept element a uint16
    column and one bit.
`fields` says which parts are kept: `codes+scales`, `codes` (mantissa decisions only; the
trainer computes its own scales) or `scales` (scales only; the trainer rounds to nearest).

A `CachePolicy` decides which sites get a record (layers x encoding x fields), so the record is
kept only where it pays (deeper layers) and in compact encodings.
"""

from __future__ import annotations

import io
import json
import math
import struct
from dataclasses import dataclass

import torch

from tracerl import fp4

ENCODINGS = ("codes", "lsb", "ties")
FIELDS = ("codes+scales", "codes", "scales")
_MAGIC = b"TRGR1"


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a 0/1 tensor (..., K) into uint8 (..., ceil(K/8)); bit i of byte j is element 8j+i."""
    k = bits.shape[-1]
    pad = (-k) % 8
    b = bits.to(torch.uint8)
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    b = b.reshape(*b.shape[:-1], -1, 8)
    weights = (1 << torch.arange(8, dtype=torch.uint8, device=b.device))
    return (b * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 (..., ceil(K/8)) -> uint8 0/1 (..., K)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :k]


def near_midpoint(v: torch.Tensor, delta: float) -> torch.Tensor:
    """Whether |v| (values already divided by the block scale) lies within delta grid steps of a rounding midpoint."""
    a = v.abs().clamp(max=fp4.E2M1_MAX)
    lo, hi = fp4.grid_neighbours(a)
    mags = fp4.E2M1_MAGNITUDES.to(a.device)
    lo_v, hi_v = mags[lo], mags[hi]
    step = hi_v - lo_v
    frac = torch.where(step > 0, (a - lo_v) / step.clamp(min=1e-30), torch.zeros_like(a))
    return (step > 0) & ((frac - 0.5).abs() <= delta)


@dataclass
class GuidanceRecord:
    """The rollout's quantization outcome at one site for rows (..., K). See module docstring."""

    fmt: str
    encoding: str
    fields: str
    shape: tuple[int, ...]
    delta: float = 0.0
    scales: torch.Tensor | None = None  # (..., K//block) fp8 e4m3 / e8m0
    global_scale: torch.Tensor | None = None  # (..., 1) float32 (nvfp4)
    codes: torch.Tensor | None = None  # encoding codes: (..., K//2) uint8 packed codes
    lsb: torch.Tensor | None = None  # encoding lsb: (..., ceil(K/8)) uint8 packed bits
    tie_counts: torch.Tensor | None = None  # encoding ties: (rows,) uint8/uint16 count per row
    tie_cols: torch.Tensor | None = None  # (nnz,) uint8/uint16 column of each kept element
    tie_bits: torch.Tensor | None = None  # (ceil(nnz/8),) uint8 packed lsb of each kept element

    # ------------------------------------------------------------------ building

    @staticmethod
    def from_quantized(
        q: fp4.FP4Tensor,
        encoding: str = "codes",
        fields: str = "codes+scales",
        *,
        near_tie: torch.Tensor | None = None,
        delta: float = 0.0,
    ) -> GuidanceRecord:
        """Build a record from the rollout's FP4Tensor (and, for `ties`, its near-midpoint mask)."""
        _check(encoding, fields)
        shape = tuple(q.shape)
        rec = GuidanceRecord(q.fmt, encoding, fields, shape, delta=delta)
        if fields in ("codes+scales", "scales"):
            rec.scales = q.scales
            rec.global_scale = q.global_scale
        if fields == "scales":
            return rec
        if encoding == "codes":
            rec.codes = q.codes
        else:
            bit = fp4.unpack_nibbles(q.codes) & 1
            if encoding == "lsb":
                rec.lsb = pack_bits(bit)
            else:
                if near_tie is None:
                    raise ValueError("a `ties` record needs the near-midpoint mask (use guidance.record)")
                rec._set_ties(near_tie, bit)
        return rec

    def _set_ties(self, near_tie: torch.Tensor, bit: torch.Tensor) -> None:
        """Encode the sparse `ties` fields from a dense mask and the rollout's lsb bits."""
        k = self.shape[-1]
        if k > 65536:
            raise ValueError(f"`ties` stores at most uint16 columns; last dim {k} exceeds 65536")
        # the narrowest integer that holds a row's count (<= k) and a column (< k)
        count_dtype = torch.uint8 if k <= 255 else torch.uint16
        col_dtype = torch.uint8 if k <= 256 else torch.uint16
        flat = near_tie.reshape(-1, k)
        self.tie_counts = flat.sum(-1).to(torch.int32).to(count_dtype)
        rows, cols = flat.nonzero(as_tuple=True)
        self.tie_cols = cols.to(torch.int32).to(col_dtype)
        self.tie_bits = pack_bits(bit.reshape(-1, k)[rows, cols])

    # ------------------------------------------------------------------ applying

    def rounding_guide(self) -> fp4.RoundingGuide:
        """The fp4.RoundingGuide that makes the trainer's quantizer follow this record."""
        g = fp4.RoundingGuide(scales=self.scales, global_scale=self.global_scale)
        if self.fields == "scales":
            return g
        k = self.shape[-1]
        if self.encoding == "codes":
            g.target = fp4.unpack_nibbles(self.codes) & 7
        elif self.encoding == "lsb":
            g.bit = unpack_bits(self.lsb, k)
        else:
            rows = math.prod(self.shape[:-1])
            device = self.tie_cols.device
            counts = self.tie_counts.to(torch.int64)
            row_idx = torch.repeat_interleave(torch.arange(rows, device=device), counts)
            cols = self.tie_cols.to(torch.int32).to(torch.int64)
            mask = torch.zeros(rows, k, dtype=torch.bool, device=device)
            bit = torch.zeros(rows, k, dtype=torch.uint8, device=device)
            mask[row_idx, cols] = True
            bit[row_idx, cols] = unpack_bits(self.tie_bits, cols.numel())
            g.mask = mask.reshape(self.shape)
            g.bit = bit.reshape(self.shape)
        return g

    # ------------------------------------------------------------------ slicing and moving

    def rows(self, index: torch.Tensor | slice) -> GuidanceRecord:
        """The record for a subset of the leading-dim rows (e.g. a micro-batch of sequences)."""
        dev = self.device
        if isinstance(index, torch.Tensor):
            index = index.to(dev)  # e.g. the trainer's micro-batch rows, made on its device
        if self.encoding == "ties" and self.fields != "scales":
            g = self.rounding_guide()  # dense view, re-encoded below for the selected rows
            lead = self.shape[0]
            sel = torch.arange(lead, device=dev)[index]
            mask = g.mask[sel]
            out = GuidanceRecord(self.fmt, "ties", self.fields, tuple(mask.shape), delta=self.delta)
            out._set_ties(mask, g.bit[sel])
            if self.scales is not None:
                out.scales = fp4.select_rows(self.scales, index)
                out.global_scale = self.global_scale[index] if self.global_scale is not None else None
            return out
        def take(t):
            return None if t is None else fp4.select_rows(t, index)
        n_rows = torch.arange(self.shape[0], device=dev)[index].numel()
        return GuidanceRecord(
            self.fmt, self.encoding, self.fields, (n_rows, *self.shape[1:]), self.delta,
            scales=take(self.scales), global_scale=take(self.global_scale),
            codes=take(self.codes), lsb=take(self.lsb),
        )

    @property
    def device(self) -> torch.device:
        """Where the record's tensors live (CPU for a record without tensors)."""
        for n in _TENSOR_FIELDS:
            t = getattr(self, n)
            if t is not None:
                return t.device
        return torch.device("cpu")

    def to(self, device: torch.device | str, *, pin: bool = False) -> GuidanceRecord:
        """Move every tensor to `device` (pinned host memory with pin=True, for offloading)."""
        def mv(t):
            if t is None:
                return None
            t = t.to(device)
            # only host tensors can be pinned (pin=True with a CUDA device just moves)
            return t.pin_memory() if pin and t.device.type == "cpu" and torch.cuda.is_available() else t
        return GuidanceRecord(
            self.fmt, self.encoding, self.fields, self.shape, self.delta,
            *(mv(getattr(self, n)) for n in _TENSOR_FIELDS),
        )

    # ------------------------------------------------------------------ bytes

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, getattr(self, n)) for n in _TENSOR_FIELDS if getattr(self, n) is not None]

    @property
    def payload_nbytes(self) -> int:
        """Bytes of the record's tensors (what scales with tokens)."""
        return sum(t.numel() * t.element_size() for _, t in self._tensors())

    def _header(self) -> bytes:
        meta = {
            "fmt": self.fmt, "encoding": self.encoding, "fields": self.fields,
            "shape": list(self.shape), "delta": self.delta,
            "tensors": [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in self._tensors()],
        }
        return json.dumps(meta, separators=(",", ":")).encode()

    @property
    def nbytes(self) -> int:
        """Exact size of `to_bytes()`."""
        return len(_MAGIC) + 4 + len(self._header()) + self.payload_nbytes

    def to_bytes(self) -> bytes:
        """Serialize (header + raw little-endian tensor bytes)."""
        header = self._header()
        buf = io.BytesIO()
        buf.write(_MAGIC)
        buf.write(struct.pack("<I", len(header)))
        buf.write(header)
        for _, t in self._tensors():
            buf.write(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return buf.getvalue()

    @staticmethod
    def from_bytes(data: bytes) -> GuidanceRecord:
        """Inverse of to_bytes."""
        if data[: len(_MAGIC)] != _MAGIC:
            raise ValueError("not a tracerl GuidanceRecord (bad magic bytes)")
        (hlen,) = struct.unpack_from("<I", data, len(_MAGIC))
        off = len(_MAGIC) + 4
        meta = json.loads(data[off : off + hlen])
        off += hlen
        rec = GuidanceRecord(meta["fmt"], meta["encoding"], meta["fields"], tuple(meta["shape"]), meta["delta"])
        for name, dtype_name, shape in meta["tensors"]:
            dtype = getattr(torch, dtype_name)
            n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            raw = torch.frombuffer(bytearray(data[off : off + n]), dtype=torch.uint8)
            setattr(rec, name, raw.view(dtype).reshape(shape))
            off += n
        if off != len(data):
            raise ValueError(f"GuidanceRecord bytes have {len(data) - off} trailing bytes")
        return rec


_TENSOR_FIELDS = ("scales", "global_scale", "codes", "lsb", "tie_counts", "tie_cols", "tie_bits")


def _check(encoding: str, fields: str) -> None:
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown guidance encoding {encoding!r}; choose one of {ENCODINGS}")
    if fields not in FIELDS:
        raise ValueError(f"unknown guidance fields {fields!r}; choose one of {FIELDS}")


def record(
    x: torch.Tensor,
    fmt: str = "nvfp4",
    encoding: str = "codes",
    *,
    fields: str = "codes+scales",
    delta: float = 0.05,
    per_row_global: bool = True,
) -> tuple[GuidanceRecord, fp4.FP4Tensor]:
    """Quantize the rollout-side input x (RTN, per-row scales) and record what happened."""
    _check(encoding, fields)
    q, scaled = fp4._quantize_with_values(x, fmt, "rtn", per_row_global=per_row_global)
    near = near_midpoint(scaled, delta) if encoding == "ties" else None
    return GuidanceRecord.from_quantized(q, encoding, fields, near_tie=near, delta=delta), q


# ----------------------------------------------------------------------------- cache policy


@dataclass(frozen=True)
class CachePolicy:
    """Which sites get a GuidanceRecord, with which fields and encoding.

    layers: `all`, `none`, `deepest:K`, `fraction:F` (the deeper F of the layers, so `fraction:0.5`
    is the deeper half), an explicit list `3,5,7`, or `auto:<bytes per token>` (choose the layers
    with the most measured flips under the byte budget; needs `resolve`).
    The reference method's default is the deeper half, `lsb` + scales.
    """

    layers: str = "fraction:0.5"
    fields: str = "codes+scales"
    encoding: str = "lsb"
    delta: float = 0.05

    def __post_init__(self) -> None:
        _check(self.encoding, self.fields)
        if not 0.0 <= self.delta <= 0.5:
            raise ValueError(f"guidance delta must lie in [0, 0.5] grid steps, got {self.delta}")
        self._parse_layers()

    def _parse_layers(self) -> tuple[str, object]:
        spec = str(self.layers).strip()
        if spec in ("all", "none"):
            return spec, None
        kind, _, arg = spec.partition(":")
        try:
            if kind == "deepest":
                k = int(arg)
                if k < 0:
                    raise ValueError
                return kind, k
            if kind == "fraction":
                f = float(arg)
                if not 0.0 <= f <= 1.0:
                    raise ValueError
                return kind, f
            if kind == "auto":
                return kind, float(arg)
            return "list", sorted({int(p) for p in spec.split(",") if p.strip()})
        except ValueError:
            raise ValueError(
                f"bad guidance layers {self.layers!r}; use all, none, deepest:K, fraction:F (0..1), "
                f"a list like 3,5,7, or auto:<bytes per token>"
            ) from None

    def layer_set(self, n_layers: int) -> set[int]:
        """The layers recorded in a model of n_layers."""
        kind, arg = self._parse_layers()
        if kind == "all":
            return set(range(n_layers))
        if kind == "none":
            return set()
        if kind == "deepest":
            return set(range(max(0, n_layers - arg), n_layers))
        if kind == "fraction":
            k = math.ceil(n_layers * arg - 1e-9)
            return set(range(n_layers - k, n_layers))
        if kind == "list":
            bad = [i for i in arg if not 0 <= i < n_layers]
            if bad:
                raise ValueError(f"guidance layers {bad} do not exist in a model of {n_layers} layers")
            return set(arg)
        raise ValueError(f"guidance layers {self.layers!r} must be resolved first (CachePolicy.resolve)")

    def records(self, site: str, n_layers: int) -> bool:
        """Whether the rollout records `site` (an activation or KV site name)."""
        from tracerl.qat import SiteName

        s = SiteName.parse(site)
        return s.kind != "weight" and s.layer is not None and s.layer in self.layer_set(n_layers)

    def resolve(self, flips_per_layer: dict[int, float], bytes_per_token_per_layer: dict[int, float]) -> CachePolicy:
        """For `auto:<budget>`: the explicit-list policy with the most flips under the byte budget."""
        kind, budget = self._parse_layers()
        if kind != "auto":
            return self
        chosen, spent = [], 0.0
        ranked = sorted(flips_per_layer, key=lambda i: flips_per_layer[i] / max(bytes_per_token_per_layer[i], 1e-9), reverse=True)
        for i in ranked:
            if spent + bytes_per_token_per_layer[i] <= budget:
                chosen.append(i)
                spent += bytes_per_token_per_layer[i]
        layers = ",".join(str(i) for i in sorted(chosen)) or "none"
        return CachePolicy(layers, self.fields, self.encoding, self.delta)
