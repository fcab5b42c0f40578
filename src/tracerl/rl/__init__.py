"""RL: losses, importance-sampling corrections, mismatch metrics, the training loop."""
