"""Multi-turn rollouts (`--env`): the policy acts, an environment answers, and the whole episode trains.

The environment (`step(state, text)`, optionally `reset(sample)`: rft_core/environments.py,
docs/multi_turn.md) runs in worker processes (rft_core/workers.py). Token in, token out: each turn goes on
from the episode's token ids, so the engine's sampled ids and logprobs train. An environment turn is
tokenized once, its text as data, cut to the room left, with mask 0 (Generation.mask): no loss or statistic
sees it. A turn stopped short of its end of turn (`</calc>`) gets the answer inline and goes on (_ended). An
episode ends when the environment says done, at `max_turns` or at its token limit; every rank runs as many
turns (`any_active`): a tensor-parallel engine's call is a collective. A failed reset or step (raised, hung,
lost its worker, malformed or unrenderable output) ends the episode, scored as a failed reward."""

import math
import re
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from rft_core.data import prompt_text
from rft_core.engines.base import Generation
from rft_core.environments import Malformed, State
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
    max_env_tokens: int = 0  # tokens of one environment answer at most (0: the room the episode has left)


@dataclass
class Episode:
    """A rolled-out sample's episode (Sample.episode): its turns, how it ended, what the environment gave."""
    turns: list  # {"role", "content"}: assistant turns and the environment's, in order
    completion: str = ""  # the last assistant turn: what the reward sources score
    env_reward: float = 0.0  # the environment's rewards, summed over its steps
    env_calls: int = 0
    env_tokens: int = 0  # response tokens the environment wrote (mask 0)
    env_truncated: int = 0  # its answers cut to fit (the episode's room, --max_env_tokens)
    info: dict = field(default_factory=dict)  # the info dict the last step returned
    cut: Optional[str] = None  # "turns" or "tokens": ended by a limit, not by the environment
    failure: Optional[str] = None  # why the environment failed, which ended the episode


BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]  # what turns follow
SLOT = "\ue000%d\ue001"  # stands for message k's content while the template renders (private-use characters)
MARKER = " [...]"  # ends an environment answer cut to fit


class EpisodeRunner:
    """Runs episodes (`run`) on an engine and `workers` (reward_sources.start_workers); tools: schemas."""

    def __init__(self, workers, tokenizer, settings, name="env", log=print, tools=None):
        self.workers, self.tokenizer, self.settings, self.tools = workers, tokenizer, settings, tools
        self.name, self.log = name, log
        self.seen = set()  # failure kinds shown
        self.env_s = 0.0  # seconds spent waiting for the environment
        self.longest = max(map(len, tokenizer.get_vocab())) + 1  # characters of a token at most (+1: a space)
        self.special = set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}  # control tokens
        self.marker = tokenizer(MARKER, add_special_tokens=False)["input_ids"]
        self.templated = bool(settings.apply_chat_template and getattr(tokenizer, "chat_template", None))
        self.parts = False  # the template takes a message's content as a list of parts (vision-language)
        self.end, self.tool_role = None, "tool"  # the template's end-of-turn markup; tool messages' role
        if self.templated:  # what the template writes after an assistant turn's end token, before the next
            self.parts = "y" not in self._template(BASE)
            self.base = self._template(BASE)
            tail = self.base[self.base.rindex("y") + 1:]
            end = tail.find(tokenizer.eos_token) if tokenizer.eos_token else -1
            self.after_eos = tail[end + len(tokenizer.eos_token):] if end >= 0 else tail
            self.end, self.tail = tail.strip(), tail
            self.after_end = tail[tail.find(self.end) + len(self.end):]
            if not self._template(BASE * 2, True).startswith(self.base):
                raise ConfigError("--env: the tokenizer's chat template renders a conversation "
                                  "differently once it goes on, so turns cannot be appended: use "
                                  "--apply_chat_template false")
            try:
                renders = SLOT % 0 in self._template(BASE + [{"role": "tool", "content": SLOT % 0}], True)
            except Exception:  # whatever the template raised ("unknown role"...)
                renders = False
            if not renders:
                self.tool_role = "user"
                log(f"[env] the chat template cannot render a `tool` message (it raises or leaves its "
                    f"content out): {name}'s tool messages are rendered as `user` messages")

    def _template(self, messages, add_generation_prompt=False):
        if self.parts:
            messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def _slots(self, messages):
        return [{"role": self.tool_role if m["role"] == "tool" else m["role"], "content": SLOT % k}
                for k, m in enumerate(messages)]

    def render(self, messages, ended="eos", limit=math.inf):
        """(ids, contents, cut) of environment messages after a turn that `ended` ("eos", "end", "close":
        after the rest of that turn's markup, all of it for "close"; "inline": as text), cut to `limit`."""
        contents = [m["content"] for m in messages]
        if not self.templated or ended == "inline":
            return self._ids("".join(SLOT % k for k in range(len(messages))), contents, limit)
        full = self._template(BASE + self._slots(messages), True)
        after = {"eos": self.after_eos, "end": self.after_end}.get(ended, self.tail)  # "close": all of it
        return self._ids(after + full[len(self.base):], contents, limit)

    def _ids(self, text, contents, limit):
        """(ids, contents, cut) of text whose SLOT k stands for contents[k], as data (special tokens' text
        stays text); past `limit` the contents end in MARKER (cut True; ids None if even that won't fit)."""
        parts = re.split("\ue000(\\d+)\ue001", text)  # markup, k, markup, k, ..., markup
        if sorted(int(k) for k in parts[1::2]) != list(range(len(contents))):
            raise ValueError("the chat template left out a message's content")
        chars = (max(limit, 0) + 1) * self.longest if limit < math.inf else None
        pieces = [self._tokens(p) if j % 2 == 0 else self._tokens(contents[int(p)][:chars], data=True)
                  for j, p in enumerate(parts)]
        long = [chars is not None and len(contents[int(k)]) > chars for k in parts[1::2]]
        if sum(map(len, pieces)) <= limit and not any(long):
            return [t for p in pieces for t in p], contents, False
        room = limit - sum(map(len, pieces[::2])) - len(self.marker)  # content ids that can stay
        if room < 0:
            return None, contents, True
        for j in range(1, len(parts), 2):
            k = int(parts[j])
            if room is None:  # after the cut
                pieces[j], contents[k] = [], ""
            elif len(pieces[j]) > room or long[j // 2]:
                contents[k] = self.tokenizer.decode(pieces[j][:room]) + MARKER
                pieces[j], room = pieces[j][:room] + self.marker, None
            else:
                room -= len(pieces[j])
        return [t for p in pieces for t in p], contents, True

    def _tokens(self, text, data=False):
        if not text:
            return []
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=data)["input_ids"]
        if data and self.special.intersection(ids):  # a vocabulary that holds the special tokens as words
            raise ValueError("its text tokenizes to a special token even as text")
        return ids

    def _ended(self, gen):
        """How a turn ended: "eos"; "end" (a stop matching the end-of-turn markup); "inline" (another stop: a
        text answer is appended inline, messages close the turn); "cut" (the limit)."""
        ids = gen.token_ids
        if ids and ids[-1] == self.tokenizer.eos_token_id:
            return "eos"
        if gen.finish != "stop":  # "length", or unknown (None) and not at EOS
            return "cut"
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return "end" if self.end and text.endswith(self.end) else "inline"

    def run(self, generate, samples, any_active):
        """One episode per Sample: the samples with generation (logprobs 0 on environment tokens, None where
        generate gave none), prompt (the opening) and episode. generate(prompts, limits, mm) -> [Generation];
        any_active(n): whether any rank has episodes going on (a collective)."""
        cfg = self.settings
        samples = [replace(s, episode=Episode([])) for s in samples]
        out = [Generation([], [], mask=[]) for _ in samples]  # the responses so far
        states = [State({"prompt": s.prompt, "label": s.label}) for s in samples]
        active = self._reset(samples, states)
        for turn in range(1, cfg.max_turns + 1):
            if not any_active(len(active)):
                break  # every rank's episodes have ended
            limits = [min(cfg.turn_tokens, cfg.max_tokens - len(out[i].token_ids)) for i in active]
            gens = generate([samples[i].prompt_ids + out[i].token_ids for i in active], limits,
                            [samples[i].mm for i in active])
            ended = {}
            for i, gen in zip(active, gens):
                episode = samples[i].episode
                text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
                _extend(out[i], gen.token_ids, gen.logprobs, 1)
                episode.turns.append({"role": "assistant", "content": text})
                episode.completion = text
                states[i].turn = turn
                states[i].messages.append({"role": "assistant", "content": text})
                ended[i] = self._ended(gen)
                episode.cut = "tokens" if ended[i] == "cut" else None  # "cut": the limit cut the turn
            stepping = [i for i in active if ended[i] != "cut"]
            outcomes = self._call("step", [(states[i], samples[i].episode.completion) for i in stepping])
            active = [i for i, outcome in zip(stepping, outcomes)
                      if self._answer(samples[i], states[i], outcome, turn, ended[i], out[i])]
        return [replace(s, generation=g) for s, g in zip(samples, out)]

    def _answer(self, sample, state, outcome, turn, ended, out):
        """Take in step's outcome (state.data, reward, info, mask-0 messages); whether it goes on."""
        episode, cfg = sample.episode, self.settings
        episode.env_calls += 1
        try:
            (messages, done, reward, info), state.data = self._outcome(*outcome, "step")
            episode.env_reward += reward
            episode.info = info
            if not math.isfinite(episode.env_reward):
                raise _Failed("malformed", f"its rewards sum to {episode.env_reward}, not a finite number")
            if done or turn == cfg.max_turns:
                episode.cut = None if done else "turns"
                return False
            if isinstance(messages, str):  # text: inline after a stop, else a user message
                messages = [{"role": "user", "content": messages}]
            elif ended == "inline":  # messages after a stop: the turn is closed by the template's markup
                ended = "close"
            room = cfg.max_tokens - len(out.token_ids) - 1  # the next turn's first token at least
            env_ids, contents, cut = self.render(messages, ended, min(room, cfg.max_env_tokens or room))
        except Exception as e:  # _Failed, or the template or tokenizer on its answer: the episode's failure
            self._fail(sample, e, f"turn {turn}", "answer")
            return False
        episode.env_truncated += cut
        if env_ids is None:  # no room for even a cut answer
            episode.cut = "tokens"
            return False
        _extend(out, env_ids, [0.0] * len(env_ids), 0)
        episode.env_tokens += len(env_ids)
        for m, content in zip(messages, contents):
            episode.turns.append({"role": m["role"] if self.templated else "environment", "content": content})
            state.messages.append({"role": m["role"], "content": content})
        return True

    def _reset(self, samples, states):
        """Reset each sample (the opening becomes its prompt, with the tools): the indices that start."""
        active = []
        results = self._call("reset", [({"prompt": s.prompt, "label": s.label},) for s in samples])
        for i, (ok, out) in enumerate(results):
            try:
                opening = self._outcome(ok, out, "reset")
                if opening is not None and samples[i].mm is not None:
                    raise _Failed("malformed", "reset returned an opening for a prompt with images; return "
                                  "None to keep the data's prompt and its images")
                if opening is not None or self.tools is not None and samples[i].mm is None:
                    opening = samples[i].prompt if opening is None else opening
                    samples[i] = replace(samples[i], prompt=opening, prompt_ids=self._opening(opening))
                    states[i].sample["prompt"] = opening
                active.append(i)
            except Exception as e:  # _Failed, or the template or tokenizer on its opening
                self._fail(samples[i], e, "reset", "opening")
        return active

    def _opening(self, opening):
        """Token ids of an opening (a string or messages), its contents as data (_ids), with the tools."""
        cfg = self.settings
        if isinstance(opening, str):
            contents, slotted = [opening], SLOT % 0
        else:
            contents, slotted = [m["content"] for m in opening], self._slots(opening)
        text = prompt_text(self.tokenizer, slotted, cfg.apply_chat_template, cfg.system_prompt, self.tools)
        prompt_ids, _, cut = self._ids(text, contents, cfg.prompt_max_len)
        if cut:
            raise _Failed("context", f"its opening is longer than --prompt_max_len {cfg.prompt_max_len}")
        return prompt_ids

    def _call(self, method, calls):
        """The environment's reset or step on each call's arguments, in the workers: (ok, value) each."""
        start = time.perf_counter()
        results = self.workers.map("env", method, calls, self.settings.timeout)
        self.env_s += time.perf_counter() - start
        return results

    def _outcome(self, ok, out, what):
        """A call's value as HostedEnv checked it (a step's with state.data); _Failed if either failed."""
        if not ok and isinstance(out, UserCodeError):
            raise _Failed(f"raised {out.kind}", f"{what} raised {out!r}")
        if not ok:  # TimeoutError, WorkerLost, PicklingError
            kind = "timeout" if isinstance(out, TimeoutError) else type(out).__name__
            raise _Failed(kind, f"{what}: {out}")
        value = out if what == "reset" else out[0]
        if isinstance(value, Malformed):
            raise _Failed("malformed", str(value))
        return value if what == "reset" else (value, out[1].data)

    def _fail(self, sample, error, where, what):
        """End the episode with error: a _Failed, or what rendering its `what` raised."""
        kind, why = error.args if isinstance(error, _Failed) else (
            "render", f"rendering its {what} raised {error!r}")
        sample.episode.failure = f"{kind}: {why}"
        if kind not in self.seen:
            self.seen.add(kind)
            self.log(f"[env] {self.name} failed an episode at {where} (label {sample.label!r}): {why}; the "
                     "episode ends and gets --reward_fallback, counted in rollout/env_errors (shown once per "
                     "kind)")


def _extend(out, ids, logprobs, mask):
    """Append ids to the response out with their logprobs (None once a turn came without) and mask."""
    out.token_ids += ids
    out.mask += [mask] * len(ids)
    out.logprobs = None if out.logprobs is None or logprobs is None else out.logprobs + list(logprobs)


class _Failed(Exception):
    """args: (kind, why): how the environment failed, which ends the episode."""


def score(samples, score_all, strict=False):
    """Score last turns (score_all) + env rewards; failed envs: the fallback, NaN components. -> failures."""
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
    """This rank's rollout/ episode metrics, with the means of the last info dicts' (finite) numbers."""
    episodes = [s.episode for s in samples]
    turns = [sum(t["role"] == "assistant" for t in e.turns) for e in episodes]
    metrics = {"rollout/turns_mean": sum(turns) / max(1, len(turns)),
               "rollout/turns_max": max(turns, default=0),
               "rollout/env_calls": sum(e.env_calls for e in episodes),
               "rollout/env_tokens": sum(e.env_tokens for e in episodes),
               "rollout/cut_turns": sum(e.cut == "turns" for e in episodes),
               "rollout/cut_tokens": sum(e.cut == "tokens" for e in episodes),
               "rollout/env_truncated": sum(e.env_truncated for e in episodes)}
    numbers = {}
    for e in episodes:
        for key, value in e.info.items():
            if isinstance(value, (int, float)):  # finite (parse_step); bools count too: rates
                numbers.setdefault(key, []).append(float(value))
    means = {f"rollout/env/{key}": sum(x / len(v) for x in v) for key, v in numbers.items()}  # no overflow
    metrics.update({key: mean for key, mean in means.items() if math.isfinite(mean)})
    return metrics
