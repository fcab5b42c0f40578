"""The rollout engine: batched FP4/BF16 generation with a KV cache and TRACE recording."""

from tracerl.rollout.batch import RolloutBatch
from tracerl.rollout.engine import Engine
from tracerl.rollout.kvcache import DenseKVCache, FP4KVCache
from tracerl.rollout.sampling import SamplingParams, sample

__all__ = ["Engine", "RolloutBatch", "SamplingParams", "sample", "DenseKVCache", "FP4KVCache"]
