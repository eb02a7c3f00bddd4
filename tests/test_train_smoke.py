"""End-to-end runs of train_ppo.py on CPU: a tiny random model for the code paths, and the
embedded SmolLM2-135M for the README's acceptance command."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, read_metrics, run_script

pytestmark = pytest.mark.slow  # every test here runs the script

TINY_BY_TOKENS = ["--max_steps", "2", "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
                  "--micro_rollout_batch_size", "4", "--generate_max_len", "8"]
TINY = [*TINY_BY_TOKENS, "--micro_train_batch_size", "2"]
PARTIAL = ["--partial_rollout", "--max_token_budget", "3", "--max_staleness", "1"]


def run(args, **kwargs):
    return run_script("train_ppo.py", args, **kwargs)


def check_outputs(out, steps=2, eval_problems=96):
    steps_rows, eval_rows = read_metrics(out)
    assert [r["step"] for r in steps_rows] == list(range(1, steps + 1))
    for r in steps_rows:
        assert math.isfinite(r["train/policy_loss"]) and math.isfinite(r["train/grad_norm"])
        assert {"rollout/reward_mean", "rollout/reward/correct", "rollout/reward_errors", "perf/generate_s",
                "perf/update_s", "train/entropy"} <= set(r)
    assert [r["step"] for r in eval_rows] == [0, steps] and eval_rows[0]["eval/num_problems"] == eval_problems
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["max_steps"] == steps
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(os.path.join(out, "model"))
    AutoTokenizer.from_pretrained(os.path.join(out, "model"))


def test_tiny_grpo(tiny_model_dir, tmp_path):
    proc = run(["--pretrain", tiny_model_dir, *TINY, "--output_dir", str(tmp_path)])
    check_outputs(str(tmp_path))
    # one `|`-separated line a step, and an eval's own line (not a step line) at step 0 and at the end
    lines = (proc.stdout + proc.stderr).splitlines()
    assert [line.split(" |")[0] for line in lines if line.startswith("step ")] == ["step 1", "step 2"]


@pytest.mark.parametrize("estimator, mode", [("dr_grpo", "seq-mean-token-sum-norm"),
                                             ("rloo", "seq-mean-token-mean"),
                                             ("reinforce_baseline", "seq-mean-token-sum")])
def test_tiny_estimators_kl_and_epochs(tiny_model_dir, tmp_path, estimator, mode, chars_reward):
    """KL loss against a reference, two epochs with two optimizer steps each (old logprobs recomputed)."""
    run(["--pretrain", tiny_model_dir, *TINY, "--advantage_estimator", estimator, "--loss_agg_mode", mode,
         "--reward_fn", chars_reward, "--actor_learning_rate", "1e-3",
         "--use_kl_loss", "--kl_estimator", "k2", "--max_epochs", "2", "--train_batch_size", "2",
         "--eval_steps", "1", "--save_steps", "2", "--output_dir", str(tmp_path)])
    steps_rows, eval_rows = read_metrics(str(tmp_path))
    assert len(steps_rows) == 2 and [r["step"] for r in eval_rows] == [0, 1, 2]
    assert all(math.isfinite(r["train/policy_loss"]) and r["train/grad_norm"] > 0 for r in steps_rows)
    assert steps_rows[1]["train/kl"] > 0  # the policy has moved away from the reference
    assert any(r["train/ppo_kl"] != 0 for r in steps_rows)  # later updates see ratios != 1
    assert (os.path.isfile(tmp_path / "checkpoint-2" / "trainer_state.json")
            and (tmp_path / "latest").read_text() == "checkpoint-2")


# dr_grpo and rloo run above (two steps, two epochs each, with the same checks): CI time
# gae: in test_ppo_critic_warmup_and_adaptive_kl and test_lora (CI time)
@pytest.mark.parametrize("estimator", ["group_norm", "cpgd", "reinforce", "reinforce_baseline"])
def test_every_estimator_three_steps(tiny_model_dir, tmp_path, chars_reward, estimator):
    run(["--pretrain", tiny_model_dir, *TINY, "--max_steps", "3", "--advantage_estimator", estimator,
         "--reward_fn", chars_reward, "--actor_learning_rate", "1e-3", "--output_dir", str(tmp_path)])
    rows, _ = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["train/policy_loss"]) and r["train/grad_norm"] > 0 for r in rows)
    assert all(0 < r["train/adam_step_rms"] <= 1.5 for r in rows)  # AdamW's step relative to its scale
    if estimator in ("reinforce", "reinforce_baseline"):  # KL penalty in the reward: 0 before any update
        assert rows[0]["rollout/kl"] == 0 and rows[2]["rollout/kl"] != 0


def test_ppo_critic_warmup_and_adaptive_kl(tiny_model_dir, tmp_path, chars_reward):
    run(["--pretrain", tiny_model_dir, *TINY, "--max_steps", "3", "--advantage_estimator", "gae",
         "--freezing_actor_steps", "1", "--kl_target", "0.01", "--init_kl_coef", "0.1",
         "--reward_fn", chars_reward, "--actor_learning_rate", "1e-3", "--output_dir", str(tmp_path)])
    rows, _ = read_metrics(str(tmp_path))
    # the actor is frozen at step 1
    assert "train/grad_norm" not in rows[0] and rows[0]["train/critic_grad_norm"] > 0
    assert rows[1]["train/grad_norm"] > 0
    assert all(r["train/critic_grad_norm"] > 0 and math.isfinite(r["train/value_loss"]) for r in rows)
    assert all(math.isfinite(r["train/values"]) for r in rows)  # a token mean over the micro-batches
    assert "train/adam_step_rms" not in rows[0] and all(r["train/critic_adam_step_rms"] > 0 for r in rows)
    assert rows[0]["rollout/kl"] == 0 and rows[2]["rollout/kl"] != 0  # KL penalty in the reward
    # KL 0 < target
    assert [r["train/kl_coef"] for r in rows][:2] == [0.1, pytest.approx(0.1 * (1 - 0.2 * 4 / 10000))]


def test_dapo_reward_models_ema_ptx(tiny_model_dir, tiny_rm_dir, tmp_path, chars_reward):
    """CPGD with dynamic sampling, high-entropy tokens, overlong shaping, a reward model weighted with a rule
    reward, normalised and clipped rewards, an EMA actor and a pretraining loss, in one run."""
    ptx = tmp_path / "ptx.jsonl"
    ptx.write_text("\n".join(json.dumps({"text": f"The number {i} is {'even' if i % 2 == 0 else 'odd'}."})
                             for i in range(6)))
    run(["--pretrain", tiny_model_dir, *TINY, "--max_steps", "3", "--advantage_estimator", "cpgd",
         "--reward_fn", chars_reward, "--reward_pretrain", tiny_rm_dir, "--reward_weights", "1", "0.5",
         "--reward_clip", "3", "--normalize_reward", "--dynamic_sampling",
         "--high_entropy_token_ratio", "0.2", "--overlong_buffer_len", "4", "--ema_beta", "0.9",
         "--pretrain_data", str(ptx), "--train_batch_size", "2",
         "--actor_learning_rate", "1e-3", "--output_dir", str(tmp_path / "out")])
    rows, _ = read_metrics(str(tmp_path / "out"))
    assert len(rows) == 3
    for r in rows:
        assert {"rollout/reward/rm0", "rollout/reward/overlong", "train/ptx_loss"} <= set(r)
        assert r["rollout/generation_rounds"] >= 1 and r["train/grad_norm"] > 0
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model").state_dict()
    ema = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "ema_model").state_dict()
    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(ema[name], final[name]) and not torch.equal(ema[name], init[name])
    # a constant reward: every group is dropped, every round runs, and dropped groups fill the batch
    (tmp_path / "const.py").write_text("def const(p, c, l, **kw):\n    return [1.0] * len(c)\n")
    run(["--pretrain", tiny_model_dir, *TINY, "--max_steps", "1", "--dynamic_sampling",
         "--max_num_gen_batches", "3", "--reward_fn", f"{tmp_path / 'const.py'}:const",
         "--output_dir", str(tmp_path / "const")])
    rows, _ = read_metrics(str(tmp_path / "const"))
    assert rows[0]["rollout/generation_rounds"] == 3 and rows[0]["rollout/filled_groups"] == 2


def test_reward_shaping_high_entropy_tokens_and_eval_accuracy(tiny_model_dir, tmp_path, chars_reward):
    """--normalize_reward: the shaped rewards have the running mean subtracted (their mean is 0 at step 1,
    when the running statistics are that batch's, and not at step 2); --reward_clip 0.1 caps them;
    --high_entropy_token_ratio 0.2 trains the policy on about a fifth of the tokens. The chars reward has no
    `correct` component, so eval reports a reward mean and no accuracy, unless --eval_reward_threshold defines
    one."""
    run(["--pretrain", tiny_model_dir, *TINY, "--reward_fn", chars_reward, "--normalize_reward",
         "--high_entropy_token_ratio", "0.2", "--output_dir", str(tmp_path / "norm")])
    rows, evals = read_metrics(str(tmp_path / "norm"))
    assert rows[0]["rollout/reward_mean"] > 0 and abs(rows[0]["rollout/shaped_reward_mean"]) < 1e-5
    assert abs(rows[1]["rollout/shaped_reward_mean"]) > 1e-3
    assert all(0 < r["train/pg_token_frac"] <= 0.3 for r in rows)
    assert "eval/accuracy" not in evals[0] and evals[0]["eval/reward_mean"] > 0

    run(["--pretrain", tiny_model_dir, *TINY, "--reward_fn", chars_reward, "--reward_clip", "0.1",
         "--eval_reward_threshold", "0.5", "--output_dir", str(tmp_path / "clip")])
    rows, evals = read_metrics(str(tmp_path / "clip"))
    assert all(r["rollout/reward_mean"] > 0.1 for r in rows)  # len / 10 of 8-token responses
    assert all(r["rollout/shaped_reward_mean"] <= 0.1 + 1e-6 and r["rollout/reward_clip_frac"] > 0
               for r in rows)
    assert "train/pg_token_frac" not in rows[0]
    assert 0 <= evals[0]["eval/accuracy"] <= 1


def test_lora(tiny_model_dir, tmp_path, chars_reward):
    """LoRA, with PPO's critic: only adapters train; the reference is the base (adapters off), so the KL
    penalty starts at 0 and grows; the export is the merged model plus the adapter, and the two agree. The
    critic is built from the base weights before the adapters are added (it used to copy the peft model's
    state dict and crash on its keys), and learns."""
    run(["--pretrain", tiny_model_dir, *TINY, "--max_steps", "3", "--lora_rank", "4",
         "--advantage_estimator", "gae", "--reward_fn", chars_reward, "--actor_learning_rate", "1e-2",
         "--output_dir", str(tmp_path)])
    rows, _ = read_metrics(str(tmp_path))
    assert rows[0]["rollout/kl"] == 0 and rows[2]["rollout/kl"] != 0
    assert all(r["train/grad_norm"] > 0 and r["train/critic_grad_norm"] > 0 for r in rows)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    via_adapter = (PeftModel.from_pretrained(base, tmp_path / "model" / "adapter")
                   .merge_and_unload().state_dict())
    assert all(torch.allclose(merged[k], via_adapter[k], atol=1e-6) for k in merged)
    untouched = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(merged[name], untouched[name])
    # not a LoRA target: frozen
    assert torch.equal(merged["model.norm.weight"], untouched["model.norm.weight"])


def test_policy_loss_variants(tiny_model_dir, tmp_path, chars_reward):
    """clip-higher, dual-clip, GSPO, TIS and an entropy bonus together, with two optimizer steps per rollout
    so ratios move."""
    run(["--pretrain", tiny_model_dir, *TINY, "--eps_clip", "0.2", "0.28", "--dual_clip", "3",
         "--policy_loss_type", "gspo", "--loss_agg_mode", "seq-mean-token-mean", "--tis_cap", "2",
         "--train_batch_size", "2", "--entropy_coef", "0.01", "--reward_fn", chars_reward,
         "--actor_learning_rate", "1e-3",
         "--output_dir", str(tmp_path)])
    rows, _ = read_metrics(str(tmp_path))
    assert len(rows) == 2 and all(math.isfinite(r["train/policy_loss"]) and r["train/grad_norm"] > 0
                                  for r in rows)
    proc = run(["--pretrain", tiny_model_dir, *TINY, "--dual_clip", "0.5",
                "--output_dir", str(tmp_path / "x")], check=False)
    assert proc.returncode == 2 and "error: --dual_clip 0.5: must be > 1" in proc.stderr


def test_two_processes_cpu(tiny_model_dir, tmp_path, chars_reward):
    """Two data-parallel ranks over gloo (torchrun + ACCELERATE_USE_CPU): PPO with its critic under DDP,
    global whitening, metric gathers, both optimizers' state moved out between updates, and the final export;
    with partial rollout, whose ranks continue different samples in the same number of rounds."""
    os.environ["ACCELERATE_USE_CPU"] = "true"
    try:
        run(["--pretrain", tiny_model_dir, *TINY, "--micro_train_batch_size", "1",
             "--reward_fn", chars_reward, "--advantage_estimator", "gae", "--optimizer_offload",
             "--output_dir", str(tmp_path), *PARTIAL, "--max_steps", "3"],
            launcher=(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"))
    finally:
        del os.environ["ACCELERATE_USE_CPU"]
    steps_rows, eval_rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in steps_rows] == [1, 2, 3] and [r["step"] for r in eval_rows] == [0, 3]
    assert sum(r["rollout/resumed"] for r in steps_rows) > 0
    assert all(r["train/grad_norm"] > 0 and r["train/critic_grad_norm"] > 0 for r in steps_rows)
    assert json.load(open(tmp_path / "config.json"))["world_size"] == 2
    assert os.path.isfile(tmp_path / "model" / "config.json")


def test_prompt_file(tiny_model_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"q": f"What is {i} + 1?", "a": str(i + 1)}) for i in range(4)))
    run(["--pretrain", tiny_model_dir, *TINY, "--prompt_data", str(data), "--input_key", "q",
         "--label_key", "a", "--output_dir", str(tmp_path / "out")])
    steps_rows, eval_rows = read_metrics(str(tmp_path / "out"))
    assert len(steps_rows) == 2 and eval_rows == []
    run(["--pretrain", tiny_model_dir, *TINY, "--prompt_data", str(data), "--input_key", "q",
         "--label_key", "a", "--eval_data", str(data), "--eval_n_samples", "3",
         "--output_dir", str(tmp_path / "out2")])
    _, eval_rows = read_metrics(str(tmp_path / "out2"))
    assert [r["eval/num_problems"] for r in eval_rows] == [4, 4]
    assert all(0 <= r["eval/pass@1"] <= r["eval/pass@3"] <= 1 for r in eval_rows)


def test_default_model_one_step(tmp_path):
    """The acceptance command: the embedded SmolLM2-135M, default flags, one step (and both evals) of 2
    prompts instead of 8 (the update of 32 samples took a minute of CI's two cores), evaluated on 8 of the
    built-in task's held-out problems instead of 96 (two evals took 140 of the test's 200 s; the tiny-model
    runs evaluate all 96)."""
    from rft_core.tasks.arithmetic import arithmetic_task

    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_task(seed=0)[1][:8]))
    run(["--max_steps", "1", "--rollout_batch_size", "2", "--eval_data", str(eval_file),
         "--output_dir", str(tmp_path / "out")])
    check_outputs(str(tmp_path / "out"), steps=1, eval_problems=8)


BY_ROWS = ["--micro_train_batch_size", "1"]
BY_TOKENS = ["--max_tokens_per_micro_batch", "40"]
PACKED = ["--max_tokens_per_micro_batch", "30", "--packing_samples"]


@pytest.mark.parametrize("mode, splits", [("token-mean", [BY_TOKENS, PACKED]),
                                          ("seq-mean-token-mean", [PACKED])])
def test_grad_accumulation_invariance(tiny_model_dir, tmp_path, mode, splits, chars_reward):
    """Same rollouts, one micro-batch of 4 vs 4 of 1, or micro-batches by a token budget (a varying number, of
    unequal sizes), padded or packed: same loss and pre-clip gradient norm."""
    rows = []
    for i, split in enumerate([["--micro_train_batch_size", "4"], *splits]):
        out = tmp_path / str(i)
        run(["--pretrain", tiny_model_dir, *TINY_BY_TOKENS, "--max_steps", "1", *split,
             "--loss_agg_mode", mode, "--reward_fn", chars_reward, "--output_dir", str(out)])
        rows.append(read_metrics(str(out))[0][0])
    assert rows[0]["rollout/reward_std"] > 0 and rows[0]["train/grad_norm"] > 0  # a real gradient to compare
    assert rows[0]["train/micro_batches"] == 1 and all(r["train/micro_batches"] > 1 for r in rows[1:])
    for other in rows[1:]:
        assert rows[0]["rollout/reward_mean"] == other["rollout/reward_mean"]
        assert rows[0]["train/grad_norm"] == pytest.approx(other["train/grad_norm"], rel=1e-4)
        assert rows[0]["train/policy_loss"] == pytest.approx(other["train/policy_loss"], rel=1e-4, abs=1e-7)


REWARD_FILE = '''
def components(prompts, completions, labels, **kwargs):
    assert len(prompts) == len(completions) == len(labels)
    return {"len": [len(c) / 100 for c in completions], "one": [1.0] * len(completions)}

def broken(prompts, completions, labels, **kwargs):
    raise RuntimeError("reward server down")
'''


def test_custom_reward_fn_and_failures(tiny_model_dir, tmp_path):
    (tmp_path / "rw.py").write_text(REWARD_FILE)
    run(["--pretrain", tiny_model_dir, *TINY, "--reward_fn", f"{tmp_path}/rw.py:components",
         "--output_dir", str(tmp_path / "a")])
    rows, _ = read_metrics(str(tmp_path / "a"))
    assert all(r["rollout/reward/one"] == 1.0 and r["rollout/reward_errors"] == 0 for r in rows)
    assert all(r["rollout/reward_mean"] == pytest.approx(1.0 + r["rollout/reward/len"]) for r in rows)

    # a reward that always fails: covered in test_user_errors.py (it stops the run unless tolerated)

    proc = run(["--pretrain", tiny_model_dir, *TINY, "--reward_fn", f"{tmp_path}/rw.py:broken",
                "--reward_failure_limit", "0", "--output_dir", str(tmp_path / "c")], check=False)
    assert proc.returncode != 0 and "reward failed on sample 0" in proc.stderr


def test_observability_under_accelerate_launch(tiny_model_dir, tmp_path):
    """Through `accelerate launch`: TensorBoard events, an offline wandb run, PNG plots and sample rows, all
    real files, and the run's outputs (evals, config, model)."""
    out = tmp_path / "out"
    os.environ.update({"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"})
    try:
        run(["--pretrain", tiny_model_dir, *TINY, "--report_to", "tensorboard", "wandb",
             "--log_samples_steps", "1", "--output_dir", str(out)],
            launcher=(sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu"))
    finally:
        for key in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT"):
            os.environ.pop(key)
    events = [os.path.join(d, f) for d, _, files in os.walk(out / "tensorboard") for f in files
              if "tfevents" in f]
    assert events and all(os.path.getsize(e) > 0 for e in events)
    runs = [d for d, _, files in os.walk(tmp_path / "wandb") if any(f.endswith(".wandb") for f in files)]
    assert runs, "no offline wandb run written"
    for png in ("curves.png", "gen_len.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4
    assert {"prompt", "completion", "label", "reward"} <= set(samples[0])
    check_outputs(str(out))


BLOCKING_REWARD = """import os, time
def chars(p, completions, l, **kw):
    if os.environ.get("BLOCK_AFTER") and os.path.isdir(os.environ["BLOCK_AFTER"]):
        time.sleep(600)  # the test kills the run here, in step 3, after checkpoint-2 is complete
    return [len(c) / 10 for c in completions]
"""


def test_sigkill_and_resume_match_an_uninterrupted_run(tiny_model_dir, tmp_path):
    """Killed with SIGKILL during step 3 and resumed from checkpoint-2, a run logs the same steps 3 and 4
    as an uninterrupted run with the same seed (everything but timings); each step once in metrics.jsonl.
    With partial rollout on, so that samples wait in the buffer at the checkpoint and continue after the
    resume (the synchronous loop's state is the same less the buffer)."""
    extra = PARTIAL
    (tmp_path / "rw.py").write_text(BLOCKING_REWARD)
    args = ["--pretrain", tiny_model_dir, *TINY, "--max_steps", "4", "--save_steps", "2",
            "--max_ckpt_num", "1", "--reward_fn", f"{tmp_path}/rw.py:chars", "--actor_learning_rate", "1e-3",
            "--ema_beta", "0.5", *extra]
    run([*args, "--output_dir", str(tmp_path / "straight")])
    rows = read_metrics(str(tmp_path / "straight"))[0]
    assert rows[1]["rollout/buffered"] > 0 and rows[2]["rollout/resumed"] > 0  # in the buffer at the save
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2",
           "BLOCK_AFTER": str(killed / "checkpoint-2")}
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_ppo.py"), *args,
                             "--output_dir", str(killed)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "latest").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(2)  # now inside step 3's reward
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and (killed / "latest").read_text() == "checkpoint-2"
    assert not (killed / "model").exists()
    run([*args, "--output_dir", str(killed)])  # resumes from checkpoint-2
    straight, _ = read_metrics(str(tmp_path / "straight"))
    resumed, evals = read_metrics(str(killed))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 4]
    for a, b in zip(straight[2:], resumed[2:]):
        assert ({k: v for k, v in a.items() if not k.startswith("perf/")}
                == {k: v for k, v in b.items() if not k.startswith("perf/")})
    # --max_ckpt_num 1
    assert [os.path.basename(c) for c in sorted(killed.glob("checkpoint-*"))] == ["checkpoint-4"]
    import torch
    from transformers import AutoModelForCausalLM
    for name in ("model", "ema_model"):
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / name).state_dict()
        b = AutoModelForCausalLM.from_pretrained(killed / name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_partial_rollout(tiny_model_dir, tmp_path, chars_reward):
    """A budget of at least --generate_max_len gives the synchronous run, step for step (sample-level weights,
    partial rollout's default, in both); a budget of 3 of 8
    tokens keeps samples in the buffer, continues them in later steps, and trains no token older than
    --max_staleness versions; TIS weights are logged."""
    base = ["--pretrain", tiny_model_dir, *TINY, "--max_steps", "2", "--reward_fn", chars_reward,
            "--actor_learning_rate", "1e-3", "--tis_cap", "2"]
    rows = []
    for i, extra in enumerate([["--tis_level", "sequence"], ["--partial_rollout", "--max_token_budget", "8"],
                               ["--partial_rollout", "--max_token_budget", "3", "--max_staleness", "1",
                                "--max_steps", "5"]]):
        run([*base, *extra, "--output_dir", str(tmp_path / str(i))])
        rows.append(read_metrics(str(tmp_path / str(i)))[0])
    partial_keys = ("perf/", "rollout/buffered", "rollout/resumed", "rollout/finished_from_buffer",
                    "rollout/dropped_stale", "rollout/staleness")
    for a, b in zip(rows[0], rows[1]):
        assert {k: v for k, v in a.items() if not k.startswith(partial_keys)} == \
            {k: v for k, v in b.items() if not k.startswith(partial_keys)}
    assert all(r["rollout/staleness_max"] == 0 and r["rollout/buffered"] == 0 for r in rows[1])
    cut = rows[2]
    assert (sum(r["rollout/resumed"] for r in cut) > 0
            and sum(r["rollout/finished_from_buffer"] for r in cut) > 0)
    assert (all(r["rollout/staleness_max"] <= 1 for r in cut)
            and max(r["rollout/staleness_max"] for r in cut) == 1)
    assert all(r["train/is_weight_mean"] > 0 and r["rollout/tokens_generated"] > 0 for r in cut)
