"""Flags from a dataclass (each field's docstring is its --help), the metrics log, and timing / memory probes."""

import argparse
import ast
import dataclasses
import inspect
import json
import os
import textwrap
import time
import typing

import numpy as np
from tqdm import tqdm


def _field_docs(cls):
    """The string literal under each field of a dataclass body: its documentation."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body, docs = tree.body[0].body, {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _bool(text):
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def parse_args(cls, argv=None):
    """Parse argv into an instance of the dataclass `cls`: `--name value`, bools as `--name [true|false]`,
    Tuple[float, float] as `--name A B`."""
    parser = argparse.ArgumentParser(description=inspect.getdoc(inspect.getmodule(cls)),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    docs, hints = _field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        args = typing.get_args(kind)
        if typing.get_origin(kind) is typing.Union:  # Optional[X]
            kind = next(a for a in args if a is not type(None))
        help_text = f"{docs.get(f.name, '')} (default: {f.default})"
        if kind is bool:
            parser.add_argument(f"--{f.name}", type=_bool, nargs="?", const=True, default=f.default, help=help_text)
        elif typing.get_origin(kind) is tuple:  # Tuple[float, float]: --name A B; Tuple[float, ...]: one or more
            items = typing.get_args(kind)
            parser.add_argument(f"--{f.name}", type=items[0], nargs="+" if items[-1] is Ellipsis else len(items),
                                default=f.default, help=help_text)
        else:
            parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=help_text)
    return cls(**vars(parser.parse_args(argv)))


def timed(fn, *args, **kwargs):
    """(fn's result, seconds it took)."""
    t = time.time()
    return fn(*args, **kwargs), time.time() - t


def phase_peak_gb():
    """Peak GPU memory allocated since the previous call, in GiB; resets the peak (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return 0.0
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return peak


def gather_metrics(local, sum_keys=()):
    """Every rank's metrics dict merged: the mean over the ranks that have a key (NaN-aware), or the sum for sum_keys."""
    from accelerate.utils import gather_object

    per_rank = gather_object([local])  # dicts, so ranks may differ in keys (reward components)
    keys = dict.fromkeys(k for m in per_rank for k in m)
    return {k: sum(m[k] for m in per_rank if k in m) if k in sum_keys else float(np.nanmean([m[k] for m in per_rank if k in m]))
            for k in keys}


STEP_LINE = [("reward", "rollout/reward_mean"), ("±", "rollout/reward_std"), ("acc", "rollout/reward/correct"),
             ("errors", "rollout/reward_errors"), ("len", "rollout/response_length"), ("pg_loss", "train/policy_loss"),
             ("kl", "train/kl"), ("ppo_kl", "train/ppo_kl"), ("clip", "train/clip_frac"), ("ent", "train/entropy"),
             ("gnorm", "train/grad_norm"), ("vloss", "train/value_loss"), ("lp_diff", "rollout/logprob_diff_mean"),
             ("t_gen", "perf/generate_s"), ("t_lp", "perf/logprob_s"), ("t_upd", "perf/update_s"),
             ("t_sync", "perf/weight_sync_s"), ("t_step", "perf/step_time_s")]  # the step line's (label, metric)


class MetricsLog:
    """Appends one JSON object per row to OUTPUT_DIR/metrics.jsonl (and to the accelerate trackers)
    and formats the console line."""

    def __init__(self, output_dir, enabled=True, accelerator=None, keep_until=None):
        """keep_until: a resumed run's checkpoint step; rows up to it are kept, later ones (logged
        after that checkpoint by the run that died) dropped. None: start a new file."""
        self.enabled = enabled
        self.accelerator = accelerator  # with trackers (wandb, TensorBoard): rows go to them too
        self.path = os.path.join(output_dir, "metrics.jsonl")
        if enabled:
            kept = []
            if keep_until is not None and os.path.exists(self.path):
                kept = [line for line in open(self.path) if line.strip() and json.loads(line)["step"] <= keep_until]
            with open(self.path, "w") as f:
                f.writelines(kept)

    def write(self, step, metrics):
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.accelerator is not None and self.accelerator.trackers:
            self.accelerator.log(metrics, step=step)

    def samples(self, step, rows):
        """Append sample rows (dicts) to samples.jsonl, print two, and log them as a wandb table if wandb is on."""
        if not self.enabled or not rows:
            return
        with open(os.path.join(os.path.dirname(self.path), "samples.jsonl"), "a") as f:
            f.writelines(json.dumps({"step": step, **x}) + "\n" for x in rows)
        for x in rows[:2]:
            tqdm.write(f"[sample] reward {x['reward']:.3g} | label {x['label']!r} | {x['completion'][:200]!r}")
        if self.accelerator is not None and any(t.name == "wandb" for t in self.accelerator.trackers):
            self.accelerator.get_tracker("wandb").log_table("samples", columns=["step", *rows[0]],
                                                            data=[[step, *x.values()] for x in rows], step=step)

    @staticmethod
    def line(step, metrics, keys=None):
        """`step 3 | reward 0.512 | ...` for the (label, key) pairs (default STEP_LINE) present in metrics."""
        keys = keys or STEP_LINE
        parts = [f"step {step}"] + [f"{label} {metrics[key]:.4g}" for label, key in keys if key in metrics]
        return " | ".join(parts)
