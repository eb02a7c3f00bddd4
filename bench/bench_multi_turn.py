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
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(seed, tool, flags, workdir):
    out = os.path.join(workdir, f"{'tool' if tool else 'alone'}-{seed}")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, os.path.join(ROOT, "train_ppo.py"), "--prompt_data", "multiply", "--seed",
           str(seed), "--output_dir", out, *(["--env", "calculator"] if tool else []), *flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        return {"seed": seed, "tool": tool, "error": proc.stdout[-2000:] + proc.stderr[-2000:]}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "train/policy_loss" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
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
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--only", choices=("tool", "alone"), help="run one of the two jobs")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--workdir", help="where the runs write (default: a temporary directory)")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_multi_turn-")
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
