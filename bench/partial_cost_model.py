"""Where partial rollout's generation time goes, from the step logs of bench_partial.py runs.

Fits one cost model to every steady step of the synchronous and the partial runs together:

    generate_s = a x tokens generated + b x decode steps + c

(decode steps: the longest response of a synchronous step; budget x generation rounds for a partial one,
whose rounds each run to the budget while any sample still generates). Then asks what a partial step would
cost had it generated only the synchronous runs' tokens (the same answers, cut into rounds): the speed of
the mechanism itself, apart from how long the two arms' policies learned to answer. An estimate from a
fit, not a measurement; the residuals say how well the model holds.

    python bench/partial_cost_model.py bench/results/partial_h100/long2048 --budget 256
"""

import argparse
import glob
import json
import os
import re
import statistics

import numpy as np


def steady_rows(path, skip):
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "perf/generate_s" in r][skip:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", help="a folder of sync-seedS / partial-seedS .metrics.jsonl files")
    parser.add_argument("--budget", type=int, required=True, help="the partial runs' --max_token_budget")
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out")
    args = parser.parse_args()
    runs = {}
    for path in sorted(glob.glob(os.path.join(args.results, "*-seed*.metrics.jsonl"))):
        name = re.fullmatch(r"(?:frozen-)?(sync|partial)-seed\d+\.metrics\.jsonl", os.path.basename(path))
        if name:  # (not partial-rR-seedS, nor a run kept under another name)
            runs.setdefault(name.group(1), []).extend(steady_rows(path, args.skip))
    if set(runs) != {"sync", "partial"}:
        raise SystemExit(f"{args.results}: needs sync-seedS and partial-seedS metrics files, "
                         f"found {sorted(runs)}")

    def decode_steps(mode, r):
        if mode == "sync":
            return r["rollout/response_length_max"]
        return args.budget * r["rollout/generation_rounds"]

    rest = {mode: statistics.median(r["perf/step_time_s"] - r["perf/generate_s"] for r in rows)
            for mode, rows in runs.items()}  # the step's other phases (update, sync, ...)
    table = [(mode, r["rollout/tokens_generated"], decode_steps(mode, r), r["perf/generate_s"])
             for mode, rows in runs.items() for r in rows]
    x = np.array([[tokens / 1e3, steps / 1e3, 1.0] for _, tokens, steps, _ in table])
    y = np.array([seconds for *_, seconds in table])
    (per_k_tokens, per_k_steps, constant), *_ = np.linalg.lstsq(x, y, rcond=None)
    fitted = x @ np.array([per_k_tokens, per_k_steps, constant])
    out = {"model": {"s_per_1k_tokens": round(per_k_tokens, 4), "ms_per_decode_step": round(per_k_steps, 3),
                     "constant_s": round(constant, 3)}}
    for mode in runs:
        pick = [i for i, row in enumerate(table) if row[0] == mode]
        out[mode] = {
            "steps": len(pick),
            "tokens_generated_median": statistics.median(table[i][1] for i in pick),
            "decode_steps_median": statistics.median(table[i][2] for i in pick),
            "generate_s_median": round(statistics.median(y[i] for i in pick), 2),
            "fit_s_median": round(statistics.median(fitted[i] for i in pick), 2),
            "residual_abs_median_s": round(statistics.median(abs(fitted[i] - y[i]) for i in pick), 2),
            "other_phases_s_median": round(rest[mode], 2),
        }
    sync, partial = out["sync"], out["partial"]
    sync_fit = statistics.median(fitted[i] for i, row in enumerate(table) if row[0] == "sync")
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
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
