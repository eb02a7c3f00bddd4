"""Writes a kill cannot cut (issue 62): the metrics rewrite at resume, the export, the move of a previous run
aside are each written aside and renamed, and what a killed writer left is cleaned at the next start; a run is
finished only once its export is whole; another host's lock is judged by its heartbeat, never by its clock; a
full disk under torch.save and under the export is one line; credentials are never written nor printed."""

import contextlib
import json
import os
import re
import resource
import stat
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, read_metrics, run_script
from test_checkpoints import fake_checkpoint, snapshot

import rft_core.runs.run_dir as run_dir
from rft_core.errors import CheckpointError, ConfigError
from rft_core.runs.checkpoint import finished_run, latest_checkpoint, save_checkpoint
from rft_core.runs.metrics import MetricsLog
from rft_core.runs.run_dir import LOCK, check_free, redact, release_lock, take_lock

URL = "http://alice:s3cret@rm.example:5000/reward?key=k3y&token=t0ken"
SECRETS = ("s3cret", "k3y", "t0ken")


def rows_file(path, steps):
    lines = [json.dumps({"step": 0, "eval/reward_mean": 0.5})]
    lines += [json.dumps({"step": s, "rollout/reward_mean": 1.0, "train/policy_loss": 0.1}) for s in steps]
    path.write_text("\n".join(lines) + "\n")


@contextlib.contextmanager
def file_size_limit(size):
    """Writes past `size` bytes of a file fail midway (EFBIG: Python ignores SIGXFSZ), where a kill would
    have stopped them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# ---- a kill cuts no file: rewrites, exports and moves aside, then renamed ----

def test_a_write_cut_while_metrics_jsonl_is_cut_back_at_resume_loses_no_row(tmp_path, capsys):
    """A resume keeps the rows up to its checkpoint by rewriting metrics.jsonl: it was truncated, then
    written, so a kill in between lost the earlier rows. Now written aside and renamed; the rerun removes the
    half-written copy and keeps them."""
    rows_file(tmp_path / "metrics.jsonl", range(1, 2001))  # ~130 kB
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with file_size_limit(20_000), pytest.raises(ConfigError, match="could not be written"):
        MetricsLog(str(tmp_path), {"seed": 0}, keep_until=1500)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    release_lock(str(tmp_path))
    MetricsLog(str(tmp_path), {"seed": 0}, keep_until=1500)
    assert (f"[output] {tmp_path}: removed what a killed run left half-written: metrics.jsonl.tmp"
            in capsys.readouterr().out)
    assert [row["step"] for row in map(json.loads, open(tmp_path / "metrics.jsonl"))] == list(range(1501))
    release_lock(str(tmp_path))


class Model(torch.nn.Linear):
    """What export_hf asks of a model: a transformers model's save_pretrained (written whole by torch)."""

    def __init__(self):
        super().__init__(64, 64)

    def save_pretrained(self, path, state_dict=None):
        torch.save(self.state_dict() if state_dict is None else state_dict, os.path.join(path, "model.pt"))


class Tokenizer:
    """What export_hf asks of a tokenizer; with die, the process 'dies' writing it (after the weights)."""

    def __init__(self, die=False):
        self.die = die

    def save_pretrained(self, path):
        if self.die:
            raise KeyboardInterrupt("killed")
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write("{}")


def test_an_export_cut_midway_leaves_the_previous_one_or_none_and_a_rerun_exports_again(tmp_path, capsys):
    """A kill during the final export left model/ half written (weights, no tokenizer) and the rerun said the
    run was finished. Now model/ appears whole or not at all, the half-written copy is removed at the next
    start, and a checkpoint of the last step without a whole export is resumed to export it again."""
    from rft_core.models import export_hf

    out = tmp_path / "run"
    model = Model()
    with pytest.raises(KeyboardInterrupt):
        export_hf(model, Tokenizer(die=True), str(out / "model"))
    assert not (out / "model").exists()
    export_hf(model, Tokenizer(), str(out / "hf-step-2"))  # (--save_hf_steps: the same writer)
    before = snapshot(out / "hf-step-2")
    with pytest.raises(KeyboardInterrupt):
        export_hf(model, Tokenizer(die=True), str(out / "hf-step-2"))  # over an older one: kept
    assert snapshot(out / "hf-step-2") == before and "tokenizer.json" in before

    ckpt = fake_checkpoint(out, 2)
    said = []
    assert not finished_run(str(ckpt), 2, said.append)
    assert said == [f"[resume] {ckpt} is step 2 of 2, but the run's model was not exported whole (it was "
                    "stopped while writing it): exporting it again"]
    check_free(str(out))  # the next start
    said = capsys.readouterr().out
    assert "removed what a killed run left half-written: hf-step-2.tmp/, model.tmp/" in said
    log = MetricsLog(str(out), {}, keep_until=2)
    export_hf(model, Tokenizer(), str(out / "model"))
    log.finished(2)
    said = []
    assert finished_run(str(ckpt), 2, said.append) and said[0].startswith(f"[done] {ckpt} is step 2 of 2")
    release_lock(str(out))


def test_leftovers_of_a_dead_writer_are_removed_at_the_next_start(tmp_path, accelerator, capsys):
    """A save killed midway left checkpoint-N.tmp/ until the next save of that step; an export's or a
    rewrite's temporary stayed for ever. The next start removes them, in one
    line, and leaves the run's own files alone."""
    out = tmp_path / "run"
    save_checkpoint(accelerator, str(out), 1, {"n": 1})
    rows_file(out / "metrics.jsonl", [1])
    kept = snapshot(out)
    for name in ("checkpoint-2.tmp", "model.tmp", "model.old", "hf-step-2.tmp"):
        (out / name).mkdir()
        (out / name / "model.safetensors").write_bytes(b"half")
    for name in ("config.json.tmp", "latest.tmp", "curves.png.tmp"):
        (out / name).write_text("half")
    check_free(str(out))  # before anything loads
    assert snapshot(out) == kept
    assert (f"[output] {out}: removed what a killed run left half-written: checkpoint-2.tmp/, "
            "config.json.tmp, curves.png.tmp, hf-step-2.tmp/, latest.tmp, model.old/, model.tmp/\n"
            in capsys.readouterr().out)
    assert latest_checkpoint(str(out)) == str(out / "checkpoint-1")


@pytest.fixture
def accelerator():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    acc.prepare(torch.nn.Linear(4, 4))
    return acc


def test_a_no_resume_cut_while_moving_the_previous_run_aside_never_splits_it(tmp_path, monkeypatch, capsys):
    """--no_resume killed while it moved the previous run into previous-1/ left that run split between the top
    level and previous-1/, and the rerun moved the rest into previous-2/. Now the entries go into
    previous-1.tmp/, renamed when all are there; the next start moves a cut move's entries back, and the
    rerun moves the run whole."""
    out = tmp_path / "run"
    fake_checkpoint(out, 2)
    (out / "latest").write_text("checkpoint-2")
    (out / "config.json").write_text('{"seed": 0}')
    rows_file(out / "metrics.jsonl", [1, 2])
    before = snapshot(out)
    rename, moved = os.rename, []

    def killed_at_the_third(src, dst):
        if len(moved) == 2:
            raise KeyboardInterrupt("killed")
        moved.append(src)
        rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        MetricsLog(str(out), {"no_resume": True})
    monkeypatch.undo()
    assert len(moved) == 2 and not (out / "previous-1").exists()
    check_free(str(out))  # the next start: the old layout back
    assert snapshot(out) == before
    assert (f"[output] {out}/previous-1.tmp/: a --no_resume stopped while moving the previous run aside; its "
            f"files are back in {out}" in capsys.readouterr().out)
    MetricsLog(str(out), {"no_resume": True})
    assert snapshot(out / "previous-1") == before and not (out / "previous-2").exists()
    release_lock(str(out))


# ---- another host's lock: judged by its heartbeat, never by comparing clocks ----

BEATER = "import os, sys, time\nwhile True:\n    os.utime(sys.argv[1])\n    time.sleep(0.05)\n"


def remote_lock(out):
    """A lock written by a run on another host, whose clock runs 20 minutes ahead of this one's."""
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK).write_text(json.dumps({"pid": 4242, "host": "another-node", "start": 1, "since":
                                        "2026-01-01 00:20:00", "command": "train_ppo.py --x"}))
    os.utime(out / LOCK, (time.time() + 1200, time.time() + 1200))


def test_another_hosts_lock_is_dead_only_when_its_heartbeat_stops(tmp_path, monkeypatch, capsys):
    """Its lock's age by this host's clock decided: a host whose clock runs 20 minutes ahead took a live run's
    lock as stale and both trained into one directory. Now the lock is watched (on this host's monotonic
    clock): taken over only if it does not change, whatever the clocks say."""
    out = tmp_path / "run"
    remote_lock(out)
    monkeypatch.setattr(run_dir, "WATCH_S", 0.5)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 1200)  # this host's clock runs ahead
    beater = subprocess.Popen([sys.executable, "-c", BEATER, str(out / LOCK)])
    try:
        time.sleep(0.2)
        with pytest.raises(ConfigError, match="in use by another run .pid 4242 on another-node"):
            check_free(str(out))
        with pytest.raises(ConfigError, match="in use by another run .pid 4242 on another-node"):
            take_lock(str(out), print)
    finally:
        beater.kill()
        beater.wait()
    said = capsys.readouterr().out
    assert (f"[output] {out / LOCK} is held by a run of another host (pid 4242 on another-node, since "
            "2026-01-01 00:20:00: train_ppo.py --x): watching its heartbeat for 0.5 s" in said)
    check_free(str(out))  # still now: dead, after one watch
    take_lock(str(out), print)  # (the same still lock: not watched again)
    said = capsys.readouterr().out
    assert said.count("watching its heartbeat") == 1 and "its run (pid 4242 on another-node" in said
    release_lock(str(out))


def test_a_live_runs_own_heartbeat_keeps_its_lock(tmp_path, monkeypatch):
    """The holder's heartbeat thread touches its lock: seen from a host that cannot check its pid, it lives;
    the lock and config.json are the user's alone (mode 0600)."""
    out = tmp_path / "run"
    code = (f"import sys, time; import rft_core.runs.run_dir as d; d.HEARTBEAT_S = 0.05; "
            f"d.take_lock({str(out)!r}); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert stat.S_IMODE(os.stat(out / LOCK).st_mode) == 0o600
        record = json.loads((out / LOCK).read_text())
        (out / LOCK).write_text(json.dumps({**record, "host": "another-node"}))  # as another host sees it
        monkeypatch.setattr(run_dir, "WATCH_S", 0.5)
        with pytest.raises(ConfigError, match="in use by another run"):
            check_free(str(out))
    finally:
        holder.kill()
        holder.wait()


# ---- secrets ----

def test_redact_hides_the_credentials_of_urls():
    assert redact(URL) == "http://***@rm.example:5000/reward?key=***&token=***"
    assert redact({"a": [f"--remote_rm_url {URL} --seed 1"], "b": (3, "x")}) == {
        "a": ["--remote_rm_url http://***@rm.example:5000/reward?key=***&token=*** --seed 1"], "b": (3, "x")}
    assert redact("error: --remote_rm_url 'https://u:p@ss@h/x#f': down") == "error: --remote_rm_url " \
                                                                           "'https://***@h/x#f': down"
    plain = "http://localhost:5000/reward and data/train.jsonl"
    assert redact(plain) == plain and redact(None) is None and redact(0.5) == 0.5


def test_credentials_are_never_written_and_the_records_are_the_users_alone(tmp_path, monkeypatch, capsys):
    """A token in --remote_rm_url was written to config.json and run.lock (world-readable while the run
    lived), and printed in an error's line: now hidden in each, and both files mode 0600."""
    from rft_core.runs.run import run_main

    monkeypatch.setattr(sys, "argv", ["train_ppo.py", "--remote_rm_url", URL])
    MetricsLog(str(tmp_path), {"remote_rm_url": URL, "plan": {"why": [f"scored by {URL}"]}})
    for name in ("config.json", LOCK):
        text = (tmp_path / name).read_text()
        assert "rm.example" in text and not any(secret in text for secret in SECRETS), (name, text)
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
    release_lock(str(tmp_path))

    def main():
        print(f"[reward] --remote_rm_url {URL} failed")
        raise ConfigError(f"--remote_rm_url {URL!r}: unreachable")

    streams = sys.stdout, sys.stderr
    try:
        with pytest.raises(SystemExit):
            run_main(main)
    finally:
        sys.stdout, sys.stderr = streams
    said = capsys.readouterr()
    assert "rm.example" in said.out + said.err and not any(s in said.out + said.err for s in SECRETS)


@pytest.mark.slow
def test_the_trackers_get_no_credentials(tmp_path, monkeypatch):
    """wandb (offline) and TensorBoard keep the run's config, its command line and what it prints: none of
    them with the token."""
    from accelerate import Accelerator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["train_ppo.py", "--remote_rm_url", URL])
    accelerator = Accelerator(cpu=True, log_with=["wandb", "tensorboard"], project_dir=str(tmp_path / "tb"))
    streams = sys.stdout, sys.stderr
    try:
        log = MetricsLog(str(tmp_path / "run"), {"remote_rm_url": URL}, accelerator, trackers=True)
        print(f"[reward] --remote_rm_url {URL} failed")
        log.write(1, {"rollout/reward_mean": 1.0})
        accelerator.end_training()
    finally:
        sys.stdout, sys.stderr = streams
        release_lock(str(tmp_path / "run"))
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any("wandb" in str(p) for p in files) and any("tfevents" in p.name for p in files)
    assert [p for p in files if any(s.encode() in p.read_bytes() for s in SECRETS)] == []


# ---- a full disk under torch.save and under the export ----

def test_a_full_disk_under_torch_save_is_one_line_with_the_size_needed(tmp_path, accelerator, monkeypatch):
    """torch.save to a path loses the disk's errno (`iostream error`): a full quota, with space left on the
    disk, ended in a traceback, and the size said was the previous checkpoint's. Now tensors.pt goes
    through a Python file (ENOSPC kept) and the size counts its tensors."""
    out = tmp_path / "run"
    save_checkpoint(accelerator, str(out), 1, {"n": 1}, {"ema": [torch.zeros(4)]})
    real_save = accelerator.save_state

    def then_full(output_dir):  # tensors.pt lands on a full device
        real_save(output_dir)
        os.symlink("/dev/full", os.path.join(output_dir, "tensors.pt"))

    monkeypatch.setattr(accelerator, "save_state", then_full)
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(accelerator, str(out), 2, {"n": 2}, {"ema": [torch.zeros(1 << 20)]})
    assert re.match(rf"no space left on {re.escape(str(out))}: checkpoint-2 needs ~4\.\d MiB, [\d.]+ [KMG]iB "
                    "free; it was not kept and checkpoint-1, the previous checkpoint, is intact",
                    str(caught.value)), str(caught.value)
    assert sorted(os.listdir(out)) == ["checkpoint-1", "latest"]


def test_a_full_disk_under_the_export_is_one_line_and_keeps_the_previous_export(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from rft_core.models import export_hf

    model = Model()
    export_hf(model, Tokenizer(), str(tmp_path / "model"))
    before = snapshot(tmp_path / "model")

    def full(path, **kwargs):
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.write(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(model, "save_pretrained", full)
    with pytest.raises(CheckpointError, match=re.escape(f"no space left on {tmp_path} (")) as caught:
        export_hf(model, Tokenizer(), str(tmp_path / "model"))
    assert re.search(r"free\): model/ \(~[\d.]+ KiB\) could not be written there, and what was there before "
                     "is as it was: free space there", str(caught.value)), str(caught.value)
    assert snapshot(tmp_path / "model") == before and sorted(os.listdir(tmp_path)) == ["model"]


@pytest.mark.slow  # (matplotlib's import)
def test_plots_are_written_aside(tmp_path, monkeypatch):
    """A kill while a plot was written left half a PNG: now the old one stays until the new one is whole."""
    from matplotlib.figure import Figure

    from rft_core.runs.plots import write_plots

    rows_file(tmp_path / "metrics.jsonl", [1, 2])
    (tmp_path / "curves.png").write_bytes(b"\x89PNG the last step's")

    def cut(self, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\x89PNG half")
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(Figure, "savefig", cut)
    with pytest.raises(KeyboardInterrupt):
        write_plots(str(tmp_path), [3, 5], 8)
    assert (tmp_path / "curves.png").read_bytes() == b"\x89PNG the last step's"


# ---- end to end: a kill during the final export ----

@pytest.mark.slow
def test_a_rerun_after_an_export_cut_by_a_kill_exports_again(tiny_model_dir, tmp_path):
    """The state a kill during the final export leaves (the last step's checkpoint complete, model/ not yet
    in place): the same command said the run was finished, with no model. Now it loads that checkpoint and
    exports, and the record keeps each step once."""
    out = tmp_path / "run"
    args = ["--pretrain", tiny_model_dir, "--max_steps", "2", "--save_steps", "2", "--rollout_batch_size",
            "2", "--n_samples_per_prompt", "2", "--micro_train_batch_size", "2", "--micro_rollout_batch_size",
            "4", "--generate_max_len", "8", "--output_dir", str(out)]
    run_script("train_ppo.py", args)
    assert json.loads((out / "finished.json").read_text()) == {"step": 2}
    rows = (out / "metrics.jsonl").read_bytes()
    os.remove(out / "finished.json")
    os.rename(out / "model", out / "model.tmp")  # killed before its rename
    os.remove(next((out / "model.tmp").glob("*.safetensors")))
    said = run_script("train_ppo.py", args).stdout
    assert f"[resume] {out}/checkpoint-2 is step 2 of 2, but the run's model was not exported whole" in said
    assert "removed what a killed run left half-written: model.tmp/" in said
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(out / "model")
    assert (out / "metrics.jsonl").read_bytes() == rows and not (out / "model.tmp").exists()
    steps, evals = read_metrics(str(out))
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    assert json.loads((out / "finished.json").read_text()) == {"step": 2}  # (a rerun: [done])
