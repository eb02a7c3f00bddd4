"""Advantage estimators, token-level returns / GAE, whitening and the KL controller against
loop-by-loop references."""

import math
import threading

import pytest
import torch

from rft_core.advantages import (
    ADVANTAGE_ESTIMATORS,
    adaptive_kl_coef,
    discounted_returns,
    gae,
    outcome_scores,
    token_rewards,
    whiten,
)

REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.1, 0.1, 0.0, 0.0]  # 3 prompts x 4 samples
N = 4


def groups(rewards, n):
    return [rewards[i:i + n] for i in range(0, len(rewards), n)]


def std(xs, unbiased=True):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - unbiased))


def naive(estimator, rewards, n, eps=1e-6):
    out = []
    for g in groups(rewards, n):
        mean = sum(g) / n
        for j, r in enumerate(g):
            if estimator == "group_norm":
                out.append((r - mean) / (std(g) + eps))
            elif estimator == "cpgd":
                out.append((r - mean) / (std(g, unbiased=False) + eps))
            elif estimator in ("dr_grpo", "reinforce_baseline"):
                out.append(r - mean)
            elif estimator == "rloo":
                out.append(r - sum(g[k] for k in range(n) if k != j) / (n - 1))
            elif estimator in ("reinforce", "gae"):
                out.append(r)
            elif estimator == "distill":  # the teacher's logprobs alone: tests/test_distill.py
                out.append(0.0)
    return out


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_matches_naive(estimator):
    got = outcome_scores(torch.tensor(REWARDS), N, estimator)
    assert got.tolist() == pytest.approx(naive(estimator, REWARDS, N), rel=1e-5, abs=1e-6)


def test_known_values():
    adv = outcome_scores(torch.tensor([1.0, 0.0]), 2, "dr_grpo")
    assert adv.tolist() == [0.5, -0.5]
    adv = outcome_scores(torch.tensor([1.0, 0.0, 0.0]), 3, "rloo")
    assert adv.tolist() == pytest.approx([1.0, -0.5, -0.5])
    assert (outcome_scores(torch.tensor([1.0, 0.0]), 2, "cpgd").tolist()
            == pytest.approx([1.0, -1.0], abs=1e-5))
    # a group where every sample got the same reward carries no signal
    assert outcome_scores(torch.tensor([0.5, 0.5, 0.5]), 3, "group_norm").abs().max() == 0


@pytest.mark.parametrize("estimator", ["group_norm", "cpgd", "dr_grpo", "rloo", "reinforce_baseline"])
@pytest.mark.parametrize("group", [[0.3] * 8, [123.456] * 5, [1.1] * 3, [1e-7] * 4])
def test_tied_group_scores_exactly_zero(estimator, group):
    """A group whose rewards are all equal (partial credit, --normalize_reward, dynamic sampling's fillers)
    has no better sample: every baseline estimator gives exactly 0. In float32 the mean of [0.3] * 8 is one
    ulp off and its std one ulp, so (r - mean) / (std + eps) used to give +0.029, and [123.456] * 5 gave
    0.80."""
    mixed = torch.tensor(group + [2.0] + group[1:])  # a tied group, then one that is not
    scores = outcome_scores(mixed, len(group), estimator)
    assert scores[:len(group)].tolist() == [0.0] * len(group)
    assert scores[len(group):].abs().max() > 0


def test_rloo_is_scaled_dr_grpo():
    """RLOO's advantage is n/(n-1) times the mean-centred one."""
    r = torch.tensor(REWARDS)
    assert torch.allclose(outcome_scores(r, N, "rloo"), outcome_scores(r, N, "dr_grpo") * N / (N - 1))


def test_errors():
    with pytest.raises(ValueError, match="groups of 4"):
        outcome_scores(torch.ones(6), 4)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        outcome_scores(torch.ones(4), 4, "ppo")
    with pytest.raises(ValueError, match="rloo needs"):
        outcome_scores(torch.ones(4), 1, "rloo")


# ---- token level: rewards with a KL penalty, returns, GAE ----

LENGTHS = [3, 1, 4]  # response lengths; T = 4, right padding
T = 4


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in LENGTHS])  # (3, 4)
    scores = torch.tensor([1.0, -0.5, 2.0])
    kl = torch.rand(3, T, generator=g)
    values = torch.randn(3, T, generator=g)
    return scores, mask, kl, values


def close(got, want, atol=1e-5):
    assert torch.allclose(got, torch.tensor(want, dtype=got.dtype), atol=atol), (got, want)


def naive_token_rewards(scores, mask, kl, coef):
    out = [[0.0] * T for _ in LENGTHS]
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            out[i][t] = -coef * float(kl[i, t]) + (float(scores[i]) if t == n - 1 else 0.0)
    return out


def test_token_rewards():
    scores, mask, kl, _ = batch()
    got = token_rewards(scores, mask, kl, 0.1)
    close(got, naive_token_rewards(scores, mask, kl, 0.1))
    # no KL: the score once
    assert token_rewards(scores, mask).sum(-1).tolist() == pytest.approx(scores.tolist())


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_discounted_returns(gamma):
    scores, mask, kl, _ = batch()
    r = naive_token_rewards(scores, mask, kl, 0.1)
    want = [[sum(gamma ** (u - t) * r[i][u] for u in range(t, n)) if t < n else 0.0 for t in range(T)]
            for i, n in enumerate(LENGTHS)]
    got = discounted_returns(torch.tensor(r), mask, gamma)
    close(got, want)


@pytest.mark.parametrize("gamma, lambd", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae(gamma, lambd):
    scores, mask, kl, values = batch()
    r = naive_token_rewards(scores, mask, kl, 0.05)
    want_adv, want_ret = [], []
    for i, n in enumerate(LENGTHS):
        v = [float(values[i, t]) for t in range(n)] + [0.0]  # V = 0 after the last token
        delta = [r[i][t] + gamma * v[t + 1] - v[t] for t in range(n)]
        adv = [sum((gamma * lambd) ** (u - t) * delta[u] for u in range(t, n)) for t in range(n)]
        want_adv.append(adv + [0.0] * (T - n))
        want_ret.append([a + v[t] for t, a in enumerate(adv)] + [0.0] * (T - n))
    adv, ret = gae(torch.tensor(r), values, mask, gamma, lambd)
    close(adv, want_adv)
    close(ret, want_ret)


def test_gae_limits():
    """lambda = 1: Monte-Carlo return minus the value; values all 0: returns discounted by gamma * lambda."""
    scores, mask, kl, values = batch()
    r = token_rewards(scores, mask, kl, 0.1)
    adv, _ = gae(r, values, mask, 0.9, 1.0)
    assert torch.allclose(adv, (discounted_returns(r, mask, 0.9) - values) * mask, atol=1e-5)
    adv, ret = gae(r, torch.zeros_like(values), mask, 0.9, 0.7)
    assert torch.allclose(ret, discounted_returns(r, mask, 0.9 * 0.7), atol=1e-6)


def test_whiten_naive():
    _, mask, _, x = batch()
    flat = [float(x[i, t]) for i, n in enumerate(LENGTHS) for t in range(n)]
    mean = sum(flat) / len(flat)
    sd = math.sqrt(sum((v - mean) ** 2 for v in flat) / len(flat))
    got = whiten(x, mask)
    want = [[(float(x[i, t]) - mean) / sd if t < n else 0.0 for t in range(T)] for i, n in enumerate(LENGTHS)]
    close(got, want)


def test_whiten_same_across_ranks():
    """Whitening a batch split over two simulated data-parallel ranks, whose reduce is a real
    all-reduce between threads, gives each rank its rows of the whole batch's whitening."""
    _, mask, _, x = batch()
    full = whiten(x, mask)
    shards = [(x[:1], mask[:1]), (x[1:], mask[1:])]
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def rank(r):
        def all_reduce(t):
            slots[r] = t
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        out[r] = whiten(*shards[r], reduce=all_reduce)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert torch.allclose(torch.cat(out), full, atol=1e-6)


def test_adaptive_kl_coef():
    # KL above target: the coefficient grows, by at most 20% x n_steps / horizon
    assert adaptive_kl_coef(0.1, 0.2, 0.1, 100, 1000) == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    assert adaptive_kl_coef(0.1, 0.11, 0.1, 100, 1000) == pytest.approx(0.1 * (1 + 0.1 * 0.1))
    assert adaptive_kl_coef(0.1, 0.0, 0.1, 100, 1000) == pytest.approx(0.1 * (1 - 0.2 * 0.1))
