"""The plan (rft_core/plan.py): resolved once from the flags, never writing them back, recorded whole."""

import json
from dataclasses import asdict, replace
from types import SimpleNamespace

import pytest

import train_ppo
import train_ppo_vl
from rft_core.errors import ConfigError
from rft_core.plan import engine_settings, resolve


def cpu_accelerator(processes=1):
    """What resolve reads of an Accelerator: one or more CPU processes, no DeepSpeed, FSDP or parallelism."""
    return SimpleNamespace(num_processes=processes, parallelism_config=None,
                           device=SimpleNamespace(type="cpu"), state=SimpleNamespace(deepspeed_plugin=None),
                           distributed_type=SimpleNamespace(name="NO"))


@pytest.mark.parametrize("module", [train_ppo, train_ppo_vl])
def test_resolve_leaves_the_flags_as_typed(module, tmp_path):
    args = module.Args(output_dir=str(tmp_path / "run"), partial_rollout=True)
    before = asdict(args)
    plan = resolve(args, cpu_accelerator(), default_lr=3e-3)
    assert asdict(args) == before
    assert plan.train_batch_size == args.rollout_batch_size * args.n_samples_per_prompt
    assert plan.engine.type == "hf" and plan.bf16 is False and plan.torch_compile is False
    assert (plan.loss.tis_cap, plan.loss.tis_level) == (2.0, "sequence")  # partial rollout's defaults
    assert plan.rollout.logprob_every == 1 and plan.rollout.token_budget == args.generate_max_len // 4
    assert plan.actor_learning_rate == (args.actor_learning_rate or 3e-3)
    assert plan.max_tokens_per_micro_batch == 16384 and plan.gradient_checkpointing is None
    record = json.loads(json.dumps(plan.record()))  # config.json holds it as JSON
    assert record["loss"]["tis_cap"] == 2.0 and record["engine"]["sleep"] == "auto"
    said = plan.describe().splitlines()
    assert said[0].startswith("[plan] ") and any("partial rollout's default" in line for line in said)


def test_resolve_runs_the_checks_first(tmp_path):
    args = train_ppo.Args(output_dir=str(tmp_path), rollout_batch_size=3)
    with pytest.raises(ConfigError, match="--rollout_batch_size 3 must divide over 2 processes"):
        resolve(args, cpu_accelerator(2))
    resolve(replace(args, rollout_batch_size=4), cpu_accelerator(2))


def test_the_old_logprobs_and_the_kl_in_the_reward(tmp_path):
    """One optimizer step per rollout reuses the update's logprobs as the old ones, unless the KL penalty in
    the reward needs them before the update."""
    base = train_ppo.Args(output_dir=str(tmp_path))
    plans = {name: resolve(replace(base, **flags), cpu_accelerator()) for name, flags in {
        "grpo": {}, "two_steps": {"train_batch_size": base.rollout_batch_size}, "ppo": {
            "advantage_estimator": "gae", "init_kl_coef": 0.01}}.items()}
    assert plans["grpo"].reuse_old_logprobs and not plans["grpo"].kl_in_reward
    assert not plans["two_steps"].reuse_old_logprobs and plans["two_steps"].rows_per_update == 8
    assert plans["ppo"].kl_in_reward and plans["ppo"].token_level and not plans["ppo"].reuse_old_logprobs


def test_the_engine_holds_a_rounds_requests():
    flags = SimpleNamespace(micro_rollout_batch_size=8, engine_tp_size=1, engine_mem_util=0.3,
                           engine_sleep="auto", engine_sleep_level=1, engine_enforce_eager=False, seed=0,
                           prompt_max_len=64,
                           generate_max_len=64, partial_rollout=False, inflight_ratio=2.5,
                           max_staleness=2, env=None, max_episode_tokens=512)
    assert engine_settings(flags, "hf", True, 256).requests == 256
    assert engine_settings(flags, "hf", True, 256).max_model_len == 128
    flags.env = "calculator"  # an episode's whole response: its turns and the environment's
    assert engine_settings(flags, "hf", True, 256).max_model_len == 64 + 512
    flags.partial_rollout = True  # a round holds --inflight_ratio steps' worth of groups
    assert engine_settings(flags, "hf", True, 256).requests == 640
    assert engine_settings(flags, "hf", True, 256, sp_size=2).micro_batch_size == 1


def test_the_prefix_cache_only_where_a_context_comes_again():
    """vLLM's prefix cache hashes every sequence's blocks as it grows: on where a call sends a context again
    (an episode's turns, a partial rollout's rounds), off for single-turn rollouts."""
    flags = SimpleNamespace(micro_rollout_batch_size=8, engine_tp_size=1, engine_mem_util=0.3,
                           engine_sleep="auto", engine_sleep_level=1, engine_enforce_eager=False, seed=0,
                           prompt_max_len=64,
                           generate_max_len=64, partial_rollout=False, inflight_ratio=1.0,
                           max_staleness=2, env=None, max_episode_tokens=512)
    assert engine_settings(flags, "hf", True, 256).prefix_caching is False
    flags.env = "calculator"
    assert engine_settings(flags, "hf", True, 256).prefix_caching is True
    flags.env, flags.partial_rollout = None, True
    assert engine_settings(flags, "hf", True, 256).prefix_caching is True


@pytest.mark.parametrize("check, flags, says", [
    ("check_values", dict(temperature=0.0), "--temperature 0.0: must be > 0"),
    ("check_values", dict(loss_agg_mode="mean"), "--loss_agg_mode 'mean': choose one of"),
    ("check_algorithm", dict(n_samples_per_prompt=1), "--n_samples_per_prompt 1 with group_norm"),
    ("check_batches", dict(rollout_batch_size=3), "= 12 must be a multiple of --train_batch_size 32"),
    ("check_setup", dict(engine_sleep="sometimes"), "choose auto, always or never"),
    ("check_inert", dict(gamma=0.9), "--gamma 0.9: it discounts the token-level estimators"),
])
def test_each_check_refuses_on_its_own(check, flags, says, tmp_path):
    """Each of rft_core/runs/checks.py's checks refuses its case alone, and passes the defaults."""
    import rft_core.runs.checks as checks

    context = {"check_values": (), "check_algorithm": (), "check_batches": (1, 32),
               "check_setup": (1, None, False, "hf"), "check_inert": ("hf",)}[check]
    args = train_ppo.Args(output_dir=str(tmp_path))
    getattr(checks, check)(args, *context)
    with pytest.raises(ConfigError, match=says):
        getattr(checks, check)(replace(args, **flags), *context)
