"""Flags from a dataclass (each field's docstring is its --help), and the checks of their values."""

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing

from rft_core.advantages import ADVANTAGE_ESTIMATORS, TOKEN_LEVEL
from rft_core.losses import LOSS_AGG_MODES


def _field_docs(cls):
    """The string literal under each field of a dataclass body: its documentation."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body, docs = tree.body[0].body, {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _bool(text):
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def parse_args(cls, argv=None):
    """Parse argv into an instance of the dataclass `cls`: `--name value`, bools as `--name [true|false]`,
    Tuple[float, float] as `--name A B`."""
    parser = argparse.ArgumentParser(description=inspect.getdoc(inspect.getmodule(cls)),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    docs, hints = _field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        args = typing.get_args(kind)
        if typing.get_origin(kind) is typing.Union:  # Optional[X]
            kind = next(a for a in args if a is not type(None))
        help_text = f"{docs.get(f.name, '')} (default: {f.default})"
        if kind is bool:
            parser.add_argument(f"--{f.name}", type=_bool, nargs="?", const=True, default=f.default,
                                help=help_text)
        elif typing.get_origin(kind) is tuple:
            # Tuple[float, float]: --name A B; Tuple[float, ...]: one or more
            items = typing.get_args(kind)
            parser.add_argument(f"--{f.name}", type=items[0],
                                nargs="+" if items[-1] is Ellipsis else len(items),
                                default=f.default, help=help_text)
        else:
            parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=help_text)
    return cls(**vars(parser.parse_args(argv)))


def check_args(args, world, deepspeed=None, sharded=False):
    """Refuse the flag values and combinations of a training script's Args that cannot work, naming the flag
    and the fix, before anything loads. world: processes; deepspeed: accelerate's DeepSpeed plugin or None;
    sharded: ZeRO-3 or FSDP2."""
    def check(ok, message):
        if not ok:
            raise ValueError(message)

    samples_per_step = args.rollout_batch_size * args.n_samples_per_prompt
    check(args.rollout_batch_size % world == 0,
          f"--rollout_batch_size {args.rollout_batch_size} must divide over {world} processes")
    check(samples_per_step % args.train_batch_size == 0, f"rollout_batch_size * n_samples_per_prompt = "
          f"{samples_per_step} must be a multiple of --train_batch_size {args.train_batch_size}")
    check(args.train_batch_size % (args.micro_train_batch_size * world) == 0,
          f"--train_batch_size {args.train_batch_size} must be a multiple of --micro_train_batch_size "
          f"{args.micro_train_batch_size} x {world} processes")
    check(not (args.ema_beta and (args.lora_rank or sharded)), "--ema_beta is not supported with --lora_rank "
          "(the export would merge the live adapter) nor under ZeRO-3 / FSDP2 (it averages whole parameters)")
    check(not (deepspeed and args.advantage_estimator == "gae"), "gae trains a critic beside the actor, "
          "which one DeepSpeed engine cannot: use the multi_gpu or fsdp2 config")
    check(not (deepspeed and args.optimizer_offload), "--optimizer_offload moves a torch optimizer's state; "
          "under DeepSpeed use accelerate_configs/deepspeed_zero3_offload.yaml")
    check(args.dual_clip is None or args.dual_clip > 1, f"--dual_clip must be > 1, got {args.dual_clip}")
    check(not (args.reward_fn and args.remote_rm_url), "--reward_fn and --remote_rm_url both given: pass one")
    check(args.advantage_estimator in ADVANTAGE_ESTIMATORS,
          f"--advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, got {args.advantage_estimator!r}")
    check(args.loss_agg_mode in LOSS_AGG_MODES,
          f"--loss_agg_mode must be one of {LOSS_AGG_MODES}, got {args.loss_agg_mode!r}")
    check(not args.freezing_actor_steps or args.advantage_estimator == "gae",
          "--freezing_actor_steps trains the critic alone: it needs --advantage_estimator gae")
    kl_in_reward = args.advantage_estimator in TOKEN_LEVEL and not args.use_kl_loss and args.init_kl_coef > 0
    check(args.kl_target is None or kl_in_reward, "--kl_target adapts the KL penalty in the reward: use "
          "gae / reinforce / reinforce_baseline, --init_kl_coef > 0 and no --use_kl_loss")
    check(0.0 <= args.high_entropy_token_ratio <= 1.0,
          f"--high_entropy_token_ratio must be in [0, 1], got {args.high_entropy_token_ratio}")
    check(0 <= args.overlong_buffer_len < args.generate_max_len,
          f"--overlong_buffer_len must be in [0, --generate_max_len {args.generate_max_len})")
    check(not (args.enable_engine_sleep and args.disable_engine_sleep),
          "--enable_engine_sleep or --disable_engine_sleep: pick one")
