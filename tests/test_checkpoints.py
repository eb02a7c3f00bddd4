"""The output directory and its checkpoints (issue 51): a finished or longer run never overwritten or pruned
away by a new one, one run at a time (a lock), every checkpoint file hashed, the newest intact checkpoint
found without `latest`, each resume's changed flags kept in config.json, RNG states checked after loading, a
full disk said as such with the previous checkpoint intact, and pickles read with weights_only=True."""

import errno
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, run_script

from rft_core.errors import CheckpointError, ConfigError
from rft_core.runs.checkpoint import (
    check_identity,
    latest_checkpoint,
    load_checkpoint,
    resume_point,
    run_identity,
    save_checkpoint,
)
from rft_core.runs.integrity import manifest
from rft_core.runs.metrics import MetricsLog
from rft_core.runs.run_dir import LOCK, _start_ticks, check_free, release_lock, take_lock

TINY = ["--max_steps", "2", "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
        "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4", "--generate_max_len", "8"]


def rows_file(path, steps, cut=None):
    """metrics.jsonl with a step-0 eval row and a training row per step (and a last line cut short)."""
    lines = [json.dumps({"step": 0, "eval/reward_mean": 0.5})]
    lines += [json.dumps({"step": s, "rollout/reward_mean": 1.0, "train/policy_loss": 0.1}) for s in steps]
    path.write_text("\n".join(lines) + "\n" + (cut or ""))


def fake_checkpoint(out, step, files=None):
    """checkpoint-<step> with a trainer state (and files: {name: bytes}) and its manifest."""
    ckpt = out / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
    for name, data in (files or {}).items():
        (ckpt / name).write_bytes(data)
    (ckpt / "manifest.json").write_text(json.dumps(manifest(str(ckpt))))
    return ckpt


def snapshot(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != LOCK}


@pytest.fixture
def accelerator():
    """A one-process CPU Accelerator with a tiny model to save."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    acc.prepare(torch.nn.Linear(4, 4))
    return acc


# ---- 1, 2: a previous run is never overwritten, nor its checkpoints mixed with a new run's ----

def test_a_new_run_over_a_finished_run_is_refused_and_no_resume_moves_it_aside(tmp_path, capsys):
    """A rerun (nothing to resume) into a finished run that kept no checkpoints used to truncate its
    metrics.jsonl and rewrite its config.json: now it is refused in one line and nothing changes; with
    --no_resume the old run moves whole into previous-1/ when the new record starts."""
    out = tmp_path / "run"
    (out / "model").mkdir(parents=True)
    (out / "model" / "model.safetensors").write_bytes(b"weights")
    (out / "config.json").write_text('{"seed": 0}')
    rows_file(out / "metrics.jsonl", [1, 2])
    before = snapshot(out)
    message = (f"--output_dir {out} holds a finished run (metrics.jsonl to step 2, model/): pass --no_resume "
               f"to start a new run there (that one moves to {out}/previous-1/), or use another --output_dir")
    with pytest.raises(ConfigError, match=re.escape(message)):
        MetricsLog(str(out), {"seed": 1, "no_resume": False})
    assert snapshot(out) == before and not (out / LOCK).exists()  # the lock is given back too

    log = MetricsLog(str(out), {"seed": 1, "no_resume": True})
    assert snapshot(out / "previous-1") == before
    assert json.loads((out / "config.json").read_text())["seed"] == 1
    assert (out / "metrics.jsonl").read_text() == "" and not (out / "model").exists()
    assert f"[output] --no_resume: the previous run (metrics.jsonl to step 2, model/) moved from {out} to " \
           f"{out}/previous-1/" in capsys.readouterr().out
    log.write(1, {"rollout/reward_mean": 0.0, "train/policy_loss": 0.0})
    with pytest.raises(ConfigError, match=re.escape("holds a run that left no checkpoint to resume "
                                                    "(metrics.jsonl to step 1)")):
        MetricsLog(str(out), {"no_resume": False})
    MetricsLog(str(out), {"no_resume": True})  # and again: previous-2/
    assert (out / "previous-2" / "metrics.jsonl").exists() and snapshot(out / "previous-1") == before
    release_lock(str(out))


def test_a_run_that_trained_no_step_is_written_over(tmp_path):
    """A record without a step (a start that failed at the step-0 eval) is nothing to keep: no refusal."""
    (tmp_path / "config.json").write_text("{}")
    rows_file(tmp_path / "metrics.jsonl", [])
    MetricsLog(str(tmp_path), {"no_resume": False})
    assert (tmp_path / "metrics.jsonl").read_text() == "" and not (tmp_path / "previous-1").exists()
    release_lock(str(tmp_path))


def test_no_resume_over_a_longer_runs_checkpoints_keeps_the_new_ones(tmp_path, accelerator):
    """--no_resume into a directory holding a longer run's checkpoint-5..7: pruning by step number deleted
    each new checkpoint as it was written and left `latest` naming a missing one. Now the old run moves to
    previous-1/; and pruning never touches the checkpoint just written nor newer steps (a resume that skipped
    damaged ones)."""
    out = tmp_path / "run"
    for step in (5, 6, 7):
        fake_checkpoint(out, step)
    (out / "latest").write_text("checkpoint-7")
    rows_file(out / "metrics.jsonl", range(1, 8))
    MetricsLog(str(out), {"no_resume": True})
    moved = ["checkpoint-5", "checkpoint-6", "checkpoint-7", "latest", "metrics.jsonl"]
    assert sorted(os.listdir(out / "previous-1")) == moved
    for step in (1, 2, 3):
        save_checkpoint(accelerator, str(out), step, {"n": step}, max_ckpt_num=2)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert (out / "latest").read_text() == "checkpoint-3"
    assert latest_checkpoint(str(out)) == str(out / "checkpoint-3")
    release_lock(str(out))

    left = tmp_path / "left"  # newer steps in place: left alone, the new ones kept
    fake_checkpoint(left, 9)
    for step in (1, 2, 3):
        save_checkpoint(accelerator, str(left), step, {"n": step}, max_ckpt_num=1)
    assert sorted(p.name for p in left.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-9"]
    assert (left / "latest").read_text() == "checkpoint-3"


@pytest.mark.slow
def test_a_failed_rerun_over_a_finished_run_without_checkpoints_loses_nothing(tiny_model_dir, tmp_path):
    """The issue's case: a run of 2 steps, no checkpoints; the same command with a reward that raises. It is
    refused in one line and the record is untouched; with --no_resume the old run is in previous-1/ whole
    while the new one fails."""
    out = tmp_path / "run"
    run_script("train_ppo.py", ["--pretrain", tiny_model_dir, *TINY, "--output_dir", str(out)])
    before = snapshot(out)
    (tmp_path / "bad.py").write_text("def bad(p, c, l, **kw):\n    raise ValueError('broken')\n")
    args = ["--pretrain", tiny_model_dir, *TINY, "--reward_fn", f"{tmp_path}/bad.py:bad", "--output_dir",
            str(out)]
    proc = run_script("train_ppo.py", args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"error: --output_dir {out} holds a finished run (metrics.jsonl to step 2, model/): pass " \
           "--no_resume" in proc.stderr
    assert snapshot(out) == before
    proc = run_script("train_ppo.py", [*args, "--no_resume"], check=False)
    assert proc.returncode != 0 and snapshot(out / "previous-1") == before


# ---- 3: every file hashed ----

def test_a_bit_flip_in_a_large_weight_file_is_found(tmp_path):
    """Files over 64 MiB were checked by size only: an exponent-bit flip in the newest checkpoint's weights
    went unnoticed. Now every file has its SHA-256 and the intact checkpoint before it is used."""
    fake_checkpoint(tmp_path, 1, {"model.safetensors": b"\0" * 1024})
    big = bytearray(os.urandom(65 << 20))
    ckpt = fake_checkpoint(tmp_path, 2, {"model.safetensors": bytes(big)})
    (tmp_path / "latest").write_text("checkpoint-2")
    assert "sha256" in json.loads((ckpt / "manifest.json").read_text())["model.safetensors"]
    big[40 << 20] ^= 0x40
    (ckpt / "model.safetensors").write_bytes(bytes(big))
    said = []
    assert latest_checkpoint(str(tmp_path), said.append) == str(tmp_path / "checkpoint-1")
    assert said == ["[resume] checkpoint-2 is damaged (model.safetensors changed since it was written "
                    "(SHA-256)): skipping it"]


# ---- 5: one run at a time ----

def lock_of(out, pid, host=None, start=None):
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "start": start,
                                        "since": "2026-01-01 00:00:00", "command": "train_ppo.py --x"}))


def test_a_second_live_run_is_refused_and_a_dead_ones_lock_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock_of(out, live.pid, start=_start_ticks(live.pid))
        message = (f"--output_dir {out} is in use by another run (pid {live.pid} on {socket.gethostname()}, "
                   f"since 2026-01-01 00:00:00: train_ppo.py --x): wait for it to end or use another "
                   f"--output_dir (if that run is gone, delete {out / LOCK})")
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_free(str(out))  # before anything loads
        with pytest.raises(ConfigError, match=re.escape(message)):
            MetricsLog(str(out), {})  # before anything is written
        assert sorted(os.listdir(out)) == [LOCK]
        # the same pid, started at another time: a reused pid, the lock is stale
        lock_of(out, live.pid, start=(_start_ticks(live.pid) or 0) + 1)
        take_lock(str(out), print)
        assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
        release_lock(str(out))
    finally:
        live.kill()
        live.wait()
    lock_of(out, live.pid)  # now dead
    MetricsLog(str(out), {})
    assert f"[output] {out / LOCK}: its run (pid {live.pid}" in capsys.readouterr().out
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
    release_lock(str(out))
    assert not (out / LOCK).exists()  # (another host's lock: tests/test_writes.py)


@pytest.mark.parametrize("end", ["return", "sys.exit(2)", "raise ValueError", "os.kill(os.getpid(), 9)"])
def test_the_lock_is_given_back_on_every_exit(tmp_path, end):
    """At exit, by an error too; a process killed outright leaves a lock the next run takes over."""
    out = tmp_path / "run"
    code = (f"import os, sys; from rft_core.runs.run_dir import take_lock; take_lock({str(out)!r})\n"
            f"def main():\n    {end}\nmain()")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True)
    assert (out / LOCK).exists() == end.startswith("os.kill")
    check_free(str(out))  # free: nothing held, or held by a dead process
    take_lock(str(out), print)
    release_lock(str(out))


@pytest.mark.slow
def test_a_second_run_into_a_busy_output_dir_is_one_line(tmp_path):
    out = tmp_path / "run"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock_of(out, live.pid, start=_start_ticks(live.pid))
        proc = run_script("train_ppo.py", [*TINY, "--output_dir", str(out)], check=False)
    finally:
        live.kill()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"error: --output_dir {out} is in use by another run (pid {live.pid}" in proc.stderr
    assert sorted(os.listdir(out)) == [LOCK]


# ---- 6: no `latest` ----

def test_without_latest_the_newest_intact_checkpoint_is_found(tmp_path):
    """A missing `latest` with checkpoint-2 and -3 there used to restart at step 1 over them."""
    for step in (2, 3):
        fake_checkpoint(tmp_path, step, {"random_states_0.pkl": os.urandom(64)})
    said = []
    assert latest_checkpoint(str(tmp_path), said.append) == str(tmp_path / "checkpoint-3")
    assert said == [f"[resume] {tmp_path} has no `latest`: checkpoint-3 is its newest intact checkpoint (by "
                    "the manifests)"]
    (tmp_path / "checkpoint-3" / "random_states_0.pkl").write_bytes(os.urandom(64))
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    (tmp_path / "latest").write_text("garbage")
    said = []
    assert latest_checkpoint(str(tmp_path), said.append) == str(tmp_path / "checkpoint-2")
    assert said[0] == f"[resume] {tmp_path / 'latest'} names 'garbage', not a checkpoint: looking for the " \
                      "newest intact one"
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text('{"step": 9}')
    with pytest.raises(CheckpointError, match="holds no intact checkpoint .checkpoint-3 and older ones"):
        latest_checkpoint(str(tmp_path))


# ---- 7: algorithm flags on resume ----

def test_each_resume_keeps_the_values_it_changed_in_config_json(tmp_path, capsys):
    """Changing --advantage_estimator (or any flag) on resume was accepted silently and config.json rewritten:
    now the change is said and config.json keeps, under "resumed", each resume's step and what changed."""
    first = {"advantage_estimator": "group_norm", "actor_learning_rate": 1e-5, "eps_clip_low_high": None,
             "plan": {"loss": {"clip_low": 0.2}, "why": []}}
    MetricsLog(str(tmp_path), first)
    second = {**first, "advantage_estimator": "rloo", "eps_clip_low_high": (0.2, 0.28),
              "plan": {"loss": {"clip_low": 0.3}, "why": []}}
    MetricsLog(str(tmp_path), second, keep_until=2)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["advantage_estimator"] == "rloo"
    assert config["resumed"] == [{"step": 2, "changed": {"advantage_estimator": ["group_norm", "rloo"],
                                                         "eps_clip_low_high": [None, [0.2, 0.28]],
                                                         "plan.loss.clip_low": [0.2, 0.3]}}]
    assert ("[resume] changed since step 2: advantage_estimator 'group_norm' -> 'rloo'; eps_clip_low_high "
            "None -> [0.2, 0.28] (and 1 plan values); config.json keeps the earlier values under \"resumed\""
            in capsys.readouterr().out)
    # an attempt that failed before training (same step) gives way; a later resume adds its own entry
    MetricsLog(str(tmp_path), {**second, "actor_learning_rate": 2e-5}, keep_until=2)
    MetricsLog(str(tmp_path), {**second, "actor_learning_rate": 2e-5}, keep_until=4)
    config = json.loads((tmp_path / "config.json").read_text())
    assert [entry["step"] for entry in config["resumed"]] == [2, 4]
    assert config["resumed"][0]["changed"]["actor_learning_rate"] == [1e-5, 2e-5]
    assert config["resumed"][1]["changed"] == {}
    release_lock(str(tmp_path))


def test_flags_whose_state_is_in_the_checkpoint_join_the_resume_identity(tmp_path):
    """--normalize_reward (its running statistics) and --ema_beta (the EMA weights) change what a checkpoint
    holds: resuming with them changed is refused like a seed (it crashed on None moments, or kept no EMA)."""
    args = SimpleNamespace(seed=0, normalize_reward=False, ema_beta=None, lora_rank=0,
                           advantage_estimator="group_norm")
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(name="NO"), num_processes=1,
                                  state=SimpleNamespace(deepspeed_plugin=None))
    identity = run_identity(args, accelerator)
    ckpt = fake_checkpoint(tmp_path, 1)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "run": identity}))
    changed = run_identity(SimpleNamespace(**{**vars(args), "normalize_reward": True, "ema_beta": 0.99}),
                           accelerator)
    with pytest.raises(CheckpointError, match=r"other settings \(normalize_reward False then, True now; ema "
                                              r"False then, True now\)"):
        check_identity(str(ckpt), changed)


# ---- 9: RNG states ----

def test_rng_states_are_checked_after_loading(tmp_path, accelerator, monkeypatch):
    """Accelerate skips an RNG state that fails to load at info level (the resumed run then diverges): the
    RNG states are compared with the saved ones after load_state, and a mismatch is refused in one line."""
    out = tmp_path / "run"
    torch.manual_seed(3)
    random.seed(3)
    save_checkpoint(accelerator, str(out), 1, {"n": 1}, {"ema": None})
    saved = torch.get_rng_state()
    torch.rand(5), random.random()  # the generators move on
    state, tensors = load_checkpoint(accelerator, str(out / "checkpoint-1"))
    assert state["n"] == 1 and tensors == {"ema": None} and torch.equal(torch.get_rng_state(), saved)
    torch.rand(5), random.random()

    def fails(state):
        raise ValueError("state vector is the wrong size")

    monkeypatch.setattr(random, "setstate", fails)  # inside accelerate's try: every state is skipped
    rng_file = out / "checkpoint-1" / "random_states_0.pkl"
    with pytest.raises(CheckpointError, match=re.escape(f"{rng_file}: the RNG state was not restored "
                                                        "(random_state differs)")):
        load_checkpoint(accelerator, str(out / "checkpoint-1"))


# ---- 12: a full disk ----

def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, accelerator, monkeypatch):
    out = tmp_path / "run"
    save_checkpoint(accelerator, str(out), 1, {"n": 1})
    real_save = accelerator.save_state

    def full(error):
        def save_state(output_dir):
            real_save(output_dir)
            with open(os.path.join(output_dir, "optimizer.bin"), "wb") as f:
                f.write(b"x" * 1000)
            raise error
        return save_state

    for error, free in ((OSError(errno.ENOSPC, "No space left on device"), None),
                        (RuntimeError("basic_ios::clear: iostream error"), 1 << 20)):  # torch's writer
        monkeypatch.setattr(accelerator, "save_state", full(error))
        if free is not None:
            monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: SimpleNamespace(free=free))
        with pytest.raises(CheckpointError) as caught:
            save_checkpoint(accelerator, str(out), 2, {"n": 2})
        said = str(caught.value)
        assert re.fullmatch(rf"no space left on {re.escape(str(out))}: checkpoint-2 needs ~\d+\.\d KiB, "
                            r"[\d.]+ [KMG]iB free; it was not kept and checkpoint-1, the previous "
                            r"checkpoint, is intact: free space there \(or lower --max_ckpt_num\) and rerun "
                            r"the same command to resume from the newest intact checkpoint", said), said
        assert sorted(os.listdir(out)) == ["checkpoint-1", "latest"]
        assert latest_checkpoint(str(out)) == str(out / "checkpoint-1")


def test_a_full_disk_never_leaves_half_a_metrics_row_and_a_cut_one_is_dropped(tmp_path, monkeypatch, capsys):
    import rft_core.runs.integrity

    log = MetricsLog(str(tmp_path))
    log.write(1, {"rollout/reward_mean": 1.0})
    before = (tmp_path / "metrics.jsonl").read_bytes()

    def half_then_full(path, text):
        with open(path, "a") as f:
            f.write(text[:len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rft_core.runs.integrity, "_write", half_then_full)
    with pytest.raises(ConfigError, match=re.escape(f"no space left on {tmp_path} (")) as caught:
        log.write(2, {"rollout/reward_mean": 2.0})
    assert "the row of step 2 could not be appended to" in str(caught.value)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    monkeypatch.undo()
    # a row cut all the same (a kill mid-write): dropped and said when the run resumes
    rows_file(tmp_path / "metrics.jsonl", [1, 2], cut='{"step": 3, "rollout/rew')
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 3, 4)))
    MetricsLog(str(tmp_path), keep_until=3)  # (samples of steps after the checkpoint: logged again)
    assert (tmp_path / "samples.jsonl").read_text() == '{"step": 1}\n{"step": 3}\n'
    assert f"[resume] {tmp_path / 'metrics.jsonl'}: its last line is cut (a write interrupted, e.g. by a " \
           "full disk): dropped" in capsys.readouterr().out
    assert [row["step"] for row in map(json.loads, open(tmp_path / "metrics.jsonl"))] == [0, 1, 2]
    release_lock(str(tmp_path))


# ---- 14: pickles from the output directory ----

class Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_planted_pickle_is_refused_in_one_line(tmp_path, accelerator, monkeypatch):
    """tensors.pt holding an object: with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 torch's default let it run; every
    torch.load of the output directory's files passes weights_only=True, and a refused file is one line."""
    out = tmp_path / "run"
    ckpt = out / "checkpoint-1"
    save_checkpoint(accelerator, str(out), 1, {"n": 1}, {"ema": None})
    marker = tmp_path / "executed"
    torch.save({"ema": None, "rollouts": Planted(str(marker))}, ckpt / "tensors.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointError, match=re.escape(f"{ckpt / 'tensors.pt'} was refused by torch.load("
                                                        "weights_only=True) (it holds more than tensors and "
                                                        "plain data: ")):
        load_checkpoint(accelerator, str(ckpt))
    assert not marker.exists()
    for root, _, names in os.walk(os.path.join(ROOT, "rft_core")):
        for name in [name for name in names if name.endswith(".py")]:
            calls = re.findall(r"torch\.load\(([^)]*)\)", open(os.path.join(root, name)).read())
            assert all("weights_only=True" in call for call in calls), (name, calls)


def test_resume_point_is_the_main_process_answer(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path), no_resume=False, seed=0, lora_rank=0, ema_beta=None,
                           advantage_estimator="group_norm")
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(name="NO"), num_processes=1,
                                  state=SimpleNamespace(deepspeed_plugin=None), is_main_process=True,
                                  print=print)
    fake_checkpoint(tmp_path, 2)
    assert resume_point(args, accelerator)[0] == str(tmp_path / "checkpoint-2")


def test_a_run_with_nothing_to_resume_is_refused_before_any_model_loads(tmp_path):
    """A finished run without checkpoints in --output_dir: resume_point (before the model loads) refuses it,
    naming --no_resume, instead of MetricsLog after the load; with --no_resume it is nothing to resume."""
    args = SimpleNamespace(output_dir=str(tmp_path), no_resume=False, seed=0, lora_rank=0, ema_beta=None,
                           advantage_estimator="group_norm")
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(name="NO"), num_processes=1,
                                  state=SimpleNamespace(deepspeed_plugin=None), is_main_process=True,
                                  print=print)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rollout/reward_mean": 0.5}\n')
    (tmp_path / "model").mkdir()
    with pytest.raises(ConfigError, match="holds a finished run .*pass --no_resume"):
        resume_point(args, accelerator)
    args.no_resume = True
    assert resume_point(args, accelerator)[0] is None


def test_loop_state_saves_and_resumes_every_declared_field(tmp_path):
    """LoopState is the checkpoint's loop state: every field goes out through save and back through load (the
    rollouts through their state_dict and buffer, the reward moments through theirs, the EMA weights as
    tensors, plain values as JSON), so a controller added as a field needs no other edit; a checkpoint from
    before it (the rollouts' entries at the top level) still resumes; EMA off in this run stays off."""
    from dataclasses import dataclass

    from rft_core.advantages import RunningMoments
    from rft_core.runs.checkpoint import LoopState

    class Stream:  # the Rollouts calls LoopState makes
        def __init__(self, drawn=0, buffer=None):
            self.drawn, self.buffer = drawn, buffer

        def state_dict(self):
            return {"batches_drawn": self.drawn}

        def buffer_state(self):
            return {"groups": self.buffer or []}

        def load_state_dict(self, state, buffer=None):
            self.drawn, self.buffer = state["batches_drawn"], buffer["groups"]

    @dataclass
    class WithController(LoopState):
        controller: float = 1.0  # a new field: declared, nothing else

    moments = RunningMoments()
    moments.update([1.0, 3.0])
    ema = [torch.arange(3.0), torch.ones(2, 2)]
    loop = WithController(Stream(7, [{"version": 2}]), {"seed": 0}, 0.05, {"accuracy": 0.4}, moments, ema,
                          controller=0.5)
    state, tensors = loop.save()
    assert json.loads(json.dumps(state)) == state  # trainer_state.json takes it whole
    torch.save(tensors, tmp_path / "tensors.pt")
    restored = WithController(Stream(), None, 0.001, moments=RunningMoments(), ema=[torch.zeros(3)])
    step = restored.load({"step": 4, **state}, torch.load(tmp_path / "tensors.pt", weights_only=True))
    assert step == 4 and restored.controller == 0.5 and restored.kl_coef == 0.05
    assert (restored.rollouts.drawn, restored.rollouts.buffer) == (7, [{"version": 2}])
    assert restored.first_eval == {"accuracy": 0.4} and restored.run == {"seed": 0}
    assert restored.moments.state_dict() == moments.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(restored.ema, ema))
    old = {"step": 3, "batches_drawn": 5, "kl_coef": 0.1, "first_eval": None, "run": None, "moments": None}
    before = LoopState(Stream(), moments=None, ema=None)  # a checkpoint written before LoopState; EMA off
    assert before.load(old, {"ema": ema, "rollouts": {"groups": []}}) == 3
    assert before.rollouts.drawn == 5 and before.kl_coef == 0.1 and before.ema is None
