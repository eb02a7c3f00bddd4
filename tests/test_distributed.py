"""Sharded training on CPU: DeepSpeed ZeRO (2 gloo ranks, DS_ACCELERATOR=cpu) through the real config
files, the layer-wise weight gather under FSDP2 and ZeRO-3, and every accelerate config file."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from test_train_smoke import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "accelerate_configs", "*.yaml")))
RUN = ["--max_steps", "2", "--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--micro_train_batch_size", "1",
       "--micro_rollout_batch_size", "4", "--generate_max_len", "8", "--use_kl_loss", "--init_kl_coef", "0.1", "--actor_learning_rate", "1e-3"]


def launch(cmd, **env):
    env = {**os.environ, "PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu", **env}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout


def test_config_files_load():
    """Each config parses as accelerate's own launcher reads it, with the backend its name promises."""
    from accelerate.commands.config.config_args import load_config_from_file

    names = {os.path.basename(p)[:-5] for p in CONFIGS}
    assert names >= {"single_gpu", "multi_gpu", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3",
                     "deepspeed_zero3_offload", "fsdp2", "fsdp2_offload", "multi_node"}
    for path in CONFIGS:
        config, name = load_config_from_file(path), os.path.basename(path)
        if name.startswith("deepspeed") or name == "multi_node":
            stage = int(name[len("deepspeed_zero")]) if name.startswith("deepspeed") else 3
            assert config.distributed_type.name == "DEEPSPEED" and config.deepspeed_config["zero_stage"] == stage
            assert (config.deepspeed_config["offload_optimizer_device"] == "cpu") == name.endswith("offload.yaml")
        if name.startswith("fsdp2"):
            assert config.distributed_type.name == "FSDP" and config.fsdp_config["fsdp_version"] == 2
            assert config.fsdp_config["fsdp_offload_params"] == name.endswith("offload.yaml")
        assert config.mixed_precision == "no"  # the script picks bf16 itself


@pytest.mark.parametrize("mode", ["fsdp2", "zero3"])
@pytest.mark.parametrize("lora", ["0", "1"])
def test_full_weights_sharded(tiny_model_dir, mode, lora):
    """The vLLM weight sync's gather: every weight exact (LoRA merged), one layer or tensor at a time."""
    if mode == "zero3":
        pytest.importorskip("deepspeed")
    out = launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                  os.path.join(ROOT, "tests", "gather_worker.py"), tiny_model_dir, mode, lora])
    assert out.count("OK") == 2


def test_deepspeed_zero3_matches_ddp_and_resumes(tiny_model_dir, tmp_path, chars_reward):
    """ZeRO-3 (sharded actor, sharded reference for the KL loss) through accelerate_configs/deepspeed_zero3.yaml:
    the same grad norms, KL and exported weights as DDP on the same seed; killed after step 1 and resumed,
    step 2 is still DDP's step 2."""
    pytest.importorskip("deepspeed")
    args = [os.path.join(ROOT, "train_ppo.py"), "--pretrain", tiny_model_dir, *RUN, "--reward_fn", chars_reward]
    launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *args,
            "--output_dir", str(tmp_path / "ddp")], ACCELERATE_USE_CPU="true")
    zero3 = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
             os.path.join(ROOT, "accelerate_configs", "deepspeed_zero3.yaml"), *args, "--save_steps", "1",
             "--output_dir", str(tmp_path / "z3")]
    launch([*zero3[:-6], "--max_steps", "1", *zero3[-6:]])  # argparse: the later --max_steps wins
    assert os.path.isdir(tmp_path / "z3" / "checkpoint-1")
    out = launch(zero3)
    assert "[resume] from" in out and "2 processes" in out
    ddp, _ = read_metrics(str(tmp_path / "ddp"))
    z3, _ = read_metrics(str(tmp_path / "z3"))
    assert [r["step"] for r in z3] == [1, 2]
    for a, b in zip(ddp, z3):
        for key in ("train/grad_norm", "train/kl", "train/policy_loss", "rollout/reward_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert z3[1]["train/kl"] > 0  # the sharded reference model is in use
    want, got = (load_file(str(tmp_path / d / "model" / "model.safetensors")) for d in ("ddp", "z3"))
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    assert json.load(open(tmp_path / "z3" / "config.json"))["world_size"] == 2
