"""Test-wide settings."""

import sys
from pathlib import Path

import torch

# tiny models do not gain from intra-op threads, and two threads on a shared 2-core CI machine
# thrash (10x slower); see docs/decisions.md
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
