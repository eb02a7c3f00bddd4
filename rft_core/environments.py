"""The boundary with an environment's code (--env): State, `load_env`, and HostedEnv, which checks reset's
and step's output in the worker as built-in types: no user class reaches the trainer."""

import inspect
import math
import os
import sys
from dataclasses import dataclass, field

from rft_core.errors import ConfigError, MissingName
from rft_core.tasks.calculator import Calculator, ReactCalculator
from rft_core.tasks.tools import ToolEnv
from rft_core.workers import line_in, load_from_file, load_module

ROLES = ("user", "tool", "system")  # an observation's (the policy alone speaks as the assistant)


@dataclass
class State:
    """What step(state, text) sees, sent with each step; only state.data (built-in types) comes back."""
    sample: dict  # {"prompt": the opening as the data or reset gave it, "label": ...}
    turn: int = 0  # assistant turns so far, the one being answered included
    messages: list = field(default_factory=list)  # the turns so far: {"role", "content"}, assistant first
    data: dict = field(default_factory=dict)  # the environment's own, kept from one step to the next


class Malformed(ValueError):
    """What HostedEnv returns (not raises) for an outcome failing its check: the episode's failure."""


class HostedEnv:
    """An environment in its worker: reset (None where none) and step (state.data as step left it), checked
    (parse_opening, parse_step) and awaited if async; about(): its `stop` and `tools`, read at start-up."""

    def __init__(self, env, spec="--env"):
        self.env = env
        stop, tools = getattr(env, "stop", None) or [], getattr(env, "tools", None)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ConfigError(f"--env {spec!r}: its stop {stop!r} is not a list of texts that end a turn")
        schemas = isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)
        if tools is not None and not schemas:
            raise ConfigError(f"--env {spec!r}: its tools {tools!r} are not a list of JSON schemas (dicts)")
        # awaited side by side in the workers (rft_core/workers.py: --env_concurrency at once)
        self.async_methods = [m for m in ("reset", "step") if inspect.iscoroutinefunction(getattr(env, m, 0))]
        self.info = {"stop": list(stop), "tools": None if tools is None else list(tools)}

    def about(self):
        return self.info

    def reset(self, sample):
        reset = getattr(self.env, "reset", None)
        return _awaited(reset(sample) if callable(reset) else None, lambda out: _checked(parse_opening, out))

    def step(self, state, text):
        def checked(out):
            out = _checked(parse_step, out)
            if not isinstance(state.data, dict):
                out = Malformed(f"step left state.data a {type(state.data).__name__}, not a dict")
            return out, state

        return _awaited(self.env.step(state, text), checked)


def _awaited(value, then):
    """then(value), or where value is awaitable (an `async def` reset or step) a coroutine of it."""
    if not inspect.isawaitable(value):
        return then(value)

    async def awaited():
        return then(await value)
    return awaited()


def _checked(parse, out):
    """parse(out), or the Malformed of whatever checking raised (a __bool__ that raises...)."""
    try:
        return parse(out)
    except ValueError as e:
        return Malformed(str(e))
    except Exception as e:
        return Malformed(f"checking what it returned raised {e!r}")


def load_env(spec):
    """The --env environment, built in a worker: calculator(_react) (rft_core/tasks/calculator.py),
    tools[:file.py] (rft_core/tasks/tools.py), or 'file.py:NAME' (with step, maybe reset; or its class)."""
    builtin = {"calculator": Calculator, "calculator_react": ReactCalculator, "tools": ToolEnv}
    if spec.startswith("tools:"):
        env = ToolEnv(load_module(spec.removeprefix("tools:"), spec, "--env", "a tools file"), spec)
    else:
        env = builtin.get(spec) or load_from_file(spec, "--env", "NAME", list(builtin), "an environment file")
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
    return HostedEnv(env, spec)


def parse_opening(opening):
    """reset's output as built-in types: None, text, messages (ROLES; assistant: few-shot) or ValueError."""
    if opening is None or isinstance(opening, str):
        return None if opening is None else _text(opening)
    if not isinstance(opening, list):
        raise ValueError(f"reset returned {type(opening).__name__}, not chat messages, a string or None")
    return [_message(m, (*ROLES, "assistant")) for m in opening]


def parse_step(out):
    """(observation, done, reward, info) from step's output as built-in types; else ValueError naming why."""
    if not isinstance(out, tuple) or not 2 <= len(out) <= 4:
        raise ValueError(f"step returned {type(out).__name__}, not (observation, done[, reward[, info]])")
    observation, done, reward, info = (*out, None, None)[:4]
    if isinstance(observation, dict):
        observation = [observation]
    if observation is not None and not isinstance(observation, (str, list)):
        raise ValueError(f"observation is {type(observation).__name__}, not a string or "
                         "{'role', 'content'} message(s)")
    if isinstance(observation, list):
        messages = [_message(m, ROLES) for m in observation]
    else:  # text, or None: no answer
        messages = _text(observation) if observation else []
    # done: a bool, 0 or 1, or a numpy / torch bool scalar ("no" is not)
    if not (isinstance(done, bool) or type(done) is int and done in (0, 1) or type(_plain(done)) is bool):
        raise ValueError(f"done {done!r:.80} is not a bool")
    if not done and not messages:
        raise ValueError("no observation for an episode that goes on (done is false)")
    if info is not None and not isinstance(info, dict):
        raise ValueError(f"info is {type(info).__name__}, not a dict")
    reward = 0.0 if reward is None else _number(reward, "reward")
    return messages, bool(done), reward, _data(info or {}, "info")


def _message(m, roles):
    if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in roles):
        raise ValueError(f"{m!r:.80} is not a message {{'role': one of {roles}, 'content': a string}}")
    return {"role": _text(m["role"]), "content": _text(m["content"])}


def _text(s):
    return str.__str__(s)  # a plain str, also of a str subclass (whose own __str__ may say anything)


def _number(value, what, kind="a finite number (one a float holds)"):
    """value as a finite float: an int, a float (a bool too), a real numpy / torch scalar; else ValueError."""
    value = _plain(value)
    try:
        number = float(value) if isinstance(value, (int, float)) else math.nan
    except OverflowError:  # an int beyond a float's range
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{what} {value!r:.80} is not {kind}")
    return number


def _plain(value):
    """A real 0-d numpy or torch value as a Python scalar, else value (neither library is imported here)."""
    numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if numpy and isinstance(value, (numpy.generic, numpy.ndarray)) and value.ndim == 0:
        return value.item() if value.dtype.kind in "biuf" else value
    if torch and isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return value.item()
    return value


def _data(value, where):
    """info's value as JSON-like built-in types, its numbers finite floats; ValueError naming where not."""
    if value is None or isinstance(value, (bool, str)):
        return _text(value) if isinstance(value, str) else value
    if isinstance(value, (list, tuple)):
        return [_data(v, f"{where}[{k}]") for k, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"{where} has a key that is not a string")
        return {_text(k): _data(v, f"{where}[{k!r}]") for k, v in value.items()}
    return _number(value, where, "a finite number, string, bool, None, list or dict")
