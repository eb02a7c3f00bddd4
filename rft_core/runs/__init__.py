"""Run bookkeeping, apart from the algorithm: flags (cli, checks), exit and signals (run), the output dir
(run_dir), checkpoints (checkpoint, integrity), the health guard (health), metrics (metrics, plots)."""
