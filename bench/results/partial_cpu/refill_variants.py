"""Session 13 scratch: the adaptive refill replayed by bench/replay_partial_schedule.py. A round draws
need - p x carried fresh groups (carried: the unfinished groups it continues; p: a running share of those that
finished per round), in every round or after round 1, against the current rule (need).

    python bench/results/partial_cpu/refill_variants.py
"""

import json
import os
import sys
import types

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path[:0] = [os.path.join(ROOT, "bench"), ROOT]
import replay_partial_schedule as replay  # noqa: E402

SOURCE = open(os.path.join(ROOT, "rft_core", "rollout.py")).read()
DRAW = "fresh = max(need, in_hand - len(ready) - len(pending))"
FINISHED = "            finished = [g for g in pending if all(g.done)]\n"


def variant(expr):
    """rollout.py with the fresh draw replaced by expr (of need, p, carried) and p updated each round."""
    draw = ("carried, p = list(pending), getattr(self, 'p', 0.5)\n"
            f"            fresh = max({expr}, in_hand - len(ready) - len(pending))")
    update = ("            if carried:\n"
              "                self.p = 0.8 * p + 0.2 * sum(all(g.done) for g in carried) / len(carried)\n")
    assert DRAW in SOURCE and FINISHED in SOURCE
    return SOURCE.replace(DRAW, draw).replace(FINISHED, FINISHED + update)


VARIANTS = {"current": SOURCE,
            "refill_every_round": variant("math.ceil(need - p * len(carried))"),
            "refill_after_round_1": variant("need if rounds == 1 else math.ceil(need - p * len(carried))")}
for name, code in VARIANTS.items():
    module = types.ModuleType("rollout_variant")
    exec(compile(code, "rollout_variant", "exec"), module.__dict__)
    replay.Rollouts, replay.RolloutSettings = module.Rollouts, module.RolloutSettings
    workloads = ((2048, 256, 7, 0.03), (2048, 256, 7, 0.10), (128, 32, 3, 0.03))
    for max_len, budget, staleness, ramble in workloads:
        result = replay.replay(max_len, budget, staleness, 1.0, ramble, steps=60, skip=10)
        print(name, json.dumps(result))
