"""The on-policy distillation study of docs/algorithms.md: a teacher made by the default GRPO job, then the
untrained SmolLM2-135M trained from it by distillation alone, by GRPO alone and by both, seed for seed, with
the same samples per step (the default 8 prompts x 4), held-out greedy accuracy after every step.

    python examples/distill_study.py --seeds 0 1 2                        # on one GPU, the runs side by side
    python examples/distill_study.py --seeds 0 --steps 2 --teacher_steps 2 --parallel 1 -- --engine_type hf \\
        --rollout_batch_size 2 --generate_max_len 16                      # a CPU smoke run

The teacher (seed 100, --teacher_steps steps of the default job) is trained once into ROOT/teacher and kept.
Then each seed's arms run, --parallel at a time on the one GPU (the engine never asleep, a small KV cache).
Flags after `--` go to every train_ppo.py run. A JSON line per run goes to $OUT/distill.jsonl (else ROOT),
with each run's log; the last line is the summary: per arm and step, the mean accuracy over the seeds.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# the checkout's root, for bench.common (run as a script, Python puts only examples/ on sys.path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import TRAIN_PPO, launch, read_run  # noqa: E402

ARMS = {"grpo": [], "distill": ["--advantage_estimator", "distill"], "grpo+distill": []}


def parse(argv):
    parser = argparse.ArgumentParser(prog="distill_study.py", allow_abbrev=False)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=15, help="steps of each student run")
    parser.add_argument("--teacher_steps", type=int, default=15, help="steps of the teacher's GRPO job")
    parser.add_argument("--parallel", type=int, default=3, help="runs at once on the GPU")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds a run may take")
    parser.add_argument("--root", default="/tmp/rft_distill")
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def train(args, name, flags):
    """One train_ppo.py run into ROOT/runs/NAME; its JSON line printed and appended to distill.jsonl."""
    out = os.environ.get("OUT", args.root)
    os.makedirs(out, exist_ok=True)
    run_dir = os.path.join(args.root, "runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)
    shared = [] if args.parallel == 1 else ["--engine_sleep", "never", "--engine_mem_util", "0.06"]
    start = time.time()
    rc = launch([sys.executable, TRAIN_PPO, "--output_dir", run_dir, *shared, *flags],
                os.path.join(out, f"{name}.log"), args.timeout)
    steps, evals, _ = read_run(run_dir)
    result = {"run": name, "rc": rc, "wall_s": round(time.time() - start, 1), "flags": flags,
              "eval": [(r["step"], r["eval/accuracy"]) for r in evals],
              "distill_kl": [round(r["train/distill_kl"], 4) for r in steps if "train/distill_kl" in r]}
    with open(os.path.join(out, "distill.jsonl"), "a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)
    return result


def main(argv):
    args, extra = parse(argv)
    teacher = os.path.join(args.root, "runs", "teacher", "model")
    if not os.path.exists(teacher):
        result = train(args, "teacher", ["--seed", "100", "--max_steps", str(args.teacher_steps), *extra])
        if result["rc"] != 0:
            raise SystemExit("the teacher's run failed: see teacher.log")
    distill = ["--teacher_pretrain", teacher]
    runs = [(f"{arm}-seed{seed}", ["--seed", str(seed), "--max_steps", str(args.steps), "--eval_steps", "1",
                                   *ARMS[arm], *(distill if "distill" in arm else []), *extra])
            for seed in args.seeds for arm in args.arms]
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda run: train(args, *run), runs))
    summary = {}
    for arm in args.arms:
        curves = [dict(r["eval"]) for r in results if r["run"].startswith(f"{arm}-seed") and r["rc"] == 0]
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        mean = [(step, round(statistics.mean(c[step] for c in curves), 3)) for step in steps]
        summary[arm] = {"seeds": len(curves), "accuracy": mean}
    line = json.dumps({"summary": summary, "teacher": read_run(os.path.dirname(teacher))[1][-1:]})
    with open(os.path.join(os.environ.get("OUT", args.root), "distill.jsonl"), "a") as f:
        f.write(line + "\n")
    print(line)
    if any(r["rc"] != 0 for r in results):
        raise SystemExit("some runs failed: see their logs")


if __name__ == "__main__":
    main(sys.argv[1:])
