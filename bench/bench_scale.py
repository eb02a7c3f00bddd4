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
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(config, tp, train_args, out_dir, timeout):
    path = os.path.join(ROOT, "accelerate_configs", f"{config}.yaml")
    run_dir = os.path.join(out_dir, f"{config}-tp{tp}")
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resumed one
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", path,
           os.path.join(ROOT, "train_ppo.py"), *train_args, "--engine_tp_size", str(tp),
           "--output_dir", run_dir]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", ((e.stdout or b"").decode(errors="replace")
                              + (e.stderr or b"").decode(errors="replace"))
    with open(f"{run_dir}.log", "w") as f:
        f.write(log)
    row = {"config": config, "tp": tp, "rc": rc, "wall_s": round(time.time() - t0, 1)}
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    steps = [json.loads(line) for line in open(metrics_path)] if os.path.exists(metrics_path) else []
    steps = [s for s in steps if "perf/step_time_s" in s]
    if steps:
        cfg = json.load(open(os.path.join(run_dir, "config.json")))
        steady = steps[1:] or steps
        step_s = statistics.median(s["perf/step_time_s"] for s in steady)
        samples = cfg["rollout_batch_size"] * cfg["n_samples_per_prompt"]
        row.update(processes=cfg["world_size"], steps=len(steps), step_s=round(step_s, 3),
                   samples_per_s=round(samples / step_s, 1),
                   mem_update_gb=round(max(s.get("perf/mem_update_gb", 0) for s in steps), 2),
                   logprob_diff_mean=round(max(s["rollout/logprob_diff_mean"] for s in steps), 4),
                   weight_sync_s=round(statistics.median(s["perf/weight_sync_s"] for s in steady), 3))
    if rc != 0:
        row["log_tail"] = [line[:300] for line in log.splitlines() if line.strip()][-12:]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", required=True, help="names under accelerate_configs/")
    parser.add_argument("--tp", nargs="+", type=int, default=[1])
    parser.add_argument("--out_dir", default="/tmp/bench_scale")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per run")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train_ppo.py's flags")
    args = parser.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    rows = []
    for config in args.configs:
        for tp in args.tp:
            rows.append(run(config, tp, train_args, args.out_dir, args.timeout))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
