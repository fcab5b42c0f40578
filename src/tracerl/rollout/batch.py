"""RolloutBatch: what one generate() call produced, in the (B, S) layout the trainer consumes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tracerl import fp4
from tracerl.guidance import GuidanceRecord


@dataclass
class RolloutBatch:
    """Token ids, masks, rollout logprobs and the rollout's records, aligned by (row, column).

    Layout: `attention_mask` marks real tokens and positions count them, so padding may sit anywhere.
    The reference Engine left-pads prompts to a common length and continues in lockstep columns; the
    GraphEngine writes each row compactly from column 0 and right-pads.
    `logprobs[b, c]` is log softmax(logits / T) of token `tokens[b, c]` given columns < c, under
    the policy the engine ran (FP4 for FP4 recipes); zero where no token was sampled.
    `policy_mask` marks the tokens the policy generated (the only ones that enter the loss);
    `prompt_mask` the prompt tokens; environment tokens are in neither.
    """

    tokens: torch.Tensor  # (B, S) int64
    attention_mask: torch.Tensor  # (B, S) bool
    prompt_mask: torch.Tensor  # (B, S) bool
    policy_mask: torch.Tensor  # (B, S) bool
    logprobs: torch.Tensor  # (B, S) float32
    prompt_index: torch.Tensor  # (B,) int64: which prompt each row samples (GRPO group id)
    routing: Any | None = None  # RoutingRecord, (L, B, S, K)
    guidance: dict[str, GuidanceRecord] = field(default_factory=dict)
    reference: dict[str, fp4.FP4Tensor] = field(default_factory=dict)  # diagnostics: all sites' codes
    guidance_bytes_per_token: float = 0.0
    finished: torch.Tensor | None = None  # (B,) bool: stopped by a stop token (vs length)
    stats: dict[str, float] = field(default_factory=dict)
    _state: Any = field(default=None, repr=False)  # engine state for continue_()

    @property
    def response_mask(self) -> torch.Tensor:
        """Alias of policy_mask: the generated tokens."""
        return self.policy_mask

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def responses(self, i: int) -> list[int]:
        """Sequence i's generated token ids (policy tokens only, in order)."""
        return self.tokens[i][self.policy_mask[i]].tolist()

    def response_logprobs(self, i: int) -> list[float]:
        """Rollout logprobs of sequence i's generated tokens."""
        return self.logprobs[i][self.policy_mask[i]].tolist()

    def prompt(self, i: int) -> list[int]:
        """Sequence i's prompt token ids."""
        return self.tokens[i][self.prompt_mask[i]].tolist()

    def sequence(self, i: int) -> list[int]:
        """All real tokens of sequence i (prompt, responses, environment turns)."""
        return self.tokens[i][self.attention_mask[i]].tolist()

    @property
    def n_generated(self) -> int:
        """Number of policy-generated tokens."""
        return int(self.policy_mask.sum())

    def select(self, rows: torch.Tensor) -> RolloutBatch:
        """A micro-batch of rows, with records sliced to match (engine state is not carried)."""
        routing = None if self.routing is None else self.routing[rows]
        return RolloutBatch(
            tokens=self.tokens[rows], attention_mask=self.attention_mask[rows], prompt_mask=self.prompt_mask[rows],
            policy_mask=self.policy_mask[rows], logprobs=self.logprobs[rows], prompt_index=self.prompt_index[rows],
            routing=routing,
            guidance={k: r.rows(rows) for k, r in self.guidance.items()},
            reference={k: _fp4_rows(q, rows) for k, q in self.reference.items()},
            guidance_bytes_per_token=self.guidance_bytes_per_token,
            finished=None if self.finished is None else self.finished[rows],
            stats=dict(self.stats),
        )


def _fp4_rows(q: fp4.FP4Tensor, rows: torch.Tensor) -> fp4.FP4Tensor:
    gs = None if q.global_scale is None else q.global_scale[rows]
    codes = q.codes[rows]
    return fp4.FP4Tensor(codes, fp4.select_rows(q.scales, rows), gs, q.fmt,
                         torch.Size((*codes.shape[:-1], q.shape[-1])))
