"""The bench's analysis tools on synthetic step logs whose answer is known."""

import json
import math
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_run(path, steps, norms=None):
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0, "eval/accuracy": 0.5}) + "\n")  # an eval line: skipped
        for i, (tokens, decode, rounds) in enumerate(steps):  # decode: the longest answer, or rounds' budgets
            generate = 0.03 * tokens / 1e3 + 2e-3 * decode + 1.0  # the cost the model should recover
            f.write(json.dumps({"perf/generate_s": generate, "perf/step_time_s": generate + 0.5,
                                "rollout/tokens_generated": tokens, "rollout/response_length_max": decode,
                                "rollout/generation_rounds": rounds, "rollout/response_length": tokens / 256,
                                "train/grad_norm": (norms or [0.1] * len(steps))[i],
                                "train/adam_step_rms": 0.5}) + "\n")


def analyze(folder, *flags):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "analyze_partial.py"), str(folder), "--budget", "256",
           "--skip", "0", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


SYNC = [(40000, 2048, 1), (50000, 1500, 1), (30000, 2048, 1), (45000, 900, 1)]
PARTIAL = [(60000, 512, 2), (80000, 512, 2), (70000, 768, 3), (65000, 512, 2)]  # decode: budget 256 x rounds


def test_cost_model_recovers_the_cost_and_prices_equal_tokens(tmp_path):
    write_run(tmp_path / "sync-seed0.metrics.jsonl", SYNC)
    write_run(tmp_path / "partial-seed0.metrics.jsonl", PARTIAL)
    write_run(tmp_path / "partial-r2-seed0.metrics.jsonl", [(1, 1, 1)] * 4)  # another arm: not read
    result = analyze(tmp_path)["cost"]
    model = result["model"]
    assert abs(model["s_per_1k_tokens"] - 0.03) < 1e-3 and abs(model["ms_per_decode_step"] - 2.0) < 1e-2
    assert abs(model["constant_s"] - 1.0) < 1e-2
    assert result["partial"]["steps"] == 4 and result["partial"]["decode_steps_median"] == 512
    # partial at the synchronous runs' median tokens (42,500), its own median decode steps (512)
    sync_fit = statistics.median(0.03 * t / 1e3 + 2e-3 * d + 1.0 for t, d, _ in SYNC)
    same = 0.03 * 42.5 + 2e-3 * 512 + 1.0
    assert abs(result["partial_at_sync_tokens"]["generate_s"] - same) < 0.006
    assert abs(result["partial_at_sync_tokens"]["step_speedup"] - (sync_fit + 0.5) / (same + 0.5)) < 0.006


def test_relative_steps_follow_adams_running_mean_square(tmp_path):
    norms = [0.8, 0.4, 0.1, 0.1, 0.1, 0.1]  # a large start, as partial rollout's short first batches give
    steps = [(25600, 256, 1)] * len(norms)
    write_run(tmp_path / "drgrpo-sync-seed0.metrics.jsonl", steps, [0.1] * len(norms))
    write_run(tmp_path / "drgrpo-partial-seed0.metrics.jsonl", steps, norms)
    write_run(tmp_path / "partial-seed0.metrics.jsonl", steps, [5.0] * len(norms))  # untagged: not read
    result = analyze(tmp_path, "--tag", "drgrpo")["optimizer"]
    v, want = 0.0, []
    for t, g in enumerate(norms, 1):  # AdamW, beta2 0.95, bias-corrected
        v = 0.95 * v + 0.05 * g * g
        want.append(g / math.sqrt(v / (1 - 0.95 ** t)))
    assert abs(result["partial"][0]["relative_step_1_5"] - statistics.mean(want[:5])) < 0.006
    assert result["sync"][0]["relative_step_1_5"] == 1.0  # a constant gradient norm: every step alike
    assert want[-1] < 0.5  # the large start keeps later steps small
    assert result["partial"][0]["adam_step_rms_1_5"] == 0.5  # the logged figure, where the runs have it


def test_sync_tis_runs_stand_for_the_synchronous_arm(tmp_path):
    write_run(tmp_path / "sync_tis-seed0.metrics.jsonl", SYNC)
    write_run(tmp_path / "sync-seed0.metrics.jsonl", [(1, 1, 1)] * 4)  # the plain arm: not read
    write_run(tmp_path / "partial-seed0.metrics.jsonl", PARTIAL)
    result = analyze(tmp_path, "--sync", "sync_tis")["cost"]
    assert result["sync"]["steps"] == 4 and result["sync"]["tokens_generated_median"] == 42500
    only_tis = tmp_path / "only"
    only_tis.mkdir()
    write_run(only_tis / "sync_tis-seed0.metrics.jsonl", SYNC)
    write_run(only_tis / "partial-seed0.metrics.jsonl", PARTIAL)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "analyze_partial.py"), str(only_tis),
                          "--budget", "256"], capture_output=True, text=True)
    assert out.returncode != 0 and "needs sync-seedS" in out.stderr  # sync_tis is read only when asked


def test_schedule_replay_prices_the_tail_and_ages_the_samples():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "replay_partial_schedule.py"), "--steps", "12",
           "--skip", "4"]
    sync = json.loads(subprocess.run(cmd + ["--budget", "2048", "--staleness", "0"], capture_output=True,
                                     text=True, check=True).stdout)
    partial = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert sync["start_age"] == 0 and sync["rounds_per_step"] == 1  # the synchronous loop: one call a step
    # 3% of answers run to 2048 tokens: every synchronous call lasts 2048 decode steps
    assert sync["generate_s_per_step"] > 2048 * 1.68e-3
    assert partial["start_age"] > 0 and 1 <= partial["rounds_per_step"] <= 3
    assert partial["generate_s_per_step"] < sync["generate_s_per_step"] / 1.5
