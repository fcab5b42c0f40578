"""The trainer's forward over a RolloutBatch, in the configured alignment with the rollout.

- `none`: the plain BF16 trainer (the usual "quantized rollout" setup);
- `qat`: fake-quantize the recipe's sites with the trainer's own round-to-nearest (QaRL/Jet-RL);
- `trace`: fake-quant whose rounding follows the rollout's GuidanceRecords where they exist.
Routing replay (R3) reuses the rollout's top-k experts; gate weights come from this forward.

This is a full-sequence, teacher-forced forward (what a trainer runs), not the engine's
incremental decode: the difference between the two is the mismatch being measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tracerl import qat
from tracerl.rl.metrics import flip_metrics
from tracerl.rollout.batch import RolloutBatch

ALIGNMENTS = ("none", "qat", "trace")


@dataclass
class TrainerForward:
    """Token logprobs aligned with RolloutBatch columns, plus what the forward observed."""

    logp: torch.Tensor  # (B, S): logp[:, c] = log pi(tokens[:, c] | tokens[:, <c]); 0 at column 0
    logits: torch.Tensor  # (B, S, V) float32 (tempered)
    routing: object | None  # RoutingRecord the forward used
    flips: dict = field(default_factory=dict)  # site -> SiteFlips (when the batch carries reference codes)


def trainer_handler(batch: RolloutBatch, alignment: str, recipe: qat.Recipe, routing_replay: bool) -> qat.QuantHandler:
    """The QuantHandler that realises `alignment` for this batch."""
    if alignment not in ALIGNMENTS:
        raise ValueError(f"unknown alignment {alignment!r}; choose one of {ALIGNMENTS}")
    if alignment == "none":
        if batch.reference:  # diagnostics: measure the flips a BF16 trainer's activations would have
            return qat.FakeQuant(recipe, reference=batch.reference, valid_tokens=batch.attention_mask, measure_only=True)
        return qat.NoQuant()
    guidance = {}
    if alignment == "trace":
        guidance = dict(batch.guidance)
        if not routing_replay:
            # expert-slot records describe the rollout's experts; without replay the trainer's
            # slots may hold other experts, so only token-level sites are guided
            guidance = {k: v for k, v in guidance.items() if not k.endswith("mlp.experts.down.input")}
    return qat.FakeQuant(recipe, guidance=guidance, reference=batch.reference, valid_tokens=batch.attention_mask)


def trainer_forward(
    model: torch.nn.Module,
    batch: RolloutBatch,
    *,
    alignment: str,
    recipe: qat.Recipe,
    routing_replay: bool,
    compute_dtype: torch.dtype | None = torch.bfloat16,
    temperature: float = 1.0,
) -> TrainerForward:
    """Teacher-forced forward of the batch's sequences with the configured alignment."""
    handler = trainer_handler(batch, alignment, recipe, routing_replay)
    replay = batch.routing if routing_replay else None
    if routing_replay and replay is None:
        raise ValueError("routing_replay needs the RolloutBatch's RoutingRecord (the engine records it)")
    out = model(
        batch.tokens, attention_mask=batch.attention_mask, quant=handler, routing_replay=replay,
        return_routing=True, compute_dtype=compute_dtype,
    )
    logits = out.logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp_next = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    logp = torch.cat([torch.zeros_like(logp_next[:, :1]), logp_next], dim=1)
    flips = handler.flips if isinstance(handler, qat.FakeQuant) else {}
    return TrainerForward(logp=logp, logits=logits, routing=out.routing, flips=flips)


def alignment_report(model, batch: RolloutBatch, *, alignment: str, recipe: qat.Recipe, routing_replay: bool,
                     compute_dtype: torch.dtype | None = torch.bfloat16, temperature: float = 1.0) -> dict[str, float]:
    """Mismatch, flip and routing metrics of one trainer forward against the rollout (no gradient)."""
    from tracerl.rl.metrics import mismatch_metrics

    with torch.no_grad():
        fw = trainer_forward(model, batch, alignment=alignment, recipe=recipe, routing_replay=routing_replay,
                             compute_dtype=compute_dtype, temperature=temperature)
    m = mismatch_metrics(fw.logp, batch.logprobs, batch.policy_mask)
    m.update(flip_metrics(fw.flips, model.config.num_layers))
    if batch.routing is not None and fw.routing is not None and not routing_replay:
        m["routing/mismatch_frac"] = fw.routing.mismatch_frac(batch.routing, batch.attention_mask)
    return m
