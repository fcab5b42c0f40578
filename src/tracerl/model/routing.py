"""RoutingRecord: the top-k experts each token was sent to, per MoE layer (for routing replay, R3).

The rollout engine records it; the trainer passes it back as `routing_replay=` so its forward uses
the same experts, while the gate weights are recomputed from the trainer's own router logits (so
the router keeps its gradient). Stored compactly: the smallest integer dtype that holds the
expert ids (uint8 up to 256 experts), one stacked tensor (L, B, S, K) over the MoE layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def ids_dtype(num_experts: int) -> torch.dtype:
    """Smallest integer dtype holding ids 0..num_experts-1 (uint8 / int16 / int32)."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    return torch.int32


@dataclass
class RoutingRecord:
    """Top-k expert ids per MoE layer and token.

    expert_ids: (L, B, S, K) integer tensor, L = number of MoE layers, slot order = the router's
      top-k order (descending probability).
    layers: the model layer index of each of the L entries (dense layers have no entry).
    num_experts: E, for validation and dtype choice.
    """

    expert_ids: torch.Tensor
    layers: tuple[int, ...]
    num_experts: int

    def __post_init__(self) -> None:
        self.layers = tuple(int(i) for i in self.layers)
        if self.expert_ids.dim() != 4:
            raise ValueError(f"RoutingRecord.expert_ids must be (L, B, S, K), got shape {tuple(self.expert_ids.shape)}")
        if self.expert_ids.shape[0] != len(self.layers):
            raise ValueError(
                f"RoutingRecord: {self.expert_ids.shape[0]} layer entries in expert_ids but {len(self.layers)} layer indices"
            )
        if self.expert_ids.is_floating_point():
            raise TypeError(f"RoutingRecord.expert_ids must be an integer tensor, got {self.expert_ids.dtype}")

    @classmethod
    def from_layers(cls, ids_per_layer: Sequence[torch.Tensor], layers: Sequence[int], num_experts: int) -> RoutingRecord:
        """Stack per-layer (B, S, K) ids into a record in the compact dtype."""
        dt = ids_dtype(num_experts)
        return cls(torch.stack([t.to(dt) for t in ids_per_layer]), tuple(layers), num_experts)

    # ------------------------------------------------------------------ shape / access

    @property
    def shape(self) -> torch.Size:
        """(L, B, S, K)."""
        return self.expert_ids.shape

    @property
    def batch_size(self) -> int:
        return self.expert_ids.shape[1]

    @property
    def seq_len(self) -> int:
        return self.expert_ids.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored ids."""
        return self.expert_ids.numel() * self.expert_ids.element_size()

    def layer(self, layer_idx: int) -> torch.Tensor:
        """The (B, S, K) ids of model layer `layer_idx` (a MoE layer)."""
        try:
            j = self.layers.index(layer_idx)
        except ValueError:
            raise KeyError(f"layer {layer_idx} is not in this RoutingRecord (MoE layers {self.layers})") from None
        return self.expert_ids[j]

    def __getitem__(self, rows) -> RoutingRecord:
        """Select batch rows (an int, slice, list or index/bool tensor): the record of those rows."""
        if isinstance(rows, int):
            rows = slice(rows, rows + 1) if rows != -1 else slice(rows, None)
        return RoutingRecord(self.expert_ids[:, rows], self.layers, self.num_experts)

    def seq_slice(self, start: int | None = None, stop: int | None = None) -> RoutingRecord:
        """The record of positions start:stop (e.g. the response part of a sequence)."""
        return RoutingRecord(self.expert_ids[:, :, start:stop], self.layers, self.num_experts)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RoutingRecord:
        """Move to `device` (e.g. offload to CPU, bring back for a training micro-batch)."""
        return RoutingRecord(self.expert_ids.to(device, non_blocking=non_blocking), self.layers, self.num_experts)

    def pin_memory(self) -> RoutingRecord:
        """A copy in pinned CPU memory (for asynchronous host-to-device copies)."""
        return RoutingRecord(self.expert_ids.pin_memory(), self.layers, self.num_experts)

    @staticmethod
    def cat(records: Sequence[RoutingRecord], dim: str = "seq") -> RoutingRecord:
        """Concatenate along 'seq' (prefill + decode steps) or 'batch' (micro-batches)."""
        if not records:
            raise ValueError("RoutingRecord.cat needs at least one record")
        first = records[0]
        for r in records[1:]:
            if r.layers != first.layers or r.num_experts != first.num_experts:
                raise ValueError("RoutingRecord.cat: records come from different models (layers / num_experts differ)")
        axis = {"seq": 2, "batch": 1}.get(dim)
        if axis is None:
            raise ValueError(f"RoutingRecord.cat: dim must be 'seq' or 'batch', got {dim!r}")
        return RoutingRecord(torch.cat([r.expert_ids for r in records], dim=axis), first.layers, first.num_experts)

    def mismatch_frac(self, other: RoutingRecord, mask_BS: torch.Tensor | None = None) -> float:
        """Share of (layer, token) whose expert *set* differs from `other`'s (over mask_BS True tokens)."""
        if self.shape != other.shape:
            raise ValueError(f"RoutingRecord.mismatch_frac: shapes differ {tuple(self.shape)} vs {tuple(other.shape)}")
        a = self.expert_ids.to(torch.int64).sort(dim=-1).values
        b = other.expert_ids.to(device=a.device, dtype=torch.int64).sort(dim=-1).values
        diff_LBS = (a != b).any(dim=-1)
        if mask_BS is None:
            return float(diff_LBS.float().mean()) if diff_LBS.numel() else 0.0
        m = mask_BS.to(device=a.device, dtype=torch.bool).unsqueeze(0).expand_as(diff_LBS)
        n = int(m.sum())
        return float((diff_LBS & m).sum()) / n if n else 0.0
