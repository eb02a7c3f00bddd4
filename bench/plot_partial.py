"""Reward against step and against wall-clock time for the runs in a bench_partial.py JSONL file.

    python bench/plot_partial.py bench/results/partial_h100/partial.jsonl   # -> partial.png beside it
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path):
    runs = [json.loads(line) for line in open(path)]
    # the shared warm-up is no arm; a run that stopped (a health-guard stop, a timeout) is left out
    runs = [r for r in runs if not r["run"].startswith("warm") and r["rc"] == 0]
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    # a colour per arm, the synchronous loop's first
    arms = sorted({r["run"].rsplit("-seed", 1)[0] for r in runs}, key=lambda a: (a != "sync", a))
    for r in runs:
        arm = r["run"].rsplit("-seed", 1)[0]
        label = f"{r['run']} ({r['samples_per_s']:.0f} samples/s)"
        style = {"color": f"C{arms.index(arm)}", "alpha": 0.8, "label": label}
        by_step.plot(range(1, len(r["reward_by_step"]) + 1), r["reward_by_step"], **style)
        by_time.plot(r["time_by_step"], r["reward_by_step"], **style)
    by_step.set(xlabel="step", ylabel="training reward (mean)", title="reward per step")
    by_time.set(xlabel="seconds (sum of step times)", title="reward against time")
    by_step.legend(fontsize=8)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])
