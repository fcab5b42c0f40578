"""Run configuration: typed dataclasses, loadable from YAML, overridable with dotted `key=value`.

    tracerl train --config configs/tiny-arith.yaml train.lr=3e-4 rollout.recipe=w4a16

Every section and field is listed here with its default; the whole resolved config is saved
with each run (runs/<name>/config.yaml), so a run can always be reproduced.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class ModelSection:
    """Which model: a preset built from random init, or a local HF checkpoint folder."""

    preset: str = "tiny"
    path: str | None = None
    seed: int = 0


@dataclass
class TaskSection:
    """Which task (tracerl.tasks.names()) and its options."""

    name: str = "arith"
    options: dict[str, Any] = field(default_factory=dict)
    eval_prompts: int = 64


@dataclass
class RolloutSection:
    """The rollout engine: precision recipe and sampling."""

    recipe: str = "w4a4kv4"  # bf16 | w4a16 | w4a4 | w4a4kv4
    format: str = "nvfp4"  # nvfp4 | mxfp4
    sites: str = "experts+kv"  # experts+kv | all-linear
    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    max_new_tokens: int = 0  # 0: the task's default
    temperature: float = 1.0
    top_p: float = 1.0
    diagnostics: bool = True  # record every site's codes to measure flips (costs memory)
    # reference: the model's PyTorch forward (any device, exact FP4 via tracerl.fp4); graph: CUDA only,
    # the Triton FP4 kernels with one CUDA graph per decode step, recording inside it (rollout/graph_engine.py)
    engine: str = "reference"


@dataclass
class GuidanceSection:
    """The CachePolicy: which layers/fields/encoding the rollout records for TRACE."""

    layers: str = "fraction:0.5"
    fields: str = "codes+scales"
    encoding: str = "lsb"
    delta: float = 0.05


@dataclass
class TrainSection:
    """The trainer: alignment with the rollout, optimisation, schedule."""

    alignment: str = "trace"  # none | qat | trace
    routing_replay: bool = True
    steps: int = 40
    lr: float = 1e-3
    lr_schedule: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 0  # sequences per forward/backward; 0 = the whole batch
    compute_dtype: str = "bfloat16"  # the trainer forward; master weights stay float32
    seed: int = 0


@dataclass
class LossSection:
    """GRPO/DAPO policy loss."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    dynamic_sampling: bool = False
    agg: str = "token-mean"  # token-mean | seq-mean
    scale_advantages: bool = True


@dataclass
class CorrectionSection:
    """Importance-sampling correction of the rollout/trainer ratio."""

    kind: str = "tis"  # none | tis | mis
    level: str = "token"  # token | sequence
    threshold: float = 2.0


@dataclass
class WarmStartSection:
    """Supervised warm start so a randomly initialised model starts RL with non-zero reward."""

    steps: int = 300  # the most steps; fewer if stop_at_reward is reached
    batch_size: int = 32
    lr: float = 3e-3
    examples: int = 4000
    # > 0: every check_every steps, sample the train split (16 prompts x 8 samples, the rollout's
    # temperature) and stop once the mean reward reaches this. RL learns from groups whose samples
    # differ; a warm start that solves every training prompt leaves it nothing (docs/decisions.md)
    stop_at_reward: float = 0.0
    check_every: int = 50


@dataclass
class RunSection:
    """Where and how often to log, evaluate and checkpoint."""

    name: str = "tiny-arith"
    out_dir: str = "runs"
    checkpoint_every: int = 10
    eval_every: int = 10
    tensorboard: bool = True
    device: str = "auto"  # auto | cpu | cuda
    cpu_threads: int = 1  # torch intra-op threads on CPU; 0 = torch's default (see docs/decisions.md)
    # CUDA only: deterministic kernels, so that a config reproduces its run bit for bit on the same GPU
    # and software (about 7% slower on the H200; CPU runs are deterministic anyway). docs/decisions.md
    deterministic: bool = True


@dataclass
class Config:
    """A whole run."""

    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    guidance: GuidanceSection = field(default_factory=GuidanceSection)
    train: TrainSection = field(default_factory=TrainSection)
    loss: LossSection = field(default_factory=LossSection)
    correction: CorrectionSection = field(default_factory=CorrectionSection)
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    run: RunSection = field(default_factory=RunSection)

    def __post_init__(self) -> None:
        choices = {
            ("rollout", "recipe"): ("bf16", "w4a16", "w4a4", "w4a4kv4"),
            ("rollout", "format"): ("nvfp4", "mxfp4"),
            ("rollout", "sites"): ("experts+kv", "all-linear"),
            ("train", "alignment"): ("none", "qat", "trace"),
            ("train", "lr_schedule"): ("constant", "cosine"),
            ("train", "compute_dtype"): ("bfloat16", "float32"),
            ("loss", "agg"): ("token-mean", "seq-mean"),
            ("correction", "kind"): ("none", "tis", "mis"),
            ("correction", "level"): ("token", "sequence"),
            ("run", "device"): ("auto", "cpu", "cuda"),
        }
        for (sec, key), allowed in choices.items():
            v = getattr(getattr(self, sec), key)
            if v not in allowed:
                raise ValueError(f"{sec}.{key}={v!r} is not one of {allowed}")
        if self.train.alignment != "none" and self.rollout.recipe == "bf16":
            raise ValueError("train.alignment qat/trace needs an FP4 rollout.recipe; with bf16 rollouts use alignment=none")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (what config.yaml holds)."""
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write as YAML."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"{key} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        return str(value)
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown config key(s) {sorted(prefix + k for k in unknown)}; valid: {sorted(prefix + n for n in names)}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ValueError(f"{prefix}{name} must be a section (mapping), got {value!r}")
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, prefix + name)
    return cls(**kwargs)


_ALIASES = {"trainer": "train"}


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings (values parsed as YAML scalars) to a nested dict."""
    for ov in overrides:
        if "=" not in ov:
            raise ValueError(f"override {ov!r} must look like section.key=value")
        key, _, raw = ov.partition("=")
        parts = key.strip().split(".")
        parts[0] = _ALIASES.get(parts[0], parts[0])
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {ov!r}: {p} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() != "" else ""
    return data


def config_from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> Config:
    """Build a Config from a nested dict (as config.yaml holds it) plus dotted overrides."""
    data = {_ALIASES.get(k, k): v for k, v in copy.deepcopy(data).items()}
    return _build(Config, apply_overrides(data, overrides or []), "")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults) and apply dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} not found (the shipped ones are in configs/)")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{p} must hold a mapping of sections")
    return config_from_dict(data, overrides)
