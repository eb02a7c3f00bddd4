"""Session 13 scratch: the adaptive refill (fresh = need - p x carried-over groups, p a running share of
those that finished per round) in every round or after round 1, replayed by bench/replay_partial_schedule.py.
    python bench/results/partial_cpu/refill_variants.py
"""
import sys, json, types
ROOT = __import__('os').path.abspath(__file__ + '/../../../..')
sys.path.insert(0, ROOT + '/bench'); sys.path.insert(0, ROOT)
import replay_partial_schedule as R
src = open(ROOT + '/rft_core/rollout.py').read()
OLD = "fresh = max(need, in_hand - len(ready) - len(pending))"
UPD = ("            finished = [g for g in pending if all(g.done)]\n")
def variant(expr):
    code = src.replace(OLD, "carried = len(pending)\n            p = getattr(self, 'p', 0.5)\n            fresh = max(" + expr + ", in_hand - len(ready) - len(pending))\n            old_groups = pending[:carried] if False else list(pending)")
    code = code.replace(UPD, UPD + "            if carried: self.p = 0.8 * p + 0.2 * sum(all(g.done) for g in old_groups[:carried]) / carried\n")
    return code
V = {'current': src,
     'p_all': variant("math.ceil(need - p * carried)"),
     'p_later': variant("need if rounds == 1 else math.ceil(need - p * carried)"),
}
for name, code in V.items():
    mod = types.ModuleType('rv'); exec(compile(code, 'rv', 'exec'), mod.__dict__)
    R.Rollouts = mod.Rollouts; R.RolloutSettings = mod.RolloutSettings
    for args in [(2048, 256, 7, 1.0, 0.03), (2048, 256, 7, 1.0, 0.10), (128, 32, 3, 1.0, 0.03)]:
        print(name, json.dumps(R.replay(*args, steps=60, skip=10)))
