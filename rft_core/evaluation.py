"""Held-out evaluation through the rollout engine: greedy accuracy and pass@k, over every rank."""

import torch

from rft_core.rewards import pass_at_k


def evaluate(engine, tokenizer, rows, score_fn, accelerator, max_len, n_samples=1, temperature=1.0):
    """Greedy accuracy, and with n_samples > 1 pass@1 / pass@n of n samples at `temperature`, on
    rows [(prompt ids, label, prompt[, image inputs])]; each rank generates for its shard and the counts are summed.

    A sample is correct by the reward's "correct" component if it has one, else if its reward > 0.
    score_fn(prompts, completions, labels) -> (rewards, components, failures).
    """
    rank, world, n = accelerator.process_index, accelerator.num_processes, n_samples
    # every rank generates for the same number of rows (with sharded weights a forward is a collective);
    # the padding rows, copies of the first, are not counted
    local = rows[rank::world]
    count, local = len(local), (local + rows[:1] * (-(-len(rows) // world) - len(local)))
    engine.wake_up()

    def correct(rows, temperature):
        if not rows:
            return []
        ids, labels, prompts, *mm = (list(col) for col in zip(*rows))
        gens = engine.generate(ids, max_len, temperature=temperature, **({"mm": mm[0]} if mm else {}))
        completions = tokenizer.batch_decode([g.token_ids for g in gens], skip_special_tokens=True)
        rewards, components, _ = score_fn(prompts, completions, labels)
        return components["correct"] if "correct" in components else [float(r > 0) for r in rewards]

    sums = [sum(correct(local, 0.0)[:count]), count, 0.0, 0.0]
    if n > 1:
        sampled = correct([row for row in local for _ in range(n)], temperature)
        hits = [int(sum(sampled[i * n:(i + 1) * n])) for i in range(count)]
        sums[2:] = [sum(pass_at_k(n, c, 1) for c in hits), sum(pass_at_k(n, c, n) for c in hits)]
    totals = accelerator.reduce(torch.tensor(sums, device=accelerator.device, dtype=torch.float64), "sum").tolist()
    metrics = {"eval/accuracy": totals[0] / totals[1], "eval/num_problems": int(totals[1])}
    if n > 1:
        metrics.update({"eval/pass@1": totals[2] / totals[1], f"eval/pass@{n}": totals[3] / totals[1]})
    return metrics
