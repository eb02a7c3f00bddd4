"""The run's plan: what a script derives from its flags and every automatic choice, in one frozen record the
loop reads (`args` is never written after local_models); config.json keeps both, and the start-up prints why.

    args = local_models(args)                  # first: hub ids (org/name) -> their snapshots in the HF cache
    plan = resolve(args, accelerator)          # right after the Accelerator exists; runs the flag checks
    plan = with_stops(plan, stops, tokenizer)  # once the tokenizer loads: --stop and the environment's
    plan = with_memory_plan(plan, args, ...)   # once the trained nets are prepared: the update's memory

Auto --optimizer_offload is decided after the first update, in the loop's `offload` (optim.py's
offload_after_update)."""

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from rft_core.advantages import TOKEN_LEVEL
from rft_core.engines import resolve_engine_type
from rft_core.engines.base import EngineSettings
from rft_core.episodes import EpisodeSettings
from rft_core.errors import ConfigError
from rft_core.losses import LossSettings
from rft_core.memory import plan_update_memory
from rft_core.model_training import checkpointing_on
from rft_core.models import hub_snapshot
from rft_core.rollout import RolloutSettings
from rft_core.runs.checks import check_args, kl_in_reward
from rft_core.sequence_parallel import group_size

TOKENS_PER_MICRO_BATCH = 16384  # the update's default budget where the memory is not measured (CPU)


@dataclass(frozen=True)
class Plan:
    world: int  # processes
    sp_size: int  # ranks sharing each sample, a slice of it each (sequence / context parallelism), else 1
    sharded: bool  # ZeRO-3 or FSDP2: parameters sharded, every forward a collective
    samples_per_step: int  # rollout_batch_size * n_samples_per_prompt, all ranks
    train_batch_size: int  # samples per optimizer step, all ranks
    rows_per_update: int  # a rank's samples per optimizer step (SP / CP: its group's)
    bf16: bool
    torch_compile: bool  # each decoder layer of what trains
    chunk_size: Optional[int]  # tokens per chunk of the fused LM head (None: the model's own logits)
    actor_learning_rate: float
    token_level: bool  # gae, reinforce, reinforce_baseline: per-token advantages
    kl_in_reward: bool  # a k1 penalty in the per-token reward (token-level estimators, no --use_kl_loss)
    reuse_old_logprobs: bool  # one optimizer step per rollout: the update's own logprobs are the old ones
    loss: LossSettings
    rollout: RolloutSettings
    engine: EngineSettings  # how the rollout engine is built (its type: hf, vllm or sglang)
    optimizer_offload: Optional[bool]  # None: decided after the first update
    max_tokens_per_micro_batch: Optional[int]  # the update's budget; None: micro-batches by rows
    gradient_checkpointing: Optional[bool]  # None until with_memory_plan
    episodes: Optional[EpisodeSettings] = None  # multi-turn (--env): the episodes' limits; None: one response
    why: tuple = ()  # what auto chose and why, a line each

    def record(self):
        out = asdict(self)
        out["loss"] = {k: v for k, v in out["loss"].items() if k != "sample_sum"}
        out["why"] = list(self.why)
        return out

    def describe(self):
        budget = self.max_tokens_per_micro_batch
        lines = [f"{self.samples_per_step} samples a step, {self.train_batch_size} an optimizer step, over "
                 f"{self.world} process(es); engine {self.engine.type}, bf16 {self.bf16}, compile "
                 f"{self.torch_compile}",
                 f"update micro-batches {f'of {budget} tokens' if budget else 'by rows'}, gradient "
                 f"checkpointing {self.gradient_checkpointing}", *self.why]
        return "\n".join(f"[plan] {line}" for line in lines)


def local_models(args):
    """args with the model flags' hub ids (org/name, not local paths) made their snapshot directories in the
    HF cache (models.hub_snapshot), downloaded where missing: every reader after sees a local directory."""
    def local(name):
        paths = getattr(args, name).split(",") if name == "reward_pretrain" else [getattr(args, name)]
        return ",".join(hub_snapshot(path, f"--{name}") for path in paths)
    names = ("pretrain", "critic_pretrain", "teacher_pretrain", "reward_pretrain")
    return replace(args, **{name: local(name) for name in names if getattr(args, name, None)})


def default_bf16(args):
    """--bf16, or on where a GPU is (needed before the Accelerator exists: its mixed precision)."""
    return torch.cuda.is_available() if args.bf16 is None else args.bf16


def resolve(args, accelerator, default_lr=None):
    """The plan from the flags (checked first: rft_core/runs/checks.py), the Accelerator and the machine.
    default_lr: the actor's where the flag is unset (the VL script's depends on the model)."""
    world, parallelism = accelerator.num_processes, accelerator.parallelism_config
    deepspeed = accelerator.state.deepspeed_plugin
    sharded = accelerator.distributed_type.name == "FSDP" or bool(deepspeed and deepspeed.zero_stage == 3)
    samples_per_step = args.rollout_batch_size * args.n_samples_per_prompt
    train_batch_size = args.train_batch_size or samples_per_step
    bf16 = default_bf16(args)
    engine_type = resolve_engine_type(args.engine_type)  # auto: with a GPU vllm, else sglang, where installed
    check_args(args, world, deepspeed, sharded, engine_type, parallelism, train_batch_size, bf16)
    why = [f"engine {engine_type}: auto, with a GPU vllm, else sglang, where installed; else hf"
           if args.engine_type == "auto" else None]
    torch_compile = args.torch_compile
    if torch_compile is None:  # auto: on where measured (SP and CP come with DeepSpeed or FSDP2)
        gpu = accelerator.device.type == "cuda"
        torch_compile = gpu and not (deepspeed or sharded) and engine_type != "hf"
        why.append(f"torch_compile {torch_compile}: auto, on with a GPU, vLLM or SGLang, and neither "
                   "DeepSpeed nor FSDP2")
    sp_size = group_size(parallelism)
    token_level, kl_penalty = args.advantage_estimator in TOKEN_LEVEL, kl_in_reward(args)
    # with the KL in the reward or a teacher, old logprobs are needed before the update: their own pass
    one_update = args.max_epochs == 1 and train_batch_size == samples_per_step and not args.teacher_pretrain
    tis_cap, tis_level = importance_weights(args)
    if args.partial_rollout and (args.tis_cap is None or args.tis_level is None):
        why.append(f"importance weights per {tis_level}, capped at {tis_cap}: partial rollout's default")
    if engine_type != "hf" and args.engine_sleep == "auto":
        why.append("engine sleep auto: the engine sleeps only when an update needs its memory")
    if args.optimizer_offload is None and engine_type != "hf":
        why.append("optimizer offload auto: decided after the first update (on if the engine cannot wake "
                   "beside the AdamW state)")
    by_rows = args.micro_train_batch_size is not None
    episodes = None if args.env is None else EpisodeSettings(
        args.max_turns, args.max_episode_tokens, args.generate_max_len, args.call_timeout,
        args.prompt_max_len, args.apply_chat_template, args.system_prompt, args.max_env_tokens)
    return Plan(
        world, sp_size, sharded, samples_per_step, train_batch_size, train_batch_size * sp_size // world,
        bf16, torch_compile, args.chunk_size or None,
        args.actor_learning_rate or default_lr, token_level, kl_penalty, one_update and not kl_penalty,
        loss_settings(args, train_batch_size, tis_cap, tis_level), rollout_settings(args, tis_cap),
        engine_settings(args, engine_type, bf16, samples_per_step // world, sp_size), args.optimizer_offload,
        None if by_rows else args.max_tokens_per_micro_batch or TOKENS_PER_MICRO_BATCH,
        args.gradient_checkpointing, episodes, tuple(line for line in why if line))


def importance_weights(args):
    """(cap, level) of the TIS weights pi_old / pi_engine. Partial rollout's defaults, 2 per "sequence": no
    late lag in six GPU seed pairs, where per-token weights left one (docs/partial_rollout.md)."""
    cap = 2.0 if args.tis_cap is None and args.partial_rollout else args.tis_cap
    return cap, args.tis_level or ("sequence" if args.partial_rollout else "token")


def loss_settings(args, train_batch_size, tis_cap, tis_level):
    cpgd = args.advantage_estimator == "cpgd"
    drift = args.policy_drift_coef if args.policy_drift_coef is not None else 0.01 if cpgd else 0.0
    eps_low, eps_high = args.eps_clip[0], args.eps_clip[-1]  # (one value: both)
    kind = args.policy_loss_type or ("cpg" if cpgd else "ppo")
    return LossSettings(args.loss_agg_mode, eps_low, eps_high, args.dual_clip, kind == "gspo",
                        kind == "cpg", tis_cap, args.tis_mode, tis_level,
                        args.high_entropy_token_ratio, args.entropy_coef, drift, args.use_kl_loss,
                        kl_estimator=args.kl_estimator, max_len=response_limit(args),
                        num_seqs=train_batch_size)


def response_limit(args):
    """Response tokens per sample at most: --generate_max_len, or --max_episode_tokens with --env."""
    return args.generate_max_len if args.env is None else args.max_episode_tokens


def rollout_settings(args, tis_cap):
    """The rollout's settings (the EOS token is set once the tokenizer loads)."""
    default = max(1, args.generate_max_len // 4)  # the budget per round
    # TIS and partial rollout weight every token by its engine logprob; otherwise they feed only the
    # engine-vs-trainer metric, which one sample in 8 estimates for an eighth of their cost
    every = 1 if tis_cap else 8
    return RolloutSettings(args.n_samples_per_prompt, args.generate_max_len, args.temperature, args.top_p,
                           args.dynamic_sampling, args.max_num_gen_batches, args.overlong_buffer_len,
                           args.overlong_penalty_factor, args.reward_failure_limit == 0, args.partial_rollout,
                           args.max_token_budget or default, args.max_staleness, None, args.inflight_ratio,
                           every)


def engine_settings(args, engine_type, bf16, requests, sp_size=1):
    """requests: one generate call's, per rank. sp_size > 1 (Accelerate drops the prepared models'
    attention masks): the transformers engine generates one prompt at a time, unpadded."""
    micro_batch_size = 1 if sp_size > 1 else args.micro_rollout_batch_size
    if args.partial_rollout:  # a generation round holds --inflight_ratio steps' worth of groups
        requests = math.ceil(requests * args.inflight_ratio)
    # an episode's turns and a partial rollout's rounds send their context again: vLLM's prefix cache
    # finds it; a single-turn rollout's never repeats, and caching costs vLLM's scheduler at every token
    prefix_caching = args.env is not None or args.partial_rollout
    return EngineSettings(
        engine_type, micro_batch_size, bf16, args.engine_tp_size, args.engine_mem_util, args.engine_sleep,
        args.engine_sleep_level, args.engine_enforce_eager, args.prompt_max_len + response_limit(args),
        requests, args.seed, prefix_caching, getattr(args, "limit_mm_image_per_prompt", None),
        getattr(args, "freeze_prefix", None))


def with_stops(plan, stops, tokenizer):
    """The plan with its stops (--stop, the environment's) in the engine's and rollout's settings: a special
    token's text (`<|im_end|>`) or `id:N` stops at that token id, any other at its text."""
    texts, ids, special, size = [], [], set(tokenizer.all_special_tokens), len(tokenizer)
    for item in stops:
        if not isinstance(item, str) or not item:
            raise ConfigError(f"stop {item!r}: a stop is a non-empty string (a text, a special token, id:N)")
        if item.startswith("id:"):
            if not (item[3:].isdigit() and int(item[3:]) < size):
                raise ConfigError(f"--stop {item}: not a token id of the tokenizer (id:0 to id:{size - 1})")
            ids.append(int(item[3:]))
        elif item in special:
            ids.append(tokenizer.convert_tokens_to_ids(item))
        else:
            texts.append(item)
    texts, ids = tuple(dict.fromkeys(texts)), tuple(dict.fromkeys(ids))
    engine = replace(plan.engine, stop=texts, stop_token_ids=ids)
    return replace(plan, engine=engine, rollout=replace(plan.rollout, stop=texts))


def with_memory_plan(plan, args, accelerator, model, nets):
    """The plan with the update's micro-batch budget and gradient checkpointing decided (the latter turned on
    in nets): flags given are kept, auto from activations measured (memory.plan_update_memory; collective)."""
    checkpointing, budget = plan.gradient_checkpointing, plan.max_tokens_per_micro_batch
    if budget and checkpointing is None:
        share = 0.0 if args.engine_sleep == "always" else args.engine_mem_util
        checkpointing, budget = plan_update_memory(
            model, budget, plan.chunk_size, accelerator.autocast, share, args.engine_sleep != "never",
            fixed_budget=args.max_tokens_per_micro_batch is not None, log=accelerator.print,
            sliced=plan.sp_size > 1)
    for net in nets if checkpointing else []:
        checkpointing_on(accelerator.unwrap_model(net))
    return replace(plan, gradient_checkpointing=bool(checkpointing), max_tokens_per_micro_batch=budget)
