"""GPUDecoder: a standalone GPU decode backend for the MoE model, FP4 weights/activations/KV kept packed.

`rollout.Engine` keeps the CPU-reference path; `rollout.graph_engine.GraphEngine` runs RL rollouts
on this decoder (forced tokens, stops and recording added to the captured step through the
`_sink` / `_kv_sink` / `_observe_routing` / `_advance` hooks). On its own it measures and serves decode speed:

    w = DecoderWeights.from_packed(model.config, model.pack_weights(Recipe("w4a4kv4")), device="cuda")
    dec = GPUDecoder(w, batch=256, max_len=2048, temperature=1.0)
    dec.prefill(prompts)                 # (B, P) token ids, teacher-forced one column per step
    toks, logps = dec.decode(128)        # (B, 128) sampled tokens and their logprobs
    # or, for benchmarks: DecoderWeights.random(cfg, recipe) and dec.fill_random(ctx_len)

Static batch slots: row b of every buffer and of the KV cache belongs to sequence b; each step
feeds one token per row at column pos[b] (rows advance in lockstep; no padding, no early stop).
On CUDA one decode step (all layers, lm_head and sampling) is captured once as a CUDA graph
and replayed; sampling (Gumbel-max with Triton's Philox, from the step counter) and the
position update run inside the graph, so `decode(n)` synchronises with the host once.

Per layer (B rows, K experts per token): fused residual-add + RMSNorm (Triton); q/k/v in one
BF16 GEMM (FP4 `fp4_linear` when the recipe quantizes attention); per-head q/k norm + RoPE + K/V
store (Triton); for an FP4 cache the new K/V are quantized by `kernels.quantize` (bit-exact with
fp4.quantize, per-row global scales) and copied into the FP4KVCache layout (swizzled where
`fp4_attention.kv_swizzle_check` passes: `kv_swizzled`, codes as the GEMM's weights); split-KV decode
attention (`kernels.fp4_attention`); o_proj; router logits in float32 (BF16 products, exact, summed in
float32: a tensor-core GEMM with a float32 output where this torch has one); top-k + stable dispatch
(Triton); the two grouped expert GEMMs (`kernels.fp4_gemm`: FP4 weights dequantized in
registers, SwiGLU fused into gate_up, gate weight + scatter fused into down); w4a4 quantizes
each expert input per row with `kernels.quantize` first.

Numerics follow the model's BF16 ops (roundings after each op) but are not bit-identical with
the CPU engine: weight values enter the dot as exact c * s8 with 1/gs applied to the float32
accumulator, attention feeds P to the PV dot in BF16, accumulation orders differ, and the logits
are a BF16 x BF16 GEMM with float32 output (the model upcasts lm_head to float32). The test
compares against the model's teacher-forced logits with a stated tolerance.

Unsupported (raise): qk_norm 'full', clip_qkv, dense (non-MoE) layers, MXFP4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tracerl import fp4, kernels, qat
from tracerl.kernels import fp4_attention as fa
from tracerl.kernels import fp4_gemm as fg
from tracerl.kernels import fp4_swizzle, pdl
from tracerl.kernels.fp4_gemm import _bf16
from tracerl.kernels.record_sink import RecordSink
from tracerl.model.config import ModelConfig
from tracerl.model.layers import rope_cos_sin
from tracerl.rollout.kvcache import DenseKVCache, FP4KVCache

# ----------------------------------------------------------------------------- small fused kernels


@triton.jit
def _add_rmsnorm_kernel(x_ptr, d_ptr, g_ptr, w_ptr, h_ptr, eps, D: tl.constexpr, BD: tl.constexpr,
                        DELTA: tl.constexpr, KD: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr = False):
    """x += delta (BF16 (B, D), or (B, KD, D) summed over KD first: float32, or BF16 times the gates
    (B, KD) float32 if GATED); h = RMSNorm(x) * w."""
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BD)
    m = i < D
    x = tl.load(x_ptr + b * D + i, mask=m, other=0.0).to(tl.float32)
    if DELTA == 1:
        x = _bf16(x + tl.load(d_ptr + b * D + i, mask=m, other=0.0).to(tl.float32)).to(tl.float32)
        tl.store(x_ptr + b * D + i, x.to(tl.bfloat16), mask=m)
    if DELTA == 2:
        acc = tl.zeros((BD,), tl.float32)
        for k in tl.static_range(KD):
            d = tl.load(d_ptr + (b * KD + k) * D + i, mask=m, other=0.0).to(tl.float32)
            if GATED:
                d = d * tl.load(g_ptr + b * KD + k)
            acc += d
        x = _bf16(x + _bf16(acc).to(tl.float32)).to(tl.float32)
        tl.store(x_ptr + b * D + i, x.to(tl.bfloat16), mask=m)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    h = _bf16(_bf16(x * r).to(tl.float32) * tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32))
    tl.store(h_ptr + b * D + i, h, mask=m)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float, h: torch.Tensor,
                gates: torch.Tensor | None = None) -> None:
    """In place: x (B, D) BF16 += delta; h = RMSNorm(x) * w (BF16). delta: BF16 (B, D), or the experts'
    outputs (B, K, D), summed over K in float32 and rounded to BF16 first, as model/moe.py's combine:
    float32 products already gated, or BF16 outputs times `gates` (B, K) float32 here (the same
    float32 products, from half the bytes)."""
    B, D = x.shape
    mode, kd = 0, 1
    if delta is not None:
        mode, kd = (2, delta.shape[1]) if delta.dim() == 3 else (1, 1)
    if gates is not None:
        if mode != 2 or delta.dtype != torch.bfloat16 or tuple(gates.shape) != (B, kd) or \
                gates.dtype != torch.float32 or not gates.is_contiguous():
            raise ValueError(f"gates go with BF16 expert outputs (B, K, D): contiguous float32 ({B}, {kd}), got "
                             f"{gates.dtype} {tuple(gates.shape)} for delta {None if delta is None else delta.dtype}")
    elif mode == 2 and delta.dtype != torch.float32:
        raise ValueError("expert outputs (B, K, D) without gates must be float32 (already gated)")
    if B:
        _add_rmsnorm_kernel[(B,)](x, delta if delta is not None else x, gates if gates is not None else x, w, h, eps,
                                  D=D, BD=triton.next_power_of_2(D), DELTA=mode, KD=kd, GATED=gates is not None,
                                  num_warps=4, **pdl.launch(x.device))


@triton.jit
def _sample_kernel(logits_ptr, sl, V, VQ, SPAN, seed_ptr, tok_ptr, lp_ptr, part_ptr, parti_ptr, inv_t,
                   GREEDY: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False):
    """Row b, vocabulary span c (program (b, c)): token = argmax(z + Gumbel) (argmax z if GREEDY), z =
    logits / T; logprob = log_softmax(z)[token]. SPLIT: store the span's (max z, sum exp(z - max),
    best key, its index) for `_sample_merge_kernel`; else the span is the whole row and the token and
    logprob are stored here. The uniforms come four to a Philox call (`rand4x`, counter b * VQ + v // 4:
    an element's draw does not depend on the split): one call an element was most of the kernel's
    instructions (1.7 ms of a 1776-row step over a 152k vocabulary on the H100)."""
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    seed = tl.load(seed_ptr)
    row = logits_ptr + b * sl
    m = tl.max(tl.full((BV,), float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros((BV,), tl.float32), axis=0)
    best = m
    best_i = tl.sum(tl.zeros((BV,), tl.int32), axis=0)
    v0 = c * SPAN
    v_end = tl.minimum(V, v0 + SPAN)
    while v0 < v_end:
        v = v0 + tl.arange(0, BV)
        msk = v < V  # (SPAN is a multiple of BV: only the row's last tile is ragged)
        z = tl.load(row + v, mask=msk, other=float("-inf")).to(tl.float32) * inv_t
        mn = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - mn) + tl.sum(tl.where(msk, tl.exp(z - mn), 0.0), axis=0)
        m = mn
        if GREEDY:
            key = z
        else:
            u0, u1, u2, u3 = tl.rand4x(seed, (b * VQ + v0 // 4 + tl.arange(0, BV // 4)).to(tl.int32))
            u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), (BV,))
            key = z - tl.log(-tl.log(u))
        key = tl.where(msk, key, float("-inf"))
        cm = tl.max(key, axis=0)
        ci = tl.argmax(key, axis=0).to(tl.int32) + v0
        better = cm > best
        best_i = tl.where(better, ci, best_i)
        best = tl.where(better, cm, best)
        v0 += BV
    if SPLIT:
        ns = tl.num_programs(1)
        p = part_ptr + (b * ns + c) * 3
        tl.store(p, m)
        tl.store(p + 1, s)
        tl.store(p + 2, best)
        tl.store(parti_ptr + b * ns + c, best_i)
    else:
        zt = tl.load(row + best_i).to(tl.float32) * inv_t
        tl.store(tok_ptr + b, best_i.to(tl.int64))
        tl.store(lp_ptr + b, zt - (m + tl.log(s)))


@triton.jit
def _sample_merge_kernel(logits_ptr, sl, part_ptr, parti_ptr, NS, tok_ptr, lp_ptr, inv_t, NSP: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Row b: the spans' partials -> token (the first span's best on a tie, as one sequential pass) and
    logprob (the spans' log-sum-exp merged)."""
    pdl.start(PDL)  # first: nothing is read or written before the previous grid is done
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NSP)
    mj = j < NS
    p = part_ptr + (b * NS + j) * 3
    m = tl.load(p, mask=mj, other=float("-inf"))
    s = tl.load(p + 1, mask=mj, other=0.0)
    key = tl.load(p + 2, mask=mj, other=float("-inf"))
    idx = tl.load(parti_ptr + b * NS + j, mask=mj, other=0)
    mx = tl.max(m, axis=0)
    tot = tl.sum(tl.where(mj, s * tl.exp(m - mx), 0.0), axis=0)
    jb = tl.argmax(key, axis=0)
    best_i = tl.sum(tl.where(j == jb, idx, 0), axis=0)
    zt = tl.load(logits_ptr + b * sl + best_i).to(tl.float32) * inv_t
    tl.store(tok_ptr + b, best_i.to(tl.int64))
    tl.store(lp_ptr + b, zt - (mx + tl.log(tot)))


# split each row's vocabulary over programs until about this many programs per SM run (a small batch
# has one program a row otherwise: 16 rows x 38 serial 4096-element tiles of a 152k vocabulary)
SAMPLE_PROGRAMS_PER_SM = 4


def _vocab_tile(V: int) -> int:
    """Elements of the vocabulary a sampler program takes per step (the draws depend on v // 4 and
    v % 4, not on it)."""
    return min(4096, max(16, triton.next_power_of_2(V)))


def sample_splits(B: int, V: int, device: torch.device) -> int:
    """Vocabulary spans per row `sample_tokens` uses by default (1: one program a row, no merge)."""
    if SAMPLE_PROGRAMS_PER_SM <= 0 or B == 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(triton.cdiv(V, _vocab_tile(V)), triton.cdiv(SAMPLE_PROGRAMS_PER_SM * sms, B)))


def sample_tokens(logits: torch.Tensor, temperature: float, seed: torch.Tensor, tokens: torch.Tensor,
                  logprobs: torch.Tensor, splits: int | None = None) -> None:
    """Sample one token per row of logits (B, V) into tokens (B,) int64 and logprobs (B,) float32.

    temperature 0 is greedy. The tempered distribution is the engine's (rollout/sampling.py);
    the random stream is Triton's Philox keyed by `seed` (int64 (1,) on the device) and the row.
    `splits`: vocabulary spans a row (default `sample_splits`); the tokens do not depend on it.
    """
    B, V = logits.shape
    bv = _vocab_tile(V)
    if not B:
        return
    nt = triton.cdiv(V, bv)
    ns = sample_splits(B, V, logits.device) if splits is None else splits
    if ns < 1:
        raise ValueError(f"splits must be >= 1, got {ns}")
    span = triton.cdiv(nt, min(ns, nt)) * bv
    ns = triton.cdiv(V, span)
    part = torch.empty(B, ns, 3, dtype=torch.float32, device=logits.device) if ns > 1 else logprobs
    parti = torch.empty(B, ns, dtype=torch.int32, device=logits.device) if ns > 1 else logprobs
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    _sample_kernel[(B, ns)](logits, logits.stride(0), V, triton.cdiv(V, 4), span, seed, tokens, logprobs, part, parti,
                            inv_t, GREEDY=temperature == 0, BV=bv, SPLIT=ns > 1, num_warps=8 if bv >= 4096 else 4,
                            **pdl.launch(logits.device))
    if ns > 1:
        _sample_merge_kernel[(B,)](logits, logits.stride(0), part, parti, ns, tokens, logprobs, inv_t,
                                   NSP=triton.next_power_of_2(ns), num_warps=1, **pdl.launch(logits.device))


# ----------------------------------------------------------------------------- weights


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    wqkv: torch.Tensor | fp4.FP4Tensor  # (H*Dh + 2*Hkv*Dh, D): q, k, v rows
    wo: torch.Tensor | fp4.FP4Tensor
    qk_norm: torch.Tensor | None  # (2, Dh): q_norm, k_norm
    router: torch.Tensor  # (E, D) BF16: the model's router weight (its logits are float32 sums)
    gate_up: torch.Tensor | fp4.FP4Tensor  # (E, 2F, D)
    down: torch.Tensor | fp4.FP4Tensor  # (E, D, F)


@dataclass
class DecoderWeights:
    """The weights a GPUDecoder runs with, in its layout (built once per recipe, shared by decoders)."""

    cfg: ModelConfig
    recipe: qat.Recipe
    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    layers: list[LayerWeights] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def nbytes(self) -> int:
        """Bytes held (tied embeddings once)."""
        seen, n = set(), 0
        tensors = [self.embed, self.lm_head, self.final_norm]
        for lw in self.layers:
            tensors += [getattr(lw, f) for f in LayerWeights.__dataclass_fields__]
        for t in tensors:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            n += t.nbytes if isinstance(t, fp4.FP4Tensor) else t.numel() * t.element_size()
        return n

    @staticmethod
    def _check(cfg: ModelConfig, recipe: qat.Recipe) -> None:
        if cfg.qk_norm == "full" or cfg.clip_qkv is not None or cfg.dense_layers:
            raise NotImplementedError("GPUDecoder supports qk_norm 'head'/'none', no clip_qkv, MoE layers only")
        if recipe.weights and recipe.fmt != "nvfp4":
            raise NotImplementedError("GPUDecoder's kernels take NVFP4 (blocks of 16, E4M3 scales)")

    @classmethod
    def from_packed(cls, cfg: ModelConfig, packed, device: torch.device | str = "cuda") -> DecoderWeights:
        """From PackedWeights (model.pack_weights(recipe)): FP4 entries stay packed, moved to `device`."""
        recipe = packed.recipe
        cls._check(cfg, recipe)

        def get(name, dtype=torch.bfloat16):
            t = packed[name]
            return t.to(device) if isinstance(t, fp4.FP4Tensor) else t.to(device=device, dtype=dtype)

        layers = []
        for i in range(cfg.num_layers):
            a = f"layers.{i}.attn"
            qkv = [get(f"{a}.{n}_proj.weight") for n in "qkv"]
            if isinstance(qkv[0], fp4.FP4Tensor):  # one shared global scale (packed.qkv_groups)
                O = sum(q.shape[0] for q in qkv)
                wqkv = fp4.FP4Tensor(torch.cat([q.codes for q in qkv]), torch.cat([q.scales for q in qkv]),
                                     qkv[0].global_scale, "nvfp4", torch.Size((O, cfg.hidden_size)))
            else:
                wqkv = torch.cat(qkv)
            qk = None
            if cfg.qk_norm == "head":
                qk = torch.stack([get(f"{a}.q_norm.weight"), get(f"{a}.k_norm.weight")])
            layers.append(LayerWeights(
                attn_norm=get(f"layers.{i}.attn_norm.weight"), mlp_norm=get(f"layers.{i}.mlp_norm.weight"),
                wqkv=wqkv, wo=get(f"{a}.o_proj.weight"), qk_norm=qk,
                router=get(f"layers.{i}.mlp.router.weight").contiguous(),
                gate_up=get(f"layers.{i}.mlp.experts.gate_up.weight"),
                down=get(f"layers.{i}.mlp.experts.down.weight"),
            ))
        embed = get("embed.weight")
        head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
        return cls(cfg, recipe, embed, head, get("norm.weight"), _for_kernels(layers))

    @classmethod
    @torch.no_grad()
    def random(cls, cfg: ModelConfig, recipe: qat.Recipe, device: torch.device | str = "cuda",
               seed: int = 0) -> DecoderWeights:
        """Random N(0, init_std) weights built layer by layer on `device` (never a full BF16 copy
        of the FP4 parts): for benchmarks at real sizes (qwen3-30b-a3b) without a 120 GB model."""
        cls._check(cfg, recipe)
        g = torch.Generator(device=device).manual_seed(seed)
        D, E, Fw, Dh = cfg.hidden_size, cfg.num_experts, cfg.expert_size, cfg.head_dim

        def rnd(*shape):
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * cfg.init_std).bfloat16()

        def maybe_fp4(site, w):
            return quantize_weight(w) if recipe.quantizes(site) else w

        ones = torch.ones(D, dtype=torch.bfloat16, device=device)
        layers = []
        for i in range(cfg.num_layers):
            a = f"layers.{i}.attn"
            wqkv = rnd(cfg.q_size + 2 * cfg.kv_size, D)
            wqkv = maybe_fp4(f"{a}.q_proj.weight", wqkv)  # q/k/v: one shared global scale
            qk = torch.ones(2, Dh, dtype=torch.bfloat16, device=device) if cfg.qk_norm == "head" else None
            layers.append(LayerWeights(
                attn_norm=ones, mlp_norm=ones, wqkv=wqkv, wo=maybe_fp4(f"{a}.o_proj.weight", rnd(D, cfg.q_size)),
                qk_norm=qk, router=rnd(E, D),
                gate_up=maybe_fp4(f"layers.{i}.mlp.experts.gate_up.weight", rnd(E, 2 * Fw, D)),
                down=maybe_fp4(f"layers.{i}.mlp.experts.down.weight", rnd(E, D, Fw)),
            ))
        embed = rnd(cfg.vocab_size, D)
        head = embed if cfg.tie_word_embeddings else rnd(cfg.vocab_size, D)
        return cls(cfg, recipe, embed, head, ones, _for_kernels(layers))


def _for_kernels(layers: list[LayerWeights]) -> list[LayerWeights]:
    """FP4 linears and experts in the layout the GEMMs read fastest (fp4_gemm.for_kernels: swizzled
    codes where the device's check passed), in place."""
    for lw in layers:
        for f in ("wqkv", "wo", "gate_up", "down"):
            setattr(lw, f, fg.for_kernels(getattr(lw, f)))
    return layers


def quantize_weight(w: torch.Tensor) -> fp4.FP4Tensor:
    """NVFP4 of a (stacked) weight with one global scale per matrix, as qat.quantize_weight, on the
    Triton kernels: stacked (E, O, I) experts are quantized as E rows of O*I (blocks of 16 never
    straddle a matrix row), so each expert's global scale is a per-row one."""
    gs = qat.weight_global_scale(w)
    if w.dim() == 2:
        return kernels.quantize(w, "nvfp4", global_scale=gs)
    E, O, I = w.shape
    q = kernels.quantize(w.reshape(E, O * I), "nvfp4", global_scale=gs.reshape(E, 1))
    return fp4.FP4Tensor(q.codes.reshape(E, O, I // 2), q.scales.reshape(E, O, I // 16), gs, "nvfp4", w.shape)


def _mm_f32_out() -> int:
    """What this torch's torch.mm(a, b, out_dtype=float32) does for BF16 inputs: 2 also into an
    `out=` buffer, 1 only into a new tensor, 0 not at all."""
    a = torch.zeros(2, 2, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch.mm(a, a, out_dtype=torch.float32)
    except Exception:
        return 0
    try:
        torch.mm(a, a, out_dtype=torch.float32, out=torch.empty(2, 2, device=a.device))
        return 2
    except Exception:
        return 1


_HAS_MM_OUT_DTYPE: int | None = None
# FP4 expert inputs: the quantize pass also writes the BF16 c * s8 the GEMM reads (fp4_gemm.DEQUANT_A)
# instead of a separate dequantize pass per GEMM. Off: the two-pass form (set it off before building a
# decoder to A/B the two).
FUSED_DEQUANT = True


# ----------------------------------------------------------------------------- decoder


class GPUDecoder:
    """Static-batch decode of an MoE model with the FP4 kernels (see the module docstring)."""

    def __init__(self, weights: DecoderWeights, batch: int, max_len: int, *, temperature: float = 1.0,
                 seed: int = 0, use_graph: bool | None = None, bf16_experts: str = "triton") -> None:
        global _HAS_MM_OUT_DTYPE
        cfg = weights.cfg
        self.w, self.cfg, self.recipe = weights, cfg, weights.recipe
        self.B, self.max_len, self.temperature = batch, max_len, temperature
        dev = self.device = weights.device
        self.use_graph = dev.type == "cuda" if use_graph is None else use_graph
        if bf16_experts not in ("triton", "grouped_mm"):
            raise ValueError("bf16_experts must be 'triton' or 'grouped_mm'")
        self.bf16_experts = bf16_experts
        if _HAS_MM_OUT_DTYPE is None:
            _HAS_MM_OUT_DTYPE = _mm_f32_out()
        L, B, D, K = cfg.num_layers, batch, cfg.hidden_size, cfg.top_k
        shape = (L, B, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.cache = FP4KVCache(*shape, device=dev) if self.recipe.kv else DenseKVCache(*shape, device=dev)
        # an FP4 cache is stored swizzled (fp4_swizzle.swizzle_blocks) where the kernels were checked
        # on it: its codes are then not FP4KVCache's natural ones (fp4_swizzle.unswizzle_codes reads them)
        self.kv_swizzled = bool(self.recipe.kv and fa.SWIZZLE_KV and fa.kv_swizzle_check(dev) == "swizzle ok")
        cos, sin = rope_cos_sin(torch.arange(max_len, device=dev)[None], cfg.head_dim, cfg.rope_theta, torch.bfloat16)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        # the split is static (the captured graph replays it at every length) and follows the
        # attention tile and program target tuned for this cache format
        acfg = fa.effective_config(bool(self.recipe.kv), B, max_len, mma_ok=fa.mma_usable(
            bool(self.recipe.kv), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.kv_swizzled, dev))
        self.split_len = fa.split_len_for(max_len, B, cfg.num_kv_heads, acfg.split_block, acfg.programs)
        self.rows_per_expert = B * K / cfg.num_experts  # the GEMM tiles follow it (fg.gemm_config)
        i32 = dict(dtype=torch.int32, device=dev)
        self.tokens = torch.zeros(B, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, **i32)
        self.lens = torch.ones(B, **i32)
        # Philox key (64-bit: the sampler reads int64 as two key words), +1 per step
        self.seed = torch.full((1,), seed, dtype=torch.long, device=dev)
        self.x = torch.zeros(B, D, dtype=torch.bfloat16, device=dev)
        self.h = torch.zeros(B, D, dtype=torch.bfloat16, device=dev)
        # the experts' outputs in BF16, gated in float32 by the residual kernel (add_rmsnorm(gates=)):
        # half the bytes of float32 gated outputs (116 MB a layer at 1776 rows), the same products
        self.y = torch.zeros(B * K, D, dtype=torch.bfloat16, device=dev)
        self.kv_new = torch.zeros(2, B, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16, device=dev)
        self.offsets = torch.zeros(L, cfg.num_experts, **i32)  # per layer, kept for byte accounting
        self.logits = torch.zeros(B, cfg.vocab_size, dtype=torch.float32, device=dev)
        # the BF16 c * s8 of the FP4 expert inputs, written by their quantize pass (see _moe)
        self.fused_dequant = bool(self.recipe.acts and fg.DEQUANT_A and FUSED_DEQUANT)
        self.dq_h = torch.zeros(B, D, dtype=torch.bfloat16, device=dev) if self.fused_dequant else None
        self.dq_mid = (torch.zeros(B * K, cfg.expert_size, dtype=torch.bfloat16, device=dev)
                       if self.fused_dequant else None)
        self.dq_linear: dict[tuple[int, ...], torch.Tensor] = {}  # the same for FP4 projections, by input shape
        self.next_tokens = torch.zeros(B, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros(B, dtype=torch.float32, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None

    # ------------------------------------------------------------------ one step

    def _act(self, site: str, x: torch.Tensor, pairs: torch.Tensor | None = None,
             dequant_out: torch.Tensor | None = None):
        """x quantized per row if the recipe quantizes `site`; `pairs`: the (token * top_k + slot)
        of each row of x when its rows are expert-sorted (the down input), for `_sink`;
        `dequant_out`: also filled with the result's e2m1 * block scale (see `_quantize`)."""
        if not self.recipe.quantizes(site):
            return x
        self._watch(site, x)
        return self._quantize(x, self._sink(site, x, pairs), dequant_out)

    def _quantize(self, x: torch.Tensor, sink: RecordSink | None,
                  dequant_out: torch.Tensor | None = None) -> fp4.FP4Tensor:
        """NVFP4 of x per row; with a sink, each row's outcome is also stored at its record row; with
        `dequant_out`, its e2m1 * block scale is written there (in the same pass on Triton)."""
        return kernels.quantize(x, "nvfp4", per_row_global=True, sink=sink, dequant_out=dequant_out)

    # hooks for a recording subclass (rollout/graph_engine.py); they run inside the captured step

    def _watch(self, site: str, x: torch.Tensor) -> None:
        """The input of a quantized site (FP4 quantization can hide inf/NaN in it)."""

    def _sink(self, site: str, x: torch.Tensor, pairs: torch.Tensor | None) -> RecordSink | None:
        """Where the quantization outcome of `site` is recorded (rows of x: tokens, or the
        expert-sorted pairs `pairs`); None: not recorded."""
        return None

    def _kv_sink(self, layer: int, kv: torch.Tensor) -> RecordSink | None:
        """As `_sink`, for the (k|v, slot, kv head) rows of a layer's new K/V."""
        return None

    def _observe_routing(self, layer: int, ids: torch.Tensor) -> None:
        """A layer's top-k expert ids (B, K)."""

    def _advance(self) -> None:
        """After sampling: the sampled tokens become the next inputs, every row moves one column."""
        self.tokens.copy_(self.next_tokens)
        self.pos.add_(1)
        self.seed.add_(1)

    def _linear(self, x: torch.Tensor, w, site: str, out_f32: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None:  # into a static buffer: the lm_head's logits, a GiB at the largest batches
            if out_f32 and _HAS_MM_OUT_DTYPE == 2 and not isinstance(w, fp4.FP4Tensor):
                return torch.mm(x, w.T, out_dtype=torch.float32, out=out)
            return out.copy_(self._linear(x, w, site, out_f32))
        if isinstance(w, fp4.FP4Tensor):
            # FP4 inputs (all-linear sites): as for the experts, the quantize pass writes the GEMM's BF16
            # c * s8, instead of a dequantize launch a projection
            dq = None
            if self.fused_dequant and self.recipe.quantizes(f"{site}.input"):
                dq = self.dq_linear.get(tuple(x.shape))
                if dq is None:  # (first met in capture()'s eager step, so not a graph-pool allocation)
                    dq = self.dq_linear[tuple(x.shape)] = torch.empty_like(x, dtype=torch.bfloat16)
            return fg.fp4_linear(self._act(f"{site}.input", x, dequant_out=dq), w, out_f32=out_f32, a_dequant=dq)
        if out_f32 and _HAS_MM_OUT_DTYPE:
            return torch.mm(x, w.T, out_dtype=torch.float32)
        if out_f32 and x.device.type == "cpu":
            return F.linear(x.float(), w.float())
        y = F.linear(x, w)
        return y.float() if out_f32 else y

    def _moe(self, i: int, lw: LayerWeights) -> torch.Tensor:
        """The MoE block of layer i on self.h: the experts' BF16 outputs into self.y (pair rows); returns
        the gates (B, K) float32 they are combined with."""
        cfg = self.cfg
        K, E, Fw = cfg.top_k, cfg.num_experts, cfg.expert_size
        p = f"layers.{i}.mlp.experts"
        # BF16 x BF16 products are exact in float32, so a tensor-core GEMM with float32 accumulation and
        # output computes what the model's float32 router does, summed in another order (the float32
        # SIMT GEMM it replaces was 1.5 ms of a 1776-row step on the H100, plus the float32 copy of h)
        if _HAS_MM_OUT_DTYPE:
            logits = torch.mm(self.h, lw.router.T, out_dtype=torch.float32)
        else:
            logits = torch.mm(self.h.float(), lw.router.float().T)
        ids, gates = fg.route(logits, K, cfg.norm_topk_prob or cfg.router == "topk_softmax")
        self._observe_routing(i, ids)
        offs, tok, pair, _ = fg.dispatch(ids, gates, E, offsets=self.offsets[i])
        w4 = isinstance(lw.gate_up, fp4.FP4Tensor)
        c_gu = fg.gemm_config((w4, w4 and self.recipe.quantizes(f"{p}.gate_up.input"), True), self.rows_per_expert)
        c_dn = fg.gemm_config((w4, w4 and self.recipe.quantizes(f"{p}.down.input"), False), self.rows_per_expert)
        # the row tiles of each row-tile size the two GEMMs use (one small kernel each; often one size).
        # Route + dispatch + tiles as one launch at small batches was timed on the H100 (2026-12-08) and
        # taken out: 1.0 ms a B=16 step against 0.48 ms for the three kernels (docs/gpu.md)
        tiles = {bm: (*fg.row_tiles(offs, bm, fg.max_row_tiles(E, self.B * K, bm)), bm) for bm in {c_gu[0], c_dn[0]}}
        if not w4 and self.bf16_experts == "grouped_mm":
            xs = self.h[tok.long()]
            h2 = torch._grouped_mm(xs, lw.gate_up.transpose(-2, -1), offs=offs)
            hm = F.silu(h2[:, :Fw]) * h2[:, Fw:]
            y = torch._grouped_mm(hm, lw.down.transpose(-2, -1), offs=offs)
            self.y.index_copy_(0, pair.long(), y)
            return gates
        # FP4 activations: the quantize pass also writes the BF16 c * s8 the GEMM reads (fg.DEQUANT_A),
        # instead of a dequantize pass per GEMM (96 launches a step, ~2.5% of a B=16 step on the H100)
        dq = self.fused_dequant and self.recipe.quantizes(f"{p}.gate_up.input")
        xa = self._act(f"{p}.gate_up.input", self.h, dequant_out=self.dq_h if dq else None)
        hmid = fg.grouped_gemm(xa, lw.gate_up, offs, row_idx=tok, swiglu=True, n_rows=tok.numel(),
                               tiles=tiles[c_gu[0]], config=c_gu, a_dequant=self.dq_h if dq else None)
        dq = self.fused_dequant and self.recipe.quantizes(f"{p}.down.input")
        hm = self._act(f"{p}.down.input", hmid, pairs=pair, dequant_out=self.dq_mid if dq else None)
        fg.grouped_gemm(hm, lw.down, offs, dst_idx=pair, out=self.y, tiles=tiles[c_dn[0]], config=c_dn,
                        a_dequant=self.dq_mid if dq else None)
        return gates

    def _attention(self, i: int, lw: LayerWeights) -> torch.Tensor:
        cfg = self.cfg
        H, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self._linear(self.h, lw.wqkv, f"layers.{i}.attn.q_proj")
        c = self.cache
        if self.recipe.kv:
            q = fa.qkv_post(qkv, self.pos, self.cos, self.sin, lw.qk_norm, H, Hkv, Dh, cfg.rms_norm_eps,
                            self.kv_new[0], self.kv_new[1])
            self._watch(f"layers.{i}.attn.kv_cache", self.kv_new)
            kvq = self._quantize(self.kv_new, self._kv_sink(i, self.kv_new))
            fa.kv_store_fp4(kvq, self.pos, c.codes[:, i], c.scales[:, i], c.gscale[:, i], swizzle=self.kv_swizzled)
            o = fa.decode_attention(q, self.lens, k_fp4=(c.codes[0, i], c.scales[0, i], c.gscale[0, i]),
                                    v_fp4=(c.codes[1, i], c.scales[1, i], c.gscale[1, i]), split_len=self.split_len,
                                    swizzled=self.kv_swizzled)
        else:
            q = fa.qkv_post(qkv, self.pos, self.cos, self.sin, lw.qk_norm, H, Hkv, Dh, cfg.rms_norm_eps,
                            c.k[i], c.v[i])
            o = fa.decode_attention(q, self.lens, k=c.k[i], v=c.v[i], split_len=self.split_len)
        return self._linear(o, lw.wo, f"layers.{i}.attn.o_proj")

    def _step(self) -> None:
        """One decode step on the static buffers (captured as the CUDA graph)."""
        cfg, w = self.cfg, self.w
        eps = cfg.rms_norm_eps
        self.lens.copy_(self.pos + 1)
        self.x.copy_(F.embedding(self.tokens, w.embed))
        add_rmsnorm(self.x, None, w.layers[0].attn_norm, eps, self.h)
        for i, lw in enumerate(w.layers):
            a = self._attention(i, lw)
            add_rmsnorm(self.x, a, lw.mlp_norm, eps, self.h)
            gates = self._moe(i, lw)
            nxt = w.layers[i + 1].attn_norm if i + 1 < len(w.layers) else w.final_norm
            add_rmsnorm(self.x, self.y.view(self.B, cfg.top_k, cfg.hidden_size), nxt, eps, self.h, gates=gates)
        self._linear(self.h, w.lm_head, "lm_head", out_f32=True, out=self.logits)
        sample_tokens(self.logits, self.temperature, self.seed, self.next_tokens, self.logprobs)
        self._advance()

    def capture(self) -> None:
        """Compile (one eager step) and capture the step as a CUDA graph; the state is restored."""
        if not self.use_graph:
            return
        saved = [t.clone() for t in (self.tokens, self.pos, self.seed)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._step()
        torch.cuda.current_stream().wait_stream(s)
        for t, v in zip((self.tokens, self.pos, self.seed), saved):
            t.copy_(v)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()
        for t, v in zip((self.tokens, self.pos, self.seed), saved):
            t.copy_(v)

    def step(self, tokens: torch.Tensor | None = None) -> None:
        """Feed `tokens` (B,) (default: the last sampled) at columns pos; sample the next tokens."""
        if tokens is not None:
            self.tokens.copy_(tokens)
        if self.use_graph:
            if self.graph is None:
                self.capture()
            self.graph.replay()
        else:
            self._step()

    # ------------------------------------------------------------------ public API

    def reset(self, pos: int = 0) -> None:
        """All rows at column `pos` (their cache columns < pos are taken as filled)."""
        self.pos.fill_(pos)

    @torch.no_grad()
    def prefill(self, prompts: torch.Tensor) -> torch.Tensor:
        """Feed prompts (B, P) column by column from column 0 (teacher-forced decode steps);
        returns the logits (B, P, V) after each column. The next token is sampled from the last."""
        B, P = prompts.shape
        if B != self.B or P > self.max_len:
            raise ValueError(f"prompts {tuple(prompts.shape)} do not fit batch {self.B} / max_len {self.max_len}")
        self.reset(0)
        out = torch.empty(B, P, self.cfg.vocab_size, device=self.device)
        for c in range(P):
            self.step(prompts[:, c].to(self.device))
            out[:, c] = self.logits
        return out

    @torch.no_grad()
    def decode(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """n steps feeding back the sampled tokens: (tokens (B, n), logprobs (B, n)); one host sync."""
        toks = torch.empty(self.B, n, dtype=torch.long, device=self.device)
        lps = torch.empty(self.B, n, device=self.device)
        for j in range(n):
            self.step()
            toks[:, j] = self.next_tokens
            lps[:, j] = self.logprobs
        return toks, lps

    @torch.no_grad()
    def fill_random(self, length: int, seed: int = 0) -> None:
        """Benchmarks: make every row's first `length` cache columns hold random K/V (unit-scale
        values; FP4: random codes, E4M3 scales and global scales of realistic size) and set
        pos = length, as if a prompt of that length had been prefilled."""
        if length >= self.max_len:
            raise ValueError(f"length {length} leaves no room in max_len {self.max_len}")
        g = torch.Generator(device=self.device).manual_seed(seed)
        c = self.cache
        if self.recipe.kv:
            for i in range(self.cfg.num_layers):  # per layer: bounded temporaries
                cc = c.codes[:, i, :, :length]
                cc.copy_(torch.randint(0, 256, cc.shape, generator=g, device=self.device, dtype=torch.uint8))
                sc = c.scales[:, i, :, :length]
                raw = torch.randint(0x60, 0x7E, sc.shape, generator=g, device=self.device, dtype=torch.uint8)
                sc.copy_(fp4_swizzle.cache_scale_bytes(raw) if self.kv_swizzled else raw)
                c.gscale[:, i, :, :length].uniform_(500.0, 2000.0, generator=g)
        else:
            for i in range(self.cfg.num_layers):
                c.k[i, :, :length].normal_(generator=g)
                c.v[i, :, :length].normal_(generator=g)
        self.tokens.copy_(torch.randint(0, self.cfg.vocab_size, (self.B,), generator=g, device=self.device))
        self.reset(length)

    # ------------------------------------------------------------------ accounting

    def bytes_per_step(self, ctx_len: float) -> dict[str, float]:
        """Bytes a step must move at mean context `ctx_len` (KV positions read), from the last
        step's routing: touched experts' weights, attention + router + norms, KV cache read and
        written, lm_head, embedding rows. Activations are not counted (small)."""
        cfg, w = self.cfg, self.w

        def nb(t):
            return t.nbytes if isinstance(t, fp4.FP4Tensor) else t.numel() * t.element_size()

        counts = torch.diff(self.offsets.long(), dim=1, prepend=torch.zeros_like(self.offsets[:, :1]).long())
        touched = (counts > 0).sum(1).tolist()
        experts = attn = 0.0
        for i, lw in enumerate(w.layers):
            experts += touched[i] / cfg.num_experts * (nb(lw.gate_up) + nb(lw.down))
            attn += nb(lw.wqkv) + nb(lw.wo) + nb(lw.router) + 2 * nb(lw.attn_norm)
        if self.recipe.kv:
            per_tok = 2 * cfg.num_kv_heads * (cfg.head_dim // 2 + cfg.head_dim // 16 + 4)
        else:
            per_tok = 2 * cfg.num_kv_heads * cfg.head_dim * 2
        kv = cfg.num_layers * self.B * per_tok * (ctx_len + 1)
        head = nb(w.lm_head) + self.B * cfg.hidden_size * 2
        return {"experts": experts, "attn_router_norms": attn, "kv_cache": kv, "lm_head_embed": head,
                "total": experts + attn + kv + head, "touched_experts_mean": sum(touched) / len(touched)}
