"""Run summaries: the first/last table and the reward/mismatch plot of `tracerl train`."""

from __future__ import annotations

from pathlib import Path

SUMMARY_KEYS = (
    "reward/mean", "acc/mean", "eval/acc", "response_len/mean", "entropy/mean", "mismatch/kl_k3",
    "mismatch/logp_abs_diff_mean", "mismatch/frac_ratio_outside_0.5_2", "flips/act_frac",
    "guidance/bytes_per_token", "is/clip_frac", "throughput/rollout_tok_s",
)


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3e}" if (abs(v) < 1e-2 and v != 0) else f"{v:.4f}"


def summary_rows(history: list[dict]) -> list[tuple[str, str, str]]:
    """(metric, first value, last value) for the summary table."""
    rows = []
    for k in SUMMARY_KEYS:
        vals = [h[k] for h in history if k in h]
        if vals:
            rows.append((k, _fmt(vals[0]), _fmt(vals[-1])))
    return rows


def plot_run(history: list[dict], path: str | Path) -> Path:
    """Reward (train and eval) and mismatch KL per step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    steps = [h["step"] for h in history]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    a1.plot(steps, [h["reward/mean"] for h in history], label="train reward")
    ev = [(h["step"], h["eval/acc"]) for h in history if "eval/acc" in h]
    if ev:
        a1.plot(*zip(*ev), "o-", label="held-out acc")
    a1.set_xlabel("step")
    a1.set_title("reward")
    a1.legend()
    a2.semilogy(steps, [max(h["mismatch/kl_k3"], 1e-12) for h in history], label="kl_k3 (train vs rollout)")
    a2.set_xlabel("step")
    a2.set_title("train-rollout mismatch")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
