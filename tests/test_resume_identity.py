"""A resume knows what changed (issue 62): the checkpoint records its data files by their content's SHA-256
and its model by its files' digest, so an edited data file or another model at the same path is refused in
one line (a moved one resumes); a lower --max_steps than the checkpoint's step is refused, and a higher one
keeps the checkpoint's learning-rate schedule instead of stretching its warm-up. Checkpoints from before
these records still resume."""

import json
import os
import time
from types import SimpleNamespace

import pytest
from conftest import read_metrics, run_script

from rft_core.errors import CheckpointError
from rft_core.runs.checkpoint import LoopState, check_identity, run_identity, schedule_length

ACCELERATOR = SimpleNamespace(distributed_type=SimpleNamespace(name="NO"), num_processes=1,
                              state=SimpleNamespace(deepspeed_plugin=None))


def args_for(**paths):
    return SimpleNamespace(**{"seed": 0, "normalize_reward": False, "ema_beta": None, "lora_rank": 0,
                              "advantage_estimator": "group_norm", "prompt_data": "arithmetic",
                              "eval_data": None, "pretrain_data": None, **paths})


def checkpoint_with(tmp_path, state):
    ckpt = tmp_path / "run" / "checkpoint-4"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 4, **state}))
    return str(ckpt)


def edit_keeping_size_and_time(path, text):
    """Rewrite path with text, its modification time set back (its change time moves: a clock tick later)."""
    stat = os.stat(path)
    time.sleep(0.02)
    path.write_text(text)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_an_edited_data_file_is_refused_and_a_moved_one_resumes(tmp_path):
    """An edited --prompt_data (the same path, size and time), --eval_data or --pretrain_data resumed without
    a word: its content's SHA-256 is recorded now and compared."""
    data = {}
    for flag in ("prompt_data", "eval_data", "pretrain_data"):
        data[flag] = tmp_path / f"{flag}.jsonl"
        data[flag].write_text('{"prompt": "1 + 1", "label": "2"}\n')
    args = args_for(**{k: str(v) for k, v in data.items()})
    ckpt = checkpoint_with(tmp_path, {"run": run_identity(args, ACCELERATOR)})
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(data["prompt_data"].read_bytes())
    check_identity(ckpt, run_identity(SimpleNamespace(**{**vars(args), "prompt_data": str(moved)}),
                                      ACCELERATOR))  # the same content elsewhere
    edit_keeping_size_and_time(data["prompt_data"], '{"prompt": "1 + 2", "label": "3"}\n')
    with pytest.raises(CheckpointError, match=r"other settings \(--prompt_data: other data \(the file was "
                                              r"edited, or is another\)\): .* pass --no_resume"):
        check_identity(ckpt, run_identity(args, ACCELERATOR))
    edit_keeping_size_and_time(data["eval_data"], '{"prompt": "2 + 2", "label": "4"}\n')
    with pytest.raises(CheckpointError, match="--prompt_data: other data .*; --eval_data: other data"):
        check_identity(ckpt, run_identity(args, ACCELERATOR))


def test_a_data_directory_is_identified_by_its_data_files(tmp_path):
    """A directory's data files count, not what lies beside them (a README, a hidden .git)."""
    folder = tmp_path / "data"
    (folder / ".git").mkdir(parents=True)
    (folder / "a.jsonl").write_text('{"prompt": "x", "label": "1"}\n')
    args = args_for(prompt_data=str(folder))
    ckpt = checkpoint_with(tmp_path, {"run": run_identity(args, ACCELERATOR)})
    (folder / "README.md").write_text("notes")
    (folder / ".git" / "index").write_text("changed")
    check_identity(ckpt, run_identity(args, ACCELERATOR))
    (folder / "b.jsonl").write_text('{"prompt": "y", "label": "2"}\n')
    with pytest.raises(CheckpointError, match="--prompt_data: other data"):
        check_identity(ckpt, run_identity(args, ACCELERATOR))


@pytest.mark.parametrize("mib", [1, 65])  # read whole; read in blocks
def test_another_model_at_the_same_path_is_refused(tmp_path, mib):
    """--pretrain was compared by path: a model directory whose weights were replaced (the KL reference
    silently became another model) resumed. Its files' digest is compared now; a large weights file is read
    in blocks spread over it, which another model's weights change."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(os.urandom(1 << 20) * mib)
    args = args_for()
    ckpt = checkpoint_with(tmp_path, {"run": run_identity(args, ACCELERATOR, str(model))})
    check_identity(ckpt, run_identity(args, ACCELERATOR, str(model)))
    time.sleep(0.02)  # (a clock tick: its change time moves)
    (model / "model.safetensors").write_bytes(os.urandom(1 << 20) * mib)  # another model, the same size
    with pytest.raises(CheckpointError, match=r"--pretrain: another model \(its files differ"):
        check_identity(ckpt, run_identity(args, ACCELERATOR, str(model)))


def test_checkpoints_from_before_the_digests_still_resume(tmp_path):
    """A checkpoint whose identity holds paths (no digests) and no schedule resumes; the next checkpoint
    records this run's digests."""
    args = args_for()
    old_run = {"pretrain": "/somewhere/model", "prompt_data": "arithmetic", "seed": 0}
    ckpt = checkpoint_with(tmp_path, {"run": old_run})
    identity = run_identity(args, ACCELERATOR, None)
    check_identity(ckpt, identity)
    assert schedule_length(ckpt, 6, 12, 0.5, print) == 12

    class Stream:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    loop = LoopState(Stream(), identity, schedule=12)
    assert loop.load({"step": 4, "run": old_run, "kl_coef": 0.0, "first_eval": None, "moments": None},
                     None) == 4
    assert loop.schedule == 12 and loop.run["data"] == identity["data"] and loop.run["seed"] == 0


def test_a_shorter_run_is_refused_and_a_longer_one_keeps_the_schedule(tmp_path):
    """A --max_steps below the checkpoint's step ended with exit 0, "finished", and no model; a higher one
    re-stretched the warm-up over the longer run (the learning rate fell back)."""
    ckpt = checkpoint_with(tmp_path, {"schedule": 8})
    with pytest.raises(CheckpointError, match=r"checkpoint-4 is past this run's last step, 2 \(--max_steps, "
                                              r"--num_episodes\): .* Resume with --max_steps 4 or more"):
        schedule_length(ckpt, 2, 4, 0.5, print)
    said = []
    assert schedule_length(ckpt, 8, 16, 0.5, said.append) == 8
    assert said == ["[resume] the learning-rate warm-up keeps the length checkpoint-4 was written with, 4 "
                    "optimizer steps, not 8 over this run's steps (the rate would fall back)"]
    assert schedule_length(ckpt, 8, 16, 0.0, said.append) == 8  # no warm-up: nothing to say
    assert schedule_length(ckpt, 4, 8, 0.5, said.append) == 8 and len(said) == 1
    assert schedule_length(None, 4, 6, 0.5, said.append) == 6


@pytest.mark.slow
def test_resume_refuses_edited_data_and_fewer_steps_and_keeps_the_warm_up(tiny_model_dir, tmp_path):
    """End to end: a run of 2 steps with checkpoints; resumed on an edited data file, refused in one line
    before anything loads; with --max_steps 1, refused; with --max_steps 4, it trains on at the learning
    rate it reached (the warm-up was 2 optimizer steps long, not 4)."""
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "label": str(i + 1)}) + "\n"
                            for i in range(8)))
    out = tmp_path / "run"
    args = ["--pretrain", tiny_model_dir, "--prompt_data", str(data), "--rollout_batch_size", "2",
            "--n_samples_per_prompt", "2", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4",
            "--generate_max_len", "8", "--save_steps", "1", "--lr_warmup_ratio", "0.9",
            "--output_dir", str(out)]
    run_script("train_ppo.py", [*args, "--max_steps", "2"])
    metrics = (out / "metrics.jsonl").read_text()
    original = data.read_text()
    edit_keeping_size_and_time(data, original.replace("0 + 1", "0 + 0"))
    proc = run_script("train_ppo.py", [*args, "--max_steps", "4"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "--prompt_data: other data (the file was edited, or is another)" in proc.stderr
    data.write_text(original)
    proc = run_script("train_ppo.py", [*args, "--max_steps", "1"], check=False)
    assert proc.returncode == 2 and "checkpoint-2 is past this run's last step, 1" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == metrics  # both refusals left the run as it was
    proc = run_script("train_ppo.py", [*args, "--max_steps", "4"])
    assert "the learning-rate warm-up keeps the length checkpoint-2 was written with, 2 " in proc.stdout
    rates = [row["train/lr"] for row in read_metrics(str(out))[0]]
    assert rates[1:] == [rates[1]] * 3 and rates[0] < rates[1]  # warm-up over steps 1-2, then constant


def test_another_teacher_is_refused(tmp_path):
    """A distilled run resumes with the teacher it started from: another (or none) is one line."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "model.safetensors").write_bytes(b"a" * 1000)
    args = args_for(teacher_pretrain=str(teacher))
    ckpt = checkpoint_with(tmp_path, {"run": run_identity(args, ACCELERATOR, "m")})
    check_identity(ckpt, run_identity(args, ACCELERATOR, "m"))
    time.sleep(0.02)
    (teacher / "model.safetensors").write_bytes(b"b" * 1000)
    with pytest.raises(CheckpointError, match=r"--teacher_pretrain: another model"):
        check_identity(ckpt, run_identity(args, ACCELERATOR, "m"))
    with pytest.raises(CheckpointError, match=r"--teacher_pretrain: another model"):
        check_identity(ckpt, run_identity(args_for(), ACCELERATOR, "m"))
