"""Data that is not what it seems (labels of other types, files of other kinds or encodings, repeated keys),
output directories that cannot be written, a resumed checkpoint with NaN weights, and signals at any moment
of a run: each is one line, or a counted and printed notice, never a traceback or a silent coercion."""

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT

from rft_core.data import load_prompt_rows
from rft_core.errors import CheckpointError, ConfigError, DataError


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


# ---- data ----

def test_labels_that_are_not_text_or_numbers_are_counted_and_named(tmp_path):
    """Lists and objects reach the reward as their JSON (json.loads reads them back), not Python's str()."""
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"prompt": "a", "label": 1}, {"prompt": "b", "label": "x"}, {"prompt": "c", "label": None},
        {"prompt": "d", "label": [1, 2]}, {"prompt": "e", "label": None},
        {"prompt": "f", "label": {"k": "é"}}])
    said = []
    rows, skipped = load_prompt_rows(path, log=said.append)
    assert skipped == 0 and [r["label"] for r in rows] == ["1", "x", "", "[1, 2]", "", '{"k": "é"}']
    assert json.loads(rows[5]["label"]) == {"k": "é"}
    assert said == [f"[data] {path}: 4 'label' values are not text or numbers: null in 2 rows (first: row 2, "
                    "read as ''), list in 1 row (first: row 3, read as '[1, 2]'), object in 1 row (first: "
                    "row 5, read as '{\"k\": \"é\"}'); the reward gets each as text (lists and objects: "
                    "their JSON)"]
    said.clear()  # numbers and text alone: nothing to say
    load_prompt_rows(write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "a", "label": 1},
                                                            {"prompt": "b", "label": "x"}]), log=said.append)
    assert said == []


def test_a_rows_other_columns_travel_with_its_sample(tmp_path):
    """Every column but the prompt, the label and images reaches the Sample (the reward's keyword arguments);
    one named like a reward's own argument, or whose values are not JSON (dates), is named and left out."""
    from rft_core.data import encode_rows

    path = write_jsonl(tmp_path / "rows.jsonl", [
        {"q": "a", "a": "1", "solution": "s0", "meta": {"w": 1}, "tags": ["x"], "info": "i",
         "day": "2024-01-02", "img": "a.png"},
        {"q": "b", "a": "2", "solution": "s1", "meta": {"w": 2}, "tags": [], "info": "j",
         "day": "2024-01-03", "img": "b.png"}])
    said = []
    rows, _ = load_prompt_rows(path, "q", "a", extra_keys={"img": "--images_key"}, log=said.append)
    assert [r["columns"] for r in rows] == [{"solution": "s0", "meta": {"w": 1}, "tags": ["x"]},
                                            {"solution": "s1", "meta": {"w": 2}, "tags": []}]
    assert said == [f"[data] {path}: columns 'info' (string), 'day' (timestamp[s]) do not reach the reward: "
                    "rename one named like a reward argument (prompts, completions, labels, turns, info); "
                    "cast one whose values are not JSON to text"]

    def tokenizer(texts, add_special_tokens):
        return {"input_ids": [[1] * len(t) for t in texts]}
    samples, _ = encode_rows(tokenizer, rows, 8, apply_chat_template=False)
    assert [s.columns for s in samples] == [r["columns"] for r in rows]


def test_a_directory_names_the_files_it_skips(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "label": "x"}])
    (tmp_path / "notes.txt").write_text("not data")
    (tmp_path / "more").mkdir()
    said = []
    rows, _ = load_prompt_rows(str(tmp_path), log=said.append)
    assert len(rows) == 1
    assert said == [f"[data] {tmp_path}: skipped 2 entries that are not .jsonl/.json/.parquet/.arrow files: "
                    "more/, notes.txt"]


@pytest.mark.parametrize("encoding, message", [
    ("latin-1", "line 2 is not UTF-8 (byte 0xe9, the line's byte 16), but JSON files must be UTF-8: "
     "convert it, e.g. for Latin-1 `iconv -f LATIN1 -t UTF-8"),
    ("utf-16", "the file is UTF-16, but JSON files must be UTF-8: convert it, e.g. `iconv -f UTF-16"),  # BOM
    ("utf-16-le", "the file is UTF-16 or UTF-32 (it holds NUL bytes), but JSON files must be UTF-8"),
])
def test_json_lines_that_are_not_utf8_are_one_line_naming_file_and_line(tmp_path, encoding, message):
    path = tmp_path / "train.jsonl"
    text = '{"prompt": "ok", "label": "x"}\n{"prompt": "café", "label": "y"}\n'
    path.write_bytes(text.encode(encoding))
    with pytest.raises(DataError) as caught:
        load_prompt_rows(str(path))
    assert str(caught.value).startswith(f"--prompt_data {str(path)!r}: {message}"), str(caught.value)
    path.write_bytes(text.encode("utf-8-sig"))  # UTF-8 with a byte-order mark reads
    assert [r["prompt"] for r in load_prompt_rows(str(path))[0]] == ["ok", "café"]


def test_a_repeated_key_is_named_with_its_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "label": "x"}\n{"prompt": "b", "label": "y", "label": "z"}\n')
    with pytest.raises(DataError) as caught:
        load_prompt_rows(str(path))
    assert str(caught.value) == (f"--prompt_data {str(path)!r}: line 2: the key 'label' appears twice in one "
                                 "object (datasets cannot read such a line): keep one")


# ---- the output directory ----

def test_an_output_dir_that_leads_nowhere_or_into_proc_is_refused(tmp_path):
    from rft_core.runs.checks import check_output_dir

    (tmp_path / "link").symlink_to(tmp_path / "gone" / "deeper")
    for path in (tmp_path / "link", tmp_path / "link" / "run"):
        with pytest.raises(ConfigError) as caught:
            check_output_dir(str(path))
        assert str(caught.value) == (f"--output_dir {str(path)!r}: {tmp_path / 'link'} is a symbolic link to "
                                     f"{tmp_path / 'gone' / 'deeper'}, which does not exist; create that or "
                                     "pass another folder")
    if os.path.isdir("/proc/self"):  # a folder that takes no files, whatever its permissions say
        with pytest.raises(ConfigError, match="'/proc/rft/run': files cannot be created in /proc "):
            check_output_dir("/proc/rft/run")
    check_output_dir(str(tmp_path / "new" / "run"))  # to be made: fine, and nothing is left behind
    assert sorted(os.listdir(tmp_path)) == ["link"]


# ---- a resumed checkpoint ----

class OneProcess:
    device = "cpu"

    def reduce(self, tensor, op):
        return tensor


def test_nan_weights_in_a_resumed_checkpoint_are_one_line(tmp_path):
    from rft_core.runs.health import check_resumed_weights

    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
    model = torch.nn.Linear(2, 2)
    check_resumed_weights([model], str(tmp_path / "checkpoint-4"), OneProcess())  # finite: nothing
    with torch.no_grad():
        model.weight[0, 1] = float("nan")
    with pytest.raises(CheckpointError) as caught:
        check_resumed_weights([model], str(tmp_path / "checkpoint-4"), OneProcess())
    assert str(caught.value) == (f"{tmp_path / 'checkpoint-4'}: its weights hold NaN or inf once loaded "
                                 "(weight, on this rank), so it is damaged; delete it to resume from "
                                 "checkpoint-2, or pass --no_resume to start afresh")
    with pytest.raises(CheckpointError, match="pass --no_resume to start afresh .there is no older"):
        check_resumed_weights([model], str(tmp_path / "checkpoint-2"), OneProcess())


# ---- signals ----

@pytest.fixture
def own_handlers():
    """The test's signal handlers are undone after it."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    import faulthandler
    faulthandler.unregister(signal.SIGUSR1)


def flags(tmp_path, **kw):
    return SimpleNamespace(**{"output_dir": str(tmp_path), "save_steps": 0, "no_resume": False, **kw})


def intact_checkpoint(output_dir, step):
    ckpt = output_dir / f"checkpoint-{step}"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
    (output_dir / "latest").write_text(ckpt.name)


def test_a_signal_during_start_up_stops_at_once_in_one_line(tmp_path, own_handlers, capfd):
    from rft_core.runs.run import StopNow, StopSignals, run_main

    StopSignals(flags(tmp_path), at_once=True)
    with pytest.raises(StopNow) as caught:
        signal.raise_signal(signal.SIGTERM)
    assert caught.value.exit_code == 143
    assert str(caught.value) == ("SIGTERM during start-up, before any step ran; no checkpoint (--save_steps "
                                 "0): a rerun starts afresh")
    intact_checkpoint(tmp_path, 3)  # a resuming run: the checkpoint it resumes from is named

    def main():  # as the scripts' main: interrupted while it loads
        StopSignals(flags(tmp_path, save_steps=3), at_once=True)
        signal.raise_signal(signal.SIGINT)

    with pytest.raises(SystemExit) as exited:
        run_main(main)
    assert exited.value.code == 130
    assert capfd.readouterr().err == ("stopped: SIGINT during start-up, before any step ran; checkpoint-3 "
                                      "is intact; rerun the same command to resume from it\n")


def test_ctrl_c_twice_names_the_checkpoint_only_if_there_is_one(tmp_path, own_handlers, capfd):
    from rft_core.runs.run import StopNow, StopSignals

    stops = StopSignals(flags(tmp_path, save_steps=2))
    signal.raise_signal(signal.SIGINT)  # the first: at the end of the step
    assert stops.requested() == "SIGINT" and "stopping after this step" in capfd.readouterr().err
    with pytest.raises(StopNow) as caught:  # the second, while the first checkpoint is written
        signal.raise_signal(signal.SIGINT)
    assert str(caught.value) == (f"SIGINT twice: stopped inside a step; no checkpoint (none complete in "
                                 f"{tmp_path}): a rerun starts afresh")
    intact_checkpoint(tmp_path, 2)
    with pytest.raises(StopNow, match="SIGINT twice: stopped inside a step; checkpoint-2 is intact; rerun "
                                      "the same command to resume from it"):
        signal.raise_signal(signal.SIGINT)


def test_a_stop_says_why_there_is_no_checkpoint(tmp_path):
    from rft_core.runs.run import stop_error

    said = lambda signal_name, step, **kw: str(stop_error(signal_name, step, flags(tmp_path, **kw)))  # noqa
    assert said("SIGTERM", 3, save_steps=5) == (
        "SIGTERM after step 3: no checkpoint (--save_steps 5: the first comes after step 5): a rerun starts "
        "afresh")
    assert said("SIGINT", 3) == "SIGINT after step 3: no checkpoint (--save_steps 0): a rerun starts afresh"
    intact_checkpoint(tmp_path, 2)
    assert said("SIGINT", 3, save_steps=2, no_resume=True) == (
        "SIGINT after step 3: checkpoint-2 is intact; rerun without --no_resume to resume from it")
    assert stop_error("SIGTERM", 3, flags(tmp_path)).exit_code == 143


@pytest.mark.slow
def test_sigterm_in_the_step0_eval_of_a_run_is_one_line(tiny_model_dir, tmp_path):
    """The script itself: SIGTERM once start-up is done, during the step-0 eval (it used to kill the process
    without a word). The reward's first call is the eval's: it leaves a mark and waits there, so the signal
    lands inside the eval however fast the machine is."""
    out, mark = tmp_path / "out", tmp_path / "in_eval"
    reward = tmp_path / "slow_first.py"
    reward.write_text(
        "import os, time\n"
        "def chars(p, completions, l, **kw):\n"
        f"    if not os.path.exists({str(mark)!r}):\n"
        f"        open({str(mark)!r}, 'w').close()\n"
        "        time.sleep(5)\n"
        "    return [len(c) / 10 for c in completions]\n")
    args = ["--pretrain", tiny_model_dir, "--max_steps", "2", "--rollout_batch_size", "2",
            "--n_samples_per_prompt", "2", "--generate_max_len", "8", "--reward_fn", f"{reward}:chars",
            "--output_dir", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_ppo.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    for line in proc.stdout:
        assert time.time() < deadline, "no [setup] line"
        if line.startswith("[setup]"):  # printed just before the step-0 eval
            break
    while not mark.exists():
        assert time.time() < deadline and proc.poll() is None, "the step-0 eval never called the reward"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output = proc.stdout.read()
    assert proc.wait(timeout=120) == 143, output[-2000:]
    assert "Traceback" not in output and output.rstrip().endswith(
        "stopped: SIGTERM during start-up, before any step ran; no checkpoint (--save_steps 0): a rerun "
        "starts afresh"), output[-2000:]
    assert not list(out.glob("checkpoint-*"))
