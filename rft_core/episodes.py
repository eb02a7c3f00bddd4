"""Multi-turn rollouts (`--env`): the policy acts, an environment answers, and the whole episode trains.

An environment is an object with `step(state, text) -> (observation, done[, reward[, info]])` and optionally
`reset(sample) -> opening` (chat messages, a string, or None for the data's prompt), in a user's file named
as `--env path/to/file.py:NAME` (docs/multi_turn.md), run in worker processes (rft_core/workers.py).

Token in, token out: each turn continues from the episode's own token ids, so the ids that train are the
engine's sampled ids (and logprobs) exactly. An environment turn is rendered and tokenized once; its tokens
carry mask 0 (Generation.mask), so no loss, KL term, entropy, advantage or length statistic sees them. An
episode ends when the environment says done, at `max_turns`, or when a turn reaches its token limit. Every
rank runs the same number of turns (`any_active`): a tensor-parallel engine's call is a collective. A reset
or step that fails (raises, hangs, ends its worker, returns something malformed or overflows the episode)
ends that episode, which scores as a failed reward.
"""

import math
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from rft_core.data import prompt_text
from rft_core.engines.base import Generation
from rft_core.environments import State, is_message, parse_step
from rft_core.errors import ConfigError
from rft_core.workers import UserCodeError


@dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int = 4  # assistant turns per episode at most
    max_tokens: int = 1024  # response tokens per episode at most: the policy's and the environment's
    turn_tokens: int = 32  # new tokens per assistant turn at most (--generate_max_len)
    timeout: float = 60.0  # seconds a reset or step call may take (--call_timeout)
    prompt_max_len: int = 1024  # tokens of an opening that reset returns, at most
    apply_chat_template: bool = True
    system_prompt: Optional[str] = None


@dataclass
class Episode:
    """A rolled-out sample's episode (Sample.episode): its turns, how it ended, what the environment gave."""
    turns: list  # {"role", "content"}: assistant turns and the environment's, in order
    completion: str = ""  # the last assistant turn: what the reward sources score
    env_reward: float = 0.0  # the environment's rewards, summed over its steps
    env_calls: int = 0
    env_tokens: int = 0  # response tokens the environment wrote (mask 0)
    info: dict = field(default_factory=dict)  # the last info dict step returned
    cut: Optional[str] = None  # "turns" or "tokens": ended by a limit, not by the environment
    failure: Optional[str] = None  # why the environment failed, which ended the episode


BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]  # what turns follow


class EpisodeRunner:
    """Runs batches of episodes through an engine and an environment (`run`), and renders the environment's
    turns as token ids. workers: the processes holding it, target "env" (reward_sources.start_workers)."""

    def __init__(self, workers, tokenizer, settings, name="env", log=print):
        self.workers, self.tokenizer, self.settings = workers, tokenizer, settings
        self.name, self.log = name, log
        self.seen = set()  # failure kinds shown
        self.env_s = 0.0  # seconds spent waiting for the environment
        self.templated = bool(settings.apply_chat_template and getattr(tokenizer, "chat_template", None))
        self.parts = False  # the template takes a message's content as a list of parts (vision-language)
        if self.templated:  # what the template writes after an assistant turn's end token, before the next
            self.base = tokenizer.apply_chat_template(self._messages(BASE), tokenize=False)
            if "y" not in self.base:
                self.parts = True
                self.base = tokenizer.apply_chat_template(self._messages(BASE), tokenize=False)
            tail = self.base[self.base.rindex("y") + 1:]
            end = tail.find(tokenizer.eos_token) if tokenizer.eos_token else -1
            self.after_eos = tail[end + len(tokenizer.eos_token):] if end >= 0 else tail
            full = tokenizer.apply_chat_template(self._messages(BASE * 2), add_generation_prompt=True,
                                                 tokenize=False)
            if not full.startswith(self.base):
                raise ConfigError("--env: the tokenizer's chat template renders a conversation "
                                  "differently once it goes on, so turns cannot be appended: use "
                                  "--apply_chat_template false")

    def _messages(self, messages):
        if not self.parts:
            return messages
        return [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]

    def render(self, messages):
        """Token ids of an environment turn (messages) that follows an assistant turn: under the chat template
        the rest of that turn's markup, the messages, and the next assistant header; else their text."""
        if not self.templated:
            text = "".join(m["content"] for m in messages)
        else:
            full = self.tokenizer.apply_chat_template(self._messages(BASE + messages),
                                                      add_generation_prompt=True, tokenize=False)
            text = self.after_eos + full[len(self.base):]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def run(self, generate, samples, any_active):
        """One episode per Sample: the samples with their generation (logprobs 0 on environment tokens,
        None where generate gave none), prompt (the opening) and episode. generate(prompts, limits, mm) ->
        [Generation]; any_active(n) -> whether any rank has episodes going on (a collective)."""
        cfg, eos = self.settings, self.tokenizer.eos_token_id
        samples = [replace(s, episode=Episode([])) for s in samples]
        ids = [[] for _ in samples]  # response token ids so far
        logprobs = [[] for _ in samples]  # None once a turn came without them
        mask = [[] for _ in samples]
        states = [State({"prompt": s.prompt, "label": s.label}) for s in samples]
        active = self._reset(samples, states)
        for turn in range(1, cfg.max_turns + 1):
            if not any_active(len(active)):
                break  # every rank's episodes have ended
            limits = [min(cfg.turn_tokens, cfg.max_tokens - len(ids[i])) for i in active]
            gens = generate([samples[i].prompt_ids + ids[i] for i in active], limits,
                            [samples[i].mm for i in active])
            stepping = []
            for i, gen in zip(active, gens):
                episode = samples[i].episode
                text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
                ids[i] += gen.token_ids
                mask[i] += [1] * len(gen.token_ids)
                known = logprobs[i] is not None and gen.logprobs is not None
                logprobs[i] = logprobs[i] + list(gen.logprobs) if known else None
                episode.turns.append({"role": "assistant", "content": text})
                episode.completion = text
                states[i].turn = turn
                states[i].messages.append({"role": "assistant", "content": text})
                if not gen.token_ids or gen.token_ids[-1] != eos:  # the limit cut the turn
                    episode.cut = "tokens"
                else:
                    stepping.append(i)
            outcomes = self._call("step", [(states[i], samples[i].episode.completion) for i in stepping])
            active = [i for i, outcome in zip(stepping, outcomes)
                      if self._answer(samples[i], states, i, outcome, turn, ids[i], mask[i], logprobs[i])]
        return [replace(s, generation=Generation(ids[i], logprobs[i], mask=mask[i]))
                for i, s in enumerate(samples)]

    def _answer(self, sample, states, i, outcome, turn, ids, mask, logprobs):
        """Take in step's outcome: states[i] as step left it, reward, info, its messages appended to ids,
        mask (0) and logprobs (0.0) in place. Returns whether the episode goes on."""
        episode, cfg = sample.episode, self.settings
        episode.env_calls += 1
        try:
            (messages, done, reward, info), states[i] = self._outcome(*outcome, "step")
        except _Failed as failed:
            self._fail(sample, failed.kind, failed.why, f"turn {turn}")
            return False
        episode.env_reward += reward
        episode.info = info or episode.info
        if done:
            return False
        if turn == cfg.max_turns:
            episode.cut = "turns"
            return False
        env_ids = self.render(messages)
        if len(ids) + len(env_ids) >= cfg.max_tokens:  # no room for the next turn
            self._fail(sample, "context", f"its answer of {len(env_ids)} tokens does not fit the episode's "
                       f"--max_episode_tokens {cfg.max_tokens} ({len(ids)} used)", f"turn {turn}")
            return False
        ids += env_ids
        mask += [0] * len(env_ids)
        if logprobs is not None:
            logprobs += [0.0] * len(env_ids)
        episode.env_tokens += len(env_ids)
        for m in messages:
            role = m["role"] if self.templated else "environment"
            episode.turns.append({"role": role, "content": m["content"]})
            states[i].messages.append(m)
        return True

    def _reset(self, samples, states):
        """Reset each sample (its opening becomes its prompt): the indices of the episodes that can start."""
        cfg, active = self.settings, []
        results = self._call("reset", [({"prompt": s.prompt, "label": s.label},) for s in samples])
        for i, (ok, out) in enumerate(results):
            try:
                opening = self._outcome(ok, out, "reset")
                if opening is None:
                    active.append(i)
                    continue
                if not (isinstance(opening, str) or isinstance(opening, list)
                        and all(is_message(m) for m in opening)):
                    raise _Failed("malformed", f"reset returned {type(opening).__name__}, not chat messages, "
                                  "a string or None")
                if samples[i].mm is not None:
                    raise _Failed("malformed", "reset returned an opening for a prompt with images; return "
                                  "None to keep the data's prompt and its images")
                text = prompt_text(self.tokenizer, opening, cfg.apply_chat_template, cfg.system_prompt)
                prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(prompt_ids) > cfg.prompt_max_len:
                    raise _Failed("context", f"its opening of {len(prompt_ids)} tokens is longer than "
                                  f"--prompt_max_len {cfg.prompt_max_len}")
            except _Failed as failed:
                self._fail(samples[i], failed.kind, failed.why, "reset")
                continue
            samples[i] = replace(samples[i], prompt=opening, prompt_ids=prompt_ids)
            states[i].sample["prompt"] = opening
            active.append(i)
        return active

    def _call(self, method, calls):
        """The environment's reset or step on each call's arguments, in the workers: (ok, value) each."""
        start = time.perf_counter()
        results = self.workers.map("env", method, calls, self.settings.timeout)
        self.env_s += time.perf_counter() - start
        return results

    def _outcome(self, ok, out, what):
        """A call's value (step's parsed, and the state as step left it); _Failed if either failed."""
        if not ok and isinstance(out, UserCodeError):
            raise _Failed(f"raised {out.kind}", f"{what} raised {out!r}")
        if not ok:  # TimeoutError, WorkerLost, PicklingError
            kind = "timeout" if isinstance(out, TimeoutError) else type(out).__name__
            raise _Failed(kind, f"{what}: {out}")
        if what == "reset":
            return out
        try:
            return parse_step(out[0]), out[1]
        except ValueError as e:
            raise _Failed("malformed", str(e)) from None

    def _fail(self, sample, kind, why, where):
        sample.episode.failure = f"{kind}: {why}"
        if kind not in self.seen:
            self.seen.add(kind)
            self.log(f"[env] {self.name} failed an episode at {where} (label {sample.label!r}): {why}; the "
                     "episode ends and gets --reward_fallback, counted in rollout/env_errors (shown once per "
                     "kind)")


class _Failed(Exception):
    def __init__(self, kind, why):
        super().__init__(why)
        self.kind, self.why = kind, why


def score(samples, score_all, strict=False):
    """Score each episode's last assistant turn with score_all (a RewardScorer), plus the environment's
    rewards ("env"); a failed environment's gets the fallback, components NaN. Returns how many failed."""
    scored = [s for s in samples if s.episode.failure is None]
    for s in samples:
        s.completion = s.episode.completion
    failed = score_all(scored, strict) if scored else 0
    names = dict.fromkeys(name for s in scored for name in s.components)
    for s in scored:
        s.components["env"] = s.episode.env_reward
        s.reward += s.episode.env_reward
    for s in samples:
        if s.episode.failure is not None:
            s.reward, s.components = score_all.fallback, {name: math.nan for name in [*names, "env"]}
            score_all.last_failure = f"environment: {s.episode.failure}"
    return failed


def episode_metrics(samples):
    """rollout/ metrics of this rank's episodes: turns, environment calls and tokens, cuts, info numbers."""
    episodes = [s.episode for s in samples]
    turns = [sum(t["role"] == "assistant" for t in e.turns) for e in episodes]
    metrics = {"rollout/turns_mean": sum(turns) / max(1, len(turns)),
               "rollout/turns_max": max(turns, default=0),
               "rollout/env_calls": sum(e.env_calls for e in episodes),
               "rollout/env_tokens": sum(e.env_tokens for e in episodes),
               "rollout/cut_turns": sum(e.cut == "turns" for e in episodes),
               "rollout/cut_tokens": sum(e.cut == "tokens" for e in episodes)}
    numbers = {}
    for e in episodes:
        for key, value in e.info.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                numbers.setdefault(key, []).append(float(value))
    metrics.update({f"rollout/env/{key}": sum(v) / len(v) for key, v in numbers.items()})
    return metrics
