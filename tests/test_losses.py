"""Losses and KL estimators against naive loop-by-loop references on hand-sized tensors."""

import dataclasses
import math

import pytest
import torch

from rft_core.experience import Experience
from rft_core.losses import (
    LOSS_AGG_MODES,
    LossSettings,
    actor_loss,
    aggregate_loss,
    entropy_from_logits,
    high_entropy_mask,
    kl_estimate,
    masked_mean,
    policy_loss,
    policy_token_counts,
    value_loss,
)

# 3 sequences of lengths 4, 2, 3 (padded to 4)
LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 9.0, 9.0], [-1.0, 0.5, 2.5, 7.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])


def ratio(pair):
    """A token-weighted metric's value: its (sum, count) pair divided."""
    return (pair[0] / pair[1]).item()


def naive_aggregate(loss, mask, mode, max_len):
    seqs = []
    for i in range(len(loss)):
        tokens = [loss[i][t] for t in range(len(loss[i])) if mask[i][t]]
        seqs.append(tokens)
    if mode == "token-mean":
        return sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    if mode == "seq-mean-token-sum":
        return sum(sum(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(s) for s in seqs) / (len(seqs) * max_len)


def test_known_values():
    # token-mean: (10 + 11 + 2) / 9; seq-mean-token-mean: (10/4 + 11/2 + 2/3) / 3
    assert aggregate_loss(LOSS, MASK, "token-mean").item() == pytest.approx(23 / 9)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx(23 / 3)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((2.5 + 5.5 + 2 / 3) / 3)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx(23 / 24)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_matches_naive(mode):
    torch.manual_seed(0)
    loss = torch.randn(5, 7)
    mask = (torch.rand(5, 7) > 0.3).long()
    mask[:, 0] = 1
    expected = naive_aggregate(loss.tolist(), mask.tolist(), mode, max_len=10)
    assert aggregate_loss(loss, mask, mode, max_len=10).item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("splits", [[8], [4, 4], [1, 3, 2, 2], [1] * 8])
def test_split_invariance(mode, splits):
    """Micro-batches / ranks normalised by the step's totals sum to the full-batch loss and gradient."""
    torch.manual_seed(1)
    logprobs = torch.randn(8, 6, requires_grad=True)
    old = logprobs.detach() + 0.1 * torch.randn(8, 6)
    adv = torch.randn(8)
    mask = (torch.rand(8, 6) > 0.25).long()
    mask[:, 0] = 1
    full, _ = policy_loss(logprobs, old, adv, mask, 0.2, mode, max_len=6)
    (full_grad,) = torch.autograd.grad(full, logprobs)

    totals = dict(num_tokens=mask.sum(), num_seqs=8, max_len=6)
    pieces, lo = [], 0
    for n in splits:
        piece, _ = policy_loss(logprobs[lo:lo + n], old[lo:lo + n], adv[lo:lo + n], mask[lo:lo + n], 0.2,
                               mode, **totals)
        pieces.append(piece)
        lo += n
    total = sum(pieces)
    (split_grad,) = torch.autograd.grad(total, logprobs)
    assert total.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(split_grad, full_grad, atol=1e-6)


def test_policy_loss_matches_naive():
    torch.manual_seed(2)
    logprobs, old = torch.randn(3, 5), torch.randn(3, 5)
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    eps = 0.2
    per_token, clipped = [], 0
    for i in range(3):
        for t in range(5):
            if not mask[i][t]:
                continue
            r = math.exp(logprobs[i][t] - old[i][t])
            a = adv[i].item()
            unclipped, clip = r * a, min(max(r, 1 - eps), 1 + eps) * a
            per_token.append(-min(unclipped, clip))
            clipped += clip < unclipped
    loss, metrics = policy_loss(logprobs, old, adv, mask, eps, "token-mean")
    assert loss.item() == pytest.approx(sum(per_token) / len(per_token), rel=1e-5)
    total, count = metrics["clip_frac"]  # (sum, tokens): Means weighs it by its tokens
    assert total.item() / count.item() == pytest.approx(clipped / len(per_token))


def test_policy_loss_on_policy_gradient_is_reinforce():
    """At ratio 1 the clipped loss's gradient is -A / num_tokens per token (the REINFORCE gradient)."""
    logprobs = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.ones(2, 3)
    loss, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, 0.2, "token-mean")
    loss.backward()
    assert torch.allclose(logprobs.grad, -adv.unsqueeze(-1).expand(2, 3) / 6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators(estimator):
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    ref = torch.tensor([[-1.5, -1.0], [-0.5, -4.0]])
    out = kl_estimate(logprobs, ref, estimator)
    for i in range(2):
        for t in range(2):
            log_r = logprobs[i][t].item() - ref[i][t].item()
            expected = {"k1": log_r, "k2": 0.5 * log_r ** 2, "k3": math.exp(-log_r) - 1 + log_r}[estimator]
            assert out[i][t].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_kl_k3_unbiased_and_nonnegative():
    """E_pi[k3] = KL(pi || ref) on an explicit 3-way categorical, estimated by exact expectation."""
    pi = torch.tensor([0.5, 0.3, 0.2])
    ref = torch.tensor([0.2, 0.5, 0.3])
    k3 = kl_estimate(pi.log(), ref.log(), "k3")
    assert (k3 >= 0).all()
    assert (pi * k3).sum().item() == pytest.approx((pi * (pi / ref).log()).sum().item(), rel=1e-5)
    k1 = kl_estimate(pi.log(), ref.log(), "k1")
    assert (pi * k1).sum().item() == pytest.approx((pi * (pi / ref).log()).sum().item(), rel=1e-5)


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(LOSS, LOSS, "k4")


def test_masked_mean_and_entropy():
    assert masked_mean(LOSS, MASK).item() == pytest.approx(23 / 9)
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    expected = [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    assert entropy_from_logits(logits).tolist() == pytest.approx(expected, rel=1e-5)
    assert (entropy_from_logits(logits, torch.logsumexp(logits, -1)).tolist()
            == pytest.approx(expected, rel=1e-5))


def naive_token_losses(logprobs, old, adv, mask, lo, hi, dual=None):
    out = []
    for i in range(len(logprobs)):
        for t in range(len(logprobs[i])):
            if not mask[i][t]:
                continue
            r, a = math.exp(logprobs[i][t] - old[i][t]), adv[i]
            loss = max(-r * a, -min(max(r, 1 - lo), 1 + hi) * a)
            if dual is not None and a < 0:
                loss = min(loss, -dual * a)
            out.append(loss)
    return out


@pytest.mark.parametrize("lo, hi, dual", [(0.2, 0.28, None), (0.1, 0.1, 3.0), (0.2, 0.28, 1.5)])
def test_clip_higher_and_dual_clip_match_naive(lo, hi, dual):
    torch.manual_seed(3)
    logprobs, old = torch.randn(4, 5), torch.randn(4, 5)  # ratios far from 1: every branch is hit
    adv = torch.tensor([1.5, -2.0, 0.3, -0.7])
    mask = torch.ones(4, 5)
    expected = naive_token_losses(logprobs.tolist(), old.tolist(), adv.tolist(), mask.tolist(), lo, hi, dual)
    loss, _ = policy_loss(logprobs, old, adv, mask, lo, "token-mean", eps_clip_high=hi, dual_clip=dual)
    assert loss.item() == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_gspo_value_and_gradient():
    """GSPO: loss -min(s_i A_i, clip(s_i) A_i) per sequence with s_i = exp(mean_t log r_t); gradient of
    each token = -A_i s_i * grad log pi_t / |o_i| (unclipped), 0 (clipped), under seq-mean-token-mean."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.05, -0.6], [-0.3, -0.9, 0.0]])
    adv = torch.tensor([1.0, 2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    eps = 0.2
    loss, _ = policy_loss(logprobs, old, adv, mask, eps, "seq-mean-token-mean", use_gspo=True)
    loss.backward()
    expected_loss, expected_grad = 0.0, torch.zeros(2, 3)
    for i in range(2):
        n = int(mask[i].sum())
        s = math.exp(sum(logprobs[i, t].item() - old[i, t].item() for t in range(n)) / n)
        a = adv[i].item()
        clipped = min(max(s, 1 - eps), 1 + eps)
        expected_loss += max(-s * a, -clipped * a) / 2
        if -s * a >= -clipped * a:  # the unclipped branch is active, so the gradient flows
            expected_grad[i, :n] = -a * s / n / 2  # s_i-weighted, over |o_i| tokens and 2 sequences
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert torch.allclose(logprobs.grad, expected_grad, atol=1e-6)


def test_importance_weights_scale_token_losses():
    logprobs, old = torch.zeros(1, 3), torch.zeros(1, 3)
    adv, mask = torch.tensor([1.0]), torch.ones(1, 3)
    weights = torch.tensor([[0.5, 1.0, 2.0]])
    loss, _ = policy_loss(logprobs, old, adv, mask, 0.2, "seq-mean-token-sum", is_weights=weights)
    assert loss.item() == pytest.approx(-(0.5 + 1.0 + 2.0))


def test_cpg_loss_value_and_gradient():
    """CPGD: per token -A * log(pi / pi_old), the log-ratio clipped to [log(1-eps), log(1+eps_high)] on the
    side A pushes it (up for A > 0, down for A < 0): the paper's objective, whose value has no -A log pi_old
    term; gradient -A / n inside the range, 0 where clipped."""
    lo, hi = 0.2, 0.28
    logprobs = torch.tensor([[-1.0, -0.5, -2.0], [-1.0, -3.0, -0.1]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.0, -2.0], [-0.9, -2.0, -0.1]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, _ = policy_loss(logprobs, old, adv, mask, lo, "token-mean", eps_clip_high=hi, use_cpg_loss=True)
    loss.backward()
    n, expected, grad = int(mask.sum()), 0.0, torch.zeros(2, 3)
    for i in range(2):
        for t in range(3):
            if not mask[i, t]:
                continue
            lp, o, a = logprobs[i, t].item(), old[i, t].item(), adv[i, t].item()
            if a > 0:
                clipped, active = min(lp - o, math.log(1 + hi)), lp - o < math.log(1 + hi)
            else:
                clipped, active = max(lp - o, math.log(1 - lo)), lp - o > math.log(1 - lo)
            expected += -a * clipped / n
            grad[i, t] = -a / n if active else 0.0
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert torch.allclose(logprobs.grad, grad)
    assert (grad == 0).sum() >= 2  # the example does clip on both sides


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_naive(clip):
    torch.manual_seed(5)
    values, old, returns = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    total, n = 0.0, int(MASK.sum())
    for i in range(3):
        for t in range(4):
            if MASK[i, t]:
                v, vo, r = values[i, t].item(), old[i, t].item(), returns[i, t].item()
                err = (v - r) ** 2
                if clip is not None:
                    err = max(err, (vo + min(max(v - vo, -clip), clip) - r) ** 2)
                total += 0.5 * err / n
    assert value_loss(values, old, returns, MASK, clip).item() == pytest.approx(total, rel=1e-5)


def test_value_loss_split_invariance():
    """Micro-batch value losses with the step's token total sum to the whole batch's loss."""
    torch.manual_seed(6)
    values, old, returns = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    whole = value_loss(values, old, returns, MASK, 0.2)
    parts = sum(value_loss(values[i:i + 1], old[i:i + 1], returns[i:i + 1], MASK[i:i + 1], 0.2,
                           num_tokens=MASK.sum())
                for i in range(3))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_high_entropy_mask():
    entropy = torch.tensor([[0.1, 5.0, 0.3, 9.0], [2.0, 0.2, 7.0, 8.0], [1.0, 4.0, 3.0, 6.0]])
    keep = high_entropy_mask(entropy, MASK, 0.4)  # 9 response tokens -> round(3.6) = 4 kept
    flat = sorted(((entropy[i, t].item(), (i, t)) for i in range(3) for t in range(4) if MASK[i, t]),
                  reverse=True)
    want = torch.zeros(3, 4)
    for _, (i, t) in flat[:4]:
        want[i, t] = 1
    assert torch.equal(keep, want.to(keep.dtype))  # padding (8.0 at [1, 3]) is never picked
    assert high_entropy_mask(entropy, MASK, 0.0).sum() == 1  # at least one token
    assert torch.equal(high_entropy_mask(entropy, MASK, 1.0), MASK.to(keep.dtype))


def test_policy_drift_is_reverse_k3():
    """CPGD's drift KL(pi_old || pi) from samples of pi_old: r - 1 - log r with r = pi / pi_old."""
    lp, old = torch.tensor([[-1.0, -0.2]]), torch.tensor([[-1.5, -0.2]])
    r = torch.exp(lp - old)
    assert torch.allclose(kl_estimate(old, lp, "k3"), r - 1 - torch.log(r))


def _micro_batch(seed, rows=6, width=5):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, width, generator=g) > 0.3).long()
    mask[:, 0] = 1
    old = -torch.rand(rows, width, generator=g) * mask
    return Experience(input_ids=torch.zeros(rows, 2 + width, dtype=torch.long),
                      attention_mask=torch.ones(rows, 2 + width, dtype=torch.long), action_mask=mask,
                      rollout_logprobs=old + 0.01 * torch.randn(rows, width, generator=g) * mask,
                      old_logprobs=old, ref_logprobs=old - 0.2 * torch.rand(rows, width, generator=g),
                      advantages=torch.randn(rows, generator=g))


def test_actor_loss_matches_its_parts():
    """actor_loss = policy loss (on the high-entropy tokens, TIS-weighted) - entropy bonus + CPGD drift + KL
    loss, each term checked against the pure functions it is built from."""
    mb = _micro_batch(0)
    logprobs = (mb.old_logprobs
                + 0.1 * torch.randn(6, 5, generator=torch.Generator().manual_seed(1))).requires_grad_()
    entropy = torch.rand(6, 5, generator=torch.Generator().manual_seed(2)).requires_grad_()
    n = float(mb.action_mask.sum())
    s = LossSettings("token-mean", 0.2, 0.28, dual_clip=3.0, tis_cap=2.0, high_entropy_token_ratio=0.5,
                     entropy_coef=0.01, policy_drift_coef=0.1, use_kl_loss=True, kl_coef=0.05,
                     kl_estimator="k2", num_tokens=torch.tensor(n),
                     num_pg_tokens=torch.tensor(float(round(0.5 * n))), num_seqs=6)
    loss, metrics = actor_loss(logprobs, entropy, mb, s)
    keep = high_entropy_mask(entropy, mb.action_mask, 0.5)
    weights = (mb.old_logprobs - mb.rollout_logprobs).exp().clamp(max=2.0)
    pg, _ = policy_loss(logprobs, mb.old_logprobs, mb.advantages, keep, 0.2, "token-mean", round(0.5 * n),
                        eps_clip_high=0.28, dual_clip=3.0, is_weights=weights)
    mask = mb.action_mask.float()
    want = (pg - 0.01 * (entropy * mask).sum() / n
            + 0.1 * (kl_estimate(mb.old_logprobs, logprobs, "k3") * mask).sum() / n
            + 0.05 * (kl_estimate(logprobs, mb.ref_logprobs, "k2") * mask).sum() / n)
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    (got_grad,) = torch.autograd.grad(loss, logprobs)
    (want_grad,) = torch.autograd.grad(want, logprobs)
    assert torch.allclose(got_grad, want_grad, atol=1e-7)
    assert ratio(metrics["pg_token_frac"]) == pytest.approx(round(0.5 * n) / n)
    # the high-entropy mask: tokens it drops get no policy-gradient (only the drift and KL terms move them)
    s_pg = LossSettings("token-mean", 0.2, 0.2, high_entropy_token_ratio=0.5, num_tokens=torch.tensor(n),
                        num_pg_tokens=torch.tensor(float(round(0.5 * n))))
    pg_only, _ = actor_loss(logprobs, entropy, mb, s_pg)
    (grad,) = torch.autograd.grad(pg_only, logprobs)
    assert (grad[(keep == 0) & (mb.action_mask == 1)] == 0).all() and (grad[keep == 1] != 0).any()


def test_actor_loss_logged_policy_loss_is_the_steps():
    """Split over 2 ranks x 2 micro-batches with the step's totals, the mean of the logged policy_loss over
    micro-batches and then over ranks (what the script logs) is the whole batch's loss, and the losses summed
    give its gradient."""
    mb = _micro_batch(3, rows=8)
    logprobs = (mb.old_logprobs + 0.05).requires_grad_()
    entropy = torch.rand(8, 5)
    counts = policy_token_counts([mb.action_mask])
    whole = LossSettings(num_tokens=torch.tensor(counts[0]), num_pg_tokens=torch.tensor(counts[1]),
                         num_seqs=8)
    full, _ = actor_loss(logprobs, entropy, mb, whole)
    split = LossSettings(num_tokens=torch.tensor(counts[0]), num_pg_tokens=torch.tensor(counts[1]),
                         num_seqs=8, micro_batches_per_step=4)
    per_rank, total = [], 0.0
    for rank in range(2):
        logged = []
        for i in (rank * 4, rank * 4 + 2):
            piece = mb.select(range(i, i + 2))
            loss, metrics = actor_loss(logprobs[i:i + 2], entropy[i:i + 2], piece, split)
            logged.append(metrics["policy_loss"])
            total = total + loss
        per_rank.append(sum(logged) / len(logged))
    assert (sum(per_rank) / 2).item() == pytest.approx(full.item(), rel=1e-6)
    assert total.item() == pytest.approx(full.item(), rel=1e-6)


def test_policy_token_counts():
    masks = [torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]), torch.tensor([[1, 1, 1, 1]])]
    assert policy_token_counts(masks) == (8.0, 8.0)
    assert policy_token_counts(masks, 0.2) == (8.0, 2.0)  # round(0.8) = 1 and round(0.8) = 1


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_behaviour_weights_truncated_or_masked(level, mode):
    """Off-policy tokens (partial rollout: sampled by older weights) are weighted by pi_old / pi_behaviour:
    truncated at the cap, or masked above it; the weights' mean, max and capped fraction are logged. Per token
    (--tis_level token), or one weight for every token of a sample: the product of its response tokens'
    ratios (sequence) or their geometric mean, padding left out; checked against a loop over the tokens."""
    mb = _micro_batch(7)
    # log ratios: a spread within each sample around its own level (some samples' geometric mean over the cap)
    level_of = torch.tensor([[-0.5], [1.0], [0.0], [0.3], [1.2], [-1.0]])
    shift = level_of + 3.0 * torch.rand(6, 5, generator=torch.Generator().manual_seed(8)) - 1.5
    # padding holds a wild value that must not enter any weight
    mb.rollout_logprobs = torch.where(mb.action_mask.bool(), mb.old_logprobs - shift, 5.0)
    logprobs = mb.old_logprobs.clone().requires_grad_()
    n = float(mb.action_mask.sum())
    s = LossSettings(tis_cap=2.0, tis_mode=mode, tis_level=level, num_tokens=torch.tensor(n),
                     num_pg_tokens=torch.tensor(n), num_seqs=6)
    loss, metrics = actor_loss(logprobs, torch.zeros(6, 5), mb, s)
    raw = torch.ones(6, 5)
    for i in range(6):
        logs = [float(mb.old_logprobs[i, t] - mb.rollout_logprobs[i, t]) if mb.action_mask[i, t] else None
                for t in range(5)]
        kept = [x for x in logs if x is not None]
        for t, x in enumerate(logs):
            raw[i, t] = math.exp({"token": x if x is not None else 0.0, "sequence": sum(kept),
                                  "geometric": sum(kept) / len(kept)}[level])
    weights = raw.clamp(max=2.0) if mode == "truncate" else raw * (raw <= 2.0)
    want, _ = policy_loss(logprobs, mb.old_logprobs, mb.advantages, mb.action_mask, 0.2, "token-mean", n,
                          is_weights=weights)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    mask = mb.action_mask.bool()
    assert ratio(metrics["is_weight_mean"]) == pytest.approx(raw[mask].mean().item(), rel=1e-5)
    assert ratio(metrics["is_weight_max"]) == pytest.approx(raw[mask].max().item(), rel=1e-5)
    assert ratio(metrics["is_capped_frac"]) == pytest.approx((raw[mask] > 2.0).float().mean().item())
    assert 0 < ratio(metrics["is_capped_frac"]) < 1
    if level != "token":  # not the per-token weights
        token_loss = actor_loss(logprobs, torch.zeros(6, 5), mb, dataclasses.replace(s, tis_level="token"))[0]
        assert token_loss.item() != pytest.approx(loss.item(), rel=1e-3)


def test_both_scripts_pass_the_tis_flags_to_the_loss():
    import train_ppo
    import train_ppo_vl
    from rft_core.plan import importance_weights, loss_settings

    for module in (train_ppo, train_ppo_vl):
        args = module.Args(tis_cap=3.0, tis_mode="mask", tis_level="sequence")
        s = loss_settings(args, 8, *importance_weights(args))
        assert (s.tis_cap, s.tis_mode, s.tis_level) == (3.0, "mask", "sequence")
        # the defaults: no weights; under partial rollout sample-level ones capped at 2, unless asked
        for flags, want in (({}, (None, "token")), (dict(partial_rollout=True), (2.0, "sequence")),
                            (dict(partial_rollout=True, tis_level="token"), (2.0, "token")),
                            (dict(tis_cap=2.0), (2.0, "token"))):
            args = module.Args(**flags)
            s = loss_settings(args, 8, *importance_weights(args))
            assert (s.tis_cap, s.tis_level) == want, flags


def test_the_engine_trainer_gap_is_a_token_mean_over_the_rows_with_engine_logprobs():
    """Rows whose engine logprobs were not asked for (NaN) leave the logprob_diff metrics, the loss finite;
    over micro-batches the mean is weighted by their known tokens (the per-sample gap's by their samples), the
    max is the largest micro-batch's; a micro-batch with none adds nothing."""
    from rft_core.runs.metrics import Means

    mbs = [_micro_batch(seed) for seed in (3, 4, 5)]
    mbs[0].rollout_logprobs[[1, 4]] = math.nan
    mbs[1].rollout_logprobs[:] = math.nan  # a micro-batch without any
    n = sum(float(mb.action_mask.sum()) for mb in mbs)
    s = LossSettings(num_tokens=torch.tensor(n), num_pg_tokens=torch.tensor(n), num_seqs=18)
    stats, gaps, maxima, sample_gaps = Means(), [], [], []
    for mb in mbs:
        logprobs = mb.old_logprobs.clone().requires_grad_()
        loss, m = actor_loss(logprobs, torch.zeros_like(logprobs), mb, s)
        assert torch.isfinite(loss)
        stats.add(m)
        known = mb.action_mask.bool() & ~mb.rollout_logprobs.isnan()
        gaps += (mb.rollout_logprobs - mb.old_logprobs).abs()[known].tolist()
        maxima += [max((mb.rollout_logprobs - mb.old_logprobs).abs()[known].tolist())] if known.any() else []
        for i in range(len(mb)):  # a sample's gap: the sum over its tokens, then its size
            if known[i].any():
                sample_gaps.append(abs(sum((mb.rollout_logprobs[i] - mb.old_logprobs[i])[known[i]].tolist())))
    result = stats.result()
    assert result["logprob_diff_mean"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-5)
    assert result["logprob_diff_max"] == pytest.approx(max(maxima), rel=1e-5)  # the step's, not a mean
    assert len(sample_gaps) == 10  # 18 rows, 6 + 2 without engine logprobs
    assert result["logprob_diff_seq_mean"] == pytest.approx(sum(sample_gaps) / len(sample_gaps), rel=1e-5)
    stats = Means()
    stats.add(actor_loss(mbs[1].old_logprobs.clone(), torch.zeros(6, 5), mbs[1], s)[1])
    assert "logprob_diff_mean" not in stats.result() and "policy_loss" in stats.result()


def test_token_metrics_add_nothing_for_a_micro_batch_without_tokens():
    """Under sequence parallelism a rank's slice may hold none of a micro-batch's response tokens: its
    token-weighted metrics (entropy, clip fraction, the weights' mean, max and capped fraction) add nothing to
    the step's means, where a mean over no tokens used to add a 0."""
    from rft_core.runs.metrics import Means

    full, empty = _micro_batch(3), _micro_batch(4)
    empty.action_mask = torch.zeros_like(empty.action_mask)
    s = LossSettings(tis_cap=2.0, num_tokens=torch.tensor(float(full.action_mask.sum())),
                     num_pg_tokens=torch.tensor(float(full.action_mask.sum())), num_seqs=6)
    entropy = torch.rand(6, 5, generator=torch.Generator().manual_seed(9))
    stats, alone = Means(), Means()
    for mb in (full, empty):
        stats.add(actor_loss(mb.old_logprobs.clone(), entropy, mb, s)[1])
    alone.add(actor_loss(full.old_logprobs.clone(), entropy, full, s)[1])
    for key in ("entropy", "clip_frac", "ppo_kl", "is_weight_mean", "is_weight_max", "is_capped_frac"):
        assert stats.result()[key] == pytest.approx(alone.result()[key]), key
    assert stats.result()["entropy"] == pytest.approx(entropy[full.action_mask.bool()].mean().item())


def test_maxima_merge_by_max_over_micro_batches_and_ranks(monkeypatch):
    """A metric named *_max is the largest value over the micro-batches that hold it (weight not 0; a
    negative maximum too) and over the ranks; means stay means and counts sums."""
    import accelerate.utils

    from rft_core.runs.metrics import Means, gather_metrics

    stats = Means()
    stats.add({"is_weight_max": (torch.tensor(1.5), torch.tensor(1.0)), "entropy": torch.tensor(1.0),
               "gap_max": (torch.tensor(-3.0), 1)})
    stats.add({"is_weight_max": (torch.tensor(0.0), torch.tensor(0.0)), "entropy": torch.tensor(3.0),
               "gap_max": (torch.tensor(-2.0), 1)})  # a micro-batch without tokens: no maximum
    stats.add({"is_weight_max": (torch.tensor(2.5), torch.tensor(1.0)), "gap_max": (torch.tensor(-9.0), 1)})
    assert stats.result() == {"is_weight_max": 2.5, "entropy": 2.0, "gap_max": -2.0}
    empty = Means()
    empty.add({"is_weight_max": (torch.tensor(0.0), torch.tensor(0.0))})
    assert empty.result() == {}
    ranks = [{"train/is_weight_max": 2.5, "train/entropy": 2.0, "rollout/buffered": 3},
             {"train/is_weight_max": 4.0, "train/entropy": 1.0, "rollout/buffered": 5}]
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda local: ranks)
    merged = gather_metrics(ranks[0])
    assert merged == {"train/is_weight_max": 4.0, "train/entropy": 1.5, "rollout/buffered": 8}
