"""Independent FP4 references for the tests: compressed-tensors' own NVFP4/MXFP4 compressors."""

from __future__ import annotations

import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4, NVFP4
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam


def ct_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' NVFP4 compression of a 2-D weight (observer math as llm-compressor does)."""
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4)
    gs = generate_gparam(w.amin(), w.amax())
    m, n = w.shape
    wb = w.reshape(m, n // 16, 16)
    scale, _ = calculate_qparams(wb.amin(-1), wb.amax(-1), scheme.weights, global_scale=gs)
    state = {"weight": w, "weight_scale": scale, "weight_global_scale": gs}
    out = NVFP4PackedCompressor.compress(state, scheme)
    out["dequantized"] = NVFP4PackedCompressor.decompress(dict(out), scheme)["weight"]
    return out


def ct_mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' MXFP4 compression of a 2-D weight."""
    scheme = QuantizationScheme(targets=["Linear"], **MXFP4)
    m, n = w.shape
    wb = w.reshape(m, n // 32, 32)
    scale, _ = calculate_qparams(wb.amin(-1), wb.amax(-1), scheme.weights)
    out = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    return out
