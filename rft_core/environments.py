"""The boundary with an environment's code (--env): the State its step sees, the environment as a worker
builds and calls it (`load_env`), and checking what its step returned."""

import math
import os
from dataclasses import dataclass, field

from rft_core.errors import ConfigError, MissingName
from rft_core.tasks.calculator import Calculator
from rft_core.workers import line_in, load_from_file


@dataclass
class State:
    """What step(state, text) sees of its episode. It goes to a worker and back with each step (any worker
    may run the next), so state.data holds built-in types (numbers, strings, lists, dicts)."""
    sample: dict  # {"prompt": the opening as the data or reset gave it, "label": ...}
    turn: int = 0  # assistant turns so far, the one being answered included
    messages: list = field(default_factory=list)  # the turns so far: {"role", "content"}, assistant first
    data: dict = field(default_factory=dict)  # the environment's own, kept from one step to the next


class HostedEnv:
    """An environment as its worker holds it: reset (None, the data's prompt, where it has none) and step,
    which returns the state too, as step left it (the trainer's copy is not the one step changed)."""

    def __init__(self, env):
        self.env = env

    def reset(self, sample):
        return self.env.reset(sample) if callable(getattr(self.env, "reset", None)) else None

    def step(self, state, text):
        return self.env.step(state, text), state


def load_env(spec):
    """The environment --env names, built in a worker: "calculator" (rft_core/tasks/calculator.py), or
    'path/to/file.py:NAME', an object with step (and optionally reset) or a class of them (no arguments)."""
    env = Calculator() if spec == "calculator" else load_from_file(spec, "--env", "NAME", ["calculator"],
                                                                 "an environment file")
    if isinstance(env, type):
        try:
            env = env()
        except BaseException as e:  # whatever it raised (a TypeError for a missing argument too)
            line = line_in(e, os.path.abspath(spec.rpartition(":")[0]))
            where = f" (line {line})" if line else ""
            raise ConfigError(f"--env {spec!r}: making {env.__name__}() failed{where}: {e!r}; an environment "
                              "class is made with no arguments") from None
    if not callable(getattr(env, "step", None)):
        raise MissingName(f"--env {spec!r}: {spec.rpartition(':')[0]} defines no {spec.rpartition(':')[2]!r} "
                          "with a step(state, text) function (docs/multi_turn.md)")
    return HostedEnv(env)


def is_message(m):
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def parse_step(out):
    """(messages, done, reward, info) from what step returned; ValueError naming what is wrong."""
    if not isinstance(out, tuple) or not 2 <= len(out) <= 4:
        raise ValueError(f"step returned {type(out).__name__}, not (observation, done[, reward[, info]])")
    observation, done, reward, info = (*out, None, None)[:4]
    if observation is None or isinstance(observation, str):
        messages = [{"role": "user", "content": observation}] if observation else []
    else:
        messages = [observation] if isinstance(observation, dict) else observation
        if not isinstance(messages, list) or not all(is_message(m) for m in messages):
            raise ValueError(f"observation is {type(observation).__name__}, not a string or "
                             "{'role', 'content'} message(s) with string content")
    if not done and not messages:
        raise ValueError("no observation for an episode that goes on (done is false)")
    if reward is not None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
        raise ValueError(f"reward {reward!r} is not a finite number")
    if info is not None and not isinstance(info, dict):
        raise ValueError(f"info is {type(info).__name__}, not a dict")
    return messages, bool(done), float(reward or 0.0), info or {}
