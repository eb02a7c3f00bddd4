"""Stops (--stop; engines/base.py: stop_end, cut_at_stop; plan.with_stops): a response ends at the token that
completes its first stop (a stop token, or a stop text in its decoded prefix), kept with the text as sampled,
in every engine; checked against a reference written token by token."""

import random
import sys
from types import SimpleNamespace

import pytest
import torch

import train_ppo
from rft_core.engines.base import Generation, cut_at_stop, stop_end
from rft_core.engines.hf import HFEngine
from rft_core.errors import ConfigError
from rft_core.plan import resolve, with_stops
from rft_core.rollout import Rollouts, RolloutSettings


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def reference_end(ids, tokenizer, stop=(), stop_token_ids=()):
    """The first k whose token is a stop token or whose decoded prefix ids[:k] holds a stop text, k by k."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=False)
        if ids[k - 1] in stop_token_ids or any(s in text for s in stop):
            return k
    return None


def test_the_first_stop_ends_a_response(tokenizer):
    ids = tokenizer.encode("Call <lookup>x</lookup> done", add_special_tokens=False)
    pieces = ["Call", " <", "lookup", ">", "x", "</", "lookup", ">", " done"]
    assert [tokenizer.decode([t]) for t in ids] == pieces
    gt = ids[3]  # ">"
    cases = [(("ook",), (), 3),  # inside a token: the token that holds it ends the response
             (("</lookup>",), (), 8),  # spanning tokens: the token that completes it
             (("done", "x</"), (), 6), (("x</", "done"), (), 6),  # several: the first to complete wins
             ((), (gt,), 4), (("ook",), (gt,), 3), (("</lookup>",), (gt, ids[-1]), 4),  # token ids
             (("</lookup>",), (ids[-1],), 8), (("nowhere",), (7,), None), ((), (), None)]
    for stop, stop_ids, end in cases:
        assert stop_end(ids, tokenizer, stop, stop_ids) == end
        assert reference_end(ids, tokenizer, stop, stop_ids) == end
    gen = cut_at_stop(ids, [float(i) for i in range(9)], tokenizer, ("x</",))
    assert (gen.token_ids, gen.logprobs, gen.finish) == (ids[:6], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "stop")
    assert tokenizer.decode(gen.token_ids).endswith("x</")  # the stop text kept as sampled
    gen = cut_at_stop(ids, None, tokenizer, ("nowhere",), (7,))
    assert (gen.token_ids, gen.logprobs, gen.finish) == (ids, None, "length")
    assert stop_end([], tokenizer, ("a",), (1,)) is None


def test_the_search_matches_the_reference_on_random_responses(tokenizer):
    """Binary search on the prefix length (O(log n) decodes) finds what the token-by-token loop finds."""
    rng = random.Random(0)
    pool = tokenizer.encode("a ab abc </call> 12 + 3 = 15 é ü 你好 <|im_end|> \n\n", add_special_tokens=False)
    for _ in range(200):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 30))]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        stop = tuple(text[i:i + rng.randint(1, 6)] for i in rng.sample(range(len(text)), min(2, len(text))))
        stop_ids = tuple(rng.sample(pool, rng.randint(0, 1)))
        assert stop_end(ids, tokenizer, stop, stop_ids) == reference_end(ids, tokenizer, stop, stop_ids)


def cut_reference(gen, tokenizer, stop=(), stop_ids=()):
    end = reference_end(gen.token_ids, tokenizer, stop, (tokenizer.eos_token_id, *stop_ids))
    return gen.token_ids[:end], gen.logprobs[:end]


def test_the_transformers_engine_stops_at_texts_and_token_ids(model, tokenizer):
    """The same seeded samples without and with stops: with them, each response is the one without cut at its
    first stop (finish "stop", logprobs alike), or whole where none occurs (finish "length"); generation
    itself stops there (one forward a token), and a stop text in the prompt's tail ends nothing."""
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("Call <lookup>x", "Hi")]

    def run(**stops):
        torch.manual_seed(0)
        return HFEngine(model, tokenizer, **stops).generate(prompts, 12)

    free = run()
    assert all(g.finish == "length" and len(g.token_ids) == 12 for g in free)
    texts = [tokenizer.decode(g.token_ids[:n], skip_special_tokens=False) for g, n in zip(free, (6, 4))]
    assert "x" not in texts[0]
    stop = (texts[0][-3:], texts[1][-2:], "x")  # inside or across tokens; "x" ends the first prompt
    steps = []
    hook = model.register_forward_hook(lambda *a: steps.append(1))
    stopped = run(stop=stop)
    hook.remove()
    for g, f in zip(stopped, free):
        assert (g.token_ids, g.logprobs) == cut_reference(f, tokenizer, stop) and g.finish == "stop"
    assert len(stopped[0].token_ids) <= 6 and len(stopped[1].token_ids) <= 4
    assert len(steps) == max(len(g.token_ids) for g in stopped)
    token = free[1].token_ids[3]
    by_id = run(stop_token_ids=(token,))
    assert by_id[1].finish == "stop" and by_id[1].token_ids[-1] == token
    for g, f in zip(by_id, free):
        assert (g.token_ids, g.logprobs) == cut_reference(f, tokenizer, (), (token,))
    assert [g.finish for g in by_id] == ["stop" if token in f.token_ids else "length" for f in free]


def test_stops_are_read_against_the_tokenizer(tokenizer, tmp_path):
    """--stop: a special token's text and id:N stop at a token id, other items at their text; a bad id or an
    empty stop is one line naming the fix. The engine's settings and the rollout's get them."""
    cpu = SimpleNamespace(type="cpu")
    accelerator = SimpleNamespace(num_processes=1, parallelism_config=None, device=cpu,
                                  state=SimpleNamespace(deepspeed_plugin=None),
                                  distributed_type=SimpleNamespace(name="NO"))
    args = train_ppo.Args(output_dir=str(tmp_path), stop=("</lookup>", "<|im_end|>", "id:7"))
    plan = resolve(args, accelerator)
    assert plan.engine.stop == () and plan.engine.stop_token_ids == ()  # until the tokenizer is there
    plan = with_stops(plan, [*args.stop, "</lookup>", "Answer:"], tokenizer)
    assert plan.engine.stop == ("</lookup>", "Answer:") == plan.rollout.stop
    assert plan.engine.stop_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"), 7)
    with pytest.raises(ConfigError, match=r"--stop id:49152: not a token id of the tokenizer \(id:0 to"):
        with_stops(plan, ["id:49152"], tokenizer)
    with pytest.raises(ConfigError, match="--stop id:x: not a token id"):
        with_stops(plan, ["id:x"], tokenizer)
    for bad in ("", None, ["a"]):
        with pytest.raises(ConfigError, match="a stop is a non-empty string"):
            with_stops(plan, [bad], tokenizer)
    assert train_ppo.Args().stop == ()


class _Chunks:
    """An engine that continues a response by replaying `tokens` chunk by chunk (no stops of its own)."""

    def __init__(self, tokens, prompt_len):
        self.tokens, self.prompt_len = tokens, prompt_len

    def generate(self, prompts, limits, temperature=1.0, top_p=1.0, mm=None, logprob_every=1):
        out = []
        for p, limit in zip(prompts, limits):
            done = len(p) - self.prompt_len
            ids = self.tokens[done:done + limit]
            out.append(Generation(ids, [-1.0] * len(ids), finish="length"))
        return out


def test_partial_rollout_finds_a_stop_across_two_chunks(tokenizer):
    """Partial rollout continues a response in later rounds: a stop text split between two rounds' chunks
    (which the engine cannot see: the first chunk is its prompt) ends the response at the token completing
    it, the rest of the round's chunk dropped, and the sample finished."""
    from rft_core.experience import Sample

    tokens = tokenizer.encode("Call <lookup>x</lookup> done and more text", add_special_tokens=False)
    prompt = Sample(prompt_ids=[1, 2], label="", prompt="p")
    settings = RolloutSettings(group_size=1, max_new_tokens=12, partial=True, token_budget=6, max_staleness=4,
                               eos_token_id=tokenizer.eos_token_id, stop=("</lookup>",), max_rounds=3)
    rollouts = Rollouts([prompt] * 4, 1, 0, 0, 1, settings, "cpu")

    def score_all(samples, strict=False):
        for s in samples:
            s.reward, s.components = 1.0, {}
        return 0

    score_all.check = lambda *a: None
    samples, _ = rollouts.collect(_Chunks(tokens, 2), tokenizer, score_all, lambda t: t, step=1)
    (sample,) = samples
    assert tokenizer.decode(tokens[:6]).endswith("</") and sample.generation.token_ids == tokens[:8]
    assert len(sample.generation.logprobs) == len(sample.generation.versions) == 8


def test_engines_cut_as_the_transformers_engine(tokenizer, monkeypatch):
    """vLLM and SGLang (scripted stand-ins, no GPU): each asks its engine to stop at the stops it can (vLLM:
    texts, detokenized with the stop kept; SGLang: token ids only, it runs without a tokenizer) and cuts what
    comes back at the first stop, as cut_at_stop does for the transformers engine."""
    from rft_core.engines.sglang import SGLangEngine
    from rft_core.engines.vllm import VLLMEngine

    ids = tokenizer.encode("Call <lookup>x</lookup> done", add_special_tokens=False)
    stop, stop_ids, seen = ("</lookup>",), (2, 7), []
    params = SimpleNamespace(SamplingParams=lambda **kw: seen.append(kw) or kw)
    monkeypatch.setitem(sys.modules, "vllm", params)

    class Llm:
        def generate(self, prompts, params, use_tqdm=False):  # vLLM returns the step's tokens past the stop
            sample = SimpleNamespace(token_ids=ids, logprobs=SimpleNamespace(logprobs=[-0.5] * len(ids)))
            return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=[sample])
                    for p in prompts]

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine.tp_group, engine.logit_bias, engine.seed, engine.calls = Llm(), None, None, 0, 0
    engine.stop, engine.stop_token_ids, engine.tokenizer = stop, stop_ids, tokenizer
    (gen,) = engine.generate([[1, 2]], 16)
    assert (gen.token_ids, gen.finish, len(gen.logprobs)) == (ids[:8], "stop", 8)
    (kw,) = seen
    assert kw["stop"] == ["</lookup>"] and kw["detokenize"] and kw["include_stop_str_in_output"]
    assert kw["stop_token_ids"] == [2, 7]

    class Sgl:
        def generate(self, input_ids, sampling_params, return_logprob):
            self.params = sampling_params
            logprobs = [(-0.5, t, None) for t in ids]
            return [{"output_ids": ids, "meta_info": {"prompt_tokens": len(p),
                                                      "output_token_logprobs": logprobs}} for p in input_ids]

    engine = SGLangEngine.__new__(SGLangEngine)
    engine.llm, engine.tp_group, engine.blocked_token_ids = Sgl(), None, []
    engine.stop, engine.stop_token_ids, engine.tokenizer = stop, stop_ids, tokenizer
    (gen,) = engine.generate([[1, 2]], 16)
    assert (gen.token_ids, gen.finish, len(gen.logprobs)) == (ids[:8], "stop", 8)
    assert engine.llm.params[0]["stop_token_ids"] == [2, 7] and "stop" not in engine.llm.params[0]


@pytest.mark.slow
def test_a_run_stops_at_its_stops(tiny_model_dir, tmp_path):
    """train_ppo.py with --stop (a text, a special token, a token id): two steps run, the plan records the
    stops read against the tokenizer, and responses end at the first "e" (a random model's tokens often hold
    one), far short of the limit."""
    import json

    from conftest import read_metrics, run_script

    out = tmp_path / "run"
    run_script("train_ppo.py", ["--pretrain", tiny_model_dir, "--max_steps", "2", "--rollout_batch_size", "2",
                                "--n_samples_per_prompt", "4", "--generate_max_len", "16",
                                "--micro_train_batch_size", "4", "--log_samples_steps", "1",
                                "--stop", "e", "<|im_end|>", "id:5", "--output_dir", str(out)])
    engine = json.load(open(out / "config.json"))["plan"]["engine"]
    assert engine["stop"] == ["e"] and engine["stop_token_ids"] == [2, 5]
    steps, evals = read_metrics(str(out))
    assert [r["step"] for r in steps] == [1, 2] and all(r["rollout/response_length"] < 8 for r in steps)
    for row in map(json.loads, (out / "samples.jsonl").read_text().splitlines()):
        c = row["completion"]
        assert "e" not in c or len(c) - c.index("e") <= 16  # nothing after the token that held the first "e"
