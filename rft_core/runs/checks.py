"""The flags' checks: what cannot work is refused before anything loads, in one line naming the flag, value
and fix. `check_args` runs them in a fixed order (the same error every run); rft_core/plan.py calls it."""

import dataclasses
import json
import math
import os
import tempfile

from rft_core.advantages import ADVANTAGE_ESTIMATORS, TOKEN_LEVEL
from rft_core.distributed import zero_offloads_optimizer
from rft_core.errors import ConfigError
from rft_core.losses import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSS_TYPES, TIS_LEVELS

RANGES = {  # flag -> (is the value valid?, what it must be)
    "actor_learning_rate": (lambda v: v is None or 0 < v < 1, "in (0, 1); typical: 1e-6 to 1e-4"),
    "critic_learning_rate": (lambda v: 0 < v < 1, "in (0, 1)"),
    "temperature": (lambda v: v > 0, "> 0 (0 would sample greedily: a group's samples alike, no signal)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "distill_coef": (lambda v: v > 0, "> 0 (the teacher's signal would weigh nothing)"),
    "eps_clip": (lambda v: len(v) <= 2 and 0 < v[0] < 1 and v[-1] > 0,
                 "one value in (0, 1), or two: LOW in (0, 1), HIGH > 0"),
    "dual_clip": (lambda v: v is None or v > 1, "> 1"),
    "value_clip": (lambda v: v is None or v > 0, "> 0"),
    "tis_cap": (lambda v: v is None or v > 0, "> 0"),
    "reward_clip": (lambda v: v is None or v > 0, "> 0"),
    "ema_beta": (lambda v: v is None or 0 < v < 1, "in (0, 1)"),
    "kl_target": (lambda v: v is None or v > 0, "> 0"),
    "gamma": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "lambd": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "high_entropy_token_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "lr_warmup_ratio": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "max_norm": (lambda v: v > 0, "> 0"),
    "engine_mem_util": (lambda v: 0 < v < 1, "in (0, 1)"),
    "engine_sleep_level": (lambda v: v in (1, 2), "1 or 2"),
    "call_timeout": (lambda v: v > 0, "> 0 seconds"),
    "workers": (lambda v: v >= 1, ">= 1 (worker processes for a --reward_fn file and the --env)"),
    "reward_failure_limit": (lambda v: v >= 0, ">= 0 (0: stop at the first failure; above 1: never stop)"),
    "lora_alpha": (lambda v: v > 0, "> 0"),
    "image_max_pixels": (lambda v: v >= 28 * 28, ">= 784 (28 x 28 pixels: one token)"),
    "seed": (lambda v: 0 <= v < 2**32, "in [0, 2**32), numpy's seeds"),
}
# (checked in this order: train_batch_size last, as its default is derived from the two before it)
AT_LEAST_ONE = ("generate_max_len", "prompt_max_len", "max_steps", "rollout_batch_size", "inflight_ratio",
                "n_samples_per_prompt", "micro_rollout_batch_size", "max_epochs", "num_episodes",
                "engine_tp_size", "max_num_gen_batches", "eval_n_samples", "max_ckpt_num",
                "limit_mm_image_per_prompt", "max_token_budget", "max_turns", "max_episode_tokens",
                "micro_train_batch_size", "max_tokens_per_micro_batch", "train_batch_size")
AT_LEAST_ZERO = ("chunk_size", "eval_steps", "save_steps", "save_hf_steps", "log_samples_steps", "lora_rank",
                 "freezing_actor_steps", "overlong_buffer_len", "max_staleness", "init_kl_coef", "ptx_coef",
                 "overlong_penalty_factor", "policy_drift_coef", "max_env_tokens", "env_concurrency")
# flags that name a file, directory, URL or column: an empty string is a mistake, not "none"
PATHS = ("pretrain", "prompt_data", "eval_data", "reward_fn", "reward_pretrain", "critic_pretrain",
         "pretrain_data", "env", "output_dir", "images_key", "freeze_prefix", "remote_rm_url",
         "teacher_pretrain")
# what the run reads (paths, comma-joined paths, path.py:NAME): --output_dir must neither hold nor be in them
INPUTS = ("pretrain", "critic_pretrain", "reward_pretrain", "prompt_data", "eval_data", "pretrain_data",
          "reward_fn", "env", "teacher_pretrain")
# numbers any finite value of suits (every numeric flag is in one of these tables: tests/test_user_errors.py)
ANY_FINITE = ("entropy_coef", "reward_fallback", "reward_weights", "eval_reward_threshold")


def kl_in_reward(args):
    """Whether the per-token reward carries a k1 KL penalty (TOKEN_LEVEL, --init_kl_coef > 0, no KL loss)."""
    return args.advantage_estimator in TOKEN_LEVEL and not args.use_kl_loss and args.init_kl_coef > 0


def check(ok, message):
    if not ok:
        raise ConfigError(message)


def check_parallelism(args, world, deepspeed, sharded, parallelism, bf16):
    """What sequence parallelism (rft_core/sequence_parallel.py) cannot split; tensor parallelism refused."""
    tp = getattr(parallelism, "tp_size", None) or 1
    check(tp == 1, f"the accelerate config's parallelism_config_tp_size is {tp}: tensor parallelism is not "
          "supported by the training scripts yet; remove it (sequence parallelism is: "
          "accelerate_configs/deepspeed_zero3_sp2.yaml, fsdp2_cp2.yaml)")
    sp, cp = (getattr(parallelism, f"{dim}_size", None) or 1 for dim in ("sp", "cp"))
    check(cp == 1 or (sharded and not deepspeed), f"parallelism_config_cp_size {cp}: context parallelism "
          "needs FSDP2 (accelerate_configs/fsdp2_cp2.yaml); under DeepSpeed use parallelism_config_sp_size "
          "(deepspeed_zero3_sp2.yaml)")
    check(cp == 1 or bf16 is not False, f"parallelism_config_cp_size {cp} without --bf16: torch's ring "
          "attention runs on the flash / efficient kernels, grouped-KV models reach in bf16 only: add it")
    if sp * cp > 1:  # what cannot work when attention masks are dropped and every sdpa forward is split
        name = f"parallelism_config_{'sp' if sp > 1 else 'cp'}_size {sp * cp}"
        for flag, on, why in (
                ("packing_samples", args.packing_samples, "sdpa would attend across the packed samples"),
                ("policy_loss_type gspo", args.policy_loss_type == "gspo",
                 "its sequence ratio needs every slice of a sequence"),
                ("high_entropy_token_ratio", args.high_entropy_token_ratio, "its top tokens span the slices"),
                ("pretrain_data", args.pretrain_data, "its padded text rows would lose their attention mask"),
                ("reward_pretrain", args.reward_pretrain, "reward models would lose their attention mask"),
                ("advantage_estimator gae", args.advantage_estimator == "gae", "the critic's values are not "
                 "split across the ranks yet")):
            check(not on, f"--{flag} with sequence parallelism ({name}): {why}; drop one of them")
        dp = getattr(parallelism, "dp_shard_size", 1) * getattr(parallelism, "dp_replicate_size", 1)
        check(world == sp * cp * dp, f"{world} processes, but the accelerate config's parallelism_config "
              f"makes {sp * cp * dp} ({name} x data-parallel {dp}): set parallelism_config_dp_shard_size to "
              f"{world // (sp * cp)}")
        check(not hasattr(args, "images_key"), f"train_ppo_vl.py with sequence parallelism ({name}): image "
              "rows are not split across ranks yet; use a config without it")


def check_values(args):
    """Ranges (RANGES, AT_LEAST_ONE, AT_LEAST_ZERO) and named choices of the flags the script has."""
    names = {f.name for f in dataclasses.fields(args)}
    for name in sorted(names):  # NaN fails no `not in range` test and inf passes `> 0`: both refused first
        value = getattr(args, name)
        numbers = value if isinstance(value, (list, tuple)) else [value]
        finite = all(math.isfinite(v) for v in numbers if isinstance(v, float))
        check(finite, f"--{name} {value}: must be a finite number")
    for name in (name for name in PATHS if name in names):
        check(getattr(args, name) != "", f"--{name} '': empty; give it a value or leave the flag out")
    for name in (name for name in RANGES if name in names):  # in a fixed order: the same error every run
        valid, want = RANGES[name]
        check(valid(getattr(args, name)), f"--{name} {getattr(args, name)}: must be {want}")
    for name in (name for name in AT_LEAST_ONE + AT_LEAST_ZERO if name in names):
        low = 1 if name in AT_LEAST_ONE else 0
        value = getattr(args, name)
        check(value is None or value >= low, f"--{name} {value}: must be >= {low}")
    choices = {"advantage_estimator": ADVANTAGE_ESTIMATORS, "loss_agg_mode": LOSS_AGG_MODES,
               "tis_mode": ("truncate", "mask"), "policy_loss_type": POLICY_LOSS_TYPES,
               "tis_level": TIS_LEVELS, "kl_estimator": KL_ESTIMATORS}
    for name, allowed in choices.items():  # (None: the flag's own default, chosen by the plan)
        value = getattr(args, name)
        check(value is None or value in allowed, f"--{name} {value!r}: choose one of {allowed}")


def check_algorithm(args):
    estimator, n = args.advantage_estimator, args.n_samples_per_prompt
    check(n > 1 or estimator in ("reinforce", "gae", "distill"), f"--n_samples_per_prompt 1 with "
          f"{estimator}: the group baseline is the sample itself, so every advantage is 0; use >= 2, or "
          "reinforce / gae")
    check(estimator != "distill" or args.teacher_pretrain, "--advantage_estimator distill: its signal is the "
          "teacher's logprobs; give the teacher with --teacher_pretrain DIR")
    check(args.overlong_buffer_len < args.generate_max_len,
          f"--overlong_buffer_len {args.overlong_buffer_len}: must be below --generate_max_len "
          f"{args.generate_max_len}")
    check(not args.freezing_actor_steps or args.freezing_actor_steps < args.max_steps,
          f"--freezing_actor_steps {args.freezing_actor_steps}: the actor would never train in --max_steps "
          f"{args.max_steps}")
    check(not (args.use_kl_loss and args.init_kl_coef == 0), "--use_kl_loss with --init_kl_coef 0: the loss "
          "weighs nothing, but a reference model would load and run every step; set a coefficient or drop it")
    check(args.eval_steps <= args.max_steps, f"--eval_steps {args.eval_steps}: past --max_steps "
          f"{args.max_steps}, so no periodic eval would run (step 0 and the end always do); lower it, or 0")
    check(args.target_modules.strip(", "), f"--target_modules {args.target_modules!r}: name the modules that "
          "get adapters: all-linear, or names such as q_proj,v_proj")


def check_batches(args, world, train_batch_size):
    samples_per_step = args.rollout_batch_size * args.n_samples_per_prompt
    check(args.rollout_batch_size % world == 0,
          f"--rollout_batch_size {args.rollout_batch_size} must divide over {world} processes")
    check(samples_per_step % train_batch_size == 0, f"rollout_batch_size * n_samples_per_prompt = "
          f"{samples_per_step} must be a multiple of --train_batch_size {train_batch_size}")
    check(train_batch_size % world == 0,
          f"--train_batch_size {train_batch_size} must divide over {world} processes")
    micro = args.micro_train_batch_size
    check(not micro or train_batch_size % (micro * world) == 0,
          f"--train_batch_size {train_batch_size} must be a multiple of --micro_train_batch_size "
          f"{micro} x {world} processes")


def check_setup(args, world, deepspeed, sharded, engine_type):
    """What the distributed set-up, the engine, the rewards and the output directory cannot do together."""
    estimator = args.advantage_estimator
    check(not (args.ema_beta and (args.lora_rank or sharded)), "--ema_beta is not supported with --lora_rank "
          "(the export would merge the live adapter) nor under ZeRO-3 / FSDP2 (it averages whole parameters)")
    check(not (deepspeed and estimator == "gae"), "gae trains a critic beside the actor, "
          "which one DeepSpeed engine cannot: use the multi_gpu or fsdp2 config")
    check(not (args.optimizer_offload and zero_offloads_optimizer(deepspeed)), "--optimizer_offload: this "
          "DeepSpeed config (offload_optimizer_device: cpu) keeps the optimizer on the CPU already; drop it")
    check(not (args.reward_fn and args.remote_rm_url), "--reward_fn and --remote_rm_url both given: pass one")
    models = len(args.reward_pretrain.split(",")) if args.reward_pretrain else 0
    sources = models + (1 if args.reward_fn or args.remote_rm_url or not models else 0)
    check(args.reward_weights is None or len(args.reward_weights) == sources,
          f"--reward_weights has {len(args.reward_weights or [])} values for {sources} reward sources "
          "(--reward_fn or --remote_rm_url, then each --reward_pretrain model)")
    for flag, ranks in (("partial_rollout", "continue different numbers of samples"),
                        ("env", "generate different numbers of episode turns")):
        check(not (getattr(args, flag) and engine_type == "hf" and sharded), f"--{flag} with the "
              f"transformers engine under ZeRO-3 / FSDP2: ranks {ranks}, which its sharded generate cannot; "
              "use vLLM (--engine_type vllm) or the multi_gpu config")
    check_env(args)
    tp = args.engine_tp_size
    check(engine_type == "hf" or world % tp == 0, f"--engine_tp_size {tp}: must divide the {world} processes "
          "(groups of consecutive ranks share an engine)")
    check_paths(args)
    prompt_limit(args, model_positions(args.pretrain))  # a response longer than the model's positions
    check(args.engine_sleep in ("auto", "always", "never"),
          f"--engine_sleep {args.engine_sleep!r}: choose auto, always or never")


def check_env(args):
    if args.env is None:
        return
    check(not args.partial_rollout, "--partial_rollout with --env: an episode's turns wait for the "
          "environment, so its samples cannot be cut and continued in a later step; drop one of them")
    check(not args.overlong_buffer_len, "--overlong_buffer_len with --env: DAPO's overlong shaping is for "
          "one response of --generate_max_len tokens, not for episodes; drop it")
    check(args.max_episode_tokens > args.generate_max_len or args.max_turns == 1,
          f"--max_episode_tokens {args.max_episode_tokens}: one turn of --generate_max_len "
          f"{args.generate_max_len} tokens would fill it; raise it (or lower --generate_max_len)")


def check_paths(args):
    """Path flags within NAME_MAX / PATH_MAX; --output_dir writable and apart from INPUTS (real paths): its
    config.json once overwrote a --pretrain model's."""
    inputs = []  # (flag, path)
    for name in (name for name in INPUTS if getattr(args, name, None)):
        for path in getattr(args, name).split(",") if name == "reward_pretrain" else [getattr(args, name)]:
            path = path.rpartition(":")[0] if name in ("reward_fn", "env") else path
            inputs += [(name, path)] if path else []
    for name, path in [*inputs, ("output_dir", args.output_dir)]:
        full = os.fsencode(os.path.abspath(path))
        longest, shown = max(full.split(os.fsencode(os.sep)), key=len), f"--{name} {path[:50]!r}..."
        check(len(longest) <= 255, f"{shown}: it holds a name of {len(longest)} bytes, over the filesystem's "
              "limit of 255 (NAME_MAX); shorten it")
        check(len(full) < 4096, f"{shown}: {len(full)} bytes, over the filesystem's limit of 4096 "
              "(PATH_MAX); use a shorter path")
    check_output_dir(args.output_dir)
    out = os.path.realpath(args.output_dir)
    for name, path in inputs:
        real = os.path.realpath(path)
        common = os.path.commonpath([out, real])
        if os.path.exists(real) and common in (out, real):  # (a missing one is named as it loads)
            how = "is" if real == out else "holds" if common == out else "is inside"
            raise ConfigError(f"--output_dir {args.output_dir!r} {how} --{name} {path!r}: the run's files "
                              "would overwrite or move what it reads; pass an --output_dir apart from them")


def model_positions(pretrain):
    """max_position_embeddings in --pretrain's config.json (a VL one's text_config), or None without one."""
    path = os.path.join(pretrain or "", "config.json")
    if not pretrain or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
        return config.get("max_position_embeddings") or (config.get("text_config") or {}).get(
            "max_position_embeddings")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"--pretrain {pretrain!r}: its config.json cannot be read ({e}); save the model "
                          "again with save_pretrained") from e


def prompt_limit(args, positions):
    """(the longest prompt in tokens, what sets it): --prompt_max_len, or less where the model's positions
    (None: unknown) cannot also hold a whole response; a response alone past them is refused."""
    flag = "max_episode_tokens" if args.env else "generate_max_len"
    response = getattr(args, flag)
    check(positions is None or response < positions, f"--{flag} {response}: past the model's {positions} "
          "positions (max_position_embeddings), which must hold the prompt and the response; lower it")
    if positions is None or args.prompt_max_len + response <= positions:
        return args.prompt_max_len, f"--prompt_max_len {args.prompt_max_len}"
    limit = positions - response
    return limit, f"{limit} tokens (the model's {positions} positions less --{flag} {response})"


def check_output_dir(path):
    """--output_dir can be made and written: a probe file (mode bits miss read-only mounts), no dead link."""
    existing = os.path.abspath(path)  # it, or the nearest folder above it that exists
    while not os.path.exists(existing):
        check(not os.path.islink(existing), f"--output_dir {path!r}: {existing} is a symbolic link to "
              f"{os.path.realpath(existing)}, which does not exist; create that or pass another folder")
        existing = os.path.dirname(existing)
    check(os.path.isdir(existing), f"--output_dir {path!r}: {existing} is a file; pass a folder to write to")
    try:
        handle, probe = tempfile.mkstemp(prefix=".probe-", dir=existing)
        os.close(handle)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--output_dir {path!r}: files cannot be created in {existing} ({e.strerror}); "
                          "pass a folder to write to") from e


def check_vl_flags(args):
    check(not args.critic_pretrain, "--critic_pretrain: the VL critic is the policy's backbone with a "
          "new value head, not a separate checkpoint; drop the flag")
    check(args.apply_chat_template, "--apply_chat_template false: image prompts need the chat template "
          "(it places the image tokens); leave it on")
    check(not args.packing_samples, "--packing_samples: not for image prompts (the model computes their "
          "multimodal positions from padded rows); drop the flag")


def check_inert(args, engine_type):
    """Flags set away from their default where they do nothing in this run are refused, saying why."""
    estimator = args.advantage_estimator
    inert = [  # (whether they act here, the flags, why they do not)
        (engine_type != "hf", ("engine_tp_size", "engine_mem_util", "engine_sleep",
                               "engine_sleep_level", "engine_enforce_eager"),
         "it sets the vLLM / SGLang engine, but this run uses the transformers engine (--engine_type hf, or "
         "auto without a GPU or without vllm)"),
        (estimator == "gae", ("critic_pretrain", "critic_learning_rate", "value_clip", "lambd",
                              "freezing_actor_steps"),
         f"it is the critic's (gae), but --advantage_estimator is {estimator}"),
        (estimator in TOKEN_LEVEL, ("gamma",), "it discounts the token-level estimators (gae, reinforce, "
         f"reinforce_baseline), but --advantage_estimator is {estimator}"),
        (kl_in_reward(args), ("kl_target",), "it adapts the KL penalty in the reward, which "
         "needs gae / reinforce / reinforce_baseline, --init_kl_coef > 0 and no --use_kl_loss"),
        (args.use_kl_loss, ("kl_estimator",), "it is the KL loss's estimator, but --use_kl_loss is off"),
        (args.dynamic_sampling or args.partial_rollout, ("max_num_gen_batches",),
         "it bounds the rounds of --dynamic_sampling and --partial_rollout, which are off"),
        (args.partial_rollout, ("max_token_budget", "max_staleness", "inflight_ratio"),
         "--partial_rollout is off"),
        (args.tis_cap is not None or args.partial_rollout, ("tis_mode", "tis_level"), "--tis_cap is off"),
        (args.env is not None, ("max_turns", "max_episode_tokens", "max_env_tokens", "env_concurrency"),
         "it limits the episodes of --env, which is not given"),
        (args.env is not None or ":" in (args.reward_fn or ""), ("workers",),
         "it sizes the processes that run --env and a --reward_fn file, and this run has neither"),
        (args.overlong_buffer_len > 0, ("overlong_penalty_factor",), "it scales the overlong penalty, but "
         "--overlong_buffer_len is 0"),
        (args.pretrain_data is not None, ("ptx_coef", "pretrain_key"),
         "it is the ptx loss's, but there is no --pretrain_data"),
        (args.teacher_pretrain is not None, ("distill_coef",), "it weighs the teacher's logprobs, but there "
         "is no --teacher_pretrain"),
        (args.lora_rank > 0, ("lora_alpha", "target_modules"),
         "it shapes LoRA adapters, but --lora_rank is 0"),
        (args.micro_train_batch_size is None, ("max_tokens_per_micro_batch",),
         "--micro_train_batch_size sets the micro-batches by rows instead"),
    ]
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    for active, flags, reason in inert:
        for name in flags if not active else ():
            value = getattr(args, name)
            check(value == defaults[name], f"--{name} {value}: {reason}; drop the flag")


def check_args(args, world, deepspeed=None, sharded=False, engine_type="hf", parallelism=None,
               train_batch_size=None, bf16=None):
    """Every check on a script's Args. world: processes; deepspeed: accelerate's plugin or None; sharded:
    ZeRO-3 / FSDP2; parallelism: a ParallelismConfig or None; the rest: resolved values (default: flags')."""
    train_batch_size = train_batch_size or args.train_batch_size
    bf16 = args.bf16 if bf16 is None else bf16
    check_parallelism(args, world, deepspeed, sharded, parallelism, bf16)
    check_values(args)
    check_algorithm(args)
    check_batches(args, world, train_batch_size)
    check_setup(args, world, deepspeed, sharded, engine_type)
    if hasattr(args, "images_key"):  # train_ppo_vl.py
        check_vl_flags(args)
    check_inert(args, engine_type)
