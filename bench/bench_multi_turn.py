"""The built-in multi-turn task, with and without its tool: train_ppo.py on --prompt_data multiply (3-digit x
2-digit products) with --env calculator, and the same job without the environment (the model answers
alone), for each seed. One JSON line per run: held-out greedy accuracy at step 0 and at the end, the median
steady-state step time and its phases, turns per episode and calculator calls, environment errors.

    python bench/bench_multi_turn.py --seeds 0 1 2                  # one GPU: the defaults (15 steps)
    python bench/bench_multi_turn.py --seeds 0 -- --max_steps 4     # flags after -- go to train_ppo.py
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import TRAIN_PPO, launch, log_tail, read_run, split_argv  # noqa: E402


def run(seed, tool, flags, workdir):
    out = os.path.join(workdir, f"{'tool' if tool else 'alone'}-{seed}")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, TRAIN_PPO, "--prompt_data", "multiply", "--seed", str(seed), "--output_dir", out,
           *(["--env", "calculator"] if tool else []), *flags]
    start = time.perf_counter()
    rc = launch(cmd, f"{out}.log")
    wall = time.perf_counter() - start
    if rc:
        return {"seed": seed, "tool": tool, "error": log_tail(f"{out}.log", 40)}
    steps, evals, _ = read_run(out)
    steady = steps[2:] or steps  # step 1 compiles
    median = lambda key: statistics.median(r[key] for r in steady) if key in steady[0] else None  # noqa: E731
    result = {"seed": seed, "tool": tool, "command": " ".join(cmd[1:]), "wall_s": round(wall, 1),
              "steps": len(steps), "eval_accuracy_start": evals[0]["eval/accuracy"],
              "eval_accuracy_end": evals[-1]["eval/accuracy"],
              "reward_first": steps[0]["rollout/reward_mean"],
              "reward_last": steps[-1]["rollout/reward_mean"]}
    for key in ("perf/step_time_s", "perf/generate_s", "perf/update_s", "perf/env_s", "rollout/turns_mean",
                "rollout/env/calls", "rollout/response_length", "rollout/env_tokens"):
        result[key] = median(key)
    result["env_errors"] = sum(r.get("rollout/env_errors", 0) for r in steps)
    return result


def main():
    argv, flags = split_argv(sys.argv[1:])
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--only", choices=("tool", "alone"), help="run one of the two jobs")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--workdir", help="where the runs write (default: a temporary directory)")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_multi_turn-")
    os.makedirs(workdir, exist_ok=True)
    for seed in args.seeds:
        for tool in (True, False):
            if args.only and args.only != ("tool" if tool else "alone"):
                continue
            line = json.dumps(run(seed, tool, flags, workdir))
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
