"""A toy policy learned through the real rollout scheduler: does partial rollout's schedule alone delay the
unlearning of long, rambling answers, as the GPU runs' rambling was delayed (README, "Partial rollout",
session 19)? A model of the counting task, not of an LLM: what it can show is what the schedule does to
the signals, not how large the effect is for a real model.

The policy writes "1 2 ... N" (a number token and a token per digit, as SmolLM2 does) and decides at each
number boundary whether to stop (EOS) or go on, with four logits: stop before N (a hazard per number, the
answers that stop early), stop at N for short prompts (N <= 15) and for long ones (N >= 40), and stop past N
(a hazard per number, the rambling; without it an answer runs to --max_len). Rewards are bench_partial.py's:
1 for exactly 1..N, 0.5 x M / N for stopping at M < N, 0.5 for going past N. The rollout is
rft_core.rollout.Rollouts itself (synchronous, or partial in finish or start order), on an engine that
samples from the logits of the version it holds; each step GRPO's group-normalised advantages, per-decision
importance weights against the behaviour logprobs (capped at 2, as --tis_cap 2), a Dr. GRPO-style sum over
decisions, and one Adam step on the four logits; then the engine takes the new logits (a weight sync).

    python bench/toy_rambling.py --seeds 20 --arms sync partial start
    python bench/toy_rambling.py --seeds 40 --optimizer sgd --lr 2    # steps that follow the gradient
    python bench/toy_rambling.py --seeds 40 --arms sync partial delay  # delay: one version, every group whole

Prints, per arm, the mean over seeds of each step's share of trained answers cut at --max_len and of the
current policy's expected share of exact answers (over 2,000 held-out N), the trained answers' reward over
the second half of the steps (with its standard error, and its difference from the synchronous arm's, seed
for seed), tokens generated a step, and the lags (in steps) at which the synchronous courses of the cut
share and of the exact share best match each other arm's.
"""

import argparse
import json
import math
import os
import random
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.analyze_partial import lag_fit  # noqa: E402
from bench.replay_partial_schedule import Tok  # noqa: E402
from rft_core.advantages import outcome_scores  # noqa: E402
from rft_core.engine import Generation  # noqa: E402
from rft_core.experience import Sample  # noqa: E402
from rft_core.rollout import Rollouts, RolloutSettings  # noqa: E402

EOS, FILL, NUM = 2, 3, 10  # token ids: EOS, a digit / space, number i is NUM + i
# initial logits: early stops ~1% a number, stop at N 90% (short) / 60% (long), past N 0.09% a number
START = {"early": -4.6, "short": 2.2, "long": 0.4, "past": -7.0}


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def decision(n, i):
    """The logit deciding whether to stop after number i of an answer to N = n."""
    return "early" if i < n else ("short" if n <= 15 else "long") if i == n else "past"


def draw_n(rng):
    return rng.randint(3, 15) if rng.random() < 0.8 else rng.randint(40, 150)


class Engine:
    """Continues each request from its tokens so far, under the logits it holds (the policy version)."""

    def __init__(self, theta, seed):
        self.theta, self.rng = dict(theta), random.Random(seed)

    def generate(self, prompts, limits, temperature=1.0, top_p=1.0, mm=None, logprob_every=1):
        if not isinstance(limits, list):
            limits = [limits] * len(prompts)
        return [self._continue(p[0] - 1000, p[2:], limit) for p, limit in zip(prompts, limits)]

    def _continue(self, n, tokens, limit):
        last, fill = 0, 0  # the last number written, and its digit tokens still to come
        for t in tokens:
            last, fill = (t - NUM, len(str(t - NUM))) if t >= NUM else (last, fill - 1)
        steps = []  # (token, its logprob): 0 where nothing is decided (digits, the first number)
        while len(steps) < limit:
            if fill:
                steps.append((FILL, 0.0))
                fill -= 1
                continue
            lp = 0.0
            if last:  # a boundary: stop or go on
                p = sigmoid(self.theta[decision(n, last)])
                if self.rng.random() < p:
                    steps.append((EOS, math.log(p)))
                    break
                lp = math.log(1 - p)
            last, fill = last + 1, len(str(last + 1))
            steps.append((NUM + last, lp))
        return Generation([t for t, _ in steps], [lp for _, lp in steps])


def outcome(n, tokens):
    """(reward, the answer's decisions as (logit name, stopped, index of the token that says so))."""
    last, decisions = 0, []
    for j, t in enumerate(tokens):
        if t == EOS or (t >= NUM and t - NUM >= 2):
            decisions.append((decision(n, last), t == EOS, j))
        if t >= NUM:
            last = t - NUM
    reward = 1.0 if last == n and tokens[-1:] == [EOS] else 0.5 * last / n if last < n else 0.5
    return reward, decisions


def score_all(samples, strict=False):
    for s in samples:
        s.reward, _ = outcome(s.prompt_ids[0] - 1000, s.generation.token_ids)
        s.components = {}
    return 0


score_all.check = lambda failed, total, step: None


class SGD:
    def __init__(self, lr):
        self.lr = lr

    def ascend(self, theta, grad):
        for k, g in grad.items():
            theta[k] += self.lr * g


class Adam:
    def __init__(self, lr, betas=(0.9, 0.95), eps=1e-8):
        self.lr, self.betas, self.eps, self.m, self.v, self.t = lr, betas, eps, {}, {}, 0

    def ascend(self, theta, grad):
        self.t += 1
        b1, b2 = self.betas
        for k, g in grad.items():
            self.m[k] = b1 * self.m.get(k, 0.0) + (1 - b1) * g
            self.v[k] = b2 * self.v.get(k, 0.0) + (1 - b2) * g * g
            m_hat, v_hat = self.m[k] / (1 - b1 ** self.t), self.v[k] / (1 - b2 ** self.t)
            theta[k] += self.lr * m_hat / (math.sqrt(v_hat) + self.eps)


def gradient(samples, theta, group, cap=2.0):
    """The policy-gradient step direction: group-normalised advantages, decisions weighted by
    min(pi / pi_behaviour, cap), summed over decisions, averaged over samples."""
    grad = dict.fromkeys(theta, 0.0)
    advantages = outcome_scores(torch.tensor([s.reward for s in samples]), group).tolist()  # GRPO's
    for s, advantage in zip(samples, advantages):
        _, decisions = outcome(s.prompt_ids[0] - 1000, s.generation.token_ids)
        for name, stopped, j in decisions:
            p = sigmoid(theta[name])
            logp = math.log(p if stopped else 1 - p)
            weight = min(math.exp(logp - s.generation.logprobs[j]), cap)
            grad[name] += advantage * weight * ((1 - p) if stopped else -p) / len(samples)
    return grad


def exactness(theta, ns):
    """The policy's expected share of exact answers over the given N."""
    total = 0.0
    for n in ns:
        reach = (1 - sigmoid(theta["early"])) ** (n - 1)
        total += reach * sigmoid(theta["short" if n <= 15 else "long"])
    return total / len(ns)


def run(arm, seed, args):
    rng = random.Random(seed)
    prompts = [Sample([1000 + draw_n(rng), i], "", "") for i in range(args.k * (args.steps + 40))]
    staleness = {"start": args.start_staleness, "delay": 1}.get(arm, args.staleness)
    # start order's default budget (RolloutSettings.from_args); the synchronous arm has none. delay: start
    # order at K = 1 with a budget of the length - 1, every group whole and trained a step later (session 21)
    budgets = {"start": math.ceil(args.max_len / (staleness + 1)), "delay": args.max_len - 1}
    budget = budgets.get(arm, args.budget)
    settings = RolloutSettings(args.group, args.max_len, max_rounds=3, partial=arm != "sync",
                               token_budget=budget, max_staleness=staleness, eos_token_id=EOS,
                               order="start" if arm in ("start", "delay") else "finish")
    rollouts = Rollouts(prompts, args.k, seed, 0, 1, settings, "cpu")
    theta = dict(START)
    optimizer = Adam(args.lr) if args.optimizer == "adam" else SGD(args.lr)
    engine = Engine(theta, seed + 10_000)
    held_out = [draw_n(random.Random(99 + i)) for i in range(2000)]
    course = []
    for step in range(1, args.steps + 1):
        samples, metrics = rollouts.collect(engine, Tok(), score_all, lambda t: t, step)
        cut = statistics.mean(len(s.generation.token_ids) >= args.max_len for s in samples)
        course.append({"cut": cut, "reward": statistics.mean(s.reward for s in samples),
                       "tokens": metrics["rollout/tokens_generated"],
                       "rounds": metrics["rollout/generation_rounds"]})
        optimizer.ascend(theta, gradient(samples, theta, args.group))
        engine.theta = dict(theta)  # the weight sync
        course[-1]["exact"] = exactness(theta, held_out)
    return course


def standard_error(values):
    return round(statistics.stdev(values) / math.sqrt(len(values)), 4) if len(values) > 1 else None


def lag(sync, other):
    fit = lag_fit(sync, other)
    return min(fit, key=fit.get)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arms", nargs="+", default=["sync", "partial", "start"],
                        choices=["sync", "partial", "start", "delay"])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--k", type=int, default=32, help="groups a step")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max_len", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--staleness", type=int, default=7)
    parser.add_argument("--start_staleness", type=int, default=2, help="K of the start-order arm")
    parser.add_argument("--lr", type=float, default=0.15, help="the optimizer's learning rate")
    parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd"],
                        help="sgd: steps that follow the gradient's size (Adam's do not, on four logits)")
    args = parser.parse_args()
    means = {}
    for arm in args.arms:
        runs = [run(arm, seed, args) for seed in range(args.seeds)]
        means[arm] = {key: [statistics.mean(r[t][key] for r in runs) for t in range(args.steps)]
                      for key in ("cut", "reward", "exact", "tokens", "rounds")}
        row = {"arm": arm, **{key: [round(x, 3) for x in v] for key, v in means[arm].items()
                              if key in ("cut", "exact")}}
        late = [statistics.mean(r[t]["reward"] for t in range(args.steps // 2, args.steps)) for r in runs]
        row["reward_late"] = round(statistics.mean(late), 4)  # steps 11-20 of 20, and its standard error
        row["reward_late_se"] = standard_error(late)
        if arm == "sync":
            sync_late = late
        elif "sync" in means:  # seed for seed (the same prompts in the same order)
            diff = [a - b for a, b in zip(late, sync_late)]
            row["reward_late_minus_sync"] = round(statistics.mean(diff), 4)
            row["its_se"] = standard_error(diff)
        row["tokens_per_step"] = round(statistics.mean(means[arm]["tokens"]))
        if "sync" in means and arm != "sync":
            row["cut_lag_behind_sync"] = lag(means["sync"]["cut"], means[arm]["cut"])
            row["exact_lag_behind_sync"] = lag(means["sync"]["exact"], means[arm]["exact"])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
