"""The rollout of one step: this rank's prompts, each sampled n times, scored, shaped (DAPO's overlong
penalty) and kept by whole groups (DAPO's dynamic sampling redraws groups of equal rewards). With `--env` a
sample is a multi-turn episode (rft_core/episodes.py). Partial rollout (Kimi k1.5, AReaL's staleness bound):
a sample cut at a round's `token_budget` continues later; each step trains the oldest finished groups, no
token older than `max_staleness` versions (docs/partial_rollout.md, `_collect_partial`)."""

import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from rft_core.data import batches
from rft_core.engines.base import Generation, stop_end, wants_logprobs
from rft_core.episodes import episode_metrics
from rft_core.episodes import score as score_episodes
from rft_core.experience import Sample
from rft_core.rewards import overlong_penalty


@dataclass
class RolloutSettings:
    group_size: int  # responses per prompt
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    dynamic_sampling: bool = False
    max_rounds: int = 1  # generation rounds per step at most (dynamic sampling)
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    strict_rewards: bool = False
    partial: bool = False  # partial rollout: the fields below
    token_budget: Optional[int] = None  # new tokens per unfinished sample per round
    max_staleness: int = 2  # in policy versions (weight syncs)
    eos_token_id: Optional[int] = None  # a response that ends in it has finished
    inflight_ratio: float = 1.0  # groups in hand per round (generating or ready), in steps' worth of groups
    logprob_every: int = 1  # the engine's logprobs for every k-th sample (engine.generate's logprob_every)
    stop: tuple = ()  # partial rollout: stop texts, matched again on a continued response's whole text


@dataclass(eq=False)  # a group is itself: membership tests compare identity, not samples (and their images)
class Group:
    samples: list
    version: int  # the policy version that sampled its first tokens
    done: list  # per sample: finished (a buffered group all finished: scored, waiting to be trained)


class Rollouts:
    """Each step's samples for this rank: rollout_batch_size // world prompts (whole groups) a step."""

    def __init__(self, prompts, rollout_batch_size, seed, rank, world, settings, device, episodes=None):
        self.data = batches(prompts, rollout_batch_size, seed)
        self.episodes = episodes  # an episodes.EpisodeRunner (--env), or None: one response per sample
        self.drawn = 0  # batches taken from the stream
        self.k = rollout_batch_size // world  # this rank's prompts per step
        self.rank, self.settings, self.device = rank, settings, device
        self.queue = []  # partial rollout: this rank's prompts drawn from the stream, not yet started
        self.buffer = []  # partial rollout: Groups unfinished, or finished and waiting

    def state_dict(self):
        return {"batches_drawn": self.drawn}

    def buffer_state(self):
        """The partial-rollout buffer and queue as plain containers (torch.load's weights_only takes them)."""
        groups = [{"version": g.version, "done": g.done, "samples": [asdict(s) for s in g.samples]}
                  for g in self.buffer]  # (asdict: the samples' Generations too)
        return {"groups": groups, "queue": [asdict(s) for s in self.queue]}

    def load_state_dict(self, state, buffer=None):
        for _ in range(state["batches_drawn"]):  # the data stream where it stopped
            next(self.data)
        self.drawn = state["batches_drawn"]
        if buffer:
            self.queue = [Sample(**s) for s in buffer["queue"]]
            self.buffer = [Group([Sample(**{**s, "generation": Generation(**s["generation"])})
                                  for s in g["samples"]], g["version"], g["done"])
                           for g in buffer["groups"]]

    def draw(self):
        """This rank's next prompts, each repeated group_size times (a group stays on one rank)."""
        batch = next(self.data)[self.rank * self.k:(self.rank + 1) * self.k]
        self.drawn += 1
        return [p for p in batch for _ in range(self.settings.group_size)]

    def collect(self, engine, tokenizer, score_all, reduce_sum, step):
        """(samples, metrics) of one step; RewardError if too many failed."""
        self.generated = self.slots = 0  # counted by _generate
        self.score_s = 0.0  # the seconds of it spent scoring (by _score)
        env_s = self.episodes.env_s if self.episodes else 0.0
        if self.settings.partial:
            return self._collect_partial(engine, tokenizer, score_all, reduce_sum, step)
        cfg, n = self.settings, self.settings.group_size
        kept, dropped, counts = [], [], [0, 0, 0]  # reward errors, samples scored, environment errors
        for rounds in range(1, cfg.max_rounds + 1):  # noqa: B007 (the last value is the rounds run)
            batch = self.draw()
            if self.episodes:
                samples = self._episodes(engine, batch, reduce_sum)
            else:
                generations = self._generate(engine, [p.prompt_ids for p in batch], cfg.max_new_tokens,
                                             [p.mm for p in batch])
                samples = [replace(p, generation=g) for p, g in zip(batch, generations)]
            groups = [samples[i:i + n] for i in range(0, len(samples), n)]
            self._score(groups, tokenizer, score_all, kept, dropped, counts)
            short = torch.tensor(float(len(kept) < self.k), device=self.device)
            if not cfg.dynamic_sampling or not reduce_sum(short):
                break  # every rank has its k groups
        metrics = {"rollout/generation_rounds": rounds}
        if self.episodes:
            metrics["perf/env_s"] = self.episodes.env_s - env_s
        return self._finish(kept, dropped, counts, score_all, reduce_sum, step, metrics)

    def _episodes(self, engine, batch, reduce_sum):
        """batch's episodes: each asks for logprobs (its turns are separate calls), every k-th keeps them."""
        every = self.settings.logprob_every

        def generate(prompts, limits, mm):
            return self._generate(engine, prompts, limits, mm, logprob_every=min(every, 1))

        def any_active(count):
            return bool(reduce_sum(torch.tensor(float(count), device=self.device)).item())

        samples = self.episodes.run(generate, batch, any_active)
        for i, s in enumerate(samples):
            if not wants_logprobs(i, every):
                s.generation.logprobs = None
        return samples

    def _score(self, groups, tokenizer, score_all, kept, dropped, counts):
        cfg = self.settings
        samples = [s for group in groups for s in group]
        if not samples:
            return
        start = time.perf_counter()
        if self.episodes:  # the last assistant turns scored, the environment's rewards added
            counts[0] += score_episodes(samples, score_all, cfg.strict_rewards)
            counts[2] += sum(s.episode.failure is not None for s in samples)
        else:
            token_ids = [s.generation.token_ids for s in samples]
            for s, c in zip(samples, tokenizer.batch_decode(token_ids, skip_special_tokens=True)):
                s.completion = c
            counts[0] += score_all(samples, cfg.strict_rewards)  # sets their reward and components
        self.score_s += time.perf_counter() - start
        counts[1] += len(samples)
        for s in samples if cfg.overlong_buffer_len else []:  # DAPO's soft overlong punishment
            s.components["overlong"] = overlong_penalty(len(s.generation.token_ids), cfg.max_new_tokens,
                                                        cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
            s.reward += s.components["overlong"]
        for group in groups:  # dynamic sampling keeps the groups whose rewards differ
            informative = not cfg.dynamic_sampling or len({s.reward for s in group}) > 1
            (kept if informative else dropped).append(group)

    def _finish(self, kept, dropped, counts, score_all, reduce_sum, step, metrics):
        num_filled = max(0, self.k - len(kept))  # the rounds ran out: zero-variance groups fill the batch
        samples = [s for group in kept[:self.k] + dropped[:num_filled] for s in group]
        failed, total, env_failed = reduce_sum(torch.tensor(counts, device=self.device)).tolist()
        score_all.check(failed + env_failed, total, step, env_failed)
        metrics = {"rollout/reward_errors": counts[0], "rollout/filled_groups": num_filled,
                   "rollout/tokens_generated": self.generated,
                   "rollout/slot_utilization": self.generated / max(1, self.slots),
                   "perf/score_s": self.score_s, **metrics}
        if self.episodes:
            metrics.update({"rollout/env_errors": counts[2], **episode_metrics(samples)})
        return samples, metrics

    def _generate(self, engine, prompts, limits, mm, logprob_every=None):
        """engine.generate, counting tokens and decode slots held (requests x longest): the batch's use."""
        cfg = self.settings
        every = cfg.logprob_every if logprob_every is None else logprob_every
        outputs = engine.generate(prompts, limits, cfg.temperature, cfg.top_p, mm=mm, logprob_every=every)
        lengths = [len(g.token_ids) for g in outputs]
        self.generated += sum(lengths)
        self.slots += len(lengths) * max(lengths, default=0)
        return outputs

    def _collect_partial(self, engine, tokenizer, score_all, reduce_sum, step):
        cfg, n, version = self.settings, self.settings.group_size, step - 1  # version: weight syncs so far
        dropped, counts = [], [0, 0, 0]
        # finished groups that waited too long (more were ready than a step takes): never trained
        stale = [g for g in self.buffer if version - g.version > cfg.max_staleness]
        for g in stale:  # their prompts are drawn again, first
            self.queue.insert(0, replace(g.samples[0], generation=None, completion=None, reward=None,
                                         components=None))
        ready = [g for g in self.buffer if all(g.done) and g not in stale]
        pending = [g for g in self.buffer if not all(g.done) and g not in stale]
        resumed = sum(not d for g in pending for d in g.done)
        # where nothing is cut off (a budget of the whole length, or K = 0): the synchronous loop
        can_cut = cfg.token_budget < cfg.max_new_tokens and cfg.max_staleness > 0
        in_hand = math.ceil(self.k * cfg.inflight_ratio) if can_cut else self.k
        for rounds in range(1, cfg.max_rounds + 1):
            need = self.k - len(ready)
            fresh = max(need, in_hand - len(ready) - len(pending))
            pending += [self._new_group(version) for _ in range(fresh)]
            # no budget for a group at the staleness bound, nor (last round) for the oldest ones still needed
            urgent = {g for g in pending if version - g.version >= cfg.max_staleness}
            if rounds == cfg.max_rounds:
                urgent.update(sorted(pending, key=lambda g: g.version)[:max(0, need)])
            requests = [(g, i) for g in pending for i in range(n) if not g.done[i]]
            limits = [min(cfg.max_new_tokens - len(g.samples[i].generation.token_ids),
                          math.inf if g in urgent else cfg.token_budget) for g, i in requests]
            prompts = [g.samples[i].prompt_ids + g.samples[i].generation.token_ids for g, i in requests]
            outputs = self._generate(engine, prompts, limits, [g.samples[i].mm for g, i in requests])
            for (g, i), limit, new in zip(requests, limits, outputs):
                gen, ids = g.samples[i].generation, g.samples[i].generation.token_ids + new.token_ids
                # a stop text may span two rounds' chunks, where the engine (which sees the first as prompt)
                # cannot find it
                end = stop_end(ids, tokenizer, cfg.stop)
                gen.token_ids, gen.logprobs = ids[:end], (gen.logprobs + new.logprobs)[:end]
                gen.versions = (gen.versions + [version] * len(new.token_ids))[:end]
                ended = end is not None or new.finish == "stop" or new.token_ids[-1:] == [cfg.eos_token_id]
                g.done[i] = ended or len(new.token_ids) < limit or len(gen.token_ids) >= cfg.max_new_tokens
            finished = [g for g in pending if all(g.done)]
            pending = [g for g in pending if not all(g.done)]
            kept = []
            self._score([g.samples for g in finished], tokenizer, score_all, kept, dropped, counts)
            ready += [g for g in finished if any(group is g.samples for group in kept)]
            if not reduce_sum(torch.tensor(float(len(ready) < self.k), device=self.device)):
                break  # every rank has its k groups
        trained = sorted(ready, key=lambda g: g.version)[:self.k]  # the oldest first (else as they finished)
        self.buffer = [g for g in ready + pending if g not in trained]
        ages = [version - v for g in trained for s in g.samples for v in s.generation.versions]
        metrics = {"rollout/generation_rounds": rounds, "rollout/resumed": resumed,
                   "rollout/buffered": sum(not d for g in pending for d in g.done),
                   "rollout/finished_from_buffer": n * sum(g.version < version for g in trained),
                   "rollout/dropped_stale": n * len(stale),
                   "rollout/staleness_mean": sum(ages) / max(1, len(ages)),
                   "rollout/staleness_max": max(ages, default=0)}
        kept = [g.samples for g in trained]
        return self._finish(kept, dropped, counts, score_all, reduce_sum, step, metrics)

    def _new_group(self, version):
        if not self.queue:
            self.queue = self.draw()[::self.settings.group_size]  # this rank's next prompts, once each
        prompt = self.queue.pop(0)
        n = self.settings.group_size
        samples = [replace(prompt, generation=Generation([], [], [])) for _ in range(n)]
        return Group(samples, version, [False] * n)
