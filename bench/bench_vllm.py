"""Benchmarks of the colocated vLLM engine; prints one JSON object.

    python bench/bench_vllm.py --model smollm2           # throughput vs raw vLLM, sleep/wake, sync
    python bench/bench_vllm.py --model qwen1.5b --only sync

One vLLM engine per process (sleep mode's allocator allows no second), so run one model per call.
The Qwen2 models are random-initialised at bench_sizes.py's shapes, with Qwen's vocabulary: sync time
depends on sizes, not values.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_sizes import SHAPES, shape_config  # noqa: E402


def build(name):
    """(model on the GPU, tokenizer): the embedded SmolLM2-135M, or a random fp32 Qwen2 "qwen<shape>"."""
    from transformers import AutoModelForCausalLM

    from rft_core.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer()  # the SmolLM2 tokenizer serves every model here
    if name != "smollm2":
        config = shape_config(SHAPES[name.removeprefix("qwen")], 151936, eos_token_id=tokenizer.eos_token_id)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.cuda(), tokenizer


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def bench_engine(args):
    from vllm import SamplingParams

    from rft_core.data import encode_prompt
    from rft_core.engines.base import EngineSettings
    from rft_core.engines.vllm import VLLMEngine
    from rft_core.tasks.arithmetic import arithmetic_task

    model, tokenizer = build(args.model)
    model_dir = tempfile.mkdtemp()
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    t = time.perf_counter()
    settings = EngineSettings("vllm", mem_util=args.mem_util, sleep="always", sleep_level=args.sleep_level,
                              max_model_len=1024, enforce_eager=args.enforce_eager)
    engine = VLLMEngine(model_dir, tokenizer.eos_token_id, settings)
    result = {"model": args.model, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
              "engine_start_s": time.perf_counter() - t, "enforce_eager": args.enforce_eager}
    result["weight_sync_s"], _ = timed(lambda: engine.update_weights(model), 5)

    if args.only != "sync":
        rows, _ = arithmetic_task(num_train=args.num_prompts, seed=0)
        prompts = [encode_prompt(tokenizer, r["prompt"]) for r in rows]
        # the very requests our engine sends: same sampling, logprobs, stop token
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=args.max_tokens, logprobs=0,
                                detokenize=False, stop_token_ids=[tokenizer.eos_token_id])
        requests = [{"prompt_token_ids": p} for p in prompts]
        raw = lambda: engine.llm.generate(requests, params, use_tqdm=False)  # noqa: E731
        ours = lambda: engine.generate(prompts, args.max_tokens, 1.0)  # noqa: E731
        raw()  # warm-up
        raw_s, outs = timed(raw, 3)
        raw_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        ours_s, gens = timed(ours, 3)
        ours_tokens = sum(len(g.token_ids) for g in gens)
        # what the sampled tokens' logprobs cost (vLLM builds a Python object per token on the CPU)
        bare = params.clone()
        bare.logprobs = None
        bare_s, outs = timed(lambda: engine.llm.generate(requests, bare, use_tqdm=False), 3)
        result["raw_no_logprobs_tokens_per_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / bare_s
        result.update({"num_prompts": len(prompts), "raw_tokens_per_s": raw_tokens / raw_s,
                       "engine_tokens_per_s": ours_tokens / ours_s,
                       "engine_overhead_pct": 100 * (1 - (ours_tokens / ours_s) / (raw_tokens / raw_s))})
        for level in (1, 2):
            engine.sleep_level = level
            free_before, total = torch.cuda.mem_get_info()
            result[f"sleep_l{level}_s"], _ = timed(engine.sleep, 1)
            result[f"sleep_l{level}_freed_gib"] = (torch.cuda.mem_get_info()[0] - free_before) / 2**30
            result[f"wake_weights_l{level}_s"], _ = timed(lambda: engine.wake_up(["weights"]), 1)
            result[f"wake_kv_l{level}_s"], _ = timed(lambda: engine.wake_up(["kv_cache"]), 1)
            engine.update_weights(model)
        after = [g.token_ids for g in engine.generate(prompts[:8], 16, 0.0)]
        result["greedy_ok_after_sleep_sync"] = len(after) == 8
    print(json.dumps(result))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=["smollm2", *(f"qwen{size}" for size in SHAPES)])
    p.add_argument("--only", default="all", choices=["all", "sync"])
    p.add_argument("--num_prompts", type=int, default=256)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--mem_util", type=float, default=0.3)
    p.add_argument("--sleep_level", type=int, default=1)
    p.add_argument("--enforce_eager", action="store_true")
    bench_engine(p.parse_args())
