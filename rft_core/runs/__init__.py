"""Run bookkeeping, apart from the algorithm: the flags parsed (cli) and checked (checks), the process's
exit and signals (run), the output directory and its lock (run_dir), checkpoints (checkpoint) and their
manifests (integrity), the health guard (health), metrics.jsonl and the samples (metrics), the curves
(plots)."""
