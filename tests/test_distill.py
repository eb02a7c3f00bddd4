"""On-policy distillation (--teacher_pretrain, --distill_coef, --advantage_estimator distill): the per-token
advantage against a loop-by-loop reference, the checks, the tokenizer refusal, and runs of both scripts."""

import dataclasses

import pytest
import torch
from conftest import read_metrics, run_script, save_eos_vl_model

import train_ppo
from rft_core.advantages import distill_advantages, outcome_scores
from rft_core.errors import ConfigError
from rft_core.runs.checks import check_args


def reference(advantages, teacher, student, mask, coef):
    """Token by token: a response token's advantage is its sequence's (or its own) plus coef * the gap."""
    out = torch.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                base = advantages[b] if advantages.dim() == 1 else advantages[b, t]
                out[b, t] = base + coef * (teacher[b, t] - student[b, t])
    return out


@pytest.mark.parametrize("per_token", [False, True])
def test_distill_advantages_match_the_loop(per_token):
    torch.manual_seed(0)
    B, T = 4, 7
    mask = torch.rand(B, T) > 0.3  # interior zeros: environment tokens of a multi-turn episode
    mask[:, 0] = False  # (prompt)
    teacher, student = -torch.rand(B, T) * 5, -torch.rand(B, T) * 5
    advantages = torch.randn(B, T) * mask if per_token else torch.randn(B)
    got = distill_advantages(advantages, teacher, student, mask.long(), 0.5)
    torch.testing.assert_close(got, reference(advantages, teacher, student, mask, 0.5))
    assert (got[~mask] == 0).all()  # masked tokens carry nothing, whatever the logprobs there


def test_distill_alone_has_no_outcome_part():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    assert (outcome_scores(rewards, 2, "distill") == 0).all()
    scores = outcome_scores(rewards, 2, "distill")
    gap = distill_advantages(scores, torch.zeros(4, 3), torch.full((4, 3), -1.0), torch.ones(4, 3))
    assert (gap == 1.0).all()  # teacher more sure than the policy: the token is pushed up by the gap in nats


def test_the_flags_are_checked():
    def refused(**flags):
        with pytest.raises(ConfigError) as e:
            check_args(dataclasses.replace(train_ppo.Args(), **flags), world=1, train_batch_size=32)
        return str(e.value)

    assert "--teacher_pretrain" in refused(advantage_estimator="distill")
    assert "no --teacher_pretrain" in refused(distill_coef=0.5)
    assert "> 0" in refused(teacher_pretrain="t", distill_coef=0.0)
    check_args(dataclasses.replace(train_ppo.Args(), teacher_pretrain="t", advantage_estimator="distill",
                                   n_samples_per_prompt=1), world=1, train_batch_size=8)  # no group needed


def test_a_teacher_with_another_tokenizer_is_one_line():
    from rft_core.models import check_teacher
    from rft_core.vision import word_tokenizer

    tokenizer, other = word_tokenizer(), word_tokenizer()
    check_teacher(tokenizer, other, "same")
    other.add_tokens(["zebra"])
    with pytest.raises(ConfigError, match=r"not the policy's \(1 of \d+ tokens differ\)") as e:
        check_teacher(tokenizer, other, "/models/other")
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_distilling_away_from_early_endings(tiny_model_dir, eos_model_dir, tmp_path):
    """A student that ends its answers after a few tokens (an EOS probability of 0.2) distilled alone into a
    teacher that almost never ends (the random tiny Llama): the sampled EOS tokens, which the teacher scores
    near log(1/V), are pushed down, so the reverse KL to the teacher falls and the answers grow. With
    group_norm the gap is added to the outcome advantages."""
    base = ["--pretrain", eos_model_dir, "--teacher_pretrain", tiny_model_dir, "--rollout_batch_size", "4",
            "--n_samples_per_prompt", "4", "--micro_rollout_batch_size", "16", "--generate_max_len", "12",
            "--actor_learning_rate", "3e-3", "--eval_steps", "0"]
    run_script("train_ppo.py", [*base, "--advantage_estimator", "distill", "--max_steps", "5",
                                "--output_dir", str(tmp_path / "alone")])
    rows = read_metrics(str(tmp_path / "alone"))[0]
    kl, length = [r["train/distill_kl"] for r in rows], [r["rollout/response_length"] for r in rows]
    assert all(r["train/teacher_logprob"] < 0 for r in rows)
    assert kl[-1] < 0.5 * kl[0] and length[-1] > length[0], (kl, length)
    run_script("train_ppo.py", [*base, "--max_steps", "1", "--distill_coef", "0.1",
                                "--output_dir", str(tmp_path / "both")])
    assert "train/distill_kl" in read_metrics(str(tmp_path / "both"))[0][0]


@pytest.mark.slow
def test_the_vl_script_distills_from_a_vl_teacher(tmp_path):
    teacher = save_eos_vl_model(tmp_path / "teacher")
    run_script("train_ppo_vl.py", ["--teacher_pretrain", teacher, "--max_steps", "1", "--eval_steps", "0",
                                   "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
                                   "--output_dir", str(tmp_path / "out")])
    row = read_metrics(str(tmp_path / "out"))[0][0]
    assert row["train/distill_kl"] == row["train/distill_kl"] and row["train/teacher_logprob"] < 0


@pytest.mark.gpu(needs="vllm")
def test_distillation_with_the_vllm_engine(tiny_model_dir, tmp_path):
    """bf16, vLLM sampling (the embedded model: vLLM's kernels need real head sizes), the old-logprob pass the
    teacher needs and the teacher's pass beside it; the teacher, a random tiny Llama, finds every token
    unlikely, so the gap is large and positive."""
    run_script("train_ppo.py", ["--teacher_pretrain", tiny_model_dir, "--advantage_estimator", "distill",
                                "--max_steps", "2", "--rollout_batch_size", "4", "--eval_steps", "0",
                                "--engine_type", "vllm", "--engine_enforce_eager", "--engine_mem_util", "0.1",
                                "--output_dir", str(tmp_path)])
    rows = read_metrics(str(tmp_path))[0]
    assert all(1 < r["train/distill_kl"] < 20 and r["train/teacher_logprob"] < -5 for r in rows), rows
