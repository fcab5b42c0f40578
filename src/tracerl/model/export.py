"""NVFP4 export: a compressed-tensors `nvfp4-pack-quantized` checkpoint that vLLM loads.

    amax = calibrate_input_amax(model, batches)          # W4A4 only: static input scales
    export_nvfp4(model, "out/", Recipe("w4a4"), input_amax=amax)

Per quantized linear (HF module names, experts per expert, e.g.
`model.layers.0.mlp.experts.3.gate_proj`):
    weight_packed        uint8          [out, in/2]   E2M1 codes, element 2i in the low nibble
    weight_scale         float8_e4m3fn  [out, in/16]  block scales
    weight_global_scale  float32        [1]           2688 / amax_w (a divisor)
    input_global_scale   float32        [1]           2688 / amax_act (W4A4 only)
Everything else (embeddings, norms, router, lm_head, and linears the recipe keeps in BF16) is
written as `dtype` under its HF name; those linears are listed in `quantization_config.ignore`.

The bytes are `model.pack_weights(recipe, dtype)`'s, sliced per HF module, so they are the very
weights the rollout engine and the trainer's FakeQuant use. Fused groups share a global scale, as
vLLM requires: q/k/v of a layer (shared scale, see packed.py), gate/up of an expert (one scale per
stacked expert matrix) and of a dense MLP (one fused matrix).

Input scales (W4A4): compressed-tensors' NVFP4 activations have a static per-tensor global scale
and dynamic ("local") block scales. `calibrate_input_amax` records, per activation site, the max
|x| over the real (non-padding) tokens of the calibration batches, with the model unquantized in
`compute_dtype`; every expert of a layer gets the layer's value (the site sees each token's input
once, as the fused MoE kernels do). tracerl's own FakeQuant uses dynamic per-row global scales
instead; the static scale is what a vLLM deployment of the checkpoint will use. An FP4 KV cache
(w4a4kv4) is a runtime choice of the engine and is not part of the checkpoint (kv_cache_scheme null).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch

from tracerl import fp4, qat
from tracerl.model.hf import config_to_hf, hf_layout, slice_param, write_safetensors_folder

_WEIGHT_ARGS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
                "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
_INPUT_ARGS = {**_WEIGHT_ARGS, "dynamic": "local", "observer": "static_minmax"}


def quantization_config(recipe: qat.Recipe, ignore: list[str]) -> dict:
    """The config.json `quantization_config` for an NVFP4 checkpoint of `recipe`."""
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": dict(_WEIGHT_ARGS),
            "input_activations": dict(_INPUT_ARGS) if recipe.acts else None,
            "output_activations": None,
            "format": None,
        }},
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


class _AmaxRecorder:
    """A QuantHandler that records max |x| per activation site over the rows `valid` marks."""

    def __init__(self) -> None:
        self.amax: dict[str, torch.Tensor] = {}
        self.valid: torch.Tensor | None = None  # (B, S) bool of the current batch

    def weight(self, site: str, w: torch.Tensor) -> torch.Tensor:
        return w

    def act(self, site: str, x: torch.Tensor) -> torch.Tensor:
        xd = x.detach()
        if self.valid is not None:
            xd = xd[self.valid]  # (n_valid, ...): leading (B, S) of every act site
        a = xd.abs().amax().float() if xd.numel() else torch.zeros((), device=x.device)
        prev = self.amax.get(site)
        self.amax[site] = a if prev is None else torch.maximum(prev, a)
        return x


def _as_batch(b) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(b, torch.Tensor):
        return b, None
    if isinstance(b, Mapping):
        return b["input_ids"], b.get("attention_mask")
    ids, mask = b
    return ids, mask


@torch.no_grad()
def calibrate_input_amax(model, batches: Iterable, *, compute_dtype: torch.dtype | None = torch.bfloat16,
                         ) -> dict[str, torch.Tensor]:
    """Max |x| (float32 scalar, CPU) per activation site over the real tokens of `batches`.

    Each batch is input_ids (B, S), a tuple (input_ids, attention_mask) or a dict with those keys.
    The model runs unquantized in `compute_dtype` (the dtype of the exported weights).
    """
    rec = _AmaxRecorder()
    dev = next(model.parameters()).device
    n = 0
    for b in batches:
        ids, mask = _as_batch(b)
        ids = ids.to(dev)
        mask = None if mask is None else mask.to(dev)
        rec.valid = None if mask is None else mask.bool()
        model(ids, mask, quant=rec, compute_dtype=compute_dtype)
        n += 1
    if n == 0:
        raise ValueError("calibrate_input_amax: no batches given")
    return {k: v.cpu() for k, v in rec.amax.items()}


def _input_site(weight_site: str) -> str:
    return weight_site.removesuffix(".weight") + ".input"


def export_nvfp4(
    model_or_path,
    out_dir: str | os.PathLike,
    recipe: qat.Recipe,
    *,
    input_amax: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 2**30,
) -> dict:
    """Write an NVFP4 compressed-tensors checkpoint of the model (or HF folder) to out_dir.

    recipe: which linears are FP4 (`Recipe("w4a16")`, `Recipe("w4a4")`, `sites="all-linear"`...).
    input_amax: per act site max |x| (from `calibrate_input_amax`), required when recipe.acts.
    Returns the written config.json dict.
    """
    from tracerl.model.hf import from_pretrained

    if recipe.fmt != "nvfp4":
        raise ValueError(f"export_nvfp4 writes NVFP4; the recipe's format is {recipe.fmt!r}. Use Recipe(..., fmt='nvfp4')")
    if not recipe.weights:
        raise ValueError(f"recipe {recipe.name!r} quantizes no weights; use save_pretrained for an unquantized checkpoint")
    model = model_or_path if isinstance(model_or_path, torch.nn.Module) else from_pretrained(model_or_path)
    cfg = model.config
    if recipe.acts and input_amax is None:
        raise ValueError(f"recipe {recipe.name!r} quantizes activations (W4A4): pass input_amax="
                         "calibrate_input_amax(model, batches) for the static input_global_scale")
    packed = model.pack_weights(recipe, dtype)
    tensors: dict[str, torch.Tensor] = {}
    ignore: list[str] = []
    for e in hf_layout(cfg):
        if e.site is None or not recipe.quantizes(e.site):
            src = packed[e.site if e.site is not None else e.param]
            tensors[e.hf_name] = slice_param(src, e).to("cpu").contiguous().clone()
            if e.site is not None:
                ignore.append(e.module)
            continue
        q: fp4.FP4Tensor = packed[e.site]
        gs = q.global_scale if e.expert is None else q.global_scale[e.expert]
        tensors[f"{e.module}.weight_packed"] = slice_param(q.codes, e).cpu().contiguous().clone()
        tensors[f"{e.module}.weight_scale"] = slice_param(q.scales, e).cpu().contiguous().clone()
        tensors[f"{e.module}.weight_global_scale"] = gs.reshape(1).to("cpu", torch.float32).clone()
        if recipe.acts:
            site = _input_site(e.site)
            if site not in input_amax:
                raise KeyError(f"input_amax has no entry for {site!r}; calibrate with this model "
                               "(calibrate_input_amax) before exporting W4A4")
            amax = torch.as_tensor(input_amax[site], dtype=torch.float32).reshape(1)
            tensors[f"{e.module}.input_global_scale"] = fp4.nvfp4_global_scale(amax).cpu()
    if "lm_head" not in ignore:  # tied embeddings: no lm_head tensor, but the module is never quantized
        ignore.append("lm_head")
    config = config_to_hf(cfg, dtype)
    config["quantization_config"] = quantization_config(recipe, sorted(set(ignore), key=ignore.index))
    write_safetensors_folder(out_dir, tensors, config, max_shard_bytes)
    return config
