"""Experience layout, micro-batch trimming, and logprobs unchanged by padding."""

import pytest
import torch

from rft_core.engine import Generation, HFEngine
from rft_core.experience import batched_logprobs, build_experience
from rft_core.models import load_model_and_tokenizer, response_logprobs

PROMPTS = [[5, 6, 7], [8], [9, 10]]
GENS = [Generation([11, 12], [-0.1, -0.2]), Generation([13, 14, 15, 2], [-1.0, -2.0, -3.0, -4.0]), Generation([16], [-0.5])]


def test_build_experience_layout():
    exp = build_experience(PROMPTS, GENS, pad_token_id=0)
    assert exp.input_ids.tolist() == [[5, 6, 7, 11, 12, 0, 0], [0, 0, 8, 13, 14, 15, 2], [0, 9, 10, 16, 0, 0, 0]]
    assert exp.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]]
    assert exp.action_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert exp.rollout_logprobs[1].tolist() == [-1.0, -2.0, -3.0, -4.0]


def test_split_trims_padding():
    exp = build_experience(PROMPTS, GENS, pad_token_id=0)
    exp.advantages = torch.tensor([1.0, 2.0, 3.0])
    first, second = exp.split(2)
    assert first.input_ids.tolist() == [[5, 6, 7, 11, 12, 0, 0], [0, 0, 8, 13, 14, 15, 2]]
    # the last row alone: prompt column 0 and response columns 2..4 are padding for it
    assert second.input_ids.tolist() == [[9, 10, 16]]
    assert second.action_mask.tolist() == [[1]]
    assert second.advantages.tolist() == [3.0]
    assert [len(mb) for mb in exp.split(1)] == [1, 1, 1]
    picked = exp.select([2, 0])
    assert picked.advantages.tolist() == [3.0, 1.0] and picked.input_ids.shape == (2, 7)


def test_logprobs_independent_of_padding_and_batching(tiny_model_dir):
    """Each row's response logprobs equal those of the row run alone, unpadded."""
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    model.eval()
    exp = build_experience(PROMPTS, GENS, pad_token_id=0)
    batched = batched_logprobs(model, exp, micro_batch_size=2)  # (B, R)
    for i, (p, g) in enumerate(zip(PROMPTS, GENS)):
        ids = torch.tensor([p + g.token_ids])
        alone, _ = response_logprobs(model, ids, torch.ones_like(ids), len(g.token_ids))
        assert torch.allclose(batched[i, :len(g.token_ids)], alone[0], atol=1e-5)
        assert batched[i, len(g.token_ids):].abs().sum() == 0  # padding positions zeroed


def test_hf_engine_logprobs_match_trainer(tiny_model_dir):
    """The engine's sampling logprobs equal the trainer's for the sampled tokens (same weights)."""
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    engine = HFEngine(model, tokenizer, micro_batch_size=2)
    prompts = [tokenizer("What is 2 + 3?")["input_ids"], tokenizer("Hi")["input_ids"], [1, 2, 3, 4, 5]]
    for temperature in (1.0, 0.7, 0.0):
        gens = engine.generate(prompts, max_new_tokens=6, temperature=temperature)
        assert len(gens) == 3 and all(1 <= len(g.token_ids) <= 6 for g in gens)
        exp = build_experience(prompts, gens, tokenizer.pad_token_id)
        trainer = batched_logprobs(model, exp, micro_batch_size=3, temperature=temperature or 1.0)
        assert torch.allclose(trainer * exp.action_mask, exp.rollout_logprobs, atol=1e-4)


def test_hf_engine_greedy_is_deterministic(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    engine = HFEngine(model, tokenizer)
    prompts = [[1, 2, 3], [7, 8]]
    a = engine.generate(prompts, 5, temperature=0.0)
    b = engine.generate(prompts[::-1], 5, temperature=0.0)[::-1]
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


def test_build_experience_mismatch():
    with pytest.raises(ValueError, match="3 prompts but 2 generations"):
        build_experience(PROMPTS, GENS[:2], 0)


def test_entropy_bonus_gradient(tiny_model_dir):
    """with_entropy="grad" lets the entropy carry a gradient; True gives it detached, for logging."""
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    _, logged = response_logprobs(model, ids, torch.ones_like(ids), 3, with_entropy=True)
    assert not logged.requires_grad
    _, entropy = response_logprobs(model, ids, torch.ones_like(ids), 3, with_entropy="grad")
    entropy.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
