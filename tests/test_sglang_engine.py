"""SGLang engine (--engine_type sglang): request building and output parsing on CPU (no sglang needed);
greedy equality with transformers after a sync, sleep / wake and the logprob diff on GPU (marked, skipped
without CUDA and sglang)."""

import importlib.util

import pytest
import torch

from rft_core.sglang_engine import generation_of, sampling_params
from test_vllm_engine import _hf_greedy, _prompts

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("sglang")),
                         reason="needs a CUDA GPU and sglang")


def test_sampling_params_per_request():
    params = sampling_params([3, 8], 0.7, 0.9, eos_token_id=2)
    assert [p["max_new_tokens"] for p in params] == [3, 8]
    assert all(p["temperature"] == 0.7 and p["top_p"] == 0.9 and p["stop_token_ids"] == [2] for p in params)
    greedy = sampling_params([4], 0.0, 0.9, eos_token_id=2)[0]  # SGLang: temperature 0 is greedy
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0


def test_generation_of_an_output():
    out = {"output_ids": [5, 9, 2], "meta_info": {"output_token_logprobs": [(-0.5, 5, None), (-1.25, 9, None),
                                                                             (-0.125, 2, None)]}}
    gen = generation_of(out)
    assert gen.token_ids == [5, 9, 2] and gen.logprobs == [-0.5, -1.25, -0.125]
    out["meta_info"]["output_token_logprobs"] = out["meta_info"]["output_token_logprobs"][:2]
    with pytest.raises(RuntimeError, match="2 logprobs, 3 tokens"):
        generation_of(out)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_asking_for_sglang_without_it_is_one_line():
    from rft_core.engine import resolve_engine_type
    from rft_core.errors import MissingDependency

    with pytest.raises(MissingDependency, match=r"--engine_type sglang needs sglang \(pip install sglang==0.5.17\)"):
        resolve_engine_type("sglang")


# ---- GPU (run on the GPU machine with bench/sglang_wheels.txt installed; one engine, shared) ----

@pytest.fixture(scope="module")
def engine_and_model():
    from rft_core.engine import create_engine
    from rft_core.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer()
    model = model.cuda()
    engine = create_engine("sglang", model, tokenizer, bf16=True, mem_util=0.3, sleep="always",
                           sleep_level=2, enforce_eager=True, max_model_len=512 + 64, requests=32)
    return engine, model, tokenizer


@gpu
def test_greedy_equals_transformers_after_sync(engine_and_model):
    engine, model, tokenizer = engine_and_model
    prompts = _prompts(tokenizer)
    with torch.no_grad():  # move the weights, as a training step would, then sync
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3 * p.abs().mean())
    engine.update_weights(model)
    ours = engine.generate(prompts, 24, temperature=0.0)
    theirs, bf16 = _hf_greedy(model, tokenizer, prompts, 24)
    ours_ids = [g.token_ids for g in ours]
    assert sum(a == b for a, b in zip(ours_ids, theirs)) >= len(prompts) // 2
    for p, a, b in zip(prompts, ours_ids, theirs):  # a divergence is allowed only at a bf16 near-tie
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            assert a == b  # the EOS included, as the trainer keeps it
            continue
        with torch.no_grad():
            logits = bf16(torch.tensor([p + b[:k]], device="cuda")).logits[0, -1].float()
        assert logits[b[k]] - logits[a[k]] < 0.5, (k, a, b)
    for gen, limit in zip(engine.generate(prompts, [3, 5] * 4, temperature=0.0), [3, 5] * 4):
        assert len(gen.token_ids) <= limit  # per-request limits (partial rollout's budget)


@gpu
def test_sleep_wake_sync_keeps_outputs_and_frees_memory(engine_and_model):
    engine, model, tokenizer = engine_and_model
    prompts = _prompts(tokenizer)
    before = [g.token_ids for g in engine.generate(prompts, 24, temperature=0.0)]
    free_awake, _ = torch.cuda.mem_get_info()
    assert engine.sleep() is True
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep - free_awake > 1 << 30  # the KV cache (and weights) went
    engine.update_weights(model)
    engine.wake_up()
    assert [g.token_ids for g in engine.generate(prompts, 24, temperature=0.0)] == before


@gpu
def test_sampling_logprobs_match_trainer(engine_and_model):
    """The mismatch metric's quantity: as small as vLLM's (< 0.05 mean absolute, SmolLM2 in bf16)."""
    from rft_core.experience import batched_logprobs, build_experience

    engine, model, tokenizer = engine_and_model
    prompts = _prompts(tokenizer) * 4
    gens = engine.generate(prompts, 32, temperature=1.0)
    exp = build_experience(prompts, gens, tokenizer.pad_token_id, "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        trainer = batched_logprobs(model, exp, temperature=1.0, micro_batch_size=32)
    diff = ((trainer - exp.rollout_logprobs).abs() * exp.action_mask).sum() / exp.action_mask.sum()
    assert diff.item() < 0.05, diff.item()
