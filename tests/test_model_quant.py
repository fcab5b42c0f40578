"""tracerl.model with quant handlers: site names and layouts, fake-quant equals explicit FP4, STE gradients, PackedWeights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tracerl import fp4, qat
from tracerl import model as M
from tracerl.qat import FakeQuant, Recipe

B, S = 2, 6


@pytest.fixture(scope="module")
def tiny():
    return M.build("tiny", seed=0, init_std=0.1)


def _ids(seed=0):
    return torch.randint(3, 128, (B, S), generator=torch.Generator().manual_seed(seed))


def expected_sites(n_layers: int, dense: tuple[int, ...] = ()) -> set[str]:
    """The site list of the model contract, written out independently of the model."""
    out = {"lm_head.input", "lm_head.weight"}
    for i in range(n_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out |= {f"layers.{i}.attn.{proj}.input", f"layers.{i}.attn.{proj}.weight"}
        out |= {f"layers.{i}.attn.k_cache", f"layers.{i}.attn.v_cache"}
        if i in dense:
            out |= {f"layers.{i}.mlp.{n}.{k}" for n in ("gate_up", "down") for k in ("input", "weight")}
        else:
            out |= {f"layers.{i}.mlp.router.input", f"layers.{i}.mlp.router.weight"}
            out |= {f"layers.{i}.mlp.experts.{n}.{k}" for n in ("gate_up", "down") for k in ("input", "weight")}
    return out


class Spy:
    """Records every call (site, kind, tensor); passes tensors through."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, torch.Tensor]] = []

    def weight(self, site, w):
        self.calls.append((site, "weight", w.detach()))
        return w

    def act(self, site, x):
        self.calls.append((site, "act", x.detach()))
        return x

    def get(self, site):
        hits = [t for s, _, t in self.calls if s == site]
        assert len(hits) == 1, f"{site} called {len(hits)} times"
        return hits[0]


# ----------------------------------------------------------------------------- sites


@pytest.mark.parametrize("dense", [(), (1,)])
def test_site_names_and_layouts(dense):
    m = M.build("tiny", seed=0, dense_layers=dense, dense_size=96 if dense else 0)
    spy = Spy()
    with torch.no_grad():
        out = m(_ids(), quant=spy, return_routing=True)
    sites = [s for s, _, _ in spy.calls]
    assert len(sites) == len(set(sites)), "a site was called twice in one forward"
    assert set(sites) == expected_sites(4, dense)
    assert m.site_names() == sites  # documented in call order
    D, K, Fw, H, Dh = 128, 2, 128, 2, 32
    for i in range(4):
        for proj in "qkv":
            assert spy.get(f"layers.{i}.attn.{proj}_proj.input").shape == (B, S, D)
        assert spy.get(f"layers.{i}.attn.o_proj.input").shape == (B, S, 4 * Dh)
        assert spy.get(f"layers.{i}.attn.k_cache").shape == (B, S, H, Dh)
        assert spy.get(f"layers.{i}.attn.v_cache").shape == (B, S, H, Dh)
        if i in dense:
            assert spy.get(f"layers.{i}.mlp.gate_up.input").shape == (B, S, D)
            assert spy.get(f"layers.{i}.mlp.down.input").shape == (B, S, 96)
            continue
        assert spy.get(f"layers.{i}.mlp.router.input").shape == (B, S, D)
        assert spy.get(f"layers.{i}.mlp.experts.gate_up.input").shape == (B, S, D)  # once per token
        assert spy.get(f"layers.{i}.mlp.experts.gate_up.weight").shape == (8, 2 * Fw, D)
        assert spy.get(f"layers.{i}.mlp.experts.down.weight").shape == (8, D, Fw)
        # the down input is in the token's top-k slot order: check it against the definition
        x = spy.get(f"layers.{i}.mlp.experts.gate_up.input")
        h = spy.get(f"layers.{i}.mlp.experts.down.input")
        assert h.shape == (B, S, K, Fw)
        ids = out.routing.layer(i).long()
        w_gu = m.layers[i].mlp.experts.w_gate_up.detach()
        for b in range(B):
            for s in range(S):
                for k in range(K):
                    gate, up = (w_gu[ids[b, s, k]] @ x[b, s]).chunk(2)
                    torch.testing.assert_close(h[b, s, k], F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_recipe_parse_name_and_site_set():
    assert Recipe.parse("w4a4kv4") == Recipe("w4a4kv4")
    assert Recipe.parse("w4a4kv4:all-linear") == Recipe("w4a4kv4", sites="all-linear")
    with pytest.raises(ValueError, match="unknown site set 'attn'"):
        Recipe.parse("w4a16:attn")
    with pytest.raises(ValueError, match="unknown precision recipe 'w8a8'"):
        Recipe.parse("w8a8:all-linear")


def test_recipe_site_selection_on_model_sites(tiny):
    sites = tiny.site_names()
    experts = {s for s in sites if ".mlp.experts." in s}
    kv = {s for s in sites if s.endswith(("k_cache", "v_cache"))}
    assert {s for s in sites if Recipe("w4a4").quantizes(s)} == experts
    assert {s for s in sites if Recipe("w4a16").quantizes(s)} == {s for s in experts if s.endswith(".weight")}
    assert {s for s in sites if Recipe("w4a4kv4").quantizes(s)} == experts | kv
    all_linear = {s for s in sites if Recipe("w4a4", sites="all-linear").quantizes(s)}
    assert all_linear == {s for s in sites if ".attn." in s or ".experts." in s} - kv
    assert not any(".router." in s or s.startswith("lm_head") for s in all_linear)
    # regression: matching is on whole names, so the router ("mlp.gate" in HF) never catches gate_up
    dense = M.build("tiny", dense_layers=(1,), dense_size=64)
    r = Recipe("w4a4", sites="all-linear", exempt=("layers.*.mlp.gate", "layers.*.mlp.gate.*"))
    assert r.quantizes("layers.1.mlp.gate_up.weight") and r.quantizes("layers.1.mlp.gate_up.input")
    assert r.quantizes("layers.0.mlp.experts.gate_up.weight")
    assert not Recipe("w4a4").quantizes("layers.1.mlp.gate_up.weight")  # dense MLP is not an expert
    assert "layers.1.mlp.gate_up.weight" in dense.site_names()


# ----------------------------------------------------------------------------- fake quant == explicit FP4


class ExplicitFP4:
    """Quantize exactly the given sites with tracerl.fp4 directly (no qat helpers)."""

    def __init__(self, sites: set[str], fmt: str = "nvfp4") -> None:
        self.sites, self.fmt = sites, fmt

    def _w(self, w, gs):
        return fp4.dequantize(fp4.quantize(w, self.fmt, global_scale=gs), w.dtype)

    def weight(self, site, w):
        if site not in self.sites:
            return w
        if self.fmt == "mxfp4":
            return self._w(w, None)
        if w.dim() == 3:  # stacked experts: one global scale per expert matrix
            return torch.stack([self._w(w[e], fp4.nvfp4_global_scale(w[e])) for e in range(w.shape[0])])
        return self._w(w, fp4.nvfp4_global_scale(w))

    def weight_group(self, items):
        ws = [w for s, w in items if s in self.sites]
        gs = fp4.nvfp4_global_scale(torch.cat([w.reshape(-1) for w in ws])) if ws and self.fmt == "nvfp4" else None
        return [self._w(w, gs) if s in self.sites else w for s, w in items]

    def act(self, site, x):
        if site not in self.sites:
            return x
        return fp4.dequantize(fp4.quantize(x, self.fmt, per_row_global=True), x.dtype)


@pytest.mark.parametrize("recipe, dtype", [
    (Recipe("w4a4kv4"), torch.float32),
    (Recipe("w4a4kv4"), torch.bfloat16),
    (Recipe("w4a4", sites="all-linear"), torch.bfloat16),
    (Recipe("w4a4kv4", fmt="mxfp4", sites="all-linear"), torch.float32),
])
@torch.no_grad()
def test_fake_quant_forward_equals_explicit_fp4(tiny, recipe, dtype):
    ids = _ids(1)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :2] = 0
    sites = {s for s in expected_sites(4) if ".experts." in s or (recipe.kv and s.endswith("_cache"))}
    if recipe.sites == "all-linear":
        sites |= {s for s in expected_sites(4) if ".attn." in s and not s.endswith("_cache")}
    fq = tiny(ids, mask, quant=FakeQuant(recipe), compute_dtype=dtype, return_routing=True)
    ex = tiny(ids, mask, quant=ExplicitFP4(sites, recipe.fmt), compute_dtype=dtype, return_routing=True)
    plain = tiny(ids, mask, compute_dtype=dtype)
    assert torch.equal(fq.logits, ex.logits)
    assert torch.equal(fq.routing.expert_ids, ex.routing.expert_ids)
    assert not torch.allclose(fq.logits, plain, atol=1e-3)  # FP4 does change the numbers


# ----------------------------------------------------------------------------- gradients


class RetainingFakeQuant(FakeQuant):
    """FakeQuant that keeps the fake-quantized weight of one site to read its gradient."""

    def __init__(self, recipe, site):
        super().__init__(recipe)
        self.site, self.kept = site, None

    def weight(self, site, w):
        out = super().weight(site, w)
        if site == self.site:
            out.retain_grad()
            self.kept = out
        return out


def test_ste_gradients_reach_master_weights(tiny):
    ids = _ids(2)
    site = "layers.1.mlp.experts.gate_up.weight"
    h = RetainingFakeQuant(Recipe("w4a4kv4"), site)
    tiny.zero_grad()
    out = tiny(ids, quant=h, return_routing=True)
    out.logits.logsumexp(-1).mean().backward()
    master = tiny.layers[1].mlp.experts.w_gate_up
    assert h.kept is not None and not torch.equal(h.kept.detach(), master.detach())  # it was quantized
    # straight-through: d loss / d master == d loss / d (fake-quantized weight), except where the
    # scaled weight lies beyond +-6 (an e4m3 block scale rounded down) and the quantizer clamps it
    w = master.detach()
    q = qat.quantize_weight(w, "nvfp4")
    mult = fp4.block_scale_values(q.scales, q.global_scale, "nvfp4")  # (E, 2F, D/16)
    inside = (w.reshape(*mult.shape, 16).abs() / mult.unsqueeze(-1) <= fp4.E2M1_MAX).reshape(w.shape)
    assert bool(inside.float().mean() > 0.9)
    assert torch.equal(master.grad, h.kept.grad * inside)
    assert float(master.grad.abs().sum()) > 0
    for name in ("layers.1.mlp.experts.w_down", "layers.1.mlp.router.weight", "layers.0.attn.k_proj.weight",
                 "embed.weight"):
        g = dict(tiny.named_parameters())[name].grad
        assert g is not None and torch.isfinite(g).all() and float(g.abs().sum()) > 0, name
    # under routing replay with fake quant (fp32 masters, bf16 compute), the router still learns
    tiny.zero_grad()
    out2 = tiny(ids, quant=FakeQuant(Recipe("w4a4kv4")), routing_replay=out.routing, compute_dtype=torch.bfloat16)
    out2.logsumexp(-1).mean().backward()
    for i in range(4):
        g = tiny.layers[i].mlp.router.weight.grad
        assert g.dtype == torch.float32 and float(g.abs().sum()) > 0
    tiny.zero_grad()


# ----------------------------------------------------------------------------- PackedWeights


@pytest.mark.parametrize("recipe", [Recipe("w4a4"), Recipe("w4a16", sites="all-linear"), Recipe("w4a4", fmt="mxfp4")])
def test_pack_weights_bit_identical_to_fake_quant(tiny, recipe):
    packed = tiny.pack_weights(recipe)
    assert packed.dtype == torch.bfloat16 and packed.recipe == recipe
    params = dict(tiny.named_parameters())
    sites = tiny.weight_sites()
    fq = FakeQuant(recipe)
    quantized = {s for s in sites if recipe.quantizes(s)}
    assert set(packed.quantized_names) == quantized
    expected_keys = set(sites) | {n for n in params if n not in sites.values()} | {"embed.weight"}
    assert set(packed.keys()) == expected_keys
    with torch.no_grad():
        for i in range(4):  # q/k/v through the fused-group path, the rest one by one
            group = [(f"layers.{i}.attn.{n}_proj.weight", params[f"layers.{i}.attn.{n}_proj.weight"].to(torch.bfloat16))
                     for n in "qkv"]
            for (s, _), w in zip(group, qat.weight_group(fq, group)):
                assert torch.equal(packed.dequantized(s), w), s
        for s, p in sites.items():
            if s.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                continue  # checked as a group above
            want = fq.weight(s, params[p].to(torch.bfloat16))
            assert torch.equal(packed.dequantized(s), want), s
            assert isinstance(packed[s], fp4.FP4Tensor) == (s in quantized)
    # dense entries are copies, not views of the master weights
    assert packed["norm.weight"].data_ptr() != params["norm.weight"].data_ptr()
    assert torch.equal(packed["layers.0.attn_norm.weight"], params["layers.0.attn_norm.weight"].to(torch.bfloat16))
    if recipe.name == "w4a16" and recipe.sites == "all-linear":
        own_differs = False
        for i in range(4):
            ws = [params[f"layers.{i}.attn.{n}_proj.weight"].detach().to(torch.bfloat16) for n in "qkv"]
            gs = [packed[f"layers.{i}.attn.{n}_proj.weight"].global_scale for n in "qkv"]
            shared = qat.weight_global_scale(torch.cat(ws))  # 2688 / amax over q, k and v
            assert all(torch.equal(g, shared) for g in gs)  # shared, as vLLM needs for a fused qkv
            own_differs |= any(not torch.equal(qat.weight_global_scale(w), shared) for w in ws)
        assert own_differs  # so the sharing is not vacuous


def test_packed_weights_bytes_and_device(tiny):
    packed = tiny.pack_weights(Recipe("w4a16"))
    E, F2, D = 8, 256, 128
    q = packed["layers.0.mlp.experts.gate_up.weight"]
    assert q.codes.shape == (E, F2, D // 2) and q.scales.shape == (E, F2, D // 16) and q.global_scale.shape == (E, 1, 1)
    assert q.nbytes == E * F2 * D // 2 + E * F2 * D // 16 + E * 4
    n_fp4 = sum(packed[s].nbytes for s in packed.quantized_names)
    n_dense = sum(t.numel() * 2 for k, t in packed.items() if k not in packed.quantized_names)
    assert packed.nbytes == n_fp4 + n_dense
    bf16 = tiny.pack_weights(Recipe("bf16"))
    assert not bf16.quantized_names and bf16.nbytes == 2 * tiny.num_params()
    assert packed.nbytes < 0.45 * bf16.nbytes
    moved = packed.to("cpu")
    assert set(moved.keys()) == set(packed.keys()) and moved.nbytes == packed.nbytes
    with pytest.raises(KeyError, match="keyed by site name"):
        packed["layers.0.mlp.experts.w_gate_up"]


def test_packed_weights_drive_a_forward_like_the_engine(tiny):
    """A handler serving dequantized PackedWeights reproduces the trainer's FakeQuant forward (w4a16)."""
    recipe = Recipe("w4a16", sites="all-linear")
    packed = tiny.pack_weights(recipe)

    class Served:
        def weight(self, site, w):
            return packed.dequantized(site) if packed.is_quantized(site) else w

        def act(self, site, x):
            return x

    ids = _ids(3)
    with torch.no_grad():
        a = tiny(ids, quant=Served(), compute_dtype=torch.bfloat16)
        b = tiny(ids, quant=FakeQuant(recipe), compute_dtype=torch.bfloat16)
    assert torch.equal(a, b)


def test_tied_embeddings_pack_once():
    m = M.build("tiny", tie_word_embeddings=True)
    assert m.lm_head is None and m.weight_sites()["lm_head.weight"] == "embed.weight"
    packed = m.pack_weights(Recipe("w4a4"))
    assert packed["lm_head.weight"] is packed["embed.weight"]
    assert packed.nbytes == packed.to("cpu").nbytes
    spy = Spy()
    m(_ids(), quant=spy)
    assert spy.get("lm_head.weight").shape == (128, 128)
