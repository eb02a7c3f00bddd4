"""The bench's analysis tools on synthetic step logs whose answer is known."""

import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_run(path, steps):
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0, "eval/accuracy": 0.5}) + "\n")  # an eval line: skipped
        for tokens, decode, rounds in steps:  # decode steps: the longest answer, or the rounds' budgets
            generate = 0.03 * tokens / 1e3 + 2e-3 * decode + 1.0  # the cost the model should recover
            f.write(json.dumps({"perf/generate_s": generate, "perf/step_time_s": generate + 0.5,
                                "rollout/tokens_generated": tokens, "rollout/response_length_max": decode,
                                "rollout/generation_rounds": rounds}) + "\n")


def test_partial_cost_model_recovers_the_cost_and_prices_equal_tokens(tmp_path):
    write_run(tmp_path / "sync-seed0.metrics.jsonl",
              [(40000, 2048, 1), (50000, 1500, 1), (30000, 2048, 1), (45000, 900, 1)])
    write_run(tmp_path / "partial-seed0.metrics.jsonl",  # decode steps: budget 256 x rounds
              [(60000, 512, 2), (80000, 512, 2), (70000, 768, 3), (65000, 512, 2)])
    write_run(tmp_path / "partial-r2-seed0.metrics.jsonl", [(1, 1, 1)] * 4)  # another arm: not read
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "partial_cost_model.py"), str(tmp_path),
                          "--budget", "256", "--skip", "0"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    model = result["model"]
    assert abs(model["s_per_1k_tokens"] - 0.03) < 1e-3 and abs(model["ms_per_decode_step"] - 2.0) < 1e-2
    assert abs(model["constant_s"] - 1.0) < 1e-2
    assert result["partial"]["steps"] == 4 and result["partial"]["decode_steps_median"] == 512
    # partial at the synchronous runs' median tokens (42,500), its own median decode steps (512)
    sync_fit = statistics.median(0.03 * t / 1e3 + 2e-3 * d + 1.0  # the synchronous steps' median cost
                                 for t, d in ((40000, 2048), (50000, 1500), (30000, 2048), (45000, 900)))
    same = 0.03 * 42.5 + 2e-3 * 512 + 1.0
    assert abs(result["partial_at_sync_tokens"]["generate_s"] - same) < 0.006
    assert abs(result["partial_at_sync_tokens"]["step_speedup"] - (sync_fit + 0.5) / (same + 0.5)) < 0.006
