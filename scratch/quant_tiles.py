"""Device scratch: the per-row-global quantize (+ BF16 dequant_out) at the decoder's expert-input shapes,
over row-fused tiles (BM, BK, num_warps); bit-equality with the default tile checked. Prints JSON lines."""
import json
import sys

import torch

sys.path.insert(0, "bench")
from gemm_profile import graph_ms  # noqa: E402

from tracerl.kernels import fp4_quant as fq  # noqa: E402

for M, K in ((14208, 768), (1776, 2048), (4352, 768), (544, 2048)):
    x = torch.randn(M, K, device="cuda").bfloat16()
    dq = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    ref = fq.quantize(x, "nvfp4", per_row_global=True, dequant_out=dq)[0]
    ref_dq = dq.clone()
    nbytes = M * K * 2 * 2 + M * K // 2 + M * K // 16 + M * 4
    for cfg in (None, (1, 1024, 4), (1, 256, 2), (2, 256, 4), (4, 256, 4), (8, 256, 8), (4, 256, 8), (2, 512, 4),
                (4, 512, 8), (8, 256, 4), (16, 256, 8), (2, 1024, 8), (4, 1024, 8), (1, 2048, 8), (2, 2048, 8)):
        if cfg and K % cfg[1] and cfg[1] < K:
            continue
        try:
            q = fq.quantize(x, "nvfp4", per_row_global=True, dequant_out=dq, config=cfg)[0]
            same = bool(torch.equal(q.codes, ref.codes) and torch.equal(q.scales.view(torch.uint8),
                        ref.scales.view(torch.uint8)) and torch.equal(q.global_scale, ref.global_scale)
                        and torch.equal(dq, ref_dq))
            ms = graph_ms(lambda: fq.quantize(x, "nvfp4", per_row_global=True, dequant_out=dq, config=cfg))
            print(json.dumps({"M": M, "K": K, "config": cfg, "us": ms * 1e3, "GBps": nbytes / ms / 1e6, "same": same}),
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"M": M, "K": K, "config": cfg, "error": str(e)[:200]}), flush=True)
