"""The mma attention kernel's sm_90 SASS on a machine without a GPU: registers and the main loop's
instruction mix (what fp4_attention_mma's docstring quotes).

    PYTHONPATH=src python scratch/mma_sass.py                  # positions kernel, BT=16
    ROWS=heads BT=32 MAXNREG=144 PYTHONPATH=src python scratch/mma_sass.py
Writes the whole listing to /tmp/mma_<rows>_bt<BT>.sass. The loop is the one ending in the last backward
branch; its count includes the rescale branch's body (32 FMUL a tile, skipped once the running max holds).
"""
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import hopper_compile as hc  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from tracerl import fp4  # noqa: E402
from tracerl.kernels import fp4_attention_mma as fm  # noqa: E402
from tracerl.kernels import fp4_swizzle as fs  # noqa: E402

BT = int(os.environ.get("BT", 16))
ROWS = os.environ.get("ROWS", "positions")
MAXNREG = int(os.environ.get("MAXNREG", 0)) or None

log, kernels = [], []
with hc.compile_only(log, regs=True):
    compile_ = JITFunction.run

    def keep(self, *a, **kw):
        k = compile_(self, *a, **kw)
        kernels.append(k)
        return k

    JITFunction.run = keep
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, Dh, L = 3, 32, 4, 128, 80
    q = torch.randn(B, H, Dh, generator=g).bfloat16()
    kq = fp4.quantize(torch.randn(B, L, Hkv, Dh, generator=g), "nvfp4", per_row_global=True)
    sc, ss = fs.swizzle_blocks(kq.codes, kq.scales.view(torch.uint8))
    po, pml = torch.empty(B, H, 1, Dh), torch.empty(B, H, 1, 2)
    lens = torch.tensor([1, 40, L], dtype=torch.int32)
    fm.launch(q, sc, ss, kq.global_scale, sc, ss, kq.global_scale, lens, po, pml, 0.088, L, BT, S=1, out=torch.empty(B, H * Dh, dtype=torch.bfloat16), maxnreg=MAXNREG, rows=ROWS)
print(ROWS, f"BT={BT}", f"maxnreg={MAXNREG}", log[-1][1]["usage"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(kernels[-1].asm["cubin"])
    f.flush()
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
with open(f"/tmp/mma_{ROWS}_bt{BT}.sass", "w") as f:
    f.write(sass)
ins = [(int(m.group(1), 16), m.group(2)) for m in
       (re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
back = [(int(m.group(1), 16), a) for a, t in ins for m in [re.search(r"BRA\s.*?0x([0-9a-f]+)", t)]
        if m and int(m.group(1), 16) < a]
start, end = max(back, key=lambda se: se[1] - se[0])  # the outermost backward branch: the tile-pair loop
body = [t for a, t in ins if start <= a <= end]
ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
print(f"loop {start:#x}-{end:#x}: {len(body)} instructions, {len(body) / 2:.0f} a {BT}-position tile")
print("  " + ", ".join(f"{k}:{v}" for k, v in ops.most_common()))
