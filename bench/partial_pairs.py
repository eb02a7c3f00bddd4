"""bench_partial.py's seed pairs at the same time, one run per GPU (issue 16's learning comparison).

Every (seed, arm) is one bench_partial.py run; on a machine of G GPUs they go in rounds of whole seeds, so
the arms of one seed start together on neighbouring GPUs and see the same machine at the same time. A round
waits for its slowest run before the next starts. The warm-up model (--warm_steps) is trained once
first, on GPU 0. Each GPU has its own vLLM / inductor / triton caches: compiles running at once into one
cache are not safe; a GPU's later runs reuse its cache. Results as bench_partial.py writes them: one JSON line
per run in $OUT/partial.jsonl, a log and the step metrics per run.

    python bench/partial_pairs.py --seeds 0 1 --arm "--tag drgrpo --modes sync_tis" \
        --arm "--tag drgrpo-b512 --budget 512 --modes partial" -- --steps 20 --warm_steps 12 \
        --warm_max_len 512 --max_len 2048 --staleness 7 --eval_steps 2 --eval_problems 256 \
        --arm_flags "--loss_agg_mode seq-mean-token-sum-norm"
    python bench/partial_pairs.py --gpus 2 --dry_run ...      # print the rounds, run nothing

With --time_limit (seconds this command may run, e.g. a job scheduler's limit), a round that the longest
round so far says would not finish in time is not started: its seeds are named at the end (exit 1).

Flags after -- go to every run (and the warm-up); each --arm's go to that arm's runs only.
"""

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def rounds(seeds, arms, gpus):
    """[[(gpu, seed, arm flags), ...], ...]: as many whole seeds (every arm) as the G GPUs hold to a round,
    so no seed's arms run apart; with more arms than GPUs, one seed's runs over several rounds."""
    per_round = max(1, gpus // len(arms))
    out = []
    for i in range(0, len(seeds), per_round):
        runs = [(seed, arm) for seed in seeds[i:i + per_round] for arm in arms]
        out += [[(gpu, *run) for gpu, run in enumerate(runs[j:j + gpus])] for j in range(0, len(runs), gpus)]
    return out


def gpu_env(gpu, cache_root):
    """The environment of a run on one GPU: that GPU alone, caches of its own, and its own port for the
    engine's one-process rendezvous (rft_core.engines.vllm otherwise asks the OS for a free one)."""
    cache = os.path.join(cache_root, f"gpu{gpu}")
    return {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "MASTER_PORT": str(29610 + gpu),
            "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(cache, "triton")}


def say(line):
    sys.stdout.write(line + "\n")  # one write: the rounds' threads print at once
    sys.stdout.flush()


def bench(flags, gpu, cache_root, dry_run):
    """One bench_partial.py run on one GPU; returns its exit code (0 for a dry run)."""
    cmd = [sys.executable, os.path.join(HERE, "bench_partial.py"), *flags]
    say(f"[gpu {gpu}] {shlex.join(cmd[1:])}")
    if dry_run:
        return 0
    start = time.time()
    done = subprocess.run(cmd, env=gpu_env(gpu, cache_root), capture_output=True, text=True)
    lines = (done.stdout + done.stderr).strip().splitlines()
    say(f"[gpu {gpu}] rc {done.returncode} after {time.time() - start:.0f} s: {lines[-1] if lines else ''}")
    return done.returncode


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--arm", action="append", required=True,
                        help="bench_partial.py flags of one arm, quoted (e.g. \"--tag t --modes sync_tis\")")
    parser.add_argument("--gpus", type=int, help="default: every GPU nvidia-smi -L lists")
    parser.add_argument("--cache_root", default="/tmp/rft_pair_cache")
    parser.add_argument("--dry_run", action="store_true")
    parser.add_argument("--time_limit", type=float,
                        help="seconds this command may run: a round is not started when the longest one so "
                             "far would not fit in what is left")
    started = time.time()
    args, common = parser.parse_known_args()
    common = [x for x in common if x != "--"]
    listed = (subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
              if not args.gpus and shutil.which("nvidia-smi") else "")
    gpus = args.gpus or len(listed.splitlines())
    if gpus < 1:
        raise SystemExit("no GPU found (nvidia-smi -L): pass --gpus N")
    if "--warm_steps" in common and bench(["--warm_only", *common], 0, args.cache_root, args.dry_run):
        raise SystemExit("the warm-up failed (its line above): no runs started")
    failed = []

    def one(gpu, seed, arm):
        if bench(["--seeds", str(seed), *shlex.split(arm), *common], gpu, args.cache_root, args.dry_run):
            failed.append(f"seed {seed} [{arm}]")

    longest, skipped = 0.0, {}  # skipped: the seeds of the rounds not started, in order
    for i, batch in enumerate(rounds(args.seeds, args.arm, gpus)):
        left = args.time_limit - (time.time() - started) if args.time_limit else float("inf")
        if longest > left:  # the limit would stop it part way: no GPU time spent on runs cut short
            skipped.update(dict.fromkeys(seed for _, seed, _ in batch))
            continue
        say(f"round {i}: {len(batch)} runs")
        round_start = time.time()
        threads = [threading.Thread(target=one, args=run) for run in batch]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        longest = max(longest, time.time() - round_start)
    problems = [f"{len(failed)} runs failed (their lines above): {'; '.join(failed)}"] if failed else []
    if skipped:
        seeds = " ".join(map(str, skipped))
        problems.append(f"seeds {seeds} not started: a round took {longest:.1f} s, more than was left of "
                        f"--time_limit {args.time_limit:g} s")
    if problems:
        raise SystemExit("; ".join(problems))


if __name__ == "__main__":
    main()
