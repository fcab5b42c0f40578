"""Test-wide settings."""

import os
import shutil
import sys
from pathlib import Path

# before any CUDA work, as the CLI does: the trainer's deterministic kernels need it for cuBLAS
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

# tiny models do not gain from intra-op threads, and two threads on a shared 2-core CI machine
# thrash (10x slower); see docs/decisions.md
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))

# Property tests draw fixed examples by default, so `make test` and CI pass or fail the same way
# on every run (a random draw once failed CI on a tolerance, not a bug). To hunt for new
# counterexamples: `pytest --hypothesis-profile=explore` (random draws, more of them); keep any
# counterexample it finds as an @example.
from hypothesis import settings  # noqa: E402

settings.register_profile("default", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile("default")


# A suite small enough to train end to end in seconds on CPU: tests of `tracerl compare` and of
# bench/lr_probe.py run it as `--suite micro` from the `configs` folder below.
MICRO = """
base:
  model: {preset: tiny}
  rollout: {prompts_per_step: 2, samples_per_prompt: 2, max_new_tokens: 6}
  train: {steps: 2, compute_dtype: float32}
  warm_start: {steps: 3, batch_size: 4, examples: 16}
  task: {eval_prompts: 4}
tasks:
  arith: []
seeds: [0]
rows: [bf16]
study_prompts: 2
study_samples: 2
"""


@pytest.fixture()
def configs(tmp_path: Path) -> Path:
    """A copy of configs/compare with the micro suite added (suite-micro.yaml)."""
    d = tmp_path / "configs"
    shutil.copytree(Path(__file__).resolve().parents[1] / "configs" / "compare", d)
    (d / "suite-micro.yaml").write_text(MICRO)
    return d
