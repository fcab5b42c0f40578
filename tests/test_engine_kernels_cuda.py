"""The engine's FP4 sites on CUDA run the Triton quantize/dequantize kernels: same results, bit for bit.

`rollout.recorder.site_quantize` sends activation and KV-cache quantization to `tracerl.kernels`
on CUDA (one kernel instead of ~40 PyTorch ops per site). The kernels are bit-exact with
`tracerl.fp4` (tests/test_kernels.py); this checks the wiring: a whole generation with recording
gives identical tokens, logprobs, routing and guidance records on both kernel backends.
Skipped without CUDA and Triton (CI); on CPU the engine never calls the kernels.
"""

from __future__ import annotations

import pytest
import torch

from tracerl import kernels, qat
from tracerl import model as M
from tracerl.guidance import CachePolicy
from tracerl.rollout import Engine, SamplingParams

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.triton_available()),
                               reason="needs CUDA and triton")


def _generate(backend: str, encoding: str):
    kernels.set_backend(backend)
    try:
        m = M.build("tiny", seed=0).to("cuda", torch.bfloat16)
        eng = Engine(m, qat.Recipe("w4a4kv4"), CachePolicy("all", "codes+scales", encoding, 0.05),
                     dtype=torch.bfloat16, device="cuda")
        prompts = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17]]
        return eng.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, n=2), seed=7)
    finally:
        kernels.set_backend("auto")


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("encoding", ["lsb", "codes"])
def test_engine_triton_sites_equal_reference_bit_for_bit(encoding):
    a, b = _generate("reference", encoding), _generate("triton", encoding)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(a.routing.expert_ids, b.routing.expert_ids)
    assert set(a.guidance) == set(b.guidance) and a.guidance
    for site, ra in a.guidance.items():
        assert ra.to_bytes() == b.guidance[site].to_bytes(), site
