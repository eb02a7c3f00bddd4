import dataclasses
import importlib
import re
from dataclasses import dataclass
from typing import Literal, Optional, Tuple

import pytest

from rft_core.runs.cli import parse_args
from rft_core.runs.metrics import MetricsLog


@dataclass
class Toy:
    lr: float = 1e-5
    """the learning rate"""
    name: Optional[str] = None
    """a name"""
    flag: bool = False
    """a switch"""
    # ---- outputs ----
    pair: Optional[Tuple[float, float]] = None
    """two numbers"""
    report_to: Tuple[Literal["wandb", "tensorboard"], ...] = ()
    """trackers"""


def test_parse_args():
    assert parse_args(Toy, []) == Toy()
    assert parse_args(Toy, ["--lr", "3e-4", "--name", "x", "--flag"]) == Toy(3e-4, "x", True)
    assert parse_args(Toy, ["--flag", "false"]).flag is False
    assert parse_args(Toy, ["--pair", "0.2", "0.28"]).pair == [0.2, 0.28]
    with pytest.raises(SystemExit):
        parse_args(Toy, ["--flag", "maybe"])
    with pytest.raises(SystemExit):
        parse_args(Toy, ["--no_such_flag", "1"])


def test_choices_and_replaced_flags_are_one_line(capsys):
    """A Literal field takes its choices alone (a list of them with Tuple[..., ...]); a flag the scripts no
    longer have names the one that replaced it."""
    assert parse_args(Toy, ["--report_to", "tensorboard", "wandb"]).report_to == ["tensorboard", "wandb"]
    with pytest.raises(SystemExit):
        parse_args(Toy, ["--report_to", "wandb", "mlflow"])
    assert "invalid choice: 'mlflow' (choose from 'wandb', 'tensorboard')" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(Toy, ["--use_tensorboard=/tmp/tb"])
    assert "error: --use_tensorboard was replaced by --report_to tensorboard" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(Toy, ["--eps_clip_low_high", "0.2", "0.28"])
    assert "error: --eps_clip_low_high was replaced by --eps_clip LOW HIGH" in capsys.readouterr().err


def test_a_mistyped_flag_is_two_lines_naming_the_closest(capsys):
    """Not 85 lines of usage: the one-line usage and the error, which names the closest flag where one is
    close; a prefix of a flag is still taken (argparse's abbreviations)."""
    for argv, said in ((["--lrr", "0.1"], "error: no flag --lrr; did you mean --lr?"),
                       (["--zzzqqq", "1"], "error: no flag --zzzqqq\n")):
        with pytest.raises(SystemExit):
            parse_args(Toy, argv)
        err = capsys.readouterr().err
        assert said in err and len(err.splitlines()) == 2, err
    assert parse_args(Toy, ["--fla"]).flag is True


def test_docstrings_become_help(capsys):
    with pytest.raises(SystemExit):
        parse_args(Toy, ["--help"])
    out = capsys.readouterr().out
    assert "the learning rate (default: 1e-05)" in out and "a switch" in out
    # the class's `# ---- section ----` comments are the sections of --help; before the first, "the task"
    task, outputs = out.index("the task:"), out.index("outputs:")
    assert task < out.index("--flag", task) < outputs < out.index("--pair", outputs)
    assert out.index("--lr", task) < outputs


@pytest.mark.parametrize("script", ["train_ppo", "train_ppo_vl"])
def test_the_scripts_flags_read_as_the_algorithm(capsys, script):
    """Each script's flags in sections that follow the algorithm; train_ppo.py's at most 100 (the README's
    budget; train_ppo_vl.py adds its image flags)."""
    args = importlib.import_module(script).Args
    with pytest.raises(SystemExit):
        parse_args(args, ["--help"])
    out = capsys.readouterr().out
    sections = ["the task", "model, data and reward", "estimator and loss", "auxiliary losses", "rollout",
                "multi-turn", "batches", "engine", "precision and memory", "outputs"]
    assert [line[:-1] for line in out.splitlines() if line[:-1] in sections] == sections
    assert script == "train_ppo_vl" or len(dataclasses.fields(args)) <= 100


# the flags whose None means off; any other None default is decided later, and its docstring says by what
OFF = {"system_prompt", "remote_rm_url", "reward_pretrain", "reward_clip", "teacher_pretrain", "dual_clip",
       "kl_target", "pretrain_data", "ema_beta", "env", "freeze_prefix"}


@pytest.mark.parametrize("script, reward", [("train_ppo", "answer"), ("train_ppo_vl", "first_word")])
def test_help_shows_the_defaults_as_they_are(capsys, monkeypatch, script, reward):
    """Every flag's help ends with `(default: X)`, X the value the parsed Args gets with no arguments, or its
    docstring names the default itself (what decides a None), and then no `(default: None)` follows: once
    `--pretrain` said both, and `--reward_fn` showed None for the `answer` reward."""
    args = importlib.import_module(script).Args
    monkeypatch.setenv("COLUMNS", "10000")  # each flag's help on one line
    with pytest.raises(SystemExit):
        parse_args(args, ["--help"])
    out = capsys.readouterr().out
    helps = dict(re.findall(r"^  --(\w+)(?: \S+)*(?:  +|\n {24})(.+)$", out, re.M))
    parsed = parse_args(args, [])
    assert parsed == args() and set(helps) == {f.name for f in dataclasses.fields(args)}
    for name, text in helps.items():
        shown = f" (default: {getattr(parsed, name)})"
        if text.endswith(shown) and "default" not in text[:-len(shown)]:
            assert getattr(parsed, name) is not None or name in OFF, f"--{name}: say what decides its None"
        else:  # the docstring names it
            assert "default" in text and text.count("(default: ") <= 1, f"--{name}: {text}"
    assert f"(default: {reward}," in helps["reward_fn"]


def test_each_script_has_its_own_output_dir():
    """The quickstarts one after the other (`python train_ppo.py`, then `python train_ppo_vl.py`): the second
    is not refused for the first's directory."""
    import train_ppo
    import train_ppo_vl

    assert train_ppo.Args().output_dir != train_ppo_vl.Args().output_dir


def test_metrics_log(tmp_path):
    log = MetricsLog(str(tmp_path))
    log.write(1, {"rollout/reward_mean": 0.5})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "rollout/reward_mean": 0.5}\n'
    line = MetricsLog.line(1, {"a": 0.123456, "b": 2.0}, [("A", "a"), ("C", "c"), ("B", "b")])
    assert line == "step 1 | A 0.1235 | B 2"
