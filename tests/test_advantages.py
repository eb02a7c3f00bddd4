"""Advantage estimators against loop-by-loop references."""

import math

import pytest
import torch

from rft_core.advantages import compute_advantages

REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.1, 0.1, 0.0, 0.0]  # 3 prompts x 4 samples
N = 4


def groups(rewards, n):
    return [rewards[i:i + n] for i in range(0, len(rewards), n)]


def std(xs):  # unbiased
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def naive(estimator, rewards, n, eps=1e-6):
    out = []
    if estimator == "reinforce_baseline":
        centred = [r - sum(g) / n for g in groups(rewards, n) for r in g]
        return [c / (std(centred) + eps) for c in centred]
    for g in groups(rewards, n):
        mean = sum(g) / n
        for j, r in enumerate(g):
            if estimator == "group_norm":
                out.append((r - mean) / (std(g) + eps))
            elif estimator == "dr_grpo":
                out.append(r - mean)
            elif estimator == "rloo":
                out.append(r - sum(g[k] for k in range(n) if k != j) / (n - 1))
    return out


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo", "reinforce_baseline"])
def test_matches_naive(estimator):
    got = compute_advantages(torch.tensor(REWARDS), N, estimator)
    assert got.tolist() == pytest.approx(naive(estimator, REWARDS, N), rel=1e-5, abs=1e-6)


def test_known_values():
    adv = compute_advantages(torch.tensor([1.0, 0.0]), 2, "dr_grpo")
    assert adv.tolist() == [0.5, -0.5]
    adv = compute_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, "rloo")
    assert adv.tolist() == pytest.approx([1.0, -0.5, -0.5])
    # a group where every sample got the same reward carries no signal
    assert compute_advantages(torch.tensor([0.5, 0.5, 0.5]), 3, "group_norm").abs().max() == 0


def test_rloo_is_scaled_dr_grpo():
    """RLOO's advantage is n/(n-1) times the mean-centred one."""
    r = torch.tensor(REWARDS)
    assert torch.allclose(compute_advantages(r, N, "rloo"), compute_advantages(r, N, "dr_grpo") * N / (N - 1))


def test_errors():
    with pytest.raises(ValueError, match="groups of 4"):
        compute_advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages(torch.ones(4), 4, "ppo")
    with pytest.raises(ValueError, match="rloo needs"):
        compute_advantages(torch.ones(4), 1, "rloo")
