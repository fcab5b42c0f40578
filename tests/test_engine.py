"""The rollout engine: incremental decode vs full-sequence forwards, FP4 paths, recording, errors."""

import pytest
import torch

from tracerl import fp4, qat
from tracerl import model as M
from tracerl.guidance import CachePolicy
from tracerl.rl.alignment import alignment_report, trainer_forward
from tracerl.rollout import Engine, FP4KVCache, SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return M.build("tiny", seed=0)


def _prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 99, (int(torch.randint(2, 11, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def test_greedy_bf16_recipe_matches_naive_full_forward_loop(tiny):
    prompts = _prompts()
    eng = Engine(tiny, "bf16", dtype=torch.float32)
    b = eng.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0), seed=0)
    for i, p in enumerate(prompts):
        seq = list(p)
        lps = []
        for _ in range(10):
            with torch.no_grad():
                logits = tiny(torch.tensor([seq]))[0, -1]
            tok = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            seq.append(tok)
        assert b.responses(i) == seq[len(p):]
        assert torch.allclose(torch.tensor(b.response_logprobs(i)), torch.tensor(lps), atol=1e-4)
        assert b.prompt(i) == p


def test_fp4_recipes_logprob_agreement_table_and_ordering(tiny):
    prompts = _prompts(8, seed=1)
    table = {}
    for recipe in ("bf16", "w4a16", "w4a4", "w4a4kv4"):
        r = qat.Recipe(recipe)
        eng = Engine(tiny, r)
        b = eng.generate(prompts, SamplingParams(max_new_tokens=20, n=2), seed=3)
        # the trainer's full-sequence forward in the same precision (fake-quant, RTN)
        al = "none" if recipe == "bf16" else "qat"
        with torch.no_grad():
            fw = trainer_forward(tiny, b, alignment=al, recipe=r, routing_replay=False)
        diff = (fw.logp - b.logprobs)[b.policy_mask].abs()
        naive = alignment_report(tiny, b, alignment="none", recipe=r, routing_replay=False)
        table[recipe] = (float(diff.max()), float(diff.mean()), naive["mismatch/kl_k3"])
    print("\nrecipe   max|dlogp| (same-precision trainer)   mean|dlogp|   kl_k3 vs BF16 trainer")
    for k, (mx, mean, kl) in table.items():
        print(f"{k:8s} {mx:10.4f} {mean:12.5f} {kl:14.3e}")
    # measured on the tiny preset: per-token |dlogp| stays below 0.5 nats even for w4a4kv4
    assert all(mx < 0.5 for mx, _, _ in table.values())
    # a BF16 trainer sees the smallest mismatch against a BF16 rollout, larger against FP4 ones
    assert table["bf16"][2] < table["w4a16"][2] < table["w4a4kv4"][2]


def test_full_guidance_and_routing_replay_cut_kl_by_10x(tiny):
    prompts = _prompts(8, seed=2)
    r = qat.Recipe("w4a4kv4")
    eng = Engine(tiny, r, CachePolicy("all", fields="codes+scales", encoding="codes"), diagnostics=True)
    b = eng.generate(prompts, SamplingParams(max_new_tokens=24, n=2), seed=5)
    plain = alignment_report(tiny, b, alignment="qat", recipe=r, routing_replay=False)
    traced = alignment_report(tiny, b, alignment="trace", recipe=r, routing_replay=True)
    factor = plain["mismatch/kl_k3"] / traced["mismatch/kl_k3"]
    print(f"\nkl_k3 qat {plain['mismatch/kl_k3']:.3e} -> trace {traced['mismatch/kl_k3']:.3e}: {factor:.0f}x; "
          f"flips {plain['flips/act_frac']:.4f} -> {traced['flips/act_frac']:.4f}")
    assert factor >= 10
    assert traced["flips/act_frac"] == 0.0 and plain["flips/act_frac"] > 0.01
    assert b.guidance_bytes_per_token > 0
    sites = set(b.guidance)
    assert "layers.0.attn.k_cache" in sites and "layers.3.mlp.experts.down.input" in sites


def test_fp4_kv_cache_stores_packed_codes_and_matches_fp4():
    c = FP4KVCache(n_layers=2, n_slots=3, max_len=8, n_kv_heads=2, head_dim=32, fmt="nvfp4", dtype=torch.float32)
    # codes: 16 B per (token, head); e4m3 scales 2 B; fp32 global scale 4 B; x2 for K and V
    assert c.nbytes == 2 * 2 * 3 * 8 * 2 * (16 + 2 + 4)
    k = torch.randn(3, 5, 2, 32)
    v = torch.randn(3, 5, 2, 32)
    c.set_step(torch.arange(3), 0)
    k_all, v_all = c.update(1, k, v)
    assert torch.equal(k_all, fp4.dequantize(fp4.quantize(k, "nvfp4", per_row_global=True), torch.float32))
    assert torch.equal(v_all, fp4.fake_quantize(v, "nvfp4", per_row_global=True))
    c.set_step(torch.tensor([0, 2]), 5)
    k2, _ = c.update(1, k[[0, 2], :1], v[[0, 2], :1])
    assert k2.shape == (2, 6, 2, 32)
    with pytest.raises(ValueError, match="overflow"):
        c.set_step(torch.arange(3), 7)
        c.update(0, k[:, :2], v[:, :2])


def test_groups_share_prefill_and_sampling_is_reproducible(tiny):
    eng = Engine(tiny, "w4a4kv4")
    prompts = _prompts(3, seed=4)
    p = SamplingParams(max_new_tokens=8, n=4)
    b1 = eng.generate(prompts, p, seed=11)
    b2 = eng.generate(prompts, p, seed=11)
    assert torch.equal(b1.tokens, b2.tokens) and torch.equal(b1.logprobs, b2.logprobs)
    assert len(b1) == 12 and b1.prompt_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert all(b1.prompt(i) == prompts[i // 4] for i in range(12))
    greedy = eng.generate(prompts, SamplingParams(max_new_tokens=8, n=3, temperature=0), seed=0)
    assert greedy.responses(0) == greedy.responses(1) == greedy.responses(2)


def test_stop_tokens_end_sequences_and_mask_the_rest(tiny):
    eng = Engine(tiny, "bf16", dtype=torch.float32)
    prompts = _prompts(4, seed=6)
    ref = eng.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0), seed=0)
    stop_tok = ref.responses(0)[2]
    b = eng.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, stop=(stop_tok,)), seed=0)
    r0 = b.responses(0)
    assert r0[-1] == stop_tok and stop_tok not in r0[:-1] and len(r0) <= 3
    assert bool(b.finished[0])
    # after a stop, the sequence has no more tokens (its columns are padding)
    last = int(b.attention_mask[0].nonzero().max())
    assert not b.attention_mask[0, last + 1:].any()
    assert all(len(b.responses(i)) <= 12 for i in range(4))


def test_multi_turn_continue_reuses_cache_and_masks_env_tokens(tiny):
    eng = Engine(tiny, "bf16", dtype=torch.float32)
    prompts = _prompts(3, seed=7)
    b = eng.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0, stop=(2,)), seed=0)
    env = [[40, 41, 42], None, [50]]
    b2 = eng.continue_(b, env, SamplingParams(max_new_tokens=4, temperature=0), seed=0)
    for i in (0, 2):
        seq = b2.sequence(i)
        assert seq[: len(b.sequence(i))] == b.sequence(i)
        # env tokens are in the sequence but not in the policy mask
        toks = b2.tokens[i][b2.attention_mask[i]].tolist()
        pol = b2.policy_mask[i][b2.attention_mask[i]].tolist()
        j = len(b.sequence(i))
        assert toks[j:j + len(env[i])] == env[i] and not any(pol[j:j + len(env[i])])
        assert sum(pol) == len(b.responses(i)) + 4
    assert b2.sequence(1) == b.sequence(1)  # ended sequences stay as they were
    # the cached continuation equals a full-sequence forward over the whole transcript
    fw = trainer_forward(tiny, b2, alignment="none", recipe=qat.Recipe("bf16"), routing_replay=False, compute_dtype=None)
    diff = (fw.logp - b2.logprobs)[b2.policy_mask].abs().max()
    assert diff < 1e-4


def test_continue_feeds_uneven_observations_in_one_forward_like_a_fresh_prompt(tiny):
    eng = Engine(tiny, "bf16", dtype=torch.float32)
    prompts = _prompts(4, seed=9)
    greedy = SamplingParams(max_new_tokens=3, temperature=0)
    b = eng.generate(prompts, greedy, seed=0)
    env = [[40, 41, 42, 43, 44, 45, 46], [50], None, []]  # uneven; [] = live, nothing to feed
    calls = []
    orig = eng._forward
    eng._forward = lambda st, rows, start, end: calls.append(end - start) or orig(st, rows, start, end)
    b2 = eng.continue_(b, env, greedy, seed=0)
    eng._forward = orig
    # one forward of 7 columns for every observation, then one per sampled token
    assert calls == [7, 1, 1, 1]
    for i in (0, 1, 3):
        transcript = b.sequence(i) + (env[i] or [])
        fresh = eng.generate([transcript], greedy, seed=0)
        assert b2.sequence(i) == transcript + fresh.responses(0)
        got = torch.tensor(b2.response_logprobs(i)[-3:])
        assert torch.allclose(got, torch.tensor(fresh.response_logprobs(0)), atol=1e-4)
    assert b2.sequence(2) == b.sequence(2)
    with pytest.raises(ValueError, match=r"appended\[1\] has token ids outside"):
        eng.continue_(b2, [[1], [999], None, None], greedy)


def test_guidance_recorded_for_a_multi_turn_batch_aligns_the_trainer(tiny):
    r = qat.Recipe("w4a4kv4")
    eng = Engine(tiny, r, CachePolicy("all", fields="codes+scales", encoding="codes"), diagnostics=True)
    p = SamplingParams(max_new_tokens=4, n=2, stop=(2,))
    b = eng.generate(_prompts(3, seed=10), p, seed=1)
    env = [[30 + i, 31, 32][: 1 + i % 3] for i in range(len(b))]
    b = eng.continue_(b, env, SamplingParams(max_new_tokens=4), seed=2)
    b = eng.continue_(b, [[60, 61]] * len(b), SamplingParams(max_new_tokens=4), seed=3)
    plain = alignment_report(tiny, b, alignment="qat", recipe=r, routing_replay=False)
    traced = alignment_report(tiny, b, alignment="trace", recipe=r, routing_replay=True)
    assert traced["flips/act_frac"] == 0.0 and plain["flips/act_frac"] > 0.01
    assert traced["mismatch/kl_k3"] < plain["mismatch/kl_k3"] / 10


def test_load_weights_swaps_without_requantizing(tiny):
    m2 = M.build("tiny", seed=1)
    eng = Engine(tiny, "w4a4")
    fresh = Engine(m2, "w4a4")
    eng.load_weights(m2.pack_weights(qat.Recipe("w4a4")))
    p = SamplingParams(max_new_tokens=6, temperature=0)
    prompts = _prompts(2, seed=8)
    assert torch.equal(eng.generate(prompts, p).tokens, fresh.generate(prompts, p).tokens)
    with pytest.raises(ValueError, match="packed for"):
        eng.load_weights(m2.pack_weights(qat.Recipe("w4a16")))


def test_bad_inputs_give_clear_errors(tiny):
    eng = Engine(tiny, "bf16")
    with pytest.raises(ValueError, match="at least one prompt"):
        eng.generate([])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        eng.generate([[1, 2], []])
    with pytest.raises(ValueError, match="exceeds the context"):
        eng.generate([[5] * 250], SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="n .samples per prompt"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="outside"):
        eng.generate([[1, 500]])


def test_nonfinite_weight_raises_clear_error_even_where_fp4_hides_it():
    # attention projections stay BF16 under `experts+kv`, so packing does not see this NaN; MXFP4
    # then turns the NaN block of V into finite codes (fallback scale 2**-127) and the logits stay
    # finite: only a per-site flag catches it (a logits-only check would return garbage tokens)
    bad = M.build("tiny", seed=0)
    with torch.no_grad():
        bad.layers[1].attn.v_proj.weight[5, 7] = float("nan")
    eng = Engine(bad, qat.Recipe("w4a4kv4", fmt="mxfp4"))
    with pytest.raises(ValueError, match=r"rollout prefill: activations became non-finite \(inf/NaN\) at "
                                         r"layers\.1\.attn\.v_cache;.*no tokens are returned.*checkpoint"):
        eng.generate(_prompts(3), SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize(("recipe", "temperature", "site"), [
    ("w4a4kv4", 1.0, r"layers\.3\.attn\.k_cache \(and \d+ later sites\)"),
    ("bf16", 0.0, "logits"),  # no quant site at all: the logits flag still stops greedy garbage
], ids=["w4a4kv4", "bf16-greedy"])
def test_inf_in_a_mid_layer_at_a_decode_step_raises_naming_the_step(tiny, recipe, temperature, site):
    eng = Engine(tiny, recipe)
    calls = []

    def inf_on_third_forward(module, args, out):
        calls.append(1)
        if len(calls) == 3:  # prefill, decode step 1, then decode step 2
            h, ids = out
            return h.index_fill(-1, torch.tensor([0]), float("inf")), ids
        return out

    eng.model.layers[2].register_forward_hook(inf_on_third_forward)
    p_len = max(len(p) for p in _prompts(4))
    with pytest.raises(ValueError, match=rf"rollout decode step 2 \(column {p_len + 1}\): activations became "
                                         rf"non-finite \(inf/NaN\) at {site};"):
        eng.generate(_prompts(4), SamplingParams(max_new_tokens=6, temperature=temperature))
    assert len(calls) == 3  # raised at the poll right after that forward, before sampling from it


_HOST_READS = ("__bool__", "__int__", "__float__", "item", "tolist", "cpu", "numpy")


def _host_reads(monkeypatch, eng: Engine, max_new_tokens: int) -> int:
    """Tensor->Python reads during one generate: each is a device->host sync on CUDA."""
    n = [0]

    def counted(f):
        def g(self, *a, **k):
            n[0] += 1
            return f(self, *a, **k)
        return g

    with monkeypatch.context() as mp:
        for name in _HOST_READS:
            mp.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
        eng.generate([[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=max_new_tokens, n=2), seed=0)
    return n[0]


@pytest.mark.parametrize("kind", ["w4a4kv4", "mxfp4-ties"])
def test_engine_finiteness_check_costs_no_host_sync_per_site(monkeypatch, kind):
    # the eager check was one sync per quantized activation / KV site and layer; the engine now
    # reads device-side flags in the host copy its decode loop makes anyway
    recipe = qat.Recipe("w4a4kv4", fmt="mxfp4" if kind == "mxfp4-ties" else "nvfp4")
    policy = CachePolicy("all", encoding="ties") if kind == "mxfp4-ties" else None  # on CUDA: the fp4.quantize path
    reads = {}
    for layers in (2, 6):
        eng = Engine(M.build("tiny", seed=0, num_layers=layers), recipe, policy)
        reads[layers] = [_host_reads(monkeypatch, eng, steps) for steps in (3, 7)]
    assert reads[2] == reads[6], reads  # independent of depth
    per_step = (reads[2][1] - reads[2][0]) / 4
    assert per_step <= 2, reads  # the loop's own reads: any active slot (+ the flags), running rows


def test_draw_equals_torch_multinomial_bit_for_bit():
    """The sync-free draw consumes the generator as multinomial does and picks the same indices."""
    from tracerl.rollout.sampling import draw

    g = torch.Generator().manual_seed(0)
    for seed in range(20):
        logits = torch.randn(64, 300, generator=g) * (1 + seed % 4)
        logits[:, ::7] = float("-inf")  # zero-probability tokens, as top-k / top-p leave them
        probs = torch.softmax(logits, -1)
        a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = torch.multinomial(probs, 1, generator=a).squeeze(-1)
        got = draw(probs, b)
        assert torch.equal(got, want), seed
        assert torch.equal(a.get_state(), b.get_state())  # the same random numbers were used
        assert not bool((got % 7 == 0).any())


def test_decode_steps_make_no_hidden_device_reads_and_copy_the_slot_list_only_when_it_changes(monkeypatch):
    # ops that read a device value inside ATen (multinomial checks its probabilities with an .item():
    # one sync per step on CUDA) are invisible to the Tensor-method count above; a dispatch mode sees
    # the op (not the read inside it), so it counts the ops known to synchronise
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    syncing = {aten._local_scalar_dense.default, aten.multinomial.default, aten.nonzero.default,
               aten.masked_select.default, aten.bincount.default, aten._unique2.default,
               aten.repeat_interleave.Tensor,
               # a tensor made from host data (`torch.tensor(...)`, `x[i] = True`): on CUDA a copy from
               # pageable memory, which synchronises
               aten.lift_fresh.default}

    class ScalarReads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ScalarReads.n += func in syncing
            return func(*args, **(kwargs or {}))

    eng = Engine(M.build("tiny", seed=0), "w4a4kv4")
    copies = []
    monkeypatch.setattr(eng, "_to_device", lambda ids, f=eng._to_device: copies.append(list(ids)) or f(ids))
    reads = {}
    for steps in (3, 9):
        ScalarReads.n, copies[:] = 0, []
        with ScalarReads():
            eng.generate([[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=steps, n=2), seed=0)
        reads[steps] = ScalarReads.n
        assert copies == [[0, 1, 2, 3]]  # no stop token: the running slots never change
    assert reads[3] == reads[9], reads
    # a row that stops changes the slot list: one copy per change
    copies[:] = []
    b = eng.generate([[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=12, n=2, stop=tuple(range(64))), seed=0)
    lengths = [len(b.responses(i)) for i in range(4)]
    changes = {n for n in lengths if n < max(lengths)}  # steps after which some rows stopped and others ran on
    assert changes, lengths  # the stop set must end some rows early for this check to mean anything
    assert len(copies) == 1 + len(changes) and all(len(c) < 4 for c in copies[1:]), (copies, lengths)
