"""tracerl: RL post-training of MoE LMs with FP4 rollouts and rollout-guided QAT (TRACE)."""

__version__ = "0.1.0"
