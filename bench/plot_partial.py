"""Reward (or held-out accuracy) against step and against wall-clock time for bench_partial.py's runs.

    python bench/plot_partial.py bench/results/partial_h100/partial.jsonl   # -> partial.png beside it
    python bench/plot_partial.py bench/results/partial_h100x4/session20/*/partial.jsonl --accuracy \
        --out bench/results/partial_h100x4/session20/accuracy.png      # several files, the arms' means

--accuracy: the greedy held-out accuracy at each evaluation (time: the sum of step times up to its step,
evaluations not counted). With several runs an arm, each run is a thin line and the arm's mean a thick one
(with a count in the legend); runs of an arm that evaluated at other steps are left out of its mean.
"""

import argparse
import json
import os
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def course(run, accuracy):
    """(steps, seconds, values) of one run."""
    if not accuracy:
        return range(1, len(run["reward_by_step"]) + 1), run["time_by_step"], run["reward_by_step"]
    clock = [0.0] + run["time_by_step"]
    return ([step for step, _, _ in run["eval"]], [clock[step] for step, _, _ in run["eval"]],
            [acc for _, acc, _ in run["eval"]])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+", help="bench_partial.py JSONL files")
    parser.add_argument("--accuracy", action="store_true", help="held-out accuracy instead of the reward")
    parser.add_argument("--out", help="default: the first file's name with .png")
    args = parser.parse_args()
    runs = [json.loads(line) for path in args.files for line in open(path)]
    # the shared warm-up is no arm; a run that stopped (a health-guard stop, a timeout) is left out
    runs = [r for r in runs if not r["run"].startswith("warm") and r["rc"] == 0]
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    # a colour per arm, the synchronous loop's first
    arm_of = {r["run"]: r["run"].rsplit("-seed", 1)[0] for r in runs}
    arms = sorted(set(arm_of.values()), key=lambda a: ("sync" not in a, a))
    for arm in arms:
        members = [r for r in runs if arm_of[r["run"]] == arm]
        colour = f"C{arms.index(arm)}"
        for r in members:
            steps, seconds, values = course(r, args.accuracy)
            label = f"{r['run']} ({r['samples_per_s']:.0f} samples/s)" if len(members) == 1 else None
            width = 1.5 if len(members) == 1 else 0.6
            by_step.plot(steps, values, color=colour, alpha=0.8, lw=width, label=label)
            by_time.plot(seconds, values, color=colour, alpha=0.8, lw=width)
        if len(members) > 1:
            courses = [course(r, args.accuracy) for r in members]
            steps = list(courses[0][0])
            same = [c for c in courses if list(c[0]) == steps]
            mean = [statistics.mean(c[2][i] for c in same) for i in range(len(steps))]
            seconds = [statistics.mean(c[1][i] for c in same) for i in range(len(steps))]
            rate = statistics.mean(r["samples_per_s"] for r in members)
            label = f"{arm}: mean of {len(same)} ({rate:.0f} samples/s)"
            by_step.plot(steps, mean, color=colour, lw=2.5, label=label)
            by_time.plot(seconds, mean, color=colour, lw=2.5)
    name = "held-out accuracy (greedy)" if args.accuracy else "training reward (mean)"
    by_step.set(xlabel="step", ylabel=name, title=f"{name.split(' (')[0]} per step")
    by_time.set(xlabel="seconds (sum of step times)", title=f"{name.split(' (')[0]} against time")
    by_step.legend(fontsize=8)
    fig.tight_layout()
    out = args.out or os.path.splitext(args.files[0])[0] + ".png"
    fig.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    main()
