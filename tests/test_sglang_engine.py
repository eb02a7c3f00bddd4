"""SGLang engine (--engine_type sglang): request building and output parsing on CPU (no sglang needed);
greedy equality with transformers after a sync, sleep / wake and the logprob diff on GPU (marked, skipped
without CUDA and sglang)."""

import importlib.util
import os

import pytest
import test_vllm_engine as same  # its GPU checks take any engine: run here on SGLang's
import torch
from test_vllm_engine import _prompts

from rft_core.engines.base import EngineSettings
from rft_core.engines.sglang import (
    SGLangEngine,
    generation_of,
    processor_output,
    sampling_params,
    sglang_param_name,
)

gpu = pytest.mark.gpu(needs="sglang")


def test_sampling_params_per_request():
    params = sampling_params([3, 8], 0.7, 0.9, stop_token_ids=(2, 5))
    assert [p["max_new_tokens"] for p in params] == [3, 8]
    assert all(p["temperature"] == 0.7 and p["top_p"] == 0.9 for p in params)
    assert all(p["stop_token_ids"] == [2, 5] for p in params)
    greedy = sampling_params([4], 0.0, 0.9, stop_token_ids=(2,))[0]  # SGLang: temperature 0 is greedy
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0


def test_image_prompts_go_in_preprocessed():
    """An image prompt reaches SGLang as the trainer's own pixels and grids (its ids are kept, no processor
    runs), vision placeholders get a -100 logit bias, and a VL model's weights take SGLang's names."""
    from rft_core.tasks.shapes import shapes_task
    from rft_core.vision import encode_vl_prompt, load_vl_model

    model, tokenizer, processor = load_vl_model(tiny="qwen2_vl")
    _, rows = shapes_task(num_eval=2)
    _, mm = encode_vl_prompt(tokenizer, processor, rows[0]["prompt"], rows[0]["images"],
                             model.config.image_token_id)
    (item,) = processor_output(mm)
    assert item["format"] == "processor_output" and set(item) == {"format", "pixel_values", "image_grid_thw"}
    assert item["pixel_values"] is mm["pixel_values"] and processor_output(None) == [None]
    assert sampling_params([4], 1.0, 1.0, (2,), blocked_token_ids=[7, 9])[0]["logit_bias"] == {"7": -100.0,
                                                                                            "9": -100.0}
    assert "logit_bias" not in sampling_params([4], 1.0, 1.0, (2,))[0]
    names = {sglang_param_name(n) for n, _ in model.named_parameters()}
    assert {"model.layers.0.self_attn.q_proj.weight", "visual.blocks.0.attn.qkv.weight", "lm_head.weight",
            "model.embed_tokens.weight"} <= names
    assert not any(n.startswith(("model.language_model", "model.visual")) for n in names)
    assert sglang_param_name("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"


def test_generate_sends_image_prompts_one_each():
    """A text-only call is one batched generate; a call with image prompts sends one request each, all in
    flight on SGLang's loop (its batched path loses image requests that finish early), with each prompt's own
    pre-processed input and sampling params, outputs in order; a prompt SGLang made longer is an error
    naming it. A scripted stand-in for sglang.Engine: no sglang needed."""
    import asyncio

    from rft_core.errors import ConfigError

    def output(ids, limit, extra=0):
        return {"output_ids": [7] * limit, "meta_info": {"prompt_tokens": len(ids) + extra,
                                                         "output_token_logprobs": [(-0.5, 7, None)] * limit}}

    class Llm:
        def __init__(self, extra=0):
            self.loop, self.batched, self.single, self.extra = asyncio.new_event_loop(), [], [], extra

        def generate(self, input_ids, sampling_params, return_logprob):
            self.batched.append(len(input_ids))
            return [output(i, p["max_new_tokens"]) for i, p in zip(input_ids, sampling_params)]

        async def async_generate(self, input_ids, sampling_params, return_logprob, image_data):
            self.single.append(image_data)
            await asyncio.sleep(0.001 * (len(self.single) % 3))  # finish out of order
            return output(input_ids, sampling_params["max_new_tokens"], self.extra)

    engine = SGLangEngine.__new__(SGLangEngine)
    engine.tp_group, engine.blocked_token_ids = None, [9]
    engine.stop, engine.stop_token_ids, engine.tokenizer = (), (2,), None
    engine.llm = Llm()
    gens = engine.generate([[1, 2], [3]], [2, 3])
    assert engine.llm.batched == [2] and not engine.llm.single and [len(g.token_ids) for g in gens] == [2, 3]
    mm = {"pixel_values": torch.zeros(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    gens = engine.generate([[1, 2], [3], [4, 5, 6]], [2, 3, 4], mm=[mm, None, mm], logprob_every=2)
    assert engine.llm.batched == [2] and len(engine.llm.single) == 3
    assert engine.llm.single[1] is None and engine.llm.single[0][0]["pixel_values"] is mm["pixel_values"]
    assert [len(g.token_ids) for g in gens] == [2, 3, 4]
    assert [g.logprobs is not None for g in gens] == [True, False, True]
    engine.llm = Llm(extra=1)
    with pytest.raises(ConfigError, match="prompt 0: SGLang made it 3 tokens, the trainer's has 2"):
        engine.generate([[1, 2]], 2, mm=[mm])


def test_generation_of_an_output():
    out = {"output_ids": [5, 9, 2], "meta_info": {"output_token_logprobs": [(-0.5, 5, None), (-1.25, 9, None),
                                                                             (-0.125, 2, None)]}}
    gen = generation_of(out)
    assert gen.token_ids == [5, 9, 2] and gen.logprobs == [-0.5, -1.25, -0.125]
    out["meta_info"]["output_token_logprobs"] = out["meta_info"]["output_token_logprobs"][:2]
    with pytest.raises(RuntimeError, match="2 logprobs, 3 tokens"):
        generation_of(out)
    assert generation_of({"output_ids": [5, 2], "meta_info": {}}, with_logprobs=False).logprobs is None


def test_flush_waits_for_an_idle_scheduler():
    """SGLang declines a flush (and asserts in a release) while its overlap scheduler still holds the last
    batch: the engine retries until the flush succeeds, and gives up with a message if it never does."""
    class Busy:
        def __init__(self, busy_calls):
            self.calls, self.busy_calls = 0, busy_calls

        def flush_cache(self):
            self.calls += 1
            return type("Out", (), {"success": self.calls > self.busy_calls})()

    engine = SGLangEngine.__new__(SGLangEngine)
    engine.llm = Busy(3)
    engine._flush()
    assert engine.llm.calls == 4
    engine.llm = Busy(10 ** 9)
    with pytest.raises(RuntimeError, match="stayed busy 0 s"):
        engine._flush(timeout_s=0.02)


def test_schedulers_start_without_torchrun_agent_store(monkeypatch):
    """Under accelerate launch (torchrun) SGLang's schedulers start without TORCHELASTIC_USE_AGENT_STORE (with
    it they hang ten minutes making their process group); the trainer keeps it. A stand-in sglang module
    records the environment its Engine starts in (no GPU needed)."""
    import sys
    import types

    seen = {}

    def engine(**kwargs):
        seen["agent_store"] = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
        seen.update(kwargs)
        return "engine"

    fake = {"sglang": types.SimpleNamespace(Engine=engine), "sglang.srt": types.ModuleType("sglang.srt"),
            "sglang.srt.utils": types.ModuleType("sglang.srt.utils"),
            "sglang.srt.utils.patch_torch": types.SimpleNamespace(monkey_patch_torch_reductions=lambda: None)}
    for name, module in fake.items():
        monkeypatch.setitem(sys.modules, name, module)
    for name, value in (("current_device", lambda: 0), ("device_count", lambda: 1),
                        ("empty_cache", lambda: None), ("mem_get_info", lambda: (60 * 2**30, 80 * 2**30))):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    settings = EngineSettings("sglang", mem_util=0.3, enforce_eager=True)
    llm = SGLangEngine._start(None, "/model", settings, 0, torch.bfloat16, None)
    assert llm == "engine" and seen["agent_store"] is None and seen["model_path"] == "/model"
    assert seen["mem_fraction_static"] == pytest.approx(0.4)  # 0.3 of the GPU, as a share of what is free
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_asking_for_sglang_without_it_is_one_line():
    from rft_core.engines import resolve_engine_type
    from rft_core.errors import MissingDependency

    with pytest.raises(MissingDependency, match=r"--engine_type sglang needs sglang \(pip install sglang=="):
        resolve_engine_type("sglang")


def test_auto_takes_sglang_where_vllm_is_not_installed(monkeypatch):
    """--engine_type auto: with a GPU, vLLM where installed, else SGLang where installed (it was the slow
    transformers engine then), else hf; hf on a CPU whatever is installed."""
    from rft_core import engines

    for installed, gpu, want in (({"vllm", "sglang"}, True, "vllm"), ({"sglang"}, True, "sglang"),
                                 (set(), True, "hf"), ({"vllm", "sglang"}, False, "hf")):
        monkeypatch.setattr(engines.importlib.util, "find_spec",
                            lambda name, found=installed: object() if name in found else None)
        monkeypatch.setattr(engines.torch.cuda, "is_available", lambda gpu=gpu: gpu)
        assert engines.resolve_engine_type("auto") == want, (installed, gpu)


# ---- GPU (with requirements-sglang.txt installed; one engine, shared) ----

@pytest.fixture(scope="module")
def engine_and_model():
    from rft_core.engines import create_engine
    from rft_core.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer()
    model = model.cuda()
    settings = EngineSettings("sglang", bf16=True, mem_util=0.3, sleep="always", sleep_level=2,
                              enforce_eager=True, max_model_len=512 + 64, requests=32)
    engine = create_engine(settings, model, tokenizer)
    return engine, model, tokenizer


@gpu
def test_greedy_equals_transformers_after_sync(engine_and_model):
    same.test_greedy_equals_transformers_after_sync(engine_and_model)
    engine, _, tokenizer = engine_and_model
    prompts = _prompts(tokenizer)
    for gen, limit in zip(engine.generate(prompts, [3, 5] * 4, temperature=0.0), [3, 5] * 4):
        assert len(gen.token_ids) <= limit  # per-request limits (partial rollout's budget)


@gpu
def test_sleep_wake_sync_keeps_outputs_and_frees_memory(engine_and_model):
    same.test_sleep_wake_sync_keeps_outputs_and_frees_memory(engine_and_model)


@gpu
def test_stops_cut_as_transformers(engine_and_model):
    """SGLang stops at the token ids itself and finds the stop texts after (it runs without a tokenizer)."""
    same.test_stops_cut_as_transformers(engine_and_model)


@gpu
def test_sampling_logprobs_match_trainer(engine_and_model):
    """The mismatch metric's quantity: as small as vLLM's (< 0.05 mean absolute, SmolLM2 in bf16)."""
    same.test_sampling_logprobs_match_trainer(engine_and_model)
