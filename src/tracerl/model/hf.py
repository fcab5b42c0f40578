"""Hugging Face checkpoints: load and save Qwen3MoeForCausalLM, MixtralForCausalLM, OlmoeForCausalLM folders.

A folder holds `config.json` and `model.safetensors`, or shards `model-0000i-of-0000n.safetensors`
with `model.safetensors.index.json`. Experts are stored per expert on disk (HF's layout,
`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`; Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2`)
and stacked into w_gate_up (E, 2F, D) (gate rows first) and w_down (E, D, F) at load time; the
fused in-memory layout (`mlp.experts.gate_up_proj` / `down_proj`) is accepted too. Dense
Qwen3-MoE layers (`mlp_only_layers` / `decoder_sparse_step`) load their gate/up into one (2F, D).

`hf_layout(cfg)` is the one table (HF tensor name <-> our parameter, expert, rows, quant site)
used by the loader, by `save_pretrained` and by the NVFP4 export.

Saving is atomic per file: everything is written to a temporary folder inside the target and
moved into place with os.replace; weight files of an earlier save that the new one does not
write are removed; other files (a tokenizer) are left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from tracerl.model.config import ModelConfig

HF_ARCHS = {"Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe"}
ARCH_CLASS = {v: k for k, v in HF_ARCHS.items()}
_CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "router_aux_loss_coef",
            "output_router_logits", "router_jitter_noise", "attention_dropout")
_IGNORED_KEYS = ("rotary_emb.inv_freq",)
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def _hf_config_class(arch: str):
    import transformers

    return {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
            "olmoe": transformers.OlmoeConfig}[arch]


# ----------------------------------------------------------------------------- config


def config_from_hf(d: dict, name: str = "hf") -> ModelConfig:
    """ModelConfig from a config.json dict; clear errors for what this model cannot run."""
    archs = d.get("architectures") or []
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None)
    if arch is None:
        raise ValueError(
            f"config.json architectures {archs} are not supported; tracerl.model loads {sorted(HF_ARCHS)}. "
            "Convert the checkpoint to one of these or add the architecture to tracerl/model/hf.py"
        )
    hf = _hf_config_class(arch).from_dict(d)
    problems = []
    if getattr(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.hidden_act!r} (only silu/SwiGLU is implemented)")
    if getattr(hf, "attention_bias", False):
        problems.append("attention_bias=true (q/k/v/o biases are not implemented)")
    rope = getattr(hf, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope.get('rope_type')!r} (only default RoPE is implemented)")
    if getattr(hf, "use_sliding_window", False) or (arch == "mixtral" and hf.sliding_window is not None):
        problems.append(f"sliding_window={hf.sliding_window} (sliding-window attention is not implemented)")
    if problems:
        raise ValueError(f"{ARCH_CLASS[arch]} config not supported: " + "; ".join(problems))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    common = dict(
        name=name, arch=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads, head_dim=head_dim,
        top_k=hf.num_experts_per_tok, max_seq_len=hf.max_position_embeddings, rope_theta=float(theta or 10000.0),
        rms_norm_eps=hf.rms_norm_eps, tie_word_embeddings=bool(hf.tie_word_embeddings),
        init_std=float(getattr(hf, "initializer_range", 0.02)),
        hf_extra={k: getattr(hf, k) for k in _CARRIED if hasattr(hf, k)},
    )
    if arch == "qwen3_moe":
        step = hf.decoder_sparse_step
        dense = [i for i in range(hf.num_hidden_layers)
                 if i in (hf.mlp_only_layers or []) or hf.num_experts == 0 or (i + 1) % step != 0]
        return ModelConfig(**common, num_experts=hf.num_experts, expert_size=hf.moe_intermediate_size,
                           dense_layers=tuple(dense), dense_size=hf.intermediate_size if dense else 0,
                           qk_norm="head", router="softmax_topk", norm_topk_prob=bool(hf.norm_topk_prob))
    if arch == "mixtral":
        return ModelConfig(**common, num_experts=hf.num_local_experts, expert_size=hf.intermediate_size,
                           qk_norm="none", router="topk_softmax", norm_topk_prob=True)
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        raise ValueError("OlmoeForCausalLM with head_dim * num_attention_heads != hidden_size is not supported "
                         "(its k_norm width is defined from hidden_size)")
    return ModelConfig(**common, num_experts=hf.num_experts, expert_size=hf.intermediate_size, qk_norm="full",
                       router="softmax_topk", norm_topk_prob=bool(hf.norm_topk_prob), clip_qkv=hf.clip_qkv)


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The config.json dict of `cfg` as its HF architecture (raises if the variant has no HF equivalent)."""
    arch = cfg.arch
    problems = []
    want_norm = {"qwen3_moe": "head", "mixtral": "none", "olmoe": "full"}[arch]
    if cfg.qk_norm != want_norm:
        problems.append(f"qk_norm={cfg.qk_norm!r} but {ARCH_CLASS[arch]} uses {want_norm!r}")
    if cfg.dense_layers and arch != "qwen3_moe":
        problems.append(f"dense_layers {cfg.dense_layers}: only Qwen3-MoE has dense layers")
    if cfg.clip_qkv is not None and arch != "olmoe":
        problems.append("clip_qkv is an OLMoE-only option")
    if arch == "mixtral" and not cfg.norm_topk_prob:
        problems.append("Mixtral's router is normalised over the top-k: norm_topk_prob must be True")
    if arch == "olmoe" and cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        problems.append("OLMoE needs head_dim * num_heads == hidden_size")
    if problems:
        raise ValueError(f"ModelConfig {cfg.name!r} cannot be saved as {ARCH_CLASS[arch]}: " + "; ".join(problems)
                         + ". Change `arch` or the variant fields.")
    kw = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, num_experts_per_tok=cfg.top_k,
        max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, hidden_act="silu", initializer_range=cfg.init_std,
    )
    kw.update({k: v for k, v in cfg.hf_extra.items() if k in _CARRIED})
    if arch == "qwen3_moe":
        kw.update(head_dim=cfg.head_dim, num_experts=cfg.num_experts, moe_intermediate_size=cfg.expert_size,
                  intermediate_size=cfg.dense_size or cfg.expert_size, decoder_sparse_step=1,
                  mlp_only_layers=list(cfg.dense_layers), norm_topk_prob=cfg.norm_topk_prob)
    elif arch == "mixtral":
        kw.update(head_dim=cfg.head_dim, num_local_experts=cfg.num_experts, intermediate_size=cfg.expert_size)
    else:
        kw.update(num_experts=cfg.num_experts, intermediate_size=cfg.expert_size, norm_topk_prob=cfg.norm_topk_prob,
                  clip_qkv=cfg.clip_qkv)
    hf = _hf_config_class(arch)(**kw)
    hf.architectures = [ARCH_CLASS[arch]]
    d = hf.to_dict()
    d["dtype"] = str(dtype).removeprefix("torch.")
    return d


# ----------------------------------------------------------------------------- tensor layout


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the HF layout and where it lives in MoEModel.

    param: our parameter name; expert: index into a stacked expert tensor (or None);
    rows: (start, stop) rows of that (per-expert) matrix (or None = all);
    site: the weight quant site when this is a linear weight (None for norms / embeddings).
    """

    hf_name: str
    param: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    site: str | None = None

    @property
    def module(self) -> str:
        """The HF module name (hf_name without '.weight')."""
        return self.hf_name.removesuffix(".weight")


def moe_prefix(arch: str) -> str:
    return "block_sparse_moe" if arch == "mixtral" else "mlp"


def hf_layout(cfg: ModelConfig) -> list[HFTensor]:
    """Every tensor of the HF checkpoint of `cfg`, in file order."""
    out = [HFTensor("model.embed_tokens.weight", "embed.weight")]
    F, Fd = cfg.expert_size, cfg.dense_size
    names = ("w1", "w3", "w2") if cfg.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i in range(cfg.num_layers):
        hp, p = f"model.layers.{i}", f"layers.{i}"
        out.append(HFTensor(f"{hp}.input_layernorm.weight", f"{p}.attn_norm.weight"))
        for n in ("q", "k", "v", "o"):
            out.append(HFTensor(f"{hp}.self_attn.{n}_proj.weight", f"{p}.attn.{n}_proj.weight",
                                site=f"{p}.attn.{n}_proj.weight"))
        if cfg.qk_norm != "none":
            out += [HFTensor(f"{hp}.self_attn.q_norm.weight", f"{p}.attn.q_norm.weight"),
                    HFTensor(f"{hp}.self_attn.k_norm.weight", f"{p}.attn.k_norm.weight")]
        if cfg.is_moe_layer(i):
            m = f"{hp}.{moe_prefix(cfg.arch)}"
            out.append(HFTensor(f"{m}.gate.weight", f"{p}.mlp.router.weight", site=f"{p}.mlp.router.weight"))
            for e in range(cfg.num_experts):
                gu, dn = f"{p}.mlp.experts.gate_up.weight", f"{p}.mlp.experts.down.weight"
                out += [HFTensor(f"{m}.experts.{e}.{names[0]}.weight", f"{p}.mlp.experts.w_gate_up", e, (0, F), gu),
                        HFTensor(f"{m}.experts.{e}.{names[1]}.weight", f"{p}.mlp.experts.w_gate_up", e, (F, 2 * F), gu),
                        HFTensor(f"{m}.experts.{e}.{names[2]}.weight", f"{p}.mlp.experts.w_down", e, None, dn)]
        else:
            gu, dn = f"{p}.mlp.gate_up.weight", f"{p}.mlp.down.weight"
            out += [HFTensor(f"{hp}.mlp.gate_proj.weight", gu, None, (0, Fd), gu),
                    HFTensor(f"{hp}.mlp.up_proj.weight", gu, None, (Fd, 2 * Fd), gu),
                    HFTensor(f"{hp}.mlp.down_proj.weight", dn, None, None, dn)]
        out.append(HFTensor(f"{hp}.post_attention_layernorm.weight", f"{p}.mlp_norm.weight"))
    out.append(HFTensor("model.norm.weight", "norm.weight"))
    if not cfg.tie_word_embeddings:
        out.append(HFTensor("lm_head.weight", "lm_head.weight", site="lm_head.weight"))
    return out


def slice_param(t: torch.Tensor, e: HFTensor) -> torch.Tensor:
    """The part of our parameter tensor `t` that entry `e` names."""
    if e.expert is not None:
        t = t[e.expert]
    if e.rows is not None:
        t = t[e.rows[0]:e.rows[1]]
    return t


# ----------------------------------------------------------------------------- load


class _Checkpoint:
    """Lazy access to the tensors of a safetensors folder (single file or index + shards)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        index = path / SAFETENSORS_INDEX
        single = path / SAFETENSORS_SINGLE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (path / f).is_file()]
            if missing:
                raise FileNotFoundError(f"{index} names shards that are missing: {missing[:5]}; the download is incomplete")
        elif single.is_file():
            files = [SAFETENSORS_SINGLE]
            weight_map = None
        else:
            found = sorted(p.name for p in path.iterdir())
            hint = " (PyTorch .bin checkpoints are not supported: convert them to safetensors)" if any(
                f.endswith(".bin") for f in found) else ""
            raise FileNotFoundError(f"{path} has neither {SAFETENSORS_SINGLE} nor {SAFETENSORS_INDEX}{hint}; found {found[:10]}")
        self._handles = {f: safe_open(str(path / f), framework="pt") for f in files}
        self.key_file = {}
        for f, h in self._handles.items():
            for k in h.keys():
                self.key_file[k] = f
        if weight_map is not None:
            absent = [k for k, f in weight_map.items() if self.key_file.get(k) != f]
            if absent:
                raise ValueError(f"{index} maps tensors that are not in their shard: {absent[:5]}")

    def keys(self) -> set[str]:
        return set(self.key_file)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self.key_file[key]].get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        return self._handles[self.key_file[key]].get_tensor(key)


def _fused_expert_key(e: HFTensor, cfg: ModelConfig) -> str:
    layer = e.param.split(".")[1]
    which = "gate_up_proj" if e.param.endswith("w_gate_up") else "down_proj"
    return f"model.layers.{layer}.{moe_prefix(cfg.arch)}.experts.{which}"


def from_pretrained(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None):
    """Load a Hugging Face MoE checkpoint folder into a MoEModel (see the module docstring).

    dtype: parameter dtype (default: the checkpoint's, e.g. bfloat16); device: default CPU.
    """
    from tracerl.model.transformer import MoEModel

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"from_pretrained: {str(path)!r} is not a directory (expected a Hugging Face model folder)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"from_pretrained: {cfg_file} is missing; a model folder needs config.json and *.safetensors")
    cfg = config_from_hf(json.loads(cfg_file.read_text()), name=path.name)
    ckpt = _Checkpoint(path)
    keys = ckpt.keys()
    if any(k.endswith(("weight_packed", ".qweight", "weight_scale")) for k in keys):
        raise ValueError(f"{path} is a quantized checkpoint; from_pretrained loads unquantized (BF16/FP32) weights")
    layout = hf_layout(cfg)
    if dtype is None:
        dtype = ckpt.get("model.embed_tokens.weight").dtype if "model.embed_tokens.weight" in keys else torch.float32

    with torch.device("meta"):
        model = MoEModel(cfg)
    model = model.to_empty(device=device or "cpu").to(dtype)
    params = dict(model.named_parameters())
    filled: set[str] = set()
    used: set[str] = set()
    missing: list[str] = []
    with torch.no_grad():
        for e in layout:
            dst = slice_param(params[e.param], e)
            if e.hf_name in keys:
                src_key, src = e.hf_name, None
            elif e.expert is not None and _fused_expert_key(e, cfg) in keys:
                src_key = _fused_expert_key(e, cfg)
                src = ckpt.get(src_key)[e.expert]  # fused (E, 2F, D) / (E, D, F): same rows as ours
                src = src if e.rows is None else src[e.rows[0]:e.rows[1]]
            else:
                missing.append(e.hf_name)
                continue
            if src is None:
                shape = ckpt.shape(src_key)
                if shape != tuple(dst.shape):
                    raise ValueError(
                        f"{path}: tensor {src_key} has shape {shape}, the config implies {tuple(dst.shape)}; "
                        "config.json does not match the weights (wrong sizes, or the wrong architecture)")
                src = ckpt.get(src_key)
            elif tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{path}: {src_key}[{e.expert}] has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(src)
            used.add(src_key)
            filled.add(e.param)
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensors missing from the checkpoint, e.g. {missing[:4]}; "
                         "the files are incomplete or config.json describes a different model")
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(k for k in keys - used if k not in ignorable and not k.endswith(_IGNORED_KEYS))
    if unexpected:
        raise ValueError(f"{path}: {len(unexpected)} checkpoint tensors have no place in the model, e.g. {unexpected[:4]}; "
                         "config.json does not describe these weights (e.g. wrong num_experts or num_hidden_layers)")
    unfilled = sorted(set(params) - filled)
    if unfilled:  # cannot happen unless hf_layout and MoEModel disagree
        raise RuntimeError(f"internal: parameters not covered by the HF layout: {unfilled[:4]}")
    return model


# ----------------------------------------------------------------------------- save


def hf_state_dict(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF-named tensors (contiguous CPU copies in `dtype`, default the model's) of `model`."""
    params = dict(model.named_parameters())
    out = {}
    for e in hf_layout(model.config):
        t = slice_param(params[e.param].detach(), e)
        out[e.hf_name] = t.to(device="cpu", dtype=dtype or t.dtype).contiguous().clone()
    return out


def write_safetensors_folder(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict, max_shard_bytes: int = 5 * 2**30,
    extra_files: dict[str, str] | None = None,
) -> None:
    """Write config.json + safetensors (sharded above max_shard_bytes) into `path`, atomically per file."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-save-", dir=path))
    try:
        written: list[str] = []
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SAFETENSORS_SINGLE), metadata={"format": "pt"})
            written.append(SAFETENSORS_SINGLE)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                written.append(fname)
                weight_map.update({k: fname for k in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                            indent=2))
            written.append(SAFETENSORS_INDEX)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        written.append("config.json")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
            written.append(name)
        for name in written:
            os.replace(tmp / name, path / name)
        for old in _weight_files(path):
            if old not in written:
                (path / old).unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _weight_files(path: Path) -> Iterable[str]:
    for p in path.iterdir():
        if p.is_file() and p.name.startswith("model") and (p.name.endswith(".safetensors") or p.name == SAFETENSORS_INDEX):
            yield p.name


def save_pretrained(model, path: str | os.PathLike, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `model` as a Hugging Face folder of its `config.arch` that transformers' from_pretrained loads."""
    saved_dtype = dtype or next(model.parameters()).dtype
    config = config_to_hf(model.config, saved_dtype)  # fails fast if the variant has no HF equivalent
    write_safetensors_folder(path, hf_state_dict(model, dtype), config, max_shard_bytes)
