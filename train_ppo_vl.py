"""Reinforcement fine-tuning of a vision-language model (Qwen2-VL family), in one file.

The same loop, estimators and losses as train_ppo.py, with images: each prompt carries its images'
pixels, the rollout engine and every trainer forward see them, and a prompt whose image tokens do
not match its images is an error naming the sample. With no arguments: GRPO on a tiny random
Qwen2-VL (word-level vocabulary, built from a config) over a built-in, seeded task of drawn shapes
("what colour is the shape ?", "how many shapes are there ?"), reward 1 for the right first word.

    python train_ppo_vl.py                                # CPU (transformers engine) or one GPU (vLLM if installed)
    accelerate launch train_ppo_vl.py --pretrain /models/Qwen2-VL-2B-Instruct --prompt_data data/vqa.jsonl \
        --images_key images --label_key answer --reward_fn math --freeze_prefix model.visual

vLLM gets one placeholder per image and the images, and must expand them to the trainer's prompt token
for token (rft_core/vllm_engine.py). With --save_steps N, running the same command again resumes from the
last complete checkpoint. gae's critic is a copy of the policy's backbone, vision tower included.
Scale-out as for train_ppo.py: `accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml
train_ppo_vl.py ...` (any config there). The loop per step: rollout -> rewards/advantages -> logprobs ->
update -> weight sync -> log -> eval/checkpoint; where it departs from the papers (KL placement, reused old
logprobs, temperature-only logprobs, per-micro-batch high-entropy tokens) is as train_ppo.py's docstring says.
"""

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm
from transformers import get_scheduler

from rft_core.advantages import (ADVANTAGE_ESTIMATORS, TOKEN_LEVEL, adaptive_kl_coef, compute_advantages,
                                  token_level_advantages)
from rft_core.cli import MetricsLog, gather_metrics, parse_args, phase_peak_gb, timed
from rft_core.data import batches, text_batches
from rft_core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from rft_core.distributed import configure_deepspeed, grad_norm_value, prepare_frozen, process_group_kwargs
from rft_core.engine import create_engine
from rft_core.evaluation import evaluate
from rft_core.experience import batched_logprobs, batched_values, build_experience
from rft_core.losses import (LOSS_AGG_MODES, aggregate_loss, high_entropy_mask, kl_estimate, masked_mean, policy_loss,
                             value_loss)
from rft_core.models import export_hf, lm_loss, response_logprobs, response_values
from rft_core.plots import write_plots
from rft_core.rewards import RunningMoments, overlong_penalty, reward_sources, weighted_rewards
from rft_core.vision import (VisionValueModel, encode_vl_prompt, first_word_reward, load_image_rows, load_vl_model,
                             shapes_task)


@dataclass
class Args:
    # ---- model and data ----
    pretrain: Optional[str] = None
    """Qwen2-VL-family model directory (default: a tiny random Qwen2-VL built from a config)"""
    prompt_data: str = "shapes"
    """built-in task name (shapes) or a local JSONL / JSON / parquet file or directory"""
    images_key: str = "images"
    """column of each prompt's image paths (relative to the data file; a list of frame paths is a video); empty: text only"""
    limit_mm_image_per_prompt: int = 4
    """prompts with more images are skipped and counted"""
    mixed_mm_data: bool = False
    """allow text-only prompts among image prompts (otherwise a prompt without images is skipped and counted)"""
    freeze_prefix: Optional[str] = None
    """freeze the parameters whose name starts with this (e.g. model.visual: the vision tower)"""
    image_max_pixels: int = 84 * 84
    """images are resized to at most this many pixels (Qwen2-VL: 28 x 28 pixels make one token)"""
    input_key: str = "prompt"
    """column holding the prompt: a string or a list of chat messages"""
    label_key: str = "label"
    """column holding the reference answer"""
    reward_fn: Optional[str] = None
    """first word of the response == label (the default) | answer (in <answer> tags) | math (math-verify) |
    path/to/file.py:function, called as fn(prompts, completions, labels) -> list of floats or dict of named
    lists (summed; each logged as rollout/reward/<name>)"""
    remote_rm_url: Optional[str] = None
    """HTTP endpoint of a reward model: POST {prompts, completions, labels} -> {"rewards": [...]}"""
    reward_pretrain: Optional[str] = None
    """reward model(s): comma-separated sequence-classification checkpoints scoring prompt + response (each logged
    as rollout/reward/rm<i>); with --reward_fn / --remote_rm_url as well, all are summed with --reward_weights"""
    reward_weights: Optional[Tuple[float, ...]] = None
    """one weight per reward source, in the order: --reward_fn or --remote_rm_url (if given), then each reward model"""
    reward_clip: Optional[float] = None
    """clip the (normalised) reward to [-C, C]"""
    normalize_reward: bool = False
    """divide rewards by the running std of all rewards seen, after subtracting the running mean"""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping: responses longer than generate_max_len - this get a linear penalty (0: off)"""
    overlong_penalty_factor: float = 1.0
    """the penalty at generate_max_len tokens"""
    reward_fallback: float = 0.0
    """reward given to a sample whose reward raises, is not finite or is missing (counted in rollout/reward_errors)"""
    strict_rewards: bool = False
    """make any reward failure fatal, showing the offending sample"""
    eval_data: Optional[str] = None
    """held-out prompts (a file or directory like --prompt_data; default: the built-in task's eval split)"""
    eval_n_samples: int = 1
    """with N > 1, eval also samples N completions per problem at --temperature and reports pass@1 and pass@N"""
    prompt_max_len: int = 1024
    """prompts longer than this (in tokens) are skipped and counted"""
    generate_max_len: int = 8
    """maximum new tokens per response (also Dr.GRPO's normalising constant)"""
    # ---- algorithm ----
    advantage_estimator: str = "group_norm"
    """group_norm (GRPO) | dr_grpo | rloo | cpgd | reinforce (REINFORCE++) | reinforce_baseline | gae (PPO with a critic)"""
    n_samples_per_prompt: int = 8
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
    """weight of the KL loss, or of the per-token KL penalty in the reward (gae, reinforce*; 0: no reference model)"""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 (Schulman's estimators) for the KL loss"""
    kl_target: Optional[float] = None
    """adaptive KL controller (Ziegler et al. 2019) for the reward penalty: the per-token KL to aim for (None: fixed)"""
    kl_horizon: int = 10000
    """the adaptive controller's horizon, in samples"""
    gamma: float = 1.0
    """discount of the token-level estimators (gae, reinforce, reinforce_baseline)"""
    lambd: float = 0.95
    """GAE lambda"""
    critic_learning_rate: float = 5e-5
    """gae: AdamW learning rate of the critic (the policy's backbone with a value head)"""
    value_clip: Optional[float] = 0.2
    """clip the critic's new values to within this of the old ones in its loss (None: unclipped)"""
    freezing_actor_steps: int = 0
    """gae: train only the critic for this many first steps"""
    use_cpg_loss: bool = False
    """CPGD's clipped policy-gradient loss (on by default with --advantage_estimator cpgd)"""
    policy_drift_coef: Optional[float] = None
    """CPGD's policy drift: weight of KL(pi_old || pi) in the loss (default: 0.01 with cpgd, else 0)"""
    high_entropy_token_ratio: float = 0.0
    """train on only this fraction of response tokens, those of highest entropy (0: all; 0.2 in the paper)"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and refill from fresh prompts"""
    max_num_gen_batches: int = 3
    """with --dynamic_sampling, at most this many generation rounds per step; the rest is filled with dropped groups"""
    ema_beta: Optional[float] = None
    """keep an exponential moving average of the actor (e.g. 0.99), exported to output_dir/ema_model"""
    pretrain_data: Optional[str] = None
    """text data (a file or directory like --prompt_data) for a pretraining loss mixed into the update (ptx)"""
    pretrain_key: str = "text"
    """column of --pretrain_data holding the text"""
    ptx_coef: float = 0.05
    """weight of the pretraining loss"""
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
    max_steps: int = 100
    """stop after this many rollout steps (or fewer, when the episodes run out)"""
    actor_learning_rate: Optional[float] = None
    """AdamW learning rate (default: 3e-3 for the built-in tiny random model, 1e-6 for a --pretrain model)"""
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
    lora_rank: int = 0
    """train LoRA adapters of this rank instead of every weight (0: full fine-tuning); vLLM gets the merged weights"""
    lora_alpha: int = 16
    """LoRA scaling numerator (the update is alpha / rank * B A)"""
    target_modules: str = "all-linear"
    """modules that get adapters: all-linear, or comma-separated names such as q_proj,v_proj"""
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
    """checkpoint every this many steps (0: never): models, optimizers, schedulers, RNG states, data position"""
    max_ckpt_num: int = 3
    """keep only the newest this many checkpoints"""
    no_resume: bool = False
    """start afresh even when output_dir holds a checkpoint (default: resume from the latest one)"""
    save_hf_steps: int = 0
    """also export the model with save_pretrained to output_dir/hf-step-N every this many steps (0: only at the end)"""
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


def main():
    args = parse_args(Args)
    args.bf16 = torch.cuda.is_available() if args.bf16 is None else args.bf16
    args.actor_learning_rate = args.actor_learning_rate or (1e-6 if args.pretrain else 3e-3)
    trackers = (["wandb"] if args.use_wandb else []) + (["tensorboard"] if args.use_tensorboard else [])
    accelerator = Accelerator(mixed_precision="bf16" if args.bf16 else "no", log_with=trackers or None,
                              project_dir=args.use_tensorboard, kwargs_handlers=process_group_kwargs())
    world = accelerator.num_processes

    # ---- derived values and checks ----
    def check(ok, message):
        if not ok:
            raise ValueError(message)

    samples_per_step = args.rollout_batch_size * args.n_samples_per_prompt
    args.train_batch_size = args.train_batch_size or samples_per_step
    check(args.rollout_batch_size % world == 0, f"--rollout_batch_size {args.rollout_batch_size} must divide over {world} processes")
    check(samples_per_step % args.train_batch_size == 0, f"rollout_batch_size * n_samples_per_prompt = {samples_per_step} "
          f"must be a multiple of --train_batch_size {args.train_batch_size}")
    check(args.train_batch_size % (args.micro_train_batch_size * world) == 0, f"--train_batch_size {args.train_batch_size} "
          f"must be a multiple of --micro_train_batch_size {args.micro_train_batch_size} x {world} processes")
    grad_accum = args.train_batch_size // (args.micro_train_batch_size * world)
    rows_per_update = args.train_batch_size // world  # local samples per optimizer step
    deepspeed = accelerator.state.deepspeed_plugin
    sharded = accelerator.distributed_type.name == "FSDP" or (deepspeed is not None and deepspeed.zero_stage == 3)
    check(not (args.ema_beta and (args.lora_rank or sharded)), "--ema_beta is not supported with --lora_rank (the export "
          "would merge the live adapter) nor under ZeRO-3 / FSDP2 (it averages whole parameters)")
    check(not (deepspeed and args.advantage_estimator == "gae"), "gae trains a critic beside the actor, which one "
          "DeepSpeed engine cannot: use the multi_gpu or fsdp2 config")
    eps_low, eps_high = args.eps_clip_low_high or (args.eps_clip, args.eps_clip)
    check(args.dual_clip is None or args.dual_clip > 1, f"--dual_clip must be > 1, got {args.dual_clip}")
    check(not (args.reward_fn and args.remote_rm_url), "--reward_fn and --remote_rm_url both given: pass one")
    check(args.advantage_estimator in ADVANTAGE_ESTIMATORS and args.loss_agg_mode in LOSS_AGG_MODES,
          f"--advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, --loss_agg_mode one of {LOSS_AGG_MODES}")
    token_level = args.advantage_estimator in TOKEN_LEVEL
    kl_in_reward = token_level and not args.use_kl_loss and args.init_kl_coef > 0  # KL penalty in the token rewards
    use_cpg_loss = args.use_cpg_loss or args.advantage_estimator == "cpgd"
    drift_coef = args.policy_drift_coef if args.policy_drift_coef is not None else 0.01 * (args.advantage_estimator == "cpgd")
    # with the KL in the reward, old logprobs are needed before the update, so they get their own pass
    reuse_old_logprobs = args.max_epochs == 1 and args.train_batch_size == samples_per_step and not kl_in_reward
    check(args.kl_target is None or kl_in_reward, "--kl_target adapts the KL penalty in the reward: use gae / reinforce / "
          "reinforce_baseline, --init_kl_coef > 0 and no --use_kl_loss")
    check(0.0 <= args.high_entropy_token_ratio <= 1.0, f"--high_entropy_token_ratio must be in [0, 1], got {args.high_entropy_token_ratio}")
    check(not args.freezing_actor_steps or args.advantage_estimator == "gae",
          "--freezing_actor_steps trains the critic alone: it needs --advantage_estimator gae")
    check(0 <= args.overlong_buffer_len < args.generate_max_len,
          f"--overlong_buffer_len must be in [0, --generate_max_len {args.generate_max_len})")

    accelerator.gradient_accumulation_steps = grad_accum  # before prepare(): DeepSpeed reads it there
    configure_deepspeed(accelerator, args.micro_train_batch_size, grad_accum, args.max_norm)
    set_seed(args.seed, device_specific=True)
    os.makedirs(args.output_dir, exist_ok=True)
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "config.json"), "w") as f:
            json.dump({**asdict(args), "world_size": world, "grad_accum": grad_accum}, f, indent=2)
    if trackers:  # scalars and strings only: TensorBoard's hparams refuse None
        accelerator.init_trackers(args.wandb_project, config={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                                              for k, v in asdict(args).items()})
    resume_from = None if args.no_resume else latest_checkpoint(args.output_dir)
    log = MetricsLog(args.output_dir, enabled=accelerator.is_main_process, accelerator=accelerator,
                     keep_until=int(resume_from.rsplit("-", 1)[1]) if resume_from else None)

    # ---- model, data, reward, optimizer, engine ----
    sources = (reward_sources(args.reward_fn, args.remote_rm_url, args.reward_pretrain, accelerator.device,
                              torch.bfloat16 if args.bf16 else None, place=lambda m: prepare_frozen(accelerator, m))
               if args.reward_fn or args.remote_rm_url or args.reward_pretrain else [("rule", first_word_reward)])
    score_all = weighted_rewards(sources, args.reward_weights, args.reward_fallback)  # (prompts, completions, labels)
    moments = RunningMoments() if args.normalize_reward else None

    model, tokenizer, processor = load_vl_model(args.pretrain, max_pixels=args.image_max_pixels)
    critic = VisionValueModel(model) if args.advantage_estimator == "gae" else None  # named model.* like the policy
    for name, p in [*model.named_parameters(), *(critic.named_parameters() if critic else [])] if args.freeze_prefix else []:
        p.requires_grad_(not name.startswith(args.freeze_prefix))
    if args.lora_rank:  # peft: only the adapters train; the frozen base serves the reference model too
        from peft import LoraConfig, get_peft_model
        targets = args.target_modules if args.target_modules == "all-linear" else args.target_modules.split(",")
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=targets))
    ref_model = None
    if (args.use_kl_loss or kl_in_reward) and not args.lora_rank:
        ref_model = prepare_frozen(accelerator, load_vl_model(args.pretrain, max_pixels=args.image_max_pixels)[0])
    for net in [m for m in (model, critic) if m is not None] if args.gradient_checkpointing else []:
        net.gradient_checkpointing_enable()
    ema = [p.detach().clone() for p in model.parameters()] if args.ema_beta is not None else None

    load_rows = lambda path, flag: load_image_rows(path, args.input_key, args.label_key, args.images_key, flag,  # noqa: E731
                                                   log=accelerator.print)
    train_rows, eval_rows = (shapes_task(seed=args.seed) if args.prompt_data == "shapes"
                             else (load_rows(args.prompt_data, "--prompt_data"), []))
    eval_rows = load_rows(args.eval_data, "--eval_data") if args.eval_data else eval_rows
    ptx_batches = text_batches(args.pretrain_data, args.pretrain_key, args.micro_train_batch_size,
                               accelerator.process_index, world) if args.pretrain_data else None
    encoded = {}  # split -> [(prompt ids, label, prompt, image inputs or None)]
    for split, rows in (("train", train_rows), ("eval", eval_rows)):
        usable = [r for r in rows if (r["images"] or args.mixed_mm_data) and len(r["images"]) <= args.limit_mm_image_per_prompt]
        encoded[split] = [(*encode_vl_prompt(tokenizer, processor, r["prompt"], r["images"], model.config.image_token_id, sample=i),
                           r["label"], r["prompt"]) for i, r in enumerate(usable)]
        encoded[split] = [(ids, label, prompt, mm) for ids, mm, label, prompt in encoded[split] if len(ids) <= args.prompt_max_len]
        if len(encoded[split]) < len(rows):
            accelerator.print(f"[data] skipped {len(rows) - len(encoded[split])} {split} prompts: no image (see --mixed_mm_data), "
                              f"more than --limit_mm_image_per_prompt images, or longer than --prompt_max_len tokens")
    check(len(encoded["train"]) >= args.rollout_batch_size, f"{len(encoded['train'])} usable training prompts, fewer than --rollout_batch_size")
    num_steps = min(args.max_steps, args.num_episodes * (len(encoded["train"]) // args.rollout_batch_size))
    num_updates = num_steps * args.max_epochs * (samples_per_step // args.train_batch_size)

    def optimizer_and_scheduler(net, lr):
        optimizer = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        return optimizer, get_scheduler("constant_with_warmup", optimizer,
                                        num_warmup_steps=math.ceil(args.lr_warmup_ratio * num_updates))

    model, optimizer, scheduler = accelerator.prepare(model, *optimizer_and_scheduler(model, args.actor_learning_rate))
    trained = [(model, optimizer, scheduler, "grad_norm")]  # what each update steps: (model, optimizer, scheduler, log key)
    if critic is not None:
        trained.append((*accelerator.prepare(critic, *optimizer_and_scheduler(critic, args.critic_learning_rate)), "critic_grad_norm"))
        critic = trained[-1][0]
    kl_coef = args.init_kl_coef
    engine = create_engine(args.engine_type, accelerator.unwrap_model(model), tokenizer, args, processor)
    rank, device = accelerator.process_index, accelerator.device

    def run_eval(step):
        metrics = evaluate(engine, tokenizer, encoded["eval"], score_all, accelerator, args.generate_max_len,
                           args.eval_n_samples, args.temperature)
        log.write(step, metrics)
        n = args.eval_n_samples
        accelerator.print(f"[eval] step {step} | greedy accuracy {metrics['eval/accuracy']:.3f} on "
                          f"{metrics['eval/num_problems']} held-out problems" +
                          (f" | pass@1 {metrics['eval/pass@1']:.3f} | pass@{n} {metrics[f'eval/pass@{n}']:.3f}" if n > 1 else ""))
        return metrics

    def export(path):
        state_dict = accelerator.get_state_dict(model)  # collective: gathers sharded weights
        if accelerator.is_main_process:
            export_hf(accelerator.unwrap_model(model), tokenizer, path, state_dict)
            processor.save_pretrained(path)

    # ---- resume ----
    data, drawn, start, first_eval = batches(encoded["train"], args.rollout_batch_size, args.seed), 0, 0, None
    if resume_from:
        state, tensors = load_checkpoint(accelerator, resume_from)  # models, optimizers, schedulers, RNG
        start, drawn, kl_coef, first_eval = state["step"], state["batches_drawn"], state["kl_coef"], state["first_eval"]
        for _ in range(drawn):  # the data stream where it stopped
            next(data)
        if moments is not None:
            moments.load_state_dict(state["moments"])
        ema = tensors["ema"] if ema is not None else None
        engine.update_weights(accelerator.unwrap_model(model))
        accelerator.print(f"[resume] from {resume_from}: step {start}")
    accelerator.print(f"[setup] {num_steps} steps x {samples_per_step} samples | {world} processes | "
                      f"grad_accum {grad_accum} | engine {type(engine).__name__} | bf16 {args.bf16}")
    if encoded["eval"] and not resume_from:
        first_eval = run_eval(0)

    k, n = args.rollout_batch_size // world, args.n_samples_per_prompt
    reduce_sum = lambda t: accelerator.reduce(t, "sum")  # noqa: E731
    train_bytes = None  # extra GPU memory one update takes, measured each step
    for step in tqdm(range(start + 1, num_steps + 1), desc="steps", initial=start, total=num_steps,
                     disable=not accelerator.is_main_process):
        t0 = time.time()
        phase_peak_gb()
        # ---- rollout ----
        _, t_wake = timed(engine.wake_up)  # the KV cache, if the engine slept
        kept, dropped, reward_errors = [], [], 0
        for gen_round in range(1, args.max_num_gen_batches + 1):
            batch, drawn = next(data)[rank * k:(rank + 1) * k], drawn + 1  # this rank's prompts: whole groups stay together
            ids, labels, prompts, mms = ([row[j] for row in batch for _ in range(n)] for j in range(4))
            generations = engine.generate(ids, args.generate_max_len, args.temperature, args.top_p, mm=mms)
            completions = tokenizer.batch_decode([g.token_ids for g in generations], skip_special_tokens=True)
            rewards, components, errors = score_all(prompts, completions, labels, args.strict_rewards)
            if args.overlong_buffer_len:  # DAPO's soft overlong punishment
                components["overlong"] = overlong_penalty([len(g.token_ids) for g in generations], args.generate_max_len,
                                                          args.overlong_buffer_len, args.overlong_penalty_factor)
                rewards = [r + p for r, p in zip(rewards, components["overlong"])]
            reward_errors += errors
            comps = [dict(zip(components, values)) for values in zip(*components.values())] or [{}] * len(rewards)
            samples = list(zip(ids, labels, prompts, generations, completions, rewards, comps, mms))
            for i in range(0, len(samples), n):  # DAPO dynamic sampling keeps the groups whose rewards differ
                informative = not args.dynamic_sampling or len({x[5] for x in samples[i:i + n]}) > 1
                (kept if informative else dropped).append(samples[i:i + n])
            if not args.dynamic_sampling or not reduce_sum(torch.tensor(float(len(kept) < k), device=device)):
                break  # every rank has its k groups
        num_filled = max(0, k - len(kept))  # generation rounds ran out: zero-variance groups fill the batch
        samples = [x for group in kept[:k] + dropped[:num_filled] for x in group]
        prompt_ids, labels, prompts, generations, completions, rewards, comps, mms = map(list, zip(*samples))
        components, t_gen = {name: [c.get(name, math.nan) for c in comps] for name in comps[0]}, time.time() - t0 - t_wake
        mem = {"perf/mem_generate_gb": phase_peak_gb()}
        slept, t_sleep = timed(engine.sleep, needed_bytes=train_bytes)  # auto mode: only if training needs the memory

        # ---- rewards ----
        exp = build_experience(prompt_ids, generations, tokenizer.pad_token_id, device, mm=mms)
        exp.rewards = torch.tensor(rewards, device=device, dtype=torch.float32)  # (B,)
        if moments is not None:  # running normalisation over every rank's rewards
            moments.update(accelerator.gather(exp.rewards).tolist())
            exp.rewards = (exp.rewards - moments.mean) / (moments.std + 1e-8)
        if args.reward_clip is not None:
            exp.rewards = exp.rewards.clamp(-args.reward_clip, args.reward_clip)
        scores = compute_advantages(exp.rewards, n, args.advantage_estimator)  # (B,) per sequence

        # ---- logprobs (old, reference), values, advantages ----
        t1 = time.time()
        with accelerator.autocast():
            if not reuse_old_logprobs:
                exp.old_logprobs = batched_logprobs(model, exp, args.micro_rollout_batch_size, args.temperature)
            if args.use_kl_loss or kl_in_reward:  # with LoRA the reference is the base: the adapters switched off
                with accelerator.unwrap_model(model).disable_adapter() if args.lora_rank else contextlib.nullcontext():
                    exp.ref_logprobs = batched_logprobs(ref_model or model, exp, args.micro_rollout_batch_size, args.temperature)
            if critic is not None:
                exp.values = batched_values(critic, exp, args.micro_rollout_batch_size)  # (B, R), the images seen
        t_lp = time.time() - t1
        mem["perf/mem_logprob_gb"] = phase_peak_gb()
        reward_kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, "k1") if kl_in_reward else None  # (B, R)
        exp.advantages = scores  # (B,), or per token (B, R): score on the last token, KL penalty on all, returns or GAE
        if token_level:
            exp.advantages, exp.returns = token_level_advantages(scores, exp.action_mask, reward_kl, kl_coef, exp.values,
                                                                 args.gamma, args.lambd, reduce_sum)

        # ---- update ----
        t2 = time.time()
        model.train()
        mem_before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0  # the peak was just reset
        ratio = args.high_entropy_token_ratio
        frozen = step <= args.freezing_actor_steps  # PPO warm-up: only the critic learns
        sums, count, grad_norms = {}, 0, {"grad_norm": [], "critic_grad_norm": []}
        for epoch in range(args.max_epochs):
            order = torch.randperm(len(exp), generator=torch.Generator().manual_seed(args.seed * 100003 + step * 101 + epoch))
            for start in range(0, len(exp), rows_per_update):
                chunk = exp.select(order[start:start + rows_per_update])  # one optimizer step's rows
                micro_batches = chunk.split(args.micro_train_batch_size)
                num_tokens = reduce_sum(chunk.action_mask.sum().float())  # the whole step's tokens
                pg_tokens = num_tokens if not ratio else reduce_sum(torch.tensor(  # the tokens high_entropy_mask keeps
                    float(sum(max(1, round(ratio * int(mb.action_mask.sum()))) for mb in micro_batches)), device=device))
                for mb in micro_batches:
                    with accelerator.accumulate(*[m for m in (model, critic) if m is not None]), accelerator.autocast():
                        with torch.set_grad_enabled(not frozen):
                            logprobs, entropy = response_logprobs(model, mb.input_ids, mb.attention_mask, mb.action_mask.shape[1],
                                                                  args.temperature, with_entropy="grad" if args.entropy_coef else True,
                                                                  mm_inputs=mb.mm_inputs())
                        old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()  # (B, T)
                        agg = dict(num_tokens=num_tokens, num_seqs=args.train_batch_size, max_len=args.generate_max_len)
                        # TIS: correct for the engine sampling from other numerics
                        is_weights = (old - mb.rollout_logprobs).exp().clamp(max=args.tis_cap) if args.tis_cap else None
                        pg_mask = high_entropy_mask(entropy, mb.action_mask, ratio) if ratio else mb.action_mask  # (B, T)
                        pg_loss, m = policy_loss(logprobs, old, mb.advantages, pg_mask, eps_low, args.loss_agg_mode,
                                                 **{**agg, "num_tokens": pg_tokens}, eps_clip_high=eps_high,
                                                 dual_clip=args.dual_clip, use_gspo=args.use_gspo, is_weights=is_weights,
                                                 use_cpg_loss=use_cpg_loss)
                        loss = pg_loss
                        if args.entropy_coef:
                            loss = loss - args.entropy_coef * aggregate_loss(entropy, mb.action_mask, args.loss_agg_mode, **agg)
                        if drift_coef:  # CPGD policy drift: KL(pi_old || pi) = E_old[r - 1 - log r], r = pi / pi_old
                            drift = kl_estimate(old, logprobs, "k3")  # (B, T)
                            loss = loss + drift_coef * aggregate_loss(drift, mb.action_mask, args.loss_agg_mode, **agg)
                        if args.use_kl_loss:
                            kl = kl_estimate(logprobs, mb.ref_logprobs, args.kl_estimator)  # (B, T)
                            loss = loss + kl_coef * aggregate_loss(kl, mb.action_mask, args.loss_agg_mode, **agg)
                            m["kl"] = masked_mean(kl, mb.action_mask).detach()
                        if ptx_batches is not None and not frozen:  # a mean per micro-batch: average it over them
                            enc = tokenizer(next(ptx_batches), return_tensors="pt", padding=True, truncation=True,
                                            max_length=args.prompt_max_len).to(device)
                            ptx_loss = lm_loss(model, enc["input_ids"], enc["attention_mask"])
                            loss = loss + args.ptx_coef * ptx_loss / (grad_accum * world)
                            m["ptx_loss"] = ptx_loss.detach()
                        if critic is not None:
                            values = response_values(critic, mb.input_ids, mb.attention_mask, mb.action_mask.shape[1],
                                                     mm_inputs=mb.mm_inputs())
                            v_loss = value_loss(values, mb.values, mb.returns, mb.action_mask, args.value_clip,
                                                args.loss_agg_mode, **agg)
                            m["value_loss"], m["values"] = v_loss.detach() * grad_accum, masked_mean(values.detach(), mb.action_mask)
                            loss = v_loss if frozen else loss + v_loss  # separate parameters: one backward serves both
                        # Losses are normalised by the whole step's totals, so undo the mean that
                        # gradient accumulation and DDP each apply.
                        accelerator.backward(loss * grad_accum * world)
                        for net, opt, sched, key in trained[frozen:]:  # the actor unless frozen, the critic
                            if accelerator.sync_gradients:
                                grad_norms[key].append(grad_norm_value(accelerator.clip_grad_norm_(net.parameters(), args.max_norm)))
                                if not math.isfinite(grad_norms[key][-1]):  # checked here, the one host sync per step
                                    raise FloatingPointError(f"non-finite loss or gradients ({key}) at step {step}: lower "
                                                             "--actor_learning_rate or use --bf16 false")
                            opt.step()
                            sched.step()
                            opt.zero_grad()
                        if ema is not None and accelerator.sync_gradients and not frozen:
                            torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 1.0 - args.ema_beta)
                    # metrics stay on the device until the update ends: an .item() here would stall the GPU
                    m["policy_loss"] = pg_loss.detach() * grad_accum  # mean over micro-batches -> step loss
                    m["entropy"] = masked_mean(entropy.detach(), mb.action_mask)
                    if epoch == 0:
                        diff = (mb.rollout_logprobs - old).abs() * mb.action_mask  # (B, T)
                        m["logprob_diff_mean"] = diff.sum() / mb.action_mask.sum()
                        m["logprob_diff_max"] = diff.max()
                    for key, v in m.items():
                        sums[key] = sums.get(key, 0.0) + v
                    count += 1
        t_upd = time.time() - t2
        if torch.cuda.is_available():
            train_bytes = torch.cuda.max_memory_allocated() - mem_before  # what the next update will need
            mem["perf/mem_update_gb"] = phase_peak_gb()

        # ---- weight sync ----
        _, t_sync = timed(engine.update_weights, accelerator.unwrap_model(model))

        # ---- log ----
        r = torch.tensor(rewards)  # as scored, before normalisation and clipping
        local = {"rollout/reward_mean": r.mean().item(), "rollout/reward_std": r.std().item() if len(r) > 1 else 0.0,
                 "rollout/reward_errors": reward_errors, "rollout/filled_groups": num_filled,
                 "rollout/response_length": exp.action_mask.sum(-1).float().mean().item(),
                 "rollout/truncated": sum(len(g.token_ids) >= args.generate_max_len for g in generations) / len(r)}
        local.update({f"rollout/reward/{k_}": float(np.nanmean(v)) for k_, v in components.items()})
        local.update({("rollout/" if k_.startswith("logprob") else "train/") + k_: float(v / count) for k_, v in sums.items()})
        local.update({f"train/{k_}": sum(v) / len(v) for k_, v in grad_norms.items() if v})  # per optimizer step
        if reward_kl is not None:
            local["rollout/kl"] = masked_mean(reward_kl, exp.action_mask).item()
        metrics = gather_metrics(local, sum_keys=("rollout/reward_errors", "rollout/filled_groups"))
        metrics.update({"rollout/generation_rounds": gen_round, "train/kl_coef": kl_coef})
        if args.kl_target is not None:  # adaptive KL controller, on the measured per-token KL
            kl_coef = adaptive_kl_coef(kl_coef, metrics["rollout/kl"], args.kl_target, args.kl_horizon, samples_per_step)
        metrics.update({"train/lr": scheduler.get_last_lr()[0], "perf/generate_s": t_gen, "perf/logprob_s": t_lp,
                        "perf/update_s": t_upd, "perf/weight_sync_s": t_sync, "perf/sleep_s": t_sleep,
                        "perf/wake_s": t_wake, "perf/engine_slept": float(slept), "perf/step_time_s": time.time() - t0})
        if torch.cuda.is_available():
            metrics.update({**mem, "perf/mem_update_extra_gb": train_bytes / 2**30})
        log.write(step, metrics)
        if step % args.logging_steps == 0:
            tqdm.write(MetricsLog.line(step, metrics)) if accelerator.is_main_process else None

        if args.log_samples_steps and step % args.log_samples_steps == 0:
            log.samples(step, [{"prompt": tokenizer.decode(p), "completion": c, "label": lab, "reward": rw}
                               for p, c, lab, rw in list(zip(prompt_ids, completions, labels, rewards))[:4]])
        if args.plot_every and (step % args.plot_every == 0 or step == num_steps) and accelerator.is_main_process:
            write_plots(args.output_dir, exp.action_mask.sum(-1).tolist(), args.generate_max_len)

        # ---- eval and checkpoint ----
        if args.eval_steps and step % args.eval_steps == 0 and step != num_steps and encoded["eval"]:
            run_eval(step)
        if args.save_steps and step % args.save_steps == 0:  # atomic: `latest` names only complete checkpoints
            state = {"batches_drawn": drawn, "kl_coef": kl_coef, "first_eval": first_eval,
                     "moments": moments.state_dict() if moments is not None else None}
            save_checkpoint(accelerator, args.output_dir, step, state, {"ema": ema} if ema is not None else None,
                            args.max_ckpt_num)
        if args.save_hf_steps and step % args.save_hf_steps == 0:
            export(os.path.join(args.output_dir, f"hf-step-{step}"))

    last_eval = run_eval(num_steps) if encoded["eval"] else None
    if args.plot_every and accelerator.is_main_process:  # the curves again, with the final eval point
        write_plots(args.output_dir, exp.action_mask.sum(-1).tolist(), args.generate_max_len)
    accelerator.wait_for_everyone()
    export(os.path.join(args.output_dir, "model"))
    if accelerator.is_main_process:
        if ema is not None:  # the same architecture with the averaged weights
            ema_state = {name: e.cpu() for (name, _), e in zip(accelerator.unwrap_model(model).named_parameters(), ema)}
            export_hf(accelerator.unwrap_model(model), tokenizer, os.path.join(args.output_dir, "ema_model"), ema_state)
        if first_eval:
            print(f"[done] greedy accuracy {first_eval['eval/accuracy']:.3f} -> {last_eval['eval/accuracy']:.3f} "
                  f"on {last_eval['eval/num_problems']} held-out problems; model in {args.output_dir}/model")
    accelerator.end_training()  # last: it also tears down the process group


if __name__ == "__main__":
    main()
