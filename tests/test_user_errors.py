"""Nothing lost, nothing silent: every mistake a user can make with flags, data, rewards and checkpoints ends
in one line naming the fix (or a counted, printed skip), a diverging run stops before its bad update is saved,
a failed start leaves output_dir as it was, and SIGINT / SIGTERM stop at a step boundary."""

import http.server
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch
from conftest import ROOT, read_metrics, run_script

from rft_core.errors import UserError

TINY = ["--max_steps", "2", "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
        "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4", "--generate_max_len", "8"]


def run(args, **kwargs):
    return run_script("train_ppo.py", args, **kwargs)


def main_raises(monkeypatch, script, args, match):
    """Run script.main() in-process (the checks come before any model loads) and expect a UserError."""
    module = __import__(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    with pytest.raises(UserError, match=match) as caught:
        module.main()
    return str(caught.value)


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "0"], "--temperature 0.0: must be > 0 (0 would sample greedily"),
    (["--temperature", "-1"], "--temperature -1.0: must be > 0"),
    (["--actor_learning_rate", "-1"], "--actor_learning_rate -1.0: must be in (0, 1)"),
    (["--actor_learning_rate", "1e3"], "--actor_learning_rate 1000.0: must be in (0, 1)"),
    (["--top_p", "0"], "--top_p 0.0: must be in (0, 1]"),
    (["--eps_clip", "-0.2"], "--eps_clip [-0.2]: must be one value in (0, 1)"),
    (["--generate_max_len", "0"], "--generate_max_len 0: must be >= 1"),
    (["--max_steps", "0"], "--max_steps 0: must be >= 1"),
    # the flag given, not --train_batch_size, whose default (rollout x samples) it makes 0
    (["--n_samples_per_prompt", "0"], "--n_samples_per_prompt 0: must be >= 1"),
    (["--rollout_batch_size", "0"], "--rollout_batch_size 0: must be >= 1"),
    (["--engine_tp_size", "3"],
     "--engine_tp_size 3: it sets the vLLM / SGLang engine, but this run uses the transformers"),
    (["--loss_agg_mode", "mean"], "--loss_agg_mode 'mean': choose one of"),
    (["--advantage_estimator", "ppo"], "--advantage_estimator 'ppo': choose one of"),
    (["--n_samples_per_prompt", "1"],
     "--n_samples_per_prompt 1 with group_norm: the group baseline is the sample"),
    (["--kl_target", "0.1"], "--kl_target 0.1: it adapts the KL penalty in the reward"),
    (["--gamma", "0.9"], "--gamma 0.9: it discounts the token-level estimators"),
    (["--freezing_actor_steps", "1"], "--freezing_actor_steps 1: it is the critic's"),
    (["--max_num_gen_batches", "5"],
     "--max_num_gen_batches 5: it bounds the rounds of --dynamic_sampling and"),
    (["--max_token_budget", "16"], "--max_token_budget 16: --partial_rollout is off"),
    (["--partial_rollout", "--max_token_budget", "0"], "--max_token_budget 0: must be >= 1"),
    (["--partial_rollout", "--max_staleness", "-1"], "--max_staleness -1: must be >= 0"),
    (["--partial_rollout", "--inflight_ratio", "0.5"], "--inflight_ratio 0.5: must be >= 1"),
    (["--inflight_ratio", "2"], "--inflight_ratio 2.0: --partial_rollout is off"),
    (["--tis_mode", "mask"], "--tis_mode mask: --tis_cap is off"),
    (["--tis_cap", "2", "--tis_mode", "clip"], "--tis_mode 'clip': choose one of ('truncate', 'mask')"),
    (["--tis_level", "sequence"], "--tis_level sequence: --tis_cap is off"),
    (["--tis_cap", "2", "--tis_level", "seq"], "--tis_level 'seq': choose one of ('token', 'sequence', "),
    (["--eps_clip", "0.2", "0.28", "0.3"], "--eps_clip [0.2, 0.28, 0.3]: must be one value in (0, 1)"),
    (["--dual_clip", "0.5"], "--dual_clip 0.5: must be > 1"),
    (["--reward_weights", "1", "2"], "--reward_weights has 2 values for 1 reward sources"),
    (["--train_batch_size", "3"], "must be a multiple of --train_batch_size 3"),
    (["--micro_train_batch_size", "3"], "must be a multiple of --micro_train_batch_size 3"),
    (["--high_entropy_token_ratio", "1.5"], "--high_entropy_token_ratio 1.5: must be in [0, 1]"),
    (["--ema_beta", "0.9", "--lora_rank", "4"], "--ema_beta is not supported with --lora_rank"),
    (["--overlong_buffer_len", "8"], "--overlong_buffer_len 8: must be below --generate_max_len 8"),
    (["--engine_sleep", "sometimes"], "--engine_sleep 'sometimes': choose auto, always or never"),
    (["--max_tokens_per_micro_batch", "100"],
     "--max_tokens_per_micro_batch 100: --micro_train_batch_size sets"),
    (["--micro_train_batch_size", "0"], "--micro_train_batch_size 0: must be >= 1"),
    (["--chunk_size", "-1"], "--chunk_size -1: must be >= 0"),
    (["--policy_loss_type", "ppo2"], "--policy_loss_type 'ppo2': choose one of ('ppo', 'gspo', 'cpg')"),
    (["--reward_failure_limit", "-0.5"], "--reward_failure_limit -0.5: must be >= 0"),
    (["--reward_fallback", "nan"], "--reward_fallback nan: must be a finite number"),
    (["--max_norm", "inf"], "--max_norm inf: must be a finite number"),
    (["--reward_weights", "1", "inf"], "--reward_weights [1.0, inf]: must be a finite number"),
    (["--seed", "-1"], "--seed -1: must be in [0, 2**32), numpy's seeds"),
    (["--seed", str(2**32)], f"--seed {2**32}: must be in [0, 2**32), numpy's seeds"),
    (["--prompt_data", ""], "--prompt_data '': empty; give it a value or leave the flag out"),
    # (it was taken for no URL: the built-in rule scored the run)
    (["--remote_rm_url", ""], "--remote_rm_url '': empty; give it a value or leave the flag out"),
    (["--use_kl_loss", "--init_kl_coef", "0"], "--use_kl_loss with --init_kl_coef 0: the loss weighs"),
    (["--eval_steps", "50"], "--eval_steps 50: past --max_steps 2, so no periodic eval would run"),
    (["--lora_rank", "4", "--target_modules", ","], "--target_modules ',': name the modules"),
])
def test_bad_flags_are_refused_before_anything_loads(tmp_path, monkeypatch, extra, message):
    main_raises(monkeypatch, "train_ppo", ["--pretrain", "/not/loaded", *TINY, *extra, "--output_dir",
                                           str(tmp_path)], re.escape(message))
    assert not os.listdir(tmp_path)  # refused before anything was written


@pytest.mark.parametrize("script", ["train_ppo", "train_ppo_vl"])
def test_every_numeric_flag_is_checked(script):
    """Every int and float flag has its range in the checks' tables (a new flag without one fails here), and
    NaN and inf are refused for every float flag, whatever its range."""
    import dataclasses
    import importlib
    import typing

    from rft_core.runs import checks

    Args = importlib.import_module(script).Args
    hints, numeric = typing.get_type_hints(Args), []
    for f in dataclasses.fields(Args):
        kind = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        many = typing.get_origin(kind[0]) is tuple  # Tuple[float, ...]: --name A B ...
        kind = typing.get_args(kind[0])[0] if many else kind[0]
        if kind in (int, float):
            numeric.append((f.name, kind, many))
    tables = {*checks.RANGES, *checks.AT_LEAST_ONE, *checks.AT_LEAST_ZERO, *checks.ANY_FINITE}
    assert [name for name, *_ in numeric if name not in tables] == []
    for name, kind, many in numeric:
        for bad in (math.nan, math.inf) if kind is float else ():
            with pytest.raises(UserError, match=f"--{name} .*: must be a finite number"):
                checks.check_values(replace(Args(), **{name: [1.0, bad] if many else bad}))


def test_vl_script_checks_the_same_flags(tmp_path, monkeypatch):
    main_raises(monkeypatch, "train_ppo_vl", ["--temperature", "0", "--output_dir", str(tmp_path)],
                re.escape("--temperature 0.0: must be > 0"))
    main_raises(monkeypatch, "train_ppo_vl", ["--image_max_pixels", "100", "--output_dir", str(tmp_path)],
                re.escape("--image_max_pixels 100: must be >= 784"))


@pytest.mark.slow
def test_a_user_error_is_one_line_without_traceback(tmp_path):
    proc = run(["--temperature", "0", "--output_dir", str(tmp_path)], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "[WARNING]" not in line]
    assert lines == ["error: --temperature 0.0: must be > 0 (0 would sample greedily: a group's samples "
                     "alike, no signal)"]
    proc = run(["--temperature", "0", "--output_dir", str(tmp_path)], check=False, env={"RFT_DEBUG": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr


def test_cuda_out_of_memory_is_one_line_naming_the_flags(monkeypatch, capsys):
    """An out-of-memory error the memory plan did not foresee (seen: ZeRO-3's optimizer step, 3B shape, one
    H100) ends with one line: what torch tried and had free, and the flags that make room; RFT_DEBUG=1 keeps
    the traceback."""
    from rft_core.runs.run import run_main

    def main():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.74 GiB. GPU 0 has a total "
                                     "capacity of 79.18 GiB of which 3.20 GiB is free. Process 1558 has ...")

    monkeypatch.setattr(sys, "argv", ["train_ppo.py"])
    monkeypatch.delenv("RFT_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stop:
        run_main(main)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and line.startswith(
        "error: CUDA out of memory. Tried to allocate 3.74 GiB. GPU 0 has a total capacity of 79.18 GiB of "
        "which 3.20 GiB is free: make room with --optimizer_offload")
    monkeypatch.setenv("RFT_DEBUG", "1")
    with pytest.raises(torch.OutOfMemoryError):
        run_main(main)


# ---- data ----

@pytest.mark.parametrize("content, message", [
    ("", "the file is empty"),
    ("\n  \n", "the file is empty"),
    ('{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": "2"}\n{"prompt": "c", label: 3}\n',
     "line 3 is not valid JSON"),
])
def test_bad_data_files_name_file_and_line(tmp_path, monkeypatch, tiny_model_dir, content, message):
    path = tmp_path / "train.jsonl"
    path.write_text(content)
    text = main_raises(monkeypatch, "train_ppo", ["--pretrain", tiny_model_dir, *TINY, "--prompt_data",
                                                  str(path), "--output_dir", str(tmp_path / "out")],
                       re.escape(message))
    assert "--prompt_data" in text and "train.jsonl" in text


def test_unusable_rows_are_counted_and_the_first_named(tmp_path):
    from rft_core.data import load_prompt_rows

    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "label": "x"}) for p in ["ok", 5, "", "fine"]))
    said = []
    rows, skipped = load_prompt_rows(str(path), log=said.append)
    assert skipped == 2 and len(rows) == 2
    assert said == [f"[data] {path}: skipped 2 rows whose 'prompt' is empty or malformed "
                    "(first: row 1, int '5')"]


def test_bad_model_paths(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    main_raises(monkeypatch, "train_ppo", ["--pretrain", str(tmp_path / "empty"), *TINY,
                                           "--output_dir", str(tmp_path / "a")], "no config.json there")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    main_raises(monkeypatch, "train_ppo", ["--pretrain", str(tmp_path / "odd"), *TINY,
                                           "--output_dir", str(tmp_path / "b")],
                "model type 'no_such_model' is not one transformers")
    # a config without weights, then weights without a tokenizer (the loaders' own errors blamed
    # sentencepiece / tiktoken)
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text(json.dumps({"model_type": "llama"}))
    main_raises(monkeypatch, "train_ppo", ["--pretrain", str(half), *TINY, "--output_dir",
                                           str(tmp_path / "c")], "config.json but no weights")
    (half / "model.safetensors").write_bytes(b"")
    main_raises(monkeypatch, "train_ppo", ["--pretrain", str(half), *TINY, "--output_dir",
                                           str(tmp_path / "d")], "no tokenizer there")


def test_a_reward_file_that_fails_to_load_is_one_line(tmp_path):
    """A --reward_fn file with a syntax error, or one whose imports fail: one line naming the file, the line
    and the error (the traceback went through importlib's frames)."""
    from rft_core.errors import ConfigError
    from rft_core.reward_sources import load_reward_fn

    (tmp_path / "syntax.py").write_text("def f(prompts, completions, labels:\n    return 1\n")
    (tmp_path / "imports.py").write_text("import os\nimport no_such_package_here\n")
    with pytest.raises(ConfigError, match=re.escape(f"loading {tmp_path / 'syntax.py'} failed (line 1): "
                                                    "SyntaxError: '(' was never closed")):
        load_reward_fn(f"{tmp_path / 'syntax.py'}:f")
    with pytest.raises(ConfigError, match=re.escape(f"loading {tmp_path / 'imports.py'} failed (line 2): "
                                                    "ModuleNotFoundError: No module named")):
        load_reward_fn(f"{tmp_path / 'imports.py'}:f")


def test_an_output_dir_that_cannot_be_written_is_refused_first(tmp_path, monkeypatch):
    """--output_dir where a file is (or under one): one line before anything loads (it was a makedirs
    traceback once the model had loaded)."""
    (tmp_path / "a_file").write_text("")
    for path in (tmp_path / "a_file", tmp_path / "a_file" / "run"):
        main_raises(monkeypatch, "train_ppo", [*TINY, "--output_dir", str(path)],
                    re.escape(f"--output_dir '{path}': {tmp_path / 'a_file'} is a file; pass a folder"))


def test_an_output_dir_that_holds_or_is_held_by_an_input_is_refused(tmp_path, monkeypatch):
    """--output_dir equal to, inside or around the model, a data file, the reward or the env file (real paths:
    through a symbolic link too) is one line before anything loads or is written: the run's config.json once
    overwrote a --pretrain model's, which then no longer loaded."""
    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir()
    data.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))  # enough: nothing loads
    (data / "train.jsonl").write_text('{"prompt": "1 + 1", "label": "2"}\n')
    (data / "rw.py").write_text("def chars(p, completions, l, **kw):\n    return [1.0] * len(completions)\n")
    (data / "env.py").write_text("class Env:\n    def step(self, state, text):\n        return None\n")
    os.symlink(model, tmp_path / "link")
    before = sorted(os.walk(tmp_path))
    for extra, out, how in [
            ([], model, "is --pretrain"), ([], model / "run", "is inside --pretrain"),
            ([], tmp_path, "holds --pretrain"), ([], tmp_path / "link", "is --pretrain"),
            (["--prompt_data", str(data / "train.jsonl")], data, "holds --prompt_data"),
            (["--eval_data", str(data)], data / "run", "is inside --eval_data"),
            (["--reward_fn", f"{data / 'rw.py'}:chars"], data, "holds --reward_fn"),
            (["--env", f"{data / 'env.py'}:Env"], data, "holds --env")]:
        main_raises(monkeypatch, "train_ppo", ["--pretrain", str(model), *TINY, *extra, "--output_dir",
                                               str(out)], re.escape(f"--output_dir '{out}' {how}"))
    assert sorted(os.walk(tmp_path)) == before  # nothing written


def test_paths_too_long_for_the_filesystem_are_one_line(tmp_path, monkeypatch):
    """A name over NAME_MAX (255 bytes) or a path over PATH_MAX (4096) in a path flag: one line before
    anything loads, not an OSError traceback once the run reaches the path (or a "no such file")."""
    name, deep = "x" * 300, os.path.join(str(tmp_path), *["d" * 200] * 25)
    for flag, path, message in [
            ("--output_dir", str(tmp_path / name), "it holds a name of 300 bytes, over the filesystem's "
             "limit of 255 (NAME_MAX); shorten it"),
            ("--output_dir", deep, f"{len(deep)} bytes, over the filesystem's limit of 4096 (PATH_MAX)"),
            ("--prompt_data", str(tmp_path / f"{name}.jsonl"), "a name of 306 bytes"),
            ("--reward_fn", f"{tmp_path / name}.py:f", "a name of 303 bytes")]:
        out = [] if flag == "--output_dir" else ["--output_dir", str(tmp_path / "run")]
        said = main_raises(monkeypatch, "train_ppo", ["--pretrain", "/not/loaded", *TINY, flag, path, *out],
                           re.escape(message))
        assert said.startswith(f"{flag} {path[:50]!r}...: ")
    assert not os.listdir(tmp_path)


def test_responses_longer_than_the_models_positions(tiny_model_dir, tmp_path, monkeypatch):
    """The tiny Llama has 512 positions: a response limit that fills them is one line before the model loads
    (vLLM's max_model_len was clamped to them without a word, the transformers engine generated past them);
    prompts too long to fit beside a whole response are skipped and counted. The VL script's built-in model
    (1024 positions) is checked once it is built."""
    import train_ppo
    import train_ppo_vl
    from rft_core.models import load_model_and_tokenizer
    from rft_core.vision import load_vl_model

    args = ["--pretrain", tiny_model_dir, *TINY, "--prompt_data", str(tmp_path / "none.jsonl"),
            "--output_dir", str(tmp_path / "run")]
    main_raises(monkeypatch, "train_ppo", [*args, "--generate_max_len", "512"], re.escape(
        "--generate_max_len 512: past the model's 512 positions (max_position_embeddings), which must hold "
        "the prompt and the response; lower it"))
    main_raises(monkeypatch, "train_ppo", [*args, "--env", "calculator", "--max_episode_tokens", "600"],
                re.escape("--max_episode_tokens 600: past the model's 512 positions"))
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    rows = {"train": [{"prompt": "1 +" * n, "label": "2"} for n in (1, 5, 200)]}
    said = []
    prompts = train_ppo.encode_prompts(train_ppo.Args(generate_max_len=470), rows, tokenizer, None, model,
                                       said.append)
    assert [len(p.prompt_ids) for p in prompts["train"]] == [32, 40]  # (42 tokens at most)
    assert said == ["[data] skipped 1 train prompts longer than 42 tokens (the model's 512 positions less "
                    "--generate_max_len 470)"]
    assert len(train_ppo.encode_prompts(train_ppo.Args(), rows, tokenizer, None, model, print)["train"]) == 3
    model, tokenizer, processor = load_vl_model()
    with pytest.raises(UserError, match=re.escape("--generate_max_len 1024: past the model's 1024 posit")):
        train_ppo_vl.encode_prompts(train_ppo_vl.Args(generate_max_len=1024), {}, tokenizer, processor,
                                    model, print)


def test_trackers_that_cannot_start_leave_the_output_dir_alone(tmp_path):
    """wandb without a login (or any tracker failing to start): one line naming the fixes, raised before
    config.json and metrics.jsonl are touched, so a finished run's record stays as it was."""
    from types import SimpleNamespace

    from rft_core.errors import ConfigError
    from rft_core.runs.metrics import MetricsLog

    def init_trackers(project, config):
        raise RuntimeError("No API key configured. Use `wandb login` to log in.")

    (tmp_path / "config.json").write_text('{"kept": 1}')
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    accelerator = SimpleNamespace(is_main_process=True, init_trackers=init_trackers)
    want = ("the trackers could not start (RuntimeError: No API key configured. Use `wandb login` to log "
            "in.): for wandb run `wandb login` or set WANDB_MODE=offline")
    with pytest.raises(ConfigError, match=re.escape(want)):
        MetricsLog(str(tmp_path), {"lr": 1e-6}, accelerator, trackers=True)
    assert (tmp_path / "config.json").read_text() == '{"kept": 1}'
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_step_that_trains_nothing_is_said_once(tmp_path, capsys):
    """A step whose actor gradient is exactly 0 (every advantage 0: a reward that never varies) is said once,
    with its cause, and so is a step whose responses were all cut at the length limit; later ones only show in
    their metrics."""
    from rft_core.runs.metrics import MetricsLog

    log = MetricsLog(str(tmp_path), max_len=8)
    for step, norm, cut in ((1, 0.5, 0.5), (2, 0.0, 1.0), (3, 0.0, 1.0)):
        log.write(step, {"train/grad_norm": norm, "rollout/truncated": cut})
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[signal]")]
    assert len(said) == 2 and said[0].startswith("[signal] step 2 trained nothing: the actor's gradient is 0")
    assert said[1].startswith("[signal] step 2: every response was cut at --generate_max_len 8 before it")


@pytest.mark.slow
def test_rerunning_a_finished_run_leaves_it_alone(tiny_model_dir, tmp_path):
    """The same command again after a run whose last checkpoint is its last step: one line, exit 0, and its
    record untouched (it used to evaluate again, append a second final eval row, then fail on the empty loop
    with an UnboundLocalError)."""
    out = tmp_path / "run"
    args = ["--pretrain", tiny_model_dir, *TINY, "--max_steps", "1", "--save_steps", "1",
            "--output_dir", str(out)]
    run(args)
    before = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "config.json")}
    said = run(args).stdout
    assert f"[done] {out}/checkpoint-1 is step 1 of 1: the run is finished, nothing to do" in said
    assert {name: (out / name).read_bytes() for name in before} == before


@pytest.mark.slow
def test_resuming_with_other_settings_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    """A checkpoint records the settings its contents depend on (data stream, batch, buffers, models, layout):
    resuming it with others is one line before anything loads, naming each; a changed learning rate or a
    longer run resumes."""
    out = str(tmp_path / "run")
    run(["--pretrain", tiny_model_dir, *TINY, "--max_steps", "1", "--save_steps", "1", "--output_dir", out])
    changed = ["--pretrain", tiny_model_dir, *TINY, "--rollout_batch_size", "4", "--seed", "7",
               "--output_dir", out]
    message = main_raises(monkeypatch, "train_ppo", changed, "other settings")
    assert "(seed 0 then, 7 now; rollout_batch_size 2 then, 4 now)" in message and "--no_resume" in message
    said = run(["--pretrain", tiny_model_dir, *TINY, "--actor_learning_rate", "1e-5",
                "--output_dir", out]).stdout
    assert f"[resume] from {out}/checkpoint-1: step 1" in said


def test_vl_image_rows(tmp_path, monkeypatch):
    """An absent --images_key column is an error; a missing or corrupt image skips its row (counted, the first
    named), or with --strict_data stops the run naming row, column and file."""
    from rft_core.tasks.shapes import draw_shapes
    from rft_core.vision import load_image_rows

    draw_shapes("red", 1, random.Random(0)).save(tmp_path / "ok.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    rows = [{"prompt": "what colour is the shape ?", "images": ["ok.png"], "label": "red"},
            {"prompt": "what colour is the shape ?", "images": ["gone.png"], "label": "red"},
            {"prompt": "what colour is the shape ?", "images": ["bad.png"], "label": "red"}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    path = str(tmp_path / "train.jsonl")
    said = []
    loaded = load_image_rows(path, "prompt", "label", "images", "--prompt_data", log=said.append)
    assert len(loaded) == 1 and len(said) == 1
    assert said[0].startswith("[data] skipped 2 rows whose images could not be read (first: --prompt_data")
    assert "row 1, column 'images'" in said[0] and "gone.png" in said[0]
    with pytest.raises(UserError, match=r"row 1, column 'images'.*gone.png.*--strict_data"):
        load_image_rows(path, "prompt", "label", "images", "--prompt_data", strict=True)
    main_raises(monkeypatch, "train_ppo_vl", ["--prompt_data", path, "--images_key", "imgs",
                                              "--mixed_mm_data", "--output_dir", str(tmp_path / "out")],
                re.escape("has no column 'imgs'") + ".*--images_key")


def test_an_image_over_pils_pixel_limit_is_a_counted_skip(tmp_path, monkeypatch):
    """An image over PIL's pixel limit (Image.MAX_IMAGE_PIXELS: PIL warns, then decodes it whole; past twice
    the limit it raises DecompressionBombError), or too thin for Qwen2-VL's processor (aspect ratio over
    200): its row is skipped and counted, the file named; with --strict_data one line. Found from the
    header, before any pixel is decoded."""
    from PIL import Image

    from rft_core.vision import load_image_rows

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for name, size in (("ok", (20, 20)), ("big", (40, 40)), ("bomb", (50, 50)), ("thin", (402, 2))):
        Image.new("RGB", size, "white").save(tmp_path / f"{name}.png")
    rows = [{"prompt": "what colour is the shape ?", "images": [f"{name}.png"], "label": "red"}
            for name in ("ok", "big", "bomb", "thin")]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    path, said = str(tmp_path / "train.jsonl"), []
    loaded = load_image_rows(path, "prompt", "label", "images", "--prompt_data", log=said.append)
    assert [r["row"] for r in loaded] == [0] and len(said) == 1
    assert said[0].startswith("[data] skipped 3 rows whose images could not be read (first: --prompt_data")
    assert f"row 1, column 'images': ValueError: {tmp_path / 'big.png'}: Image size (1600 pixels)" in said[0]
    assert "Shrink it (or raise PIL's Image.MAX_IMAGE_PIXELS)" in said[0]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[2:]))
    with pytest.raises(UserError, match=r"row 0, column 'images'.*bomb.png: Image size \(2500 pixels\).*"
                                        "--strict_data"):
        load_image_rows(path, "prompt", "label", "images", "--prompt_data", strict=True)
    (tmp_path / "train.jsonl").write_text(json.dumps(rows[3]))
    with pytest.raises(UserError, match=r"thin.png: 402 x 2 pixels, an aspect ratio over 200"):
        load_image_rows(path, "prompt", "label", "images", "--prompt_data", strict=True)


# ---- rewards ----

REWARDS = '''
import math, time
def raises(p, c, l, **kw):
    raise RuntimeError("reward server down")
def wrong_length(p, c, l, **kw):
    return [1.0]
def strings(p, c, l, **kw):
    return ["high"] * len(c)
def nan(p, c, l, **kw):
    return [math.nan] * len(c)
def slow(p, c, l, **kw):
    time.sleep(30)
'''


def test_reward_failures_are_printed_once_and_bounded(tmp_path):
    """Every kind of broken reward is printed (once) with its exception and counted; a step where all samples
    failed stops the run before training on it, unless --reward_failure_limit is raised."""
    from rft_core.experience import Sample
    from rft_core.reward_sources import load_reward_fn
    from rft_core.rewards import RewardScorer

    (tmp_path / "rw.py").write_text(REWARDS)
    for name, why in [("raises", "RuntimeError('reward server down')"),
                      ("wrong_length", "has 1 values for 1"),
                      ("strings", "could not convert string to float"), ("nan", "non-finite"),
                      ("slow", "no result within --call_timeout 0.2 s")]:
        said = []
        scorer = RewardScorer([("rule", load_reward_fn(f"{tmp_path}/rw.py:{name}", timeout=0.2))],
                              log=said.append)
        samples = [Sample([1], "x", "p", completion=c) for c in ("a", "b")]
        assert scorer(samples) == (2 if name != "wrong_length" else 0), name
        if name == "wrong_length":  # wrong for the batch, right for one sample: rescored one by one
            continue
        assert len(said) == 1 and why in said[0], (name, said)
        assert scorer(samples) == 2 and len(said) == 1  # the same kind again: counted, not printed
        with pytest.raises(UserError, match=r"the rewards of 4 of 4 samples failed at step 3"):
            scorer.check(4, 4, 3)
        scorer.check(3, 4, 3)  # below the default limit (all of them)


@pytest.mark.slow
def test_a_run_whose_rewards_all_fail_stops(tiny_model_dir, tmp_path):
    (tmp_path / "rw.py").write_text(REWARDS)
    args = ["--pretrain", tiny_model_dir, *TINY, "--reward_fn", f"{tmp_path}/rw.py:raises"]
    proc = run([*args, "--output_dir", str(tmp_path / "a")], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "[reward] rule failed on a sample" in proc.stdout + proc.stderr
    assert "error: the rewards of 4 of 4 samples failed at step 1" in proc.stderr
    run([*args, "--reward_failure_limit", "2", "--reward_fallback", "-1",
         "--output_dir", str(tmp_path / "b")])
    rows, _ = read_metrics(str(tmp_path / "b"))
    assert all(r["rollout/reward_errors"] == 4 and r["rollout/reward_mean"] == -1.0 for r in rows)


class _Broken(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/500":
            self.send_response(500)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"this is not json")

    def log_message(self, *args):
        pass


def test_remote_reward_failures_name_url_and_status():
    from rft_core.reward_sources import remote_reward_fn

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    try:
        for url, why in [(f"http://127.0.0.1:{server.server_port}/500", "HTTP 500 Internal Server Error"),
                         (f"http://127.0.0.1:{server.server_port}/json", "not a valid answer (Expecting"),
                         (f"http://127.0.0.1:{free}/x", "no valid answer after 2 tries: unreachable")]:
            with pytest.raises(ConnectionError, match=re.escape(f"--remote_rm_url {url}: {why}")):
                remote_reward_fn(url, timeout=2, retries=2, backoff=0.01)(["p"], ["c"], ["l"])
    finally:
        server.shutdown()


def test_reward_sources_name_their_flag(tmp_path):
    """A reward model or critic path that is not there, and a --remote_rm_url that is not http(s), are refused
    before the first step, each naming its flag (the URL was only found wrong at step 1, as 32 failures)."""
    from rft_core.errors import ConfigError, MissingPath
    from rft_core.model_training import load_value_model
    from rft_core.reward_sources import reward_sources

    with pytest.raises(ConfigError, match=re.escape("--remote_rm_url 'localhost:5000': not an http(s) URL")):
        reward_sources(remote_rm_url="localhost:5000")
    missing = str(tmp_path / "rm")
    with pytest.raises(MissingPath, match=re.escape(f"--reward_pretrain {missing!r}: not a model directory")):
        reward_sources(reward_pretrain=missing)
    with pytest.raises(MissingPath, match=re.escape(f"--critic_pretrain {missing!r}: not a model directory")):
        load_value_model(missing)


# ---- the output directory ----

@pytest.mark.slow
def test_a_failed_rerun_leaves_the_finished_run_alone(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(["--pretrain", tiny_model_dir, *TINY, "--output_dir", str(out)])
    before = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "config.json")}
    main_raises(monkeypatch, "train_ppo", ["--pretrain", tiny_model_dir, *TINY, "--output_dir", str(out)],
                "holds a finished run .* pass --no_resume")  # before anything loads
    main_raises(monkeypatch, "train_ppo", ["--pretrain", tiny_model_dir, *TINY, "--prompt_data",
                                           str(tmp_path / "typo.jsonl"), "--output_dir", str(out),
                                           "--no_resume"], "typo.jsonl")
    main_raises(monkeypatch, "train_ppo", ["--pretrain", str(tmp_path / "no_model"), *TINY, "--output_dir",
                                           str(out), "--no_resume"], "no_model")
    assert {name: (out / name).read_bytes() for name in before} == before


# ---- training health ----

HUGE = """
calls = [0]
def reward(p, completions, l, **kw):
    calls[0] += len(completions) == 4  # the training steps' calls (eval scores 96 at once)
    scale = 1.0 if calls[0] <= 1 else 1e38  # step 2: advantages that overflow the gradient norm
    return [scale * (i % 2) for i in range(len(completions))]
"""


@pytest.mark.slow
def test_non_finite_gradients_stop_before_the_update_and_name_the_intact_checkpoint(tiny_model_dir, tmp_path):
    (tmp_path / "rw.py").write_text(HUGE)
    proc = run(["--pretrain", tiny_model_dir, *TINY, "--max_steps", "3", "--advantage_estimator", "dr_grpo",
                "--reward_fn", f"{tmp_path}/rw.py:reward", "--save_steps", "1",
                "--actor_learning_rate", "1e-3", "--output_dir", str(tmp_path / "out")], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert re.search(r"error: non-finite loss or gradients \(grad_norm (inf|nan)\) at step 2, and nothing of "
                     r"it was saved; checkpoint-1 is the newest intact checkpoint: rerun with a lower "
                     r"--actor_learning_rate .* --no_resume", proc.stderr), proc.stderr[-2000:]
    assert (tmp_path / "out" / "latest").read_text() == "checkpoint-1"


def test_health_guard_catches_explosion_and_collapse(tmp_path):
    from rft_core.runs.health import HealthGuard

    guard = HealthGuard(str(tmp_path), vocab_size=1000)
    for norm in (1.0, 2.0, 1.5, 0.0):
        guard.grad_norm("grad_norm", norm, 1)
    guard.grad_norm("grad_norm", 1e3, 2)  # a spike clipping absorbs
    with pytest.raises(UserError, match=r"the gradient norm exploded \(grad_norm 1e\+05, 57143 times.* no "
                                        r"checkpoint was written"):
        guard.grad_norm("grad_norm", 1e5, 3)
    guard.entropy(1.2, 1)
    guard.entropy(4.0, 2)  # higher, not uniform
    with pytest.raises(UserError,
                       match=r"the policy collapsed: entropy 6.90, at the uniform bound log\(V\) = 6.91"):
        guard.entropy(6.9, 3)
    random_model = HealthGuard(str(tmp_path), vocab_size=1000)
    random_model.entropy(6.9, 1)
    random_model.entropy(6.9, 2)  # a model that starts uniform is left alone


def test_nonfinite_gradients_name_the_nonfinite_inputs(tmp_path):
    """The stop on a NaN gradient names what of the step's experience is not finite on response tokens; NaN
    engine logprobs of a row the engine returned none for (one sample in 8) are no finding."""
    from rft_core.experience import Experience
    from rft_core.runs.health import HealthGuard, nonfinite_inputs

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    exp = Experience(torch.zeros(3, 6, dtype=torch.long), torch.ones(3, 6), mask,
                     torch.tensor([[-1.0, -2.0, -3.0, 0.0], [math.nan] * 4, [-1.0, math.nan, -1.0, -1.0]]),
                     old_logprobs=torch.zeros(3, 4), advantages=torch.tensor([1.0, 0.0, -1.0]))
    assert nonfinite_inputs(exp) == "rollout_logprobs 1 tokens"  # row 2's one NaN, not row 1's
    exp.old_logprobs[0, 3] = -math.inf  # padding: no finding
    exp.old_logprobs[2, 0] = -math.inf
    exp.advantages[1] = math.nan
    assert nonfinite_inputs(exp) == "rollout_logprobs 1 tokens, old_logprobs 1 tokens, advantages 2 tokens"
    with pytest.raises(UserError, match=r"non-finite loss or gradients \(grad_norm nan; not finite in the "
                                        r"step's inputs: rollout_logprobs 1 tokens, old_logprobs 1 tokens, "
                                        r"advantages 2 tokens\) at step 4"):
        HealthGuard(str(tmp_path), vocab_size=1000).grad_norm("grad_norm", math.nan, 4, exp)



def test_a_nan_gradient_before_any_update_is_not_blamed_on_the_learning_rate(tmp_path):
    """A non-finite gradient with finite inputs at a process's first update (the weights as loaded) names the
    forward or backward and --torch_compile false; after an update it points at the learning rate."""
    from rft_core.experience import Experience
    from rft_core.runs.health import HealthGuard

    exp = Experience(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4), torch.ones(1, 2),
                     torch.zeros(1, 2), old_logprobs=torch.zeros(1, 2), advantages=torch.tensor([1.0]))
    first = (r"\(grad_norm nan\) at step 1, and nothing of it was saved; no checkpoint was written before "
             r"it: the step's inputs are finite and no update has run yet, .* not the learning rate: "
             r"rerun with --torch_compile false")
    with pytest.raises(UserError, match=first):
        HealthGuard(str(tmp_path), vocab_size=1000).grad_norm("grad_norm", math.nan, 1, exp)
    guard = HealthGuard(str(tmp_path), vocab_size=1000)
    guard.grad_norm("grad_norm", 0.5, 1, exp)
    with pytest.raises(UserError, match=r"at step 2, .* rerun with a lower --actor_learning_rate$"):
        guard.grad_norm("grad_norm", math.nan, 2, exp)


# ---- checkpoints ----

@pytest.mark.slow
def test_damaged_checkpoints_are_named_and_skipped(tiny_model_dir, tmp_path):
    """The latest checkpoint's weights truncated and the one before's RNG state truncated: the resume names
    both and continues from the newest intact one, checkpoint-1."""
    out = tmp_path / "out"
    args = ["--pretrain", tiny_model_dir, *TINY, "--save_steps", "1", "--max_ckpt_num", "3"]
    run([*args, "--max_steps", "3", "--output_dir", str(out)])
    with open(out / "checkpoint-3" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with open(out / "checkpoint-2" / "random_states_0.pkl", "r+b") as f:
        f.truncate(10)
    proc = run([*args, "--max_steps", "4", "--output_dir", str(out)])
    said = proc.stdout + proc.stderr
    assert "[resume] checkpoint-3 is damaged (model.safetensors has 100 bytes" in said
    assert "[resume] checkpoint-2 is damaged (random_states_0.pkl has 10 bytes" in said
    assert "[resume] from " in said and "checkpoint-1: step 1" in said
    rows, _ = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_no_intact_checkpoint_is_an_error_naming_the_fix(tmp_path):
    from rft_core.runs.checkpoint import latest_checkpoint, manifest
    from rft_core.runs.integrity import verify_checkpoint

    ckpt = tmp_path / "checkpoint-5"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text('{"step": 5}')
    (ckpt / "manifest.json").write_text(json.dumps(manifest(str(ckpt))))
    (tmp_path / "latest").write_text("checkpoint-5")
    assert verify_checkpoint(str(ckpt)) is None and latest_checkpoint(str(tmp_path)) == str(ckpt)
    (ckpt / "trainer_state.json").write_text('{"step": 6}')  # same size, other bytes
    assert verify_checkpoint(str(ckpt)) == "trainer_state.json changed since it was written (SHA-256)"
    with pytest.raises(UserError, match="holds no intact checkpoint .* pass --no_resume"):
        latest_checkpoint(str(tmp_path))
    (tmp_path / "latest").write_text("checkpoint-9")  # deleted
    assert verify_checkpoint(str(tmp_path / "checkpoint-9")) == "missing"


# ---- signals ----

SLOW = """import time
def chars(p, completions, l, **kw):
    time.sleep(0.5)
    return [len(c) / 10 for c in completions]
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signals_stop_at_a_step_boundary_in_one_line(tiny_model_dir, tmp_path, sig, code):
    """SIGINT / SIGTERM during step 2: the step finishes, one line says what is intact, the exit status says
    which signal; a checkpoint of that step is written first (SIGTERM: always). SIGUSR1 before it only
    prints the stacks (where a stuck run waits)."""
    from rft_core.runs.integrity import verify_checkpoint

    (tmp_path / "rw.py").write_text(SLOW)
    out = tmp_path / "out"
    args = ["--pretrain", tiny_model_dir, *TINY, "--max_steps", "20",
            "--reward_fn", f"{tmp_path}/rw.py:chars", "--save_steps", "1" if sig == signal.SIGINT else "0",
            "--output_dir", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_ppo.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "metrics.jsonl").exists() or "step" not in (out / "metrics.jsonl").read_text():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    time.sleep(1.0)  # inside the next step
    if sig == signal.SIGTERM:  # first SIGUSR1: every thread's stack is printed and the run goes on
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.3)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == code and "Traceback" not in stderr, stderr[-2000:]
    assert ("(most recent call first)" in stderr) == (sig == signal.SIGTERM), stderr[-2000:]
    stopped = [line for line in stderr.splitlines() if line.startswith("stopped: ")]
    step = len(read_metrics(str(out))[0])
    assert stopped == [f"stopped: {signal.Signals(sig).name} after step {step}: checkpoint-{step} is intact; "
                       "rerun the same command to resume from it"]
    assert (out / "latest").read_text() == f"checkpoint-{step}" and not (out / "model").exists()
    # the checkpoint is whole: every file its manifest lists (the RNG states among them), of the size and
    # digest it was written with, and it is the step's
    ckpt = out / f"checkpoint-{step}"
    assert verify_checkpoint(str(ckpt)) is None
    assert "random_states_0.pkl" in json.loads((ckpt / "manifest.json").read_text())
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == step


def test_a_deleted_latest_checkpoint_falls_back_to_the_one_before(tmp_path):
    from rft_core.runs.checkpoint import latest_checkpoint, manifest

    for step in (2, 4):
        ckpt = tmp_path / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
        (ckpt / "random_states_0.pkl").write_bytes(os.urandom(64))
        (ckpt / "manifest.json").write_text(json.dumps(manifest(str(ckpt))))
    (tmp_path / "latest").write_text("checkpoint-4")
    import shutil
    shutil.rmtree(tmp_path / "checkpoint-4")
    said = []
    assert latest_checkpoint(str(tmp_path), log=said.append) == str(tmp_path / "checkpoint-2")
    assert said == ["[resume] checkpoint-4 is damaged (missing): skipping it"]


def test_engine_groups_must_divide_the_processes():
    """--engine_tp_size with vLLM or SGLang: groups of consecutive ranks share an engine, so it must divide
    the processes; refused before anything starts (the transformers engine ignores it, with its own
    message)."""
    import train_ppo
    from rft_core.runs.checks import check_args

    args = train_ppo.Args(engine_tp_size=2, rollout_batch_size=12)  # 12 prompts: over 3 or 4 processes
    args = replace(args, train_batch_size=args.rollout_batch_size * args.n_samples_per_prompt)
    for engine in ("vllm", "sglang"):
        with pytest.raises(UserError, match=re.escape("--engine_tp_size 2: must divide the 3 processes")):
            check_args(args, 3, engine_type=engine)
        check_args(args, 4, engine_type=engine)


def test_context_and_tensor_parallelism_and_what_sequence_parallelism_cannot_do_are_refused():
    """An accelerate config whose parallelism_config asks for tensor parallelism, or for context parallelism
    outside FSDP2, is refused in one line before anything loads. Sequence parallelism (Ulysses under
    DeepSpeed) and context parallelism (FSDP2) pass, but not with the flags whose rows they cannot split, nor
    in train_ppo_vl.py, nor with a process count the groups do not make up; data parallelism passes."""
    import types

    import train_ppo
    import train_ppo_vl
    from rft_core.runs.checks import check_args

    def config(**sizes):
        return types.SimpleNamespace(**{"sp_size": 1, "cp_size": 1, "tp_size": 1, **sizes})

    args = train_ppo.Args()
    args = replace(args, train_batch_size=args.rollout_batch_size * args.n_samples_per_prompt)
    deepspeed, fsdp2 = dict(deepspeed=object(), sharded=True), dict(sharded=True)
    with pytest.raises(UserError, match="parallelism_config_tp_size is 2: .* not supported"):
        check_args(args, 2, parallelism=config(tp_size=2))
    for kind in ({}, deepspeed):
        with pytest.raises(UserError, match="parallelism_config_cp_size 2: context parallelism needs FSDP2"):
            check_args(args, 2, parallelism=config(cp_size=2), **kind)
    check_args(args, 2, parallelism=config(cp_size=2), **fsdp2)
    with pytest.raises(UserError, match="parallelism_config_cp_size 2 without --bf16: .*: add it"):
        check_args(replace(args, bf16=False), 2, parallelism=config(cp_size=2), **fsdp2)
    check_args(args, 2, parallelism=config(sp_size=2), **deepspeed)
    check_args(args, 4, parallelism=config(sp_size=2, dp_shard_size=2))  # 2 groups of 2 (data parallel)
    with pytest.raises(UserError, match="4 processes, but the accelerate config's parallelism_config makes 2 "
                                        ".*: set parallelism_config_dp_shard_size to 2"):
        check_args(args, 4, parallelism=config(sp_size=2))
    check_args(args, 2, parallelism=config(dp_shard_size=2))
    check_args(args, 2, parallelism=None)
    for sizes, kind in ((dict(sp_size=2), {}), (dict(cp_size=2), fsdp2)):  # summed over the slices
        check_args(replace(args, tis_cap=2.0, tis_level="sequence"), 2, parallelism=config(**sizes), **kind)
    for flag, value in (("packing_samples", True), ("policy_loss_type", "gspo"),
                        ("high_entropy_token_ratio", 0.2), ("pretrain_data", "x.jsonl"),
                        ("reward_pretrain", "rm"), ("advantage_estimator", "gae")):
        for sizes, kind in ((dict(sp_size=2), {}), (dict(cp_size=2), fsdp2)):
            with pytest.raises(UserError,
                               match=f"--{flag}.* with sequence parallelism .*: .*; drop one of them"):
                check_args(replace(args, **{flag: value}), 2, parallelism=config(**sizes), **kind)
    vl = train_ppo_vl.Args()
    vl = replace(vl, train_batch_size=vl.rollout_batch_size * vl.n_samples_per_prompt)
    for sizes, kind in ((dict(sp_size=2), {}), (dict(cp_size=2), fsdp2)):
        with pytest.raises(UserError, match="train_ppo_vl.py with sequence parallelism .* not split across"):
            check_args(vl, 2, parallelism=config(**sizes), **kind)


def test_optimizer_offload_under_deepspeed():
    """--optimizer_offload runs under DeepSpeed (it moves the ZeRO optimizer's inner AdamW state:
    tests/ds_offload_worker.py), not beside ZeRO-Offload, whose optimizer is on the CPU already; left to
    auto, it is decided after the first update there too, except under ZeRO-Offload."""
    import types

    import train_ppo
    from rft_core.distributed import zero_offloads_optimizer
    from rft_core.optim import offload_after_update
    from rft_core.runs.checks import check_args

    def plugin(device):
        zero = {"offload_optimizer": {"device": device}}
        return types.SimpleNamespace(deepspeed_config={"zero_optimization": zero})

    args = replace(train_ppo.Args(), optimizer_offload=True)
    args = replace(args, train_batch_size=args.rollout_batch_size * args.n_samples_per_prompt)
    check_args(args, 2, deepspeed=plugin("none"), sharded=True)
    with pytest.raises(UserError, match=r"--optimizer_offload: this DeepSpeed config \(offload_optimizer_"
                                        r"device: cpu\) keeps the optimizer on the CPU already; drop it"):
        check_args(args, 2, deepspeed=plugin("cpu"), sharded=True)
    assert [zero_offloads_optimizer(p) for p in (None, plugin("none"), plugin("cpu"))] == [False, False, True]
    short = types.SimpleNamespace(can_wake=lambda: False)  # an engine that could not wake beside the state
    said = []
    assert offload_after_update([], None, short, plugin("none"), said.append) is True
    assert said == ["[memory] optimizer state on the CPU between updates: True"]
    assert offload_after_update([], None, short, plugin("cpu"), said.append) is None and len(said) == 1


def test_the_engine_memory_checks_name_the_fix(monkeypatch):
    """vLLM's start and each wake-up are checked against the GPU's free memory first, so a trainer that holds
    too much gets one line naming the flags instead of vLLM's traceback (seen on 2 x H200: the 7B shape's full
    fine-tuning under ZeRO-3 left 34 GiB free for vLLM's default 42)."""
    import rft_core.engines.colocation as V
    from rft_core.errors import OutOfMemory

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (34 << 30, 140 << 30))
    assert V.memory_error("vLLM", 20 << 30, "start") is None
    error = V.memory_error("vLLM", 0.3 * (140 << 30), "start (--engine_mem_util 0.3 of the GPU)")
    assert isinstance(error, OutOfMemory) and "\n" not in str(error)
    assert str(error).startswith("vLLM needs 42.0 GiB to start (--engine_mem_util 0.3 of the GPU), but only "
                                 "34.0 of 140.0 GiB are free")
    assert "lower --engine_mem_util" in str(error) and "--lora_rank" in str(error)


def test_lora_target_modules_that_match_nothing_are_one_line(tiny_model_dir):
    """--target_modules names peft would not find: one line naming them and the model's linear layers (peft's
    own error is a traceback); names peft matches (a layer's name, a dotted suffix) are kept."""
    from transformers import AutoModelForCausalLM

    from rft_core.errors import ConfigError
    from rft_core.models import lora_model

    with pytest.raises(ConfigError, match=re.escape("--target_modules q_proj,qkv: the model has no module "
                                                    "named qkv; its linear layers: down_proj, gate_proj, ")):
        lora_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 4, 8, "q_proj,qkv")
    model = lora_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 4, 8, "self_attn.q_proj,v_proj")
    adapted = {name.split(".lora_A")[0].split(".")[-1] for name, _ in model.named_parameters()
               if "lora_A" in name}
    assert adapted == {"q_proj", "v_proj"}
