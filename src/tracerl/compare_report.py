"""reports/<suite>/report.md and plots, written only from results.json (no figure is typed by hand)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

MISMATCH_KEYS = ("mismatch/kl_k3", "mismatch/logp_abs_diff_mean", "mismatch/frac_ratio_outside_0.5_2", "flips/act_frac")
ALIGN_ROWS = ("none", "qat", "qat-r3", "trace", "trace-full")


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    xs = [float(x) for x in xs if x is not None and x == x]  # drop missing and NaN
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _f(x: float, sci: bool = False) -> str:
    if x != x:  # nan
        return "-"
    return f"{x:.2e}" if sci else f"{x:.3f}"


def _pm(ms: tuple[float, float]) -> str:
    """'mean +- sd', or '-' where nothing was measured."""
    return "-" if ms[0] != ms[0] else f"{_f(ms[0])} +- {_f(ms[1])}"


def _row_runs(results: dict, row: str, task: str) -> list[dict]:
    """The run records of `row` on `task`, one per seed that ran."""
    return [r for k, r in results["runs"].items() if k.split("/")[:2] == [row, task]]


def _row_values(results: dict, row: str, task: str, fn) -> list[float]:
    return [fn(r) for r in _row_runs(results, row, task)]


def _final_train_reward(rec: dict, last: int = 5) -> float:
    h = rec["history"][-last:]
    return statistics.fmean(x["reward/mean"] for x in h)


def _first_train_reward(rec: dict, first: int = 3) -> float:
    """Sampled reward of the first steps: the warm-started policy, before RL has moved it much."""
    return statistics.fmean(x["reward/mean"] for x in rec["history"][:first])


def _task_runs(results: dict, task: str) -> list[dict]:
    """The run records of every row and seed on `task`."""
    return [r for k, r in results["runs"].items() if k.split("/")[1] == task]


def rl_lowered_reward(results: dict, task: str, margin: float = 0.05) -> bool:
    """True if every trained row of `task` ends (last 5 steps) below its start (first 3) by > margin."""
    recs = _task_runs(results, task)
    return bool(recs) and all(_final_train_reward(r) < _first_train_reward(r) - margin for r in recs)


def rl_collapsed(results: dict, task: str, within: int = 5, keep: float = 0.5) -> tuple[float, float, float, float] | None:
    """If the first RL updates broke every trained row of `task`, the (min, max) of their step-0
    rewards and of their worst rewards over steps 1..within; else None.

    Step 0 is sampled from the warm-started policy itself; "broke" = some step among the next
    `within` samples less than `keep` of the step-0 reward. The rows then compare recoveries
    from that fall, not RL from the warm start (a step size too large for the task)."""
    recs = [r for r in _task_runs(results, task) if len(r["history"]) > 1]
    if not recs:
        return None
    start = [r["history"][0]["reward/mean"] for r in recs]
    worst = [min(x["reward/mean"] for x in r["history"][1:within + 1]) for r in recs]
    if not all(w < keep * s0 for s0, w in zip(start, worst, strict=True)):
        return None
    return min(start), max(start), min(worst), max(worst)


def task_saturated(results: dict, task: str, level: float = 0.99) -> bool:
    """True if every trained row of `task` starts, ends and is evaluated at reward >= level (the
    warm start already solves it: its rows cannot tell the methods apart)."""
    recs = _task_runs(results, task)
    return bool(recs) and all(min(_first_train_reward(r), _final_train_reward(r), r["final_eval"]["eval/reward"])
                              >= level for r in recs)


def rl_updated(rec: dict) -> bool:
    """False if no step of the run changed the policy: every step's gradient norm was exactly 0.

    GRPO's advantages are rewards minus their group's mean, so a step in which every group's samples
    all score the same (all solved, or all failed) has a zero gradient; a run made only of such steps
    ends as its warm start. Records without gradient norms count as updated (nothing to judge by).
    """
    norms = [x["train/grad_norm"] for x in rec["history"] if "train/grad_norm" in x]
    return not norms or any(n > 0 for n in norms)


def rl_never_updated(results: dict, task: str, row: str) -> bool:
    """True if `row` ran on `task` and RL never changed its policy, in any seed."""
    recs = _row_runs(results, row, task)
    return bool(recs) and not any(rl_updated(r) for r in recs)


def _both_idle(results: dict, task: str) -> bool:
    """RL changed neither trace's nor bf16's policy on `task`: both rows are their warm start."""
    return rl_never_updated(results, task, "trace") and rl_never_updated(results, task, "bf16")


UNKNOWN_WARM_START = "unknown"


def warm_starts(results: dict, task: str) -> dict[str, set[str]]:
    """Seed -> the warm-start digests the runs of `task` with that seed began from. GPU runs
    recorded before digests existed count as UNKNOWN_WARM_START (their warm start may differ from
    any other: GPU warm starts were not reproducible then); CPU runs without one are left out (CPU
    warm starts are reproducible)."""
    out: dict[str, set[str]] = {}
    for k, r in results["runs"].items():
        _, t, seed = k.split("/")
        if t != task:
            continue
        if "warm_digest" in r:
            out.setdefault(seed, set()).add(r["warm_digest"])
        elif str(r.get("device", "cpu")).startswith("cuda"):
            out.setdefault(seed, set()).add(UNKNOWN_WARM_START)
    return out


def _run_mean(rec: dict, key: str) -> float:
    vals = [x[key] for x in rec["history"] if key in x]
    return statistics.fmean(vals) if vals else float("nan")


def _held(rows: list[tuple]) -> bool | None:
    """All judged rows' last field true; None when no row was judged (a partial suite, or only
    studies whose mismatch is already negligible)."""
    judged = [r[-1] for r in rows if r[-1] is not None]
    return all(judged) if judged else None


def _judged_studies(results: dict) -> dict[str, dict]:
    """The studies claims and the default policy are judged on: bf16 ones (the RL precision), else all."""
    return {k: v for k, v in results["study"].items() if v["dtype"] == "bfloat16"} or dict(results["study"])


def _claim_a_rows(studies: dict, metric: str) -> list[tuple]:
    """(study, trace, qat-r3, qat, none, held) with trace below a third of qat-r3's and none's `metric`.

    held is None where qat-r3's kl_k3 is already negligible: nothing is left for guidance to remove,
    and ratios of noise-level values (1e-9 vs 1e-10) say nothing about the method.
    """
    rows = []
    for key, st in studies.items():
        a = st["alignments"]
        tr, r3, q, no = (a[k][metric] for k in ("trace", "qat-r3", "qat", "none"))
        held = None if _negligible(a) else tr < r3 / 3 and tr < no / 3
        rows.append((key, tr, r3, q, no, held))
    return rows


def _claim_a_first_batch(results: dict) -> list[tuple]:
    """(task/seed, trace, qat-r3, naive, held) on each seed's first training batch, judged as (a).

    Every FP4 row of a seed samples its first batch from the same warm start with the same seed and
    the same FP4 computation, so the rows' step-1 kl_k3 compare alignments on one more shared batch
    (the training prompts, not the study's): a second draw from the heavy-tailed per-batch kl_k3.
    A seed whose rows' first batches differ (reward or length) is left out.
    """
    rows = []
    runs = results["runs"]
    for task in results["tasks"]:
        for seed in results.get("seeds", []):
            recs = [runs.get(f"{row}/{task}/{seed}") for row in ("trace", "fp4-qat-r3", "fp4-naive")]
            if any(r is None or not r.get("history") for r in recs):
                continue
            firsts = [r["history"][0] for r in recs]
            if len({(f.get("reward/mean"), f.get("response_len/mean")) for f in firsts}) != 1:
                continue
            tr, r3, no = (f["mismatch/kl_k3"] for f in firsts)
            held = None if r3 < NEGLIGIBLE_KL else tr < r3 / 3 and tr < no / 3
            rows.append((f"{task}/{seed}", tr, r3, no, held))
    return rows


def _claim_d_rows(studies: dict, metric: str) -> list[tuple]:
    """(study, share of trace-full's reduction kept, share of its bytes, held); held None as in (a)."""
    rows = []
    for key, st in studies.items():
        a = st["alignments"]
        base, full, comp = a["qat-r3"][metric], a["trace-full"][metric], a["trace"][metric]
        kept = (base - comp) / (base - full) if base > full else float("nan")
        frac_bytes = a["trace"]["bytes_per_token"] / max(a["trace-full"]["bytes_per_token"], 1e-9)
        held = None if _negligible(a) else kept >= 0.5 and frac_bytes <= 0.3
        rows.append((key, kept, frac_bytes, held))
    return rows


def _negligible(alignments: dict) -> bool:
    """qat-r3's kl_k3 is below NEGLIGIBLE_KL: the study cannot rank alignments (as in pick_default_policy)."""
    return alignments["qat-r3"]["mismatch/kl_k3"] < NEGLIGIBLE_KL


MAX_REWARD = 1.0  # task rewards lie in [0, 1]
TRIMMED = "mismatch/kl_k3_trim5"
FRAGILE_SHARE = 0.5  # a kl_k3 more than half of which is one token is that token's noise


def _robust(studies: dict, rows_fn) -> bool | None:
    """The claim re-judged on kl_k3 without each batch's 5 worst tokens (None: a study predates that metric)."""
    if not studies or any(TRIMMED not in a for st in studies.values() for a in st["alignments"].values()):
        return None
    return _held(rows_fn(studies, TRIMMED))


def _fragile(studies: dict, names: tuple[str, ...]) -> list[str]:
    """Studies where one token carries most of the kl_k3 of one of the alignments `names`."""
    return [key for key, st in studies.items() if not _negligible(st["alignments"])
            and any(st["alignments"][n].get("mismatch/kl_k3_top1_share", 0.0) > FRAGILE_SHARE for n in names)]


def claims(results: dict) -> dict[str, dict]:
    """Evaluate the method's four claims (each: held True/False, or None if not measured, and the numbers)."""
    out = {}
    # claims are judged in the precision the RL runs used (bf16); the float32 study is a control
    # showing how little mismatch is left when upstream numerics agree to float32 rounding
    studies = _judged_studies(results)
    # (a) trace mismatch well below fp4-qat and fp4-naive, on the same rollouts
    rows = _claim_a_rows(studies, "mismatch/kl_k3")
    out["a"] = {"held": _held(rows), "rows": rows, "robust": _robust(studies, _claim_a_rows),
                "first_batch": _claim_a_first_batch(results),
                "fragile": _fragile(studies, ("trace", "qat-r3")),
                "text": "trace's kl_k3 is below a third of fp4-qat-r3's and fp4-naive's on every task's fixed bf16 rollout batch "
                        "(a batch where fp4-qat-r3's kl_k3 is already below 1e-6 is not judged)"}
    # (b) trace reward comparable to bf16: final train reward within the seed spread (or 0.05)
    rb = []
    for task in results["tasks"]:
        tr_m, tr_s = _mean_sd(_row_values(results, "trace", task, _final_train_reward))
        bf_m, bf_s = _mean_sd(_row_values(results, "bf16", task, _final_train_reward))
        if tr_m != tr_m or bf_m != bf_m:  # a row not run (partial suite)
            continue
        tol = max(0.05, 2 * max(tr_s, bf_s))
        # neither row learned anything: both are their warm start, the task cannot compare the methods
        rb.append((task, tr_m, bf_m, tol, None if _both_idle(results, task) else tr_m >= bf_m - tol))
    out["b"] = {"held": _held(rb), "rows": rb,
                "text": "trace's final training reward (mean of the last 5 steps, over seeds) is at least bf16's minus "
                        "max(0.05, 2 sd) (comparable or better); a task where RL updated neither row's policy is not judged"}
    # (c) trace's FP4 policy better than ptq (held-out reward as deployed in FP4), paired by seed: the
    # same seed shares the warm start, so the per-seed difference cancels most of the seed noise
    rc = []
    for task in results["tasks"]:
        diffs, t_all, p_all = [], [], []
        for key, rec in results["runs"].items():
            row, t, seed = key.split("/")
            ptq = results["ptq"].get(f"{task}/{seed}")
            if row == "trace" and t == task and ptq is not None:
                t_all.append(rec["final_eval"]["eval/reward"])
                p_all.append(ptq["eval/reward"])
                diffs.append(t_all[-1] - p_all[-1])
        if not diffs:
            continue
        d_m, d_s = _mean_sd(diffs)
        margin = 2 * d_s / math.sqrt(len(diffs))  # two standard errors (0 with one seed: no noise estimate)
        t_m, p_m = statistics.fmean(t_all), statistics.fmean(p_all)
        # ptq already at the maximum reward: nothing can exceed it, the task cannot rank the two; or
        # RL changed neither policy: both are the warm start deployed in FP4, the same policy
        held = None if p_m >= MAX_REWARD or _both_idle(results, task) else d_m > margin
        rc.append((task, t_m, p_m, margin, held))
    out["c"] = {"held": _held(rc), "rows": rc,
                "text": "trace's held-out reward deployed in w4a4kv4 exceeds ptq's (the bf16 policy quantized post hoc) "
                        "by more than two standard errors of the per-seed difference (any margin with one seed); "
                        "a task where ptq already scores the maximum, 1.0, or where RL updated neither trace's nor bf16's policy, "
                        "is not judged"}
    # (d) compact policy keeps most of trace-full's alignment at a small fraction of its bytes
    rd = _claim_d_rows(studies, "mismatch/kl_k3")
    out["d"] = {"held": _held(rd), "rows": rd, "robust": _robust(studies, _claim_d_rows),
                "fragile": _fragile(studies, ("trace", "qat-r3", "trace-full")),
                "text": "the default compact policy removes >= 50% of the kl_k3 that trace-full removes (vs fp4-qat-r3) with <= 30% "
                        "of its bytes (batches as in (a))"}
    return out


def pareto(sweep: list[dict]) -> list[dict]:
    """The sweep points not dominated in (bytes per token, kl_k3)."""
    pts = sorted(sweep, key=lambda m: (m["bytes_per_token"], m["mismatch/kl_k3"]))
    front, best = [], float("inf")
    for p in pts:
        if p["mismatch/kl_k3"] < best:
            front.append(p)
            best = p["mismatch/kl_k3"]
    return front


def _band(ax, steps: list[int], per_step: list[list[float]], label: str, **kw):
    """Plot the mean over seeds with a +- sd band; returns the line."""
    m = [statistics.fmean(p) for p in per_step]
    s = [statistics.stdev(p) if len(p) > 1 else 0.0 for p in per_step]
    (line,) = ax.plot(steps, m, label=label, **kw)
    ax.fill_between(steps, [a - b for a, b in zip(m, s)], [a + b for a, b in zip(m, s)], alpha=0.12, color=line.get_color())
    return line


def write_plots(results: dict, out: Path) -> list[str]:
    """reward_<task>.png (training and, if evaluated per step, held-out reward per step; mean +- sd
    over seeds), pareto_<task>.png; returns file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for task in results["tasks"]:
        if not _task_runs(results, task):
            continue  # nothing trained on this task yet (a partial suite)
        # held-out reward per step where the runs evaluated during training (run.eval_every)
        has_eval = any("eval/reward" in h for r in _task_runs(results, task) for h in r["history"])
        fig, axes = plt.subplots(1, 2 if has_eval else 1, figsize=(11 if has_eval else 6.5, 3.8), squeeze=False)
        ax, ax_ev = axes[0][0], (axes[0][1] if has_eval else None)
        for row in results["rows"]:
            runs = _row_runs(results, row, task)
            if not runs:
                continue
            n = min(len(r["history"]) for r in runs)
            line = _band(ax, list(range(1, n + 1)), [[r["history"][i]["reward/mean"] for r in runs] for i in range(n)], row)
            if ax_ev is not None:
                steps = [i for i in range(n) if all("eval/reward" in r["history"][i] for r in runs)]
                if steps:
                    _band(ax_ev, [i + 1 for i in steps], [[r["history"][i]["eval/reward"] for r in runs] for i in steps],
                          row, color=line.get_color(), marker="o")
        ax.set_xlabel("RL step")
        ax.set_ylabel("train reward")
        ax.set_title(f"{task}: training reward (mean +- sd over seeds)", fontsize=9)
        ax.legend(fontsize=7, ncol=2)
        if ax_ev is not None:
            ax_ev.set_xlabel("RL step")
            ax_ev.set_ylabel("held-out reward (deployed precision)")
            ax_ev.set_title(f"{task}: held-out reward (mean +- sd over seeds)", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / f"reward_{task}.png", dpi=110)
        plt.close(fig)
        names.append(f"reward_{task}.png")
    for key, st in results["study"].items():
        fig, ax = plt.subplots(figsize=(6, 3.8))
        for enc, mk in zip(("codes", "lsb", "ties"), "os^"):
            pts = [m for m in st["sweep"] if m["encoding"] == enc]
            ax.scatter([m["bytes_per_token"] for m in pts], [max(m["mismatch/kl_k3"], 1e-12) for m in pts], marker=mk, label=enc)
            for m in pts:
                ax.annotate(m["layers"].replace("deepest ", ""), (m["bytes_per_token"], max(m["mismatch/kl_k3"], 1e-12)), fontsize=6)
        front = pareto(st["sweep"])
        ax.plot([m["bytes_per_token"] for m in front], [max(m["mismatch/kl_k3"], 1e-12) for m in front], "k--", lw=0.8, label="Pareto front")
        for name, ls in (("qat-r3", ":"), ("none", "-.")):
            ax.axhline(st["alignments"][name]["mismatch/kl_k3"], ls=ls, color="gray", lw=0.8, label=f"{name} (no guidance)")
        ax.set_yscale("log")
        ax.set_xlabel("guidance bytes per token")
        ax.set_ylabel("kl_k3 (trainer vs rollout)")
        ax.set_title(f"cost vs alignment: {key}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fname = f"pareto_{key.replace('/', '_')}.png"
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        names.append(fname)
    return names


def _separate_tables(lines: list[str]) -> list[str]:
    """Insert the blank line Markdown needs between a line of text and the table after it."""
    out: list[str] = []
    for line in lines:
        if line.startswith("|") and out and out[-1].strip() and not out[-1].startswith(("|", "#")):
            out.append("")
        out.append(line)
    return out


def write_report(results_path: str | Path) -> Path:
    """Render report.md (and plots) next to results.json."""
    results_path = Path(results_path)
    results = json.loads(results_path.read_text())
    out = results_path.parent
    plots = write_plots(results, out)
    L: list[str] = [f"# TRACE comparison: suite `{results['suite']}`", ""]
    L.append(f"Tasks {', '.join(results['tasks'])}; seeds {results['seeds']}; rows {', '.join(results['rows'])} + ptq. "
             f"FP4 rows and ptq are deployed as `{results['deploy_recipe']}`. Every figure below is read from "
             f"`results.json` by `tracerl.compare_report`.")
    per_task = {t: o for t, o in results.get("task_overrides", {}).items() if o}
    if per_task:
        L += ["", "Settings of one task's rows (every row of that task has them; compare rows within a task): "
              + "; ".join(f"{t}: {', '.join(f'`{x}`' for x in o)}" for t, o in per_task.items()) + "."]
    if not results.get("complete", True):
        L += ["", f"**Partial run**: the time budget ran out before {len(results['missing'])} cells: "
                  f"{', '.join(results['missing'])}. Re-running the same command resumes from the committed cells; "
                  "claims below are judged only on what was run."]
    L += ["", "## Claims", ""]
    cl = claims(results)
    names = {"a": "(a) trace mismatch well below fp4-qat and fp4-naive", "b": "(b) trace reward comparable to bf16",
             "c": "(c) trace's FP4 policy better than ptq", "d": "(d) compact guidance keeps most of trace-full's alignment"}
    verdict = {True: "held", False: "did not hold", None: "not measured in this run"}
    for k in "abcd":
        v = verdict[cl[k]["held"]]
        if cl[k]["held"] is None and cl[k]["rows"]:
            v = {"b": "not judged (RL updated neither trace's nor bf16's policy on any task)",
                 "c": "not judged (on every task ptq already scores the maximum, or RL updated neither policy)"}.get(
                k, "not judged (fp4-qat-r3's mismatch is already negligible on every batch)")
        L.append(f"- **{names[k]}: {v}.** Test: {cl[k]['text']}.")
        skipped = [str(r[0]) for r in cl[k]["rows"] if r[-1] is None]
        if skipped and cl[k]["held"] is not None:
            L.append(f"  Not judged on {', '.join(skipped)} (see the test's exclusions); the verdict rests on the rest.")
        if cl[k].get("robust") is not None:
            L.append(f"  Re-judged on kl_k3 without each batch's 5 worst tokens: {verdict[cl[k]['robust']]}.")
        fb = cl[k].get("first_batch")
        if fb:
            L.append(f"  Cross-check on each seed's first training batch (one FP4 rollout shared by every FP4 row): "
                     f"{verdict[_held(fb)]} (trace / fp4-qat-r3 / fp4-naive kl_k3: "
                     + "; ".join(f"{r[0]} {_f(r[1], True)} / {_f(r[2], True)} / {_f(r[3], True)}" for r in fb) + ").")
        # a large gap survives its worst token: warn only where the trimmed verdict differs (or is unknown)
        if cl[k].get("fragile") and cl[k].get("robust") != cl[k]["held"]:
            L.append(f"  Caution: on {', '.join(cl[k]['fragile'])} one token carries more than half of a compared "
                     "kl_k3 (column 'worst token share'), so the verdict there rests on that token's noise.")
    L += ["", "## Mismatch at a matched checkpoint (same FP4 rollout batch for every alignment)", ""]
    for key, st in results["study"].items():
        L.append(f"### {key} (trainer compute {st['dtype']}; {st['tokens_per_batch']} tokens)")
        L.append("| alignment | kl_k3 | kl_k3 w/o worst 5 tokens | worst token share | mean abs dlogp | "
                 "frac ratio outside [0.5, 2] | flips/act_frac | bytes/token |")
        L.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name in ALIGN_ROWS:
            a = st["alignments"][name]
            nan = float("nan")
            L.append(f"| {name} | {_f(a['mismatch/kl_k3'], True)} | {_f(a.get(TRIMMED, nan), True)} | "
                     f"{_f(a.get('mismatch/kl_k3_top1_share', nan))} | {_f(a['mismatch/logp_abs_diff_mean'], True)} | "
                     f"{_f(a['mismatch/frac_ratio_outside_0.5_2'], True)} | {_f(a.get('flips/act_frac', float('nan')), True)} | "
                     f"{a.get('bytes_per_token', 0):.0f} |")
        layers = sorted({k.split("_")[-1] for a in st["alignments"].values() for k in a if k.startswith("flips/layer_")}, key=int)
        if layers:
            L.append("")
            L.append("Flip rate per layer:")
            L.append("| alignment | " + " | ".join(f"L{i}" for i in layers) + " |")
            L.append("| --- |" + " --- |" * len(layers))
            for name in ALIGN_ROWS:
                a = st["alignments"][name]
                L.append(f"| {name} | " + " | ".join(_f(a.get(f'flips/layer_{i}', float('nan')), True) for i in layers) + " |")
        L.append("")
        L.append("CachePolicy sweep (trace + R3 on the same prompts):")
        L.append("| layers | encoding | bytes/token | kl_k3 | flips/act_frac | recording overhead |")
        L.append("| --- | --- | --- | --- | --- | --- |")
        warmed = st.get("overhead_timing") == "warmed"
        for m in st["sweep"]:
            overhead = f"{m['recording_overhead'] * 100:+.0f}%" if warmed else "-"
            L.append(f"| {m['layers']} | {m['encoding']} | {m['bytes_per_token']:.0f} | {_f(m['mismatch/kl_k3'], True)} | "
                     f"{_f(m.get('flips/act_frac', float('nan')), True)} | {overhead} |")
        if not warmed:
            L += ["", "(Recording overhead not shown: this study timed its unrecorded baseline rollout cold, "
                      "compilation included; studies run since time it after a warm-up pass.)"]
        front = pareto(st["sweep"])
        L.append("")
        L.append("Pareto front (bytes/token -> kl_k3): " + ", ".join(
            f"{m['layers']}/{m['encoding']} ({m['bytes_per_token']:.0f} B, {m['mismatch/kl_k3']:.2e})" for m in front))
        L.append("")
    if results["study"]:
        L += _default_choice(results)
    if results["runs"]:
        L += ["## Reward", ""]
        L.append("Training reward: mean sampled reward of the first 3 steps (step 0 samples the warm-started "
                 "policy, steps 1-2 follow one and two RL updates) -> mean of the last 5 steps; held-out "
                 "reward/accuracy as deployed; mean +- sd over seeds.")
        L.append("")
        # a partial run leaves out tasks with no run yet, and shows not-yet-run rows as "-"
        run_tasks = [t for t in results["tasks"] if _task_runs(results, t)]
        L.append("| row | " + " | ".join(f"{t} train first 3 -> last 5 | {t} held-out reward | {t} held-out acc"
                                         for t in run_tasks) + " |")
        L.append("| --- |" + " --- | --- | --- |" * len(run_tasks))
        for row in results["rows"]:
            cells = []
            for t in run_tasks:
                t0 = _mean_sd(_row_values(results, row, t, _first_train_reward))
                tr = _mean_sd(_row_values(results, row, t, _final_train_reward))
                ev = _mean_sd(_row_values(results, row, t, lambda r: r["final_eval"]["eval/reward"]))
                ac = _mean_sd(_row_values(results, row, t, lambda r: r["final_eval"]["eval/acc"]))
                start = f"{_f(t0[0])} -> " if t0[0] == t0[0] else ""
                cells.append(f"{start}{_pm(tr)} | {_pm(ev)} | {_pm(ac)}")
            L.append(f"| {row} | " + " | ".join(cells) + " |")
        cells = []
        for t in run_tasks:
            ev = _mean_sd([v["eval/reward"] for k, v in results["ptq"].items() if k.split("/")[0] == t])
            ac = _mean_sd([v["eval/acc"] for k, v in results["ptq"].items() if k.split("/")[0] == t])
            cells.append(f"- | {_pm(ev)} | {_pm(ac)}")
        L.append("| ptq | " + " | ".join(cells) + " |")
        lowered = [t for t in run_tasks if rl_lowered_reward(results, t)]
        if lowered:
            L += ["", f"**RL lowered the sampled reward in every row of {', '.join(lowered)}** (last 5 steps more "
                  "than 0.05 below the first 3): these runs compare policies that RL degraded (learning rate too "
                  "high for the warm-started policy, or too few steps to recover), so their reward and held-out "
                  "figures say little about the methods; claims (b) and (c) on them are weak evidence."]
        for t in run_tasks:
            fell = rl_collapsed(results, t)
            if fell:
                L += ["", f"**{t}: the first RL updates broke every row**: the sampled reward fell from "
                      f"{_f(fell[0])}-{_f(fell[1])} at step 0 (the warm-started policy) to {_f(fell[2])}-{_f(fell[3])} "
                      "(each row's worst of steps 1-5, below half its step 0). The rows then recover from that "
                      "fall at their own pace, so this task compares recoveries, not RL from the warm start (most "
                      "likely a learning rate too large for this task); claims (b) and (c) on it are weak evidence."]
        saturated = [t for t in run_tasks if task_saturated(results, t)]
        if saturated:
            L += ["", f"**{', '.join(saturated)}: every row starts, ends and is evaluated at reward >= 0.99**: the "
                  "warm start already solves the task, so its rows cannot tell the methods apart (claim (b) holds "
                  "there trivially; (c) is not judged where ptq also scores 1.0)."]
        for t in run_tasks:
            idle = [row for row in results["rows"] if rl_never_updated(results, t, row)]
            if idle:
                L += ["", f"**{t}: RL never changed the policy of {', '.join(idle)}** (every step's gradient norm is 0: "
                      "in every group all samples scored the same, so every advantage was 0). Those rows end as their "
                      "warm start; their reward and held-out figures measure the warm start, not the method, and "
                      "claims (b) and (c) are not judged on a task where both trace and bf16 are such rows."]
        for t in run_tasks:
            split = sorted(seed for seed, ds in warm_starts(results, t).items() if len(ds) > 1)
            if split:
                L += ["", f"**{t}: rows of seed {', '.join(split)} began from different warm starts** (their weights' "
                      "digests differ, or some GPU rows predate the digest and may have begun from another warm start: "
                      "GPU warm starts were not reproducible before deterministic kernels); their differences mix the "
                      "methods with the starting point."]
        L += ["", "Training-run mismatch and cost (mean over steps and seeds):", ""]
        L.append("| row | task | kl_k3 | flips/act_frac | guidance B/token | rollout s/step | train s/step |")
        L.append("| --- | --- | --- | --- | --- | --- | --- |")
        for row in results["rows"]:
            for t in run_tasks:
                if not _row_values(results, row, t, lambda r: 0.0):
                    continue
                def mean(key, row=row, t=t):
                    return _mean_sd(_row_values(results, row, t, lambda r: _run_mean(r, key)))[0]
                L.append(f"| {row} | {t} | {_f(mean('mismatch/kl_k3'), True)} | {_f(mean('flips/act_frac'), True)} | "
                         f"{mean('guidance/bytes_per_token'):.0f} | {_f(mean('timing/rollout_s'))} | {_f(mean('timing/train_s'))} |")
        L.append("")
    L += ["## Claim details", ""]
    for k in "abcd":
        if not cl[k]["rows"]:
            L.append(f"- {names[k]}: not measured in this run")
            continue
        def cell(v):
            return _f(v, True) if isinstance(v, float) else "not judged" if v is None else str(v)
        L.append(f"- {names[k]}: " + "; ".join(", ".join(cell(v) for v in r) for r in cl[k]["rows"]))
    if "engine_bench" in results:
        L += _engine_bench_lines(results["engine_bench"])
    if "gpu_bench" in results:
        L += _gpu_bench_lines(results["gpu_bench"])
    L += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    path = out / "report.md"
    path.write_text("\n".join(_separate_tables(L)) + "\n")
    return path


def _engine_bench_lines(bench: dict) -> list[str]:
    """The RL rollout benchmark (bench/engine_rollout.py JSON): both engines, recipes and recording's cost."""
    L = ["", "## RL rollout speed and recording cost (bench/results/engine_rollout_h200.json, "
         "`bench/engine_rollout.py`)", "",
         f"One RL step's rollout on one {bench.get('device', 'GPU')}: `{bench.get('preset', '?')}` preset (random "
         f"weights), {bench.get('prompts', '?')} prompts x {bench.get('samples', '?')} samples, prompt "
         f"{bench.get('prompt_len', '?')}, {bench.get('new_tokens', '?')} new tokens. Recording `trace` is the default "
         "CachePolicy (deepest half, lsb + scales); `full` is all layers, codes, plus the diagnostics the suite records."
         + (" `graph` records from inside its quantize kernels; `graph-copy` is the same engine copying the records "
            "after each quantize (`index_copy_`), the A/B of that choice."
            if any(r["engine"] == "graph-copy" for r in bench.get("rows", [])) else ""),
         "", "| engine | recipe | recording | s per rollout | tok/s | x reference engine | recording overhead |",
         "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in bench.get("rows", []):
        x, o = r.get("x_reference"), r.get("recording_overhead")
        L.append(f"| {r['engine']} | {r['recipe']} | {r['recording']} | {r['s']:.3f} | {r['tok_per_s']:.0f} | "
                 f"{'-' if x is None else f'{x:.1f}'} | {'-' if o is None else f'{o:+.0%}'} |")
    return L


def _gpu_bench_lines(bench: dict) -> list[str]:
    """The engine benchmark's decode points (bench/rollout.py JSON) as a table, speedups vs BF16 beside them."""
    env = bench.get("env", {})
    speed = {(x["recipe"], x["context"], x["batch"]): x["speedup"] for x in bench.get("speedups", [])
             if x["vs"] == "bf16 equal batch"}
    L = ["", "## Rollout speed (bench/results/rollout_h200.json, `bench/rollout.py`)", "",
         f"Decode on one {env.get('gpu', 'GPU')}, `{env.get('model', '?')}` shapes ({env.get('layers', '?')} layers, "
         f"random weights), CUDA-graph decode step; roofline = the step's bytes at the copy bandwidth measured in "
         f"the same run ({env.get('copy_GBps', float('nan')):.0f} GB/s).", "",
         "| recipe | context | batch | tok/s | ms/step | roofline fraction | peak GiB | x BF16 (equal batch) |",
         "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for pt in bench.get("points", []):
        batch = f"{pt['batch']}{' (largest)' if pt.get('largest') else ''}"
        if "tok_per_s" not in pt:
            L.append(f"| {pt['recipe']} | {pt['context']} | {batch} | does not fit | | | | |")
            continue
        x = speed.get((pt["recipe"], pt["context"], pt["batch"]))
        L.append(f"| {pt['recipe']} | {pt['context']} | {batch} | {pt['tok_per_s']:.0f} | {pt['ms_per_step']:.2f} | "
                 f"{pt['roofline_frac']:.2f} | {pt['peak_mem_gib']:.1f} | {'-' if x is None else f'{x:.2f}'} |")
    others = [x for x in bench.get("speedups", []) if x["vs"] != "bf16 equal batch"]
    if others:
        L += ["", "Other ratios: " + "; ".join(f"{x['recipe']} ctx {x['context']} batch {x['batch']} vs {x['vs']}: "
                                               f"{x['speedup']:.2f}x" for x in others)]
    return L


# below this kl_k3 (nats per token) a mismatch is negligible for RL: importance ratios stay within
# about 1e-3 of 1, so a study whose qat-r3 mismatch is already this small cannot rank policies
NEGLIGIBLE_KL = 1e-6
SHIPPED_DEFAULT = ("deepest half", "lsb")  # configs' guidance.layers=fraction:0.5, encoding=lsb
KEEP = 0.8  # share of the best sweep point's mismatch reduction a default must keep


def pick_default_policy(studies: list[dict]) -> dict:
    """The cheapest sweep point that keeps >= KEEP of the best point's kl_k3 reduction (vs qat-r3),
    or is itself negligible, on every study that has a mismatch worth removing."""
    used = 0
    points: dict[tuple[str, str], dict] = {}
    for st in studies:
        base = st["alignments"]["qat-r3"]["mismatch/kl_k3"]
        best = min(m["mismatch/kl_k3"] for m in st["sweep"])
        votes = not _negligible(st["alignments"])
        used += votes
        for m in st["sweep"]:
            p = points.setdefault((m["layers"], m["encoding"]), {"bytes": [], "kept": [], "ok": True})
            p["bytes"].append(m["bytes_per_token"])
            if votes:
                kept = (base - m["mismatch/kl_k3"]) / (base - best) if base > best else 1.0
                p["kept"].append(kept)
                p["ok"] &= kept >= KEEP or m["mismatch/kl_k3"] < NEGLIGIBLE_KL
    ok = [k for k, p in points.items() if p["ok"]]
    # no point is good enough everywhere (studies disagree on the best one): the most robust
    pick = (min(ok, key=lambda k: statistics.fmean(points[k]["bytes"])) if ok
            else max(points, key=lambda k: min(points[k]["kept"], default=1.0)))
    p = points[pick]
    return {"layers": pick[0], "encoding": pick[1], "bytes_per_token": statistics.fmean(p["bytes"]),
            "kept_min": min(p["kept"], default=float("nan")), "met_rule": bool(ok),
            "studies_used": used, "studies": len(studies)}


def _default_choice(results: dict) -> list[str]:
    studies = list(_judged_studies(results).values())
    d = pick_default_policy(studies)
    if d["studies_used"] == 0:
        why = "No study had a qat-r3 mismatch worth removing, so none can rank the policies; shown: the cheapest."
    elif d["met_rule"]:
        why = (f"It keeps at least {d['kept_min']:.0%} of the best point's reduction on every such study "
               f"({d['studies_used']} of {d['studies']}).")
    else:
        why = (f"No point met the rule on every study (they disagree on the best layers); this one keeps the most "
               f"in its worst study ({d['kept_min']:.0%}).")
    return ["## Default CachePolicy", "",
            f"Rule ({'bf16' if studies and studies[0]['dtype'] == 'bfloat16' else 'all'} studies): the cheapest sweep "
            f"point that keeps >= {KEEP:.0%} of the kl_k3 reduction (vs qat-r3) of the study's best point, or whose "
            f"kl_k3 is negligible (< {NEGLIGIBLE_KL:g}), on every study whose qat-r3 kl_k3 is not already negligible. "
            f"Here: **{d['layers']} / {d['encoding']}** ({d['bytes_per_token']:.0f} B/token on average). {why} "
            + ("This is the shipped default (`guidance.layers: fraction:0.5`, `encoding: lsb`, the reference method's)."
               if (d["layers"], d["encoding"]) == SHIPPED_DEFAULT else
               "The shipped default (`guidance.layers: fraction:0.5`, `encoding: lsb`) is the reference method's; "
               "on models like these, set `guidance.layers`/`guidance.encoding` to this pick."), ""]
