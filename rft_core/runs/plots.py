"""PNG plots: reward / accuracy curves, the latest rollout's lengths (the seed's GenLenAnalyser's)."""

import os

from rft_core.runs.integrity import read_rows


def write_plots(output_dir, lengths, max_len):
    """Write curves.png and gen_len.png into output_dir; lengths: the latest rollout's response lengths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = read_rows(os.path.join(output_dir, "metrics.jsonl"))[0]  # (a cut last row left out)
    steps = [r for r in rows if "rollout/reward_mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    curves, ax = plt.subplots(figsize=(6, 4))
    x = [r["step"] for r in steps]
    ax.plot(x, [r["rollout/reward_mean"] for r in steps], label="rollout/reward_mean")
    if steps and "rollout/reward/correct" in steps[0]:
        ax.plot(x, [r.get("rollout/reward/correct") for r in steps], label="rollout accuracy")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o--",
                label="eval/accuracy (greedy)")
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)

    gen_len, ax = plt.subplots(figsize=(6, 4))
    ax.hist(lengths, bins=min(50, max_len), range=(0, max_len))
    step = steps[-1]["step"] if steps else 0
    ax.set_title(f"generation lengths, step {step}: mean {sum(lengths) / max(len(lengths), 1):.1f}, "
                 f"{sum(n >= max_len for n in lengths)}/{len(lengths)} hit the limit")
    ax.set(xlabel="response tokens", ylabel="samples")
    for fig, name in ((curves, "curves.png"), (gen_len, "gen_len.png")):
        path = os.path.join(output_dir, name)  # written aside and renamed: a kill never leaves half a picture
        fig.tight_layout()
        fig.savefig(path + ".tmp", dpi=100, format="png")
        plt.close(fig)
        os.replace(path + ".tmp", path)
