"""The engine's quant handler: FP4 weights from PackedWeights, FP4 activations, and recording.

Every activation site the recipe quantizes is quantized with round-to-nearest and per-row scales
(`tracerl.fp4`, the same function the trainer calls). Sites the CachePolicy selects (and, with
`diagnostics`, every quantized site) are staged per token position in (slots, max_len, ...)
buffers while the engine generates; `finalize` turns them into compact GuidanceRecords aligned to
the RolloutBatch's (B, S) token layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracerl import fp4, kernels
from tracerl.guidance import CachePolicy, GuidanceRecord, near_midpoint
from tracerl.qat import Recipe


@dataclass
class _Stage:
    codes: torch.Tensor  # (slots, max_len, *rest, K//2) uint8
    scales: torch.Tensor  # (slots, max_len, *rest, K//block) uint8 view
    gscale: torch.Tensor | None  # (slots, max_len, *rest, 1) float32
    near: torch.Tensor | None  # (slots, max_len, *rest, K) bool, for `ties`
    k: int


class SiteRecorder:
    """Stages the rollout's quantization outcomes per site and position."""

    def __init__(self, recipe: Recipe, policy: CachePolicy | None, n_layers: int, n_slots: int, max_len: int,
                 diagnostics: bool = False) -> None:
        self.recipe, self.policy, self.n_layers = recipe, policy, n_layers
        self.n_slots, self.max_len, self.diagnostics = n_slots, max_len, diagnostics
        self.stages: dict[str, _Stage] = {}
        self._groups: dict[tuple[str, ...], _Stage] = {}  # graph engine: stages made by stage_group
        self.rows = torch.arange(n_slots)
        self.start = 0
        self.enabled = True

    def set_step(self, rows: torch.Tensor, start: int) -> None:
        """The next forward runs slots `rows` with new tokens from column `start`."""
        self.rows, self.start = rows, start

    def wants(self, site: str) -> bool:
        """Whether `site` is staged."""
        if not self.enabled:
            return False
        return self.diagnostics or (self.policy is not None and self.policy.records(site, self.n_layers))

    def needs_scaled(self, site: str) -> bool:
        """Whether `observe(site, ...)` needs the pre-rounding scaled values (the `ties` encoding does)."""
        return self.wants(site) and self.policy is not None and self.policy.encoding == "ties"

    def observe(self, site: str, q: fp4.FP4Tensor, scaled: torch.Tensor | None) -> None:
        """Stage a quantization outcome at `site` for the running slots (leading dims (B, S_new))."""
        if not self.wants(site):
            return
        st = self.stages.get(site)
        rest, k = tuple(q.shape[2:-1]), q.shape[-1]
        dev = q.codes.device
        if st is None:
            lead = (self.n_slots, self.max_len, *rest)
            need_near = self.policy is not None and self.policy.encoding == "ties"
            st = _Stage(
                codes=torch.zeros(*lead, k // 2, dtype=torch.uint8, device=dev),
                scales=torch.zeros(*lead, q.scales.shape[-1], dtype=torch.uint8, device=dev),
                gscale=torch.ones(*lead, 1, device=dev) if q.global_scale is not None else None,
                near=torch.zeros(*lead, k, dtype=torch.bool, device=dev) if need_near else None,
                k=k,
            )
            self.stages[site] = st
        end = self.start + q.shape[1]
        st.codes[self.rows, self.start:end] = q.codes
        st.scales[self.rows, self.start:end] = q.scales.view(torch.uint8)
        if st.gscale is not None:
            st.gscale[self.rows, self.start:end] = q.global_scale
        if st.near is not None:
            if scaled is None:
                raise ValueError(f"{site}: the ties encoding needs the scaled values (check needs_scaled first)")
            st.near[self.rows, self.start:end] = near_midpoint(scaled, self.policy.delta)

    def stage(self, site: str, k: int, rest: tuple[int, ...], device: torch.device) -> _Stage:
        """The staging buffers of `site` (rows of k elements) as a group of one: (1, slots, max_len, *rest, ...).

        For the graph engine, whose captured step writes into them through a RecordSink (in the
        quantize kernel, or after it): they are allocated once and only cleared in place afterwards."""
        return self.stage_group((site,), k, rest, device)

    def stage_group(self, sites: tuple[str, ...], k: int, rest: tuple[int, ...], device: torch.device) -> _Stage:
        """One buffer (len(sites), slots, max_len, *rest, ...) whose [j] is site j's stage: sites
        quantized together (a layer's K and V) are recorded by one RecordSink over it."""
        for site in sites:
            self._check_recordable(site)
        group = self._groups.get(sites)
        if group is None:
            if any(site in self.stages for site in sites):
                raise RuntimeError(f"{sites}: staged before in another grouping")
            group = self._groups[sites] = self._new_group(sites, k, rest, device)
        return group

    def _check_recordable(self, site: str) -> None:
        if self.needs_scaled(site):
            raise ValueError(f"{site}: the `ties` encoding is not recorded by the graph engine; use lsb or codes")

    def _new_group(self, sites: tuple[str, ...], k: int, rest: tuple[int, ...], device: torch.device) -> _Stage:
        spec = fp4.FORMATS[self.recipe.fmt]
        lead = (len(sites), self.n_slots, self.max_len, *rest)
        g = _Stage(codes=torch.zeros(*lead, k // 2, dtype=torch.uint8, device=device),
                   scales=torch.zeros(*lead, k // spec.block, dtype=torch.uint8, device=device),
                   gscale=torch.ones(*lead, 1, device=device) if spec.has_global_scale else None, near=None, k=k)
        for j, site in enumerate(sites):
            self.stages[site] = _Stage(codes=g.codes[j], scales=g.scales[j],
                                       gscale=None if g.gscale is None else g.gscale[j], near=None, k=k)
        return g

    def clear(self) -> None:
        """Zero every stage in place (the graph engine reuses its buffers across calls)."""
        for st in self.stages.values():
            for t in (st.codes, st.scales, st.near):
                if t is not None:
                    t.zero_()
            if st.gscale is not None:
                st.gscale.fill_(1.0)

    def expand(self, index: torch.Tensor) -> None:
        """Re-slot after a shared prefill: slot i becomes a copy of old slot index[i]."""
        for st in self.stages.values():
            st.codes = st.codes[index].contiguous()
            st.scales = st.scales[index].contiguous()
            if st.gscale is not None:
                st.gscale = st.gscale[index].contiguous()
            if st.near is not None:
                st.near = st.near[index].contiguous()
        self.n_slots = len(index)

    def _fp4(self, st: _Stage, length: int, copy: bool = False) -> fp4.FP4Tensor:
        spec = fp4.FORMATS[self.recipe.fmt]

        def cut(t):
            t = t[:, :length]
            return t.clone() if copy else t

        codes = cut(st.codes)
        return fp4.FP4Tensor(
            codes=codes,
            scales=cut(st.scales).view(spec.scale_dtype),
            global_scale=None if st.gscale is None else cut(st.gscale),
            fmt=self.recipe.fmt,
            shape=torch.Size((*codes.shape[:-1], st.k)),
        )

    def finalize(self, length: int, valid: torch.Tensor, copy: bool = False
                 ) -> tuple[dict[str, GuidanceRecord], dict[str, fp4.FP4Tensor], float]:
        """(policy records, diagnostic reference codes, record bytes per valid token) over columns [0, length).

        `copy`: the records own their tensors (not views of stages that will be reused)."""
        records: dict[str, GuidanceRecord] = {}
        reference: dict[str, fp4.FP4Tensor] = {}
        n_valid = max(int(valid.sum()), 1)
        frac_valid = n_valid / valid.numel()
        total_bytes = 0.0
        for site, st in self.stages.items():
            q = self._fp4(st, length, copy)
            if self.diagnostics:
                reference[site] = q
            if self.policy is None or not self.policy.records(site, self.n_layers):
                continue
            near = None
            if st.near is not None:
                v = valid.reshape(*valid.shape, *([1] * (st.near.dim() - 2)))
                near = st.near[:, :length] & v
            rec = GuidanceRecord.from_quantized(q, self.policy.encoding, self.policy.fields, near_tie=near,
                                                delta=self.policy.delta)
            records[site] = rec
            # dense parts scale with every (B, S) position; sparse tie entries exist only for valid ones
            sparse = sum(t.numel() * t.element_size() for t in (rec.tie_cols, rec.tie_bits) if t is not None)
            total_bytes += (rec.payload_nbytes - sparse) * frac_valid + sparse
        return records, reference, total_bytes / n_valid


class FiniteWatch:
    """Device-side inf/NaN flags of the engine's quantized tensors, read once per engine step.

    An eager `bool(torch.isfinite(x).all())` per quant site is a device->host sync on CUDA, dozens
    per decode step of a launch-bound loop. Here each site only queues a flag on the device; the
    engine reads them in the host copy its decode loop makes anyway and raises there. The flags
    are per site, not just on the logits: the quantizer can hide a non-finite input (MXFP4 gives a
    NaN block the fallback scale 2**-127 and finite codes; the Triton kernels do not reproduce NaN
    scales), so the logits may stay finite while the rollout computed garbage.
    """

    def __init__(self) -> None:
        self.label = "prefill"  # which forward the next flags belong to, for the error message
        self._flags: list[torch.Tensor] = []
        self._where: list[tuple[str, str]] = []
        self._taken: list[tuple[str, str]] = []

    def note(self, site: str, x: torch.Tensor) -> None:
        """Queue whether `x` (about to be used at `site`) is all finite; no host sync."""
        self._flags.append(torch.isfinite(x).all().reshape(1))
        self._where.append((self.label, site))

    def take(self) -> list[torch.Tensor]:
        """The queued flags ((1,) bool tensors) to read in the caller's host copy; pass that copy to `check`."""
        flags, self._taken = self._flags, self._where
        self._flags, self._where = [], []
        return flags

    def check(self, ok: list[bool]) -> None:
        """Raise ValueError naming the first site whose flag (host copy of `take()`'s) is False."""
        bad = [w for w, f in zip(self._taken, ok, strict=True) if not f]
        self._taken = []
        if bad:
            label, site = bad[0]
            more = f" (and {len(bad) - 1} later sites)" if len(bad) > 1 else ""
            raise ValueError(
                f"rollout {label}: activations became non-finite (inf/NaN) at {site}{more}; sampling from them "
                "(FP4 quantization can even make them look finite) gives garbage, so no tokens are returned. "
                "Check the model weights / checkpoint for NaN or inf (e.g. after a diverged training step) and "
                "that activations fit the compute dtype"
            )


class RolloutQuant:
    """QuantHandler of the engine: packed FP4 weights (dequantized once per load) and FP4 activations.

    With a FiniteWatch, inf/NaN inputs are flagged on the device (read by the engine once per step)
    instead of checked eagerly at every site.
    """

    def __init__(self, recipe: Recipe, weights: dict[str, torch.Tensor], recorder: SiteRecorder | None,
                 finite: FiniteWatch | None = None) -> None:
        self.recipe, self.weights, self.recorder, self.finite = recipe, weights, recorder, finite

    def weight(self, site: str, w: torch.Tensor) -> torch.Tensor:
        return self.weights.get(site, w)

    def act(self, site: str, x: torch.Tensor) -> torch.Tensor:
        if not self.recipe.quantizes(site):
            return x
        need = self.recorder is not None and self.recorder.needs_scaled(site)
        q, scaled = site_quantize(x, self.recipe.fmt, need_scaled=need, name=site, finite=self.finite)
        if self.recorder is not None:
            self.recorder.observe(site, q, scaled)
        return site_dequantize(q, x.dtype)


def site_quantize(x: torch.Tensor, fmt: str, *, need_scaled: bool, name: str,
                  finite: FiniteWatch | None = None) -> tuple[fp4.FP4Tensor, torch.Tensor | None]:
    """RTN, per-row scales: (FP4Tensor, the scaled pre-rounding values if `need_scaled` else None).

    On CUDA without `need_scaled` this is one Triton kernel (`tracerl.kernels.quantize`, bit-exact
    with fp4.quantize, tested on the GPU) instead of ~40 PyTorch ops per site: the engine's decode
    step is launch-bound on small models. Elsewhere it is exactly the CPU reference.
    Non-finite x raises ValueError, or, given a FiniteWatch, is flagged there on the device
    instead (the engine reads the flags once per step: no host sync per site).
    """
    check_finite = finite is None
    if finite is not None:
        finite.note(name, x)
    if x.is_cuda and not need_scaled:
        if check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name}: non-finite values (inf/NaN) in a tensor to be FP4-quantized")
        return kernels.quantize(x, fmt, "rtn", per_row_global=True), None
    return fp4._quantize_with_values(x, fmt, "rtn", per_row_global=True, name=name, check_finite=check_finite)


def site_dequantize(q: fp4.FP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp4.dequantize, on CUDA through the Triton kernel (bit-exact)."""
    return kernels.dequantize(q, dtype) if q.codes.is_cuda else fp4.dequantize(q, dtype)
