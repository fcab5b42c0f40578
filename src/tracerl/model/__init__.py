"""tracerl.model: a decoder-only MoE LM (Qwen3-MoE / Mixtral / OLMoE variants) with named FP4 quant sites.

    from tracerl import model as M
    m = M.build("tiny", seed=0)                   # random init, deterministic per seed
    m = M.from_pretrained("path/to/hf_folder")     # Qwen3MoeForCausalLM / MixtralForCausalLM / OlmoeForCausalLM
    logits = m(input_ids, attention_mask)          # (B, S, V) float32
    out = m(input_ids, attention_mask, quant=FakeQuant(Recipe("w4a4")), return_routing=True)
    packed = m.pack_weights(Recipe("w4a4"))       # PackedWeights for the rollout engine

See docs/model.md for the forward contract, the quant-site names and the checkpoint formats.
"""

from tracerl.model.config import PRESETS, ModelConfig
from tracerl.model.hf import from_pretrained
from tracerl.model.kvcache import DenseKVCache
from tracerl.model.packed import PackedWeights
from tracerl.model.routing import RoutingRecord
from tracerl.model.transformer import ModelOutput, MoEModel, build

__all__ = [
    "PRESETS",
    "DenseKVCache",
    "ModelConfig",
    "ModelOutput",
    "MoEModel",
    "PackedWeights",
    "RoutingRecord",
    "build",
    "from_pretrained",
]
