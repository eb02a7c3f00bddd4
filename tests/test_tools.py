"""Tools as Python functions (rft_core/tasks/tools.py), async environments awaited side by side in the worker
processes under --env_concurrency (rft_core/workers.py), prompts rendered with tools (data.prompt_text), and
the ReAct calculator (rft_core/tasks/calculator.py)."""

import json
import time

import pytest
from conftest import read_metrics, run_script

from rft_core.data import prompt_text
from rft_core.environments import State, load_env
from rft_core.errors import ConfigError, MissingPath
from rft_core.reward_sources import start_workers
from rft_core.workers import Workers

TOOLS = '''import asyncio, sys
from os.path import join  # imported: not a tool

def lookup(key: str, limit: int = 3) -> str:
    """Look a key up.

    Args:
        key: the key to look up
        limit: how many results at most
    """
    if key == "boom":
        raise KeyError(key)
    return f"{key}:{limit}"

def stats(values: list[float]) -> dict:
    """Sum and count numbers.

    Args:
        values: the numbers
    """
    return {"sum": sum(values), "n": len(values)}

def has_torch() -> bool:
    """Whether torch is imported in this process."""
    return "torch" in sys.modules

def _helper():
    pass

def reset(sample):
    return "opening: " + sample["prompt"]
'''
ASYNC_TOOLS = '''import asyncio
async def fetch(key: str) -> str:
    """Fetch a key.

    Args:
        key: the key
    """
    await asyncio.sleep(0.01)
    return key.upper()
'''
# an async environment: its steps sleep 0.2 s (or hang, or block the event loop); r is drawn before any await
ASYNC_ENV = '''import asyncio, os, random, time
class Env:
    async def reset(self, sample):
        return None

    async def step(self, state, text):
        if text == "block":
            time.sleep(60)
        r = random.random()
        await asyncio.sleep(60 if text == "hang" else 0.2)
        return None, True, 0.0, {"pid": os.getpid(), "r": r}
'''


def call(text):
    return f"<tool_call>{json.dumps(text) if not isinstance(text, str) else text}</tool_call>"


@pytest.fixture
def tools_env(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS)
    return load_env(f"tools:{tmp_path}/tools.py")


def step(env, text, state=None):
    (messages, done, _, info), state = env.step(state or State({"prompt": "p"}, turn=1), text)
    return [messages] if isinstance(messages, str) else [m["content"] for m in messages], done, info, state


def test_a_files_functions_become_tools_with_schemas(tools_env, tmp_path):
    """The file's own public functions are the tools (not what it imports, nor _private, reset or
    parse_tool_calls); schemas from type hints and the docstring's Args; its reset is the opening."""
    tools = tools_env.about()["tools"]
    assert [t["function"]["name"] for t in tools] == ["lookup", "stats", "has_torch"]
    lookup = tools[0]["function"]
    assert lookup["description"] == "Look a key up."
    assert lookup["parameters"]["properties"] == {
        "key": {"type": "string", "description": "the key to look up"},
        "limit": {"type": "integer", "description": "how many results at most"}}
    assert lookup["parameters"]["required"] == ["key"]
    assert tools[1]["function"]["parameters"]["properties"]["values"]["items"] == {"type": "number"}
    assert tools_env.reset({"prompt": "p"}) == "opening: p" and tools_env.about()["stop"] == []
    (tmp_path / "bad.py").write_text("def f(x):\n    return x\n")
    with pytest.raises(ConfigError, match=r"the tool f: .*a type hint for each argument and a docstring"):
        load_env(f"tools:{tmp_path}/bad.py")
    with pytest.raises(MissingPath, match="no such file"):
        load_env(f"tools:{tmp_path}/missing.py")


def test_hermes_calls_run_and_bad_ones_are_answered_not_failed(tools_env):
    """One call, several in a turn, a non-str result as JSON; a call that is not JSON, names no tool, has
    wrong arguments or raises is answered by a tool message saying so; a turn without a call ends it."""
    one = 'I look. <tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>'
    assert step(tools_env, one)[:2] == (["a:3"], False)
    texts, done, info, state = step(tools_env, call({"name": "lookup", "arguments": {"key": "b", "limit": 1}})
                                    + call({"name": "stats", "arguments": {"values": [1, 2.5]}}))
    assert texts == ["b:1", '{"sum": 3.5, "n": 2}'] and not done and info == {"calls": 2, "errors": 0}
    texts, done, info, state = step(tools_env, call("{not json") + call({"name": "nope", "arguments": {}})
                                    + call({"name": "lookup", "arguments": {"wrong": 1}})
                                    + call({"name": "lookup", "arguments": {"key": "boom"}})
                                    + call({"name": "lookup", "arguments": [1]}), state)
    assert texts[0].startswith("error: '{not json' is not JSON") and "JSONDecodeError" in texts[0]
    assert texts[1] == "error: no tool 'nope'; the tools are lookup, stats, has_torch"
    assert texts[2] == "error: lookup: missing a required argument: 'key'"
    assert texts[3] == "error: lookup raised KeyError: 'boom'"
    assert texts[4] == "error: lookup's arguments are list, not a JSON object"
    assert not done and info == {"calls": 7, "errors": 5}
    assert step(tools_env, "So <answer>3</answer>", state)[:3] == ([], True, {"calls": 7, "errors": 5})


def test_a_file_may_replace_the_parser(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS + '''
def parse_tool_calls(text):
    if "explode" in text:
        raise ValueError("cannot read")
    return [(line.split()[1], {"key": line.split()[2]}) for line in text.splitlines() if "CALL" in line]
''')
    env = load_env(f"tools:{tmp_path}/tools.py")
    assert "parse_tool_calls" not in [t["function"]["name"] for t in env.about()["tools"]]
    assert step(env, "CALL lookup x\nCALL lookup y")[:2] == (["x:3", "y:3"], False)
    assert step(env, call({"name": "lookup", "arguments": {"key": "a"}}))[1]  # not its format: no call
    texts, done, info, _ = step(env, "explode")
    assert texts == ["error: the tool calls could not be read: ValueError: cannot read"] and not done


def test_tools_in_a_worker_without_torch_and_async_tools_awaited(tmp_path):
    """The workers build the tools env without importing torch (transformers' get_json_schema does not);
    an async tool is awaited, and its environment reports itself async."""
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "async_tools.py").write_text(ASYNC_TOOLS)
    workers = Workers({"env": (load_env, f"tools:{tmp_path}/tools.py"),
                       "async": (load_env, f"tools:{tmp_path}/async_tools.py")}, size=1, timeout=30)
    has_torch = call({"name": "has_torch", "arguments": {}})
    out, _ = workers.call("env", "step", (State({"prompt": "p"}), has_torch))
    assert out[0] == [{"role": "tool", "content": "false"}] and workers.concurrent["env"] == []
    assert workers.concurrent["async"] == ["step"]
    fetch = call({"name": "fetch", "arguments": {"key": "k"}})
    out, _ = workers.call("async", "step", (State({"prompt": "p"}), fetch))
    assert out[0] == [{"role": "tool", "content": "K"}]
    workers.close()


def test_prompt_text_renders_tools_through_the_template_or_as_a_system_message(tiny_model_dir):
    """A template that takes tools= writes them; SmolLM2's ignores them, so the schemas go in the system
    message (merged with --system_prompt), in Qwen2.5's words; without a template, before the prompt."""
    from transformers import AutoTokenizer

    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look up.", "parameters": {
        "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # SmolLM2's template
    text = prompt_text(tokenizer, "Find a.", True, "Be brief.", tools)
    assert text.count("<|im_start|>system") == 1 and "Be brief.\n\n# Tools" in text
    assert f"<tools>\n{json.dumps(tools[0])}\n</tools>" in text and text.endswith("<|im_start|>assistant\n")
    opening = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Find a."}]
    assert "<|im_start|>system\nMine.\n\n# Tools" in prompt_text(tokenizer, opening, tools=tools)
    assert prompt_text(tokenizer, "Find a.", False, tools=tools).endswith("</tool_call>\n\nFind a.")
    assert prompt_text(tokenizer, "Find a.", True) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Find a."}], add_generation_prompt=True, tokenize=False)
    tokenizer.chat_template = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
                               "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    text = prompt_text(tokenizer, "Find a.", True, "Be brief.", tools)
    assert text == f"TOOLS [{json.dumps(tools[0])}]\n<system>Be brief.\n<user>Find a.\n<assistant>"


@pytest.fixture(scope="module")
def async_env(tmp_path_factory):
    path = tmp_path_factory.mktemp("async") / "env.py"
    path.write_text(ASYNC_ENV)
    return f"{path}:Env"


def timed_steps(workers, texts, timeout=10):
    start = time.monotonic()
    out = workers.map("env", "step", [(State({"prompt": "p"}), t) for t in texts], timeout)
    return time.monotonic() - start, out


def test_async_steps_run_side_by_side_under_the_cap(async_env):
    """8 steps of 0.2 s over 2 workers: all at once with a cap of 8, two at a time with 2. A step's random
    draws before its first await are the same whatever the cap (seeded by call number)."""
    draws = []
    for cap, fastest, slowest in [(8, 0.2, 0.7), (2, 0.8, 2.0)]:
        workers = Workers({"env": (load_env, async_env)}, size=2, timeout=10, concurrency=cap)
        assert workers.concurrent["env"] == ["reset", "step"]
        assert workers.call("env", "reset", ({"prompt": "p"},)) is None
        took, out = timed_steps(workers, ["x"] * 8)
        assert fastest <= took < slowest and all(ok for ok, _ in out)
        assert len({value[0][3]["pid"] for _, value in out}) == 2  # both workers
        draws.append([value[0][3]["r"] for _, value in out])
        workers.close()
    assert draws[0] == draws[1] and len(set(draws[0])) == 8


@pytest.mark.slow  # seconds: it waits on worker processes
def test_an_async_call_past_its_timeout_is_cancelled_and_its_worker_goes_on(async_env, monkeypatch):
    """A hung await is cancelled in its worker (no process killed, the worker answers the next call); one
    that blocks the event loop is killed GRACE_S after its timeout, with the calls beside it."""
    import rft_core.workers as pool

    workers = Workers({"env": (load_env, async_env)}, size=1, timeout=10, concurrency=4, log=lambda _: None)
    pid = workers.procs[0].proc.pid
    took, out = timed_steps(workers, ["hang", "x", "x"], timeout=0.5)
    assert took < 1.5 and isinstance(out[0][1], TimeoutError) and "cancelled in its worker" in str(out[0][1])
    assert all(ok for ok, _ in out[1:]) and workers.restarts["timeout"] == 0
    assert timed_steps(workers, ["x"])[1][0][1][0][3]["pid"] == pid
    monkeypatch.setattr(pool, "GRACE_S", 0.3)
    took, out = timed_steps(workers, ["block", "x"], timeout=0.3)
    assert took < 2 and [type(e).__name__ for _, e in out] == ["TimeoutError", "TimeoutError"]
    assert workers.restarts["timeout"] == 1 and workers.procs[0] is None
    assert timed_steps(workers, ["x"])[1][0][0]  # a new worker
    workers.close()


def test_a_cap_above_the_workers_for_a_sync_environment_is_said(tmp_path):
    said = []
    workers = start_workers(None, "calculator", 1, 10, log=said.append, env_concurrency=4)
    assert len(said) == 1 and "raise --workers or make step async" in said[0]
    workers.close()
    with pytest.raises(ConfigError, match="--env_concurrency -1: must be >= 0"):
        start_workers(None, "calculator", 1, 10, env_concurrency=-1)


def test_the_react_calculator_answers_inline():
    """Its examples hold the call, the result and the answer in one assistant message; it stops at </calc>
    and answers a turn that ends with a call by the result as text; a turn without one ends the episode."""
    env = load_env("calculator_react")
    opening = env.reset({"prompt": "What is 12 * 34?"})
    assert opening[2]["content"] == "<calc>123 * 45</calc> = 5535\n<answer>5535</answer>"
    assert opening[2]["role"] == "assistant" and opening[-1]["content"] == "What is 12 * 34?"
    assert env.about()["stop"] == ["</calc>"]
    texts, done, _, state = step(env, "Let me see. <calc>12 * 34</calc>")
    assert texts == [" = 408\n"] and not done
    assert step(env, "<answer>408</answer>", state)[1:3] == (True, {"calls": 1})


def test_the_built_in_tools_task_stops_at_its_call():
    """--env tools: calculate is its one tool, a turn stops at </tool_call>, and the call is answered by a
    tool message (which closes the turn: episodes.EpisodeRunner)."""
    env = load_env("tools")
    assert [t["function"]["name"] for t in env.about()["tools"]] == ["calculate"]
    assert env.about()["stop"] == ["</tool_call>"]
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
    assert step(env, call)[:2] == (["408"], False)


@pytest.mark.slow
def test_the_tools_task_trains(eos_model_dir, tmp_path):
    """train_ppo.py --prompt_data multiply --env tools on a tiny model: two steps of episodes."""
    out = tmp_path / "out"
    run_script("train_ppo.py", ["--pretrain", eos_model_dir, "--prompt_data", "multiply", "--env", "tools",
                                "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
                                "--generate_max_len", "16", "--max_episode_tokens", "64",
                                "--prompt_max_len", "512", "--micro_train_batch_size", "4",
                                "--max_steps", "2", "--eval_steps", "0", "--env_concurrency", "2",
                                "--workers", "2", "--output_dir", str(out)])
    rows, _ = read_metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout/env_calls"] > 0 for r in rows)
    assert all(r["rollout/env/calls"] >= 0 and r["rollout/env_errors"] == 0 for r in rows)
