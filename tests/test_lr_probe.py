"""bench/lr_probe.py: one suite row per value and seed, written after every run, cells reused."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _probe():
    spec = importlib.util.spec_from_file_location("lr_probe", ROOT / "bench" / "lr_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_runs_each_value_per_seed_and_reuses_its_cells(configs, tmp_path, monkeypatch):
    probe = _probe()
    args = ["--suite", "micro", "--task", "arith", "--configs", str(configs), "--work", str(tmp_path / "w"),
            "--vary", "train.lr=1e-4,1e-5", "--seeds", "0,1", "--out", str(tmp_path / "p.json")]
    assert probe.main(args) == 0
    runs = json.loads((tmp_path / "p.json").read_text())["runs"]
    assert [(r["seed"], r["value"]) for r in runs] == [(0, "1e-4"), (0, "1e-5"), (1, "1e-4"), (1, "1e-5")]
    assert [r["lr"] for r in runs] == [1e-4, 1e-5, 1e-4, 1e-5]
    assert len(list((tmp_path / "w" / "cells").glob("run-*.json"))) == 4

    # a second probe over the same runs reads them back from cells/ (run_one returns a cached
    # record before it needs a warm start), so no warm start is recomputed
    def no_warm(*a, **k):
        raise AssertionError("warm start recomputed for runs already in cells/")
    monkeypatch.setattr(probe, "_warm_state", no_warm)
    assert probe.main(args) == 0
    assert json.loads((tmp_path / "p.json").read_text())["runs"] == runs
