"""Does RL at a given learning rate raise or lower the reward? One suite row at several rates, one warm start.

The small suite's first version ran RL at lr 3e-4 and every arith row's sampled reward fell from
0.91 to 0.5-0.6 within 5 steps (reports/small-v1). Before a full suite run, this trains one row
(bf16 by default) of one task at each rate from the suite's shared warm start and prints the
reward at the start and the end, the fraction of steps with a nonzero gradient and the held-out
reward:

    PYTHONPATH=src python3 bench/lr_probe.py --suite small --task arith --lrs 3e-5,1e-4 --out $OUT/lr_probe.json

`--vary KEY=V1,V2` varies any other setting the same way, e.g. the rollout engine in RL (the graph
engine's A/B against the reference engine: same warm start, same seeds, rewards and step times):

    PYTHONPATH=src python3 bench/lr_probe.py --suite small --task arith --row trace \
        --vary rollout.engine=reference,graph --out $OUT/engine_ab.json

Runs go to --work (cells, checkpoints); weights and the warm start to --cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tracerl.experiments import Suite, _warm_state, _with, run_cell, run_config, run_one  # noqa: E402


def summary(rec: dict, key: str = "train.lr", value: str | None = None) -> dict:
    """Start (first 3 steps) and end (last 5) sampled reward, steps that moved the policy, held-out reward."""
    h = rec["history"]
    steps = [x for x in h if "timing/rollout_s" in x]
    return {"lr": rec["config"]["train"]["lr"], "key": key, "value": value,
            "rollout_s_per_step": statistics.fmean(x["timing/rollout_s"] for x in steps) if steps else None,
            "reward_first3": statistics.fmean(x["reward/mean"] for x in h[:3]),
            "reward_last5": statistics.fmean(x["reward/mean"] for x in h[-5:]),
            "steps_with_gradient": sum(x.get("train/grad_norm", 0) > 0 for x in h) / len(h),
            "heldout_reward": rec["final_eval"]["eval/reward"], "wall_s": rec["wall_s"],
            "seed": rec["config"]["train"]["seed"],
            "kl_k3_mean": statistics.fmean(x["mismatch/kl_k3"] for x in h) if "mismatch/kl_k3" in h[0] else None,
            "flips_mean": statistics.fmean(x["flips/act_frac"] for x in h) if "flips/act_frac" in h[0] else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="small")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--row", default="bf16")
    ap.add_argument("--lrs", default="3e-5,1e-4")
    ap.add_argument("--vary", default=None, help="KEY=V1,V2: vary this setting instead of the lr")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds, each from its own warm start "
                    "(default: the suite's first seed)")
    ap.add_argument("--device", default=None, help="override run.device (default: the suite's)")
    ap.add_argument("--overrides", nargs="*", default=[], help="more config overrides, e.g. train.steps=5")
    ap.add_argument("--configs", default="configs/compare")
    ap.add_argument("--work", default="out/lr_probe")
    ap.add_argument("--cache", default=None, help="warm starts and weights (default: <work>/cache); the suite's "
                    "reports/<suite>/cache shares the warm start with a suite run after it")
    ap.add_argument("--out", default="out/lr_probe.json")
    args = ap.parse_args(argv)
    suite = Suite.load(args.suite, args.configs)
    if args.task not in suite.tasks:
        raise SystemExit(f"task {args.task!r} is not in suite {args.suite!r} ({list(suite.tasks)})")
    work = Path(args.work)
    cache = Path(args.cache) if args.cache else work / "cache"
    (work / "cells").mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    extra = [*args.overrides, *([f"run.device={args.device}"] if args.device else [])]
    if args.vary:
        key, sep, values = args.vary.partition("=")
        if not sep or not values:
            raise SystemExit(f"--vary {args.vary!r}: expected KEY=V1,V2 (e.g. rollout.engine=reference,graph)")
        variants = [(key, v) for v in values.split(",")]
    else:
        variants = [("train.lr", str(float(lr))) for lr in args.lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else suite.seeds[:1]
    runs = []
    for seed in seeds:
        base = _with(run_config(suite, args.row, args.task, seed, work, args.configs), extra)
        runs += [(base, key, value) for key, value in variants]
    rows = []
    warm: dict = {}
    for base, key, value in runs:
        cfg = _with(base, [f"{key}={value}"])
        # a run already in cells/ is read back, so its seed's warm start is not recomputed for it
        if base.train.seed not in warm and not run_cell(work / "cells", cfg).exists():
            warm[base.train.seed] = _warm_state(base, cache, print)
        rec = run_one(cfg, warm.get(base.train.seed), work / "cells", cache, print)
        rows.append(summary(rec, key, value))
        r = rows[-1]
        step = "-" if r["rollout_s_per_step"] is None else f"{r['rollout_s_per_step']:.2f}"
        kl = "" if r["kl_k3_mean"] is None else f", kl_k3 {r['kl_k3_mean']:.2e}"
        print(f"seed {r['seed']} {key}={value}: sampled reward {r['reward_first3']:.3f} -> {r['reward_last5']:.3f}, "
              f"{r['steps_with_gradient']:.0%} of steps with a gradient, held-out {r['heldout_reward']:.3f}, "
              f"rollout {step} s/step{kl}, {r['wall_s']:.0f} s", flush=True)
        # after every run: a probe cut by its time limit keeps the runs it finished
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"suite": args.suite, "task": args.task, "row": args.row,
                                              "overrides": extra, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
