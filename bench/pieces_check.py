"""Does an answer generated in pieces (partial rollout's continuation: prompt + tokens so far, under the same
weights) come out as one uninterrupted generation does? One engine, fixed weights, the counting task's
prompts (bench_partial.py); arms alternate: "whole" (one call to --max_len), "pieces" (calls of at most
--budget tokens, continued until EOS or --max_len, with Rollouts' rule for when a sample has finished) and
"whole_list" (one call, the limit given per prompt as partial rollout's calls give it).

    python bench/pieces_check.py --engine_type vllm --prompts 512 --n 4 --reps 2 [--model DIR]
    python bench/pieces_check.py --engine_type hf --max_len 128 --budget 32 --prompts 32 --n 4   # CPU

Prints, and writes to $OUT/pieces.json, per arm and repetition: answers, mean length, share ending in EOS,
share cut at --max_len, the task's reward, and EOS's hazard (answers ending at a position over answers that
reached it) in the 16 positions before and after each multiple of --budget (the seams) and elsewhere.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_partial import reward, task_rows  # noqa: E402
from rft_core.data import encode_rows  # noqa: E402
from rft_core.engine import create_engine  # noqa: E402
from rft_core.models import load_model_and_tokenizer  # noqa: E402
from rft_core.rollout import answer_finished  # noqa: E402


def whole(engine, prompts, max_len, per_request=False):
    """One call; per_request: the limit given per prompt (a list), the path partial rollout's calls take."""
    limits = [max_len] * len(prompts) if per_request else max_len
    return [g.token_ids for g in engine.generate(prompts, limits)]


def pieces(engine, prompts, max_len, budget, eos):
    """Continue each unfinished answer by at most `budget` tokens a call, until the rollout's
    answer_finished."""
    tokens, done = [[] for _ in prompts], [False] * len(prompts)
    while not all(done):
        idx = [i for i, d in enumerate(done) if not d]
        limits = [min(budget, max_len - len(tokens[i])) for i in idx]
        outputs = engine.generate([prompts[i] + tokens[i] for i in idx], limits)
        for i, limit, new in zip(idx, limits, outputs):
            tokens[i] += new.token_ids
            done[i] = answer_finished(new.token_ids, limit, len(tokens[i]), max_len, eos)
    return tokens


def summary(lengths, ends, labels, texts, max_len, budget):
    """The arm's figures from its answers' lengths, whether each ended in EOS, and their texts."""
    seam = {"ends": 0, "reached": 0}
    rest = {"ends": 0, "reached": 0}
    for length, ended in zip(lengths, ends):
        for t in range(1, length + 1):  # position t (1-based) reached; an EOS there ends the answer
            near = min(t % budget, budget - t % budget) <= 16
            where = seam if near and t > 16 else rest
            where["reached"] += 1
            where["ends"] += ended and t == length
    # up to the first seam both arms are one call on the same prompts: only what follows it may differ
    alive = [ended for length, ended in zip(lengths, ends) if length > budget]
    rewards = reward(None, texts, labels)
    return {"answers": len(lengths), "mean_len": statistics.mean(lengths),
            "eos_share": statistics.mean(ends), "cut_share": statistics.mean(n >= max_len for n in lengths),
            "past_budget": len(alive) / len(lengths), "eos_share_past_budget": statistics.mean(alive or [0]),
            "reward": statistics.mean(c + p for c, p in zip(rewards["correct"], rewards["partial"])),
            "correct": statistics.mean(rewards["correct"]),
            "eos_hazard_at_seams": seam["ends"] / max(1, seam["reached"]), "seam_positions": seam["reached"],
            "eos_hazard_elsewhere": rest["ends"] / max(1, rest["reached"])}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="an HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--engine_type", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--max_len", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--n", type=int, default=4, help="answers per prompt")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each arm, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", default=["whole", "pieces"],
                        choices=["whole", "pieces", "whole_list"])
    parser.add_argument("--enforce_eager", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    model, tokenizer = load_model_and_tokenizer(args.model, torch.bfloat16 if cuda else torch.float32)
    model.to("cuda" if cuda else "cpu")
    rows = task_rows(args.prompts, 7)
    samples, _ = encode_rows(tokenizer, rows, 256)
    prompts = [s.prompt_ids for s in samples for _ in range(args.n)]
    labels = [s.label for s in samples for _ in range(args.n)]
    engine = create_engine(args.engine_type, model, tokenizer, micro_batch_size=64, bf16=cuda, mem_util=0.5,
                         max_model_len=args.max_len + 256, requests=256, seed=args.seed,
                         enforce_eager=args.enforce_eager, sleep="never")
    eos, results = tokenizer.eos_token_id, []
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    for rep in range(args.reps):
        for arm in args.arms:
            start = time.time()
            answers = (pieces(engine, prompts, args.max_len, args.budget, eos) if arm == "pieces"
                       else whole(engine, prompts, args.max_len, per_request=arm == "whole_list"))
            texts = tokenizer.batch_decode(answers, skip_special_tokens=True)
            lengths, ends = [len(a) for a in answers], [bool(a) and a[-1] == eos for a in answers]
            row = {"arm": arm, "rep": rep, "seconds": round(time.time() - start, 1),
                   **summary(lengths, ends, labels, texts, args.max_len, args.budget)}
            print(json.dumps(row), flush=True)
            # per answer, in prompt order (answers of a prompt together): paired comparisons between arms
            results.append({**row, "lengths": lengths, "ended": ends})
            with open(os.path.join(out, "pieces.json"), "w") as f:  # each arm: a run cut off keeps them
                json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
