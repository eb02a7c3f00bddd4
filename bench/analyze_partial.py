"""What the step logs of bench_partial.py runs say about partial rollout against the synchronous loop.

1. Where generation's time goes. One cost model is fitted to every steady step of both arms together:

       generate_s = a x tokens generated + b x decode steps + c

   (decode steps: the longest response of a synchronous step; budget x generation rounds for a partial one,
   whose rounds each run to the budget while any sample still generates). Then: what a partial step would
   cost had it generated only the synchronous runs' tokens (the same answers, cut into rounds), i.e. the
   speed of the mechanism itself, apart from how long each arm's policy learned to answer. An estimate from
   a fit, not a measurement; the residuals say how well the model holds.

2. How large the optimizer's steps were. AdamW divides each gradient by the root of its running mean
   square, so a step's size relative to the others is about |g_t| / sqrt(v_t), with v_t the bias-corrected
   running mean of |g|^2 (beta2 of the scripts' AdamW, 0.95). From the logged gradient norms (before
   clipping): a global proxy of Adam's per-coordinate scaling that leaves out its momentum, not its exact
   steps; runs that log `train/adam_step_rms` (AdamW's own m_hat / sqrt(v_hat), RMS over the parameters)
   have the exact figure beside it. Also the correlation of the gradient norm with the trained responses'
   mean length (token-mean losses average over more tokens in a batch of longer answers).

3. How a metric moves step by step (--trajectory, e.g. rollout/truncated): its mean over each arm's runs at
   every step, and the lag, in steps, by which the synchronous arm's course best matches the partial arm's
   (least mean square difference over the steps both cover; lags up to half the steps). An eval/ metric
   (the held-out evaluations, every --eval_steps) is taken at each evaluation, its lag in evaluations.

4. Seed for seed (--pairs): each partial run against the synchronous run of its seed: speed-up, trained
   reward over steps 11-20, held-out accuracy at each evaluation and at the same training time; the
   differences' mean, standard error and t over the seeds (pairs()).

    python bench/analyze_partial.py RESULTS --budget 256      # RESULTS: bench_partial.py's $OUT folder
    python bench/analyze_partial.py RESULTS --budget 256 --tag frozen     # the runs named frozen-MODE-seedS
    python bench/analyze_partial.py RESULTS --budget 256 --sync sync_tis  # against sync_tis-seedS
    python bench/analyze_partial.py A B --budget 512 --tag drgrpo --partial_tag drgrpo-b512 --sync sync_tis \
        --trajectory rollout/truncated                                    # the runs of folders A and B
    python bench/analyze_partial.py A B C D --budget 512 --tag drgrpo --partial_tag drgrpo-b512 \
        --sync sync_tis --pairs > b512.json
    python bench/analyze_partial.py A B --budget 2047 --tag drgrpo --sync sync_tis --partial_tag alt \
        --partial_mode sync_tis --pairs    # a synchronous arm of other flags (alt-sync_tis-seedS) as partial

5. Plots (no analysis; --out the PNG written):
   --plot_pairs FILE:LABEL ...: the held-out accuracy's difference per evaluation step, arm minus its
   synchronous pair, mean over the seed pairs with one standard error, one line per --pairs output FILE.
   --plot_runs JSONL ... [--accuracy]: the training reward (or, --accuracy, the greedy held-out accuracy)
   against step and against wall-clock time (the sum of step times, evaluations not counted) of
   bench_partial.py's runs (its partial.jsonl files); several runs of an arm: each a thin line and the arm's
   mean a thick one, with a count in the legend (runs that evaluated at other steps left out of the mean).

    python bench/analyze_partial.py --plot_pairs b512.json:"budget 512" b2048.json:"budget 2048" \
        --out differences.png
    python bench/analyze_partial.py --plot_runs A/partial.jsonl B/partial.jsonl --accuracy --out accuracy.png
    python bench/analyze_partial.py --plot_runs RESULTS/partial.jsonl          # -> RESULTS/partial.png
"""

import argparse
import glob
import json
import math
import os
import re
import statistics

import numpy as np

BETA2 = 0.95  # rft_core.optim.adamw_with_warmup's


def read_runs(folders, tag, sync="sync", partial_tag=None, partial_mode="partial", cut=False):
    """[(mode, seed, rows)] for the runs named [TAG-]SYNC-seedS / [PARTIAL_TAG-]PARTIAL_MODE-seedS in the
    folders (SYNC: sync, or sync_tis for the synchronous arm with partial rollout's importance weights;
    PARTIAL_TAG: TAG unless given; PARTIAL_MODE: partial, or another arm compared with the synchronous one,
    e.g. sync_tis under another tag), read as "sync" and "partial"; rows: every line of the run's
    metrics.jsonl. cut: instead, runs stopped before their end whose step metrics were kept as
    NAME-seedS.cut.metrics.jsonl (a copy of the run's metrics.jsonl taken while it ran), for pairs()'s
    every-pair differences only."""
    partial_tag = tag if partial_tag is None else partial_tag
    names = {"sync": (re.escape(tag + "-") if tag else "") + sync,
             "partial": (re.escape(partial_tag + "-") if partial_tag else "") + partial_mode}
    if names["sync"] == names["partial"]:
        raise SystemExit(f"both arms would be {names['sync']}-seedS: give the other one its --partial_tag")
    found = []
    for path in sorted(p for folder in folders for p in glob.glob(os.path.join(folder, "*.metrics.jsonl"))):
        for mode, name in names.items():  # (not partial-rR-seedS, nor a run kept under another name)
            suffix = r"\.cut" if cut else ""
            match = re.fullmatch(name + r"-seed(\d+)" + suffix + r"\.metrics\.jsonl", os.path.basename(path))
            if match:
                with open(path) as f:
                    found.append((mode, int(match.group(1)), [json.loads(line) for line in f]))
    if not cut and {mode for mode, _, _ in found} != {"sync", "partial"}:
        raise SystemExit(f"{' '.join(folders)}: needs {names['sync']}-seedS and {names['partial']}-seedS "
                         f"metrics files, found {sorted({mode for mode, _, _ in found})}")
    return found


def by_arm(runs, key="perf/generate_s"):
    """{mode: [[rows of a run that hold key], ...]}: the steps' rows, or (key eval/accuracy) the held-out
    evaluations'."""
    arms = {}
    for mode, _, rows in runs:
        arms.setdefault(mode, []).append([r for r in rows if key in r])
    return arms


def cost_model(runs, budget, skip):
    def decode_steps(mode, r):
        if mode == "sync":
            return r["rollout/response_length_max"]
        return budget * r["rollout/generation_rounds"]

    steady = {mode: [r for rows in group for r in rows[skip:]] for mode, group in runs.items()}
    empty = [mode for mode, rows in steady.items() if not rows]
    if empty:
        raise SystemExit(f"no steps left after --skip {skip} in the {empty} runs")
    rest = {mode: statistics.median(r["perf/step_time_s"] - r["perf/generate_s"] for r in rows)
            for mode, rows in steady.items()}  # the step's other phases (update, sync, ...)
    table = [(mode, r["rollout/tokens_generated"], decode_steps(mode, r), r["perf/generate_s"])
             for mode, rows in steady.items() for r in rows]
    x = np.array([[tokens / 1e3, steps / 1e3, 1.0] for _, tokens, steps, _ in table])
    y = np.array([seconds for *_, seconds in table])
    (per_k_tokens, per_k_steps, constant), *_ = np.linalg.lstsq(x, y, rcond=None)
    fitted = x @ np.array([per_k_tokens, per_k_steps, constant])
    out = {"model": {"s_per_1k_tokens": round(per_k_tokens, 4), "ms_per_decode_step": round(per_k_steps, 3),
                     "constant_s": round(constant, 3)}}
    picks = {mode: [i for i, row in enumerate(table) if row[0] == mode] for mode in steady}
    fit_median = {mode: statistics.median(fitted[i] for i in pick) for mode, pick in picks.items()}
    for mode, pick in picks.items():
        out[mode] = {
            "steps": len(pick),
            "tokens_generated_median": statistics.median(table[i][1] for i in pick),
            "decode_steps_median": statistics.median(table[i][2] for i in pick),
            "generate_s_median": round(statistics.median(y[i] for i in pick), 2),
            "fit_s_median": round(fit_median[mode], 2),
            "residual_abs_median_s": round(statistics.median(abs(fitted[i] - y[i]) for i in pick), 2),
            "other_phases_s_median": round(rest[mode], 2),
        }
    sync, partial = out["sync"], out["partial"]
    sync_fit = fit_median["sync"]
    same_tokens = (per_k_tokens * sync["tokens_generated_median"] / 1e3
                   + per_k_steps * partial["decode_steps_median"] / 1e3 + constant)
    out["partial_at_sync_tokens"] = {
        "generate_s": round(same_tokens, 2),
        "generate_speedup": round(sync_fit / same_tokens, 2),
        # the other phases as the synchronous run's, which trained those tokens
        "step_speedup": round((sync_fit + rest["sync"]) / (same_tokens + rest["sync"]), 2),
        "tokens_ratio_measured": round(partial["tokens_generated_median"]
                                       / sync["tokens_generated_median"], 2),
    }
    return out


def relative_steps(norms):
    """|g_t| / sqrt(v_t) for each step: AdamW's running mean square with its bias correction."""
    v, out = 0.0, []
    for t, g in enumerate(norms, 1):
        v = BETA2 * v + (1 - BETA2) * g * g
        out.append(g / math.sqrt(v / (1 - BETA2 ** t)) if v > 0 else 0.0)
    return out


def step_sizes(runs, windows=((1, 5), (6, 10), (11, 20))):
    out = {}
    for mode, group in runs.items():
        per_run = []
        for rows in group:
            rows = [r for r in rows if "train/grad_norm" in r]
            norms = [r["train/grad_norm"] for r in rows]
            lengths = [r["rollout/response_length"] for r in rows]
            rel = relative_steps(norms)
            per_run.append({
                **{f"relative_step_{a}_{b}": round(statistics.mean(rel[a - 1:b]), 2)
                   for a, b in windows if len(rel) >= b},
                **{f"grad_norm_{a}_{b}": round(statistics.mean(norms[a - 1:b]), 3)
                   for a, b in windows if len(norms) >= b},
                **{f"adam_step_rms_{a}_{b}": round(statistics.mean(r["train/adam_step_rms"]
                                                                   for r in rows[a - 1:b]), 3)
                   for a, b in windows if len(rows) >= b and all("train/adam_step_rms" in r for r in rows)},
                "corr_grad_norm_length": (round(statistics.correlation(norms, lengths), 2)
                                          if len(set(norms)) > 1 and len(set(lengths)) > 1 else None),
            })
        out[mode] = per_run
    return out


def lag_fit(sync, other):
    """{d: mean of (other[t] - sync[t - d])^2 over the steps both cover}, for lags d up to half the steps."""
    steps = len(sync)
    return {d: statistics.mean((other[t] - sync[t - d]) ** 2 for t in range(d, steps))
            for d in range(steps // 2 + 1)}


def trajectory(runs, metric):
    """The metric's mean over each arm's runs at every step (runs that stopped early left out, counted), and
    the synchronous arm's lag behind the partial one: the shift d minimising the mean of
    (partial[t] - sync[t - d])^2."""
    steps = max(len(rows) for arm in runs.values() for rows in arm)
    whole = {mode: [rows for rows in arm if len(rows) == steps] for mode, arm in runs.items()}
    mean = {mode: [statistics.mean(rows[t][metric] for rows in arm) for t in range(steps)]
            for mode, arm in whole.items()}
    msd = lag_fit(mean["sync"], mean["partial"])
    return {"metric": metric, "runs": {mode: len(arm) for mode, arm in whole.items()},
            "stopped_early": {mode: len(runs[mode]) - len(arm) for mode, arm in whole.items()},
            "sync": [round(x, 4) for x in mean["sync"]], "partial": [round(x, 4) for x in mean["partial"]],
            "best_lag": min(msd, key=msd.get), "msd_by_lag": {d: round(v, 6) for d, v in msd.items()}}


def spread(diffs):
    """mean, sample sd, standard error and t of paired differences."""
    mean = statistics.mean(diffs)
    sd = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
    se = sd / math.sqrt(len(diffs))
    return {"mean": round(mean, 4), "sd": round(sd, 4), "se": round(se, 4),
            "t": round(mean / se, 2) if se > 0 else None}


def pairs(runs, skip, window=(11, 20), cut_runs=()):
    """Seed for seed, each partial run against the synchronous run of its seed (runs of one seed ran on one
    host, at the same time, where bench/partial_pairs.py ran them): the speed-up in samples per second
    over the steps after `skip` (sums of step times, and the median step's; pooled over the pairs in the
    summary), the trained reward's difference over the steps in `window`, and the held-out accuracy's
    difference at each evaluation and averaged over the evaluations after step 0, also against the
    synchronous run's at the same training time (seconds of steps, evaluations not counted; linear between
    its evaluations). Seeds without both arms, or whose arms ran different numbers of steps, are listed and
    left out; also the held-out accuracy's difference at each evaluation over every seed whose two runs
    reached it, cut_runs (read_runs(cut=True)) included."""
    by_seed, with_cut = {}, {}
    for mode, seed, rows in runs:
        by_seed.setdefault(seed, {})[mode] = rows
    for mode, seed, rows in [*cut_runs, *runs]:  # a whole run over a cut one of its name
        with_cut.setdefault(seed, {})[mode] = rows
    # seed: mode: {step: held-out accuracy}, for the seeds with both arms, cut or whole
    evals_of = {seed: {mode: {r["step"]: r["eval/accuracy"] for r in arm if "eval/accuracy" in r}
                       for mode, arm in arms.items()}
                for seed, arms in with_cut.items() if set(arms) == {"sync", "partial"}}
    reached = {}  # evaluation step: [partial - sync, one per seed whose two runs reached it]
    for evals in evals_of.values():
        for t in sorted(set(evals["sync"]) & set(evals["partial"])):
            reached.setdefault(t, []).append(evals["partial"][t] - evals["sync"][t])
    rows, left_out = [], {}
    for seed, arms in sorted(by_seed.items()):
        if set(arms) != {"sync", "partial"}:
            left_out[seed] = "one arm only"
            continue
        steps = {mode: [r for r in arm if "perf/step_time_s" in r] for mode, arm in arms.items()}
        if len(steps["sync"]) != len(steps["partial"]):
            left_out[seed] = f"steps {len(steps['sync'])} sync, {len(steps['partial'])} partial"
            continue
        times = {mode: [r["perf/step_time_s"] for r in arm[skip:]] for mode, arm in steps.items()}
        seconds = {mode: sum(t) for mode, t in times.items()}  # after `skip`
        reward = {mode: statistics.mean(r["rollout/reward_mean"] for r in arm[window[0] - 1:window[1]])
                  for mode, arm in steps.items()}
        evals = evals_of[seed]
        at = sorted(set(evals["sync"]) & set(evals["partial"]))
        # wall-clock: the seconds of training steps (generation included, evaluations not) up to each step
        clock = {mode: np.cumsum([0.0] + [r["perf/step_time_s"] for r in arm]) for mode, arm in steps.items()}
        sync_at = sorted(evals["sync"])
        same_time = [evals["partial"][t] - np.interp(clock["partial"][t], clock["sync"][sync_at],
                                                     [evals["sync"][u] for u in sync_at])
                     for t in sorted(evals["partial"]) if t > 0]
        rows.append({"seed": seed,
                     "speedup_sum": round(seconds["sync"] / seconds["partial"], 3),
                     "seconds": {mode: round(total, 3) for mode, total in seconds.items()},
                     "speedup_median_step": round(statistics.median(times["sync"])
                                                  / statistics.median(times["partial"]), 3),
                     "reward_sync": round(reward["sync"], 4), "reward_diff": round(reward["partial"]
                                                                                   - reward["sync"], 4),
                     "eval_diff": {t: round(evals["partial"][t] - evals["sync"][t], 4) for t in at},
                     "eval_mean_diff": round(statistics.mean(evals["partial"][t] - evals["sync"][t]
                                                             for t in at if t > 0), 4),
                     # the partial run's accuracy against the synchronous run's at the same training time
                     "eval_same_time_diff": round(float(statistics.mean(same_time)), 4),
                     "time_ratio": round(float(clock["sync"][-1] / clock["partial"][-1]), 3)})
    if not rows:
        raise SystemExit(f"no seed has both arms over the same steps: {left_out}")
    common = sorted(set.intersection(*(set(r["eval_diff"]) for r in rows)))
    speedups = [r["speedup_sum"] for r in rows]
    return {"seeds": rows, "left_out": left_out, "summary": {
        "pairs": len(rows), "window": list(window),
        "speedup_sum": {"median": round(statistics.median(speedups), 3), "min": min(speedups),
                        "max": max(speedups)},
        # every pair's samples over every pair's seconds (each run trains as many samples a step)
        "speedup_pooled": round(sum(r["seconds"]["sync"] for r in rows)
                                / sum(r["seconds"]["partial"] for r in rows), 3),
        "speedup_median_step": round(statistics.median(r["speedup_median_step"] for r in rows), 3),
        "reward_diff": spread([r["reward_diff"] for r in rows]),
        "eval_mean_diff": spread([r["eval_mean_diff"] for r in rows]),
        "eval_same_time_diff": spread([r["eval_same_time_diff"] for r in rows]),
        "eval_diff_by_step": {t: spread([r["eval_diff"][t] for r in rows]) for t in common},
        "eval_diff_by_step_every_pair": {t: {"pairs": len(d), **spread(d)} for t, d in sorted(reached.items())
                                         if t > 0}}}


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pairs(specs, out):
    """--plot_pairs: each FILE:LABEL's (a --pairs output) held-out accuracy difference by step, with its
    standard error."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.axhline(0, color="grey", linewidth=0.8)
    for spec in specs:
        path, _, label = spec.partition(":")
        with open(path) as f:
            summary = json.load(f)["pairs"]["summary"]
        by_step = sorted((int(step), d["mean"], d["se"]) for step, d in summary["eval_diff_by_step"].items())
        steps, means, ses = zip(*by_step)
        ax.errorbar(steps, means, yerr=ses, capsize=3, marker="o",
                    label=f"{label or path} ({summary['pairs']} pairs)")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy, arm minus synchronous")
    ax.set_title("mean over seed pairs, one standard error")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def course(run, accuracy):
    """(steps, seconds, values) of one bench_partial.py run: its reward by step, or its held-out accuracy
    at each evaluation."""
    if not accuracy:
        return range(1, len(run["reward_by_step"]) + 1), run["time_by_step"], run["reward_by_step"]
    clock = [0.0] + run["time_by_step"]
    return ([step for step, _, _ in run["eval"]], [clock[step] for step, _, _ in run["eval"]],
            [acc for _, acc, _ in run["eval"]])


def plot_runs(files, accuracy, out):
    """--plot_runs: reward (or held-out accuracy) against step and against time, a colour per arm."""
    plt = pyplot()
    runs = []
    for path in files:
        with open(path) as f:
            runs += [json.loads(line) for line in f]
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
            steps, seconds, values = course(r, accuracy)
            label = f"{r['run']} ({r['samples_per_s']:.0f} samples/s)" if len(members) == 1 else None
            width = 1.5 if len(members) == 1 else 0.6
            by_step.plot(steps, values, color=colour, alpha=0.8, lw=width, label=label)
            by_time.plot(seconds, values, color=colour, alpha=0.8, lw=width)
        if len(members) > 1:
            courses = [course(r, accuracy) for r in members]
            steps = list(courses[0][0])
            same = [c for c in courses if list(c[0]) == steps]
            mean = [statistics.mean(c[2][i] for c in same) for i in range(len(steps))]
            seconds = [statistics.mean(c[1][i] for c in same) for i in range(len(steps))]
            rate = statistics.mean(r["samples_per_s"] for r in members)
            label = f"{arm}: mean of {len(same)} ({rate:.0f} samples/s)"
            by_step.plot(steps, mean, color=colour, lw=2.5, label=label)
            by_time.plot(seconds, mean, color=colour, lw=2.5)
    name = "held-out accuracy (greedy)" if accuracy else "training reward (mean)"
    by_step.set(xlabel="step", ylabel=name, title=f"{name.split(' (')[0]} per step")
    by_time.set(xlabel="seconds (sum of step times)", title=f"{name.split(' (')[0]} against time")
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="*",
                        help="folders of [TAG-]sync-seedS / partial-seedS .metrics.jsonl files")
    parser.add_argument("--budget", type=int, help="the partial runs' --max_token_budget (required)")
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the cost model")
    parser.add_argument("--tag", default="", help="read the runs named TAG-MODE-seedS")
    parser.add_argument("--partial_tag", help="the partial runs' tag, where it is not --tag's")
    parser.add_argument("--partial_mode", default="partial",
                        help="the compared arm's mode in its runs' names (e.g. sync_tis, with --partial_tag)")
    parser.add_argument("--trajectory", metavar="METRIC", help="a step metric's course in both arms")
    parser.add_argument("--with_cut", action="store_true",
                        help="--pairs: also NAME-seedS.cut.metrics.jsonl (runs stopped early), in "
                             "eval_diff_by_step_every_pair only")
    parser.add_argument("--sync", default="sync", choices=["sync", "sync_tis"],
                        help="the synchronous arm: sync-seedS, or sync_tis-seedS (with --tis_cap 2)")
    parser.add_argument("--pairs", action="store_true",
                        help="seed for seed: speed-up, trained reward and held-out accuracy (pairs())")
    parser.add_argument("--plot_pairs", nargs="+", metavar="FILE:LABEL",
                        help="plot these --pairs outputs' held-out differences by step (with --out)")
    parser.add_argument("--plot_runs", nargs="+", metavar="JSONL",
                        help="plot bench_partial.py runs (partial.jsonl files): reward against step and time")
    parser.add_argument("--accuracy", action="store_true",
                        help="--plot_runs: the held-out accuracy instead of the reward")
    parser.add_argument("--out", help="the plot's PNG (--plot_runs: else the first file's name with .png)")
    args = parser.parse_args()
    if args.plot_pairs and args.plot_runs:
        parser.error("one plot a call: --plot_pairs or --plot_runs")
    if args.plot_pairs:
        if not args.out:
            parser.error("--plot_pairs needs --out PNG")
        plot_pairs(args.plot_pairs, args.out)
        print(args.out)
        return
    if args.plot_runs:
        out = args.out or os.path.splitext(args.plot_runs[0])[0] + ".png"
        plot_runs(args.plot_runs, args.accuracy, out)
        print(out)
        return
    if not args.results or args.budget is None:
        parser.error("the analysis needs results folders and --budget (or a --plot_pairs / --plot_runs plot)")
    runs = read_runs(args.results, args.tag, args.sync, args.partial_tag, args.partial_mode)
    steps = by_arm(runs)
    out = {"cost": cost_model(steps, args.budget, args.skip), "optimizer": step_sizes(steps)}
    if args.pairs:
        cut = read_runs(args.results, args.tag, args.sync, args.partial_tag, args.partial_mode, cut=True) \
            if args.with_cut else ()
        out["pairs"] = pairs(runs, args.skip, cut_runs=cut)
    if args.trajectory:
        evals = args.trajectory.startswith("eval/")
        out["trajectory"] = trajectory(by_arm(runs, "eval/accuracy") if evals else steps, args.trajectory)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
