"""`tracerl compare`: a micro suite end to end, caching by config hash, report read from results.json."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tracerl import experiments
from tracerl import model as M
from tracerl.compare_report import claims, pareto, pick_default_policy, write_report
from tracerl.config import config_from_dict
from tracerl.experiments import ROWS, Budget, Suite, config_hash, run_config, run_suite


def assert_markdown_tables(text: str) -> None:
    """Every table follows a blank line or a heading, and each of its rows has the header's columns."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            assert "| --- |" not in line, f"line {i + 1}: a table row does not start the line: {line[:60]}"
            continue
        if not lines[i - 1].startswith("|"):  # a header row
            assert not lines[i - 1].strip() or lines[i - 1].startswith("#"), f"line {i + 1}: no blank line before the table"
            head = line.count("|")
            assert lines[i + 1].startswith("| ---") and lines[i + 1].count("|") == head, f"line {i + 2}: bad delimiter row"
        assert line.count("|") == head, f"line {i + 1}: {line.count('|') - 1} columns, the header has {head - 1}"


REPORTS = Path(__file__).resolve().parents[1] / "reports"


@pytest.mark.parametrize("suite", sorted(p.parent.name for p in REPORTS.glob("*/report.md")))
def test_committed_reports_are_well_formed_markdown(suite):
    assert_markdown_tables((REPORTS / suite / "report.md").read_text())


def test_committed_tiny_suite_is_complete_under_the_current_configs(tmp_path):
    # a config change that moves hashes (a new setting, a renamed field) orphans every committed
    # cell, and the next `tracerl compare` would silently re-run the whole suite
    shutil.copytree("reports/tiny/cells", tmp_path / "tiny" / "cells")
    res = run_suite("tiny", tmp_path, "configs/compare", log=lambda s: None, time_budget=0)
    assert res["complete"] and res["missing"] == [] and len(res["runs"]) == 63


def test_committed_small_suite_is_complete_under_the_current_configs(tmp_path):
    # small's maze changed its RL settings (lr, engine) after its studies ran: studies are keyed
    # without those (study_config), so a key scheme that broke this would re-run GPU cells
    shutil.copytree("reports/small/cells", tmp_path / "small" / "cells")
    res = run_suite("small", tmp_path, "configs/compare", log=lambda s: None, time_budget=0)
    assert res["complete"] and res["missing"] == [] and len(res["runs"]) == 21 and len(res["study"]) == 6
    assert res["task_overrides"]["maze"][-2:] == ["train.lr=3.0e-5", "rollout.engine=graph"]
    assert "maze: `rollout.prompts_per_step=8`" in (REPORTS / "small" / "report.md").read_text()


def test_study_key_ignores_only_rl_settings_a_study_never_reads(configs):
    suite = Suite.load("micro", configs)
    key = config_hash(experiments.study_config(suite, "arith", 0, Path("o"), configs))
    rl_only = Suite(**{**suite.__dict__, "tasks": {"arith": ["train.lr=3.0e-5", "rollout.engine=graph"]}})
    assert config_hash(experiments.study_config(rl_only, "arith", 0, Path("o"), configs)) == key
    # ...while the row itself is a different run
    assert config_hash(run_config(rl_only, "trace", "arith", 0, Path("o"), configs)) != \
        config_hash(run_config(suite, "trace", "arith", 0, Path("o"), configs))
    sampled = Suite(**{**suite.__dict__, "tasks": {"arith": ["rollout.temperature=0.7"]}})
    assert config_hash(experiments.study_config(sampled, "arith", 0, Path("o"), configs)) != key


def test_every_row_has_a_config_and_rows_differ(configs):
    suite = Suite.load("tiny", configs)
    hashes = {config_hash(run_config(suite, r, "arith", 0, Path("/tmp/x"), configs)) for r in ROWS}
    assert len(hashes) == len(ROWS)
    cfg = run_config(suite, "trace-full", "maze", 1, Path("/tmp/x"), configs)
    assert cfg.guidance.layers == "all" and cfg.guidance.encoding == "codes" and cfg.train.routing_replay
    assert cfg.task.name == "maze" and cfg.train.seed == 1 and cfg.rollout.prompts_per_step == 4
    with pytest.raises(FileNotFoundError, match="available"):
        Suite.load("nope", configs)


def test_micro_suite_runs_caches_and_reports(configs, tmp_path, monkeypatch):
    out = tmp_path / "reports"
    logs = []
    # a spent budget starts nothing, yet writes a results.json that says what is missing
    res = run_suite("micro", out, configs, log=logs.append, time_budget=0)
    assert not res["complete"] and logs == [] and not res["runs"]
    assert res["missing"] == ["study arith/bfloat16", "bf16/arith/0", "study arith/float32"]
    report = write_report(out / "micro" / "results.json").read_text()
    assert "Partial run" in report and "bf16/arith/0" in report
    assert report.count("not measured in this run") == 8  # the four claims and their details

    res = run_suite("micro", out, configs, log=logs.append)
    assert res["complete"] and res["missing"] == []
    assert set(res["runs"]) == {"bf16/arith/0"} and set(res["ptq"]) == {"arith/0"}
    # records are small JSON cells (committed); weights stay in the cache
    cells = {p.name.split("-")[0] for p in (out / "micro" / "cells").iterdir()}
    assert cells == {"run", "ptq", "study"}
    assert not list((out / "micro" / "cells").glob("*.pt"))
    study = res["study"]["arith/bfloat16"]
    assert set(study["alignments"]) == {"none", "qat", "qat-r3", "trace", "trace-full"}
    assert len(study["sweep"]) == 9
    assert sum(1 for x in logs if x.startswith("train")) == 1

    # adding a row trains only that row; everything else comes from the cache
    text = (configs / "suite-micro.yaml").read_text().replace("rows: [bf16]", "rows: [bf16, trace]")
    (configs / "suite-micro.yaml").write_text(text)
    logs.clear()
    res = run_suite("micro", out, configs, log=logs.append)
    assert [x for x in logs if x.startswith(("train", "warm", "mismatch"))] == ["train trace-arith-s0"]
    assert set(res["runs"]) == {"bf16/arith/0", "trace/arith/0"}

    path = write_report(out / "micro" / "results.json")
    report = path.read_text()
    assert_markdown_tables(report)
    for k in ("(a)", "(b)", "(c)", "(d)", "Pareto front", "CachePolicy sweep", "Default CachePolicy"):
        assert k in report
    # figures in the report come from results.json
    kl = res["study"]["arith/bfloat16"]["alignments"]["trace"]["mismatch/kl_k3"]
    assert f"{kl:.2e}" in report
    assert (out / "micro" / "reward_arith.png").exists() and (out / "micro" / "pareto_arith_bfloat16.png").exists()
    on_disk = json.loads((out / "micro" / "results.json").read_text())
    assert on_disk["runs"]["trace/arith/0"]["history"][-1]["step"] == 2
    # both rows record the one shared warm start they began from (the report's same-start check)
    digests = {on_disk["runs"][k]["warm_digest"] for k in ("bf16/arith/0", "trace/arith/0")}
    assert len(digests) == 1 and all(on_disk["runs"][k]["deterministic"] for k in on_disk["runs"])
    # the baseline rollout is timed warm, so the report shows the recording overhead
    assert study["overhead_timing"] == "warmed" and "Recording overhead not shown" not in report

    # a checkout that has only results.json (suites run before cells were committed) restores the
    # cells from it, so the report re-renders complete without training anything
    shutil.rmtree(out / "micro" / "cells")
    logs.clear()
    again = run_suite("micro", out, configs, log=logs.append, time_budget=0)
    assert again["complete"] and set(again["runs"]) == set(res["runs"]) and set(again["study"]) == set(res["study"])
    assert logs == ["restored 5 cells from " + str(out / "micro" / "results.json")]
    # a study recorded before the per-token kl spread existed is kept for the report, and re-run
    # (last, only if the budget allows) to fill it in
    sp = next((out / "micro" / "cells").glob("study-arith-bfloat16-*.json"))
    old_rec = json.loads(sp.read_text())
    for a in old_rec["alignments"].values():
        for k in ("mismatch/kl_k3_trim5", "mismatch/kl_k3_top1_share", "mismatch/tokens"):
            del a[k]
    del old_rec["schema"]
    sp.write_text(json.dumps(old_rec))
    logs.clear()
    kept = run_suite("micro", out, configs, log=logs.append, time_budget=0)
    assert logs == [] and "mismatch/kl_k3_trim5" not in kept["study"]["arith/bfloat16"]["alignments"]["trace"]
    upgraded = run_suite("micro", out, configs, log=logs.append)
    assert logs == ["mismatch study arith/bfloat16: re-run (recorded before schema 2)"]
    assert upgraded["study"]["arith/bfloat16"]["alignments"]["trace"]["mismatch/kl_k3"] == kl  # same batch, same numbers
    assert "mismatch/kl_k3_trim5" in json.loads(sp.read_text())["alignments"]["trace"]

    # on a fresh machine (cells committed, weights not) a missing ptq cell re-trains the bf16 row
    # it needs instead of stopping the suite, and the re-trained record replaces the old one
    for p in (out / "micro" / "cells").glob("ptq-*.json"):
        p.unlink()
    committed = json.loads((out / "micro" / "results.json").read_text())
    (out / "micro" / "results.json").write_text(json.dumps(committed | {"ptq": {}}))
    for p in (out / "micro" / "cache").glob("model-*.pt"):
        p.unlink()
    logs.clear()
    fresh = run_suite("micro", out, configs, log=logs.append)
    assert fresh["complete"] and set(fresh["ptq"]) == {"arith/0"}
    assert [x for x in logs if x.startswith(("train", "re-train"))] == [
        "re-train bf16/arith/0: its final weights are not in " + str(out / "micro" / "cache") + " and ptq needs them",
        "train bf16-arith-s0"]
    # ... but not a record whose config changed since
    shutil.rmtree(out / "micro" / "cells")
    (configs / "suite-micro.yaml").write_text(text.replace("train: {steps: 2,", "train: {steps: 3,"))
    changed = run_suite("micro", out, configs, log=logs.append, time_budget=0)
    assert not changed["runs"] and not changed["study"] and "bf16/arith/0" in changed["missing"]


def test_run_config_does_not_leak_one_tasks_overrides_into_another(configs):
    suite = Suite.load("tiny", configs)
    alone = config_hash(run_config(suite, "bf16", "arith", 0, Path("/tmp/x"), configs))
    run_config(suite, "bf16", "maze", 0, Path("/tmp/x"), configs)  # maze overrides rollout/train/warm_start
    assert config_hash(run_config(suite, "bf16", "arith", 0, Path("/tmp/x"), configs)) == alone


def test_report_hides_overhead_timed_cold_and_says_what_was_not_measured(tmp_path):
    align = {k: {"mismatch/kl_k3": 1e-5, "mismatch/logp_abs_diff_mean": 1e-3, "mismatch/frac_ratio_outside_0.5_2": 0.0,
                 "bytes_per_token": 10} for k in ("none", "qat", "qat-r3", "trace", "trace-full")}
    sweep = [{"layers": "all", "encoding": "lsb", "bytes_per_token": 10, "mismatch/kl_k3": 1e-6, "recording_overhead": -0.86}]
    res = {"suite": "x", "tasks": ["arith"], "seeds": [0], "rows": ["bf16"], "deploy_recipe": "w4a4kv4", "runs": {},
           "ptq": {}, "complete": False, "missing": ["bf16/arith/0"],
           "study": {"arith/bfloat16": {"dtype": "bfloat16", "tokens_per_batch": 9, "alignments": align, "sweep": sweep}}}
    (tmp_path / "results.json").write_text(json.dumps(res))
    report = write_report(tmp_path / "results.json").read_text()
    assert "-86%" not in report and "Recording overhead not shown" in report
    assert "(b) trace reward comparable to bf16: not measured in this run" in report
    res["study"]["arith/bfloat16"]["overhead_timing"] = "warmed"
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert "| -86% |" in write_report(tmp_path / "results.json").read_text()


def test_pareto_and_claims_logic():
    sweep = [
        {"bytes_per_token": 100, "mismatch/kl_k3": 5e-6},
        {"bytes_per_token": 200, "mismatch/kl_k3": 1e-6},
        {"bytes_per_token": 300, "mismatch/kl_k3": 2e-6},  # dominated
        {"bytes_per_token": 400, "mismatch/kl_k3": 1e-7},
    ]
    assert [p["bytes_per_token"] for p in pareto(sweep)] == [100, 200, 400]
    align = {
        "none": {"mismatch/kl_k3": 1e-4}, "qat": {"mismatch/kl_k3": 1e-5}, "qat-r3": {"mismatch/kl_k3": 9e-6},
        "trace": {"mismatch/kl_k3": 1e-6, "bytes_per_token": 100}, "trace-full": {"mismatch/kl_k3": 1e-7, "bytes_per_token": 1000},
    }
    res = {"study": {"arith/bfloat16": {"dtype": "bfloat16", "alignments": align}}, "tasks": [], "runs": {}, "ptq": {}}
    c = claims(res)
    assert c["a"]["held"] and c["d"]["held"]
    align["trace"]["mismatch/kl_k3"] = 5e-6  # no longer a third of qat-r3's
    assert not claims(res)["a"]["held"]
    # studies without the per-token spread (run before it was recorded) are neither re-judged nor flagged
    assert claims(res)["a"]["robust"] is None and claims(res)["a"]["fragile"] == []
    # one token carries qat-r3's kl_k3: without the worst tokens trace is well below it, and the
    # verdict on the full kl_k3 is flagged as resting on that token
    trimmed = {"none": 1e-4, "qat": 9e-6, "qat-r3": 8e-6, "trace": 1e-6, "trace-full": 1e-7}
    for name, kl in trimmed.items():
        align[name]["mismatch/kl_k3_trim5"] = kl
        align[name]["mismatch/kl_k3_top1_share"] = 0.1
    align["qat-r3"]["mismatch/kl_k3_top1_share"] = 0.9
    c = claims(res)
    assert not c["a"]["held"] and c["a"]["robust"] is True and c["a"]["fragile"] == ["arith/bfloat16"]
    align["qat-r3"]["mismatch/kl_k3_top1_share"] = 0.4
    assert claims(res)["a"]["fragile"] == []
    # a second study whose qat-r3 mismatch is already negligible (1e-9) is not judged, whatever
    # the ratio of its noise-level values
    small = {k: {"mismatch/kl_k3": v, "bytes_per_token": 100} for k, v in
             {"none": 5e-3, "qat": 2e-9, "qat-r3": 1.7e-9, "trace": 8e-10, "trace-full": 5e-11}.items()}
    res["study"]["maze/bfloat16"] = {"dtype": "bfloat16", "alignments": small}
    align["trace"]["mismatch/kl_k3"] = 1e-6
    c = claims(res)
    assert c["a"]["held"] is True and c["a"]["rows"][1][-1] is None and c["d"]["rows"][1][-1] is None
    del res["study"]["arith/bfloat16"]
    assert claims(res)["a"]["held"] is None and claims(res)["a"]["rows"]


def test_budget_starts_a_cell_only_if_the_longest_of_its_kind_fits(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(experiments.time, "perf_counter", lambda: clock[0])
    b = Budget(60)
    assert b.allows("run")  # nothing known about runs yet: start one
    clock[0] += 25
    b.ran("run", 25)
    assert b.allows("run")  # 25 elapsed + 25 <= 60
    clock[0] += 25
    b.ran("run", 25)
    assert not b.allows("run") and b.allows("ptq")  # 50 + 25 > 60; a ptq cell has no estimate yet
    assert Budget(None).allows("run")


def test_claim_c_pairs_seeds_needs_two_standard_errors_and_skips_a_saturated_task():
    def run(reward):
        return {"history": [{"reward/mean": reward}], "final_eval": {"eval/reward": reward}}
    res = {"study": {}, "tasks": ["arith", "maze"], "runs": {"trace/maze/0": run(1.0)}, "ptq": {"maze/0": {"eval/reward": 1.0}}}
    trace, ptq = [0.80, 0.85, 0.90], [0.70, 0.80, 0.82]
    for seed, (t, p) in enumerate(zip(trace, ptq)):
        res["runs"][f"trace/arith/{seed}"] = run(t)
        res["ptq"][f"arith/{seed}"] = {"eval/reward": p}
    c = claims(res)["c"]
    # per-seed differences 0.10, 0.05, 0.08: mean 0.0767, sd 0.02517, two standard errors 0.02906
    task, t_m, p_m, margin, held = c["rows"][0]
    assert (task, held) == ("arith", True) and margin == pytest.approx(2 * 0.025166 / 3 ** 0.5, rel=1e-4)
    assert c["rows"][1] == ("maze", 1.0, 1.0, 0.0, None) and c["held"] is True
    # the same means with seeds that disagree: the difference is within the noise
    res["ptq"]["arith/0"]["eval/reward"], res["ptq"]["arith/2"]["eval/reward"] = 0.85, 0.67
    assert claims(res)["c"]["held"] is False


def test_claim_a_cross_check_on_the_first_training_batch():
    def run(kl, reward=0.5, length=7.0):
        return {"history": [{"reward/mean": reward, "response_len/mean": length, "mismatch/kl_k3": kl}]}

    res = {"study": {}, "tasks": ["arith", "maze"], "seeds": [0, 1], "ptq": {}, "runs": {
        "trace/arith/0": run(1e-5), "fp4-qat-r3/arith/0": run(4e-5), "fp4-naive/arith/0": run(1e-3),
        # seed 1: trace above a third of qat-r3's
        "trace/arith/1": run(2e-5), "fp4-qat-r3/arith/1": run(5e-5), "fp4-naive/arith/1": run(1e-3),
        # maze: qat-r3 already negligible, not judged
        "trace/maze/0": run(3e-9), "fp4-qat-r3/maze/0": run(1e-9), "fp4-naive/maze/0": run(1e-4),
        # maze seed 1: the rows' first batches differ (another sampled length): left out
        "trace/maze/1": run(1e-5), "fp4-qat-r3/maze/1": run(1e-3, length=8.0), "fp4-naive/maze/1": run(1e-2),
    }}
    fb = claims(res)["a"]["first_batch"]
    assert [(r[0], r[-1]) for r in fb] == [("arith/0", True), ("arith/1", False), ("maze/0", None)]
    assert fb[0][1:4] == (1e-5, 4e-5, 1e-3)
    del res["runs"]["trace/arith/1"]  # a row not run: that seed is not compared
    assert [r[0] for r in claims(res)["a"]["first_batch"]] == ["arith/0", "maze/0"]


def test_claims_not_measured_when_rows_are_missing():
    res = {"study": {}, "tasks": ["arith"], "runs": {}, "ptq": {}}
    assert all(v["held"] is None for v in claims(res).values())


def test_default_policy_rule_keeps_most_of_the_reduction_and_skips_negligible_studies():
    def study(qat_r3, kls):
        sweep = [{"layers": lay, "encoding": "lsb", "bytes_per_token": b, "mismatch/kl_k3": kl}
                 for (lay, b), kl in zip((("all", 400), ("deepest half", 200), ("deepest quarter", 100)), kls)]
        return {"dtype": "bfloat16", "alignments": {"qat-r3": {"mismatch/kl_k3": qat_r3}}, "sweep": sweep}

    # half keeps (1e-3 - 1e-4) / (1e-3 - 1e-8) = 90% here; quarter keeps 50%
    a = study(1e-3, [1e-8, 1e-4, 5e-4])
    d = pick_default_policy([a])
    assert (d["layers"], d["met_rule"], d["studies_used"]) == ("deepest half", True, 1)
    # a study with nothing to remove (qat-r3 already negligible) does not veto, however noisy its ratios
    noisy = study(1e-10, [3e-10, 2e-11, 9e-11])
    assert pick_default_policy([a, noisy])["layers"] == "deepest half"
    # a second real study where half keeps only 50%: full depth it is
    b = study(1e-4, [1e-8, 5e-5, 9e-5])
    assert pick_default_policy([a, b])["layers"] == "all"
    # a point whose own mismatch is negligible is good enough even if the best is far lower
    c = study(1e-4, [1e-12, 5e-7, 9e-5])
    assert pick_default_policy([a, c])["layers"] == "deepest half"


def test_report_shows_the_start_reward_and_flags_rl_that_lowered_it_everywhere(tmp_path):
    def run(rewards):
        return {"name": "x", "hash": "h", "wall_s": 1.0, "final_eval": {"eval/reward": 0.5, "eval/acc": 0.5},
                "history": [{"step": i + 1, "reward/mean": r} for i, r in enumerate(rewards)]}
    down, up = [0.9, 0.9, 0.9, 0.5, 0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.7, 0.9, 0.9, 0.9, 0.9]
    res = {"suite": "x", "tasks": ["arith", "maze"], "seeds": [0], "rows": ["bf16", "trace"], "deploy_recipe": "w4a4kv4",
           "runs": {"bf16/arith/0": run(down), "trace/arith/0": run(down), "bf16/maze/0": run(down),
                    "trace/maze/0": run(up)},
           "ptq": {}, "study": {}, "complete": True, "missing": []}
    from tracerl.compare_report import rl_lowered_reward
    assert rl_lowered_reward(res, "arith") and not rl_lowered_reward(res, "maze")
    (tmp_path / "results.json").write_text(json.dumps(res))
    report = write_report(tmp_path / "results.json").read_text()
    # first 3 steps 0.9 -> last 5 steps 0.5 (hand-computed means)
    assert "| bf16 | 0.900 -> 0.500 +- 0.000 |" in report
    assert "| 0.500 -> 0.860 +- 0.000 |" in report  # trace/maze: (0.7 + 4 * 0.9) / 5
    assert "RL lowered the sampled reward in every row of arith**" in report
    assert "warm start already solves" not in report
    # a task every row solves from the first step is flagged as saturated; one row below it is enough to not be
    from tracerl.compare_report import task_saturated

    solved = run([1.0] * 8) | {"final_eval": {"eval/reward": 1.0, "eval/acc": 1.0}}
    res["runs"] |= {"bf16/maze/0": solved, "trace/maze/0": solved}
    assert task_saturated(res, "maze") and not task_saturated(res, "arith")
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert "**maze: every row starts, ends and is evaluated at reward >= 0.99**" in write_report(
        tmp_path / "results.json").read_text()
    res["runs"]["trace/maze/0"] = solved | {"final_eval": {"eval/reward": 0.98, "eval/acc": 0.98}}
    assert not task_saturated(res, "maze")


def test_report_flags_a_task_whose_first_rl_updates_broke_every_row(tmp_path):
    from tracerl.compare_report import rl_collapsed

    def run(rewards):
        return {"name": "x", "hash": "h", "wall_s": 1.0, "final_eval": {"eval/reward": 0.5, "eval/acc": 0.5},
                "history": [{"step": i + 1, "reward/mean": r} for i, r in enumerate(rewards)]}
    # maze rows fall below half their step 0 within 5 steps (0.25 < 0.375, 0.3 < 0.4); arith's bf16 does
    # not (0.45 >= 0.9 / 2), so arith is not flagged although its trace row fell
    res = {"suite": "x", "tasks": ["arith", "maze"], "seeds": [0], "rows": ["bf16", "trace"], "deploy_recipe": "w4a4kv4",
           "runs": {"bf16/maze/0": run([0.75, 0.25, 0.3, 0.5, 0.6, 0.7, 0.7]),
                    "trace/maze/0": run([0.8, 0.5, 0.6, 0.6, 0.6, 0.3, 0.2]),
                    "bf16/arith/0": run([0.9, 0.45, 0.8, 0.9]), "trace/arith/0": run([0.9, 0.2, 0.8, 0.9])},
           "ptq": {}, "study": {}, "complete": True, "missing": []}
    assert rl_collapsed(res, "maze") == (0.75, 0.8, 0.25, 0.3)
    assert rl_collapsed(res, "arith") is None
    (tmp_path / "results.json").write_text(json.dumps(res))
    report = write_report(tmp_path / "results.json").read_text()
    assert ("**maze: the first RL updates broke every row**: the sampled reward fell from 0.750-0.800 at step 0 "
            "(the warm-started policy) to 0.250-0.300") in report
    assert "**arith: the first RL updates" not in report


def test_report_renders_the_gpu_benchmark_from_its_json():
    from tracerl.compare_report import _gpu_bench_lines
    bench = {"env": {"gpu": "H200", "model": "m", "layers": 2, "copy_GBps": 4000.0},
             "points": [{"recipe": "w4a4kv4", "context": 1024, "batch": 16, "tok_per_s": 1216.3, "ms_per_step": 13.154,
                         "roofline_frac": 0.238, "peak_mem_gib": 18.64},
                        {"recipe": "bf16", "context": 8192, "batch": 256, "fits": False}],
             "speedups": [{"recipe": "w4a4kv4", "context": 1024, "batch": 16, "vs": "bf16 equal batch", "speedup": 0.999},
                          {"recipe": "w4a4kv4", "context": 1024, "batch": 16, "vs": "peer", "speedup": 5.65}]}
    text = "\n".join(_gpu_bench_lines(bench))
    assert "| w4a4kv4 | 1024 | 16 | 1216 | 13.15 | 0.24 | 18.6 | 1.00 |" in text
    assert "| bf16 | 8192 | 256 | does not fit |" in text and "vs peer: 5.65x" in text and "(4000 GB/s)" in text


def test_report_renders_the_engine_benchmark_from_its_json():
    from tracerl.compare_report import _engine_bench_lines
    bench = {"preset": "small", "prompts": 16, "samples": 8, "prompt_len": 32, "new_tokens": 128, "device": "H200",
             "rows": [{"engine": "reference", "recipe": "w4a4kv4", "recording": "none", "s": 8.2099,
                       "tok_per_s": 1995.6, "x_reference": None, "recording_overhead": None},
                      {"engine": "graph", "recipe": "w4a4kv4", "recording": "trace", "s": 0.3406,
                       "tok_per_s": 48103.4, "x_reference": 23.665, "recording_overhead": 0.1804}]}
    text = "\n".join(_engine_bench_lines(bench))
    assert "| reference | w4a4kv4 | none | 8.210 | 1996 | - | - |" in text
    assert "| graph | w4a4kv4 | trace | 0.341 | 48103 | 23.7 | +18% |" in text
    assert "16 prompts x 8 samples, prompt 32, 128 new tokens" in text
    assert "graph-copy" not in text  # explained only when the bench has such rows
    bench["rows"].append({**bench["rows"][1], "engine": "graph-copy"})
    assert "`graph-copy` is the same engine" in "\n".join(_engine_bench_lines(bench))


def test_per_step_evals_leave_training_unchanged_and_top_up_old_cells(configs, tmp_path):
    out = tmp_path / "reports"
    text = (configs / "suite-micro.yaml").read_text().replace("task: {eval_prompts: 4}", "task: {eval_prompts: 4}\n  run: {eval_every: 0}")
    (configs / "suite-micro.yaml").write_text(text)
    first = run_suite("micro", out, configs, log=lambda s: None)
    old = first["runs"]["bf16/arith/0"]
    assert not any("eval/acc" in h for h in old["history"])
    # asking for per-step evals keeps the hash (eval is measurement only) and re-runs the cell last
    (configs / "suite-micro.yaml").write_text(text.replace("eval_every: 0", "eval_every: 1"))
    logs: list[str] = []
    spent = run_suite("micro", out, configs, log=logs.append, time_budget=0)
    assert logs == [] and spent["complete"] and spent["runs"]["bf16/arith/0"]["hash"] == old["hash"]
    new = run_suite("micro", out, configs, log=logs.append)
    assert "re-run bf16/arith/0 for its per-step held-out evals" in logs
    rec = new["runs"]["bf16/arith/0"]
    assert all("eval/reward" in h for h in rec["history"]) and rec["history"][-1]["eval/reward"] == rec["final_eval"]["eval/reward"]
    assert rec["final_eval"] == old["final_eval"] and new["ptq"]["arith/0"] == first["ptq"]["arith/0"]  # ptq re-made, same weights

    def training(h):
        return {k: v for k, v in h.items() if not k.startswith(("timing/", "throughput/", "eval/"))}
    assert [training(h) for h in rec["history"]] == [training(h) for h in old["history"]]
    assert run_suite("micro", out, configs, log=logs.append)["runs"]["bf16/arith/0"]["history"] == rec["history"]


def test_rows_that_rl_never_updated_are_flagged_and_not_judged_for_b_and_c(tmp_path):
    # small/code on the H200: every group solved every prompt, so every advantage and gradient was 0
    # and trace, bf16 and ptq all ended as the warm start; (c) "did not hold" there only by a tie
    def run(norms, final):
        return {"name": "x", "hash": "h", "wall_s": 1.0, "final_eval": {"eval/reward": final, "eval/acc": final},
                "history": [{"step": i + 1, "reward/mean": 1.0, "train/grad_norm": g} for i, g in enumerate(norms)]}
    from tracerl.compare_report import rl_never_updated, rl_updated

    idle, moved = [0.0] * 8, [0.0] * 6 + [0.06, 0.0]
    assert not rl_updated(run(idle, 0.7)) and rl_updated(run(moved, 0.7))
    assert rl_updated({"history": [{"step": 1, "reward/mean": 1.0}]})  # no gradient norms recorded: not judged idle
    res = {"suite": "x", "tasks": ["code", "arith"], "seeds": [0], "rows": ["bf16", "trace"],
           "deploy_recipe": "w4a4kv4", "study": {}, "complete": True, "missing": [],
           "runs": {"bf16/code/0": run(idle, 0.69), "trace/code/0": run(idle, 0.69),
                    "bf16/arith/0": run(moved, 0.5), "trace/arith/0": run(moved, 0.8)},
           "ptq": {"code/0": {"eval/reward": 0.69, "eval/acc": 0.69}, "arith/0": {"eval/reward": 0.6, "eval/acc": 0.6}}}
    assert rl_never_updated(res, "code", "trace") and not rl_never_updated(res, "arith", "trace")
    assert not rl_never_updated(res, "maze", "trace")  # a row that did not run is not idle
    cl = claims(res)
    assert [r[0] for r in cl["c"]["rows"] if r[-1] is None] == ["code"] and cl["c"]["held"] is True
    assert [r[0] for r in cl["b"]["rows"] if r[-1] is None] == ["code"] and cl["b"]["held"] is True
    (tmp_path / "results.json").write_text(json.dumps(res))
    report = write_report(tmp_path / "results.json").read_text()
    assert "**code: RL never changed the policy of bf16, trace**" in report
    assert "Not judged on code" in report and "arith: RL never changed" not in report
    # one row that learned is enough for the comparison to mean something again
    res["runs"]["trace/code/0"] = run(moved, 0.69)
    assert claims(res)["c"]["rows"][0][-1] is False


def test_state_digest_names_bit_identical_weights_only():
    from tracerl.experiments import state_digest

    m = M.build("tiny", seed=0).state_dict()
    same = {k: v.clone() for k, v in m.items()}
    assert state_digest(m) == state_digest(same)
    k = next(k for k, v in m.items() if v.is_floating_point())
    same[k].view(-1)[0] = torch.nextafter(same[k].view(-1)[0], torch.tensor(1.0, dtype=same[k].dtype))
    assert state_digest(m) != state_digest(same)  # one ulp of one weight
    assert state_digest(m) != state_digest({k: v.to(torch.bfloat16) for k, v in m.items()})


def test_run_deterministic_picks_kernels_not_the_experiment(configs):
    suite = Suite.load("micro", configs)
    cfg = run_config(suite, "trace", "arith", 0, Path("/tmp/x"), configs)
    off = config_from_dict(cfg.to_dict(), ["run.deterministic=false"])
    assert cfg.run.deterministic and not off.run.deterministic
    assert config_hash(off) == config_hash(cfg)  # committed cells (run before the flag) keep their hashes


def test_report_flags_rows_of_one_seed_that_began_from_different_warm_starts(tmp_path):
    def run(digest, device="cuda:0"):
        rec = {"name": "x", "hash": "h", "wall_s": 1.0, "final_eval": {"eval/reward": 0.5, "eval/acc": 0.5},
               "history": [{"step": i + 1, "reward/mean": 0.5} for i in range(8)], "device": device}
        return rec | ({"warm_digest": digest} if digest else {})
    res = {"suite": "x", "tasks": ["code", "arith", "maze"], "seeds": [0, 1], "rows": ["bf16", "trace"],
           "deploy_recipe": "w4a4kv4", "study": {}, "ptq": {}, "complete": True, "missing": [],
           "runs": {"bf16/code/0": run("aa"), "trace/code/0": run("bb"), "bf16/code/1": run("cc"),
                    "trace/code/1": run("cc"), "bf16/arith/0": run("dd"), "trace/arith/0": run(None, "cpu"),
                    "bf16/arith/1": run("ee"), "trace/arith/1": run(None), "bf16/maze/0": run(None),
                    "trace/maze/0": run(None)}}
    (tmp_path / "results.json").write_text(json.dumps(res))
    report = write_report(tmp_path / "results.json").read_text()
    # seeds have their own warm starts; a seed is flagged whose rows' digests differ, or where a GPU row that
    # predates digests sits next to a recorded one (a GPU warm start was not reproducible then); CPU runs
    # reproduce their warm start, and rows that all predate digests cannot be compared
    assert "**code: rows of seed 0 began from different warm starts**" in report
    assert "**arith: rows of seed 1 began from different warm starts**" in report
    assert "seed 0, 1" not in report and "maze: rows of seed" not in report


def test_gpu_runs_without_a_warm_start_digest_are_re_run_cpu_runs_are_not(configs):
    from tracerl.experiments import run_stale_reason

    cfg = run_config(Suite.load("micro", configs), "trace", "arith", 0, Path("/tmp/x"), configs)
    every = cfg.run.eval_every
    assert every  # the checks below need per-step evals asked for
    current = {"eval_every": every, "device": "cuda:0", "warm_digest": "ab12"}
    assert run_stale_reason(current, cfg) is None
    assert run_stale_reason(current | {"eval_every": 0}, cfg) == "for its per-step held-out evals"
    old_gpu = {k: v for k, v in current.items() if k != "warm_digest"}
    assert run_stale_reason(old_gpu, cfg) == "from a recorded, deterministic warm start"
    assert run_stale_reason(old_gpu | {"device": "cpu"}, cfg) is None  # CPU runs reproduce without it


def test_warm_start_target_is_hashed_only_when_on(configs):
    # committed cells predate warm_start.stop_at_reward/check_every: off, they must not change a hash
    suite = Suite.load("micro", configs)
    cfg = run_config(suite, "trace", "arith", 0, Path("/tmp/x"), configs)
    h = config_hash(cfg)
    assert config_hash(config_from_dict(cfg.to_dict(), ["warm_start.check_every=7"])) == h  # unused while off
    on = config_from_dict(cfg.to_dict(), ["warm_start.stop_at_reward=0.8"])
    assert config_hash(on) != h
    assert config_hash(config_from_dict(on.to_dict(), ["warm_start.check_every=7"])) != config_hash(on)


def test_warm_start_cache_key_covers_what_the_stop_check_samples_with(configs):
    from tracerl.experiments import warm_cache_path

    cfg = run_config(Suite.load("micro", configs), "trace", "arith", 0, Path("/tmp/x"), configs)

    def path(c, *o):
        return warm_cache_path(config_from_dict(c.to_dict(), list(o)), Path("/c"))

    # off: the warm start never samples, so rollout settings do not matter (and old caches stay valid)
    assert path(cfg, "rollout.temperature=0.7") == path(cfg) and path(cfg, "train.lr=1e-5") == path(cfg)
    on = config_from_dict(cfg.to_dict(), ["warm_start.stop_at_reward=0.8"])
    assert path(on) != path(cfg)
    for o in ("rollout.temperature=0.7", "rollout.max_new_tokens=9", "train.compute_dtype=bfloat16",
              "warm_start.check_every=7"):
        assert path(on, o) != path(on), o
    assert path(on, "train.lr=1e-5") == path(on)  # RL settings: rows of every lr share it
