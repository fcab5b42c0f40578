"""Command line: `tracerl train | compare | eval | export`.

    tracerl train --config configs/tiny-arith.yaml [section.key=value ...]
    tracerl train --resume runs/tiny-arith
    tracerl compare --suite tiny
    tracerl eval --run runs/tiny-arith [--recipe w4a4kv4]
    tracerl export --format nvfp4 CHECKPOINT_DIR OUT_DIR [--recipe w4a4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

console = Console()


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console, transient=False,
    )


def cmd_train(args: argparse.Namespace) -> int:
    """Run (or resume) an RL training job with a live progress bar and a final summary."""
    from tracerl.config import Config, load_config
    from tracerl.rl.report import plot_run, summary_rows
    from tracerl.rl.trainer import Trainer, TrainingDiverged

    if args.resume:
        run_dir = Path(args.resume)
        cfg = load_config(run_dir / "config.yaml", args.overrides)
        # a resumed run lives where it was started, whatever the overrides say
        cfg.run.out_dir, cfg.run.name = str(run_dir.parent), run_dir.name
        Config.__post_init__(cfg)
    else:
        cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg, resume=bool(args.resume))
    before: dict[str, float] | None = None  # held-out accuracy of the warm-started policy, before RL
    console.print(f"[bold]tracerl train[/] {trainer.dir}  model={cfg.model.path or cfg.model.preset} "
                  f"task={cfg.task.name} rollout={cfg.rollout.recipe}/{cfg.rollout.format} "
                  f"alignment={cfg.train.alignment} R3={cfg.train.routing_replay} correction={cfg.correction.kind}")
    try:
        with _progress() as prog:
            if not args.resume:
                ws = prog.add_task("warm start", total=max(cfg.warm_start.steps, 1), info="")
                trainer.warm_start(lambda s, loss: prog.update(ws, completed=s + 1, info=f"loss {loss:.3f}"))
                prog.update(ws, completed=max(cfg.warm_start.steps, 1))
                before = trainer.evaluate()
            rl = prog.add_task("RL", total=cfg.train.steps, completed=trainer.step, info="")
            while trainer.step < cfg.train.steps:
                m = trainer.train_step()
                prog.update(rl, completed=trainer.step, info=(
                    f"reward {m['reward/mean']:.3f}  kl {m['mismatch/kl_k3']:.2e}  "
                    f"flips {m.get('flips/act_frac', float('nan')):.4f}  "
                    f"guide {m['guidance/bytes_per_token']:.0f} B/tok"))
    except TrainingDiverged as e:
        console.print(f"[bold red]stopped:[/] {e}")
        return 3
    finally:
        trainer.close()
    table = Table(title=f"summary: {trainer.dir}")
    table.add_column("metric")
    table.add_column("first", justify="right")
    table.add_column("last", justify="right")
    for name, first, last in summary_rows(trainer.history):
        table.add_row(name, first, last)
    console.print(table)
    if before is not None:
        last = trainer.history[-1] if trainer.history else {}
        after = last if "eval/acc" in last else trainer.evaluate()
        console.print(f"held-out accuracy ({cfg.rollout.recipe}, greedy): before RL {before['eval/acc']:.3f}, "
                      f"after {after['eval/acc']:.3f}")
    png = plot_run(trainer.history, trainer.dir / "summary.png")
    console.print(f"metrics: {trainer.dir / 'metrics.jsonl'}   plot: {png}   checkpoint: {trainer.dir / 'checkpoint.pt'}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Held-out accuracy of a run's policy, deployed in a given precision."""

    from tracerl import model as M
    from tracerl import qat
    from tracerl import tasks as T
    from tracerl.config import config_from_dict, load_config
    from tracerl.rl import checkpoint as ckpt
    from tracerl.rl.evaluate import evaluate
    from tracerl.rl.trainer import compute_dtype_of, resolve_device, rollout_dtype
    from tracerl.rollout import make_engine

    run = Path(args.run)
    cfg = load_config(run / "config.yaml")
    state = ckpt.load(run / "checkpoint.pt")
    model = M.from_pretrained(cfg.model.path) if cfg.model.path else M.build(cfg.model.preset, seed=cfg.model.seed)
    model.load_state_dict(state["model"])
    task = T.get(cfg.task.name, **cfg.task.options)
    recipe = qat.Recipe(args.recipe or cfg.rollout.recipe, fmt=cfg.rollout.format, sites=cfg.rollout.sites)
    # the run's own device and rollout dtype (not "bf16 whenever a GPU exists", which built a bf16
    # engine on the CPU model of a run.device=cpu run)
    if args.device:
        cfg = config_from_dict(cfg.to_dict(), [f"run.device={args.device}"])
    device = resolve_device(cfg)
    engine = make_engine(cfg.rollout.engine, model, recipe, dtype=rollout_dtype(device, compute_dtype_of(cfg)),
                         device=device)
    r = evaluate(engine, task, n=args.n, max_new_tokens=cfg.rollout.max_new_tokens or task.max_new_tokens)
    console.print_json(json.dumps({"run": str(run), "step": state["step"], "recipe": recipe.name, **r}))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a compressed-tensors NVFP4 checkpoint (what vLLM serves FP4 from)."""
    from tracerl import qat
    from tracerl.model.export import export_nvfp4

    if args.format != "nvfp4":
        console.print(f"[red]unsupported export format {args.format!r}; only nvfp4 is implemented[/]")
        return 2
    out = export_nvfp4(args.checkpoint, args.out, qat.Recipe(args.recipe))
    console.print(f"wrote {out}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Run (or resume) the comparison matrix and write reports/<suite>/report.md."""
    from tracerl.compare_report import write_report
    from tracerl.experiments import run_suite

    tasks = args.tasks.split(",") if args.tasks else None
    results = run_suite(args.suite, out_root=args.out, configs_dir=args.configs,
                        log=lambda s: console.log(s), only_study=args.study_only, tasks=tasks,
                        time_budget=args.time_budget)
    if tasks:
        console.print(f"cached {len(results['runs'])} runs of {tasks}; run without --tasks to write the report")
        return 0
    path = write_report(Path(args.out) / args.suite / "results.json")
    left = f"; partial, {len(results['missing'])} cells left for a later call" if results["missing"] else ""
    console.print(f"wrote {path} ({len(results['runs'])} runs{left})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    p = argparse.ArgumentParser(prog="tracerl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="RL training (GRPO with FP4 rollouts and TRACE)")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="YAML config (see configs/)")
    src.add_argument("--resume", help="run directory to continue (runs/<name>)")
    t.add_argument("overrides", nargs="*", help="section.key=value overrides")
    t.set_defaults(fn=cmd_train)
    e = sub.add_parser("eval", help="held-out accuracy of a run's checkpoint")
    e.add_argument("--run", required=True)
    e.add_argument("--recipe", default=None, help="deploy precision (default: the run's rollout recipe)")
    e.add_argument("--n", type=int, default=128)
    e.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: the run's run.device")
    e.set_defaults(fn=cmd_eval)
    c = sub.add_parser("compare", help="the TRACE comparison matrix (configs/compare/)")
    c.add_argument("--suite", default="tiny", help="configs/compare/suite-<name>.yaml")
    c.add_argument("--out", default="reports")
    c.add_argument("--configs", default="configs/compare")
    c.add_argument("--study-only", action="store_true", help="only the matched-checkpoint mismatch study")
    c.add_argument("--tasks", default=None, help="comma-separated subset of task families (fills the cells only)")
    c.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no new cell that would not finish within SECONDS; writes a partial report")
    c.set_defaults(fn=cmd_compare)
    x = sub.add_parser("export", help="export an HF checkpoint folder as compressed-tensors NVFP4")
    x.add_argument("--format", default="nvfp4")
    x.add_argument("--recipe", default="w4a16", help="w4a16 (weights only) or w4a4 (with input_global_scale)")
    x.add_argument("checkpoint")
    x.add_argument("out")
    x.set_defaults(fn=cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tracerl` command."""
    args = build_parser().parse_args(argv)
    # before any CUDA work: cuBLAS reads it once, and run.deterministic (default) needs it
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
