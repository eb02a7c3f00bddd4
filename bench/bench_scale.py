"""Scale-out table: train_ppo.py under each accelerate config and vLLM TP size; prints one JSON list.

    python bench/bench_scale.py --configs multi_gpu deepspeed_zero3 fsdp2 --tp 1 2 -- \
        --pretrain /models/Qwen2.5-0.5B-Instruct --max_steps 3 --engine_enforce_eager

Each row: config, processes, TP size, return code, median step time over the steps after the
first (the first compiles and warms up), samples per second, peak GPU memory of the update
phase (per rank, rank 0's), the logprob diff between vLLM and the trainer (a broken weight sync
shows here first) and the weight-sync time. A failed run keeps its log's last lines.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import ROOT, TRAIN_PPO, launch, log_tail, read_run, split_argv  # noqa: E402


def run(config, tp, train_args, out_dir, timeout):
    path = os.path.join(ROOT, "accelerate_configs", f"{config}.yaml")
    run_dir = os.path.join(out_dir, f"{config}-tp{tp}")
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resumed one
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", path, TRAIN_PPO,
           *train_args, "--engine_tp_size", str(tp), "--output_dir", run_dir]
    t0 = time.time()
    rc = launch(cmd, f"{run_dir}.log", timeout=timeout)
    row = {"config": config, "tp": tp, "rc": rc, "wall_s": round(time.time() - t0, 1)}
    steps, _, cfg = read_run(run_dir)
    if steps:
        steady = steps[1:] or steps
        step_s = statistics.median(s["perf/step_time_s"] for s in steady)
        samples = cfg["rollout_batch_size"] * cfg["n_samples_per_prompt"]
        row.update(processes=cfg["world_size"], steps=len(steps), step_s=round(step_s, 3),
                   samples_per_s=round(samples / step_s, 1),
                   mem_update_gb=round(max(s.get("perf/mem_update_gb", 0) for s in steps), 2),
                   logprob_diff_mean=round(max(s["rollout/logprob_diff_mean"] for s in steps), 4),
                   weight_sync_s=round(statistics.median(s["perf/weight_sync_s"] for s in steady), 3))
    if rc != 0:
        row["log_tail"] = log_tail(f"{run_dir}.log")
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", required=True, help="names under accelerate_configs/")
    parser.add_argument("--tp", nargs="+", type=int, default=[1])
    parser.add_argument("--out_dir", default="/tmp/bench_scale")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per run")
    argv, train_args = split_argv(sys.argv[1:])
    args = parser.parse_args(argv)
    rows = []
    for config in args.configs:
        for tp in args.tp:
            rows.append(run(config, tp, train_args, args.out_dir, args.timeout))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
