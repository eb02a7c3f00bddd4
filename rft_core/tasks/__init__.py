"""The built-in tasks: arithmetic (train_ppo.py's default), shapes (train_ppo_vl.py's), and the multiply
task with its calculator environment (calculator)."""
