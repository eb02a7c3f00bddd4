"""End-to-end runs of train_ppo_vl.py on CPU: the built-in tiny Qwen2-VL on drawn shapes, and a file dataset
with images (several per prompt, text-only rows, a row over the image limit)."""

import importlib.util
import json
import math
import os
import sys

import pytest
from conftest import ROOT, read_metrics, run_script

VL_TINY = ["--max_steps", "3", "--rollout_batch_size", "2", "--n_samples_per_prompt", "4",
           "--micro_train_batch_size", "4", "--generate_max_len", "4"]


def run_vl(args, **kwargs):
    return run_script("train_ppo_vl.py", args, **kwargs)


@pytest.mark.slow
def test_builtin_shapes(tmp_path):
    run_vl([*VL_TINY, "--output_dir", str(tmp_path)])
    rows, evals = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["step"] for r in evals] == [0, 3]
    for r in rows:  # GRPO: a gradient exactly when some group's rewards differ (all equal: all advantages 0)
        assert "rollout/reward/correct" in r and math.isfinite(r["train/policy_loss"])
        assert (r["train/grad_norm"] > 0) == (r["rollout/reward_std"] > 0)
    assert evals[0]["eval/num_problems"] == 64
    from transformers import Qwen2VLForConditionalGeneration
    Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "model")
    assert os.path.isfile(tmp_path / "model" / "preprocessor_config.json")


@pytest.mark.slow
def test_file_dataset_with_images(tmp_path, chars_reward):
    import random

    from rft_core.tasks.shapes import draw_shapes
    for i in range(3):  # img0 at 280 x 280: decoded when drawn, resized to the 84 x 84 the processor allows
        draw_shapes("red", i + 1, random.Random(i), size=280 if i == 0 else 84).save(tmp_path / f"img{i}.png")
    rows = [{"prompt": "what colour is the shape ?", "images": ["img0.png"], "label": "red"},
            {"prompt": "how many shapes are there ?", "images": "img1.png", "label": "two"},
            # text only: kept with --mixed_mm_data
            {"prompt": "what is the colour ?", "images": [], "label": "red"},
            # over the limit
            {"prompt": "how many shapes are there ?", "images": ["img1.png", "img2.png"], "label": "five"}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    proc = run_vl([*VL_TINY, "--prompt_data", str(tmp_path / "train.jsonl"), "--mixed_mm_data",
                   "--limit_mm_image_per_prompt", "1", "--reward_fn", chars_reward,
                   "--advantage_estimator", "reinforce_baseline", "--use_kl_loss", "--num_episodes", "3",
                   "--output_dir", str(tmp_path / "out")])
    assert "skipped 1 train prompts" in proc.stdout
    steps, _ = read_metrics(str(tmp_path / "out"))
    assert len(steps) == 3 and all(r["train/grad_norm"] > 0 for r in steps)
    assert steps[2]["train/kl"] != 0  # the reference model saw the images too


# dr_grpo, rloo: only their pure function differs
@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["cpgd", "reinforce", "gae"])
def test_estimators_with_images(tmp_path, estimator, chars_reward):
    """More of the text script's estimators on the shapes task (group_norm and reinforce_baseline run above);
    gae trains its vision critic, alone for the first step (--freezing_actor_steps 1), on a reward that always
    varies, with activation checkpointing on (the critic's wrapper passes it to its Qwen2-VL)."""
    extra = ["--freezing_actor_steps", "1", "--critic_learning_rate", "1e-3",
             "--gradient_checkpointing", "true"] if estimator == "gae" else []
    run_vl([*VL_TINY, "--advantage_estimator", estimator, "--reward_fn", chars_reward, *extra,
            "--output_dir", str(tmp_path)])
    rows, _ = read_metrics(str(tmp_path))
    assert len(rows) == 3 and all(math.isfinite(r["train/policy_loss"]) for r in rows)
    trained = rows[1:] if estimator == "gae" else rows  # gae: the actor is frozen at step 1
    assert all(r["train/grad_norm"] > 0 for r in trained)  # the chars reward varies: a real gradient
    if estimator == "gae":
        assert "train/grad_norm" not in rows[0]
        assert all(r["train/critic_grad_norm"] > 0 and r["train/value_loss"] > 0 for r in rows)
        assert rows[2]["train/values"] != 0  # the zero head has learned


@pytest.mark.slow
def test_text_flags_in_the_vl_script(tmp_path, chars_reward, monkeypatch):
    """Every flag of train_ppo.py exists in train_ppo_vl.py; those that cannot apply are refused in one line,
    the others run (--optimizer_offload, --system_prompt, --partial_rollout: image prompts continued from
    their token ids with their images, with a weight per sample, --tis_level sequence; a checkpoint of the
    unfinished samples resumes: their images were PIL objects that torch.load(weights_only=True) refused)."""
    import dataclasses

    import train_ppo
    import train_ppo_vl

    text, vl = ({f.name for f in dataclasses.fields(m.Args)} for m in (train_ppo, train_ppo_vl))
    assert text <= vl, text - vl
    for flags, message in ((["--advantage_estimator", "gae", "--critic_pretrain", "/x"], "VL critic is the"),
                           (["--apply_chat_template", "false"], "--apply_chat_template false"),
                           (["--packing_samples"], "--packing_samples: not for image prompts")):
        monkeypatch.setattr(sys, "argv", ["train_ppo_vl.py", *flags, "--output_dir", str(tmp_path)])
        with pytest.raises(ValueError, match=message):
            train_ppo_vl.main()
    flags = [*VL_TINY, "--optimizer_offload", "--system_prompt", "answer with a word .", "--reward_fn",
             chars_reward, "--partial_rollout", "--max_token_budget", "2", "--max_staleness", "1",
             "--tis_level", "sequence", "--save_steps", "1", "--output_dir", str(tmp_path / "out")]
    run_vl([*flags, "--max_steps", "3"])
    assert "[resume] from" in run_vl([*flags, "--max_steps", "4"]).stdout
    rows, _ = read_metrics(str(tmp_path / "out"))
    assert len(rows) == 4 and rows[0]["train/grad_norm"] > 0
    assert sum(r["rollout/resumed"] for r in rows) > 0 and all(r["rollout/staleness_max"] <= 1 for r in rows)


@pytest.mark.slow
def test_deepspeed_zero3_matches_ddp(tmp_path, chars_reward):
    """train_ppo_vl.py through accelerate_configs/deepspeed_zero3.yaml on two CPU ranks (DS_ACCELERATOR=cpu),
    the policy and the image-seeing reference sharded: the same rewards, grad norms and KL as DDP on the same
    seed."""
    pytest.importorskip("deepspeed")
    import subprocess

    args = [os.path.join(ROOT, "train_ppo_vl.py"), "--max_steps", "2", "--rollout_batch_size", "2",
            "--n_samples_per_prompt", "4", "--micro_train_batch_size", "2", "--generate_max_len", "4",
            "--use_kl_loss", "--init_kl_coef", "0.1", "--reward_fn", chars_reward]
    env = {**os.environ, "PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for launcher, out, extra in (([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"],
                                  "ddp", {"ACCELERATE_USE_CPU": "true"}),
                                 ([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                   os.path.join(ROOT, "accelerate_configs", "deepspeed_zero3.yaml")],
                                  "z3", {})):
        proc = subprocess.run([*launcher, *args, "--output_dir", str(tmp_path / out)], cwd=ROOT,
                              env={**env, **extra}, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ddp, z3 = read_metrics(str(tmp_path / "ddp"))[0], read_metrics(str(tmp_path / "z3"))[0]
    assert len(z3) == 2 and z3[1]["train/kl"] > 0
    for a, b in zip(ddp, z3):
        for key in ("train/grad_norm", "train/kl", "rollout/reward_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_engine_without_vllm_is_a_clear_error(tmp_path, monkeypatch):
    import train_ppo_vl

    monkeypatch.setattr(sys, "argv", ["train_ppo_vl.py", "--engine_type", "vllm",
                                      "--output_dir", str(tmp_path)])
    with pytest.raises(ImportError, match="--engine_type vllm needs vllm"):
        train_ppo_vl.main()
