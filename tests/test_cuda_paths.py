"""The CPU-developed paths on CUDA: engine, trainer step (+ checkpoint/resume), compare suite.

Skipped without CUDA (`-m gpu` selects them); importable without CUDA or Triton (CI has no CUDA),
so nothing here imports `tracerl.kernels` or `rollout/gpu.py`.

`TRACERL_TEST_DEVICE=cpu` runs the same tests on the CPU (bf16 there), to check the tests
themselves on a machine without a GPU; it cannot catch device mismatches.

Tolerances of the CUDA engine (bf16) against the CPU engine in float32 (test (a)). Bitwise
equality cannot hold: the bf16 engine casts weights and activations to bf16 (and packs its FP4
weights from bf16 copies, so global scales differ from the float32 packing), and CUDA kernels
accumulate in another order. Measured on CPU with a bf16 engine against the float32 one (tiny
preset, 6 random models x 8 prompts x 6 greedy tokens; the random model's logits have std ~0.23):

| recipe  | max abs dlogp (nats) | greedy regret (fp32 logits) | expert-set mismatch, prompt tokens |
| bf16    | 0.029                | 0.004                       | 2.5%                               |
| w4a4kv4 | 0.082                | 0.094                       | 13%                                |

w4a4kv4 is much noisier since one flipped FP4 code moves a value a whole grid step (the very
mismatch the project studies). CUDA differs from CPU-bf16 only in accumulation order, the same
order of magnitude as bf16 rounding, so the tolerances below are about 3x the measurements.
"Greedy equal" then means: the same tokens until the first position where the float32 logits
have a near-tie (top-1 minus top-2 below the regret tolerance); the CUDA token must always be
within that tolerance of the float32 argmax. Quantities that are exact on every device (FP4
packing of identical weights, record slicing, GRPO advantages) are compared bit for bit.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tracerl import fp4, qat
from tracerl import model as M
from tracerl.config import load_config
from tracerl.guidance import CachePolicy
from tracerl.rl.alignment import trainer_forward
from tracerl.rl.losses import group_advantages, zero_variance_groups
from tracerl.rl.trainer import Trainer
from tracerl.rollout import Engine, SamplingParams

DEVICE = os.environ.get("TRACERL_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.gpu,
]

# recipe: (max |dlogp| nats, near-tie / greedy-regret logit margin, expert-set mismatch on prompt tokens)
TOL = {"bf16": (0.1, 0.02, 0.1), "w4a4kv4": (0.25, 0.3, 0.35)}
N_NEW = 6

# DESIGN.md "Metrics" logged by every trainer step (routing/mismatch_frac belongs to the study's
# alignment reports, not to a step with routing replay)
STEP_KEYS = {
    "reward/mean", "reward/std", "acc/mean", "response_len/mean", "entropy/mean", "mismatch/kl_k3",
    "mismatch/logp_abs_diff_mean", "mismatch/prob_abs_diff_mean", "mismatch/prob_abs_diff_max",
    "mismatch/ratio_max", "mismatch/frac_ratio_outside_0.5_2", "flips/act_frac", "guidance/bytes_per_token",
    "guidance/coverage", "is/clip_frac", "timing/rollout_s", "timing/train_s", "throughput/rollout_tok_s",
}


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 99, (int(torch.randint(2, 11, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type == torch.device(DEVICE).type


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor's raw bytes on the CPU (float8 and -0.0 compared exactly)."""
    if t is None:
        return None
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


def _same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    a, b = _bits(a), _bits(b)
    return (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))


# ----------------------------------------------------------------------------- (a) engine


@pytest.mark.parametrize("recipe", ["bf16", "w4a4kv4"])
def test_engine_on_cuda_matches_cpu_float32(recipe):
    r = qat.Recipe(recipe)
    tol_lp, tol_tie, tol_route = TOL[recipe]
    m = M.build("tiny", seed=0)
    m_dev = copy.deepcopy(m).to(DEVICE)
    policy = CachePolicy("fraction:0.5", "codes+scales", "lsb")
    prompts = _prompts(6, seed=0)
    params = SamplingParams(max_new_tokens=N_NEW, temperature=0)

    # FP4 packing of the same weights is exact arithmetic (IEEE division, RNE): identical bits on any device
    packed_cpu, packed_dev = m.pack_weights(r, torch.bfloat16), m_dev.pack_weights(r, torch.bfloat16)
    for name in packed_cpu.quantized_names:
        a, b = packed_cpu[name], packed_dev[name]
        assert _on_device(b.codes) and _on_device(b.scales)
        for f in ("codes", "scales", "global_scale"):
            assert _same_bits(getattr(a, f), getattr(b, f)), f"{name}.{f} differs between CPU and {DEVICE}"
    assert bool(packed_cpu.quantized_names) == (recipe != "bf16")

    ref = Engine(m, r, policy, dtype=torch.float32, device="cpu", diagnostics=True).generate(prompts, params)
    got = Engine(m_dev, r, policy, dtype=torch.bfloat16, device=DEVICE, diagnostics=True).generate(prompts, params)
    for t in (got.tokens, got.logprobs, got.attention_mask, got.policy_mask, got.prompt_index):
        assert _on_device(t)
    assert torch.equal(got.prompt_mask.cpu(), ref.prompt_mask) and torch.equal(got.attention_mask.cpu(), ref.attention_mask)
    assert all(len(got.responses(i)) == N_NEW for i in range(len(prompts)))

    al = "none" if recipe == "bf16" else "qat"  # the same precision as the engine, full sequence, float32
    with torch.no_grad():
        ref_logits = trainer_forward(m, ref, alignment=al, recipe=r, routing_replay=False,
                                     compute_dtype=torch.float32).logits
        # rescoring the CUDA tokens with the float32 model
        fw = trainer_forward(m, _to_cpu(got), alignment=al, recipe=r, routing_replay=False,
                             compute_dtype=torch.float32)
    tok = got.tokens.cpu()
    pol = got.policy_mask.cpu()
    assert float((fw.logp - got.logprobs.cpu())[pol].abs().max()) < tol_lp
    lg = fw.logits[:, :-1][pol[:, 1:]]
    chosen = lg.gather(-1, tok[:, 1:][pol[:, 1:]][:, None]).squeeze(-1)
    assert float((lg.max(-1).values - chosen).max()) < tol_tie  # greedy up to a near-tie

    # the same tokens as the CPU float32 engine until a near-tie, with logprobs within tolerance
    p_len = int(ref.prompt_mask.sum(-1).max())  # left padding: prompts end at column p_len - 1
    compared = 0
    for i in range(len(prompts)):
        for c in range(p_len, p_len + N_NEW):
            if int(tok[i, c]) != int(ref.tokens[i, c]):
                top2 = ref_logits[i, c - 1].topk(2).values
                assert float(top2[0] - top2[1]) < tol_tie, f"row {i} col {c}: tokens differ without a near-tie"
                break
            assert abs(float(got.logprobs[i, c]) - float(ref.logprobs[i, c])) < tol_lp
            compared += 1
    assert compared >= len(prompts)  # not vacuous: most first tokens agree

    # routing records: (L_moe, B, S, K) compact ids on the device; prompt tokens route (nearly) alike
    cfg = m.config
    ids = got.routing.expert_ids
    assert _on_device(ids) and ids.dtype == torch.uint8
    assert tuple(ids.shape) == (len(cfg.moe_layers), len(prompts), got.tokens.shape[1], cfg.top_k)
    assert int(ids.max()) < cfg.num_experts
    assert got.routing.mismatch_frac(ref.routing, ref.prompt_mask) <= tol_route

    # guidance records (the policy's deeper half) and diagnostics reference codes, on the device
    assert set(got.guidance) == set(ref.guidance) and set(got.reference) == set(ref.reference)
    if recipe == "bf16":
        assert not got.guidance and not got.reference  # nothing is quantized
    else:
        assert {"layers.3.attn.k_cache", "layers.3.mlp.experts.down.input"} <= set(got.guidance)
        assert not any(s.startswith(("layers.0.", "layers.1.")) for s in got.guidance)
        for site, rec in got.guidance.items():
            want = ref.guidance[site]
            assert rec.shape == want.shape and rec.shape[:2] == tuple(got.tokens.shape)
            assert rec.device.type == torch.device(DEVICE).type
            assert rec.scales.dtype == torch.float8_e4m3fn and _on_device(rec.lsb) and rec.lsb.shape == want.lsb.shape
        assert got.guidance_bytes_per_token > 0
        # the trainer's guided forward consumes the records on the device
        with torch.no_grad():
            tr = trainer_forward(m_dev, got, alignment="trace", recipe=r, routing_replay=True)
        assert _on_device(tr.logp) and bool(torch.isfinite(tr.logp).all())
        assert tr.flips and all(f.total > 0 for f in tr.flips.values())


def _to_cpu(batch):
    """A RolloutBatch with tokens and masks on the CPU (enough for a CPU trainer forward, no records)."""
    from tracerl.rollout import RolloutBatch

    return RolloutBatch(tokens=batch.tokens.cpu(), attention_mask=batch.attention_mask.cpu(),
                        prompt_mask=batch.prompt_mask.cpu(), policy_mask=batch.policy_mask.cpu(),
                        logprobs=batch.logprobs.cpu(), prompt_index=batch.prompt_index.cpu())


@pytest.mark.skipif(DEVICE != "cuda", reason="counts CUDA host syncs")
@pytest.mark.parametrize("recipe", ["bf16", "w4a4kv4"])
def test_engine_decode_syncs_with_the_host_once_per_step(recipe):
    import warnings

    m = M.build("tiny", seed=0).to(DEVICE)
    eng = Engine(m, qat.Recipe(recipe), CachePolicy("fraction:0.5", "codes+scales", "lsb"), dtype=torch.bfloat16,
                 device=DEVICE)
    params = SamplingParams(max_new_tokens=12, n=2, stop=())
    # as in RL (run.deterministic): deterministic index kernels must not add syncs either
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        eng.generate(_prompts(4, seed=3), params, seed=0)  # compile the kernels first
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                b = eng.generate(_prompts(4, seed=3), params, seed=0)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.use_deterministic_algorithms(before)
    # the warning's location is the Python line that called the synchronizing op
    sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                if "called a synchronizing" in str(w.message))
    n = sum(sites.values())
    print(f"\n{recipe}: {n} host syncs for {params.max_new_tokens} decode steps: {sites.most_common()}")
    assert len(b.responses(0)) == params.max_new_tokens
    # one poll per step (+1 after the last forward) and a few around prefill and finalize
    assert n <= params.max_new_tokens + 1 + 6, sites.most_common(8)


@pytest.mark.parametrize("encoding", ["lsb", "ties", "codes"])
def test_micro_batch_select_on_cuda_slices_records_like_cpu(encoding):
    """RolloutBatch.select with device row indices (the trainer's micro-batches) == slicing on the CPU."""
    m = M.build("tiny", seed=1).to(DEVICE)
    eng = Engine(m, "w4a4kv4", CachePolicy("all", "codes+scales", encoding), device=DEVICE, diagnostics=True)
    b = eng.generate(_prompts(3, seed=2), SamplingParams(max_new_tokens=5, n=2), seed=1)
    for rows in (torch.tensor([1, 4, 5]), torch.tensor([True, False, False, True, True, False])):
        sub = b.select(rows.to(DEVICE))
        n = int(rows.sum()) if rows.dtype == torch.bool else len(rows)
        assert _on_device(sub.tokens) and len(sub) == n and sub.routing.batch_size == n
        for site, rec in b.guidance.items():
            mine, want = sub.guidance[site], rec.to("cpu").rows(rows)
            assert mine.device.type == torch.device(DEVICE).type and mine.shape == want.shape
            g1, g2 = mine.rounding_guide(), want.rounding_guide()
            for f in ("target", "bit", "mask", "scales", "global_scale"):
                assert _same_bits(getattr(g1, f), getattr(g2, f)), f"{site}.{f}"
        for site, q in b.reference.items():
            assert _same_bits(sub.reference[site].scales, fp4.select_rows(q.scales.cpu(), rows))
            assert _same_bits(sub.reference[site].codes, q.codes.cpu()[rows])


def test_grpo_advantages_on_cuda_equal_cpu():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 1.0, 0.25, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    for scale in (True, False):
        want = group_advantages(rewards, groups, scale=scale)
        got = group_advantages(rewards.to(DEVICE), groups.to(DEVICE), scale=scale)
        assert _on_device(got) and torch.allclose(got.cpu(), want, rtol=0, atol=1e-6)
    zv = zero_variance_groups(rewards.to(DEVICE), groups.to(DEVICE))
    assert zv.cpu().tolist() == [False, False, True, True, True, True, False, False]


# ----------------------------------------------------------------------------- (b) trainer

FAST = [
    "warm_start.steps=5", "warm_start.batch_size=8", "warm_start.examples=64", "train.steps=2",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8",
    "train.micro_batch_size=3", "train.compute_dtype=bfloat16", "train.routing_replay=true",
    "loss.kl_coef=0.01", "task.eval_prompts=4", "run.eval_every=1", "run.checkpoint_every=1",
    "run.tensorboard=false", f"run.device={DEVICE}",
]


@pytest.mark.parametrize("alignment", ["none", "qat", "trace"])
def test_trainer_step_on_cuda_with_routing_replay(tmp_path, alignment):
    cfg = load_config("configs/tiny-arith.yaml", [f"run.out_dir={tmp_path}", f"run.name={alignment}",
                                                   f"train.alignment={alignment}", *FAST])
    t = Trainer(cfg)
    assert t.device.type == torch.device(DEVICE).type and _on_device(next(t.model.parameters()))
    losses = t.warm_start()
    assert len(losses) == 5 and all(map(_finite, losses))
    m = t.train_step()  # micro-batches of 3 rows out of 8: device row indices slice every record
    missing = STEP_KEYS - set(m)
    assert not missing, f"metrics missing: {sorted(missing)}"
    assert all(_finite(v) for k, v in m.items() if isinstance(v, float)), m
    assert "eval/acc" in m and "kl/ref_k3" in m and any(k.startswith("flips/layer_") for k in m)
    assert (m["guidance/bytes_per_token"] > 0) == (alignment == "trace")
    assert all(_on_device(p) and p.dtype == torch.float32 for p in t.model.parameters())
    t.close()

    # the checkpoint (saved on CPU) resumes onto the device and trains on
    r = Trainer(cfg, resume=True)
    assert r.step == 1 and _on_device(next(r.model.parameters()))
    assert all(_on_device(v) for s in r.opt.state.values() for k, v in s.items() if k != "step")
    m2 = r.train_step()
    assert m2["step"] == 2 and _finite(m2["loss/policy"]) and _finite(m2["mismatch/kl_k3"])
    lines = (tmp_path / alignment / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    r.close()


@pytest.mark.skipif(DEVICE != "cuda", reason="the graph engine runs on CUDA")
@pytest.mark.parametrize("task", ["arith", "maze"])
def test_trainer_steps_with_the_graph_engine(tmp_path, task):
    # rollout.engine=graph: Triton kernels + CUDA-graph decode, records made inside the graph; the
    # guided trainer (all layers, codes) must follow those rollouts much closer than a BF16 trainer
    def run(name, extra):
        cfg = load_config("configs/tiny-arith.yaml", [f"run.out_dir={tmp_path}", f"run.name={name}",
                                                       f"task.name={task}", "rollout.engine=graph", *FAST, *extra])
        t = Trainer(cfg)
        t.warm_start()
        ms = [t.train_step(), t.train_step()]
        t.close()
        for m in ms:
            assert all(_finite(v) for k, v in m.items() if isinstance(v, float)), m
        return ms

    full = run("full", ["train.alignment=trace", "guidance.layers=all", "guidance.encoding=codes"])
    naive = run("naive", ["train.alignment=none"])
    assert all(m["flips/act_frac"] == 0.0 and m["guidance/bytes_per_token"] > 0 for m in full), full
    kl_full = sum(m["mismatch/kl_k3"] for m in full)
    kl_naive = sum(m["mismatch/kl_k3"] for m in naive)
    assert kl_full < kl_naive / 10, (kl_full, kl_naive)


def test_trainer_on_cuda_reproduces_warm_start_and_steps_bit_for_bit(tmp_path):
    # run.deterministic (default): on the H200 two warm starts of small/code differed by 4e-9 without it
    # (bench/determinism.py), and the suite's cached cells assume a config fixes its run
    from tracerl.experiments import state_digest

    def run(name):
        cfg = load_config("configs/tiny-arith.yaml", [f"run.out_dir={tmp_path}", f"run.name={name}",
                                                       "train.alignment=trace", "task.name=code", *FAST])
        t = Trainer(cfg)
        assert torch.are_deterministic_algorithms_enabled() == (t.device.type == "cuda")
        t.warm_start()
        warm = state_digest(t.model.state_dict())
        t.train_step()
        t.close()
        return warm, state_digest(t.model.state_dict())

    assert run("a") == run("b")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and v == v and abs(v) != float("inf")


# ----------------------------------------------------------------------------- (c) compare suite

MINI = f"""
base:
  model: {{preset: tiny}}
  rollout: {{prompts_per_step: 2, samples_per_prompt: 2, max_new_tokens: 6}}
  train: {{steps: 2, compute_dtype: bfloat16}}
  warm_start: {{steps: 3, batch_size: 4, examples: 16}}
  task: {{eval_prompts: 4}}
  run: {{device: {DEVICE}}}
tasks:
  arith: []
seeds: [0]
rows: [bf16, fp4-qat-r3, trace]
study_prompts: 2
study_samples: 2
"""


def test_mini_suite_on_cuda_writes_every_cell(tmp_path):
    from tracerl.experiments import run_suite

    configs = tmp_path / "configs"
    shutil.copytree("configs/compare", configs)
    (configs / "suite-mini.yaml").write_text(MINI)
    out = tmp_path / "reports"
    res = run_suite("mini", out, configs, log=lambda s: None)
    assert res["complete"] and res["missing"] == []
    on_disk = json.loads((out / "mini" / "results.json").read_text())
    assert set(on_disk["runs"]) == {"bf16/arith/0", "fp4-qat-r3/arith/0", "trace/arith/0"}
    assert set(on_disk["ptq"]) == {"arith/0"} and set(on_disk["study"]) == {"arith/bfloat16", "arith/float32"}
    for key, run in on_disk["runs"].items():
        assert [h["step"] for h in run["history"]] == [1, 2], key
        assert all(_finite(h["mismatch/kl_k3"]) and _finite(h["loss/policy"]) for h in run["history"]), key
        assert 0.0 <= run["final_eval"]["eval/acc"] <= 1.0
    for dt, study in on_disk["study"].items():
        assert set(study["alignments"]) == {"none", "qat", "qat-r3", "trace", "trace-full"}, dt
        assert len(study["sweep"]) == 9 and all(_finite(s["mismatch/kl_k3"]) for s in study["sweep"]), dt
