"""Tools as plain Python functions (`--env tools:path/to/file.py`), and the built-in tools task (`--env
tools`: this file's `calculate`, with the multiply task).

    python train_ppo.py --prompt_data multiply --env tools                   # calculate, below
    python train_ppo.py --prompt_data my_data.jsonl --env tools:my_tools.py  # your file's functions

Every public function a file defines is a tool, its schema (transformers' get_json_schema: type hints, the
docstring's Args) rendered into the opening (data.prompt_text). Each call of a turn (Qwen2.5 / Hermes),
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, gets a "tool" message: the result (JSON unless
a string) or what was wrong with the call, to learn from; a turn without one ends the episode. `async def`
tools are awaited side by side. Not tools: a file's `reset(sample)` (the opening),
`parse_tool_calls(text) -> [(name, arguments)]` (another call format) and `stop` (texts that end a turn)."""

import inspect
import json
import re
import sys
from unittest import mock

from rft_core.errors import ConfigError
from rft_core.tasks import calculator

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
SYSTEM = ("You have a calculator tool. To use it, call it and stop; its result comes back. Then give the "
          "final answer in <answer></answer> tags.")


def parse_tool_calls(text):
    """[(name, arguments)] of text's Qwen2.5 / Hermes <tool_call> JSON, or (None, why) for a bad one."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            calls.append((call["name"], call.get("arguments", {})))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            calls.append((None, f'{body.strip()[:200]!r} is not JSON {{"name": ..., "arguments": {{...}}}} '
                                f"({type(e).__name__}: {e})"))
    return calls


class ToolEnv:
    """A module's tools as an environment, made in a worker (environments.load_env); default: this file's."""

    def __init__(self, module=None, spec="tools"):
        from transformers.utils import chat_template_utils, get_json_schema  # ~1.4 s, without torch

        module = module or sys.modules[__name__]
        functions = {name: f for name, f in vars(module).items() if inspect.isfunction(f)
                     and f.__module__ == module.__name__ and not name.startswith("_")}
        if "reset" in functions:
            self.reset = functions.pop("reset")
        self.parse = functions.pop("parse_tool_calls", parse_tool_calls)
        if not functions:
            raise ConfigError(f"--env {spec!r}: the file defines no public function to serve as a tool")
        self.functions, self.tools, self.stop = functions, [], getattr(module, "stop", [])
        # hide torch: get_json_schema imports it (2 s, ~300 MB a worker) for Tensor hints; tool args are JSON
        with mock.patch.object(chat_template_utils, "is_torch_available", lambda: False, create=True):
            for name, f in functions.items():
                try:
                    self.tools.append(get_json_schema(f))
                except Exception as e:  # no docstring, an argument without a type hint or a description
                    raise ConfigError(f"--env {spec!r}: the tool {name}: {e} (a tool needs a type hint for "
                                      "each argument and a docstring with an Args section; or name it "
                                      f"_{name})") from None
        if any(inspect.iscoroutinefunction(f) for f in functions.values()):
            self.step = self._step_async  # awaited in the workers, side by side

    def step(self, state, text):
        return self._answer(state, self._calls(text))

    async def _step_async(self, state, text):
        return self._answer(state, [await a if inspect.isawaitable(a) else a for a in self._calls(text)])

    def _calls(self, text):
        try:
            calls = list(self.parse(text))
        except Exception as e:  # a file's own parser
            calls = [(None, f"the tool calls could not be read: {type(e).__name__}: {e}")]
        return [self._call(name, arguments) for name, arguments in calls]

    def _call(self, name, arguments):
        """(ok, the text answering a call), or an awaitable of it (an async tool)."""
        if name is None:  # what the parser could not read
            return False, f"error: {arguments}"
        f = self.functions.get(name) if isinstance(name, str) else None
        if f is None:
            return False, f"error: no tool {name!r}; the tools are {', '.join(self.functions)}"
        if not isinstance(arguments, dict):
            return False, f"error: {name}'s arguments are {type(arguments).__name__}, not a JSON object"
        try:
            inspect.signature(f).bind(**arguments)
        except TypeError as e:
            return False, f"error: {name}: {e}"
        try:
            result = f(**arguments)
        except Exception as e:
            return False, f"error: {name} raised {type(e).__name__}: {e}"
        return _awaited(name, result) if inspect.isawaitable(result) else _text(name, result)

    def _answer(self, state, answers):
        info = {"calls": state.data.get("calls", 0) + len(answers),
                "errors": state.data.get("errors", 0) + sum(not ok for ok, _ in answers)}
        state.data.update(info)
        if not answers:  # the answer: the reward scores this turn
            return None, True, 0.0, info
        return [{"role": "tool", "content": text} for _, text in answers], False, 0.0, info


async def _awaited(name, result):
    try:
        return _text(name, await result)
    except Exception as e:
        return False, f"error: {name} raised {type(e).__name__}: {e}"


def _text(name, result):
    if isinstance(result, str):
        return True, result
    try:
        return True, json.dumps(result)
    except (TypeError, ValueError) as e:
        return False, f"error: {name}'s result is not JSON ({e})"


# ---- the built-in task's tool, stop and opening ----

stop = ["</tool_call>"]  # a turn ends at its call (one a turn), else the model may go on and invent a result


def calculate(expression: str):
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers, + - * / // % and parentheses, e.g. "123 * 45"
    """
    return calculator.calculate(str(expression))  # a number given as one too


def reset(sample):
    """The opening for a multiply_task prompt: instructions, two worked examples (call, result, answer)."""
    def shot(x, y):
        call = json.dumps({"name": "calculate", "arguments": {"expression": f"{x} * {y}"}})
        return [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                {"role": "tool", "content": str(x * y)},
                {"role": "assistant", "content": f"{x} * {y} = {x * y}\n<answer>{x * y}</answer>"}]
    return calculator.opening(sample, SYSTEM, shot)
