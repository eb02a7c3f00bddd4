"""Reinforcement fine-tuning of a vision-language model (Qwen2-VL family), in one file.

train_ppo.py with images: the same loop, estimators and losses, and every flag of it (those that cannot
apply are refused with a message). Each prompt carries its images' pixels, the rollout engine and every
trainer forward see them, and a prompt whose image tokens do not match its images is an error naming the
sample. With no arguments: GRPO on a tiny random Qwen2-VL (word-level vocabulary, built from a config) over
a built-in, seeded task of drawn shapes ("what colour is the shape ?", "how many shapes are there ?"),
reward 1 for the right first word.

    python train_ppo_vl.py                     # CPU (transformers engine) or one GPU (vLLM if installed)
    accelerate launch train_ppo_vl.py --pretrain /models/Qwen2-VL-2B-Instruct --prompt_data data/vqa.jsonl \
        --images_key images --label_key answer --reward_fn math --freeze_prefix model.visual

Any config in accelerate_configs/ works as for train_ppo.py. vLLM gets one placeholder per image and the
images, and must expand them to the trainer's prompt token for token (rft_core/engines/vllm.py). gae's
critic is a copy of the policy's backbone, vision tower included. The lines marked `# VL` (and the
`# VL begin` ... `# VL end` blocks) are where this file differs from train_ppo.py, and
tests/test_scripts_in_step.py fails on any other difference. The loop per step and where it departs from
the papers (KL placement, reused old logprobs, temperature-only logprobs, per-micro-batch high-entropy
tokens) and partial rollout are as train_ppo.py's docstring says.
"""
import math
import os
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Literal, Optional, Tuple

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

from rft_core.advantages import (RunningMoments, adaptive_kl_coef, distill_advantages, outcome_scores,
                                 shape_rewards, token_level_advantages)
from rft_core.data import text_batches  # VL
from rft_core.distributed import (configure_deepspeed, cpu_ranks, end_run, prepare_frozen,
                                  process_group_kwargs)
from rft_core.engines import create_engine
from rft_core.episodes import EpisodeRunner
from rft_core.errors import DataError
from rft_core.evaluation import eval_line, eval_summary, evaluate
from rft_core.experience import (Forward, batched_logprobs, build_experience, logprob_passes,
                                 micro_batch_logprobs, micro_batch_values, optimizer_chunks)
from rft_core.losses import (actor_loss, kl_estimate, masked_mean, policy_token_counts, token_mean,
                             value_loss)
from rft_core.memory import micro_batch_splits
from rft_core.model_training import compile_blocks, text_lm_loss
from rft_core.models import check_teacher, export_hf, lora_model, named_like
from rft_core.vision import VisionValueModel, encode_vl_rows, freeze, load_image_rows, load_vl_model  # VL
from rft_core.optim import (accumulate_over, accumulation_divisor, adamw_with_warmup, move_optimizer_state,
                            offload_after_update, step_optimizers)
from rft_core.plan import default_bf16, local_models, resolve, with_memory_plan, with_stops
from rft_core.reward_sources import reward_sources, start_workers
from rft_core.rewards import RewardScorer
from rft_core.rollout import Rollouts
from rft_core.runs.checkpoint import (LoopState, checkpoint_step, finished_run, load_checkpoint,
                                      resume_point, save_checkpoint, schedule_length)
from rft_core.runs.checks import prompt_limit
from rft_core.runs.cli import parse_args
from rft_core.runs.health import HealthGuard, check_resumed_weights
from rft_core.runs.metrics import (Means, MetricsLog, StepTimer, gather_metrics, rollout_metrics,
                                   update_metrics)
from rft_core.runs.run import StopSignals, run_main, stop_error
from rft_core.sequence_parallel import SequenceParallel, sliced
from rft_core.tasks.shapes import shapes_task  # VL


@dataclass
class Args:
    # VL begin: the task (model, data, reward) and the defaults that suit it
    pretrain: Optional[str] = None
    """Qwen2-VL-family model directory or hub id (org/name, as in train_ppo.py; default: a tiny random
    Qwen2-VL built from a config)"""
    prompt_data: str = "shapes"
    """built-in task name (shapes) or a local JSONL / JSON / parquet file or directory"""
    images_key: str = "images"
    """column of each prompt's image paths, relative to the data file (a list of frame paths: a video)"""
    limit_mm_image_per_prompt: int = 4
    """prompts with more images are skipped and counted"""
    mixed_mm_data: bool = False
    """keep text-only prompts among image prompts (else they are skipped and counted)"""
    freeze_prefix: Optional[str] = None
    """freeze the parameters whose name starts with this (e.g. model.visual: the vision tower)"""
    image_max_pixels: int = 84 * 84
    """images are resized to at most this many pixels (Qwen2-VL: 28 x 28 pixels make one token)"""
    strict_data: bool = False
    """a row whose image is missing or unreadable stops the run (default: it is skipped and counted)"""
    reward_fn: Optional[str] = None
    """first_word (the response's first word is the label) | answer | math | file.py:function: as in
    train_ppo.py (default: first_word, unless --remote_rm_url or --reward_pretrain gives the reward)"""
    generate_max_len: int = 8
    """maximum new tokens per response (also Dr.GRPO's normalising constant)"""
    n_samples_per_prompt: int = 8
    """responses sampled per prompt (the group size)"""
    max_steps: int = 100
    """stop after this many rollout steps (or fewer, when the episodes run out)"""
    actor_learning_rate: Optional[float] = None
    """AdamW learning rate (default: 3e-3 for the built-in tiny random model, 1e-6 for a --pretrain model)"""
    # VL end
    # ---- model, data and reward ----
    input_key: str = "prompt"
    """column holding the prompt: a string or a list of chat messages"""
    label_key: str = "label"
    """column holding the reference answer"""
    apply_chat_template: bool = True
    """wrap string prompts in the tokenizer's chat template"""
    system_prompt: Optional[str] = None
    """system message prepended to every prompt that has none"""
    prompt_max_len: int = 1024
    """prompts longer than this (in tokens) are skipped and counted"""
    eval_data: Optional[str] = None
    """held-out prompts (given as --prompt_data is; default: the built-in task's eval split)"""
    eval_n_samples: int = 1
    """with N > 1, eval also samples N responses per problem at --temperature: pass@1 and pass@N"""
    eval_reward_threshold: Optional[float] = None
    """eval counts a response correct when its reward is at least this (default: by the reward's `correct`
    component; a reward without one reports eval/reward_mean and no accuracy)"""
    remote_rm_url: Optional[str] = None
    """HTTP endpoint of a reward model: POST {prompts, completions, labels} -> {"rewards": [...]}"""
    reward_pretrain: Optional[str] = None
    """reward model(s): comma-separated sequence-classification checkpoints scoring prompt + response (each
    logged as rollout/reward/rm<i>); with --reward_fn / --remote_rm_url as well, all are summed with
    --reward_weights"""
    reward_weights: Optional[Tuple[float, ...]] = None
    """one weight per reward source: --reward_fn or --remote_rm_url (if given), then each reward model
    (default: 1 each)"""
    reward_clip: Optional[float] = None
    """clip the (normalised) reward to [-C, C]"""
    normalize_reward: bool = False
    """divide rewards by the running std of all rewards seen, after subtracting the running mean"""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping: responses longer than generate_max_len - this get a linear penalty (0: off)"""
    overlong_penalty_factor: float = 1.0
    """the penalty at generate_max_len tokens"""
    reward_fallback: float = 0.0
    """reward of a sample whose reward raises, is not finite or is missing (rollout/reward_errors)"""
    call_timeout: float = 60.0
    """seconds one call into user code may take (a --reward_fn call, a --remote_rm_url request, an --env
    reset or step); then its samples or episode fail, and a worker's call is stopped (killed)"""
    workers: int = 4
    """worker processes per training process that run a --reward_fn file and the --env, a call at a time
    each (rft_core/workers.py)"""
    env_concurrency: int = 0
    """--env calls (reset, step) in flight at once at most (0: --workers): an async environment's (async def)
    run side by side, ceil(this / --workers) in each worker; a sync one's one a worker"""
    reward_failure_limit: float = 1.0
    """stop when this share of a step's samples failed their reward (0: at the first failure, showing the
    sample; 1: all of them; above 1: never)"""
    # ---- estimator and loss ----
    advantage_estimator: str = "group_norm"
    """group_norm (GRPO) | dr_grpo | rloo | cpgd | reinforce (REINFORCE++) | reinforce_baseline | gae (PPO) |
    distill (the --teacher_pretrain's logprobs alone, no reward)"""
    teacher_pretrain: Optional[str] = None
    """on-policy distillation: a teacher model (the policy's tokenizer) scores every sampled token; its
    logprob minus the policy's, times --distill_coef, joins each token's advantage (docs/algorithms.md)"""
    distill_coef: float = 1.0
    """weight of the teacher's per-token signal (reverse KL) in the advantages"""
    policy_loss_type: Optional[str] = None
    """ppo (the clipped ratio) | gspo (GSPO: the sequence-level ratio; pair with --loss_agg_mode
    seq-mean-token-mean, small clips) | cpg (CPGD's clipped policy gradient) (default: cpg with
    --advantage_estimator cpgd, else ppo)"""
    eps_clip: Tuple[float, ...] = (0.2,)
    """PPO ratio clip range (default 0.2), or two: LOW HIGH, DAPO's clip-higher (e.g. 0.2 0.28)"""
    dual_clip: Optional[float] = None
    """dual-clip constant c > 1: for negative advantages the loss is capped at -c A"""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm"""
    tis_cap: Optional[float] = None
    """truncated importance sampling (TIS): weight tokens by min(pi_old / pi_rollout_engine, cap) (default:
    off; with --partial_rollout 2, AReaL's decoupled objective against the policy that sampled each token)"""
    tis_mode: str = "truncate"
    """truncate (min(w, cap)) | mask (a token whose weight exceeds the cap gets none)"""
    tis_level: Optional[str] = None
    """token | sequence (each token gets its sample's product of ratios) | geometric (their geometric mean)
    (default: sequence with --partial_rollout, measured best there; else token)"""
    high_entropy_token_ratio: float = 0.0
    """train on only this fraction of response tokens, those of highest entropy (0: all; 0.2 in the paper)"""
    gamma: float = 1.0
    """discount of the token-level estimators (gae, reinforce, reinforce_baseline)"""
    lambd: float = 0.95
    """GAE lambda"""
    critic_pretrain: Optional[str] = None
    """gae: the critic, a sequence/token-classification checkpoint (default: the actor + a zero head)"""
    critic_learning_rate: float = 5e-5
    """gae: AdamW learning rate of the critic"""
    value_clip: Optional[float] = 0.2
    """clip the critic's new values to within this of the old ones in its loss (None: unclipped)"""
    freezing_actor_steps: int = 0
    """gae: train only the critic for this many first steps"""
    # ---- auxiliary losses ----
    entropy_coef: float = 0.0
    """entropy bonus: subtract entropy_coef * entropy (aggregated like the loss) from the loss"""
    use_kl_loss: bool = False
    """add init_kl_coef * KL(policy || reference) to the loss (GRPO); loads a frozen reference model"""
    init_kl_coef: float = 0.001
    """weight of the KL loss, or of the KL penalty in the token rewards (gae, reinforce*; 0: no reference)"""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 (Schulman's estimators) for the KL loss"""
    kl_target: Optional[float] = None
    """adaptive KL controller (Ziegler et al. 2019) for the reward penalty: the per-token KL to aim for
    (over a horizon of 10,000 samples: rft_core/advantages.py)"""
    policy_drift_coef: Optional[float] = None
    """CPGD's policy drift: weight of KL(pi_old || pi) in the loss (default: 0.01 with cpgd, else 0)"""
    pretrain_data: Optional[str] = None
    """text data (a file or directory) for a pretraining loss mixed into the update (ptx)"""
    pretrain_key: str = "text"
    """column of --pretrain_data holding the text"""
    ptx_coef: float = 0.05
    """weight of the pretraining loss"""
    ema_beta: Optional[float] = None
    """keep an exponential moving average of the actor (e.g. 0.99), exported to output_dir/ema_model"""
    # ---- rollout ----
    temperature: float = 1.0
    """sampling temperature of the rollouts"""
    top_p: float = 1.0
    """nucleus sampling of the rollouts"""
    stop: Tuple[str, ...] = ()
    """texts that end a response (kept in it), e.g. </lookup>; a special token's text (<|im_end|>) or id:N
    stops at that token id. Rollouts, evaluation and episodes alike; an --env's declared stops are added"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and refill from fresh prompts"""
    max_num_gen_batches: int = 3
    """generation rounds per step at most: with --dynamic_sampling (then dropped groups fill the batch) and
    --partial_rollout (the last round completes the groups still needed)"""
    partial_rollout: bool = False
    """partial rollout: unfinished samples wait in a buffer and continue in later steps (see above)"""
    max_token_budget: Optional[int] = None
    """with --partial_rollout: new tokens per unfinished sample per round (default: generate_max_len // 4)"""
    max_staleness: int = 2
    """with --partial_rollout: no trained token is older than this many policy versions (weight syncs)"""
    inflight_ratio: float = 1.0
    """with --partial_rollout: groups in hand per round (generating or ready), in steps' worth of groups;
    fresh prompts fill it, so every round generates a full batch (1: draw only the groups still needed)"""
    # ---- multi-turn ----
    env: Optional[str] = None
    """multi-turn episodes: an environment answers each assistant turn: calculator, calculator_react or tools
    (built-in, with --prompt_data multiply), tools:path/to/file.py (its functions as tools:
    rft_core/tasks/tools.py) or path/to/file.py:NAME, with step(state, text) and optionally reset(sample)
    (docs/multi_turn.md); the reward sources score an episode's last assistant turn"""
    max_turns: int = 4
    """with --env: assistant turns per episode at most (each of --generate_max_len tokens at most)"""
    max_episode_tokens: int = 1024
    """with --env: response tokens per episode at most, the policy's and the environment's"""
    max_env_tokens: int = 0
    """with --env: tokens of one environment answer at most, cut beyond (ending in " [...]", counted in
    rollout/env_truncated); 0: only the room left of --max_episode_tokens bounds it"""
    # ---- batches ----
    rollout_batch_size: int = 8
    """prompts per step, over all ranks"""
    micro_rollout_batch_size: int = 32
    """per-rank batch of the transformers engine's generate (and of the logprob passes with
    --micro_train_batch_size)"""
    train_batch_size: Optional[int] = None
    """samples per optimizer step, over all ranks (default: rollout_batch_size * n_samples_per_prompt)"""
    max_tokens_per_micro_batch: Optional[int] = None
    """per-rank micro-batches by tokens: samples of similar length, up to this many padded tokens per update
    forward/backward (twice as many per logprob pass); default on a GPU: the most that fit, up to 32768,
    beside the awake engine, else while it sleeps, else 16384 with gradient checkpointing; on a CPU: 1 GiB of
    activations or less, by the memory available)"""
    micro_train_batch_size: Optional[int] = None
    """per-rank samples per forward/backward instead (fixed-size micro-batches, in order; default: by
    tokens, --max_tokens_per_micro_batch)"""
    max_epochs: int = 1
    """passes of the optimizer over each rollout batch"""
    num_episodes: int = 1
    """passes over the prompt data"""
    lr_warmup_ratio: float = 0.0
    """fraction of optimizer steps spent warming the learning rate up linearly"""
    max_norm: float = 1.0
    """gradient clipping norm"""
    # ---- engine ----
    engine_type: str = "auto"
    """rollout engine: vllm | sglang | hf (transformers generate) | auto (with a GPU: vllm where installed,
    else sglang where installed; else hf)"""
    engine_tp_size: int = 1
    """the engine's (vLLM / SGLang) tensor-parallel size: groups of this many consecutive ranks share one"""
    engine_mem_util: float = 0.3
    """fraction of GPU memory the engine (vLLM / SGLang) takes for weights and KV cache"""
    engine_sleep: str = "auto"
    """when the engine (vLLM / SGLang) sleeps during updates: auto (only when an update needs its memory),
    always or never"""
    engine_sleep_level: int = 1
    """engine sleep level: 1 offloads weights to CPU, 2 discards them (the sync rewrites them anyway)"""
    engine_enforce_eager: bool = False
    """the engine (vLLM / SGLang) without CUDA graphs and compiling: fast start, slower decode"""
    # ---- precision and memory ----
    bf16: Optional[bool] = None
    """bf16 mixed precision (default: on with a GPU, off on CPU)"""
    packing_samples: bool = False
    """concatenate each micro-batch's samples into one row without padding, positions restarting per sample:
    transformers' packed-sequence attention (flash-attention varlen where the model uses it; with sdpa / eager
    a block-diagonal mask, exact but slower); text only"""
    chunk_size: int = 2048
    """the LM head runs with the log-softmax this many tokens at a time, forward and backward, so the (tokens
    x vocab) logits never exist whole (0: the model's own logits)"""
    gradient_checkpointing: Optional[bool] = None
    """recompute activations in backward to save memory (default: on when an update micro-batch of
    --max_tokens_per_micro_batch tokens would not fit beside the optimizer state, measured at start-up)"""
    torch_compile: Optional[bool] = None
    """torch.compile each decoder layer of the trained model, dynamic shapes (default: on with a GPU, alone or
    under DDP, with vLLM / SGLang generating)"""
    optimizer_offload: Optional[bool] = None
    """keep the optimizer state on the CPU outside the update, away from the rollout's KV cache (default: on
    only if the engine could not wake beside it after the first update)"""
    lora_rank: int = 0
    """train LoRA adapters of this rank (0: every weight); the engine gets the merged weights"""
    lora_alpha: int = 16
    """LoRA scaling numerator (the update is alpha / rank * B A)"""
    target_modules: str = "all-linear"
    """modules that get adapters: all-linear, or comma-separated names such as q_proj,v_proj"""
    # ---- outputs ----
    seed: int = 0
    """seed for data order, sampling and the built-in task"""
    output_dir: str = "outputs/run_vl"  # VL
    """where config.json, metrics.jsonl, checkpoints and the final model go"""
    eval_steps: int = 0
    """greedy held-out eval every this many steps (always at step 0 and at the end; 0: only those)"""
    save_steps: int = 0
    """checkpoint every this many steps (0: never): models, optimizers, schedulers, RNG, data position"""
    max_ckpt_num: int = 3
    """keep only the newest this many checkpoints"""
    no_resume: bool = False
    """start afresh even when output_dir holds a checkpoint (default: resume from the newest intact one)"""
    save_hf_steps: int = 0
    """also save_pretrained the model to output_dir/hf-step-N every this many steps (0: only at the end)"""
    report_to: Tuple[Literal["wandb", "tensorboard"], ...] = ()
    """trackers, through accelerate: wandb (WANDB_MODE=offline works without a network), tensorboard (its
    events in output_dir/tensorboard/)"""
    log_samples_steps: int = 0
    """every this many steps, print a few prompt / completion / reward rows, append them to samples.jsonl and
    draw curves.png and gen_len.png in output_dir (the plots also at the end; 0: none)"""

# VL begin: loading the model and the image prompts
def load_models(args, plan, accelerator):
    """(policy, tokenizer, image processor, frozen reference model or None, critic or None, frozen teacher or
    None)."""
    # with LoRA the base is frozen: kept in bf16, it needs no fp32 master copy (not when the critic copies it)
    bf16_base = args.lora_rank and plan.bf16 and args.advantage_estimator != "gae"
    model, tokenizer, processor = load_vl_model(args.pretrain, max_pixels=args.image_max_pixels,
                                                dtype=torch.bfloat16 if bf16_base else torch.float32)
    critic = VisionValueModel(model) if args.advantage_estimator == "gae" else None  # named model.* too
    freeze(args.freeze_prefix, model, critic)
    if args.lora_rank:  # peft: only the adapters train; the frozen base serves the reference model too
        model = lora_model(model, args.lora_rank, args.lora_alpha, args.target_modules)
    ref_model = None
    if (args.use_kl_loss or plan.kl_in_reward) and not args.lora_rank:  # sharded like the actor
        reference, _, _ = load_vl_model(args.pretrain, max_pixels=args.image_max_pixels)
        ref_model = prepare_frozen(accelerator, reference)
    teacher = None
    if args.teacher_pretrain:  # a VL model of the policy's family, held like the reference model
        teacher, teacher_tokenizer, _ = load_vl_model(args.teacher_pretrain, max_pixels=args.image_max_pixels)
        check_teacher(tokenizer, teacher_tokenizer, args.teacher_pretrain)
        teacher = prepare_frozen(accelerator, teacher)
    return model, tokenizer, processor, ref_model, critic, teacher


def load_rows(args, log):
    """{"train": rows, "eval": rows}: the built-in task's splits, or --prompt_data and --eval_data."""
    def load(path, flag):
        return load_image_rows(path, args.input_key, args.label_key, args.images_key, flag, log=log,
                               strict=args.strict_data)

    if args.prompt_data == "shapes":
        train_rows, eval_rows = shapes_task(seed=args.seed)
    else:
        train_rows, eval_rows = load(args.prompt_data, "--prompt_data"), []
    return {"train": train_rows, "eval": load(args.eval_data, "--eval_data") if args.eval_data else eval_rows}


def encode_prompts(args, rows, tokenizer, processor, model, log):
    """{"train": [Sample], "eval": [Sample]}: the rows' prompts encoded, each with its images (decoded when
    a step draws them, a step's worth kept decoded); those too long for the model's positions with a whole
    response (or for --prompt_max_len) skipped and counted."""
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    max_len, limit = prompt_limit(args, positions)
    prompts = {}
    for split, split_rows in rows.items():
        prompts[split], skipped = encode_vl_rows(
            tokenizer, processor, split_rows, model.config.image_token_id, max_len,
            args.limit_mm_image_per_prompt, args.mixed_mm_data, args.system_prompt, args.rollout_batch_size)
        if skipped:
            log(f"[data] skipped {skipped} {split} prompts: no image (see --mixed_mm_data), more than "
                f"--limit_mm_image_per_prompt images, or longer than {limit}")
    return prompts
# VL end


def micro_batch_loss(model, critic, mb, settings, frozen, args, fwd, ptx_batches, tokenizer):
    """One micro-batch's loss, normalised by the whole optimizer step's totals (settings), and its metrics:
    the policy loss (and KL, entropy, TIS: actor_loss), the ptx loss, the critic's value loss."""
    with torch.set_grad_enabled(not frozen):  # PPO's warm-up: only the critic learns
        entropy_grad = "grad" if args.entropy_coef else True  # the entropy, with a gradient if it is a loss
        logprobs, entropy = micro_batch_logprobs(model, mb, fwd, entropy_grad)  # (B, T) each
    loss, m = actor_loss(logprobs, entropy, mb, settings)  # (B, T) each -> scalar
    if ptx_batches is not None and not frozen:  # a mean per micro-batch: average it over them
        ptx_loss = text_lm_loss(model, tokenizer, next(ptx_batches), args.prompt_max_len)
        loss = loss + args.ptx_coef * ptx_loss / settings.micro_batches_per_step
        m["ptx_loss"] = ptx_loss.detach()
    if critic is not None:
        values = micro_batch_values(critic, mb, fwd)  # (B, T)
        v_loss = value_loss(values, mb.values, mb.returns, mb.action_mask, args.value_clip,
                            args.loss_agg_mode, settings.num_tokens, settings.num_seqs, settings.max_len)
        m["value_loss"] = v_loss.detach() * settings.micro_batches_per_step  # as policy_loss
        m["values"] = token_mean(values.detach(), mb.action_mask)
        loss = v_loss if frozen else loss + v_loss  # separate parameters: one backward
    return loss, m


def main():
    args = parse_args(Args)
    StopSignals(args, at_once=True)  # until the loop starts, SIGINT / SIGTERM stop the run at once, in a line
    args = local_models(args)  # hub ids (org/name) -> their snapshots in the HF cache, downloaded once
    precision = "bf16" if default_bf16(args) else "no"  # (the plan records it)
    accelerator = Accelerator(mixed_precision=precision, log_with=list(args.report_to) or None,
                              project_dir=os.path.join(args.output_dir, "tensorboard"),
                              cpu=cpu_ranks(), kwargs_handlers=process_group_kwargs())  # gloo without a GPU
    rank, device = accelerator.process_index, accelerator.device

    # ---- the plan: the flags checked, batch sizes, engine and other choices made (rft_core/plan.py) ----
    plan = resolve(args, accelerator, default_lr=1e-6 if args.pretrain else 3e-3)  # VL
    world, deepspeed = plan.world, accelerator.state.deepspeed_plugin
    configure_deepspeed(accelerator, plan.rows_per_update, args.micro_train_batch_size, args.max_norm)
    set_seed(args.seed, device_specific=True)
    # identity: what a resume must share, the model's and the data files' digests among it
    resume_from, identity = resume_point(args, accelerator, args.pretrain)  # VL

    # ---- model, data, reward, optimizer, engine ----
    rows = load_rows(args, accelerator.print)  # data errors come before the model loads
    ptx_batches = text_batches(args.pretrain_data, args.pretrain_key, args.micro_train_batch_size or 8, rank,
                               world) if args.pretrain_data else None  # for the ptx loss
    # user code (a --reward_fn file, --env) runs in worker processes: whatever it does stays there
    workers = start_workers(args.reward_fn, args.env, args.workers, args.call_timeout, args.seed, rank,
                            tqdm.write, args.env_concurrency)
    sources = reward_sources(args.reward_fn, args.remote_rm_url, args.reward_pretrain, device,
                             torch.bfloat16 if plan.bf16 else None, workers, args.call_timeout,
                             place=lambda m: prepare_frozen(accelerator, m),
                             default_rule="first_word")  # VL
    score_all = RewardScorer(sources, args.reward_weights, args.reward_fallback, args.reward_failure_limit,
                             log=tqdm.write)  # score_all(samples)
    model, tokenizer, processor, ref_model, critic, teacher = load_models(args, plan, accelerator)
    for net in [net for net in (model, critic) if net is not None and plan.torch_compile]:  # what trains
        compile_blocks(net)  # fuses the element-wise ops that dominate a small model's update
    ema = [p.detach().clone() for p in model.parameters()] if args.ema_beta is not None else None
    prompts = encode_prompts(args, rows, tokenizer, processor, model, accelerator.print)
    if len(prompts["train"]) < args.rollout_batch_size:
        raise DataError(f"{len(prompts['train'])} usable training prompts, fewer than --rollout_batch_size")
    num_steps = min(args.max_steps, args.num_episodes * (len(prompts["train"]) // args.rollout_batch_size))
    num_updates = num_steps * args.max_epochs * (plan.samples_per_step // plan.train_batch_size)
    # resumed: the schedule's length as the checkpoint has it (a higher --max_steps keeps the warm-up)
    num_updates = schedule_length(resume_from, num_steps, num_updates, args.lr_warmup_ratio,
                                  accelerator.print)
    warmup = math.ceil(args.lr_warmup_ratio * num_updates)  # optimizer steps of linear warm-up
    if finished_run(resume_from, num_steps, accelerator.print):  # a rerun of a finished run
        return end_run(accelerator)

    sp = SequenceParallel.from_accelerator(accelerator, model)  # None without SP or CP
    # what one optimizer step updates, by the name its gradient norm is logged under
    actor_optim = adamw_with_warmup(model, plan.actor_learning_rate, warmup)
    model, optimizer, scheduler = accelerator.prepare(model, *actor_optim)
    trained = {"grad_norm": (model, optimizer, scheduler)}
    if critic is not None:
        critic_optim = adamw_with_warmup(critic, args.critic_learning_rate, warmup)
        trained["critic_grad_norm"] = accelerator.prepare(critic, *critic_optim)
        critic = trained["critic_grad_norm"][0]
    trained_nets = [net for net, _, _ in trained.values()]  # as prepared (DDP- or DeepSpeed-wrapped)
    # micro-batches by rows or by tokens (planned from the measured activations on a GPU), checkpointing
    plan = with_memory_plan(plan, args, accelerator, model, trained_nets)
    split, logprob_split = micro_batch_splits(args, plan, accelerator, sp)  # the micro-batches' sizes
    fwd = Forward(args.temperature, plan.chunk_size, args.packing_samples, sp)  # how each forward runs
    optimizers = [opt for _, opt, _ in trained.values()]
    about = workers.call("env", "about", ()) if args.env else {"stop": []}  # what the --env declares
    plan = with_stops(plan, [*args.stop, *about["stop"]], tokenizer)  # every generate call stops at them
    engine = create_engine(plan.engine, accelerator.unwrap_model(model), tokenizer, processor)
    # multi-turn: episodes against the --env, in the workers (rft_core/episodes.py)
    episodes = EpisodeRunner(workers, tokenizer, plan.episodes, args.env, tqdm.write,
                             tools=about["tools"]) if args.env else None  # the tools' schemas, rendered

    def run_eval(step):
        metrics = evaluate(engine, tokenizer, prompts["eval"], score_all, accelerator, args.generate_max_len,
                           args.eval_n_samples, args.temperature, args.eval_reward_threshold, episodes)
        log.write(step, metrics)
        accelerator.print(eval_line(step, metrics, args.eval_n_samples))
        return metrics

    def export(path, state_dict=None):
        state_dict = state_dict or accelerator.get_state_dict(model)  # collective: gathers sharded weights
        if accelerator.is_main_process:
            export_hf(accelerator.unwrap_model(model), tokenizer, path, state_dict, processor)

    # the run's record starts here, once everything has loaded: a failed start leaves output_dir as it was
    config = {**asdict(args), "world_size": world, "plan": plan.record()}  # the flags as typed, the plan
    log = MetricsLog(args.output_dir, config, accelerator, bool(args.report_to),
                     keep_until=checkpoint_step(resume_from) if resume_from else None,
                     samples_every=args.log_samples_steps, max_len=args.generate_max_len)
    guard = HealthGuard(args.output_dir, accelerator.unwrap_model(model).config.get_text_config().vocab_size)

    # ---- resume ----
    settings = replace(plan.rollout, eos_token_id=tokenizer.eos_token_id)
    rollouts = Rollouts(prompts["train"], args.rollout_batch_size, args.seed, rank, world, settings, device,
                        episodes)
    # the rest of a checkpoint beside the models (rft_core/runs/checkpoint.py): a field declared there is
    # saved and resumed; the loop reads and writes loop.<field>
    loop = LoopState(rollouts, identity, args.init_kl_coef, ema=ema, schedule=num_updates,
                     moments=RunningMoments() if args.normalize_reward else None)
    start = 0  # the last step done
    if resume_from:
        state, tensors = load_checkpoint(accelerator, resume_from)  # models, optimizers, schedulers, RNG
        check_resumed_weights(trained_nets, resume_from, accelerator)  # finite, or one line naming it
        start = loop.load(state, tensors)  # the prompt stream, partial rollout's buffer, KL, moments, EMA
        engine.update_weights(accelerator.unwrap_model(model))
        accelerator.print(f"[resume] from {resume_from}: step {start}")
    accelerator.print(plan.describe())
    accelerator.print(f"[setup] {num_steps} steps x {plan.samples_per_step} samples | {world} processes | "
                      f"engine {type(engine).__name__} | bf16 {plan.bf16}")
    if prompts["eval"] and not resume_from:
        loop.first_eval = run_eval(0)

    reduce_sum = lambda t: accelerator.reduce(t, "sum")  # noqa: E731
    perf, stops = StepTimer(), StopSignals(args)  # from here, a signal stops the loop at a step's end
    loss_settings = replace(plan.loss, sample_sum=sp.sum if sp else None)  # SP / CP: a sample's slices summed
    offload = plan.optimizer_offload  # --optimizer_offload; auto (None): decided after the first update
    for step in tqdm(range(start + 1, num_steps + 1), desc="steps", initial=start, total=num_steps,
                     disable=not accelerator.is_main_process):
        # ---- rollout: generate and score (perf/score_s of it), keep whole groups ----
        perf.phase("wake")
        engine.wake_up()  # the KV cache, if the engine slept
        perf.phase("generate")
        samples, rollout_stats = rollouts.collect(engine, tokenizer, score_all, reduce_sum, step)
        samples = sp.gather_samples(samples, accelerator) if sp else samples  # the group's, on each rank
        perf.phase("sleep")
        slept = engine.sleep(needed_bytes=perf.extra.get("update"))  # auto: if training needs the memory

        # ---- experience: the padded batch, its rewards shaped ----
        perf.phase("experience")
        exp = build_experience([s.prompt_ids for s in samples], [s.generation for s in samples],
                               tokenizer.pad_token_id, device, mm=[s.mm for s in samples])
        rewards = torch.tensor([s.reward for s in samples], device=device, dtype=torch.float32)  # (B,)
        # both optional
        exp.rewards = shape_rewards(rewards, loop.moments, args.reward_clip, accelerator.gather)

        # ---- logprobs (old, reference, teacher) and values ----
        perf.phase("logprob")
        with accelerator.autocast():  # (B, T) each, or None where not needed
            exp.old_logprobs, exp.ref_logprobs, exp.values = logprob_passes(
                exp, model, ref_model, critic, fwd, logprob_split,
                old=not plan.reuse_old_logprobs, ref=args.use_kl_loss or plan.kl_in_reward,
                lora=bool(args.lora_rank))
            teacher_logprobs = batched_logprobs(teacher, exp, fwd, **logprob_split) if teacher else None

        # ---- advantages ----
        perf.phase("advantages")
        scores = outcome_scores(exp.rewards, args.n_samples_per_prompt, args.advantage_estimator)  # (B,)
        reward_kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, "k1") if plan.kl_in_reward else None
        exp.advantages = scores  # (B,)
        if plan.token_level:  # (B, T): the score on the last token, the KL penalty on all, then GAE / returns
            exp.advantages, exp.returns = token_level_advantages(
                scores, exp.action_mask, reward_kl, loop.kl_coef, exp.values, args.gamma, args.lambd,
                reduce_sum)
        if teacher is not None:  # on-policy distillation: + coef * (teacher - policy logprob) on each token
            exp.advantages = distill_advantages(exp.advantages, teacher_logprobs, exp.old_logprobs,
                                                exp.action_mask, args.distill_coef)  # (B, T)

        # ---- update ----
        perf.phase("update")
        if offload:
            move_optimizer_state(optimizers, device)  # the AdamW moments back on the GPU
        model.train()
        frozen = step <= args.freezing_actor_steps  # PPO warm-up: only the critic learns
        stepped = {key: parts for key, parts in trained.items() if not (frozen and parts[0] is model)}
        stats = Means()
        shuffle_seed = args.seed * 100003 + step * 101
        for chunk in optimizer_chunks(exp, plan.rows_per_update, args.max_epochs, shuffle_seed):
            micro_batches = chunk.split(**split, fwd=fwd)  # as many on every rank
            accumulate_over(accelerator, len(micro_batches))  # the last one syncs and steps
            scale = world * accumulation_divisor(accelerator)  # the mean gradient accumulation and DDP apply
            stats.add({"micro_batches": len(micro_batches)})
            # the losses are normalised by the whole optimizer step's totals, over every micro-batch and rank
            masks = [mb.action_mask for mb in micro_batches]
            totals = policy_token_counts(masks, args.high_entropy_token_ratio)
            totals = reduce_sum(torch.tensor(totals, device=device))  # (2,): tokens, policy-loss tokens
            settings = replace(loss_settings, kl_coef=loop.kl_coef, num_tokens=totals[0],
                               num_pg_tokens=totals[1], micro_batches_per_step=len(micro_batches) * world)
            for mb in micro_batches:
                with accelerator.accumulate(*trained_nets), accelerator.autocast(), sliced(sp, model, mb):
                    loss, m = micro_batch_loss(model, critic, mb, settings, frozen, args, fwd, ptx_batches,
                                               tokenizer)
                    accelerator.backward(loss * scale)  # the losses are already the step's
                    # clipped norms (finite, not exploding: checked) on the step's last micro-batch
                    step_optimizers(accelerator, stepped, args.max_norm, m,
                                    check=partial(guard.grad_norm, step=step, experience=exp))
                if loop.ema is not None and accelerator.sync_gradients and not frozen:
                    weights = [p.detach() for p in model.parameters()]
                    torch._foreach_lerp_(loop.ema, weights, 1.0 - args.ema_beta)
                stats.add(m)  # device tensors: read once, after the update
        # auto (None): decided once, now, by whether the engine can wake beside the optimizer state
        offload = offload_after_update(optimizers, offload, engine, deepspeed, accelerator.print)

        # ---- weight sync ----
        perf.phase("weight_sync")
        engine.update_weights(accelerator.unwrap_model(model))

        # ---- log ----
        perf.phase("log")
        shaped = exp.rewards if loop.moments is not None or args.reward_clip is not None else None  # (B,)
        local = {**rollout_metrics(samples, args.generate_max_len, shaped, args.reward_clip), **rollout_stats,
                 **update_metrics(stats), "perf/tokens": exp.attention_mask.sum().item() / plan.sp_size}
        if reward_kl is not None:
            local["rollout/kl"] = masked_mean(reward_kl, exp.action_mask).item()
        if teacher is not None:  # the reverse KL to the teacher per token (k1), and the teacher's logprob
            gap = exp.old_logprobs - teacher_logprobs  # (B, T)
            local["train/distill_kl"] = masked_mean(gap, exp.action_mask).item()
            local["train/teacher_logprob"] = masked_mean(teacher_logprobs, exp.action_mask).item()
        metrics = gather_metrics(local)  # over the ranks: means, and sums of counts
        metrics.update({"train/kl_coef": loop.kl_coef, "train/lr": scheduler.get_last_lr()[0],
                        "perf/engine_slept": float(slept), **perf.metrics()})
        if args.kl_target is not None:  # adaptive KL controller, on the measured per-token KL
            loop.kl_coef = adaptive_kl_coef(loop.kl_coef, metrics["rollout/kl"], args.kl_target,
                                            plan.samples_per_step)
        log.write(step, metrics, print_line=True)
        guard.entropy(metrics.get("train/entropy"), step)  # None: no policy token (every episode failed)
        log.samples_and_plots(step, samples, tokenizer, exp.action_mask.sum(-1).tolist(), step == num_steps)

        # ---- eval and checkpoint (and a stop asked for by SIGINT / SIGTERM) ----
        stop = stops.requested(reduce_sum, device)
        if args.eval_steps and step % args.eval_steps == 0 and step != num_steps and prompts["eval"]:
            run_eval(step)
        if args.save_steps and step % args.save_steps == 0 or stop == "SIGTERM":  # (pre-emption: saved)
            # atomic: `latest` names only whole checkpoints, and only healthy weights are saved
            guard.before_checkpoint(model, exp, logprob_split, fwd, accelerator, step)
            save_checkpoint(accelerator, args.output_dir, step, *loop.save(), args.max_ckpt_num)
        if args.save_hf_steps and step % args.save_hf_steps == 0:
            export(os.path.join(args.output_dir, f"hf-step-{step}"))
        if stop and step < num_steps:
            raise stop_error(stop, step, args)

    last_eval = None
    if start < num_steps:  # (else resumed from the last step's checkpoint: only its export is left to do)
        # the final weights pass the checks a checkpoint's do
        guard.before_checkpoint(model, exp, logprob_split, fwd, accelerator, step)
        last_eval = run_eval(num_steps) if prompts["eval"] else None
        log.plots(exp.action_mask.sum(-1).tolist())  # the curves again, with the final eval point
    accelerator.wait_for_everyone()
    export(os.path.join(args.output_dir, "model"))  # written aside, then renamed: whole or not at all
    if loop.ema is not None:  # the same architecture with the averaged weights
        export(os.path.join(args.output_dir, "ema_model"),
               named_like(accelerator.unwrap_model(model), loop.ema))
    log.finished(num_steps)  # after the exports: the same command again then has nothing to do
    if loop.first_eval and last_eval:
        accelerator.print(f"[done] {eval_summary(loop.first_eval, last_eval)}; "
                          f"model in {args.output_dir}/model")
    end_run(accelerator)  # last: every rank waits for the others, then the process groups are torn down


if __name__ == "__main__":
    run_main(main)
