"""NVFP4 export: compressed-tensors' own decompressor gives back exactly tracerl's dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import NVFP4
from safetensors import safe_open

from tracerl import fp4
from tracerl import model as M
from tracerl.model.export import calibrate_input_amax, export_nvfp4
from tracerl.qat import Recipe

SCHEME = QuantizationScheme(targets=["Linear"], **NVFP4)


@pytest.fixture(scope="module")
def model():
    # a dense layer too, so dense gate/up/down are exported
    return M.build("tiny", seed=0, init_std=0.1, dense_layers=(1,), dense_size=96)


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _decompress(t, module):
    sd = {n: t[f"{module}.{n}"] for n in ("weight_packed", "weight_scale", "weight_global_scale")}
    return NVFP4PackedCompressor.decompress(sd, SCHEME)["weight"]


def test_w4a16_experts_export_decompresses_to_our_weights(model, tmp_path):
    recipe = Recipe("w4a16")
    cfg = export_nvfp4(model, tmp_path, recipe)
    t = _tensors(tmp_path)
    packed = model.pack_weights(recipe)
    qc = cfg["quantization_config"]
    QuantizationConfig.model_validate(qc)  # compressed-tensors accepts the config
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"] == qc
    assert qc["format"] == "nvfp4-pack-quantized" and qc["config_groups"]["group_0"]["input_activations"] is None
    assert "lm_head" in qc["ignore"] and "model.layers.0.mlp.gate" in qc["ignore"]
    assert "model.layers.0.self_attn.q_proj" in qc["ignore"] and "model.layers.1.mlp.gate_proj" in qc["ignore"]
    n_checked = 0
    for i in (0, 2, 3):
        gu = fp4.dequantize(packed[f"layers.{i}.mlp.experts.gate_up.weight"], torch.bfloat16)
        dn = fp4.dequantize(packed[f"layers.{i}.mlp.experts.down.weight"], torch.bfloat16)
        for e in range(8):
            m = f"model.layers.{i}.mlp.experts.{e}"
            assert t[f"{m}.gate_proj.weight_packed"].dtype == torch.uint8
            assert t[f"{m}.gate_proj.weight_packed"].shape == (128, 64)
            assert t[f"{m}.gate_proj.weight_scale"].dtype == torch.float8_e4m3fn
            assert t[f"{m}.gate_proj.weight_scale"].shape == (128, 8)
            assert t[f"{m}.gate_proj.weight_global_scale"].shape == (1,)
            assert f"{m}.gate_proj.input_global_scale" not in t
            assert torch.equal(_decompress(t, f"{m}.gate_proj"), gu[e, :128])
            assert torch.equal(_decompress(t, f"{m}.up_proj"), gu[e, 128:])
            assert torch.equal(_decompress(t, f"{m}.down_proj"), dn[e])
            # gate and up of one expert share their global scale (vLLM fuses them)
            assert torch.equal(t[f"{m}.gate_proj.weight_global_scale"], t[f"{m}.up_proj.weight_global_scale"])
            n_checked += 3
    assert n_checked == 72
    # unquantized tensors are the bf16 weights under their HF names
    params = dict(model.named_parameters())
    assert torch.equal(t["model.layers.0.self_attn.q_proj.weight"], params["layers.0.attn.q_proj.weight"].to(torch.bfloat16))
    assert torch.equal(t["model.layers.1.mlp.gate_proj.weight"], params["layers.1.mlp.gate_up.weight"][:96].to(torch.bfloat16))
    assert torch.equal(t["model.layers.0.mlp.gate.weight"], params["layers.0.mlp.router.weight"].to(torch.bfloat16))
    assert not any(k.endswith("weight_packed") and ("self_attn" in k or ".mlp.gate." in k) for k in t)


def test_w4a4_all_linear_export_with_calibrated_input_scales(model, tmp_path):
    recipe = Recipe("w4a4", sites="all-linear")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    amax = calibrate_input_amax(model, [(ids, mask), {"input_ids": ids[:1]}])
    with pytest.raises(ValueError, match="input_amax"):
        export_nvfp4(model, tmp_path / "x", recipe)
    cfg = export_nvfp4(model, tmp_path, recipe, input_amax=amax)
    t = _tensors(tmp_path)
    packed = model.pack_weights(recipe)
    qc = cfg["quantization_config"]
    QuantizationConfig.model_validate(qc)
    assert qc["config_groups"]["group_0"]["input_activations"]["dynamic"] == "local"
    assert "model.layers.0.self_attn.q_proj" not in qc["ignore"] and "model.layers.0.mlp.gate" in qc["ignore"]
    for i in range(4):
        a = f"model.layers.{i}.self_attn"
        for n in "qkvo":
            want = fp4.dequantize(packed[f"layers.{i}.attn.{n}_proj.weight"], torch.bfloat16)
            assert torch.equal(_decompress(t, f"{a}.{n}_proj"), want)
        # q/k/v share one global scale (a fused qkv in vLLM)
        gs = [t[f"{a}.{n}_proj.weight_global_scale"] for n in "qkv"]
        assert torch.equal(gs[0], gs[1]) and torch.equal(gs[0], gs[2])
        # static input scale = 2688 / max |x| of the site over real tokens
        site_amax = amax[f"layers.{i}.attn.q_proj.input"]
        assert torch.equal(t[f"{a}.q_proj.input_global_scale"], (2688.0 / site_amax).reshape(1).float())
    dense = fp4.dequantize(packed["layers.1.mlp.gate_up.weight"], torch.bfloat16)
    assert torch.equal(_decompress(t, "model.layers.1.mlp.up_proj"), dense[96:])
    assert torch.equal(t["model.layers.1.mlp.gate_proj.weight_global_scale"], t["model.layers.1.mlp.up_proj.weight_global_scale"])
    down_amax = amax["layers.0.mlp.experts.down.input"]
    for e in (0, 7):
        assert torch.equal(t[f"model.layers.0.mlp.experts.{e}.down_proj.input_global_scale"], (2688.0 / down_amax).reshape(1))


def test_calibration_ignores_padding(model):
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    base = calibrate_input_amax(model, [ids])
    big = torch.full((1, 4), 5)
    padded = calibrate_input_amax(model, [(torch.cat([big, ids], 1), torch.cat([torch.zeros(1, 4), torch.ones(1, 8)], 1))])
    # left padding moves no real token's activations (up to float noise: the model is bf16, so one
    # bf16 ulp, 2^-7 relative, at a site whose maximum went through a longer reduction)
    for site, v in base.items():
        torch.testing.assert_close(padded[site], v, rtol=2**-7, atol=1e-4, msg=site)
    # and counting the padding would move most maxima by far more (so this test can fail)
    unmasked = calibrate_input_amax(model, [torch.cat([big, ids], 1)])
    moved = sum(bool((unmasked[s] - v).abs() > v / 64) for s, v in base.items())
    assert moved > len(base) // 2


def test_export_from_hf_folder_and_errors(model, tmp_path):
    m = M.build("tiny", seed=2, arch="mixtral", qk_norm="none", router="topk_softmax")
    m.save_pretrained(tmp_path / "hf")
    export_nvfp4(tmp_path / "hf", tmp_path / "out", Recipe("w4a16"))
    t = _tensors(tmp_path / "out")
    q = fp4.dequantize(m.pack_weights(Recipe("w4a16"))["layers.3.mlp.experts.gate_up.weight"], torch.bfloat16)
    assert torch.equal(_decompress(t, "model.layers.3.block_sparse_moe.experts.5.w3"), q[5, 128:])
    with pytest.raises(ValueError, match="mxfp4"):
        export_nvfp4(model, tmp_path / "y", Recipe("w4a16", fmt="mxfp4"))
    with pytest.raises(ValueError, match="save_pretrained"):
        export_nvfp4(model, tmp_path / "y", Recipe("bf16"))
