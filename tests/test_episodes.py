"""Multi-turn rollouts (rft_core/episodes.py): token in / token out against a scripted engine and the
transformers engine, the environment's tokens kept out of every loss and statistic, environment faults, the
calculator task, and the flags' checks."""

import math
import time
from dataclasses import replace

import pytest
import torch

from rft_core.advantages import gae, token_level_advantages, token_rewards, whiten
from rft_core.engines.base import Generation
from rft_core.environments import HostedEnv, State, load_env, parse_step
from rft_core.episodes import EpisodeRunner, EpisodeSettings, episode_metrics, score
from rft_core.experience import Experience, Forward, Sample, build_experience
from rft_core.losses import LossSettings, actor_loss
from rft_core.runs.metrics import rollout_metrics
from rft_core.workers import UserCodeError, Workers


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class TurnEngine:
    """Each call answers every request with 3 tokens of its own (1000 + 10 x call + k), then EOS, cut at its
    limit; the logprob of token k of a turn is -(k + 1) / 10. It records the prompts and limits it got."""

    def __init__(self, eos, length=3):
        self.eos, self.length, self.calls = eos, length, []

    def generate(self, prompts, limits, temperature=1.0, top_p=1.0, mm=None, logprob_every=1):
        self.calls.append(([list(p) for p in prompts], list(limits)))
        out = []
        for limit in limits:
            ids = [1000 + 10 * len(self.calls) + k for k in range(self.length)] + [self.eos]
            ids = ids[:limit]
            out.append(Generation(ids, [-(k + 1) / 10 for k in range(len(ids))]))
        return out


class InProcess:
    """The workers' map for an environment object of this file's, called in this process (the tests of the
    episodes' logic; the workers' own tests use a file)."""

    def __init__(self, env):
        self.env = HostedEnv(env)

    def map(self, name, method, calls, timeout):
        results = []
        for args in calls:
            try:
                results.append((True, getattr(self.env, method)(*args)))
            except Exception as e:
                results.append((False, UserCodeError(repr(e), type(e).__name__)))
        return results


class Scripted:
    """An environment: step answers turn t with `replies[t - 1]`, or whatever the test sets."""

    def __init__(self, replies, opening=None):
        self.replies, self.opening, self.texts = replies, opening, []

    def reset(self, sample):
        return self.opening

    def step(self, state, text):
        self.texts.append(text)
        reply = self.replies[state.turn - 1]
        return reply(state, text) if callable(reply) else reply


def prompts(tokenizer, n=2):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [Sample(list(ids), "7", [{"role": "user", "content": "hi"}]) for _ in range(n)]


def run(env, tokenizer, samples, engine=None, **settings):
    engine = engine or TurnEngine(tokenizer.eos_token_id)
    settings = EpisodeSettings(**{"turn_tokens": 8, **settings})
    runner = EpisodeRunner(InProcess(env), tokenizer, settings, log=lambda m: None)
    out = runner.run(lambda p, limits, mm: engine.generate(p, limits, mm=mm), samples, lambda n: n > 0)
    return out, engine, runner


def test_each_turn_continues_from_the_episodes_own_token_ids(tokenizer):
    """Token in, token out: the second turn's prompt is the prompt + the first turn's sampled ids + the
    environment's, and the trained ids are exactly the sampled ids plus the environment's; the mask is 1 on
    the sampled ones, their logprobs the engine's (0 on the environment's)."""
    env = Scripted([("12", False), (None, True)])
    samples = prompts(tokenizer)
    out, engine, _ = run(env, tokenizer, samples)
    (first, _), (second, _) = engine.calls
    turn1 = first[0][len(samples[0].prompt_ids):] or None
    assert turn1 is None  # the first call is the prompt alone
    env_text = "\n<|im_start|>user\n12<|im_end|>\n<|im_start|>assistant\n"  # the template's markers
    env_ids = tokenizer(env_text, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    sampled1, sampled2 = [1010, 1011, 1012, eos], [1020, 1021, 1022, eos]
    assert second[0] == samples[0].prompt_ids + sampled1 + env_ids
    g = out[0].generation
    assert g.token_ids == sampled1 + env_ids + sampled2
    assert g.mask == [1] * 4 + [0] * len(env_ids) + [1] * 4
    assert g.logprobs == [-0.1, -0.2, -0.3, -0.4] + [0.0] * len(env_ids) + [-0.1, -0.2, -0.3, -0.4]
    e = out[0].episode
    assert [t["role"] for t in e.turns] == ["assistant", "user", "assistant"]
    assert e.turns[1]["content"] == "12"
    assert e.env_calls == 2 and e.env_tokens == len(env_ids) and e.cut is None and e.failure is None
    assert env.texts[0] == tokenizer.decode(sampled1, skip_special_tokens=True)


def test_plain_text_without_the_chat_template(tokenizer):
    env = Scripted([({"role": "tool", "content": " = 12."}, False), (None, True)])
    out, _, _ = run(env, tokenizer, prompts(tokenizer, 1), apply_chat_template=False)
    g, env_ids = out[0].generation, tokenizer(" = 12.", add_special_tokens=False)["input_ids"]
    assert g.token_ids[4:4 + len(env_ids)] == env_ids and out[0].episode.turns[1]["role"] == "environment"


def test_limits_cut_episodes(tokenizer):
    """max_turns: the episode is cut after its last turn's step; a turn at its token limit (the turn's, or
    what is left of the episode's) ends the episode unfinished; each turn asks for at most what is left."""
    going_on = ("ok", False)
    out, engine, _ = run(Scripted([going_on] * 3), tokenizer, prompts(tokenizer, 1), max_turns=3)
    assert out[0].episode.cut == "turns" and len(engine.calls) == 3 and out[0].episode.env_calls == 3
    assert sum(out[0].generation.mask) == 12
    out, engine, _ = run(Scripted([going_on] * 3), tokenizer, prompts(tokenizer, 1), turn_tokens=3)
    assert out[0].episode.cut == "tokens" and len(engine.calls) == 1 and out[0].episode.env_calls == 0
    env_len = len(tokenizer("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)["input_ids"])
    out, engine, _ = run(Scripted([going_on] * 3), tokenizer, prompts(tokenizer, 1),
                         max_tokens=4 + env_len + 2)
    assert engine.calls[1][1] == [2] and out[0].episode.cut == "tokens"
    assert len(out[0].generation.token_ids) == 4 + env_len + 2


def test_every_rank_runs_the_same_number_of_turns(tokenizer):
    """While another rank has episodes going on, a rank whose episodes ended still calls generate (with no
    prompts): a tensor-parallel engine's call is a collective."""
    engine = TurnEngine(tokenizer.eos_token_id)
    others = iter([True, True, False])
    runner = EpisodeRunner(InProcess(Scripted([(None, True)])), tokenizer, EpisodeSettings(turn_tokens=8),
                           log=lambda m: None)
    runner.run(lambda p, limits, mm: engine.generate(p, limits), prompts(tokenizer, 1),
               lambda n: n > 0 or next(others))
    assert [len(p) for p, _ in engine.calls] == [1, 0, 0]



ENV = """import os, threading, time
class Env:
    def step(self, state, text):
        kind = state.sample["label"]
        state.data.setdefault("pids", []).append(os.getpid())
        if kind == "raise":
            raise ValueError("boom")
        if kind == "exit":
            raise SystemExit(3)
        if kind == "os_exit":
            os._exit(0)
        if kind == "hang":
            time.sleep(30)
        if kind == "malformed":
            return 42
        if kind == "long":
            return "word " * 200, False
        if kind == "lock":
            state.data["lock"] = threading.Lock()
        if kind == "leak":
            state.data["n"] = len(LEAKED)
            LEAKED.append(bytearray(40 << 20))
        if kind == "spin" and not state.data.get("spun"):
            state.data["spun"] = threading.Thread(target=spin, daemon=True).start()
        return (None, True) if state.turn == 2 else ("fine", False)
LEAKED = []
def spin():
    while True:
        pass
"""


@pytest.fixture(scope="module")
def env_workers(tmp_path_factory):
    """Two worker processes holding the ENV file's environment; the lines they said."""
    path = tmp_path_factory.mktemp("env") / "env.py"
    path.write_text(ENV)
    said = []
    workers = Workers({"env": (load_env, f"{path}:Env")}, size=2, timeout=0.5, log=said.append)
    yield workers, said
    workers.close()


def test_environment_faults_end_the_episode_not_the_run(tokenizer, env_workers):
    """An environment (in worker processes) that raises (an Exception, or SystemExit), calls os._exit, hangs,
    keeps a state that does not pickle or returns something malformed: that episode ends with its failure,
    counted, the first of each kind printed; the others go on (an answer too long for the episode too: cut to
    fit). The hung call is stopped at the timeout (its worker killed) and the workers that ended are
    replaced."""
    workers, said = env_workers
    kinds = ["raise", "exit", "os_exit", "hang", "lock", "malformed", "long", "ok", "raise"]
    samples = [replace(s, label=k) for s, k in zip(prompts(tokenizer, len(kinds)), kinds)]
    lines = []
    runner = EpisodeRunner(workers, tokenizer, EpisodeSettings(turn_tokens=8, timeout=0.5, max_tokens=100),
                           log=lines.append)
    engine = TurnEngine(tokenizer.eos_token_id)
    start = time.monotonic()
    out = runner.run(lambda p, limits, mm: engine.generate(p, limits), samples, lambda n: n > 0)
    assert time.monotonic() - start < 4  # the hung call was not waited for
    failures = [s.episode.failure for s in out]
    assert failures[0].startswith("raised ValueError") and failures[1].startswith("raised SystemExit")
    assert failures[2].startswith("WorkerLost: step: its worker process ended during the call (exit status 0")
    assert failures[3].startswith("timeout: step: no result within --call_timeout 0.5 s: the call was")
    assert failures[4].startswith("raised PicklingError: step raised PicklingError('its result does not")
    assert "_thread.lock" in failures[4]
    assert failures[5].startswith("malformed") and failures[6] is None
    assert out[6].episode.env_truncated == 1 and out[6].episode.cut == "tokens"
    assert len(out[6].generation.token_ids) == 100  # the answer left room for one more token: it was taken
    assert failures[7] is None and failures[8].startswith("raised")
    assert out[7].episode.env_calls == 2 and len(lines) == 6  # the second ValueError is not printed again
    assert "--reward_fallback" in lines[0] and "ValueError('boom')" in lines[0]
    assert workers.restarts["ended"] >= 1 and workers.restarts["timeout"] == 1
    assert any(line.startswith("[workers] a call ran past --call_timeout 0.5 s: killed") for line in said)


def test_the_state_goes_to_whichever_worker_runs_the_next_step(env_workers):
    """state.data persists across turns though another worker process runs each step; the trainer's copy is
    the one step returned, and its outcome comes back checked, as built-in types (parse_step)."""
    workers, _ = env_workers
    a, b = State({"prompt": "p", "label": "ok"}, turn=1), State({"prompt": "p", "label": "ok"}, turn=1)
    (_, (out_a, a)), (_, (_, b)) = workers.map("env", "step", [(a, "x"), (b, "x")], 10)
    (_, (_, b)), (_, (out_a, a)) = workers.map("env", "step", [(b, "x"), (replace(a, turn=2), "x")], 10)
    assert out_a == ([], True, 0.0, {}) and len(a.data["pids"]) == 2 and len(set(a.data["pids"])) == 2


def test_a_worker_that_leaks_is_replaced(env_workers, monkeypatch):
    """A worker whose memory grew past the bound is replaced after its call, said once."""
    import rft_core.workers as pool

    workers, said = env_workers
    monkeypatch.setattr(pool, "LEAK_BYTES", 30 << 20)
    state = State({"prompt": "p", "label": "leak"}, turn=1)
    pids = [workers.call("env", "step", (state, "x"), 10)[1].data["pids"][-1] for _ in range(2)]
    assert pids[0] != pids[1] and workers.restarts["memory"] == 2
    assert sum("[workers] a worker's memory grew to" in line for line in said) == 1


def test_a_worker_that_spins_is_replaced(env_workers, monkeypatch):
    """A worker that burnt CPU between calls (a thread left spinning) is replaced after its next call."""
    import rft_core.workers as pool

    workers, said = env_workers
    monkeypatch.setattr(pool, "BUSY_SHARE", 0.1)
    monkeypatch.setattr(pool, "BUSY_MIN_S", 0.05)
    _, state = workers.call("env", "step", (State({"prompt": "p", "label": "spin"}, turn=1), "x"), 10)
    time.sleep(0.3)
    for _ in range(2):
        _, state = workers.call("env", "step", (state, "x"), 10)
    assert workers.restarts["busy"] == 1 and len(set(state.data["pids"])) == 2
    assert sum(line.startswith("[workers] a worker used") for line in said) == 1


def test_a_reset_that_fails_or_returns_an_opening(tokenizer):
    opening = [{"role": "user", "content": "What is 2 * 3?"}]
    env = Scripted([(None, True)], opening=opening)
    out, engine, _ = run(env, tokenizer, prompts(tokenizer, 1))
    want = tokenizer(tokenizer.apply_chat_template(opening, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]
    assert out[0].prompt_ids == want and engine.calls[0][0][0] == want and out[0].prompt == opening
    out, engine, _ = run(Scripted([(None, True)], opening=42), tokenizer, prompts(tokenizer, 1))
    assert out[0].episode.failure.startswith("malformed") and not engine.calls
    assert out[0].generation.token_ids == [] and out[0].generation.mask == []
    out, _, _ = run(Scripted([(None, True)], opening="x " * 50), tokenizer, prompts(tokenizer, 1),
                    prompt_max_len=20)
    assert out[0].episode.failure.startswith("context")


@pytest.mark.parametrize("bad, why", [
    ("text", "not (observation, done"), ((1, False), "observation is int"),
    ((None, False), "no observation"), (("x", True, math.nan), "reward nan"),
    (("x", True, 0.0, [1]), "info is list"),
    (([{"role": "user"}], False), "{'role': 'user'} is not a message")])
def test_malformed_steps_are_named(bad, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(")):
        parse_step(bad)
    assert parse_step(("x", 0)) == ("x", False, 0.0, {})


def test_scoring_episodes():
    """The reward sources score the last assistant turn, the environment's rewards add to it (component env);
    an episode whose environment failed gets the fallback and NaN components and is not scored."""
    from rft_core.episodes import Episode
    from rft_core.rewards import RewardScorer

    seen = []

    def reward(prompts, completions, labels):
        seen.extend(completions)
        return {"correct": [float(c == labels[i]) for i, c in enumerate(completions)]}

    scorer = RewardScorer([("rule", reward)], fallback=-1.0)
    samples = [Sample([1], "5", "q", episode=Episode([], completion="5", env_reward=0.5)),
               Sample([1], "5", "q", episode=Episode([], completion="4")),
               Sample([1], "5", "q", episode=Episode([], completion="5", failure="timeout: ..."))]
    assert score(samples, scorer) == 0 and seen == ["5", "4"]
    assert [s.reward for s in samples] == [1.5, 0.0, -1.0]
    assert samples[0].components == {"correct": 1.0, "env": 0.5}
    assert all(math.isnan(v) for v in samples[2].components.values())
    with pytest.raises(Exception, match=r"2 of 3 samples failed \(1 in the environment"):
        scorer.failure_limit = 0.5
        scorer.check(2, 3, 1, env_failed=1)


def gapped(seed=0, rows=4, width=12):
    """A micro-batch of multi-turn rows (action tokens, then environment tokens, then action tokens, then
    padding) with finite garbage on the environment's tokens, and the same rows with those tokens removed."""
    g = torch.Generator().manual_seed(seed)
    spans = [(3, 4, 3), (2, 2, 5), (4, 0, 0), (1, 5, 2)][:rows]  # action, environment, action tokens
    mask, env = torch.zeros(rows, width, dtype=torch.long), torch.zeros(rows, width, dtype=torch.bool)
    for r, (a, e, b) in enumerate(spans):
        mask[r, :a] = 1
        env[r, a:a + e] = True
        mask[r, a + e:a + e + b] = 1
    values = {name: -torch.rand(rows, width, generator=g) for name in ("old", "ref", "roll", "new", "ent")}
    garbage = lambda: (torch.rand(rows, width, generator=g) - 0.5) * 80  # noqa: E731
    gap = {k: torch.where(env, garbage(), v * mask) for k, v in values.items()}
    compact = {k: torch.zeros(rows, width) for k in values}
    compact_mask = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):
        keep = mask[r].bool()
        n = int(keep.sum())
        compact_mask[r, :n] = 1
        for k in values:
            compact[k][r, :n] = values[k][r][keep]
    adv = torch.randn(rows, generator=g)

    def experience(t, m):
        return Experience(torch.zeros(rows, width + 2, dtype=torch.long),
                          torch.ones(rows, width + 2, dtype=torch.long), m, t["roll"], t["old"], t["ref"],
                          advantages=adv)
    return (experience(gap, mask), gap), (experience(compact, compact_mask), compact), env


LOSSES = [dict(), dict(loss_agg_mode="seq-mean-token-mean"), dict(loss_agg_mode="seq-mean-token-sum-norm"),
          dict(loss_agg_mode="seq-mean-token-sum", use_gspo=True),
          dict(tis_cap=2.0, tis_level="sequence"), dict(tis_cap=1.5, tis_level="token", tis_mode="mask"),
          dict(tis_cap=2.0, tis_level="geometric"), dict(use_kl_loss=True, kl_coef=0.1, kl_estimator="k2"),
          dict(entropy_coef=0.01, policy_drift_coef=0.1), dict(high_entropy_token_ratio=0.5),
          dict(dual_clip=3.0, use_cpg_loss=True)]


@pytest.mark.parametrize("flags", LOSSES, ids=lambda f: ",".join(f) or "default")
def test_no_environment_token_reaches_the_loss_or_its_metrics(flags):
    """A multi-turn micro-batch, garbage on the environment's tokens, gives exactly the loss, metrics and
    gradients of the same rows with the environment's tokens removed: importance ratios, TIS weights
    (sequence-level products included), KL, entropy and the token counts see only the policy's tokens."""
    (mb, gap), (cmb, compact), env = gapped()
    n = float(mb.action_mask.sum())
    settings = LossSettings(**{"max_len": 12, "num_seqs": 4, "num_tokens": torch.tensor(n),
                               "num_pg_tokens": torch.tensor(n if not flags.get("high_entropy_token_ratio")
                                                             else float(round(0.5 * n))), **flags})
    results = []
    for batch, t in ((mb, gap), (cmb, compact)):
        logprobs = (t["old"] + 0.1 * t["new"]).requires_grad_()
        entropy = (-t["ent"]).requires_grad_()
        loss, metrics = actor_loss(logprobs, entropy, batch, settings)
        grads = torch.autograd.grad(loss, [logprobs, entropy], allow_unused=True)
        results.append((loss, metrics, grads, batch.action_mask.bool()))
    (loss, metrics, grads, mask), (closs, cmetrics, cgrads, cmask) = results
    assert loss.item() == pytest.approx(closs.item(), rel=1e-5, abs=1e-7)
    for key, value in metrics.items():
        a = value if torch.is_tensor(value) else torch.stack(value)
        b = cmetrics[key] if torch.is_tensor(cmetrics[key]) else torch.stack(cmetrics[key])
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6), key
    for g, cg in zip(grads, cgrads):
        if g is None:
            continue
        assert (g[env] == 0).all()  # no gradient reaches an environment token
        assert torch.allclose(g[mask], cg[cmask], rtol=1e-5, atol=1e-7)


def test_token_level_advantages_pass_over_environment_tokens():
    """Returns and GAE of a multi-turn row equal those of the row without its environment tokens (each policy
    token followed by the next policy token), with a KL penalty and critic values of garbage on the
    environment's tokens; whitening's statistics see only policy tokens."""
    (mb, gap), (cmb, compact), env = gapped(1)
    scores = torch.tensor([1.0, -0.5, 0.3, 2.0])
    for values in (None, "values"):
        v, cv = (gap["ref"], compact["ref"]) if values else (None, None)
        adv, ret = token_level_advantages(scores, mb.action_mask, gap["new"], 0.1, v, 0.9, 0.8)
        cadv, cret = token_level_advantages(scores, cmb.action_mask, compact["new"], 0.1, cv, 0.9, 0.8)
        mask, cmask = mb.action_mask.bool(), cmb.action_mask.bool()
        assert torch.allclose(adv[mask], cadv[cmask], atol=1e-6) and (adv[env] == 0).all()
        if values:
            assert torch.allclose(ret[mask], cret[cmask], atol=1e-6)
    rewards = token_rewards(scores, mb.action_mask)
    assert rewards[0, 9] == 1.0 and rewards[2, 3] == 0.3  # on each row's last policy token
    # GAE by hand for row 0 (tokens 0-2, environment 3-6, tokens 7-9), gamma 1, lambda 1: A_t = R - V_t
    values = torch.rand(1, 12)
    adv, _ = gae(token_rewards(scores[:1], mb.action_mask[:1]), values, mb.action_mask[:1], 1.0, 1.0)
    keep = mb.action_mask[0].bool()
    assert torch.allclose(adv[0][keep], 1.0 - values[0][keep], atol=1e-6)
    assert torch.allclose(whiten(adv, mb.action_mask[:1])[0][keep].mean(), torch.tensor(0.0), atol=1e-6)


def test_lengths_and_episode_metrics_count_policy_tokens():
    from rft_core.episodes import Episode

    def sample(mask, turns, cut=None, info=None):
        g = Generation(list(range(len(mask))), [0.0] * len(mask), mask=mask)
        e = Episode([{"role": r, "content": ""} for r in turns], cut=cut, env_calls=turns.count("user"),
                    env_tokens=mask.count(0), info=info or {})
        return Sample([1], "", "", generation=g, reward=1.0, components={}, episode=e)

    samples = [sample([1, 1, 0, 0, 0, 1], ["assistant", "user", "assistant"], info={"calls": 1}),
               sample([1, 1, 1, 1], ["assistant"], cut="tokens", info={"calls": 0})]
    m = rollout_metrics(samples, generate_max_len=4)
    assert m["rollout/response_length"] == 3.5 and m["rollout/truncated"] == 0.5
    m = episode_metrics(samples)
    assert m == {"rollout/turns_mean": 1.5, "rollout/turns_max": 2, "rollout/env_calls": 1,
                 "rollout/env_tokens": 3, "rollout/cut_turns": 0, "rollout/cut_tokens": 1,
                 "rollout/env_truncated": 0, "rollout/env/calls": 0.5}


def test_experience_layout_with_environment_tokens(tiny_model_dir):
    """build_experience puts the mask in action_mask; the layout (trimming, token budgets, packing) counts
    the environment's tokens, so packed and padded logprobs agree on the policy's tokens."""
    from transformers import AutoModelForCausalLM

    from rft_core.experience import batched_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    gens = [Generation([5, 6, 7, 8, 9, 10], [0.0] * 6, mask=[1, 1, 0, 0, 1, 1]),
            Generation([11, 12, 13], [0.0] * 3, mask=[1, 0, 1])]
    exp = build_experience([[1, 2, 3], [4]], gens, pad_token_id=0)
    assert exp.action_mask[0, :6].tolist() == [1, 1, 0, 0, 1, 1] and exp.response_lengths().tolist() == [6, 3]
    assert exp.split(max_tokens=100)[0].action_mask.shape[1] >= 6  # trimming keeps whole responses
    padded = batched_logprobs(model, exp, micro_batch_size=2)
    packed = batched_logprobs(model, exp, Forward(packed=True), max_tokens=100)
    assert torch.allclose(padded, packed, atol=1e-5) and (padded[exp.action_mask == 0] == 0).all()


def test_calculator():
    from rft_core.episodes import State
    from rft_core.tasks.calculator import Calculator, calculate, multiply_task

    assert calculate("773 * 38") == 29374 and calculate("(1 + 2) / 4") == 0.75 and calculate("-3 // 2") == -2
    for bad in ("__import__('os')", "2 ** 10", "1 / 0", "x"):
        with pytest.raises(ValueError):
            calculate(bad)
    train, held = multiply_task(num_train=200, seed=1)
    assert len(held) == 96 and held == multiply_task(num_train=10, seed=2)[1]
    assert not {r["label"] + r["prompt"][-1]["content"] for r in held} & {
        r["label"] + r["prompt"][-1]["content"] for r in train}
    env, state = Calculator(), State(held[0])
    opening = env.reset(held[0])
    assert opening[-1] == held[0]["prompt"][-1] and opening[0]["content"].startswith("You have a calculator")
    assert env.step(state, "<calc>12 * 3</calc>") == ({"role": "tool", "content": "36"}, False)
    assert env.step(state, "<calc>import os</calc>")[0]["content"].startswith("error:")
    assert env.step(state, "12 * 3 = 36 <answer>36</answer>") == (None, True, 0.0, {"calls": 2})
    with pytest.raises(ValueError, match="--prompt_data multiply"):
        env.reset({"prompt": "What is 2 + 2?", "label": "4"})


@pytest.mark.slow  # builds and runs a model: about 10 s
def test_greedy_episodes_reproduce_and_the_trainer_scores_the_sampled_tokens(eos_model_dir):
    """With the transformers engine: an episode under unchanged weights reproduces greedily, token for token;
    sampled, the trainer's logprobs of the episode's policy tokens are the engine's, and the experience's
    response holds exactly the sampled ids and the environment's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rft_core.engines.hf import HFEngine
    from rft_core.experience import batched_logprobs

    model = AutoModelForCausalLM.from_pretrained(eos_model_dir)
    tok = AutoTokenizer.from_pretrained(eos_model_dir)
    engine = HFEngine(model, tok)
    env = Scripted([("a", False), ("b c", False), (None, True)])
    settings = EpisodeSettings(turn_tokens=12, max_turns=3)
    runner = EpisodeRunner(InProcess(env), tok, settings, log=lambda m: None)

    def episodes(temperature):
        torch.manual_seed(0)
        return runner.run(lambda p, limits, mm: engine.generate(p, limits, temperature), prompts(tok, 4),
                          lambda n: n > 0)

    first, again = episodes(0.0), episodes(0.0)
    assert [s.generation.token_ids for s in first] == [s.generation.token_ids for s in again]
    sampled = episodes(1.0)
    assert any(s.episode.env_calls >= 2 for s in sampled)  # several turns happened
    exp = build_experience([s.prompt_ids for s in sampled], [s.generation for s in sampled], tok.pad_token_id)
    for i, s in enumerate(sampled):
        n = len(s.generation.token_ids)
        assert exp.input_ids[i, -exp.action_mask.shape[1]:][:n].tolist() == s.generation.token_ids
    trainer = batched_logprobs(model, exp, micro_batch_size=4)
    known = exp.action_mask.bool()
    assert torch.allclose(trainer[known], exp.rollout_logprobs[known], atol=2e-4)


@pytest.mark.parametrize("flags, why", [
    (["--env", "calculator", "--partial_rollout"], "--partial_rollout with --env"),
    (["--env", "calculator", "--overlong_buffer_len", "4"], "--overlong_buffer_len with --env"),
    (["--max_turns", "2"], "--max_turns 2: it limits the episodes of --env"),
    (["--env", "calculator", "--max_episode_tokens", "16"], "--max_episode_tokens 16: one turn"),
    (["--env", "calculator", "--call_timeout", "0"], "--call_timeout 0.0: must be > 0"),
    (["--env", "calculator", "--workers", "0"], "--workers 0: must be >= 1"),
    (["--workers", "2"], "--workers 2: it sizes the processes that run --env and a --reward_fn file")])
def test_flags_that_cannot_work_with_episodes(flags, why):
    from rft_core.errors import ConfigError
    from rft_core.runs.checks import check_args
    from rft_core.runs.cli import parse_args
    from train_ppo import Args

    args = parse_args(Args, flags)
    with pytest.raises(ConfigError, match=why.replace("(", r"\(")):
        check_args(args, world=1, sharded=False, engine_type="hf", train_batch_size=32)


def test_environment_files_that_cannot_load(tmp_path):
    """Each is one line when the workers start, before any model loads: a file that is not there, exits at
    import or has no such environment, a class that cannot be made with no arguments."""
    from rft_core.errors import ConfigError, MissingName, MissingPath
    from rft_core.reward_sources import start_workers

    (tmp_path / "env.py").write_text("class NoStep:\n    pass\nimport sys\nx = 1\n"
                                     "class Needs:\n    def __init__(self, n):\n        self.step = n\n")
    with pytest.raises(MissingName, match="no 'NoStep' with a step"):
        load_env(f"{tmp_path}/env.py:NoStep")
    with pytest.raises(MissingPath):
        load_env(f"{tmp_path}/none.py:Env")
    with pytest.raises(ConfigError, match="expected path/to/file.py:NAME or one of"):
        load_env("calculatr")
    with pytest.raises(ConfigError, match=r"making Needs\(\) failed: TypeError\(.*an environment class is "
                       "made with no arguments"):
        load_env(f"{tmp_path}/env.py:Needs")
    (tmp_path / "ok.py").write_text("class Env:\n    def step(self, state, text):\n"
                                    "        return None, True\n")
    state = State({"prompt": "p"})
    assert load_env(f"{tmp_path}/ok.py:Env").step(state, "") == (([], True, 0.0, {}), state)
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ConfigError, match="an environment file cannot end"):  # through a worker process
        start_workers(None, f"{tmp_path}/exits.py:Env", 2, 30)
    workers = start_workers("answer", "calculator", 1, 30)  # the built-in calculator runs in a worker too
    opening = workers.call("env", "reset", ({"prompt": "What is 12 * 34?"},))
    workers.close()
    assert list(workers.targets) == ["env"] and opening[-1]["content"] == "What is 12 * 34?"
