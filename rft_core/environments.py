"""The boundary with an environment's code (--env, rft_core/episodes.py runs the episodes): loading one from a
user's file, calling it where a hang or an exit cannot take the run down (a thread per call, a timeout), and
checking what its step returned."""

import math
import threading
import time

from rft_core.errors import MissingName
from rft_core.reward_sources import load_from_file
from rft_core.tasks.calculator import Calculator


def load_env(spec):
    """The environment --env names: "calculator" (rft_core/tasks/calculator.py), or 'path/to/file.py:NAME', an
    object with step (and optionally reset), or a class of them (made with no arguments)."""
    if spec == "calculator":
        return Calculator()
    env = load_from_file(spec, "--env", "NAME", ["calculator"], "an environment file")
    if isinstance(env, type):
        env = env()
    if not callable(getattr(env, "step", None)):
        raise MissingName(f"--env {spec!r}: {spec.rpartition(':')[0]} defines no {spec.rpartition(':')[2]!r} "
                          "with a step(state, text) function (docs/multi_turn.md)")
    return env


def call_all(calls, timeout):
    """Each zero-argument call in its own daemon thread, all started at once and waited for together, at most
    `timeout` seconds: per call ("ok", value), ("raised", exception) or ("timeout", None). A call that timed
    out goes on in its thread (Python cannot stop one); its result is dropped."""
    results = [("timeout", None)] * len(calls)

    def run(i, fn):
        try:
            results[i] = ("ok", fn())
        except BaseException as e:  # the environment's, whatever it is: its episode's failure
            results[i] = ("raised", e)

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(calls)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [results[i] if not t.is_alive() else ("timeout", None) for i, t in enumerate(threads)]


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
