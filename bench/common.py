"""What the benches that run train_ppo.py share: the split of their command line, the launch, and reading a
run's output directory back."""

import json
import os
import signal
import subprocess
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_PPO = os.path.join(ROOT, "train_ppo.py")


def split_argv(argv):
    """(the bench's own arguments, the flags after -- that go to train_ppo.py)."""
    if "--" not in argv:
        return argv, []
    return argv[:argv.index("--")], argv[argv.index("--") + 1:]


def launch(cmd, log_path, timeout=None, env=None):
    """Run cmd with its output in log_path, each line after the seconds since launch (where start-up goes).
    Returns the exit code, or "timeout": then the run's threads' stacks go to the log (the scripts print
    them on SIGUSR1) and it is stopped."""
    started = time.time()
    with open(log_path, "w") as log:
        run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)

        def copy():
            for line in iter(run.stdout.readline, b""):
                log.write(f"{time.time() - started:7.1f} {line.decode(errors='replace')}")
                log.flush()

        copier = threading.Thread(target=copy, daemon=True)
        copier.start()
        try:
            rc = run.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
            run.send_signal(signal.SIGUSR1)
            time.sleep(2)
            run.terminate()
            try:
                run.wait(timeout=30)
            except subprocess.TimeoutExpired:
                run.kill()
                run.wait()
        copier.join(timeout=10)
    return rc


def log_tail(log_path, lines=12):
    """The last non-empty lines of a launch's log, for a run that failed."""
    with open(log_path, errors="replace") as f:
        return [line.rstrip()[:300] for line in f if line.strip()][-lines:]


def read_run(run_dir):
    """(steps, evaluations, config) of a train_ppo.py run: its metrics.jsonl's step rows and held-out
    evaluation rows, and its config.json; ([], [], {}) where it wrote no metrics."""
    if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        return [], [], {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    steps = [r for r in rows if "perf/step_time_s" in r]
    return steps, [r for r in rows if "eval/accuracy" in r], config
