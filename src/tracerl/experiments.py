"""The TRACE comparison matrix (`tracerl compare --suite tiny|small`): runs, caching, results.json.

Rows (configs/compare/<row>.yaml, each a set of overrides on the suite's base config):
  bf16, fp4-naive, fp4-tis, fp4-qat, fp4-qat-r3, trace, trace-full, and `ptq` (row 1's final
  policy quantized post hoc to w4a4kv4; evaluation only).
For every task family and seed, one supervised warm start is shared by all rows (same weights,
same seeds, so rows differ only in what they are about). Each (row, task, seed) run's record is
kept in reports/<suite>/cells/run-<hash>.json by the hash of its full resolved config, so adding a
row or a seed does not re-run the others, and an interrupted suite resumes where it stopped. The
cells are small JSON and are committed, which is how the GPU suite resumes across device sessions;
weights (warm starts, final policies) live in reports/<suite>/cache/ and are not committed.

A run can be given a time budget (`--time-budget`): work is done in priority order (the bf16
study, then bf16 + ptq, trace, fp4-naive, fp4-qat-r3, fp4-qat, fp4-tis, trace-full, then the
float32 control study) and no new cell is started once the budget would be exceeded by it (its
cost estimated from the cells of the same kind already run in this process). results.json is
then written with `complete: false` and the missing cells listed, and the report says so.

Besides training, a controlled study at matched checkpoints: from each task's warm-start policy,
one fixed FP4 rollout batch is scored by every alignment (none / qat / qat+R3 / trace / trace-full)
and by a CachePolicy sweep (layers all / deepest half / deepest quarter x encodings codes / lsb /
ties): the same work, so the mismatch differences are due to alignment alone.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
import yaml

from tracerl import qat
from tracerl.config import Config, apply_overrides, config_from_dict
from tracerl.guidance import CachePolicy
from tracerl.rl import checkpoint as ckpt
from tracerl.rl.alignment import alignment_report
from tracerl.rl.collect import collect
from tracerl.rl.evaluate import evaluate
from tracerl.rl.sft import warm_start
from tracerl.rl.trainer import WARM_CHECK_PROMPTS, WARM_CHECK_SAMPLES, WARM_CHECK_SEED, Trainer
from tracerl.rollout import Engine, make_engine

ROWS = ("bf16", "fp4-naive", "fp4-tis", "fp4-qat", "fp4-qat-r3", "trace", "trace-full")
DEPLOY = "w4a4kv4"  # how FP4 rows (and ptq) are deployed
SWEEP_LAYERS = {"all": "all", "deepest half": "fraction:0.5", "deepest quarter": "fraction:0.25"}
SWEEP_ENCODINGS = ("codes", "lsb", "ties")


@dataclass
class Suite:
    """A suite file: base config, tasks with their overrides, seeds, rows."""

    name: str
    base: dict
    tasks: dict[str, list[str]]
    seeds: list[int]
    rows: list[str]
    study_prompts: int = 8
    study_samples: int = 4

    @staticmethod
    def load(name: str, configs_dir: str | Path = "configs/compare") -> Suite:
        """Read configs/compare/suite-<name>.yaml."""
        path = Path(configs_dir) / f"suite-{name}.yaml"
        if not path.is_file():
            have = sorted(p.stem.removeprefix("suite-") for p in Path(configs_dir).glob("suite-*.yaml"))
            raise FileNotFoundError(f"no suite {name!r} ({path} missing); available: {have}")
        d = yaml.safe_load(path.read_text())
        rows = d.get("rows", list(ROWS))
        unknown = set(rows) - set(ROWS)
        if unknown:
            raise ValueError(f"{path}: unknown rows {sorted(unknown)}; rows are {ROWS}")
        return Suite(name, d["base"], {k: list(v or []) for k, v in d["tasks"].items()}, list(d["seeds"]), rows,
                     d.get("study_prompts", 8), d.get("study_samples", 4))


def row_overrides(row: str, configs_dir: str | Path = "configs/compare") -> dict:
    """The overrides a row file holds (nested dict)."""
    path = Path(configs_dir) / f"{row}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"row config {path} missing")
    return yaml.safe_load(path.read_text()) or {}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_config(suite: Suite, row: str, task: str, seed: int, out_dir: Path, configs_dir: str | Path) -> Config:
    """The fully resolved Config of one (row, task, seed) run."""
    # _merge shares the sections a row does not touch with suite.base: copy before the task's
    # overrides are applied in place, or one task's overrides leak into every later config
    data = copy.deepcopy(_merge(suite.base, row_overrides(row, configs_dir)))
    data = apply_overrides(data, suite.tasks[task])
    return config_from_dict(data, [f"task.name={task}", f"train.seed={seed}", f"model.seed={seed}",
                                   f"run.name={row}-{task}-s{seed}", f"run.out_dir={out_dir / 'runs'}",
                                   "run.tensorboard=false"])


# Settings a mismatch study never reads: it measures the warm-start policy on the reference engine.
STUDY_UNUSED = ("train.lr", "rollout.engine")


def study_config(suite: Suite, task: str, seed: int, out_dir: Path, configs_dir: str | Path) -> Config:
    """The Config of a task's mismatch study (its cell key): the trace row's, less the task's RL-only overrides.

    A task that changes only how RL trains (small/maze's lr and rollout engine) keeps its studies,
    and a study cell made before such a change still matches.
    """
    kept = [o for o in suite.tasks[task] if o.split("=", 1)[0].strip() not in STUDY_UNUSED]
    return run_config(replace(suite, tasks={**suite.tasks, task: kept}), "trace", task, seed, out_dir, configs_dir)


def study_cell_name(task: str, dtype_name: str, study_cfg: Config) -> str:
    """The file name of a mismatch study's cell (keyed by its `study_config`)."""
    return f"study-{task}-{dtype_name}-{config_hash(study_cfg)}.json"


def config_hash(cfg: Config) -> str:
    """Stable hash of everything that determines a run's results (not where it is written).

    `run.eval_every` only adds held-out measurements (greedy, own seed: training is unchanged,
    tested), so it is hashed as 0, the value every cell had before suites evaluated per step:
    those cells keep their hashes and are topped up with per-step evals when the budget allows.
    `run.deterministic` is left out: it picks kernels, not the experiment. Without it a GPU run is
    one draw among runs that differ in the last bits; with it the same draw every time. Cells run
    before it existed stay valid (their records have no `deterministic` field).
    """
    d = _settings(cfg)
    d["run"] = {k: v for k, v in d["run"].items() if k not in ("name", "out_dir", "tensorboard", "deterministic")}
    d["run"]["eval_every"] = 0
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _settings(cfg: Config) -> dict:
    """cfg as a dict, less the settings added after suites had committed cells while they keep the
    earlier behaviour: the cells run before those settings existed keep their hashes."""
    d = cfg.to_dict()
    if d["warm_start"]["stop_at_reward"] <= 0:  # off: the warm start runs all its steps, as before
        del d["warm_start"]["stop_at_reward"], d["warm_start"]["check_every"]
    if d["rollout"]["engine"] == "reference":  # the engine every cell ran before the graph engine existed
        del d["rollout"]["engine"]
    return d


def run_stale_reason(rec: dict, cfg: Config) -> str | None:
    """What a run record lacks, as "re-run <key> ..." ends, or None if it is current.

    A record is stale without the per-step held-out evals its config asks for or, from a GPU,
    without the digest of its warm start: GPU runs from before deterministic kernels began from
    warm starts that differ between machines in the last bits (bench/RESULTS.md), so rows of one
    task run in different sessions may not share one. CPU runs are deterministic: their records
    stay current without the digest.
    """
    if cfg.run.eval_every and rec.get("eval_every") != cfg.run.eval_every:
        return "for its per-step held-out evals"
    if rec.get("device", "cpu").startswith("cuda") and "warm_digest" not in rec:
        return "from a recorded, deterministic warm start"
    return None


def warm_cache_path(cfg: Config, cache: Path) -> Path:
    """Where the shared warm start of (task, seed, warm-start settings) is cached."""
    d = _settings(cfg)
    key = {"model": d["model"], "task": d["task"], "warm": d["warm_start"], "seed": cfg.train.seed,
           "device": cfg.run.device}
    if cfg.warm_start.stop_at_reward > 0:  # where it stops depends on how its check samples
        key["check"] = {"temperature": cfg.rollout.temperature, "max_new_tokens": cfg.rollout.max_new_tokens,
                        "compute_dtype": cfg.train.compute_dtype, "prompts": WARM_CHECK_PROMPTS,
                        "samples": WARM_CHECK_SAMPLES, "seed": WARM_CHECK_SEED}
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache / f"warm-{cfg.task.name}-s{cfg.train.seed}-{h}.pt"


class WarmStart(NamedTuple):
    """A shared warm start: its weights, and their `state_digest` (hashed once, not per cell)."""

    state: dict[str, torch.Tensor]
    digest: str


def _warm_state(cfg: Config, cache: Path, log: Callable[[str], None]) -> WarmStart:
    """The shared warm start for (task, seed, warm-start settings), computed once."""
    path = warm_cache_path(cfg, cache)
    if path.exists():
        state = ckpt.load(path)["model"]
        return WarmStart(state, state_digest(state))
    log(f"warm start {cfg.task.name} seed {cfg.train.seed}")
    t = Trainer(_with(cfg, ["run.checkpoint_every=0"]), log=log)  # log: the stop_at_reward checks
    w = cfg.warm_start
    # the shared warm start is plain supervised learning: float32 on CPU (fast), bf16 on GPU
    dtype = torch.bfloat16 if t.device.type == "cuda" else torch.float32
    losses = warm_start(t.model, t.task, steps=w.steps, batch_size=w.batch_size, lr=w.lr, examples=w.examples,
                        seed=cfg.train.seed, compute_dtype=dtype, device=t.device,
                        stop=t.warm_start_stop(), check_every=w.check_every)
    if t.warm_checks:
        last = t.warm_checks[-1]
        reached = "reached" if last["reward"] >= w.stop_at_reward else "did not reach"
        log(f"warm start {cfg.task.name} seed {cfg.train.seed}: {len(losses)} steps; sampled train reward "
            f"{last['reward']:.3f} at step {last['step']} ({reached} {w.stop_at_reward})")
    ckpt.save_atomic({"model": t.model.state_dict(), "losses": losses, "checks": t.warm_checks}, path)
    return WarmStart(t.model.state_dict(), state_digest(t.model.state_dict()))


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 of a state dict's names, dtypes, shapes and bytes: equal digests, bit-identical weights."""
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().cpu().contiguous()
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _with(cfg: Config, overrides: list[str]) -> Config:
    return config_from_dict(cfg.to_dict(), overrides)


def run_cell(cells: Path, cfg: Config) -> Path:
    """Where the record of the run `cfg` is cached in `cells` (named by its config hash)."""
    return cells / f"run-{config_hash(cfg)}.json"


def run_one(cfg: Config, warm: WarmStart, cells: Path, cache: Path, log: Callable[[str], None],
            refresh: bool = False) -> dict:
    """Train one row (its record cached by config hash in `cells`); return the record.

    Every `run.eval_every` steps (and at the end) the policy's held-out reward, deployed in the
    rollout precision, is added to that step's history entry; `final_eval` is the last one.
    """
    h = config_hash(cfg)
    path = run_cell(cells, cfg)
    if path.exists() and not refresh:  # refresh: train again, the old record stands until the new one is written
        return json.loads(path.read_text())
    log(f"train {cfg.run.name}")
    t0 = time.perf_counter()
    tr = Trainer(_with(cfg, ["run.checkpoint_every=0", "run.eval_every=0"]))
    tr.start_from(warm.state)
    every = cfg.run.eval_every
    history = []
    for step in range(1, cfg.train.steps + 1):
        history.append(tr.train_step())
        if every and step % every == 0 and step < cfg.train.steps:
            history[-1].update(tr.evaluate())
    final = tr.evaluate()
    if every:
        history[-1].update(final)
    tr.close()
    model_path = cache / f"model-{h}.pt"
    ckpt.save_atomic({"model": tr.model.state_dict()}, model_path)
    rec = {"name": cfg.run.name, "hash": h, "config": cfg.to_dict(), "history": history,
           "final_eval": final, "wall_s": time.perf_counter() - t0, "model_path": model_path.name,
           "device": str(tr.device), "eval_every": every,
           # which warm start it began from, and whether the GPU kernels were deterministic: rows of one
           # task compare methods only if they share the warm start (the report checks)
           "warm_digest": warm.digest, "deterministic": tr.device.type == "cpu" or cfg.run.deterministic}
    _write_json(path, rec)
    return rec


def _run_summary(rec: dict) -> dict:
    """What results.json keeps of a run record (enough to restore its cell)."""
    return {k: rec[k] for k in ("name", "hash", "history", "final_eval", "wall_s", "eval_every", "device",
                                  "warm_digest", "deterministic") if k in rec}


def _write_json(path: Path, obj: dict, indent: int | None = None) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=indent))
    tmp.replace(path)


def model_path_of(rec: dict, cache: Path) -> Path:
    """Where a run's final weights are (records restored from results.json do not name the file)."""
    return cache / rec.get("model_path", f"model-{rec['hash']}.pt")


def eval_ptq(cfg_bf16: Config, rec_bf16: dict, cache: Path) -> dict:
    """Row 8: the bf16 row's final policy quantized post hoc to w4a4kv4, evaluated as deployed."""
    tr = Trainer(_with(cfg_bf16, ["run.checkpoint_every=0", "run.eval_every=0"]))
    path = model_path_of(rec_bf16, cache)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the bf16 row's final weights are needed for ptq; they are not committed, "
                                f"so delete its cell {rec_bf16['hash']} (cells/run-{rec_bf16['hash']}.json) to re-train it")
    tr.model.load_state_dict(ckpt.load(path)["model"])
    eng = make_engine(cfg_bf16.rollout.engine, tr.model, qat.Recipe(DEPLOY, fmt=cfg_bf16.rollout.format),
                      dtype=tr.engine.dtype, device=tr.device)
    r = evaluate(eng, tr.task, n=cfg_bf16.task.eval_prompts, max_new_tokens=tr.max_new_tokens)
    return {"eval/acc": r["acc"], "eval/reward": r["reward"]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# 2: alignment reports carry the per-token spread of kl_k3 (kl_k3_trim5, kl_k3_top1_share, tokens)
STUDY_SCHEMA = 2


def study_is_current(rec: dict) -> bool:
    """Whether a study record has what the current schema adds (judged by content: the first
    schema-2 records were written before the field existed)."""
    return rec.get("schema", 1) >= STUDY_SCHEMA or all(
        "mismatch/kl_k3_trim5" in a for a in rec["alignments"].values())


def mismatch_study(cfg: Config, warm: WarmStart, suite: Suite, dtype_name: str) -> dict:
    """Alignments and the CachePolicy sweep on one fixed FP4 rollout batch from the warm-start policy."""
    cfg = _with(cfg, [f"train.compute_dtype={dtype_name}", "rollout.recipe=w4a4kv4", "train.alignment=trace"])
    tr = Trainer(_with(cfg, ["run.checkpoint_every=0"]))
    tr.model.load_state_dict(warm.state)
    recipe = tr.recipe
    prompts = tr.task.prompts("train", suite.study_prompts, seed=12345)
    out: dict = {"dtype": dtype_name, "alignments": {}, "sweep": [], "schema": STUDY_SCHEMA,
                 "warm_digest": warm.digest}

    def rollout(policy: CachePolicy | None) -> tuple:
        # the reference engine whatever rollout.engine says: the sweep includes `ties`, which only it records
        eng = Engine(tr.model, recipe, policy, dtype=tr.engine.dtype, device=tr.device, diagnostics=True)
        _sync(tr.device)
        t0 = time.perf_counter()
        col = collect(eng, tr.task, prompts, samples_per_prompt=suite.study_samples,
                      max_new_tokens=tr.max_new_tokens, seed=12345)
        _sync(tr.device)
        return col.batch, time.perf_counter() - t0

    def report(batch, alignment, replay):
        return alignment_report(tr.model, batch, alignment=alignment, recipe=recipe, routing_replay=replay,
                                compute_dtype=tr.compute_dtype, temperature=cfg.rollout.temperature)

    # untimed first pass: kernel compilation and allocator warm-up would otherwise be charged to the
    # unrecorded baseline and make recording look free (the first GPU study printed -86%)
    rollout(CachePolicy("all", "codes+scales", "codes"))
    plain, t_plain = rollout(None)
    out["rollout_s_no_record"] = t_plain
    out["overhead_timing"] = "warmed"
    out["alignments"]["none"] = report(plain, "none", False)
    out["alignments"]["qat"] = report(plain, "qat", False)
    out["alignments"]["qat-r3"] = report(plain, "qat", True)
    for label, layers in SWEEP_LAYERS.items():
        for enc in SWEEP_ENCODINGS:
            pol = CachePolicy(layers, "codes+scales", enc, cfg.guidance.delta)
            batch, t_rec = rollout(pol)
            m = report(batch, "trace", True)
            m.update({"layers": label, "encoding": enc, "bytes_per_token": batch.guidance_bytes_per_token,
                      "rollout_s": t_rec, "recording_overhead": t_rec / t_plain - 1})
            out["sweep"].append(m)
    default = CachePolicy(cfg.guidance.layers, cfg.guidance.fields, cfg.guidance.encoding, cfg.guidance.delta)
    b, _ = rollout(default)
    out["alignments"]["trace"] = report(b, "trace", True) | {"bytes_per_token": b.guidance_bytes_per_token}
    full, _ = rollout(CachePolicy("all", "codes+scales", "codes"))
    out["alignments"]["trace-full"] = report(full, "trace", True) | {"bytes_per_token": full.guidance_bytes_per_token}
    out["tokens_per_batch"] = int(plain.attention_mask.sum())
    return out


ROW_PRIORITY = ("bf16", "trace", "fp4-naive", "fp4-qat-r3", "fp4-qat", "fp4-tis", "trace-full")


class Budget:
    """Wall-clock budget for starting new cells: a cell starts only if the elapsed time plus the
    longest cell of the same kind seen so far (0 before the first) fits."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.t0 = time.perf_counter()
        self.longest: dict[str, float] = {}

    def allows(self, kind: str) -> bool:
        """True if a `kind` cell may start now."""
        if self.seconds is None:
            return True
        return time.perf_counter() - self.t0 + self.longest.get(kind, 0.0) <= self.seconds

    def ran(self, kind: str, seconds: float) -> None:
        """Record that a `kind` cell took `seconds`."""
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)


def _cells_from_results(suite: Suite, out: Path, cells: Path, configs_dir: str | Path) -> int:
    """Write the cells a committed results.json holds but cells/ lacks; return how many.

    Suites run before records lived in cells/ committed only results.json: this keeps them
    re-renderable and resumable. A record is restored only if its config hash is still the one the
    current configs give, so a changed config still re-runs its cells.
    """
    path = out / "results.json"
    if not path.is_file():
        return 0
    old = json.loads(path.read_text())
    n = 0

    def restore(name: str, rec: dict) -> None:
        nonlocal n
        p = cells / name
        if not p.exists():
            _write_json(p, rec)
            n += 1

    def hash_of(row: str, task: str, seed: int) -> str:
        return config_hash(run_config(suite, row, task, seed, out, configs_dir))

    for key, rec in old.get("runs", {}).items():
        row, task, seed = key.split("/")
        if task in suite.tasks and int(seed) in suite.seeds and row in suite.rows \
                and rec.get("hash") == hash_of(row, task, int(seed)):
            restore(f"run-{rec['hash']}.json", rec)
    for key, rec in old.get("ptq", {}).items():
        task, seed = key.split("/")
        bf16 = old.get("runs", {}).get(f"bf16/{key}")
        if bf16 is not None and task in suite.tasks and bf16.get("hash") == hash_of("bf16", task, int(seed)):
            restore(f"ptq-{bf16['hash']}.json", rec)
    for key, rec in old.get("study", {}).items():
        task, dt = key.split("/")
        if task not in suite.tasks or not suite.seeds:
            continue
        # a study record holds no hash of its own: it is current if the trace run of its config is
        h = hash_of("trace", task, suite.seeds[0])
        if old.get("runs", {}).get(f"trace/{task}/{suite.seeds[0]}", {}).get("hash") == h:
            restore(study_cell_name(task, dt, study_config(suite, task, suite.seeds[0], out, configs_dir)), rec)
    return n


def run_suite(name: str, out_root: str | Path = "reports", configs_dir: str | Path = "configs/compare",
              log: Callable[[str], None] = print, only_study: bool = False,
              tasks: list[str] | None = None, time_budget: float | None = None) -> dict:
    """Run (or resume) a suite; write reports/<suite>/results.json and return it.

    `tasks` runs a subset of the suite's task families (e.g. one per process) and writes no
    results.json, so parallel partial runs fill the cells and a final call assembles everything.
    `time_budget` (seconds) stops starting new cells once they would not fit; the results.json
    written then has `complete: false` and lists what is missing.
    """
    suite = Suite.load(name, configs_dir)
    if tasks:
        unknown = set(tasks) - set(suite.tasks)
        if unknown:
            raise ValueError(f"tasks {sorted(unknown)} are not in suite {name!r} ({list(suite.tasks)})")
        suite.tasks = {t: suite.tasks[t] for t in tasks}
    out = Path(out_root) / name
    cache, cells = out / "cache", out / "cells"
    cache.mkdir(parents=True, exist_ok=True)
    cells.mkdir(parents=True, exist_ok=True)
    results: dict = {"suite": name, "tasks": list(suite.tasks), "seeds": suite.seeds, "rows": suite.rows,
                     "runs": {}, "ptq": {}, "study": {}, "deploy_recipe": DEPLOY,
                     # what each task's rows change from the suite's base (maze's lr and engine in small)
                     "task_overrides": {t: list(o) for t, o in suite.tasks.items()}}
    seeded = _cells_from_results(suite, out, cells, configs_dir)
    if seeded:
        log(f"restored {seeded} cells from {out / 'results.json'}")
    budget = Budget(time_budget)
    missing: list[str] = []
    rows = sorted(suite.rows, key=ROW_PRIORITY.index)

    def budgeted(kind: str, compute: Callable[[], dict]) -> dict | None:
        """compute() if the budget still allows a cell of `kind` (its time is counted); else None."""
        if not budget.allows(kind):
            return None
        t0 = time.perf_counter()
        rec = compute()
        budget.ran(kind, time.perf_counter() - t0)
        return rec

    def cell(kind: str, label: str, path: Path, compute: Callable[[], dict]) -> dict | None:
        """The cached record at `path`, or compute it if the budget allows (None: left for later)."""
        old = cache / path.name  # records used to live beside the weights
        if not path.exists() and old.exists():
            old.replace(path)
        if path.exists():
            return json.loads(path.read_text())
        rec = budgeted(kind, compute)
        if rec is None:
            missing.append(label)
            return None
        _write_json(path, rec)
        return rec

    warm_cache: dict = {}
    stale: list[tuple] = []
    stale_runs: list[tuple] = []

    def rerun(cfg: Config, why: str) -> dict | None:
        """Train a cached run again if the budget allows (its old record stands until the new one is written)."""
        def train() -> dict:
            log(why)
            return run_one(cfg, warm_for(cfg), cells, cache, log, refresh=True)
        return budgeted("run", train)

    def warm_for(cfg: Config) -> WarmStart:
        key = (cfg.task.name, cfg.train.seed)
        if key not in warm_cache:
            warm_cache[key] = _warm_state(cfg, cache, log)
        return warm_cache[key]

    for task in suite.tasks:
        for seed in suite.seeds:
            study_cfg = study_config(suite, task, seed, out, configs_dir)
            # bf16 (the RL precision, on which claims are judged) first; float32 is a control, last
            dtypes = ("bfloat16", "float32") if seed == suite.seeds[0] else ()

            def study(dt: str, task: str = task, study_cfg: Config = study_cfg) -> None:
                label = f"{task}/{dt}"
                p = cells / study_cell_name(task, dt, study_cfg)
                if not p.exists() and budget.allows("study"):
                    log(f"mismatch study {task} ({dt})")
                rec = cell("study", f"study {label}", p, lambda: mismatch_study(study_cfg, warm_for(study_cfg), suite, dt))
                if rec is not None:
                    results["study"][label] = rec
                    if not study_is_current(rec):
                        stale.append((label, p, study_cfg, dt))

            if dtypes:
                study(dtypes[0])
            if not only_study:
                for row in rows:
                    cfg = run_config(suite, row, task, seed, out, configs_dir)
                    key = f"{row}/{task}/{seed}"
                    rec = cell("run", key, run_cell(cells, cfg),
                               lambda cfg=cfg: run_one(cfg, warm_for(cfg), cells, cache, log))
                    if rec is None:
                        continue
                    if row == "bf16" and not (cells / f"ptq-{rec['hash']}.json").exists() \
                            and not model_path_of(rec, cache).is_file():
                        # weights stay on the machine that trained them (GBs, not committed): a resumed
                        # suite on a fresh machine re-trains the bf16 row for ptq, and the re-trained
                        # record replaces the old one, so ptq evaluates the run the report shows
                        rec = rerun(cfg, f"re-train {key}: its final weights are not in {cache} and ptq needs them")
                        if rec is None:
                            missing += [key, f"ptq/{task}/{seed}"]
                            continue
                    results["runs"][key] = _run_summary(rec)
                    if (reason := run_stale_reason(rec, cfg)) is not None:
                        stale_runs.append((key, cfg, reason))
                    if row == "bf16":
                        p = cells / f"ptq-{rec['hash']}.json"
                        ptq = cell("ptq", f"ptq/{task}/{seed}", p, lambda cfg=cfg, rec=rec: eval_ptq(cfg, rec, cache))
                        if ptq is not None:
                            results["ptq"][f"{task}/{seed}"] = ptq
            for dt in dtypes[1:]:
                study(dt)
    # runs and studies recorded before the current schema (no per-step evals or, from a GPU, no
    # warm-start digest; no per-token kl spread) are re-run last, once every missing cell is done;
    # until then the old record stands
    for key, cfg, reason in stale_runs:
        rec = rerun(cfg, f"re-run {key} {reason}")
        if rec is None:
            break
        results["runs"][key] = _run_summary(rec)
        if key.startswith("bf16/"):
            # the re-run is another realisation (a warm start recomputed on another machine differs
            # in float summation order): ptq must quantize these weights, or claim (c)'s per-seed
            # pairing compares different trainings
            task_seed = key.split("/", 1)[1]
            ptq = eval_ptq(cfg, rec, cache)
            _write_json(cells / f"ptq-{rec['hash']}.json", ptq)
            results["ptq"][task_seed] = ptq
    for label, p, study_cfg, dt in stale:
        def restudy(label=label, study_cfg=study_cfg, dt=dt) -> dict:
            log(f"mismatch study {label}: re-run (recorded before schema {STUDY_SCHEMA})")
            return mismatch_study(study_cfg, warm_for(study_cfg), suite, dt)
        rec = budgeted("study", restudy)
        if rec is None:
            break
        _write_json(p, rec)
        results["study"][label] = rec
    # the GPU benchmarks' committed JSON (bench/RESULTS.md says how each was made), for the cost section
    for key, name in (("gpu_bench", "rollout_h200.json"), ("engine_bench", "engine_rollout_h200.json")):
        bench = Path("bench/results") / name
        if bench.exists():
            results[key] = json.loads(bench.read_text())
    results["wall_s"] = time.perf_counter() - budget.t0
    results["run_wall_s_total"] = sum(r["wall_s"] for r in results["runs"].values())
    results["complete"] = not missing
    results["missing"] = missing
    if not tasks:
        _write_json(out / "results.json", results, indent=1)
    return results
