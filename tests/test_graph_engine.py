"""GraphEngine (rollout/graph_engine.py): the engine API on the GPU decoder, with recording.

`check_generate` / `check_multi_turn` run the tiny model through the graph engine and test what the
trainer relies on: the batch layout (prompt, responses, stop, budget), the recorded routing and FP4
codes, and above all that the trainer's forward *guided by the records* reproduces the rollout's
logprobs far better than a plain BF16 trainer does (a record written at the wrong slot, column or
expert slot would make the guided trainer follow the wrong codes, and the gap would vanish).
They run natively with CUDA (with the CUDA graph) and in Triton's interpreter on CPU (a subprocess,
as tests/test_gpu_kernels.py does).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from test_gpu_kernels import _run_interpreter  # noqa: E402 (tests/ is on sys.path)
from tracerl import qat
from tracerl.guidance import CachePolicy
from tracerl.rollout import SamplingParams, make_engine

CUDA = torch.cuda.is_available()
try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def _model():
    from tracerl import model as M

    return M.build("tiny", seed=0)


def _kl(fw_logp, batch) -> float:
    from tracerl.rl.metrics import mismatch_metrics

    return mismatch_metrics(fw_logp, batch.logprobs, batch.policy_mask)["mismatch/kl_k3"]


def check_generate(dev: str, check_every: int = 2, full: bool = True) -> None:
    """Layout, stops, routing and guidance of a w4a4kv4 graph rollout of the tiny model
    (`full`: also the same rollout again from the same seed, and another from another seed)."""
    from tracerl.rl.alignment import alignment_report, trainer_forward

    m = _model().to(dev)
    recipe = qat.Recipe("w4a4kv4")
    policy = CachePolicy("all", "codes+scales", "codes")
    eng = make_engine("graph", m, recipe, policy, device=dev, diagnostics=True, max_len=24, check_every=check_every)
    prompts = [[1, 5, 9, 13, 17], [1, 7, 3]]
    stop = 11
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop=(stop,), n=2)
    b = eng.generate(prompts, params, seed=3)
    assert len(b) == 4 and b.prompt_index.tolist() == [0, 0, 1, 1]
    for i in range(4):
        p = prompts[i // 2]
        assert b.prompt(i) == p and b.sequence(i)[:len(p)] == p, i
        resp = b.responses(i)
        assert 1 <= len(resp) <= 6
        # the row is compact: prompt, then the response, then padding (right-padded layout)
        n = len(p) + len(resp)
        assert b.attention_mask[i, :n].all() and not b.attention_mask[i, n:].any()
        assert bool(b.finished[i]) == (resp[-1] == stop) and stop not in resp[:-1]
        if not b.finished[i]:
            assert len(resp) == 6
        assert (b.logprobs[i][b.policy_mask[i]] < 0).all() and (b.logprobs[i][~b.policy_mask[i]] == 0).all()
    if full:  # same seed, same rollout (from reused slots and graph); another seed, another one
        again = eng.generate(prompts, params, seed=3)
        assert torch.equal(again.tokens, b.tokens) and torch.equal(again.logprobs, b.logprobs)
        assert not torch.equal(eng.generate(prompts, params, seed=4).tokens, b.tokens)
        b = again
    # the records drive the trainer: guided by all codes + routing replay it follows the rollout
    none = alignment_report(m, b, alignment="none", recipe=recipe, routing_replay=False)
    full = alignment_report(m, b, alignment="trace", recipe=recipe, routing_replay=True)
    assert full["flips/act_frac"] == 0.0, full
    assert none["flips/act_frac"] > 0.05, none  # the BF16 trainer's RTN codes differ from the rollout's
    assert full["mismatch/kl_k3"] < none["mismatch/kl_k3"] / 20, (full, none)
    assert full["mismatch/kl_k3"] < 1e-4, full
    # the recorded routing is what the trainer's own router picks (ties aside)
    fw = trainer_forward(m, b, alignment="trace", recipe=recipe, routing_replay=False)
    assert fw.routing.mismatch_frac(b.routing, b.attention_mask) < 0.05
    # trace-full's records as the reference engine lays them out for the trainer: every site, (B, S, ...)
    for site, rec in b.guidance.items():
        assert rec.shape[:2] == tuple(b.tokens.shape), (site, rec.shape)
    assert any(s.endswith("experts.down.input") for s in b.guidance)
    assert b.guidance_bytes_per_token > 0


def check_multi_turn(dev: str) -> None:
    """continue_: observations fed teacher-forced, masked out of the policy; finished rows left alone."""
    from tracerl.rl.alignment import alignment_report

    m = _model().to(dev)
    recipe = qat.Recipe("w4a4kv4")
    eng = make_engine("graph", m, recipe, CachePolicy("all", "codes+scales", "lsb"), device=dev, max_len=32,
                      check_every=3)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, stop=(), n=2)
    b1 = eng.generate([[1, 5, 9], [1, 7, 3, 4]], params, seed=1)
    first = [b1.sequence(i) for i in range(4)]
    obs = [20, 21, 22, 23]
    turn = SamplingParams(max_new_tokens=3, temperature=1.0, stop=(), n=1)
    # row 0 an observation, row 1 over, row 2 an empty observation (acts again), row 3 a short one
    b2 = eng.continue_(b1, [obs, None, [], [30]], turn, seed=2)
    assert b2.prompt_index.tolist() == [0, 0, 1, 1]  # the GRPO groups survive the turns
    s0 = b2.sequence(0)
    assert s0[:len(first[0])] == first[0] and s0[len(first[0]):len(first[0]) + 4] == obs
    assert len(s0) == len(first[0]) + 4 + 3
    assert b2.sequence(1) == first[1]  # no observation: the episode is over, nothing appended
    env_cols = b2.attention_mask[0] & ~b2.policy_mask[0] & ~b2.prompt_mask[0]
    assert b2.tokens[0][env_cols].tolist() == obs
    assert b2.sequence(2)[:len(first[2])] == first[2] and len(b2.sequence(2)) == len(first[2]) + 3
    assert b2.sequence(3)[len(first[3])] == 30
    assert [len(b2.responses(i)) for i in range(4)] == [6, 3, 6, 6]
    # lsb guidance + scales reproduce the rollout's codes on every recorded site
    full = alignment_report(m, b2, alignment="trace", recipe=recipe, routing_replay=True)
    none = alignment_report(m, b2, alignment="none", recipe=recipe, routing_replay=False)
    assert full["mismatch/kl_k3"] < none["mismatch/kl_k3"] / 10, (full, none)


def check_turn_noise(dev: str) -> None:
    """Turns of an episode draw fresh sampling noise (collect passes seed + turn to each turn).

    At temperature 20 the tiny model's distribution is nearly uniform, so the sampled token is
    the Gumbel noise's argmax: a turn that re-drew the previous turn's noise (keys a few steps
    apart) would repeat its tokens at some shift. Independent noise matches ~1/128 of positions.
    """
    m = _model().to(dev)
    eng = make_engine("graph", m, qat.Recipe("bf16"), device=dev, max_len=48)
    params = SamplingParams(max_new_tokens=12, temperature=20.0, stop=(), n=2)
    b1 = eng.generate([[1, 5, 9]], params, seed=7)
    b2 = eng.continue_(b1, [[], []], SamplingParams(max_new_tokens=12, temperature=20.0, stop=()), seed=8)
    for i in range(2):
        t1, t2 = b2.responses(i)[:12], b2.responses(i)[12:]
        best = max(sum(t2[j] == t1[j + d] for j in range(12) if 0 <= j + d < 12) for d in range(-11, 12))
        assert best <= 3, (i, t1, t2)


def check_errors(dev: str) -> None:
    m = _model().to(dev)
    with pytest.raises(ValueError, match="ties"):
        make_engine("graph", m, qat.Recipe("w4a4kv4"), CachePolicy("all", "codes+scales", "ties"), device=dev)
    eng = make_engine("graph", m, qat.Recipe("bf16"), device=dev, max_len=16)
    with pytest.raises(ValueError, match="top_p"):
        eng.generate([[1, 2]], SamplingParams(max_new_tokens=2, top_p=0.9))
    with pytest.raises(ValueError, match="exceeds the context"):
        eng.generate([[1] * 12], SamplingParams(max_new_tokens=8))
    b = eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="later generate"):
        eng.continue_(b, [[3]], SamplingParams(max_new_tokens=2))


# ----------------------------------------------------------------------------- CPU


def test_philox_keys_of_nearby_seeds_lie_far_apart():
    from tracerl.rollout.graph_engine import philox_key

    # the step counts up in the low word: calls of distinct high words never share a key
    keys = [philox_key(s) for s in range(5000)]
    assert len({k >> 32 for k in keys}) == 5000 and all(k % 2**32 == 0 and 0 < k < 2**63 for k in keys)


def test_make_engine_errors():
    m = _model()
    with pytest.raises(ValueError, match="unknown rollout.engine"):
        make_engine("vllm", m, qat.Recipe("bf16"))
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="runs on CUDA"):
            make_engine("graph", m, qat.Recipe("bf16"), device="cpu")


def test_engine_setting_keeps_reference_config_hashes():
    """rollout.engine at its default is left out of the hash: committed cells keep theirs."""
    from tracerl.config import config_from_dict
    from tracerl.experiments import config_hash

    base = config_from_dict({})
    ref = config_from_dict({}, ["rollout.engine=reference"])
    graph = config_from_dict({}, ["rollout.engine=graph"])
    assert config_hash(base) == config_hash(ref) != config_hash(graph)


@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="needs triton and no CUDA (the interpreter runs on CPU)")
def test_graph_engine_in_interpreter():
    # one rollout (about 100 s in the interpreter on 2 cores); the slow test and the GPU tests do the rest
    p = _run_interpreter("import test_graph_engine as t; t.check_generate('cpu', full=False); print('checks ok')")
    assert p.returncode == 0 and "checks ok" in p.stdout, p.stdout[-3000:] + p.stderr[-6000:]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="needs triton and no CUDA (the interpreter runs on CPU)")
def test_graph_engine_full_in_interpreter():
    p = _run_interpreter("import test_graph_engine as t; t.check_generate('cpu'); t.check_multi_turn('cpu'); "
                         "t.check_turn_noise('cpu'); t.check_errors('cpu'); print('checks ok')")
    assert p.returncode == 0 and "checks ok" in p.stdout, p.stdout[-3000:] + p.stderr[-6000:]


# ----------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not (CUDA and HAS_TRITON), reason="needs CUDA and triton")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("check_every", [1, 8])
def test_graph_engine_gpu(check_every):
    check_generate("cuda", check_every=check_every)


@gpu
@pytest.mark.gpu
def test_graph_engine_copy_recording_gpu(monkeypatch):
    """The index_copy_ recording path (FUSED_RECORDING off, kept for A/B timing) records the same."""
    from tracerl.rollout import graph_engine

    monkeypatch.setattr(graph_engine, "FUSED_RECORDING", False)
    check_generate("cuda", full=False)


@gpu
@pytest.mark.gpu
def test_graph_engine_multi_turn_gpu():
    check_multi_turn("cuda")
    check_turn_noise("cuda")
    check_errors("cuda")


@gpu
@pytest.mark.gpu
def test_graph_engine_syncs_once_per_check():
    """The host reads the device once every `check_every` steps (plus a few around the call)."""
    import collections
    import warnings

    m = _model().to("cuda")
    eng = make_engine("graph", m, qat.Recipe("w4a4kv4"), CachePolicy("fraction:0.5", "codes+scales", "lsb"),
                      device="cuda", max_len=80, check_every=8)
    params = SamplingParams(max_new_tokens=64, n=2, stop=())
    prompts = [[1, 5, 9, 13], [1, 7]]
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # as in RL (run.deterministic)
    try:
        eng.generate(prompts, params, seed=0)  # compile and capture first
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                b = eng.generate(prompts, params, seed=1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.use_deterministic_algorithms(before)
    sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                if "called a synchronizing" in str(w.message))
    n = sum(sites.values())
    steps = 4 + 64  # the longest prompt is fed one token per step, then 64 sampled
    print(f"\ngraph engine: {n} host syncs for {steps} steps: {sites.most_common()}")
    assert all(len(b.responses(i)) == 64 for i in range(len(b)))
    # a poll per 8 steps (+1), and the copies that set up and finish the call: never one per step
    assert n <= steps // 8 + 2 + 18 < steps, sites.most_common(8)
