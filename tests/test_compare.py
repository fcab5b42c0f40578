"""`tracerl compare`: a micro suite end to end, caching by config hash, report read from results.json."""

import json
import shutil
from pathlib import Path

import pytest

from tracerl import experiments
from tracerl.compare_report import claims, pareto, write_report
from tracerl.experiments import ROWS, Budget, Suite, config_hash, run_config, run_suite

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
def configs(tmp_path):
    d = tmp_path / "configs"
    shutil.copytree("configs/compare", d)
    (d / "suite-micro.yaml").write_text(MICRO)
    return d


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
    assert report.count("not measured in this run") == 4

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
    for k in ("(a)", "(b)", "(c)", "(d)", "Pareto front", "CachePolicy sweep", "Default CachePolicy"):
        assert k in report
    # figures in the report come from results.json
    kl = res["study"]["arith/bfloat16"]["alignments"]["trace"]["mismatch/kl_k3"]
    assert f"{kl:.2e}" in report
    assert (out / "micro" / "reward_arith.png").exists() and (out / "micro" / "pareto_arith_bfloat16.png").exists()
    on_disk = json.loads((out / "micro" / "results.json").read_text())
    assert on_disk["runs"]["trace/arith/0"]["history"][-1]["step"] == 2


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


def test_claims_not_measured_when_rows_are_missing():
    res = {"study": {}, "tasks": ["arith"], "runs": {}, "ptq": {}}
    assert all(v["held"] is None for v in claims(res).values())
