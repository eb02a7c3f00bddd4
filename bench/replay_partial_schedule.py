"""Replay partial rollout's scheduler (rft_core/rollout.py) on a scripted engine, no model: how old the
trained samples are and what generation would cost, for lengths like bench_partial.py's counting task.

Each prompt asks to count to N (80% in 3-15, 20% in 40-150); an answer is 2N + 6-16 tokens, and a share
(--ramble) runs to --max_len. Generation time per engine call comes from the cost model that
analyze_partial.py fitted to the H100 runs (1.68 ms per decode step + 0.032 s per 1,000 tokens), so it
prices the scheduling only. Prints one JSON line per run: the trained samples' mean start age and token age
(versions), the share of one-budget answers trained a step or more late, rounds and modelled generate seconds
per step (means over the steps after --skip).

    python bench/replay_partial_schedule.py --max_len 2048 --budget 256 --staleness 7 --ratio 1 2
    python bench/replay_partial_schedule.py --max_len 2048 --budget 2048 --staleness 0      # synchronous
    python bench/replay_partial_schedule.py --order start --staleness 1 --budget 2047  # a pure one-step delay
"""

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rft_core.engine import Generation  # noqa: E402
from rft_core.experience import Sample  # noqa: E402
from rft_core.rollout import Rollouts, RolloutSettings  # noqa: E402

EOS, GROUP, PROMPT_LEN = 0, 8, 3


class Engine:
    """Answer j of prompt i has a fixed length (its own seeded draw); its token t is 10 + 10000 j + t, EOS
    last. A continued request names its answer by its first token, a new one by its place among the requests
    of its prompt (a group's new samples come in order)."""

    def __init__(self, max_len, ramble, prompts):
        rng = random.Random(0)
        self.tops = [rng.randint(3, 15) if rng.random() < 0.8 else rng.randint(40, 150)
                     for _ in range(prompts)]
        self.max_len, self.ramble, self.calls = max_len, ramble, []

    def length(self, prompt, j):
        rng = random.Random(prompt * 1000 + j)
        if rng.random() < self.ramble:
            return self.max_len
        return min(self.max_len, 2 * self.tops[prompt] + 6 + rng.randint(0, 10))

    def generate(self, prompts, limits, temperature=1.0, top_p=1.0, mm=None, logprob_every=1):
        out, new = [], {}
        for p, limit in zip(prompts, limits):
            done = len(p) - PROMPT_LEN
            if done:
                j = (p[PROMPT_LEN] - 10) // 10000
            else:
                j = new[p[0]] = new.get(p[0], -1) + 1
            total = self.length(p[0], j)
            ids = [10 + 10000 * j + t for t in range(done, min(total, done + limit))]
            if done + len(ids) == total and total < self.max_len:
                ids[-1] = EOS
            out.append(Generation(ids, [0.0] * len(ids)))
        self.calls.append([len(g.token_ids) for g in out])
        return out


class Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [""] * len(ids)


def score_all(samples, strict=False):
    for s in samples:
        s.reward, s.components = random.random(), {}
    return 0


score_all.check = lambda failed, total, step: None


def replay(max_len, budget, staleness, ratio, ramble, steps, skip, k=32, max_rounds=3, order="finish"):
    prompts = 200 * k
    settings = RolloutSettings(GROUP, max_len, max_rounds=max_rounds, partial=True, token_budget=budget,
                               max_staleness=staleness, eos_token_id=EOS, inflight_ratio=ratio, order=order)
    rollouts = Rollouts([Sample([i, 0, 99], str(i), f"p{i}") for i in range(prompts)], k, 0, 0, 1, settings,
                        "cpu")
    engine = Engine(max_len, ramble, prompts)
    ages, token_ages, late, rounds, seconds, mixed = [], [], [], [], [], []
    for step in range(1, steps + 1):
        first = len(engine.calls)
        samples, _ = rollouts.collect(engine, Tok(), score_all, lambda t: t, step)
        if step <= skip:
            continue
        calls = engine.calls[first:]
        rounds.append(len(calls))
        seconds.append(sum(1.68e-3 * max(c, default=0) + 0.032e-3 * sum(c) for c in calls))
        for s in samples:
            versions = s.generation.versions
            ages.append(step - 1 - min(versions))
            token_ages += [step - 1 - v for v in versions]
            mixed.append(len(set(versions)) > 1)
            if len(versions) <= budget:
                late.append(ages[-1] > 0)
    mean = statistics.mean
    return {"order": order, "budget": budget, "staleness": staleness, "ratio": ratio, "ramble": ramble,
            "start_age": round(mean(ages), 2), "token_age": round(mean(token_ages), 2),
            "mixed_versions": round(mean(mixed), 3),
            "one_budget_trained_late": round(mean(late), 2) if late else None,
            "rounds_per_step": round(mean(rounds), 2), "generate_s_per_step": round(mean(seconds), 2)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_len", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--staleness", type=int, default=7)
    parser.add_argument("--ratio", type=float, nargs="+", default=[1.0])
    parser.add_argument("--ramble", type=float, default=0.03, help="share of answers that run to --max_len")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--order", default="finish", choices=["finish", "start"], help="--partial_order")
    args = parser.parse_args()
    for ratio in args.ratio:
        print(json.dumps(replay(args.max_len, args.budget, args.staleness, ratio, args.ramble, args.steps,
                                args.skip, order=args.order)), flush=True)


if __name__ == "__main__":
    main()
