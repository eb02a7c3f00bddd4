"""Session 22's CPU table: held-out accuracy and reward at step 10 for seeds 0-3 of the synchronous loop,
the lagged loop and the lagged loop with sample-level weights, each arm minus the synchronous one.

    python bench/results/partial_cpu/session22/table.py      # from the repository root
"""

import json
import statistics

FILES = ["bench/results/partial_cpu/partial.jsonl", "bench/results/partial_cpu/session21/partial.jsonl",
         "bench/results/partial_cpu/session22/partial.jsonl",
         "bench/results/partial_cpu/session22/seeds23/partial.jsonl"]
ARMS = ("sync", "lag1-sync_tis", "lag1seq-sync_tis")

at10 = {"accuracy": {}, "reward": {}}  # metric: arm: seed: value at step 10
for path in FILES:
    for line in open(path):
        run = json.loads(line)
        arm, _, seed = run["run"].rpartition("-seed")
        if arm in ARMS and "eval" in run:
            step, accuracy, reward = run["eval"][-1]
            assert step == 10, run["run"]
            at10["accuracy"].setdefault(arm, {})[int(seed)] = accuracy
            at10["reward"].setdefault(arm, {})[int(seed)] = reward
for metric, arms in at10.items():
    for arm in ARMS:
        values = dict(sorted(arms[arm].items()))
        mean = statistics.mean(values.values())
        print(metric, arm, {s: round(v, 3) for s, v in values.items()}, round(mean, 3))
    for arm in ARMS[1:]:
        diffs = [arms[arm][s] - arms["sync"][s] for s in sorted(arms[arm])]
        print(metric, arm, "minus sync", [round(d, 3) for d in diffs], round(statistics.mean(diffs), 3),
              "SE", round(statistics.stdev(diffs) / len(diffs) ** 0.5, 3))
