"""The held-out accuracy difference per step, arm minus its synchronous pair, mean over the seed pairs with
one standard error, for several comparisons in one plot (analyze_partial.py --pairs JSON files).

    python bench/analyze_partial.py bench/results/partial_h100x4/session20/{a,b,c,d} --budget 512 \
        --tag drgrpo --partial_tag drgrpo-b512 --sync sync_tis --pairs > s20.json
    python bench/analyze_partial.py bench/results/partial_h100x4/session21/{a,b,c} --budget 2047 \
        --tag drgrpo --partial_tag delay1 --sync sync_tis --pairs > s21.json
    python bench/plot_pairs.py s20.json:"partial, budget 512" s21.json:"one version of delay" \
        --out bench/results/partial_h100x4/session21/differences.png
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+", help="FILE:LABEL, an analyze_partial.py --pairs output each")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.axhline(0, color="grey", linewidth=0.8)
    for spec in args.files:
        path, _, label = spec.partition(":")
        summary = json.load(open(path))["pairs"]["summary"]
        by_step = sorted((int(step), d["mean"], d["se"]) for step, d in summary["eval_diff_by_step"].items())
        steps, means, ses = zip(*by_step)
        ax.errorbar(steps, means, yerr=ses, capsize=3, marker="o",
                    label=f"{label or path} ({summary['pairs']} pairs)")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy, arm minus synchronous")
    ax.set_title("mean over seed pairs, one standard error")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(args.out)


if __name__ == "__main__":
    main()
