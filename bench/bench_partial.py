"""Partial rollout against the synchronous loop on a heavy-tailed workload (issue 16's measurement).

The task: "Write the whole numbers from 1 to N" with N heavy-tailed (80% in 3-15, 20% in 40-150), so most
answers are short and a few are long; reward 1 for exactly 1..N, else half the share of correct leading
numbers. SmolLM2-135M (embedded), 32 prompts x 8 samples, --generate_max_len 512, held-out accuracy every
10 steps. Each seed runs the synchronous loop and --partial_rollout (budget 128 tokens, staleness 3: a
512-token answer spreads over 4 steps without generating unbudgeted), the same flags otherwise. One JSON
line per run: samples trained per second, tokens generated per second, the decode slots' utilization
(rollout/slot_utilization), reward and accuracy against step and time, and the completions' length tail
(p99 / median, in characters, from every completion scored).

    python bench/bench_partial.py --seeds 0 1 2 --steps 40              # one H100 (vLLM)
    python bench/bench_partial.py --warm_steps 12 --seeds 0 1 2 --steps 20   # from a model that stops
    python bench/bench_partial.py --warm_steps 12 --modes partial --inflight_ratio 2   # partial-r2-seed0
    python bench/bench_partial.py --warm_steps 12 --modes sync_tis    # synchronous with --tis_cap 2
    python bench/bench_partial.py --warm_steps 12 --frozen            # both arms at the warm-up's weights
    python bench/bench_partial.py --warm_steps 12 --tag drgrpo --arm_flags "--loss_agg_mode \
        seq-mean-token-sum-norm"                                     # flags for the measured runs only
    python bench/bench_partial.py --seeds 0 --steps 2 --max_len 32 --budget 8 -- --engine_type hf \
        --rollout_batch_size 4 --n_samples_per_prompt 2                  # a CPU smoke run (2-3 minutes)

Flags after -- go to train_ppo.py. Results go to $OUT (else --root): one JSON line per run appended to
partial.jsonl, and each run's log and step metrics (NAME.log, NAME.metrics.jsonl), which analyze_partial.py
reads.
"""

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def task_rows(n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        top = rng.randint(3, 15) if rng.random() < 0.8 else rng.randint(40, 150)
        rows.append({"prompt": f"Write the whole numbers from 1 to {top}, separated by single spaces, and "
                               "nothing else.", "label": str(top)})
    return rows


def reward(prompts, completions, labels):
    """1 for exactly 1..N; else half the share of the leading numbers that are right. Appends every
    completion's length (characters) to $COUNT_LENGTHS, for the tail statistics."""
    out = []
    for completion, label in zip(completions, labels):
        words, want = completion.split(), [str(i) for i in range(1, int(label) + 1)]
        right = next((i for i, (w, x) in enumerate(zip(words, want)) if w != x), min(len(words), len(want)))
        out.append(1.0 if words == want else 0.5 * right / len(want))
    if os.environ.get("COUNT_LENGTHS"):
        with open(os.environ["COUNT_LENGTHS"], "a") as f:
            f.write("".join(f"{len(c)}\n" for c in completions))
        # the answers that went on past N: what the rambling tail says, beside how far they were right
        with open(os.environ["COUNT_LENGTHS"] + ".overshoot.jsonl", "a") as f:
            for completion, label, r in zip(completions, labels, out):
                words = completion.split()
                if len(words) > int(label):
                    f.write(json.dumps({"label": int(label), "words": len(words), "chars": len(completion),
                                        "reward": r, "tail": completion[-160:]}) + "\n")
    return {"correct": [float(r == 1.0) for r in out], "partial": [r if r < 1 else 0.0 for r in out]}


def summarise(out_dir, lengths_file, skip, samples_per_step):
    rows, evals = [], []
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            (rows if "perf/step_time_s" in r else evals).append(r)
    if not rows:
        return {"steps": 0}
    steady = rows[skip:] or rows
    median_step = statistics.median(r["perf/step_time_s"] for r in steady)
    seconds = sum(r["perf/step_time_s"] for r in steady)
    lengths = sorted(int(x) for x in open(lengths_file)) if os.path.exists(lengths_file) else []
    return {
        "steps": len(rows), "steady_steps": len(steady),
        "step_s_median": median_step,
        "generate_s_median": statistics.median(r["perf/generate_s"] for r in steady),
        "samples_per_s": samples_per_step * len(steady) / seconds,
        # the median step's rate: a step that recompiled the trainer's layers (~10 s, once) does not weigh
        "samples_per_s_median": samples_per_step / median_step,
        "tokens_generated_per_s": sum(r["rollout/tokens_generated"] for r in steady) / seconds,
        "slot_utilization": statistics.mean(r["rollout/slot_utilization"] for r in steady),
        "staleness_max": max(r.get("rollout/staleness_max", 0) for r in rows),
        # where generation's time goes: rounds per step, and the tokens generated per trained sample (a
        # partial run also generates for samples still in the buffer at the end)
        "generation_rounds_mean": statistics.mean(r.get("rollout/generation_rounds", 1) for r in steady),
        "tokens_per_trained_sample": (sum(r["rollout/tokens_generated"] for r in rows)
                                      / (samples_per_step * len(rows))),
        "length_p50_chars": lengths[len(lengths) // 2] if lengths else None,
        "length_p99_chars": lengths[int(len(lengths) * 0.99)] if lengths else None,
        "reward_by_step": [round(r["rollout/reward_mean"], 4) for r in rows],
        "time_by_step": [round(sum(r["perf/step_time_s"] for r in rows[:i + 1]), 2)
                         for i in range(len(rows))],
        "eval": [(r["step"], r.get("eval/accuracy"), r.get("eval/reward_mean")) for r in evals],
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max_len", type=int, default=512)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--staleness", type=int, default=3)
    parser.add_argument("--inflight_ratio", type=float, help="partial runs only (named partial-rR-seedS)")
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the rates")
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--root", default="/tmp/rft_partial")
    parser.add_argument("--modes", nargs="+", default=["sync", "partial"],
                        choices=["sync", "sync_tis", "partial"])
    parser.add_argument("--warm_steps", type=int, default=0,
                        help="first train this many synchronous steps (seed 100); every run starts from them")
    parser.add_argument("--warm_max_len", type=int, help="the warm-up's --generate_max_len (else --max_len)")
    parser.add_argument("--eval_steps", type=int, default=10, help="held-out evaluation every N steps")
    parser.add_argument("--eval_problems", type=int, default=64, help="held-out problems (greedy)")
    parser.add_argument("--warm_only", action="store_true", help="train the warm-up model, print its path")
    parser.add_argument("--frozen", action="store_true",
                        help="the measured runs keep their starting weights (learning rate 1e-12, updates "
                             "of ~1e-12): both arms answer alike, so the rates compare the rollouts alone "
                             "(named frozen-MODE-seedS)")
    parser.add_argument("--arm_flags", default="",
                        help="train_ppo.py flags for the measured runs only, not the warm-up (e.g. "
                             "\"--loss_agg_mode seq-mean-token-sum-norm\"); with --tag")
    parser.add_argument("--tag", help="a prefix for the measured runs' names (TAG-MODE-seedS)")
    args, extra = parser.parse_known_args()
    extra = [x for x in extra if x != "--"]
    out = os.environ.get("OUT", args.root)
    os.makedirs(out, exist_ok=True)
    os.makedirs(args.root, exist_ok=True)
    data, evals = os.path.join(args.root, "count.jsonl"), os.path.join(args.root, "count_eval.jsonl")
    for path, rows in ((data, task_rows(4000, 0)), (evals, task_rows(args.eval_problems, 1))):
        # written whole, then renamed: runs started at once (partial_pairs.py) read these as others write
        with open(f"{path}.{os.getpid()}", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(f"{path}.{os.getpid()}", path)
    # sync_tis: the synchronous loop with the importance weights partial rollout turns on (cap 2), which
    # the plain synchronous arm runs without
    modes = {"sync": [], "sync_tis": ["--tis_cap", "2"],
             "partial": ["--partial_rollout", "--max_token_budget", str(args.budget),
                         "--max_staleness", str(args.staleness)]}
    ratio = f"{args.inflight_ratio:g}" if args.inflight_ratio else None
    if ratio:
        modes["partial"] += ["--inflight_ratio", ratio]
    warm_len = args.warm_max_len or args.max_len
    warm_name = f"warm-{args.warm_steps}" + (f"-len{warm_len}" if warm_len != args.max_len else "")
    warm = os.path.join(args.root, "runs", warm_name, "model")
    if args.warm_steps and not os.path.exists(warm):
        # (held-out eval every 10 steps whatever --eval_steps says: one warm-up model for any --eval_steps)
        rc = run(args, out, data, evals, warm_name, 100, args.warm_steps, [], extra, max_len=warm_len,
                 eval_steps=10)
        if rc != 0 or not os.path.exists(warm):
            raise SystemExit(f"the warm-up failed (rc {rc}): see {os.path.join(out, warm_name + '.log')}")
    if args.warm_only:
        print(warm)
        return
    start_from = ["--pretrain", warm] if args.warm_steps else []
    frozen = ["--actor_learning_rate", "1e-12"] if args.frozen else []  # (0 is refused)
    if args.arm_flags and not args.tag:
        raise SystemExit("--arm_flags needs a --tag, so its runs are not taken for the plain ones")
    failed = []
    for seed in args.seeds:
        for mode in args.modes:
            flags = modes[mode] + start_from + frozen + shlex.split(args.arm_flags)
            name = f"{mode}-r{ratio}-seed{seed}" if mode == "partial" and ratio else f"{mode}-seed{seed}"
            name = "frozen-" + name if args.frozen else name
            name = f"{args.tag}-{name}" if args.tag else name
            if run(args, out, data, evals, name, seed, args.steps, flags, extra) != 0:
                failed.append(name)
    if failed:
        raise SystemExit(f"{len(failed)} of {len(args.seeds) * len(args.modes)} runs failed "
                         f"({', '.join(failed)}): see their logs in {out}")


def run(args, out, data, evals, name, seed, steps, flags, extra, max_len=None, eval_steps=None):
    """One training run; prints and appends its JSON line to $OUT/partial.jsonl. Returns its exit code
    (or "timeout")."""
    run_dir = os.path.join(args.root, "runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resumed or moved-aside one
    lengths = os.path.join(args.root, f"{name}.lengths")
    for path in (lengths, lengths + ".overshoot.jsonl"):
        if os.path.exists(path):
            os.remove(path)
    task = ["--eval_data", evals, "--reward_fn", f"{os.path.abspath(__file__)}:reward"]
    cmd = [sys.executable, os.path.join(ROOT, "train_ppo.py"), "--prompt_data", data, *task,
           "--rollout_batch_size", "32", "--n_samples_per_prompt", "8",
           "--generate_max_len", str(max_len or args.max_len), "--max_steps", str(steps),
           "--eval_steps", str(eval_steps or args.eval_steps), "--seed", str(seed), "--output_dir", run_dir,
           "--no_resume", *flags, *extra]
    path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])  # the checkout, then any PYTHONPATH
    env = {**os.environ, "COUNT_LENGTHS": lengths, "PYTHONPATH": path}
    start = time.time()
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"run": name, "rc": rc, "wall_s": round(time.time() - start, 1), "flags": flags + extra}
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        config = json.load(open(os.path.join(run_dir, "config.json")))
        per_step = config["rollout_batch_size"] * config["n_samples_per_prompt"]
        result.update(summarise(run_dir, lengths, args.skip, per_step))
        # the step logs (generation rounds, staleness, buffer) beside the summary
        shutil.copy(os.path.join(run_dir, "metrics.jsonl"), os.path.join(out, f"{name}.metrics.jsonl"))
    if os.path.exists(lengths + ".overshoot.jsonl"):
        shutil.copy(lengths + ".overshoot.jsonl", os.path.join(out, f"{name}.overshoot.jsonl"))
    line = json.dumps(result)
    print(line, flush=True)
    with open(os.path.join(out, "partial.jsonl"), "a") as f:
        f.write(line + "\n")
    return rc


if __name__ == "__main__":
    main()
