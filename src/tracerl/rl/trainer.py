"""TRACE RL trainer: GRPO with FP4 rollouts and rollout-guided QAT.

One step (DESIGN.md "Data flow"):
  pack the master weights to FP4 once -> engine.load_weights (bit-identical FP4 weights on both
  sides) -> the engine samples G completions for each of P prompts, recording routing and the
  CachePolicy's guidance -> the task scores them -> the trainer runs a teacher-forced forward in
  the configured alignment (none / qat / trace, optional routing replay) -> GRPO advantages,
  DAPO clip-higher PPO loss, optional k3 KL to the warm-start policy, optional TIS/MIS correction
  of the rollout/trainer ratio -> AdamW on float32 master weights.
Every step logs DESIGN.md's metrics to runs/<name>/metrics.jsonl (and TensorBoard) and
checkpoints atomically every `run.checkpoint_every` steps; `--resume` continues exactly, since
prompts and sampling seeds derive from (seed, step) and the RNG state is checkpointed.

    tracerl train --config configs/tiny-arith.yaml train.alignment=qat
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils.deterministic

from tracerl import model as M
from tracerl import qat
from tracerl import tasks as T
from tracerl.config import Config
from tracerl.guidance import CachePolicy
from tracerl.rl import checkpoint as ckpt
from tracerl.rl.alignment import trainer_forward
from tracerl.rl.collect import collect
from tracerl.rl.corrections import Correction
from tracerl.rl.evaluate import evaluate
from tracerl.rl.losses import aggregate, clipped_pg_loss_NT, group_advantages, k3_kl_NT, zero_variance_groups
from tracerl.rl.metrics import entropy_mean, flip_metrics, mismatch_metrics
from tracerl.rl.sft import warm_start
from tracerl.rollout import Engine, make_engine


class TrainingDiverged(RuntimeError):
    """A NaN/inf loss or weights: the run stops and the last good checkpoint is kept."""


def resolve_device(cfg: Config) -> torch.device:
    """The device a run's config asks for (`run.device`: auto, cpu or cuda)."""
    if cfg.run.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but CUDA is not available; use run.device=cpu")
    return torch.device(cfg.run.device)


# warm_start.stop_at_reward's check: 16 training prompts x 8 samples (a reward to about +-0.04),
# drawn with a seed no RL step uses
WARM_CHECK_PROMPTS, WARM_CHECK_SAMPLES, WARM_CHECK_SEED = 16, 8, 4242


def use_deterministic_kernels(device: torch.device, on: bool) -> bool:
    """On CUDA, switch PyTorch's deterministic algorithms on or off (process-wide, as PyTorch has it);
    return the previous setting, for `Trainer.close` to restore.

    Without them the backward of the MoE dispatch (index_put_ with accumulate) sums in atomics' order:
    on the H200 two identical warm starts of small/code differed by 4e-9 after 40 steps, enough
    for one different sample a few RL steps later (bench/determinism.py; bench/RESULTS.md). warn_only:
    an op without a deterministic kernel warns instead of stopping a long run; on the H200 the
    warm start and RL steps reproduced bit for bit this way.
    """
    before = torch.are_deterministic_algorithms_enabled()
    if device.type != "cuda" or on == before:
        return before
    if on and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        # cuBLAS reads it once, when PyTorch first uses it: the CLI sets it before any CUDA work
        if torch.cuda.is_initialized():
            warnings.warn("run.deterministic: CUDA started before CUBLAS_WORKSPACE_CONFIG was set, so cuBLAS may "
                          "not be reproducible; set CUBLAS_WORKSPACE_CONFIG=:4096:8 before using CUDA", stacklevel=3)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(on, warn_only=True)
    # the mode also fills every new CUDA tensor with NaN (to expose reads of uninitialized memory):
    # a kernel per allocation in the decode loop, and no part of reproducibility
    torch.utils.deterministic.fill_uninitialized_memory = False
    return before


def compute_dtype_of(cfg: Config) -> torch.dtype:
    """The trainer forward's dtype (`train.compute_dtype`)."""
    return torch.bfloat16 if cfg.train.compute_dtype == "bfloat16" else torch.float32


def rollout_dtype(device: torch.device, compute_dtype: torch.dtype) -> torch.dtype:
    """The engine's dtype: bf16 on the GPU (as a serving engine runs), else the trainer's compute dtype."""
    return torch.bfloat16 if device.type == "cuda" or compute_dtype == torch.bfloat16 else torch.float32


def step_seed(seed: int, step: int) -> int:
    """The seed of one step's prompts and sampling (independent of earlier steps, so resumes are exact)."""
    return (seed * 1_000_003 + step * 7919 + 17) % (2**31 - 1)


class Trainer:
    """Owns the policy, the optimizer, the engine and the run directory."""

    def __init__(self, cfg: Config, *, resume: bool = False, log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.log = log or (lambda s: None)
        self.device = resolve_device(cfg)
        if self.device.type == "cpu" and cfg.run.cpu_threads > 0:
            torch.set_num_threads(cfg.run.cpu_threads)
        # run.deterministic: false leaves the process's setting as it is
        self._deterministic_before = (use_deterministic_kernels(self.device, True) if cfg.run.deterministic
                                      else None)
        self.warm_checks: list[dict[str, float]] = []
        self.dir = Path(cfg.run.out_dir) / cfg.run.name
        self.task = T.get(cfg.task.name, **cfg.task.options)
        self.recipe = qat.Recipe(cfg.rollout.recipe, fmt=cfg.rollout.format, sites=cfg.rollout.sites)
        self.policy = CachePolicy(cfg.guidance.layers, cfg.guidance.fields, cfg.guidance.encoding, cfg.guidance.delta)
        self.compute_dtype = compute_dtype_of(cfg)
        self.correction = Correction(cfg.correction.kind, cfg.correction.level, cfg.correction.threshold)
        self.max_new_tokens = cfg.rollout.max_new_tokens or self.task.max_new_tokens
        torch.manual_seed(cfg.train.seed)
        if cfg.model.path:
            self.model = M.from_pretrained(cfg.model.path)
        else:
            self.model = M.build(cfg.model.preset, seed=cfg.model.seed)
        if self.task.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ValueError(
                f"the task's tokenizer has {self.task.tokenizer.vocab_size} ids but the model's vocab is "
                f"{self.model.config.vocab_size}; pick a model whose vocab covers the tokenizer"
            )
        self.model.to(self.device).float()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                     betas=(0.9, 0.99))
        self.ref_model: torch.nn.Module | None = None
        self.step = 0
        self.history: list[dict] = []
        self.warm_losses: list[float] = []
        if resume:
            self._resume()
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.dir / "config.yaml")
            (self.dir / "metrics.jsonl").write_text("")
        self.engine = make_engine(cfg.rollout.engine, self.model, self.recipe,
                                  self.policy if cfg.train.alignment == "trace" else None,
                                  dtype=rollout_dtype(self.device, self.compute_dtype), device=self.device,
                                  diagnostics=cfg.rollout.diagnostics)
        self._tb = None

    # ------------------------------------------------------------------ lifecycle

    def warm_start(self, on_step: Callable[[int, float], None] | None = None) -> list[float]:
        """The supervised warm start (skipped on resume), then the step-0 checkpoint."""
        w = self.cfg.warm_start
        self.warm_losses = warm_start(
            self.model, self.task, steps=w.steps, batch_size=w.batch_size, lr=w.lr, examples=w.examples,
            seed=self.cfg.train.seed, compute_dtype=self.compute_dtype, device=self.device, on_step=on_step,
            stop=self.warm_start_stop(), check_every=w.check_every,
        )
        if self.cfg.loss.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.save()
        return self.warm_losses

    def warm_start_stop(self) -> Callable[[int], bool] | None:
        """The test behind `warm_start.stop_at_reward` (None when it is 0); each check is appended to
        `self.warm_checks` as {"step", "reward"}.

        The sampled reward is the policy's own, in BF16 with the rollout's temperature, on a fixed
        set of training prompts: the warm start is shared by rows of every rollout precision.
        """
        w = self.cfg.warm_start
        self.warm_checks = []
        if w.stop_at_reward <= 0:
            return None
        if w.check_every < 1:
            raise ValueError(f"warm_start.check_every must be >= 1 when stop_at_reward is set (got {w.check_every})")
        engine = Engine(self.model, qat.Recipe("bf16"), None, dtype=self.engine.dtype, device=self.device)
        prompts = self.task.prompts("train", WARM_CHECK_PROMPTS, seed=WARM_CHECK_SEED)

        def stop(step: int) -> bool:
            engine.load_weights(self.model.pack_weights(engine.recipe, dtype=engine.dtype))
            col = collect(engine, self.task, prompts, samples_per_prompt=WARM_CHECK_SAMPLES,
                          max_new_tokens=self.max_new_tokens, temperature=self.cfg.rollout.temperature, seed=step)
            reward = float(col.rewards.mean())
            self.warm_checks.append({"step": step, "reward": reward})
            self.log(f"warm start step {step}: sampled train reward {reward:.3f} (stops at {w.stop_at_reward})")
            return reward >= w.stop_at_reward

        return stop

    def start_from(self, model_state: dict) -> None:
        """Skip the warm start: begin RL from given weights (e.g. a warm start shared by many runs)."""
        self.model.load_state_dict(model_state)
        if self.cfg.loss.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.save()

    def save(self) -> None:
        """Atomic checkpoint of everything a resume needs."""
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "rng": torch.get_rng_state(),
            "ref_model": None if self.ref_model is None else self.ref_model.state_dict(),
            "config": self.cfg.to_dict(),
            "warm_losses": self.warm_losses,
        }
        ckpt.save_atomic(state, self.dir / "checkpoint.pt")

    def _resume(self) -> None:
        state = ckpt.load(self.dir / "checkpoint.pt")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.step = state["step"]
        self.warm_losses = state.get("warm_losses", [])
        if state.get("ref_model") is not None:
            self.ref_model = copy.deepcopy(self.model)
            self.ref_model.load_state_dict(state["ref_model"])
            self.ref_model.eval().requires_grad_(False)
        # metrics logged after the checkpoint (by a run that then died) are replayed, not duplicated
        path = self.dir / "metrics.jsonl"
        kept = []
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip() and json.loads(line)["step"] <= self.step:
                    kept.append(line)
        path.write_text("".join(k + "\n" for k in kept))
        self.history = [json.loads(k) for k in kept]

    # ------------------------------------------------------------------ one RL step

    def _lr(self, step: int) -> float:
        t = self.cfg.train
        if t.warmup_steps and step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        if t.lr_schedule == "cosine":
            frac = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
            return t.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        return t.lr

    def train_step(self) -> dict[str, float]:
        """Rollout, score, and update once; return the step's metrics."""
        cfg = self.cfg
        seed = step_seed(cfg.train.seed, self.step)
        t0 = time.perf_counter()
        self.engine.load_weights(self.model.pack_weights(self.recipe, dtype=self.engine.dtype))
        prompts = self.task.prompts("train", cfg.rollout.prompts_per_step, seed=seed)
        col = collect(self.engine, self.task, prompts, samples_per_prompt=cfg.rollout.samples_per_prompt,
                      max_new_tokens=self.max_new_tokens, temperature=cfg.rollout.temperature,
                      top_p=cfg.rollout.top_p, seed=seed)
        t_roll = time.perf_counter() - t0
        batch = col.batch
        rewards = col.rewards.to(self.device)
        adv = group_advantages(rewards, batch.prompt_index, scale=cfg.loss.scale_advantages)
        keep = torch.ones(len(batch), dtype=torch.bool, device=self.device)
        if cfg.loss.dynamic_sampling:
            keep = ~zero_variance_groups(rewards, batch.prompt_index)

        t1 = time.perf_counter()
        metrics = self._update(batch, adv, keep)
        t_train = time.perf_counter() - t1

        lens = batch.policy_mask.sum(-1).float()
        metrics.update({
            "step": self.step + 1,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "acc/mean": float((rewards >= 1.0 - 1e-6).float().mean()),
            "response_len/mean": float(lens.mean()),
            "guidance/bytes_per_token": batch.guidance_bytes_per_token,
            "guidance/coverage": self._coverage(batch),
            "timing/rollout_s": t_roll,
            "timing/train_s": t_train,
            "throughput/rollout_tok_s": batch.n_generated / max(t_roll, 1e-9),
            "train/kept_frac": float(keep.float().mean()),
        })
        if getattr(self.task, "multi_turn", False):
            metrics["episode/turns_mean"] = col.turns
        self.step += 1
        if cfg.run.eval_every and (self.step % cfg.run.eval_every == 0 or self.step == cfg.train.steps):
            metrics.update(self.evaluate())
        self._log(metrics)
        if cfg.run.checkpoint_every and (self.step % cfg.run.checkpoint_every == 0 or self.step == cfg.train.steps):
            self.save()
        return metrics

    def _coverage(self, batch) -> float:
        sites = [s for s in self.model.site_names() if not s.endswith(".weight") and self.recipe.quantizes(s)]
        return len([s for s in sites if s in batch.guidance]) / len(sites) if sites else 0.0

    def _update(self, batch, adv: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        cfg = self.cfg
        for g in self.opt.param_groups:
            g["lr"] = self._lr(self.step)
        mask_all = batch.policy_mask & keep[:, None]
        n_tokens = int(mask_all.sum())
        n_seqs = int((mask_all.sum(-1) > 0).sum())
        B = len(batch)
        mb = cfg.train.micro_batch_size or B
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "clip": 0.0, "is_hit": 0.0, "kl": 0.0}
        train_logp = torch.zeros_like(batch.logprobs)
        entropies, flips = [], {}
        for start in range(0, B, mb):
            rows = torch.arange(start, min(B, start + mb), device=self.device)
            sub = batch.select(rows)
            mask = mask_all[rows]
            fw = trainer_forward(self.model, sub, alignment=cfg.train.alignment, recipe=self.recipe,
                                 routing_replay=cfg.train.routing_replay, compute_dtype=self.compute_dtype,
                                 temperature=cfg.rollout.temperature)
            logp = fw.logp
            old = logp.detach()
            train_logp[rows] = old
            adv_NT = adv[rows][:, None].expand_as(logp)
            loss_tok, clipped = clipped_pg_loss_NT(logp, old, adv_NT, clip_low=cfg.loss.clip_low,
                                                   clip_high=cfg.loss.clip_high)
            w, hit = self.correction.weights(old, sub.logprobs, mask)
            loss_tok = loss_tok * w
            if self.ref_model is not None and cfg.loss.kl_coef > 0:
                with torch.no_grad():
                    ref = trainer_forward(self.ref_model, sub, alignment="none", recipe=self.recipe,
                                          routing_replay=False, compute_dtype=self.compute_dtype,
                                          temperature=cfg.rollout.temperature).logp
                kl = k3_kl_NT(logp, ref)
                loss_tok = loss_tok + cfg.loss.kl_coef * kl
                sums["kl"] += float((kl.detach() * mask).sum())
            loss = aggregate(loss_tok, mask, cfg.loss.agg, n_tokens=max(n_tokens, 1), n_seqs=max(n_seqs, 1))
            if not torch.isfinite(loss):
                raise TrainingDiverged(
                    f"non-finite loss ({loss.item()}) at step {self.step + 1}; the run stops and "
                    f"{self.dir / 'checkpoint.pt'} holds the last good state. Lower train.lr or check the rollouts."
                )
            loss.backward()
            sums["loss"] += float(loss.detach())
            sums["clip"] += float((clipped & mask).sum())
            sums["is_hit"] += float((hit & mask).sum())
            entropies.append(entropy_mean(fw.logits, mask) * float(mask.sum()))
            for site, f in fw.flips.items():
                acc = flips.setdefault(site, type(f)())
                acc.flipped += f.flipped
                acc.total += f.total
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.train.grad_clip)
        self.opt.step()
        for p in self.model.parameters():
            if not torch.isfinite(p).all():
                raise TrainingDiverged(
                    f"non-finite weights after step {self.step + 1}; the last good checkpoint is "
                    f"{self.dir / 'checkpoint.pt'}. Lower train.lr or train.grad_clip."
                )
        denom = max(n_tokens, 1)
        m = mismatch_metrics(train_logp, batch.logprobs, batch.policy_mask)
        m.update(flip_metrics(flips, self.model.config.num_layers))
        m.update({
            "loss/policy": sums["loss"],
            "train/grad_norm": float(grad_norm),
            "train/lr": self.opt.param_groups[0]["lr"],
            "entropy/mean": sum(entropies) / denom,
            "is/clip_frac": sums["is_hit"] / denom,
            "ppo/clip_frac": sums["clip"] / denom,
        })
        if cfg.loss.kl_coef > 0:
            m["kl/ref_k3"] = sums["kl"] / denom
        return m

    # ------------------------------------------------------------------ eval and logging

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy with greedy decoding, deployed in the rollout's precision."""
        self.engine.load_weights(self.model.pack_weights(self.recipe, dtype=self.engine.dtype))
        r = evaluate(self.engine, self.task, n=self.cfg.task.eval_prompts, max_new_tokens=self.max_new_tokens)
        return {"eval/acc": r["acc"], "eval/reward": r["reward"]}

    def _log(self, metrics: dict[str, float]) -> None:
        self.history.append(metrics)
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.cfg.run.tensorboard:
            if self._tb is None:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.dir / "tb"))
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, metrics["step"])
            self._tb.flush()

    def close(self) -> None:
        """Flush and close loggers; put back the process's deterministic-kernels setting."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._deterministic_before is not None:
            use_deterministic_kernels(self.device, self._deterministic_before)
            self._deterministic_before = None
