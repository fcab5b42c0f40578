"""ModelConfig: the shape and the architectural variant of a decoder-only MoE LM, plus named presets.

One dataclass covers the three MoE families RL users post-train, as switches rather than
subclasses:

| field           | Qwen3-MoE            | Mixtral              | OLMoE                 |
| --------------- | -------------------- | -------------------- | --------------------- |
| `qk_norm`       | "head" (RMSNorm over head_dim, per head) | "none" | "full" (RMSNorm over the whole q / k projection) |
| `router`        | "softmax_topk"       | "topk_softmax"       | "softmax_topk"        |
| `norm_topk_prob`| True (30B-A3B)       | True (by construction) | False               |
| dense layers    | `mlp_only_layers` / `decoder_sparse_step` | none | none                |

Router rules (E experts, top-k K): "softmax_topk" takes p = softmax(logits) over all E, picks the
K largest and uses their p as gate weights, renormalised to sum 1 when `norm_topk_prob`;
"topk_softmax" (Mixtral) picks the K largest logits and takes a softmax over those K only, which
equals the renormalised case. Both select experts by the top-k of the probabilities.

Widths are checked to be multiples of 32 so that both NVFP4 (blocks of 16) and MXFP4 (blocks of
32) block every quantized dimension: hidden size (all linear inputs), expert and dense MLP widths
(down-projection inputs), head_dim (KV-cache blocks) and the attention output width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

FP4_BLOCK_LCM = 32  # NVFP4 blocks 16, MXFP4 blocks 32
ARCHS = ("qwen3_moe", "mixtral", "olmoe")
QK_NORMS = ("none", "head", "full")
ROUTERS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and variant switches of an MoE transformer. See the module docstring for the variants.

    `arch` names the Hugging Face family used by `save_pretrained` / `export_nvfp4`
    (qwen3_moe | mixtral | olmoe); it does not change the computation, the switches do.
    """

    name: str = "custom"
    arch: str = "qwen3_moe"
    vocab_size: int = 128
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    top_k: int = 2
    expert_size: int = 128  # F: width of one expert's SwiGLU (moe_intermediate_size)
    dense_layers: tuple[int, ...] = ()  # layers with a dense SwiGLU MLP instead of experts
    dense_size: int = 0  # width of the dense SwiGLU MLP (intermediate_size)
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qk_norm: str = "head"
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    clip_qkv: float | None = None  # OLMoE option: clamp q, k, v to +-clip_qkv after the qk-norm
    tie_word_embeddings: bool = False
    logits_fp32: bool = True  # lm_head matmul in float32 (bf16 logits are a known mismatch source)
    init_std: float = 0.02
    # config.json fields that do not change the computation (token ids, dtype, ...), kept by save_pretrained
    hf_extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(sorted(int(i) for i in self.dense_layers)))
        errs: list[str] = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                errs.append(msg)

        need(self.arch in ARCHS, f"arch {self.arch!r} is not one of {ARCHS}")
        need(self.qk_norm in QK_NORMS, f"qk_norm {self.qk_norm!r} is not one of {QK_NORMS}")
        need(self.router in ROUTERS, f"router {self.router!r} is not one of {ROUTERS}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "num_experts", "top_k", "expert_size", "max_seq_len"):
            need(int(getattr(self, name)) > 0, f"{name} must be positive, got {getattr(self, name)}")
        if errs:
            raise ValueError(self._fmt(errs))
        for name in ("hidden_size", "expert_size", "head_dim"):
            v = getattr(self, name)
            need(v % FP4_BLOCK_LCM == 0,
                 f"{name}={v} is not a multiple of {FP4_BLOCK_LCM}: NVFP4 (16) and MXFP4 (32) blocks must divide it; "
                 f"use {(v + FP4_BLOCK_LCM - 1) // FP4_BLOCK_LCM * FP4_BLOCK_LCM}")
        need(self.num_heads % self.num_kv_heads == 0,
             f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads} (GQA groups)")
        need(self.top_k <= self.num_experts, f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        need(not bad, f"dense_layers {bad} are outside 0..{self.num_layers - 1}")
        need(len(set(self.dense_layers)) == len(self.dense_layers), f"dense_layers {self.dense_layers} repeats a layer")
        if self.dense_layers:
            need(self.dense_size > 0 and self.dense_size % FP4_BLOCK_LCM == 0,
                 f"dense_layers are set, so dense_size must be a positive multiple of {FP4_BLOCK_LCM}, got {self.dense_size}")
        need(len(self.dense_layers) < self.num_layers, "every layer is dense: an MoE model needs at least one MoE layer")
        need(self.router != "topk_softmax" or self.norm_topk_prob,
             "router='topk_softmax' (Mixtral) is normalised by construction: set norm_topk_prob=True")
        need(self.clip_qkv is None or self.clip_qkv > 0, f"clip_qkv must be positive or None, got {self.clip_qkv}")
        need(self.rms_norm_eps > 0, f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        need(self.rope_theta > 0, f"rope_theta must be positive, got {self.rope_theta}")
        need(self.num_experts <= 2**31 - 1, "num_experts does not fit int32")
        if errs:
            raise ValueError(self._fmt(errs))

    def _fmt(self, errs: list[str]) -> str:
        return f"invalid ModelConfig {self.name!r}:\n  - " + "\n  - ".join(errs)

    # ------------------------------------------------------------------ derived sizes

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers with routed experts."""
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i has routed experts (else a dense SwiGLU MLP)."""
        return i not in self.dense_layers

    @property
    def q_size(self) -> int:
        """Width of the q projection (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the k and v projections (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim

    def num_params(self, active: bool = False) -> int:
        """Parameter count; `active=True` counts only top_k experts per MoE layer (per-token compute)."""
        d = self.hidden_size
        attn = d * self.q_size * 2 + d * self.kv_size * 2 + 2 * d
        if self.qk_norm == "head":
            attn += 2 * self.head_dim
        elif self.qk_norm == "full":
            attn += self.q_size + self.kv_size
        n_exp = self.top_k if active else self.num_experts
        moe = n_exp * 3 * d * self.expert_size + self.num_experts * d
        dense = 3 * d * self.dense_size
        n_moe = len(self.moe_layers)
        total = self.num_layers * attn + n_moe * moe + (self.num_layers - n_moe) * dense
        total += self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
        return total

    def replace(self, **changes) -> ModelConfig:
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    # CPU demo: ~1.8M parameters; char tokenizer (99 ids) padded to 128.
    "tiny": ModelConfig(
        name="tiny", vocab_size=128, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        num_experts=8, top_k=2, expert_size=128, max_seq_len=256, rope_theta=10000.0,
    ),
    # GPU RL: ~245M parameters (~55M active); char tokenizer by default, override vocab_size for an HF one.
    "small": ModelConfig(
        name="small", vocab_size=128, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64,
        num_experts=32, top_k=4, expert_size=256, max_seq_len=2048, rope_theta=1e6,
    ),
    # Qwen3-30B-A3B shapes (random weights, for benchmarks): 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, num_experts=128, top_k=8, expert_size=768, max_seq_len=40960, rope_theta=1e6,
        rms_norm_eps=1e-6,
    ),
}


def get_config(name_or_config: str | ModelConfig, **overrides) -> ModelConfig:
    """A preset by name (or a given config), with `overrides` applied."""
    if isinstance(name_or_config, ModelConfig):
        cfg = name_or_config
    else:
        try:
            cfg = PRESETS[name_or_config]
        except KeyError:
            raise ValueError(
                f"unknown model preset {name_or_config!r}; choose one of {sorted(PRESETS)} or pass a ModelConfig"
            ) from None
    return cfg.replace(**overrides) if overrides else cfg
