"""The longest response one update step trains at batch 1 per GPU (issue 18), with and without sequence
parallelism, and the step time per length; a random-weight Qwen2 shape (bench_sizes.SHAPES), under DeepSpeed
ZeRO-3 (Ulysses SP) or FSDP2 (context parallelism).

    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml bench/bench_sp_length.py \\
        --lengths 8192 16384 32768 --out sp1.json
    accelerate launch --config_file accelerate_configs/deepspeed_zero3_sp2.yaml bench/bench_sp_length.py ...
    accelerate launch --config_file accelerate_configs/fsdp2.yaml bench/bench_sp_length.py ...
        (and fsdp2_cp2)

Per length: one row of a 64-token prompt and L response tokens for each data-parallel rank (without SP each
GPU has its own row; with SP 2 the two GPUs share one), through the scripts' update: the chunked logprobs
(SequenceParallel's slices under SP / CP), actor_loss, backward and the AdamW step, bf16 autocast over fp32
weights. Gradient checkpointing is off (--checkpointing: on), so activations bound the length. Lengths go up
until one runs out of memory (that ends the sweep). The JSON (rewritten after each length, so a run cut off
keeps what it measured) holds per length: ok or oom, the median step seconds of --repeats after one warm-up,
and rank 0's peak GiB.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_sizes import SHAPES, shape_config  # noqa: E402
from rft_core.distributed import configure_deepspeed, process_group_kwargs  # noqa: E402
from rft_core.experience import Experience, Forward, micro_batch_logprobs  # noqa: E402
from rft_core.losses import LossSettings, actor_loss  # noqa: E402
from rft_core.sequence_parallel import SequenceParallel, sliced  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="1.5b", choices=[*SHAPES, "tiny"])  # tiny: a CPU check of the bench
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from accelerate import Accelerator
    from transformers import Qwen2ForCausalLM

    shape = {**SHAPES, "tiny": (64, 2, 4, 2, 128, True)}[args.size]
    config = shape_config(shape, 49152, max_position_embeddings=max(args.lengths) + 64,
                          attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)  # fp32 weights, as the scripts train
    accelerator = Accelerator(mixed_precision="bf16", kwargs_handlers=process_group_kwargs())
    configure_deepspeed(accelerator, 1, None, 1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    sp = SequenceParallel.from_accelerator(accelerator, model)
    model, optimizer = accelerator.prepare(model, optimizer)
    if args.checkpointing:
        accelerator.unwrap_model(model).gradient_checkpointing_enable({"use_reentrant": False})
    world, device = accelerator.num_processes, accelerator.device
    deepspeed = accelerator.state.deepspeed_plugin is not None
    result = {"size": args.size, "gpus": world, "sp_size": sp.size if sp else 1,
              "backend": "deepspeed" if deepspeed else accelerator.distributed_type.name.lower(),
              "checkpointing": args.checkpointing, "lengths": {},
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    cuda = torch.cuda if torch.cuda.is_available() else None

    def step(length):
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(5, 49000, (1, 64 + length), generator=g).to(device)
        exp = Experience(ids, torch.ones_like(ids), torch.ones(1, length, dtype=torch.long, device=device),
                         torch.zeros(1, length, device=device), advantages=torch.randn(1, device=device))
        mb = sp.shard(exp) if sp else exp
        tokens = accelerator.reduce(mb.action_mask.sum().float(), "sum")
        settings = LossSettings(num_tokens=tokens, num_pg_tokens=tokens,
                                num_seqs=world // (sp.size if sp else 1))
        with sliced(sp, model, mb), accelerator.autocast():  # CP: the forward and the backward in its context
            logprobs, entropy = micro_batch_logprobs(model, mb, Forward(chunk_size=2048, sp=sp), True)
            loss, _ = actor_loss(logprobs, entropy, mb, settings)
            accelerator.backward(loss * world)  # DeepSpeed steps AdamW here (one micro-batch per step)
        if not deepspeed:
            optimizer.step()
            optimizer.zero_grad()

    model.train()
    for length in args.lengths:
        times = []
        if cuda:
            cuda.reset_peak_memory_stats()
        try:
            for _ in range(1 + args.repeats):
                start = time.perf_counter()
                step(length)
                if cuda:
                    cuda.synchronize()
                times.append(time.perf_counter() - start)
            entry = {"ok": True, "step_s": round(statistics.median(times[1:]), 3),
                     "peak_gib": round(cuda.max_memory_allocated() / 2**30, 1) if cuda else None}
        except torch.OutOfMemoryError:
            entry = {"ok": False, "oom": True}
        result["lengths"][str(length)] = entry
        accelerator.print(json.dumps({"length": length, **entry}), flush=True)
        if accelerator.is_main_process:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        if not entry["ok"]:
            break
    accelerator.print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # after an out-of-memory error the engine's state is not worth tearing down


if __name__ == "__main__":
    main()
