"""Experience layout, micro-batch trimming, and logprobs unchanged by padding."""

import pytest
import torch

from rft_core.engines.base import Generation
from rft_core.engines.hf import HFEngine
from rft_core.experience import Forward, batched_forward, batched_logprobs, build_experience
from rft_core.logprobs import response_logprobs
from rft_core.models import load_model_and_tokenizer

PROMPTS = [[5, 6, 7], [8], [9, 10]]
GENS = [Generation([11, 12], [-0.1, -0.2]), Generation([13, 14, 15, 2], [-1.0, -2.0, -3.0, -4.0]),
        Generation([16], [-0.5])]


def test_build_experience_layout():
    exp = build_experience(PROMPTS, GENS, pad_token_id=0)
    # 3 + 4 columns, and one more of response padding for a multiple of 8
    assert exp.input_ids.tolist() == [[5, 6, 7, 11, 12, 0, 0, 0], [0, 0, 8, 13, 14, 15, 2, 0],
                                      [0, 9, 10, 16, 0, 0, 0, 0]]
    assert exp.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 0],
                                           [0, 1, 1, 1, 0, 0, 0, 0]]
    assert exp.action_mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    assert exp.rollout_logprobs[1].tolist() == [-1.0, -2.0, -3.0, -4.0, 0.0]


def test_split_trims_padding():
    exp = build_experience(PROMPTS, GENS, pad_token_id=0)
    exp.advantages = torch.tensor([1.0, 2.0, 3.0])
    first, second = exp.split(2)
    assert first.input_ids.tolist() == [[5, 6, 7, 11, 12, 0, 0, 0], [0, 0, 8, 13, 14, 15, 2, 0]]
    assert second.input_ids.tolist() == [[0, 9, 10, 16, 0, 0, 0, 0]]  # 3 columns used, 8 kept
    assert second.action_mask.tolist() == [[1, 0, 0, 0, 0]]
    assert second.advantages.tolist() == [3.0]
    assert [len(mb) for mb in exp.split(1)] == [1, 1, 1]
    picked = exp.select([2, 0])
    assert picked.advantages.tolist() == [3.0, 1.0] and picked.input_ids.shape == (2, 8)
    exp = build_experience([[5] * 9, [6]], [Generation([7], [0.0]), Generation([8], [0.0])], 0)
    assert exp.input_ids.shape == (2, 16)
    assert exp.split(1)[1].input_ids.tolist() == [[6, 8] + [0] * 6]  # 2 columns used, 8 kept


def test_split_widths_are_multiples_of_8_where_the_padding_allows():
    """One shape class for a compiled model: a trimmed width grows to a multiple of 8, the responses' padding
    first, then the prompts'; the rows' tokens and masks are the same ones."""
    prompts = [[5] * 3, [6] * 10]
    exp = build_experience(prompts, [Generation([7] * 2, [0.0] * 2), Generation([8] * 9, [0.0] * 9)], 0)
    assert exp.input_ids.shape == (2, 24)  # 10 + 9, and 5 columns of response padding
    first, second = exp.split(1)
    # row 0 alone: its prompt's 3 + 2 = 5 columns -> 8, with 3 of its response padding columns
    assert first.input_ids.tolist() == [[5, 5, 5, 7, 7, 0, 0, 0]] and first.action_mask.shape == (1, 5)
    assert second.input_ids.shape == (1, 24)  # row 1 alone: 19 -> 24
    exp = build_experience([[5] * 2, [6] * 14], [Generation([7] * 2, [0.0] * 2), Generation([8], [0.0])], 0)
    assert exp.input_ids.shape == (2, 16)  # 14 + 2: no response padding added
    first = exp.split(1)[0]  # row 0: 2 + 2 = 4 -> 8, none of response padding left: 4 of the prompt's
    assert first.input_ids.tolist() == [[0, 0, 0, 0, 5, 5, 7, 7]]
    assert (first.attention_mask.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
            and first.action_mask.tolist() == [[1, 1]])


def test_batched_forward_stores_any_dtype_as_fp32():
    """A pass computed in bf16 (FSDP2's reference model) fills the (B, T) fp32 buffer like an fp32 one: the
    values of each micro-batch's response tokens, zeros elsewhere (it raised a dtype error before)."""
    exp = build_experience(PROMPTS, GENS, pad_token_id=0)
    bf16 = lambda mb: mb.action_mask.to(torch.bfloat16) * -0.5  # noqa: E731
    out = batched_forward(exp, bf16, micro_batch_size=2)
    assert out.dtype == torch.float32
    assert out.tolist() == (exp.action_mask * -0.5).tolist()


def test_micro_batches_by_tokens():
    """A token budget groups rows of similar length, each micro-batch's padded size (rows x (longest prompt +
    longest response)) within it, every row exactly once; a row over the budget goes alone; a synced count
    above the local one halves the costliest micro-batches until it is met."""
    import random

    rng = random.Random(0)
    prompts = [[1] * rng.randint(1, 20) for _ in range(37)]
    gens = [Generation([3] * rng.randint(1, 30), [0.0] * 30) for _ in range(37)]
    gens = [Generation(g.token_ids, g.logprobs[:len(g.token_ids)]) for g in gens]
    exp = build_experience(prompts, gens, pad_token_id=0)

    def padded(rows):
        return len(rows) * (max(len(prompts[i]) for i in rows) + max(len(gens[i].token_ids) for i in rows))

    for budget in (30, 64, 200, 10_000):
        groups = exp.micro_batch_rows(max_tokens=budget)
        assert sorted(i for g in groups for i in g) == list(range(37))
        assert all(padded(g) <= budget or len(g) == 1 for g in groups)
        mbs = exp.split(max_tokens=budget)
        # trimmed to that, then up to a multiple of 8 columns (the whole width, 56, is one)
        widths = [padded(g) // len(g) for g in groups]
        assert [mb.input_ids.shape for mb in mbs] == [(len(g), w + -w % 8) for g, w in zip(groups, widths)]
    assert len(exp.micro_batch_rows(max_tokens=10_000)) == 1
    assert len(exp.micro_batch_rows(max_tokens=1)) == 37  # each row alone
    local = len(exp.micro_batch_rows(max_tokens=200))
    groups = exp.micro_batch_rows(max_tokens=200, sync_count=lambda n: n + 3)
    assert len(groups) == local + 3 and sorted(i for g in groups for i in g) == list(range(37))
    with pytest.raises(ValueError, match="cannot make"):
        exp.micro_batch_rows(max_tokens=200, sync_count=lambda n: 38)
    assert exp.micro_batch_rows(micro_batch_size=16) == [list(range(16)), list(range(16, 32)),
                                                         list(range(32, 37))]


def test_logprobs_independent_of_padding_and_batching(tiny_model_dir):
    """Each row's response logprobs equal those of the row run alone, unpadded."""
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    model.eval()
    exp = build_experience(PROMPTS, GENS, pad_token_id=0)
    batched = batched_logprobs(model, exp, micro_batch_size=2)  # (B, R)
    # by tokens, regrouped
    assert torch.allclose(batched_logprobs(model, exp, max_tokens=8), batched, atol=1e-5)
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
        trainer = batched_logprobs(model, exp, Forward(temperature or 1.0), micro_batch_size=3)
        assert torch.allclose(trainer * exp.action_mask, exp.rollout_logprobs, atol=1e-4)


def test_hf_engine_returns_the_logprobs_of_every_kth_request(tiny_model_dir):
    """logprob_every=k: the sampling logprobs of requests 0, k, 2k, ... only (0: none), the tokens unchanged;
    the Experience marks the other rows' engine logprobs NaN on their response tokens."""
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    engine = HFEngine(model, tokenizer, micro_batch_size=2)
    prompts = [[1, 2, 3], [7, 8], [4, 5, 6, 7], [9], [3, 3]]
    every = engine.generate(prompts, 5, temperature=0.0)
    some = engine.generate(prompts, 5, temperature=0.0, logprob_every=3)
    none = engine.generate(prompts, 5, temperature=0.0, logprob_every=0)
    assert [g.token_ids for g in some] == [g.token_ids for g in every] == [g.token_ids for g in none]
    assert [g.logprobs is not None for g in some] == [True, False, False, True, False]
    assert some[0].logprobs == every[0].logprobs and some[3].logprobs == every[3].logprobs
    assert all(g.logprobs is None for g in none)
    exp = build_experience(prompts, some, tokenizer.pad_token_id)
    lengths = [len(g.token_ids) for g in some]
    for i, n in enumerate(lengths):
        assert exp.rollout_logprobs[i, :n].isnan().all() == (i not in (0, 3))
        assert not exp.rollout_logprobs[i, n:].isnan().any()  # padding stays 0
    assert torch.equal(exp.rollout_logprobs[3, :lengths[3]], torch.tensor(every[3].logprobs))


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


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_packed_equals_padded(tiny_model_dir, chunk_size):
    """--packing_samples: one row without padding, positions restarting per sample, gives the padded path's
    logprobs, entropy (with its gradient) and parameter gradients, on samples of several prompt and response
    lengths (prompts left-padded, responses right-padded in the padded layout); and a token of one sample
    does not see the others (changing another sample leaves its logprobs)."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from rft_core.experience import micro_batch_logprobs, micro_batch_values
    from rft_core.model_training import load_value_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (4, 1, 6, 2)]
    gens = [Generation(torch.randint(3, 90, (n,), generator=g).tolist(), [0.0] * n) for n in (3, 5, 1, 2)]
    exp = build_experience(prompts, gens, pad_token_id=0)
    upstream = torch.randn(exp.action_mask.shape, generator=g)
    results = []
    for packed in (False, True):
        model.zero_grad()
        logprobs, entropy = micro_batch_logprobs(model, exp, Forward(0.9, chunk_size, packed), "grad")
        ((logprobs + 0.5 * entropy) * upstream * exp.action_mask).sum().backward()
        results.append((logprobs.detach(), entropy.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp, ent, grads), (plp, pent, pgrads) = results
    assert (torch.allclose(lp * exp.action_mask, plp, atol=1e-5)
            and torch.allclose(ent * exp.action_mask, pent, atol=1e-5))
    assert (plp * (1 - exp.action_mask)).abs().sum() == 0  # zeros on the padding
    assert all(torch.allclose(grads[n], pgrads[n], rtol=1e-4, atol=1e-5) for n in grads)
    other = exp.input_ids.clone()
    other[1, exp.input_ids.shape[1] - exp.action_mask.shape[1] + 1] = 77  # sample 1's second response token
    with torch.no_grad():
        moved = micro_batch_logprobs(model, replace(exp, input_ids=other), Forward(0.9, chunk_size, True))[0]
    assert (torch.allclose(moved[[0, 2, 3]], plp[[0, 2, 3]], atol=1e-6)
            and not torch.allclose(moved[1], plp[1]))
    critic = load_value_model(actor=model)
    torch.nn.init.normal_(critic.score.weight)
    with torch.no_grad():
        values = [micro_batch_values(critic, exp, Forward(packed=packed)) * exp.action_mask
                  for packed in (False, True)]
    assert torch.allclose(values[0], values[1], atol=1e-5) and values[0].abs().sum() > 0
    # the token budget counts a packed micro-batch's real tokens, not its padding
    lengths = exp.attention_mask.sum(-1).tolist()
    assert len(exp.micro_batch_rows(max_tokens=sum(lengths), packed=True)) == 1
    assert len(exp.micro_batch_rows(max_tokens=sum(lengths))) > 1  # padded, the same rows need more room
