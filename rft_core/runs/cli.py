"""Flags from a dataclass: each field becomes `--name`, its docstring the help (with the field's default,
unless the docstring names the default itself: what decides a None), and each `# ---- section ----` comment
of the class a section of `--help`; rft_core/runs/checks.py checks the values."""

import argparse
import ast
import dataclasses
import difflib
import inspect
import re
import sys
import textwrap
import typing

# flags the scripts no longer have -> what replaced them (said in one line when one is given)
REPLACED = {"--use_wandb": "--report_to wandb", "--use_tensorboard": "--report_to tensorboard",
            "--plot_every": "--log_samples_steps",
            "--save_on_sigterm": "no flag: SIGTERM always writes a checkpoint",
            "--eps_clip_low_high": "--eps_clip LOW HIGH",
            "--kl_horizon": "no flag: the adaptive KL's horizon is 10,000 samples (rft_core/advantages.py)"}


def _bool(text):
    if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
    return text.lower() in ("1", "true", "yes", "on")


def parse_args(cls, argv=None):
    """argv as a `cls`: bools as `--name [true|false]`, tuples as `--name A B`, Literals as choices."""
    parser = argparse.ArgumentParser(description=inspect.getdoc(inspect.getmodule(cls)),
                                     usage="%(prog)s [--flag value ...] (--help lists them)",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = textwrap.dedent(inspect.getsource(cls))
    body, docs = ast.parse(source).body[0].body, {}  # {field: (section, the string literal under it)}
    lines, section = source.splitlines(), "the task"
    for node, nxt in zip(body, body[1:]):
        if not isinstance(node, ast.AnnAssign):
            continue
        above = re.match(r"\s*# ---- (.+) ----", lines[node.lineno - 2])
        section = above.group(1) if above else section
        documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
        docs[node.target.id] = section, " ".join(str(nxt.value.value).split()) if documented else ""
    hints = typing.get_type_hints(cls)
    groups = {s: parser.add_argument_group(s) for s, _ in [("the task", ""), *docs.values()]}
    for f in dataclasses.fields(cls):
        section, doc = docs.get(f.name, ("the task", ""))
        group, kind = groups[section], hints[f.name]
        if typing.get_origin(kind) is typing.Union:  # Optional[X]
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        extra = {}
        if kind is bool:
            kind, extra = _bool, {"nargs": "?", "const": True}
        elif typing.get_origin(kind) is tuple:  # Tuple[float, float]: --name A B; Tuple[float, ...]: A ...
            items = typing.get_args(kind)
            kind, extra = items[0], {"nargs": "+" if items[-1] is Ellipsis else len(items)}
        if typing.get_origin(kind) is typing.Literal:
            kind, extra = str, {**extra, "choices": typing.get_args(kind)}
        shown = "" if "default" in doc else f" (default: {f.default})"
        group.add_argument(f"--{f.name}", type=kind, default=f.default, help=doc + shown, **extra)
    flags = [f"--{f.name}" for f in dataclasses.fields(cls)]
    for given in (a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)):
        if given in REPLACED:
            parser.error(f"{given} was replaced by {REPLACED[given]}")
        if given.startswith("--") and given not in (*flags, "--help") and not any(
                f.startswith(given) for f in flags):  # (argparse takes an unambiguous prefix)
            close = difflib.get_close_matches(given, flags, n=1, cutoff=0.6)
            parser.error(f"no flag {given}" + (f"; did you mean {close[0]}?" if close else ""))
    return cls(**vars(parser.parse_args(argv)))
