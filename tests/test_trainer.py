"""The RL trainer: alignment ordering, resume exactness, crash safety, divergence, config, CLI."""

import json
import re

import pytest
import torch

from tracerl import qat
from tracerl.config import load_config
from tracerl.guidance import CachePolicy
from tracerl.rl import trainer as trainer_mod
from tracerl.rl.alignment import alignment_report
from tracerl.rl.collect import collect
from tracerl.rl.trainer import Trainer, TrainingDiverged
from tracerl.rollout import Engine

FAST = [
    "warm_start.steps=10", "warm_start.batch_size=8", "warm_start.examples=64", "train.steps=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "run.eval_every=0", "run.tensorboard=false",
    "task.eval_prompts=8", "rollout.max_new_tokens=8",
]


def _cfg(tmp_path, name, extra=()):
    return load_config("configs/tiny-arith.yaml", [f"run.out_dir={tmp_path}", f"run.name={name}", *FAST, *extra])


def _strip(m):
    return {k: v for k, v in m.items() if not k.startswith(("timing/", "throughput/"))}


def test_trace_beats_qat_beats_none_on_the_same_rollouts(tmp_path):
    cfg = _cfg(tmp_path, "order", ["train.compute_dtype=bfloat16", "warm_start.steps=40", "warm_start.examples=400"])
    t = Trainer(cfg)
    t.warm_start()
    recipe = qat.Recipe("w4a4kv4")
    results = {}
    for layers, enc in (("fraction:0.5", "lsb"), ("all", "codes")):
        eng = Engine(t.model, recipe, CachePolicy(layers, encoding=enc), diagnostics=True)
        prompts = t.task.prompts("train", 8, seed=1)
        batch = collect(eng, t.task, prompts, samples_per_prompt=4, max_new_tokens=t.max_new_tokens, seed=1).batch
        rows = {
            "none": alignment_report(t.model, batch, alignment="none", recipe=recipe, routing_replay=False),
            "qat": alignment_report(t.model, batch, alignment="qat", recipe=recipe, routing_replay=False),
            "trace": alignment_report(t.model, batch, alignment="trace", recipe=recipe, routing_replay=True),
        }
        results[(layers, enc)] = rows
        print(f"\n{layers}/{enc} ({batch.guidance_bytes_per_token:.0f} B/token):")
        for k, m in rows.items():
            print(f"  {k:6s} kl_k3 {m['mismatch/kl_k3']:.3e}  flips {m['flips/act_frac']:.4f}")
        kl = {k: m["mismatch/kl_k3"] for k, m in rows.items()}
        fl = {k: m["flips/act_frac"] for k, m in rows.items()}
        assert kl["trace"] < kl["qat"] < kl["none"]
        assert fl["trace"] < fl["qat"] < fl["none"]
    full = results[("all", "codes")]["trace"]
    assert full["flips/act_frac"] == 0.0
    assert all(v == 0.0 for k, v in full.items() if k.startswith("flips/layer_"))


def test_resume_reproduces_an_uninterrupted_run_even_after_a_crash_mid_checkpoint(tmp_path, monkeypatch):
    full = Trainer(_cfg(tmp_path, "full", ["run.checkpoint_every=2"]))
    full.warm_start()
    ref = [_strip(full.train_step()) for _ in range(4)]

    part = Trainer(_cfg(tmp_path, "part", ["run.checkpoint_every=2"]))
    part.warm_start()
    part.train_step()
    part.train_step()  # checkpoint at step 2
    good = (part.dir / "checkpoint.pt").read_bytes()
    part.train_step()

    # the process dies while writing the step-4 checkpoint: the step-2 one must survive intact
    def dying_save(obj, f, *a, **k):
        f.write(b"partial garbage")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        part.train_step()
    monkeypatch.undo()
    assert (part.dir / "checkpoint.pt").read_bytes() == good
    assert not list(part.dir.glob("*.tmp"))

    resumed = Trainer(_cfg(tmp_path, "part", ["run.checkpoint_every=2"]), resume=True)
    assert resumed.step == 2
    got = [_strip(m) for m in resumed.history] + [_strip(resumed.train_step()) for _ in range(2)]
    assert got == ref
    lines = [json.loads(x) for x in (resumed.dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]


def test_nan_loss_stops_with_clear_message_and_keeps_checkpoint(tmp_path, monkeypatch):
    t = Trainer(_cfg(tmp_path, "nan"))
    t.warm_start()
    before = (t.dir / "checkpoint.pt").read_bytes()
    real = trainer_mod.clipped_pg_loss_NT

    def nan_loss(*a, **k):
        loss, c = real(*a, **k)
        return loss * float("nan"), c

    monkeypatch.setattr(trainer_mod, "clipped_pg_loss_NT", nan_loss)
    with pytest.raises(TrainingDiverged, match="non-finite loss.*last good state"):
        t.train_step()
    assert (t.dir / "checkpoint.pt").read_bytes() == before


def test_config_yaml_overrides_and_errors(tmp_path):
    cfg = load_config("configs/tiny-arith.yaml", ["trainer.lr=3e-4", "rollout.recipe=w4a16", "guidance.layers=deepest:2"])
    assert cfg.train.lr == 3e-4 and cfg.rollout.recipe == "w4a16" and cfg.guidance.layers == "deepest:2"
    with pytest.raises(ValueError, match="unknown config key.*train.lrr"):
        load_config("configs/tiny-arith.yaml", ["train.lrr=1"])
    with pytest.raises(ValueError, match="train.steps must be an integer"):
        load_config("configs/tiny-arith.yaml", ["train.steps=abc"])
    with pytest.raises(ValueError, match="rollout.recipe='w8a8'"):
        load_config("configs/tiny-arith.yaml", ["rollout.recipe=w8a8"])
    with pytest.raises(ValueError, match="needs an FP4 rollout"):
        load_config("configs/tiny-arith.yaml", ["rollout.recipe=bf16"])
    with pytest.raises(FileNotFoundError, match="configs/"):
        load_config("nope.yaml")
    cfg.save(tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


def test_cli_train_writes_metrics_plot_and_resumes(tmp_path, capsys):
    from tracerl.cli import main

    args = ["train", "--config", "configs/tiny-arith.yaml", f"run.out_dir={tmp_path}", "run.name=cli", *FAST,
            "train.steps=2", "run.checkpoint_every=1"]
    assert main(args) == 0
    # the summary compares the warm-started policy with the trained one
    assert re.search(r"before RL \d\.\d{3}, after \d\.\d{3}", capsys.readouterr().out)
    run = tmp_path / "cli"
    assert (run / "summary.png").stat().st_size > 1000
    lines = (run / "metrics.jsonl").read_text().splitlines()
    names = set(json.loads(lines[-1]))
    for k in ("reward/mean", "reward/std", "acc/mean", "response_len/mean", "entropy/mean", "mismatch/kl_k3",
              "mismatch/logp_abs_diff_mean", "mismatch/prob_abs_diff_mean", "mismatch/prob_abs_diff_max",
              "mismatch/ratio_max", "mismatch/frac_ratio_outside_0.5_2", "flips/act_frac", "flips/layer_3",
              "guidance/bytes_per_token", "guidance/coverage", "is/clip_frac", "timing/rollout_s",
              "timing/train_s", "throughput/rollout_tok_s"):
        assert k in names, k
    assert main(["train", "--resume", str(run), "train.steps=3"]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    assert main(["train", "--config", "configs/tiny-arith.yaml", "train.bogus=1"]) == 2


def test_cli_eval_uses_the_runs_device_and_dtype(tmp_path, monkeypatch, capsys):
    import tracerl.rollout
    from tracerl.cli import main

    assert main(["train", "--config", "configs/tiny-arith.yaml", f"run.out_dir={tmp_path}", "run.name=ev", *FAST,
                 "train.steps=1", "train.compute_dtype=float32", "run.device=cpu"]) == 0
    built = []
    real = tracerl.rollout.Engine

    def spy(*a, **kw):
        built.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(tracerl.rollout, "Engine", spy)
    # a machine with a GPU must not turn a CPU float32 run's eval into a bf16 engine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capsys.readouterr()
    assert main(["eval", "--run", str(tmp_path / "ev"), "--n", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 1 and 0.0 <= out["acc"] <= 1.0
    assert built[-1]["dtype"] == torch.float32 and torch.device(built[-1]["device"]).type == "cpu"


@pytest.mark.slow
def test_demo_reward_rises(tmp_path):
    cfg = load_config("configs/tiny-arith.yaml", [f"run.out_dir={tmp_path}", "run.name=demo"])
    t = Trainer(cfg)
    t.warm_start()
    hist = [t.train_step() for _ in range(cfg.train.steps)]
    first = sum(h["reward/mean"] for h in hist[:5]) / 5
    last = sum(h["reward/mean"] for h in hist[-5:]) / 5
    print(f"reward first5 {first:.3f} last5 {last:.3f}")
    assert last > first + 0.05


def test_warm_start_stops_once_the_sampled_train_reward_reaches_its_target(tmp_path, monkeypatch):
    # off (0): every step runs and nothing is sampled
    t = Trainer(_cfg(tmp_path, "off"))
    assert len(t.warm_start()) == 10 and t.warm_checks == []
    # unreachable: every check_every steps a sampled check (not after the last step), all steps run
    t = Trainer(_cfg(tmp_path, "never", ["warm_start.stop_at_reward=1.01", "warm_start.check_every=3"]))
    assert len(t.warm_start()) == 10
    assert [c["step"] for c in t.warm_checks] == [3, 6, 9]
    assert all(0.0 <= c["reward"] <= 1.0 for c in t.warm_checks)
    # the check samples the policy as trained so far: rewards from collect, a fixed prompt set
    seen = []
    real = trainer_mod.collect

    def fake(engine, task, prompts, **kw):
        col = real(engine, task, prompts, **kw)
        seen.append(([p.id for p in prompts], engine.recipe.name, kw["samples_per_prompt"]))
        col.rewards.fill_(0.5 if len(seen) == 1 else 0.9)
        return col

    monkeypatch.setattr(trainer_mod, "collect", fake)
    t = Trainer(_cfg(tmp_path, "stops", ["warm_start.stop_at_reward=0.8", "warm_start.check_every=3"]))
    assert len(t.warm_start()) == 6  # 0.5 at step 3, 0.9 >= 0.8 at step 6
    assert t.warm_checks == [{"step": 3, "reward": 0.5}, {"step": 6, "reward": pytest.approx(0.9)}]
    assert seen[0][0] == seen[1][0] and len(seen[0][0]) == trainer_mod.WARM_CHECK_PROMPTS
    assert seen[0][1:] == ("bf16", trainer_mod.WARM_CHECK_SAMPLES)  # the shared warm start is checked in BF16


def test_warm_start_restores_train_mode_after_each_check():
    from tracerl import model as M
    from tracerl import tasks as T
    from tracerl.rl.sft import warm_start

    m = M.build("tiny", seed=0)
    modes = []

    def stop(step):
        modes.append((step, m.training, torch.is_grad_enabled()))
        return step >= 4

    losses = warm_start(m, T.get("arith"), steps=9, batch_size=4, lr=1e-3, examples=16, stop=stop, check_every=2)
    assert len(losses) == 4 and modes == [(2, False, False), (4, False, False)] and m.training
