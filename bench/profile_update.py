"""Where the update phase's time goes: the train_ppo.py update (logprobs + entropy, PPO loss, backward,
clip, AdamW) on a synthetic batch, timed per step and profiled with torch.profiler; prints one JSON object.

    python bench/profile_update.py                          # SmolLM2-135M, 256 x (100 + 128) tokens, micro 64
    python bench/profile_update.py --micro_batch 128 --no_item_syncs [--compile]
    python bench/profile_update.py --pretrain TINY_DIR --batch 8 --micro_batch 4 --steps 2   # a CPU smoke run

--no_item_syncs keeps the per-micro-batch metrics on the device (train_ppo.py calls .item() on each),
to measure what those host syncs cost.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrain", default=None)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt_len", type=int, default=100)
    parser.add_argument("--response_len", type=int, default=128)
    parser.add_argument("--micro_batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no_item_syncs", action="store_true")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each decoder layer (--torch_compile)")
    args = parser.parse_args()

    from accelerate import Accelerator

    from rft_core.experience import Experience
    from rft_core.logprobs import response_logprobs
    from rft_core.losses import masked_mean, policy_loss
    from rft_core.model_training import compile_blocks
    from rft_core.models import load_model_and_tokenizer

    cuda = torch.cuda.is_available()
    accelerator = Accelerator(mixed_precision="bf16" if cuda else "no")
    model, tokenizer = load_model_and_tokenizer(args.pretrain)
    model = compile_blocks(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95))
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.gradient_accumulation_steps = args.batch // args.micro_batch
    device, B, P, R = accelerator.device, args.batch, args.prompt_len, args.response_len
    g = torch.Generator().manual_seed(0)
    exp = Experience(input_ids=torch.randint(10, len(tokenizer) - 10, (B, P + R), generator=g).to(device),
                     attention_mask=torch.ones(B, P + R, dtype=torch.long, device=device),
                     action_mask=torch.ones(B, R, dtype=torch.long, device=device),
                     rollout_logprobs=torch.zeros(B, R, device=device))
    exp.advantages = torch.randn(B, generator=g).to(device)
    sync = (lambda t: t) if args.no_item_syncs else (lambda t: t.item())

    def step():
        metrics = []
        num_tokens = exp.action_mask.sum().float()
        for mb in exp.split(args.micro_batch):
            with accelerator.accumulate(model), accelerator.autocast():
                logprobs, entropy = response_logprobs(model, mb.input_ids, mb.attention_mask, R, 1.0,
                                                      with_entropy=True)
                loss, m = policy_loss(logprobs, logprobs.detach(), mb.advantages, mb.action_mask, 0.2,
                                      num_tokens=num_tokens)
                accelerator.backward(loss * accelerator.gradient_accumulation_steps)
                if accelerator.sync_gradients:
                    metrics.append(sync(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
                optimizer.step()
                optimizer.zero_grad()
            metrics += [sync(loss.detach()), sync(masked_mean(entropy, mb.action_mask))]
        if cuda:
            torch.cuda.synchronize()
        return metrics

    step()  # warm-up
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    activities = ([torch.profiler.ProfilerActivity.CPU]
                  + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
    with torch.profiler.profile(activities=activities) as prof:
        step()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:args.top]
    print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "batch": B, "tokens": P + R,
                      "micro_batch": args.micro_batch, "item_syncs": not args.no_item_syncs,
                      "compile": args.compile, "step_s_median": statistics.median(times), "step_s": times,
                      "top_ops_ms": {e.key: round(getattr(e, key) / 1e3, 2) for e in events},
                      "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}))


if __name__ == "__main__":
    main()
