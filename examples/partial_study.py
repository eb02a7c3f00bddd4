"""The partial-rollout study of docs/partial_rollout.md: partial rollout against the synchronous loop on a
heavy-tailed task, seed for seed. The task: "Write the whole numbers from 1 to N", N heavy-tailed (80% in
3-15, 20% in 40-150); reward 1 for exactly 1..N, else half the share of the leading numbers that are right.
SmolLM2-135M (embedded), 32 prompts x 8 samples. A run is one mode of an arm on one seed, named
[TAG-]MODE-seedS; the modes: `sync`, `sync_tis` (with --tis_cap 2) and `partial` (--partial_rollout,
--budget new tokens a round, at most --staleness versions old).

    python examples/partial_study.py run --seeds 0 --steps 2 --max_len 32 --budget 8 -- --engine_type hf \\
        --rollout_batch_size 4 --n_samples_per_prompt 2                          # a CPU smoke run
    python examples/partial_study.py run --gpus 4 --seeds 0 1 --arm "--tag s --modes sync_tis" \\
        --arm "--tag p --modes partial" -- --steps 20 --warm_steps 12            # two arms, seed pairs
    python examples/partial_study.py analyze OUT... --tag s --partial_tag p --sync sync_tis \\
        --trajectory eval/accuracy > p.json
    python examples/partial_study.py plot p.json:"label" ... --out differences.png

run: each seed's runs of each --arm (its flags, quoted; without --arm, one arm of the common flags), in
rounds of whole seeds over --gpus GPUs, one run per GPU with caches of its own; a round waits for its slowest
run. With --warm_steps every run starts from a model first trained that many synchronous steps (seed 100),
once. Flags run does not know go to train_ppo.py (--arm_flags: to the arm's runs, not the warm-up). Results
go to $OUT (else --root): a JSON line per run in partial.jsonl, each run's NAME.log and NAME.metrics.jsonl.
analyze: each partial run against the synchronous run of its seed (pairs()), and a metric's mean course in
both arms with the lag between them (trajectory()). plot: the held-out accuracy's difference per
evaluation, arm minus synchronous, mean and standard error over the pairs, a line per analyze output.
"""

import argparse
import glob
import json
import math
import os
import random
import re
import shlex
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# the checkout's root, for bench.common (run as a script, Python puts only examples/ on sys.path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import TRAIN_PPO, launch, read_run  # noqa: E402

SKIP = 3  # first steps left out of the rates (compiles, warm-up)


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
    completion's length (characters) to $COUNT_LENGTHS, for the length tail."""
    out = []
    for completion, label in zip(completions, labels):
        words, want = completion.split(), [str(i) for i in range(1, int(label) + 1)]
        right = next((i for i, (w, x) in enumerate(zip(words, want)) if w != x), min(len(words), len(want)))
        out.append(1.0 if words == want else 0.5 * right / len(want))
    if os.environ.get("COUNT_LENGTHS"):
        with open(os.environ["COUNT_LENGTHS"], "a") as f:
            f.write("".join(f"{len(c)}\n" for c in completions))
    return {"correct": [float(r == 1.0) for r in out], "partial": [r if r < 1 else 0.0 for r in out]}


# ---- run: the runs of some seeds and arms ----

def parse_run(argv):
    """run's arguments and the flags left for train_ppo.py."""
    parser = argparse.ArgumentParser(prog="partial_study.py run", allow_abbrev=False)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--arm", action="append", help="the flags of one arm, quoted (else one arm)")
    parser.add_argument("--gpus", type=int, default=1, help="runs at once, one a GPU")
    parser.add_argument("--cache_root", default="/tmp/rft_pair_cache", help="the GPUs' compile caches")
    parser.add_argument("--modes", nargs="+", default=["sync", "partial"],
                        choices=["sync", "sync_tis", "partial"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max_len", type=int, default=512, help="--generate_max_len")
    parser.add_argument("--budget", type=int, default=128, help="partial: --max_token_budget")
    parser.add_argument("--staleness", type=int, default=3, help="partial: --max_staleness")
    parser.add_argument("--tag", help="a prefix for the runs' names (TAG-MODE-seedS)")
    parser.add_argument("--arm_flags", default="", help="train_ppo.py flags of these runs, not the warm-up's")
    parser.add_argument("--warm_steps", type=int, default=0)
    parser.add_argument("--warm_max_len", type=int, help="the warm-up's --generate_max_len (else --max_len)")
    parser.add_argument("--eval_steps", type=int, default=10, help="held-out evaluation every N steps")
    parser.add_argument("--eval_problems", type=int, default=64, help="held-out problems (greedy)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds a run may take")
    parser.add_argument("--root", default="/tmp/rft_partial")
    args, extra = parser.parse_known_args([x for x in argv if x != "--"])
    if args.arm_flags and not args.tag:
        raise SystemExit("--arm_flags needs a --tag, so its runs are not taken for the plain ones")
    return args, extra


def write_task(args):
    os.makedirs(args.root, exist_ok=True)
    for name, rows in (("count", task_rows(4000, 0)), ("count_eval", task_rows(args.eval_problems, 1))):
        with open(os.path.join(args.root, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def train(args, name, flags, env):
    """One train_ppo.py run on the task; prints its JSON line and appends it to $OUT/partial.jsonl. Returns
    its exit code ("timeout" when it ran out of time)."""
    out = os.environ.get("OUT", args.root)
    os.makedirs(out, exist_ok=True)
    run_dir = os.path.join(args.root, "runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resumed one
    lengths = os.path.join(run_dir, "lengths.txt")  # (the reward writes it once the run has made run_dir)
    cmd = [sys.executable, TRAIN_PPO, "--prompt_data", os.path.join(args.root, "count.jsonl"),
           "--eval_data", os.path.join(args.root, "count_eval.jsonl"),
           "--reward_fn", f"{os.path.abspath(__file__)}:reward", "--rollout_batch_size", "32",
           "--n_samples_per_prompt", "8", "--output_dir", run_dir, "--no_resume", *flags]
    start = time.time()
    rc = launch(cmd, os.path.join(out, f"{name}.log"), args.timeout, env={**env, "COUNT_LENGTHS": lengths})
    result = {"run": name, "rc": rc, "wall_s": round(time.time() - start, 1), "flags": flags}
    steps, evals, config = read_run(run_dir)
    if steps:
        shutil.copy(os.path.join(run_dir, "metrics.jsonl"), os.path.join(out, f"{name}.metrics.jsonl"))
        steady = steps[SKIP:] or steps
        seconds = sum(r["perf/step_time_s"] for r in steady)
        samples = config["rollout_batch_size"] * config["n_samples_per_prompt"] * len(steady)
        with open(lengths) as f:
            chars = sorted(int(x) for x in f)
        result.update({"steps": len(steps), "samples_per_s": samples / seconds,
                       "tokens_generated_per_s": sum(r["rollout/tokens_generated"] for r in steady) / seconds,
                       "slot_utilization": statistics.mean(r["rollout/slot_utilization"] for r in steady),
                       "length_p50_chars": chars[len(chars) // 2],
                       "length_p99_chars": chars[int(len(chars) * 0.99)],
                       "eval": [(r["step"], r["eval/accuracy"]) for r in evals]})
    line = json.dumps(result)
    sys.stdout.write(line + "\n")  # one write: runs on other GPUs print at the same time
    sys.stdout.flush()
    with open(os.path.join(out, "partial.jsonl"), "a") as f:
        f.write(line + "\n")
    return rc


def warm_up(args, extra, env):
    """With --warm_steps: the train_ppo.py flags that start from the warm-up model, trained if absent."""
    if not args.warm_steps:
        return []
    max_len = args.warm_max_len or args.max_len
    name = f"warm-{args.warm_steps}" + (f"-len{max_len}" if max_len != args.max_len else "")
    model = os.path.join(args.root, "runs", name, "model")
    if not os.path.exists(model):  # held-out evaluation every 10 steps, whatever --eval_steps says
        flags = ["--generate_max_len", str(max_len), "--max_steps", str(args.warm_steps), "--eval_steps",
                 str(min(10, args.warm_steps)), "--seed", "100", *extra]
        rc = train(args, name, flags, env)
        if rc != 0 or not os.path.exists(model):
            raise SystemExit(f"the warm-up failed (rc {rc}): see {name}.log")
    return ["--pretrain", model]


def run_seed(args, extra, seed, env):
    """Every mode of args on one seed, one after the other; returns the names of the runs that failed."""
    start = warm_up(args, extra, env)
    modes = {"sync": [], "sync_tis": ["--tis_cap", "2"],
             "partial": ["--partial_rollout", "--max_token_budget", str(args.budget),
                         "--max_staleness", str(args.staleness)]}
    failed = []
    for mode in args.modes:
        name = f"{args.tag}-{mode}-seed{seed}" if args.tag else f"{mode}-seed{seed}"
        flags = ["--generate_max_len", str(args.max_len), "--max_steps", str(args.steps), "--eval_steps",
                 str(min(args.eval_steps, args.steps)), "--seed", str(seed), *modes[mode], *start,
                 *shlex.split(args.arm_flags), *extra]
        if train(args, name, flags, env) != 0:
            failed.append(name)
    return failed


def rounds(seeds, arms, gpus):
    """[[(gpu, seed, arm), ...], ...]: as many whole seeds (every arm) as the GPUs hold to a round, so no
    seed's arms run apart; with more arms than GPUs, one seed's runs over several rounds."""
    per_round = max(1, gpus // len(arms))
    out = []
    for i in range(0, len(seeds), per_round):
        runs = [(seed, arm) for seed in seeds[i:i + per_round] for arm in arms]
        out += [[(gpu, *run) for gpu, run in enumerate(runs[j:j + gpus])] for j in range(0, len(runs), gpus)]
    return out


def gpu_env(gpu, cache_root):
    """A run's environment on one GPU: that GPU alone, caches of its own, and its own port for the engine's
    one-process rendezvous."""
    cache = os.path.join(cache_root, f"gpu{gpu}")
    return {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "MASTER_PORT": str(29610 + gpu),
            "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(cache, "triton")}


def run_main(argv):
    args, extra = parse_run(argv)
    arms = [parse_run(shlex.split(arm) + argv) for arm in args.arm or [""]]  # the common flags win
    write_task(args)
    warm_up(args, extra, gpu_env(0, args.cache_root))  # once, before the runs that start from it
    failed = []
    for i, batch in enumerate(rounds(args.seeds, arms, args.gpus)):
        print(f"round {i}: {len(batch)} runs", flush=True)
        with ThreadPoolExecutor(len(batch)) as pool:  # the round's runs at once, one a GPU
            done = [pool.submit(run_seed, *arm, seed, gpu_env(gpu, args.cache_root))
                    for gpu, seed, arm in batch]
        failed += [name for runs in done for name in runs.result()]
    if failed:
        raise SystemExit(f"{len(failed)} runs failed ({', '.join(failed)}): see their logs")


# ---- analyze: what the runs' step logs say ----

def read_runs(folders, tag="", sync="sync", partial_tag=None):
    """[(arm, seed, rows)] of the runs named [TAG-]SYNC-seedS (arm "sync") and [PARTIAL_TAG-]partial-seedS
    (arm "partial"; PARTIAL_TAG: TAG unless given) in the folders; rows: every line of the run's metrics."""
    partial_tag = tag if partial_tag is None else partial_tag
    names = {"sync": f"{tag}-{sync}" if tag else sync,
             "partial": f"{partial_tag}-partial" if partial_tag else "partial"}
    found = []
    for path in sorted(p for folder in folders for p in glob.glob(os.path.join(folder, "*.metrics.jsonl"))):
        for arm, name in names.items():
            match = re.fullmatch(re.escape(name) + r"-seed(\d+)\.metrics\.jsonl", os.path.basename(path))
            if match:
                with open(path) as f:
                    found.append((arm, int(match.group(1)), [json.loads(line) for line in f]))
    if {arm for arm, _, _ in found} != {"sync", "partial"}:
        raise SystemExit(f"{' '.join(folders)}: needs {names['sync']}-seedS and {names['partial']}-seedS "
                         "metrics files, found " + str(sorted({arm for arm, _, _ in found})))
    return found


def spread(diffs):
    """mean, sample sd, standard error and t of paired differences."""
    mean = statistics.mean(diffs)
    sd = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
    se = sd / math.sqrt(len(diffs))
    return {"mean": round(mean, 4), "sd": round(sd, 4), "se": round(se, 4),
            "t": round(mean / se, 2) if se > 0 else None}


def pairs(runs, skip=SKIP):
    """Seed for seed, each partial run against the synchronous run of its seed: the speed-up in samples per
    second (step times summed after the first `skip`), the trained reward's difference over the second half
    of the steps (11-20 of 20), the held-out accuracy's difference at each evaluation, and against the
    synchronous run's at the same training time (seconds of steps, evaluations not counted; linear between
    its evaluations). Seeds without both arms, or whose arms ran different numbers of steps, are left out."""
    by_seed = {}
    for arm, seed, rows in runs:
        by_seed.setdefault(seed, {})[arm] = rows
    per_seed, left_out = [], {}
    for seed, arms in sorted(by_seed.items()):
        if len(arms) < 2:
            left_out[seed] = "one arm only"
            continue
        steps = {arm: [r for r in rows if "perf/step_time_s" in r] for arm, rows in arms.items()}
        if len(steps["sync"]) != len(steps["partial"]):
            left_out[seed] = f"steps {len(steps['sync'])} sync, {len(steps['partial'])} partial"
            continue
        evals = {arm: {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
                 for arm, rows in arms.items()}
        seconds = {arm: sum(r["perf/step_time_s"] for r in rows[skip:] or rows)
                   for arm, rows in steps.items()}
        reward = {arm: statistics.mean(r["rollout/reward_mean"] for r in rows[len(rows) // 2:])
                  for arm, rows in steps.items()}
        # wall-clock: the seconds of training steps (generation included, evaluations not) up to each step
        clock = {arm: np.cumsum([0.0] + [r["perf/step_time_s"] for r in rows]) for arm, rows in steps.items()}
        sync_at = sorted(evals["sync"])
        same_time = [evals["partial"][t] - np.interp(clock["partial"][t], clock["sync"][sync_at],
                                                     [evals["sync"][u] for u in sync_at])
                     for t in sorted(evals["partial"]) if t > 0]
        at = sorted(set(evals["sync"]) & set(evals["partial"]))
        per_seed.append({"seed": seed, "speedup_sum": round(seconds["sync"] / seconds["partial"], 3),
                         "reward_diff": round(reward["partial"] - reward["sync"], 4),
                         "eval_diff": {t: round(evals["partial"][t] - evals["sync"][t], 4) for t in at},
                         "eval_same_time_diff": round(float(statistics.mean(same_time)), 4)})
    if not per_seed:
        raise SystemExit(f"no seed has both arms over the same steps: {left_out}")
    common = sorted(set.intersection(*(set(r["eval_diff"]) for r in per_seed)))
    speedups = [r["speedup_sum"] for r in per_seed]
    return {"seeds": per_seed, "left_out": left_out, "summary": {
        "pairs": len(per_seed),
        "speedup_sum": {"median": round(statistics.median(speedups), 3), "min": min(speedups),
                        "max": max(speedups)},
        "reward_diff": spread([r["reward_diff"] for r in per_seed]),
        "eval_same_time_diff": spread([r["eval_same_time_diff"] for r in per_seed]),
        "eval_diff_by_step": {t: spread([r["eval_diff"][t] for r in per_seed]) for t in common}}}


def trajectory(runs, metric):
    """The metric's mean over each arm's runs at every row that logs it (runs with fewer rows, stopped
    early, left out and counted), and the synchronous arm's lag behind the partial one, in those rows: the
    shift d up to half the rows minimising the mean of (partial[t] - sync[t - d])^2."""
    courses = {"sync": [], "partial": []}
    for arm, _, rows in runs:
        courses[arm].append([r[metric] for r in rows if metric in r])
    n = max(len(course) for arm in courses.values() for course in arm)
    whole = {arm: [course for course in arm_courses if len(course) == n]
             for arm, arm_courses in courses.items()}
    mean = {arm: [statistics.mean(course[t] for course in arm_courses) for t in range(n)]
            for arm, arm_courses in whole.items()}
    msd = {d: statistics.mean((mean["partial"][t] - mean["sync"][t - d]) ** 2 for t in range(d, n))
           for d in range(n // 2 + 1)}
    return {"metric": metric, "runs": {arm: len(whole[arm]) for arm in whole},
            "stopped_early": {arm: len(courses[arm]) - len(whole[arm]) for arm in whole},
            "sync": [round(x, 4) for x in mean["sync"]], "partial": [round(x, 4) for x in mean["partial"]],
            "best_lag": min(msd, key=msd.get), "msd_by_lag": {d: round(v, 6) for d, v in msd.items()}}


def analyze_main(argv):
    parser = argparse.ArgumentParser(prog="partial_study.py analyze")
    parser.add_argument("results", nargs="+", help="run's $OUT folders")
    parser.add_argument("--tag", default="", help="the synchronous runs' tag (TAG-SYNC-seedS)")
    parser.add_argument("--partial_tag", help="the partial runs' tag, where it is not --tag's")
    parser.add_argument("--sync", default="sync", choices=["sync", "sync_tis"], help="the synchronous mode")
    parser.add_argument("--trajectory", metavar="METRIC", help="a metric's course in both arms")
    args = parser.parse_args(argv)
    runs = read_runs(args.results, args.tag, args.sync, args.partial_tag)
    out = {"pairs": pairs(runs)}
    if args.trajectory:
        out["trajectory"] = trajectory(runs, args.trajectory)
    print(json.dumps(out, indent=1))


# ---- plot: the held-out differences of analyze outputs ----

def plot_main(argv):
    parser = argparse.ArgumentParser(prog="partial_study.py plot")
    parser.add_argument("analyses", nargs="+", metavar="FILE:LABEL", help="analyze's outputs")
    parser.add_argument("--out", required=True, help="the PNG written")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.axhline(0, color="grey", linewidth=0.8)
    for spec in args.analyses:
        path, _, label = spec.partition(":")
        with open(path) as f:
            summary = json.load(f)["pairs"]["summary"]
        by_step = sorted((int(t), d["mean"], d["se"]) for t, d in summary["eval_diff_by_step"].items())
        steps, means, ses = zip(*by_step)
        ax.errorbar(steps, means, yerr=ses, capsize=3, marker="o",
                    label=f"{label or path} ({summary['pairs']} pairs)")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy, arm minus synchronous")
    ax.set_title("mean over seed pairs, one standard error")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(args.out)


def main():
    commands = {"run": run_main, "analyze": analyze_main, "plot": plot_main}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        raise SystemExit(f"usage: python examples/partial_study.py {{{','.join(commands)}}} ... "
                         "(its docstring)")
    commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
