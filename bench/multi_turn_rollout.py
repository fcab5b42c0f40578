"""Multi-turn rollout cost: one `collect` of maze episodes (policy turns + environment observations).

Counts the engine's forwards per turn (one for a turn's observation tokens, one per sampled token)
and times the rollout; prints a line and writes bench/results/multi_turn_rollout_<device>.json.

    python bench/multi_turn_rollout.py                                   # tiny, CPU
    python bench/multi_turn_rollout.py --preset small --device cuda --recipe w4a4kv4
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from tracerl import model as M
from tracerl import qat
from tracerl import tasks as T
from tracerl.rl.collect import collect
from tracerl.rollout import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--recipe", default="w4a4kv4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype = torch.bfloat16
    task = T.get("maze")
    model = M.build(args.preset, seed=0).to(dev)
    eng = Engine(model, qat.Recipe(args.recipe), dtype=dtype, device=dev)
    prompts = task.prompts("train", args.prompts, seed=1)
    collect(eng, task, prompts[:2], samples_per_prompt=2, max_new_tokens=task.max_new_tokens, seed=0)  # warm-up

    columns: list[int] = []
    forward = eng._forward
    eng._forward = lambda st, rows, start, end: columns.append(end - start) or forward(st, rows, start, end)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    c = collect(eng, task, prompts, samples_per_prompt=args.samples, max_new_tokens=task.max_new_tokens, seed=0)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dt = time.perf_counter() - t0
    eng._forward = forward
    b = c.batch
    res = {
        "preset": args.preset, "recipe": args.recipe, "device": str(dev),
        "machine": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine(),
        "episodes": len(b), "turns_mean": c.turns, "columns": int(b.tokens.shape[1]),
        "forwards": len(columns), "forward_columns": sum(columns),
        "policy_tokens": int(b.policy_mask.sum()), "env_and_prompt_tokens": int((b.attention_mask & ~b.policy_mask).sum()),
        "rollout_s": dt, "ms_per_forward": 1000 * dt / max(len(columns), 1),
        "reward_mean": float(c.rewards.mean()), "torch": torch.__version__,
    }
    print(f"{res['episodes']} maze episodes, {res['turns_mean']:.1f} turns: {res['forwards']} forwards "
          f"({res['forward_columns']} columns) in {dt:.2f} s, {res['ms_per_forward']:.1f} ms/forward")
    out = Path(args.out or f"bench/results/multi_turn_rollout_{dev.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
