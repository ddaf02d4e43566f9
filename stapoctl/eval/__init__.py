"""Evaluation: the paper's benchmark protocol, avg@k/pass@k/maj@k, the resumable eval runner."""
