"""The README's launch commands on a machine without a GPU: `accelerate launch --config_file
accelerate_configs/multi_gpu.yaml train_ppo.py` runs as two CPU processes over gloo (rft_core.distributed's
cpu_ranks; accelerate alone made each process take itself for the only one, and the two raced for the output
directory), a plain `accelerate launch train_ppo.py` as one, and an FSDP config is refused in one line."""

import json
import os
import sys

import pytest
import torch
from conftest import ROOT, read_metrics, run_script

from rft_core.distributed import cpu_ranks
from rft_core.errors import ConfigError

on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")

TINY = ["--max_steps", "1", "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
        "--micro_rollout_batch_size", "4", "--generate_max_len", "8", "--micro_train_batch_size", "2"]


def tiny_run(model_dir, tmp_path):
    """A one-step run's flags: a data file without an eval split (no held-out eval: time)."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [json.dumps({"prompt": f"Count to {i}.", "label": str(i)}) + "\n" for i in range(4)]
    prompts.write_text("".join(rows))
    return ["--pretrain", model_dir, "--prompt_data", str(prompts), *TINY,
            "--output_dir", str(tmp_path / "run")]


def accelerate_launch(config=None):
    """The launcher as the README types it (`accelerate launch [--config_file accelerate_configs/C.yaml]`)."""
    chosen = ["--config_file", os.path.join(ROOT, "accelerate_configs", f"{config}.yaml")] if config else []
    return (sys.executable, "-m", "accelerate.commands.launch", *chosen)


def test_cpu_ranks(monkeypatch):
    """Accelerator(cpu=True) only for several processes without a GPU and without DeepSpeed (which joins its
    ranks itself); FSDP refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for env, want in (({}, False), ({"WORLD_SIZE": "1"}, False), ({"WORLD_SIZE": "2"}, True),
                      ({"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"}, False)):
        for name in ("WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert cpu_ranks() is want, env
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match="FSDP needs GPUs"):
        cpu_ranks()


@pytest.mark.parametrize("config, processes", [("multi_gpu", 2), (None, 1)])
@pytest.mark.slow
@on_cpu
def test_accelerate_launch_on_cpu_runs_every_process(tiny_model_dir, tmp_path, config, processes):
    """multi_gpu.yaml (num_processes 2): two gloo ranks, one run; no config: one process, as before."""
    out = tmp_path / "run"
    proc = run_script("train_ppo.py", tiny_run(tiny_model_dir, tmp_path), launcher=accelerate_launch(config))
    assert f"| {processes} processes |" in proc.stdout and "in use by another run" not in proc.stderr
    steps, _ = read_metrics(str(out))
    assert [r["step"] for r in steps] == [1]
    assert json.load(open(out / "config.json"))["world_size"] == processes
    assert os.path.isfile(out / "model" / "config.json")


@pytest.mark.slow
@on_cpu
def test_fsdp_on_cpu_is_refused_in_a_line(tiny_model_dir, tmp_path):
    """accelerate runs FSDP on GPUs only: told `cpu`, it would run DDP instead without a word."""
    out = tmp_path / "run"
    proc = run_script("train_ppo.py", tiny_run(tiny_model_dir, tmp_path), launcher=accelerate_launch("fsdp2"),
                      check=False)
    assert proc.returncode != 0
    said = {line for line in proc.stderr.splitlines() if line.startswith("error: ")}
    assert said == {"error: FSDP needs GPUs: on CPU use the multi_gpu.yaml or deepspeed_zero*.yaml config"}
    assert not out.exists()
