"""The engine interface (rft_core/engines/base.py): every engine offers each call of the `Engine` protocol
with its signature, and every call the loop makes on an engine is on the protocol. CPU only: the vLLM and
SGLang engine modules import without vllm, sglang or a GPU."""

import ast
import glob
import inspect
import os

import pytest

from rft_core.engines.base import Engine
from rft_core.engines.hf import HFEngine
from rft_core.engines.sglang import SGLangEngine
from rft_core.engines.vllm import VLLMEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALLS = sorted(name for name, value in vars(Engine).items() if inspect.isfunction(value) and name[0] != "_")


def shape(function):
    """A signature's parameters as (name, kind, default): annotations aside."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("engine", [HFEngine, VLLMEngine, SGLangEngine], ids=lambda c: c.__name__)
def test_every_engine_offers_the_protocol(engine):
    assert CALLS == ["can_wake", "generate", "sleep", "update_weights", "wake_up"]
    for name in CALLS:
        assert shape(getattr(engine, name)) == shape(getattr(Engine, name)), f"{engine.__name__}.{name}"
    public = sorted({n for c in engine.__mro__ for n, v in vars(c).items() if callable(v) and n[0] != "_"})
    assert public == CALLS, f"{engine.__name__}: a public call the protocol lacks"


def test_the_loop_calls_only_the_protocol():
    """`engine.<call>` in the scripts and in every rft_core function that takes an `engine` is on the
    protocol (a new call the loop makes must be written down there)."""
    used = set()
    paths = [p for p in glob.glob(os.path.join(ROOT, "rft_core", "**", "*.py"), recursive=True)
             if os.sep + "engines" + os.sep not in p]  # the engines themselves: the test above
    for path in [os.path.join(ROOT, "train_ppo.py"), os.path.join(ROOT, "train_ppo_vl.py"), *paths]:
        tree = ast.parse(open(path).read())
        if "rft_core" in path:  # there `engine` may be a DeepSpeed engine: only functions taking an engine
            scopes = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                      and "engine" in [a.arg for a in f.args.args]]
        else:
            scopes = [tree]
        used |= {node.attr for scope in scopes for node in ast.walk(scope) if isinstance(node, ast.Attribute)
                 and isinstance(node.value, ast.Name) and node.value.id == "engine"}
    assert used and used <= set(CALLS), sorted(used - set(CALLS))


def test_the_engine_directory_is_the_same_for_the_same_files(tiny_model_dir, tmp_path, monkeypatch):
    """vLLM keys its torch.compile cache by the model's path: engine_dir gives the same files the same
    directory under $RFT_CACHE (so a second run loads its compiled graphs, ~20 s less at 135M on an H100),
    other files another; "off", or a cache it cannot write, gives a fresh temporary directory each time."""
    from transformers import AutoConfig, AutoTokenizer

    from rft_core.engines import engine_dir

    config = AutoConfig.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    monkeypatch.setenv("RFT_CACHE", str(tmp_path / "cache"))
    first, second = engine_dir(config, tokenizer), engine_dir(config, tokenizer)
    assert first == second and first.startswith(str(tmp_path / "cache" / "engine"))
    assert AutoConfig.from_pretrained(first).num_hidden_layers == config.num_hidden_layers
    assert os.listdir(tmp_path / "cache" / "engine") == [os.path.basename(first)]  # nothing left aside
    config.num_hidden_layers += 1
    assert engine_dir(config, tokenizer) != first
    monkeypatch.setenv("RFT_CACHE", "off")
    assert engine_dir(config, tokenizer) != engine_dir(config, tokenizer)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RFT_CACHE", str(tmp_path / "file"))  # not a directory
    fallback = engine_dir(config, tokenizer)
    assert os.path.isfile(os.path.join(fallback, "config.json")) and not fallback.startswith(str(tmp_path))
