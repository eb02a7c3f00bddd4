"""Both scripts with multi-turn episodes (--env) end to end on CPU, on tiny random models whose turns end
after a few tokens (conftest.make_eos_prone): metrics, samples.jsonl, environment faults, the KL loss, dynamic
sampling, GAE's critic, and a run killed mid-way that resumes to the same steps."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, read_metrics, run_script, save_eos_vl_model

# answers twice, then ends the episode with a reward of 0.25; fails on some turns (deterministically, by the
# assistant's text); with BLOCK_AFTER set, hangs once that directory exists (the resume test kills it there)
ENV = """import os, time
class Env:
    def step(self, state, text):
        if os.environ.get("BLOCK_AFTER") and os.path.isdir(os.environ["BLOCK_AFTER"]):
            time.sleep(600)
        if os.environ.get("FAIL_SOME") and len(text) % 7 == 3:
            raise ValueError("the tool broke")
        if state.turn >= 3:
            return None, True, 0.25, {"hops": state.turn}
        return "ok then", False
"""
CHARS = "def chars(p, completions, l, **kw):\n    return [len(c) / 10 for c in completions]\n"
TINY = ["--rollout_batch_size", "4", "--n_samples_per_prompt", "4", "--generate_max_len", "12",
        "--micro_train_batch_size", "4", "--actor_learning_rate", "1e-3",
        "--max_episode_tokens", "256"]  # within the tiny model's 512 positions


@pytest.fixture
def files(tmp_path):
    (tmp_path / "env.py").write_text(ENV)
    (tmp_path / "chars.py").write_text(CHARS)
    return ["--env", f"{tmp_path}/env.py:Env", "--reward_fn", f"{tmp_path}/chars.py:chars"]


@pytest.mark.slow
def test_text_script_trains_episodes(eos_model_dir, files, tmp_path):
    """GRPO with the KL loss and dynamic sampling over episodes of up to three turns, some of whose
    environment calls fail: every step trains, the failures are counted and named once, and samples.jsonl
    holds whole episodes with their roles."""
    out = tmp_path / "out"
    proc = run_script("train_ppo.py", ["--pretrain", eos_model_dir, *TINY, *files, "--max_steps", "3",
                                       "--use_kl_loss", "--dynamic_sampling", "--log_samples_steps", "1",
                                       "--output_dir", str(out)], env={**os.environ, "FAIL_SOME": "1"})
    rows, evals = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2, 3] and "eval/env_errors" in evals[0]
    assert sum(r["rollout/env_errors"] for r in rows) > 0 and proc.stdout.count("[env] ") == 1
    assert "ValueError('the tool broke')" in proc.stdout
    for r in rows:
        assert 1 <= r["rollout/turns_mean"] <= r["rollout/turns_max"] <= 3 and r["rollout/env_calls"] > 0
        assert r["rollout/env_tokens"] > 0 and math.isfinite(r["train/policy_loss"]) and r["train/kl"] >= 0
        # lengths count the policy's tokens: at most three turns of 12
        assert r["rollout/response_length_max"] <= 36 and "rollout/reward/env" in r
    assert any(r.get("rollout/env/hops") == 3 for r in rows)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    episode = max(samples, key=lambda s: len(s["turns"]))
    assert [t["role"] for t in episode["turns"]][:3] == ["assistant", "user", "assistant"]
    assert episode["turns"][1]["content"] == "ok then"
    assert episode["completion"] == episode["turns"][-1]["content"]


@pytest.mark.slow
def test_steps_whose_every_episode_failed_at_reset(eos_model_dir, tmp_path):
    """Every reset raises and --reward_failure_limit above 1 keeps the run going: each step logs its failures
    and trains nothing, instead of dying on a step without a policy token (no train/entropy)."""
    (tmp_path / "env.py").write_text("class Env:\n    def reset(self, sample):\n"
                                     "        raise ValueError('no')\n"
                                     "    def step(self, state, text):\n        return None, True\n")
    out = tmp_path / "out"
    run_script("train_ppo.py", ["--pretrain", eos_model_dir, *TINY, "--env", f"{tmp_path}/env.py:Env",
                                "--max_steps", "2", "--reward_failure_limit", "2", "--output_dir", str(out)])
    rows, _ = read_metrics(str(out))
    assert [r["rollout/env_errors"] for r in rows] == [16, 16] and "train/entropy" not in rows[0]


@pytest.mark.slow
def test_gae_over_episodes(eos_model_dir, files, tmp_path):
    run_script("train_ppo.py", ["--pretrain", eos_model_dir, *TINY, *files, "--max_steps", "2",
                                "--advantage_estimator", "gae", "--output_dir", str(tmp_path / "out")])
    rows, _ = read_metrics(str(tmp_path / "out"))
    assert all(math.isfinite(r["train/value_loss"]) and r["train/critic_grad_norm"] > 0 for r in rows)


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_episodes(eos_model_dir, files, tmp_path):
    """Killed with SIGKILL inside step 3's environment call and resumed from checkpoint-2, a run logs the same
    step 3 as an uninterrupted run (everything but timings)."""
    args = ["--pretrain", eos_model_dir, *TINY, *files, "--max_steps", "3", "--save_steps", "2"]
    run_script("train_ppo.py", [*args, "--output_dir", str(tmp_path / "straight")])
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2",
           "BLOCK_AFTER": str(killed / "checkpoint-2")}
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_ppo.py"), *args, "--output_dir",
                             str(killed)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "latest").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(2)  # inside step 3's environment call
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and (killed / "latest").read_text() == "checkpoint-2"
    run_script("train_ppo.py", [*args, "--output_dir", str(killed)])
    straight, resumed = read_metrics(str(tmp_path / "straight"))[0], read_metrics(str(killed))[0]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    drop = lambda row: {k: v for k, v in row.items() if not k.startswith("perf/")}  # noqa: E731
    assert drop(straight[2]) == drop(resumed[2])


@pytest.mark.slow
def test_vl_script_trains_episodes_with_images_in_the_opening_turn(files, tmp_path):
    model = save_eos_vl_model(tmp_path / "vl")
    out = tmp_path / "out"
    run_script("train_ppo_vl.py", ["--pretrain", model, "--max_steps", "2", "--rollout_batch_size", "2",
                                   "--n_samples_per_prompt", "4", "--micro_train_batch_size", "4",
                                   "--generate_max_len", "6", "--log_samples_steps", "1", files[0], files[1],
                                   "--max_episode_tokens", "256",
                                   "--output_dir", str(out)])
    rows, _ = read_metrics(str(out))
    assert len(rows) == 2 and all(r["rollout/env_calls"] > 0 and r["rollout/turns_max"] >= 2 for r in rows)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all("<|image_pad|>" in s["prompt"] for s in samples)
    assert any([t["role"] for t in s["turns"]][:2] == ["assistant", "user"] for s in samples)
