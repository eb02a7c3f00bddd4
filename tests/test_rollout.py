"""Partial rollout (rft_core/rollout.py) against a scripted engine whose responses have known lengths, and the
transformers engine's continuation of a cut-off response."""

import math
import random
from dataclasses import replace

import pytest
import torch

from rft_core.engines.base import Generation, wants_logprobs
from rft_core.experience import Sample
from rft_core.plan import importance_weights, rollout_settings
from rft_core.rollout import Rollouts, RolloutSettings

EOS = 0


class ScriptedEngine:
    """Response i of a prompt is (prompt_ids[0] * 7 + i-th call's salt) % 23 + 1 tokens long, then EOS; token
    t of a response is t + 10 with logprob -t / 100, so a continued response can be checked token for
    token."""

    def __init__(self):
        self.calls = []  # (number of requests, limits)

    def generate(self, prompts, limits, temperature=1.0, top_p=1.0, mm=None, logprob_every=1):
        limits = limits if isinstance(limits, list) else [limits] * len(prompts)
        self.calls.append((len(prompts), list(limits)))
        self.logprob_every = logprob_every
        out = []
        for p, limit in zip(prompts, limits):
            prompt_len = PROMPT_LEN[p[0]]
            done = len(p) - prompt_len  # tokens generated before
            total = LENGTHS[(p[0], p[1])]
            ids = [t + 10 for t in range(done, min(total, done + limit))]
            if done + len(ids) == total:
                ids[-1] = EOS
            logprobs = [-t / 100 for t in range(done, done + len(ids))]
            out.append(Generation(ids, logprobs if wants_logprobs(len(out), logprob_every) else None))
        return out


class Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]


def score_all(samples, strict=False):
    for s in samples:
        s.reward, s.components = float(len(s.generation.token_ids) % 3), {}
    return 0


score_all.check = lambda failed, total, step, env_failed=0: None
N_PROMPTS, GROUP = 40, 2
PROMPT_LEN = {i: 3 for i in range(N_PROMPTS)}
# (prompt id, sample within the group) -> length; heavy-tailed: most short, some up to 24
rng = random.Random(0)
LENGTHS = {(i, j): rng.choice([2, 3, 4, 5, 20, 24]) for i in range(N_PROMPTS) for j in range(GROUP)}


def prompts():
    # the second token tells the group's samples apart (the engine's script keys on it)
    return [Sample([i, 0, 99], str(i), f"p{i}") for i in range(N_PROMPTS)]


def make(partial=True, budget=4, staleness=1, rounds=2, max_len=24, prompts_=None, inflight=1.0):
    settings = RolloutSettings(GROUP, max_len, max_rounds=rounds, partial=partial, token_budget=budget,
                               max_staleness=staleness, eos_token_id=EOS, inflight_ratio=inflight)
    r = Rollouts(prompts_ or prompts(), 4, seed=0, rank=0, world=1, settings=settings, device="cpu")
    return r


class PerSample(Rollouts):
    """Group samples are told apart by their second prompt token (0 or 1), as the scripted engine expects."""

    def _new_group(self, version):
        g = super()._new_group(version)
        for j, s in enumerate(g.samples):
            s.prompt_ids = [s.prompt_ids[0], j, 99]
        return g

    def draw(self):
        batch = super().draw()
        return [Sample([p.prompt_ids[0], j % GROUP, 99], p.label, p.prompt) for j, p in enumerate(batch)]


def collect(r, engine, step):
    return r.collect(engine, Tok(), score_all, lambda t: t, step)


def per_sample(**kw):
    r = make(**kw)
    r.__class__ = PerSample
    return r


@pytest.mark.parametrize("staleness,inflight", [(0, 1.0), (1, 1.0), (3, 1.0), (0, 2.0), (1, 2.0), (3, 2.5)])
def test_every_step_trains_k_finished_groups_within_the_staleness_bound(staleness, inflight):
    r, engine = per_sample(staleness=staleness, inflight=inflight), ScriptedEngine()
    seen = {"resumed": 0, "from_buffer": 0}
    for step in range(1, 13):
        samples, m = collect(r, engine, step)
        assert len(samples) == 4 * GROUP and m["rollout/filled_groups"] == 0
        for s in samples:
            gen = s.generation
            total = LENGTHS[(s.prompt_ids[0], s.prompt_ids[1])]
            # the whole response, token for token, however many rounds and steps it took
            assert gen.token_ids == [t + 10 for t in range(total - 1)] + [EOS]
            assert gen.logprobs == [-t / 100 for t in range(total)]
            assert len(gen.versions) == total and gen.versions == sorted(gen.versions)
            assert max(step - 1 - v for v in gen.versions) <= staleness  # no token older than the bound
        assert m["rollout/staleness_max"] <= staleness
        seen["resumed"] += m["rollout/resumed"]
        seen["from_buffer"] += m["rollout/finished_from_buffer"]
    if staleness:
        assert seen["resumed"] > 0 and seen["from_buffer"] > 0
    else:  # nothing may wait: every response finishes in the step that started it
        assert seen["resumed"] == 0 and seen["from_buffer"] == 0 and not r.buffer


def test_a_budget_of_the_whole_length_is_the_synchronous_rollout():
    """With a budget >= max_len nothing is cut off: the same requests, the same samples as without (the
    in-flight ratio then draws only what a step needs)."""
    outs = []
    for partial in (False, True):
        r, engine = make(partial=partial, budget=24, inflight=2.0), ScriptedEngine()
        r.__class__ = PerSample
        steps = [collect(r, engine, step)[0] for step in range(1, 4)]
        outs.append(([[(s.prompt_ids, s.generation.token_ids, s.reward) for s in ss] for ss in steps],
                     [(n, set(limits)) for n, limits in engine.calls]))
    assert outs[0] == outs[1]


def test_the_buffer_survives_a_checkpoint():
    r, engine = per_sample(), ScriptedEngine()
    for step in range(1, 4):
        collect(r, engine, step)
    assert r.buffer  # something is waiting
    state = torch.load(_roundtrip(r.buffer_state()), weights_only=True)
    restored = make()
    restored.__class__ = PerSample
    restored.load_state_dict(r.state_dict(), state)
    for step in range(4, 8):
        a, ma = collect(r, ScriptedEngine(), step)
        b, mb = collect(restored, ScriptedEngine(), step)
        assert [(s.prompt_ids, s.generation, s.reward) for s in a] == [(s.prompt_ids, s.generation, s.reward)
                                                                        for s in b]
        ma.pop("perf/score_s"), mb.pop("perf/score_s")  # seconds: the rest is the same
        assert ma == mb


def _roundtrip(obj):
    import io
    f = io.BytesIO()
    torch.save(obj, f)
    f.seek(0)
    return f


def test_a_continued_response_equals_an_uninterrupted_one(tiny_model_dir):
    """Greedy, unchanged weights: 3 tokens, then 5 more from prompt + those 3 (token ids in, token ids out),
    are the 8 tokens of one uninterrupted generation, with the same logprobs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rft_core.engines.hf import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFEngine(model, tokenizer)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    whole = engine.generate(prompts, 8, temperature=0.0)
    first = engine.generate(prompts, [3, 3], temperature=0.0)
    rest = engine.generate([p + g.token_ids for p, g in zip(prompts, first)], [5, 5], temperature=0.0)
    for w, a, b in zip(whole, first, rest):
        if tokenizer.eos_token_id in a.token_ids:
            continue
        assert w.token_ids == a.token_ids + b.token_ids
        assert w.logprobs == pytest.approx(a.logprobs + b.logprobs, abs=1e-5)


def test_slot_utilization_rises_with_a_budget():
    """rollout/slot_utilization = tokens generated / (requests x longest output) per call: the heavy-tailed
    script leaves most of a synchronous batch idle; a budget of 4 tokens keeps more of it busy."""
    util = {}
    for partial in (False, True):
        r, engine = per_sample(partial=partial, staleness=3), ScriptedEngine()
        steps = [collect(r, engine, step) for step in range(1, 9)]
        util[partial] = sum(m["rollout/slot_utilization"] for _, m in steps) / len(steps)
        if not partial:  # one call a step, every sample of it trained: the ratio exactly
            samples, m = steps[0]
            lengths = [len(s.generation.token_ids) for s in samples]
            assert m["rollout/tokens_generated"] == sum(lengths)
            assert m["rollout/slot_utilization"] == pytest.approx(sum(lengths)
                                                                  / (len(lengths) * max(lengths)))
    assert util[True] > util[False] + 0.2


def test_the_inflight_ratio_keeps_rounds_full():
    """--inflight_ratio R: fresh prompts are drawn until R x k groups are in hand (generating or ready), so
    the first round holds R x k groups and later rounds top it up; the steps need fewer rounds than with 1
    (only the groups still needed); every step still trains k groups (the staleness test, parametrized)."""
    rounds = {}
    for inflight in (1.0, 2.5):
        r, engine = per_sample(staleness=3, inflight=inflight), ScriptedEngine()
        steps = [collect(r, engine, step)[1] for step in range(1, 13)]
        assert engine.calls[0][0] == GROUP * math.ceil(4 * inflight)  # k = 4 groups a step
        rounds[inflight] = sum(m["rollout/generation_rounds"] for m in steps)
    assert rounds[2.5] < rounds[1.0]


@pytest.mark.parametrize("partial,tis_cap,every", [(False, None, 8), (False, 2.0, 1), (True, None, 1)])
def test_engine_logprobs_for_all_samples_only_where_tokens_are_weighted_by_them(partial, tis_cap, every):
    """TIS and partial rollout weight every token by its engine logprob, so every sample has them; otherwise
    they feed only the engine-vs-trainer metric and one sample in 8 asks for them."""
    from types import SimpleNamespace

    args = SimpleNamespace(max_token_budget=None, generate_max_len=24, n_samples_per_prompt=GROUP,
                           temperature=1.0, top_p=1.0, dynamic_sampling=False, max_num_gen_batches=1,
                           overlong_buffer_len=0, overlong_penalty_factor=1.0, reward_failure_limit=1.0,
                           partial_rollout=partial, max_staleness=1, inflight_ratio=1.0, tis_cap=tis_cap,
                           tis_level=None)
    settings = replace(rollout_settings(args, importance_weights(args)[0]), eos_token_id=EOS)
    assert settings.logprob_every == every
    r = Rollouts(prompts(), 4, seed=0, rank=0, world=1, settings=settings, device="cpu")
    r.__class__ = PerSample
    engine = ScriptedEngine()
    for step in (1, 2, 3):
        samples, _ = collect(r, engine, step)
        assert engine.logprob_every == every
        with_logprobs = [s.generation.logprobs is not None for s in samples]
        assert with_logprobs == [i % every == 0 for i in range(len(samples))]


def test_the_default_budget():
    """A quarter of the length, per round."""
    from types import SimpleNamespace

    args = SimpleNamespace(max_token_budget=None, generate_max_len=2048, n_samples_per_prompt=GROUP,
                           temperature=1.0, top_p=1.0, dynamic_sampling=False, max_num_gen_batches=1,
                           overlong_buffer_len=0, overlong_penalty_factor=1.0, reward_failure_limit=1.0,
                           partial_rollout=True, max_staleness=2, inflight_ratio=1.0, tis_cap=None,
                           tis_level=None)
    assert rollout_settings(args, importance_weights(args)[0]).token_budget == 512
