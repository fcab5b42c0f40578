"""Is a GPU run bit-reproducible? The warm start and a few RL steps, twice each, compared bit for bit.

The small suite caches cells by config hash and resumes across device sessions, which assumes that
a config determines its result. On the H200 the code task's cells re-run in a later session diverged
from the committed ones (the same rollouts for 6 steps, then one different sample), while arith's
re-ran bit for bit. This probe finds which phase differs, with PyTorch's default kernels and with
`torch.use_deterministic_algorithms(True)`:

    PYTHONPATH=src python3 bench/determinism.py --tasks arith,code --out $OUT/determinism.json

Prints one line per (task, mode, phase): whether the two runs' weights are bit-equal, the largest
weight difference, and seconds per run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path

# read when cuBLAS creates its handle: must be set before the first CUDA matmul
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tracerl.experiments import Suite, _with, run_config  # noqa: E402
from tracerl.rl.sft import warm_start  # noqa: E402
from tracerl.rl.trainer import Trainer  # noqa: E402


def _diff(a: dict, b: dict) -> tuple[bool, float]:
    equal = all(torch.equal(a[k], b[k]) for k in a)
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())
    return equal, worst


def _run(cfg, warm_steps: int, rl_steps: int) -> tuple[dict, dict, float]:
    t0 = time.perf_counter()
    tr = Trainer(_with(cfg, ["run.checkpoint_every=0", "run.eval_every=0"]))
    w = cfg.warm_start
    warm_start(tr.model, tr.task, steps=warm_steps, batch_size=w.batch_size, lr=w.lr, examples=w.examples,
               seed=cfg.train.seed, compute_dtype=torch.bfloat16, device=tr.device)
    warm = copy.deepcopy(tr.model.state_dict())
    tr.start_from(warm)
    for _ in range(rl_steps):
        tr.train_step()
    rl = copy.deepcopy(tr.model.state_dict())
    tr.close()
    return warm, rl, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="small")
    ap.add_argument("--row", default="trace")
    ap.add_argument("--tasks", default="arith,code")
    ap.add_argument("--warm-steps", type=int, default=40)
    ap.add_argument("--rl-steps", type=int, default=3)
    ap.add_argument("--modes", default="default,deterministic")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="out/determinism.json")
    args = ap.parse_args(argv)
    suite = Suite.load(args.suite)
    results = []
    for task in args.tasks.split(","):
        cfg = _with(run_config(suite, args.row, task, suite.seeds[0], Path("/tmp/determinism"), "configs/compare"),
                    [f"run.device={args.device}"])
        for mode in args.modes.split(","):
            torch.use_deterministic_algorithms(mode == "deterministic", warn_only=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                a_warm, a_rl, s1 = _run(cfg, args.warm_steps, args.rl_steps)
                b_warm, b_rl, s2 = _run(cfg, args.warm_steps, args.rl_steps)
            # ops without a deterministic kernel only warn (warn_only): name them
            nondet = sorted({str(w.message).split(" does not have a deterministic")[0]
                             for w in caught if "deterministic" in str(w.message)})
            for phase, a, b in (("warm start", a_warm, b_warm), (f"+{args.rl_steps} RL steps", a_rl, b_rl)):
                equal, worst = _diff(a, b)
                results.append({"task": task, "mode": mode, "phase": phase, "bit_equal": equal,
                                "max_abs_diff": worst, "s_per_run": (s1 + s2) / 2, "no_deterministic_kernel": nondet})
                print(f"{task:6s} {mode:13s} {phase:16s} bit-equal {equal!s:5s} max|dw| {worst:.3e} "
                      f"{(s1 + s2) / 2:6.1f} s/run  {'; '.join(nondet)[:200]}", flush=True)
    torch.use_deterministic_algorithms(False)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                          "torch": torch.__version__, "args": vars(args), "results": results},
                                         indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
