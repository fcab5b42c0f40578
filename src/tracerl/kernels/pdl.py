"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (sm_90 and later).

A decode step at small batches is ~650 short kernels (13 a layer), most of them a few microseconds, so
the time between one kernel's last CTA and the next kernel's first one is a visible part of the step.
With PDL a kernel is launched with CUDA's programmatic-stream-serialization attribute and may be
scheduled while the kernel before it drains; CUDA graphs keep the dependency as a programmatic edge.

The rule every kernel here follows (`start`): its first statement waits for the previous grid to
complete (`griddepcontrol.wait`: all of that grid's memory operations visible), then lets the next
grid launch (`griddepcontrol.launch_dependents`: it is scheduled once every CTA of this grid has
started or exited, so it never takes an SM from one of ours). No load or store comes before the
wait, so reads of the previous kernel's outputs and writes over its inputs are ordered as without
PDL; and since every CTA waits, a grid cannot complete before its predecessor has, so a kernel two
launches later sees both. Both instructions are no-ops in a launch without the attribute (a kernel
compiled with PDL runs correctly after cuBLAS or a torch op).

Off by default (`ENABLED`): no GPU has timed it yet (docs/decisions.md: a faster kernel that no GPU
has run stays opt-in). The interpreter has no inline PTX, so it never applies there.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = False
# tests/hopper_compile.py compiles for sm_90 on a machine without a GPU: there the CPU tensors stand
# for the device's, and the kernels' PDL variants must compile too
ASSUME_SM90 = False
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def on(device: torch.device | str) -> bool:
    """Whether launches on `device` use PDL: ENABLED, not the interpreter, a CUDA device of sm_90+."""
    if not ENABLED or _INTERPRET:
        return False
    if ASSUME_SM90:
        return True
    d = torch.device(device)
    return d.type == "cuda" and torch.cuda.get_device_capability(d)[0] >= 9


def launch(device: torch.device | str) -> dict:
    """Keyword arguments for a kernel launch: the kernel's PDL constexpr and Triton's `launch_pdl`."""
    return {"PDL": True, "launch_pdl": True} if on(device) else {"PDL": False}


@triton.jit
def start(PDL: tl.constexpr):
    """A kernel's first statement: wait for the previous grid, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
