"""Sandbox throughput: how many short programs per second the `code` task's reward can evaluate.

Runs the code task's reference solutions plus a share of wrong, crashing and looping programs (as a
policy early in training writes them) through `Sandbox.run_many`, checks that no process was left
behind, prints programs/second and writes bench/results/sandbox_throughput.json.

    python bench/sandbox_throughput.py               # 400 programs, workers = 2 x cores
    python bench/sandbox_throughput.py --n 1000 --workers 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from tracerl.tasks.code import CodeTask
from tracerl.tasks.sandbox import _UID_BASE, _UID_SPAN, Sandbox

BAD = {
    7: " return x+",  # syntax error
    11: " return undefined_name",  # runtime error
    13: " return [v for v in x]*0 if x else None",  # wrong answer
}


def programs(n: int, loopers: int) -> tuple[CodeTask, list, list[str]]:
    """n code-task prompts and completions: mostly correct, some wrong, `loopers` infinite loops."""
    task = CodeTask()
    prompts = task.prompts("train", n, seed=0)
    completions = []
    for i, p in enumerate(prompts):
        if i < loopers:
            completions.append(" while True:\n  pass")
        else:
            completions.append(next((v for k, v in BAD.items() if i % k == 0), task.solve(p)))
    return task, prompts, completions


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400, help="programs to evaluate")
    ap.add_argument("--workers", type=int, default=None, help="concurrent children (default 2 x cores)")
    ap.add_argument("--loopers", type=int, default=0, help="how many programs loop until the CPU limit")
    ap.add_argument("--out", default="bench/results/sandbox_throughput.json")
    args = ap.parse_args()

    task, prompts, completions = programs(args.n, args.loopers)
    workers = args.workers or 2 * (os.cpu_count() or 1)
    task.workers = workers
    task.rewards(prompts[:4], completions[:4])  # warm the page cache and the interpreter

    serial = Sandbox(task.limits)
    t = time.perf_counter()
    k = min(50, args.n)
    for p, c in zip(prompts[:k], completions[:k]):
        serial.run(p.text + c, [tt["args"] for tt in p.meta["tests"]])
    serial_rate = k / (time.perf_counter() - t)

    t = time.perf_counter()
    rewards = task.rewards(prompts, completions)
    elapsed = time.perf_counter() - t
    rate = args.n / elapsed
    leaked = _leftover_children(os.getpid()) + _sandbox_uid_processes()
    statuses: dict[str, int] = {}
    for r in rewards:
        key = r.info.get("status") or r.info.get("reason", "?")
        statuses[key] = statuses.get(key, 0) + 1
    result = {
        "programs": args.n, "workers": workers, "loopers": args.loopers, "seconds": round(elapsed, 3),
        "programs_per_s": round(rate, 1), "serial_programs_per_s": round(serial_rate, 1),
        "mean_reward": round(sum(r.value for r in rewards) / len(rewards), 4), "statuses": statuses,
        "leaked_processes": len(leaked), "cpus": os.cpu_count(), "cpu_model": cpu_model(),
        "kernel": platform.release(), "python": platform.python_version(), "root": os.geteuid() == 0,
        "git": _git_rev(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    print(f"{rate:.1f} programs/s with {workers} workers ({args.n} programs in {elapsed:.2f} s; "
          f"serial {serial_rate:.1f}/s); statuses {statuses}; leaked processes: {len(leaked)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if leaked:
        sys.exit(f"leaked processes: {leaked}")


def _leftover_children(me: int) -> list[int]:
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == me:
                        kids.append(int(name))
            except (OSError, ValueError):
                pass
    return kids


def _sandbox_uid_processes() -> list[int]:
    """Processes still running under a sandbox's private uid (only used when running as root)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status", "rb") as f:
                    uid = next(int(line.split()[1]) for line in f if line.startswith(b"Uid:"))
                if _UID_BASE <= uid < _UID_BASE + _UID_SPAN:
                    found.append(int(name))
            except (OSError, ValueError, StopIteration):
                pass
    return found


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
