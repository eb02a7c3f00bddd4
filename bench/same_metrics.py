"""Same seeds, same metrics: run a fixed set of short CPU jobs from one checkout, then compare two such runs
metric for metric, to show that a change left the training loop's numbers as they were.

    python bench/same_metrics.py run /tmp/before                   # in the checkout before the change
    python bench/same_metrics.py run /tmp/after                    # in the checkout after it
    python bench/same_metrics.py compare /tmp/before /tmp/after    # IDENTICAL, or the differences
    python bench/same_metrics.py run /tmp/after gae lora           # some of the jobs only

`run OUTROOT [names...]` writes the test suite's tiny models (tests/conftest.py: a 2-layer random Llama, a
reward model, a character-count reward) to OUTROOT/tiny, then runs each job (jobs() below: both scripts'
default jobs, and tiny-model runs that cover every loss and estimator feature) with the train_ppo.py /
train_ppo_vl.py of the checkout this file is in, OMP_NUM_THREADS=1, into OUTROOT/NAME (metrics.jsonl, and
the output in log.txt). It prints one `NAME rc=CODE` line a job and exits 1 if one failed. The nine jobs
take about 8 minutes on a 2-core CPU.

`compare BEFORE AFTER [names...]` reads every row of each job's metrics.jsonl in both roots and prints, a
job, IDENTICAL or the differences: rows added or missing, and every key outside perf/ (timings) whose value
is not the same (NaN equals NaN). It exits 1 if a job differs or either root lacks it.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["text_default", "vl_default", "gae", "cpgd", "rloo_kl", "variants", "lora", "vl_gae", "vl_kl"]
TINY_TEXT = ("--max_steps 3 --rollout_batch_size 2 --n_samples_per_prompt 2 --micro_train_batch_size 2 "
             "--micro_rollout_batch_size 4 --generate_max_len 8 --actor_learning_rate 1e-3").split()
TINY_VL = ("--max_steps 3 --rollout_batch_size 2 --n_samples_per_prompt 4 --micro_train_batch_size 4 "
           "--generate_max_len 4").split()


def jobs(tiny):
    """{name: [script, flags...]}, the tiny models and files in the folder `tiny`."""
    model, rm, ptx = (os.path.join(tiny, name) for name in ("model", "rm", "ptx.jsonl"))
    chars = ["--reward_fn", os.path.join(tiny, "chars.py") + ":chars"]
    text = ["train_ppo.py", "--pretrain", model, *TINY_TEXT, *chars]
    return {
        "text_default": ["train_ppo.py", "--max_steps", "3"],
        "vl_default": ["train_ppo_vl.py", "--max_steps", "6"],
        "gae": [*text, *"--advantage_estimator gae --freezing_actor_steps 1 --kl_target 0.01 "
                        "--init_kl_coef 0.1".split()],
        "cpgd": [*text, "--reward_pretrain", rm, "--pretrain_data", ptx,
                 *"--advantage_estimator cpgd --reward_weights 1 0.5 --reward_clip 3 --normalize_reward "
                  "--dynamic_sampling --high_entropy_token_ratio 0.2 --overlong_buffer_len 4 --ema_beta 0.9 "
                  "--train_batch_size 2".split()],
        "rloo_kl": [*text, *"--advantage_estimator rloo --loss_agg_mode seq-mean-token-mean --use_kl_loss "
                            "--kl_estimator k2 --max_epochs 2 --train_batch_size 2".split()],
        "variants": [*text, *"--eps_clip 0.2 0.28 --dual_clip 3 --policy_loss_type gspo "
                             "--loss_agg_mode seq-mean-token-mean --tis_cap 2 --train_batch_size 2 "
                             "--entropy_coef 0.01".split()],
        "lora": [*text, *"--lora_rank 4 --advantage_estimator reinforce --actor_learning_rate 1e-2".split()],
        "vl_gae": ["train_ppo_vl.py", *TINY_VL, *chars,
                   *"--advantage_estimator gae --freezing_actor_steps 1 --critic_learning_rate 1e-3".split()],
        "vl_kl": ["train_ppo_vl.py", *TINY_VL, *"--advantage_estimator reinforce_baseline --use_kl_loss "
                                              "--high_entropy_token_ratio 0.5 --entropy_coef 0.01".split()],
    }


def make_tiny(tiny):
    """The tiny models and files the jobs use, written by this checkout's tests/conftest.py (seeded)."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from conftest import CHARS_REWARD, save_tiny_model, save_tiny_rm

    save_tiny_rm(os.path.join(tiny, "rm"), save_tiny_model(os.path.join(tiny, "model")))
    with open(os.path.join(tiny, "chars.py"), "w") as f:
        f.write(CHARS_REWARD)
    with open(os.path.join(tiny, "ptx.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": f"The number {i} is {'even' if i % 2 == 0 else 'odd'}."}) + "\n"
                     for i in range(6))


def run(outroot, names):
    """Run the named jobs into OUTROOT/NAME; returns the names of those that failed."""
    tiny = os.path.join(outroot, "tiny")
    make_tiny(tiny)
    failed, commands = [], jobs(tiny)
    for name in names:
        out = os.path.join(outroot, name)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        cmd = [sys.executable, *commands[name], "--output_dir", out]
        with open(os.path.join(out, "log.txt"), "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
        print(f"{name} rc={rc}", flush=True)
        if rc != 0:
            failed.append(name)
    return failed


def same(x, y):
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


def row_diffs(before, after):
    """The differences between two runs' metrics rows (lists of dicts), keys under perf/ left out."""
    diffs = [f"rows {len(before)} vs {len(after)}"] if len(before) != len(after) else []
    for a, b in zip(before, after):
        for key in a:
            if key.startswith("perf/"):
                continue
            if key not in b:
                diffs.append(f"step {a.get('step')} {key} missing after")
            elif not same(a[key], b[key]):
                diffs.append(f"step {a.get('step')} {key}: {a[key]} -> {b[key]}")
        diffs += [f"step {b.get('step')} new {key}" for key in b
                  if key not in a and not key.startswith("perf/")]
    return diffs


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def compare(before, after, names, shown=12):
    """Print IDENTICAL or the differences (the first `shown`) of each named job; returns how many differ or
    are missing."""
    bad = 0
    for name in names:
        try:
            rows = [read_rows(os.path.join(root, name, "metrics.jsonl")) for root in (before, after)]
        except FileNotFoundError as e:
            print(f"{name} missing: {e.filename}")
            bad += 1
            continue
        diffs = row_diffs(*rows)
        print(name, f"{len(diffs)} diffs" if diffs else "IDENTICAL")
        for line in diffs[:shown]:
            print("   ", line)
        bad += bool(diffs)
    return bad


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run the jobs from this checkout into OUTROOT/NAME")
    run_parser.add_argument("outroot")
    compare_parser = commands.add_parser("compare", help="compare two `run` output roots, job for job")
    compare_parser.add_argument("before")
    compare_parser.add_argument("after")
    for sub in (run_parser, compare_parser):
        sub.add_argument("names", nargs="*", help=f"default: all ({' '.join(NAMES)})")
    args = parser.parse_args()
    names = args.names or NAMES
    unknown = [name for name in names if name not in NAMES]
    if unknown:
        parser.error(f"no job named {' '.join(unknown)}: the jobs are {' '.join(NAMES)}")
    if args.command == "run":
        failed = run(os.path.abspath(args.outroot), names)
        if failed:
            raise SystemExit(f"{len(failed)} jobs failed ({' '.join(failed)}): see their log.txt")
    elif compare(args.before, args.after, names):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
