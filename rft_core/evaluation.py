"""Held-out evaluation through the rollout engine: greedy reward and accuracy, and pass@k, over every rank."""

import math
from dataclasses import replace
from functools import partial

import torch

from rft_core.episodes import score as score_episodes


def is_correct(sample, threshold=None):
    """1.0 if right by its "correct" component (or reward >= threshold); a failed reward is 0.0."""
    if threshold is not None:
        return float(sample.reward >= threshold)
    value = sample.components.get("correct", math.nan)
    return 0.0 if math.isnan(value) else value


def evaluate(engine, tokenizer, prompts, score_fn, accelerator, max_len, n_samples=1, temperature=1.0,
             reward_threshold=None, episodes=None):
    """eval/reward_mean of greedy responses, and where is_correct is defined eval/accuracy and, for
    n_samples > 1, pass@1 / pass@n at `temperature`, over every rank's shard. score_fn: a
    rewards.RewardScorer; episodes: an episodes.EpisodeRunner (--env)."""
    rank, world, n = accelerator.process_index, accelerator.num_processes, n_samples
    # every rank generates as many rows (sharded weights: a forward is a collective); the padding not counted
    local = prompts[rank::world]
    count, local = len(local), (local + prompts[:1] * (-(-len(prompts) // world) - len(local)))
    engine.wake_up()
    failed = env_failed = 0  # rewards (scored as the fallback) and environments that failed, on this rank

    def any_rank(count):
        return bool(accelerator.reduce(torch.tensor(float(count), device=accelerator.device), "sum").item())

    def rollout(prompts, temperature, real):
        """The first `real` samples (the rest pad the ranks' generate calls alike), scored."""
        nonlocal failed, env_failed

        def generate(prompts, limits, mm):
            return engine.generate(prompts, limits, temperature=temperature, mm=mm, logprob_every=0)

        if episodes is not None:  # (every rank takes part in each turn, with or without prompts)
            samples = episodes.run(generate, prompts, any_rank)[:real]
            failed += score_episodes(samples, score_fn)
            env_failed += sum(s.episode.failure is not None for s in samples)
            return samples
        if not prompts:
            return []
        gens = generate([p.prompt_ids for p in prompts], max_len, [p.mm for p in prompts])
        completions = tokenizer.batch_decode([g.token_ids for g in gens], skip_special_tokens=True)
        samples = [replace(p, generation=g, completion=c) for p, g, c in zip(prompts, gens, completions)]
        failed += score_fn(samples[:real]) or 0
        return samples[:real]

    correct = partial(is_correct, threshold=reward_threshold)
    greedy = rollout(local, 0.0, count)
    defined = reward_threshold is not None or any("correct" in s.components for s in greedy) or not count
    defined = not any_rank(not defined)  # on every rank: none lacks it
    sums = [sum(s.reward for s in greedy), count, sum(correct(s) for s in greedy), 0.0, 0.0]
    if n > 1 and defined:
        sampled = rollout([p for p in local for _ in range(n)], temperature, count * n)
        hits = [int(sum(correct(s) for s in sampled[i * n:(i + 1) * n])) for i in range(count)]
        sums[3:5] = [sum(pass_at_k(n, c, 1) for c in hits), sum(pass_at_k(n, c, n) for c in hits)]
    sums += [failed, env_failed]
    totals = accelerator.reduce(torch.tensor(sums, device=accelerator.device, dtype=torch.float64),
                                "sum").tolist()
    metrics = {"eval/reward_mean": totals[0] / totals[1], "eval/num_problems": int(totals[1]),
               "eval/reward_errors": int(totals[5])}
    if episodes is not None:
        metrics["eval/env_errors"] = int(totals[6])
    if defined:
        metrics["eval/accuracy"] = totals[2] / totals[1]
        if n > 1:
            metrics.update({"eval/pass@1": totals[3] / totals[1], f"eval/pass@{n}": totals[4] / totals[1]})
    return metrics


def eval_line(step, metrics, n):
    line = f"[eval] step {step} | greedy reward {metrics['eval/reward_mean']:.3f}"
    if "eval/accuracy" in metrics:
        line += f" | accuracy {metrics['eval/accuracy']:.3f}"
    if f"eval/pass@{n}" in metrics and n > 1:
        line += f" | pass@1 {metrics['eval/pass@1']:.3f} | pass@{n} {metrics[f'eval/pass@{n}']:.3f}"
    line += f" on {metrics['eval/num_problems']} held-out problems"
    if metrics.get("eval/reward_errors"):  # their fallback reward is in the figures above
        line += f" ({metrics['eval/reward_errors']} rewards failed and count as --reward_fallback)"
    return line


def eval_summary(first, last):
    """`greedy accuracy 0.1 -> 0.4 on 96 held-out problems` (reward where accuracy is not defined)."""
    key, name = ("eval/accuracy", "accuracy") if "eval/accuracy" in last else ("eval/reward_mean", "reward")
    return (f"greedy {name} {first[key]:.3f} -> {last[key]:.3f} on {last['eval/num_problems']} held-out "
            "problems")


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
