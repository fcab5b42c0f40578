"""The rollout engine: batched FP4/BF16 generation with a KV cache and TRACE recording."""

import os

import torch

from tracerl.rollout.batch import RolloutBatch
from tracerl.rollout.engine import Engine
from tracerl.rollout.kvcache import DenseKVCache, FP4KVCache
from tracerl.rollout.sampling import SamplingParams, sample

ENGINES = ("reference", "graph")


def make_engine(kind: str, model: torch.nn.Module, *args, **kwargs):
    """The rollout engine `rollout.engine` names: `reference` (Engine) or `graph` (GraphEngine, CUDA)."""
    if kind == "reference":
        return Engine(model, *args, **kwargs)
    if kind != "graph":
        raise ValueError(f"unknown rollout.engine {kind!r}; choose one of {ENGINES}")
    device = torch.device(kwargs.get("device") or next(model.parameters()).device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"rollout.engine: graph runs on CUDA (this run's device is {device}); "
                         "use rollout.engine: reference, or run.device: cuda")
    try:
        from tracerl.rollout.graph_engine import GraphEngine
    except ImportError as e:
        raise ValueError(f"rollout.engine: graph needs Triton ({e}); pip install triton, "
                         "or use rollout.engine: reference") from e
    return GraphEngine(model, *args, **kwargs)


__all__ = ["Engine", "ENGINES", "RolloutBatch", "SamplingParams", "make_engine", "sample", "DenseKVCache",
           "FP4KVCache"]
