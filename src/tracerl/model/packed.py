"""PackedWeights: the weights the rollout engine runs with, FP4 where the recipe says, BF16 elsewhere.

Made once per RL step by `MoEModel.pack_weights(recipe, dtype=torch.bfloat16)`:
- every linear weight is stored under its *weight site name*
  (`layers.3.attn.q_proj.weight`, `layers.3.mlp.experts.gate_up.weight` (E, 2F, D),
  `layers.3.mlp.experts.down.weight` (E, D, F), `layers.3.mlp.router.weight`,
  `layers.1.mlp.gate_up.weight` (dense), `lm_head.weight`): an `fp4.FP4Tensor` when
  `recipe.quantizes(site)`, else a `dtype` copy;
- every other parameter under its parameter name (`embed.weight`, `layers.3.attn_norm.weight`,
  `layers.3.attn.q_norm.weight`, `norm.weight`, ...) as a `dtype` copy.
With tied embeddings `lm_head.weight` is the same tensor as `embed.weight` (counted once).

Bit-identity: an FP4 entry is `qat.quantize_weight(param.to(dtype), fmt, global_scale=...)`, the
very tensor the trainer's `FakeQuant` rounds when it runs with `compute_dtype=dtype`; q/k/v of a
layer share one global scale (`qat.shared_weight_global_scale`, as FakeQuant.weight_group does
and as vLLM expects of a fused qkv), stacked experts have one per expert, the fused gate_up one
per matrix. So `fp4.dequantize(packed[site])` equals `FakeQuant.weight(site, w)` bit for bit and
the NVFP4 export writes these very bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tracerl import fp4, qat


@dataclass
class PackedWeights:
    """Dict-like: name -> FP4Tensor or Tensor (see the module docstring for the names)."""

    recipe: qat.Recipe
    dtype: torch.dtype
    tensors: dict[str, fp4.FP4Tensor | torch.Tensor]

    def __getitem__(self, name: str) -> fp4.FP4Tensor | torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"PackedWeights has no entry {name!r} (linear weights are keyed by site name, "
                           f"e.g. 'layers.0.mlp.experts.gate_up.weight'; others by parameter name)") from None

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def keys(self):
        return self.tensors.keys()

    def items(self):
        return self.tensors.items()

    def is_quantized(self, name: str) -> bool:
        return isinstance(self.tensors.get(name), fp4.FP4Tensor)

    @property
    def quantized_names(self) -> list[str]:
        """The entries stored as FP4."""
        return [k for k, v in self.tensors.items() if isinstance(v, fp4.FP4Tensor)]

    def dequantized(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The entry as a dense tensor (FP4 entries dequantized) in `dtype` (default: self.dtype)."""
        t = self[name]
        dtype = dtype or self.dtype
        return fp4.dequantize(t, dtype) if isinstance(t, fp4.FP4Tensor) else t.to(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes as stored (FP4 codes + scales + global scales, plus dense copies; shared tensors once)."""
        seen: set[int] = set()
        total = 0
        for t in self.tensors.values():
            if id(t) in seen:
                continue
            seen.add(id(t))
            total += t.nbytes if isinstance(t, fp4.FP4Tensor) else t.numel() * t.element_size()
        return total

    def to(self, device: torch.device | str) -> PackedWeights:
        """A copy on `device` (aliases such as tied embeddings stay shared)."""
        moved: dict[int, fp4.FP4Tensor | torch.Tensor] = {}
        out = {}
        for k, t in self.tensors.items():
            if id(t) not in moved:
                moved[id(t)] = t.to(device)
            out[k] = moved[id(t)]
        return PackedWeights(self.recipe, self.dtype, out)


def qkv_groups(model) -> list[list[str]]:
    """The fused weight groups sharing one global scale: [q, k, v] weight sites of every layer."""
    return [[f"layers.{i}.attn.{n}_proj.weight" for n in "qkv"] for i in range(model.config.num_layers)]


@torch.no_grad()
def pack_weights(model, recipe: qat.Recipe, dtype: torch.dtype = torch.bfloat16) -> PackedWeights:
    """Pack `model`'s weights for `recipe` (see the module docstring)."""
    params = dict(model.named_parameters())
    sites = model.weight_sites()
    fmt = recipe.fmt

    def cast(name: str) -> torch.Tensor:
        return params[name].detach().to(dtype, copy=True)

    group_scale: dict[str, torch.Tensor | None] = {}
    for group in qkv_groups(model):
        members = [cast(sites[s]) for s in group if recipe.quantizes(s)]
        gs = qat.shared_weight_global_scale(members, fmt)
        group_scale.update({s: gs for s in group})

    out: dict[str, fp4.FP4Tensor | torch.Tensor] = {}
    dense_copies: dict[str, torch.Tensor] = {}
    for site, pname in sites.items():
        if recipe.quantizes(site):
            out[site] = qat.quantize_weight(cast(pname), fmt, name=site, global_scale=group_scale.get(site))
        else:
            out[site] = dense_copies.setdefault(pname, cast(pname))
    covered = set(sites.values())
    for pname in params:
        if pname not in covered or pname == "embed.weight":
            out[pname] = dense_copies.setdefault(pname, cast(pname))
    return PackedWeights(recipe, dtype, out)
