"""Quantization-aware forward: precision recipes, named quant sites and the handlers a model calls.

A model never decides precision itself. At every quant site it calls its `QuantHandler`:
  - `handler.weight(site, w)` for a linear's weight (site `layers.3.mlp.experts.gate_up.weight`),
  - `handler.act(site, x)` for a linear's input and for K/V as written to the cache
    (sites `layers.3.attn.q_proj.input`, `layers.3.attn.k_cache`).
The handler returns the tensor to compute with. `NoQuant` is the plain BF16 model, `FakeQuant`
is the trainer's QAT forward (optionally guided by the rollout's GuidanceRecords, TRACE), and the
rollout engine has its own recording handler. So the same module runs in all three modes.

Blocking (DESIGN.md "FP4 conventions"): weights are quantized along the input (last) dim with
one global scale per matrix (per expert for stacked expert weights); activations and K/V per row
(token, or token x head) with dynamic per-row global scales, blocks along the last dim.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tracerl import fp4

RECIPES = ("bf16", "w4a16", "w4a4", "w4a4kv4")
SITE_SETS = ("experts+kv", "all-linear")

# layers.<i>.<module path>.<kind>; kind is input | weight | k_cache | v_cache
_SITE_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(input|weight)$|^layers\.(\d+)\.attn\.(k_cache|v_cache)$")


@dataclass(frozen=True)
class SiteName:
    """A parsed quant site name."""

    layer: int | None
    module: str  # e.g. "attn.q_proj", "mlp.experts.gate_up", "mlp.router", "attn"
    kind: str  # input | weight | k_cache | v_cache

    @staticmethod
    def parse(site: str) -> SiteName:
        """Parse `layers.3.mlp.experts.down.input`-style names (exactly, not by substring)."""
        m = _SITE_RE.match(site)
        if m is None:
            if site.startswith("lm_head.") or site.startswith("embed"):
                return SiteName(None, site.rsplit(".", 1)[0], site.rsplit(".", 1)[-1])
            raise ValueError(f"not a quant site name: {site!r} (expected e.g. 'layers.3.attn.q_proj.input')")
        if m.group(1) is not None:
            return SiteName(int(m.group(1)), m.group(2), m.group(3))
        return SiteName(int(m.group(4)), "attn", m.group(5))


def _is_expert(module: str) -> bool:
    return module in ("mlp.experts.gate_up", "mlp.experts.down")


def _is_linear_not_router(module: str) -> bool:
    # attention projections and dense MLPs; never the router, embeddings or lm_head
    return module.startswith("attn.") or module in ("mlp.gate_up", "mlp.down") or _is_expert(module)


@dataclass(frozen=True)
class Recipe:
    """Which quant sites are FP4 and in what format.

    name: bf16 | w4a16 | w4a4 | w4a4kv4. sites: `experts+kv` (the reference method: routed experts
    and the KV cache; attention projections, router, embeddings, lm_head stay BF16) or
    `all-linear`. exempt: site names or fnmatch patterns matched against the *whole* name.
    """

    name: str = "bf16"
    fmt: str = "nvfp4"
    sites: str = "experts+kv"
    exempt: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"unknown precision recipe {self.name!r}; choose one of {RECIPES}")
        fp4.format_spec(self.fmt)
        if self.sites not in SITE_SETS:
            raise ValueError(f"unknown site set {self.sites!r}; choose one of {SITE_SETS}")
        object.__setattr__(self, "exempt", tuple(self.exempt))

    @classmethod
    def parse(cls, spec: str) -> Recipe:
        """'NAME' or 'NAME:SITES' (e.g. 'w4a4kv4:all-linear') -> Recipe; unknown parts raise as the constructor."""
        name, _, sites = spec.partition(":")
        return cls(name, sites=sites) if sites else cls(name)

    @property
    def weights(self) -> bool:
        """Whether weights are FP4."""
        return self.name != "bf16"

    @property
    def acts(self) -> bool:
        """Whether linear inputs are FP4."""
        return self.name in ("w4a4", "w4a4kv4")

    @property
    def kv(self) -> bool:
        """Whether the KV cache is FP4."""
        return self.name == "w4a4kv4"

    def quantizes(self, site: str) -> bool:
        """Whether `site` is quantized under this recipe (exact name matching)."""
        if any(fnmatch.fnmatchcase(site, pat) for pat in self.exempt):
            return False
        s = SiteName.parse(site)
        if s.kind in ("k_cache", "v_cache"):
            return self.kv
        if s.layer is None:  # lm_head / embeddings
            return False
        in_set = _is_expert(s.module) if self.sites == "experts+kv" else _is_linear_not_router(s.module)
        if not in_set:
            return False
        return self.weights if s.kind == "weight" else self.acts


class QuantHandler(Protocol):
    """What a model calls at its quant sites."""

    def weight(self, site: str, w: torch.Tensor) -> torch.Tensor:
        """The weight to compute with at `site`."""
        ...

    def act(self, site: str, x: torch.Tensor) -> torch.Tensor:
        """The activation (linear input, or K/V written to the cache) to compute with at `site`."""
        ...

    # Optional: `weight_group(items: Sequence[tuple[str, Tensor]]) -> list[Tensor]` for a fused
    # group (q/k/v) whose members share one NVFP4 global scale; models call it through the
    # module-level `weight_group`, which falls back to `weight` per member.


class NoQuant:
    """The plain model: every site passes through."""

    def weight(self, site: str, w: torch.Tensor) -> torch.Tensor:
        return w

    def act(self, site: str, x: torch.Tensor) -> torch.Tensor:
        return x


def weight_global_scale(w: torch.Tensor) -> torch.Tensor:
    """NVFP4 global scale per matrix: shape (1,) for 2-D weights, (E, 1, 1) for stacked experts."""
    if w.dim() == 2:
        return fp4.nvfp4_global_scale(w)
    flat = w.reshape(w.shape[0], 1, -1)
    return fp4.nvfp4_global_scale(flat, per_row=True).reshape(w.shape[0], *([1] * (w.dim() - 1)))


def shared_weight_global_scale(ws: Sequence[torch.Tensor], fmt: str) -> torch.Tensor | None:
    """One NVFP4 global scale for a fused group of 2-D weights (q/k/v): 2688 / max of their amaxes.

    This is what vLLM and llm-compressor use for fused partitions; equal, bit for bit, to
    `weight_global_scale(torch.cat(ws))`. None for formats without a global scale or an empty group.
    """
    if not ws or not fp4.format_spec(fmt).has_global_scale:
        return None
    amaxes = torch.stack([w.detach().abs().amax() for w in ws])
    return fp4.nvfp4_global_scale(amaxes)


def quantize_weight(
    w: torch.Tensor, fmt: str, name: str = "weight", global_scale: torch.Tensor | None = None
) -> fp4.FP4Tensor:
    """Quantize a (stacked) weight along its input dim with one global scale per matrix.

    `global_scale` overrides the computed one (a fused group's shared scale).
    """
    if global_scale is None and fp4.format_spec(fmt).has_global_scale:
        global_scale = weight_global_scale(w)
    return fp4.quantize(w, fmt, global_scale=global_scale, name=name)


def fake_quantize_weight(
    w: torch.Tensor, fmt: str, name: str = "weight", global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Differentiable (STE) fake-quant of a weight; bit-identical to dequantize(quantize_weight(w))."""
    if global_scale is None and fp4.format_spec(fmt).has_global_scale:
        global_scale = weight_global_scale(w.detach())
    return fp4.fake_quantize(w, fmt, global_scale=global_scale, name=name)


def weight_group(handler: QuantHandler, items: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The weights to compute with for a fused group [(site, w), ...] (q/k/v of one layer).

    Handlers that implement `weight_group(items)` quantize the group with one shared global scale;
    for the others this is `handler.weight(site, w)` per member.
    """
    fn = getattr(handler, "weight_group", None)
    if fn is not None:
        return list(fn(items))
    return [handler.weight(site, w) for site, w in items]


@dataclass
class SiteFlips:
    """Per-site count of elements whose FP4 code differs from the rollout's."""

    flipped: int = 0
    total: int = 0


@dataclass
class FakeQuant:
    """The trainer's QAT handler: fake-quantize every site the recipe selects.

    With `guidance` (site -> GuidanceRecord aligned to this forward's tokens) the rounding at that
    site follows the rollout's record (TRACE); other sites round to nearest (plain QAT).
    With `reference` (site -> FP4Tensor of the rollout's codes at that site, diagnostics only)
    the handler counts code flips per site into `flips`, over the (B, S) `valid_tokens`.
    """

    recipe: Recipe
    guidance: Mapping[str, object] = field(default_factory=dict)
    reference: Mapping[str, fp4.FP4Tensor] = field(default_factory=dict)
    flips: dict[str, SiteFlips] = field(default_factory=dict)
    valid_tokens: torch.Tensor | None = None
    measure_only: bool = False  # a BF16 trainer: count what its RTN codes would be, compute unquantized

    def weight(self, site: str, w: torch.Tensor) -> torch.Tensor:
        if self.measure_only or not self.recipe.quantizes(site):
            return w
        return fake_quantize_weight(w, self.recipe.fmt, name=site)

    def weight_group(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """A fused group (q/k/v): the quantized members share one global scale (see `weight_group`)."""
        if self.measure_only:
            return [w for _, w in items]
        members = [w for site, w in items if self.recipe.quantizes(site)]
        gs = shared_weight_global_scale(members, self.recipe.fmt)
        return [fake_quantize_weight(w, self.recipe.fmt, name=site, global_scale=gs)
                if self.recipe.quantizes(site) else w for site, w in items]

    def act(self, site: str, x: torch.Tensor) -> torch.Tensor:
        if not self.recipe.quantizes(site):
            return x
        if self.measure_only:
            ref = self.reference.get(site)
            if ref is not None:
                self._count_flips(site, x.detach(), None, ref)
            return x
        record = self.guidance.get(site)
        guide = record.rounding_guide() if record is not None else None
        out = fp4.fake_quantize(x, self.recipe.fmt, guidance=guide, per_row_global=True, name=site)
        ref = self.reference.get(site)
        if ref is not None:
            self._count_flips(site, x.detach(), guide, ref)
        return out

    def _count_flips(self, site: str, x: torch.Tensor, guide: fp4.RoundingGuide | None, ref: fp4.FP4Tensor) -> None:
        rounding = "guided" if guide is not None else "rtn"
        q = fp4.quantize(x, self.recipe.fmt, rounding, per_row_global=True, guide=guide, name=site)
        mine, theirs = fp4.unpack_codes(q), fp4.unpack_codes(ref)
        if mine.shape != theirs.shape:
            raise ValueError(f"{site}: reference codes {tuple(theirs.shape)} do not align with {tuple(mine.shape)}")
        # "-0" vs "+0" is the same value: compare values, not sign bits of zeros
        diff = (mine & 7) != (theirs & 7)
        diff |= ((mine & 7) > 0) & ((mine >> 3) != (theirs >> 3))
        if self.valid_tokens is not None:  # only real tokens count (not padding)
            v = self.valid_tokens.reshape(*self.valid_tokens.shape, *([1] * (diff.dim() - 3)))
            v = v.expand(diff.shape[:-1])
            diff = diff & v.unsqueeze(-1)
            total = int(v.sum()) * diff.shape[-1]
        else:
            total = diff.numel()
        f = self.flips.setdefault(site, SiteFlips())
        f.flipped += int(diff.sum())
        f.total += total
