"""Policy losses and KL estimators: pure functions on (B, T) tensors.

Loss aggregation (`loss_agg_mode`), with l_it the per-token loss of sequence i, token t, m_it the
action mask, |o_i| = sum_t m_it the response length, N the number of sequences and L a constant:

    token-mean               sum_it m_it l_it / sum_it m_it                    (DAPO)
    seq-mean-token-sum       (1/N) sum_i sum_t m_it l_it
    seq-mean-token-mean      (1/N) sum_i (sum_t m_it l_it / |o_i|)             (GRPO paper)
    seq-mean-token-sum-norm  (1/N) sum_i sum_t m_it l_it / L                   (Dr.GRPO, L = max length)

`num_tokens` / `num_seqs` are the optimizer step's totals over micro-batches and ranks, so the
per-micro-batch losses *sum* to the full-batch loss, whatever the split (tests/test_losses.py)."""

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
TIS_LEVELS = ("token", "sequence", "geometric")
KL_ESTIMATORS = ("k1", "k2", "k3")
POLICY_LOSS_TYPES = ("ppo", "gspo", "cpg")  # --policy_loss_type: policy_loss's use_gspo, use_cpg_loss


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of x over positions where mask is 1 (all of them if dim is None)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def token_mean(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(sum, count) of x over mask: Means weighs by tokens, so an empty micro-batch or SP slice adds no 0."""
    mask = mask.to(x.dtype)
    return (x * mask).sum(), mask.sum()


def aggregate_loss(loss_mat: Tensor, mask: Tensor, loss_agg_mode: str, num_tokens=None, num_seqs=None,
                   max_len: Optional[int] = None, seq_lens: Optional[Tensor] = None) -> Tensor:
    """(B, T) per-token loss -> scalar, by the module docstring's formulas; defaults: num_tokens / num_seqs
    this batch's, max_len (L) T, seq_lens (B,) |o_i| the mask's (under SP it holds a slice of a row)."""
    mask = mask.to(loss_mat.dtype)
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    num_seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    seq_sums = (loss_mat * mask).sum(-1)  # (B,)
    if loss_agg_mode == "token-mean":
        return seq_sums.sum() / max(float(num_tokens), 1.0)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.sum() / num_seqs
    if loss_agg_mode == "seq-mean-token-mean":
        lens = mask.sum(-1) if seq_lens is None else seq_lens.to(mask.dtype)
        return (seq_sums / lens.clamp(min=1)).sum() / num_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return seq_sums.sum() / (num_seqs * (max_len or loss_mat.shape[-1]))
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {LOSS_AGG_MODES}")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kl_estimator: str = "k3") -> Tensor:
    """Per-token KL(pi || pi_ref) from samples of pi (Schulman, 'Approximating KL'), log r = logprobs -
    ref_logprobs: k1 = log r, k2 = (log r)^2 / 2, k3 = (1/r - 1) + log r (unbiased, non-negative).
    log r is clamped to [-10, 10] as OpenRLHF/verl do, so one wild token cannot overflow exp."""
    log_ratio = (logprobs - ref_logprobs).clamp(-10.0, 10.0)  # (B, T)
    if kl_estimator == "k1":
        return log_ratio
    if kl_estimator == "k2":
        return 0.5 * log_ratio.square()
    if kl_estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"unknown kl_estimator {kl_estimator!r}; choose one of {KL_ESTIMATORS}")


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, action_mask: Tensor,
                eps_clip_low: float = 0.2, loss_agg_mode: str = "token-mean", num_tokens=None, num_seqs=None,
                max_len: Optional[int] = None, eps_clip_high: Optional[float] = None,
                dual_clip: Optional[float] = None, use_gspo: bool = False,
                is_weights: Optional[Tensor] = None, use_cpg_loss: bool = False,
                seq_lens: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """PPO clipped surrogate (Schulman et al. 2017): -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and:
    eps_clip_high  clip-higher (DAPO); default eps_clip_low, the symmetric clip
    dual_clip      dual-clip (Ye et al. 2020): for A < 0 the loss is capped at -dual_clip * A (dual_clip > 1)
    use_gspo       GSPO (Zheng et al. 2025): s_i = exp(mean_t log r_t) for r_t; gradient sg(s_i) grad log pi
    is_weights     detached per-token importance weights (TIS against the rollout engine)
    use_cpg_loss   CPGD (Liu et al. 2025): -A * clip(log r, log(1 - eps_low), log(1 + eps_high)), clipped on
                   the side A pushes only; gradient -A grad log pi inside the range, 0 outside
    logprobs, old_logprobs, action_mask: (B, T); advantages: (B, T) or (B,). Returns (loss, metrics): clip
    fraction and k1 policy-vs-old KL, detached 0-d tensors (no host sync)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)  # (B, T)
    log_ratio = logprobs - old_logprobs  # (B, T), per token (CPGD's and the metrics' even under GSPO)
    ratio = torch.exp(log_ratio)
    if use_gspo:  # value s_i, gradient of log pi
        seq_log_ratio = masked_mean(log_ratio, action_mask, -1)  # (B,): log s_i
        ratio = torch.exp(seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach())
    high = eps_clip_low if eps_clip_high is None else eps_clip_high
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - eps_clip_low, 1.0 + high) * advantages
    loss_mat = -torch.minimum(surr1, surr2)  # (B, T)
    if use_cpg_loss:  # the paper's objective is on the log-ratio: its gradient is log pi's (pi_old: constant)
        clipped = torch.where(advantages > 0, log_ratio.clamp(max=math.log1p(high)),
                              log_ratio.clamp(min=math.log1p(-eps_clip_low)))
        loss_mat = -advantages * clipped  # (B, T)
    if dual_clip is not None:
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, -dual_clip * advantages), loss_mat)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(loss_mat, action_mask, loss_agg_mode, num_tokens, num_seqs, max_len, seq_lens)
    with torch.no_grad():
        metrics = {"clip_frac": token_mean((surr2 < surr1).float(), action_mask),
                   "ppo_kl": token_mean(-log_ratio, action_mask)}
    return loss, metrics


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, action_mask: Tensor,
               value_clip: Optional[float] = None, loss_agg_mode: str = "token-mean", num_tokens=None,
               num_seqs=None, max_len: Optional[int] = None, seq_lens: Optional[Tensor] = None) -> Tensor:
    """PPO critic loss 0.5 (V - R)^2 (B, T) -> scalar; with value_clip c, the pessimistic
    max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), as in OpenAI's PPO2 baselines."""
    loss_mat = (values - returns).square()  # (B, T)
    if value_clip is not None:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        loss_mat = torch.maximum(loss_mat, (clipped - returns).square())
    return 0.5 * aggregate_loss(loss_mat, action_mask, loss_agg_mode, num_tokens, num_seqs, max_len, seq_lens)


def high_entropy_mask(entropy: Tensor, action_mask: Tensor, ratio: float) -> Tensor:
    """Mask (B, T) of the round(ratio * n) highest-entropy response tokens (at least one): the forking tokens
    carry the learning signal ('Beyond the 80/20 rule', Wang et al. 2025)."""
    flat = entropy.detach().float().masked_fill(action_mask == 0, float("-inf")).flatten()  # (B*T,)
    k = max(1, round(ratio * int(action_mask.sum())))
    keep = torch.zeros_like(flat)
    keep[flat.topk(k).indices] = 1.0
    return keep.view_as(entropy) * action_mask


def entropy_from_logits(logits: Tensor, lse: Optional[Tensor] = None) -> Tensor:
    """Entropy of softmax(z) (..., V) -> (...): lse - sum softmax(z) z; lse: logsumexp(logits) if known."""
    logits = logits.float()
    lse = torch.logsumexp(logits, -1) if lse is None else lse
    return lse - (torch.exp(logits - lse.unsqueeze(-1)) * logits).sum(-1)


@dataclass
class LossSettings:
    """What `actor_loss` needs besides the tensors: the loss flags, and the optimizer step's totals."""
    loss_agg_mode: str = "token-mean"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    dual_clip: Optional[float] = None
    use_gspo: bool = False
    use_cpg_loss: bool = False
    tis_cap: Optional[float] = None  # truncated importance sampling against the rollout engine's logprobs
    tis_mode: str = "truncate"  # or "mask": tokens whose weight exceeds the cap get none
    tis_level: str = "token"  # or "sequence" / "geometric": one weight per sample (TIS_LEVELS)
    high_entropy_token_ratio: float = 0.0  # train the policy on this fraction of tokens (0: all)
    entropy_coef: float = 0.0
    policy_drift_coef: float = 0.0  # CPGD's KL(pi_old || pi) weight
    use_kl_loss: bool = False
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    max_len: Optional[int] = None  # Dr.GRPO's constant L
    num_seqs: Optional[int] = None  # sequences in the optimizer step, over all ranks
    num_tokens: Optional[torch.Tensor] = None  # response tokens in the optimizer step, over all ranks
    num_pg_tokens: Optional[torch.Tensor] = None  # those the policy loss keeps (high_entropy_token_ratio)
    micro_batches_per_step: int = 1  # over all ranks: the logged loss is this micro-batch's share times this
    sample_sum: Optional[Callable] = None  # SP / CP: sums (B, k) per-row values over a row's slices


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, level: str = "token",
                sample_sum: Optional[Callable] = None) -> Tensor:
    """pi_old / pi_rollout (B, T), uncapped, log clamped at 20: per token; sequence: the sample's product
    (fixes prefixes older policies chose); geometric: its geometric mean (verl's); sample_sum: SP sums."""
    log_ratio = torch.where(mask.bool(), old_logprobs - rollout_logprobs, 0.0)  # (B, T)
    if level != "token":
        per_sample = torch.stack([log_ratio.sum(-1), mask.sum(-1).to(log_ratio.dtype)], -1)  # (B, 2)
        if sample_sum is not None:
            per_sample = sample_sum(per_sample)  # the whole responses' sums and lengths
        log_weight = per_sample[:, :1]  # (B, 1)
        if level == "geometric":
            log_weight = log_weight / per_sample[:, 1:].clamp(min=1)
        log_ratio = log_weight.expand_as(log_ratio)
    return log_ratio.clamp(max=20.0).exp()


def policy_token_counts(action_masks: list[Tensor], ratio: float = 0.0) -> tuple[float, float]:
    """(response tokens, those high_entropy_mask keeps: round(ratio * n) per micro-batch, at least one)."""
    counts = [int(mask.sum()) for mask in action_masks]
    kept = [max(1, round(ratio * n)) for n in counts] if ratio else counts
    return float(sum(counts)), float(sum(kept))


def actor_loss(logprobs: Tensor, entropy: Optional[Tensor], mb, s: LossSettings) -> tuple[Tensor, dict]:
    """One micro-batch's loss, normalised by the step's totals (LossSettings), and detached 0-d metrics;
    logprobs, entropy: (B, T) (entropy with a gradient if s.entropy_coef); mb.old_logprobs None: pi_old =
    logprobs. loss = policy loss (PPO clip or variant, high-entropy tokens if asked, TIS-weighted) -
    entropy_coef * entropy + policy_drift_coef * KL(pi_old || pi) (CPGD) + kl_coef * KL(pi || ref) (GRPO)."""
    old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()  # (B, T)
    mask = mb.action_mask
    agg = dict(num_tokens=s.num_tokens, num_seqs=s.num_seqs, max_len=s.max_len, seq_lens=mb.response_lens)
    # TIS: the engine samples with other numerics (and, partial rollout, older weights): weight by pi_old /
    # pi_rollout (AReaL's decoupled PPO: pi_old is the proximal policy), truncated or masked above the cap
    is_weights = None
    if s.tis_cap:
        raw = tis_weights(old, mb.rollout_logprobs, mask, s.tis_level, s.sample_sum)  # (B, T)
        over = raw > s.tis_cap
        is_weights = raw.clamp(max=s.tis_cap) if s.tis_mode == "truncate" else raw * ~over
    ratio = s.high_entropy_token_ratio
    pg_mask = high_entropy_mask(entropy, mask, ratio) if ratio else mask  # (B, T)
    pg_loss, metrics = policy_loss(logprobs, old, mb.advantages, pg_mask, s.eps_clip_low, s.loss_agg_mode,
                                   s.num_pg_tokens, s.num_seqs, s.max_len, eps_clip_high=s.eps_clip_high,
                                   dual_clip=s.dual_clip, use_gspo=s.use_gspo, is_weights=is_weights,
                                   use_cpg_loss=s.use_cpg_loss, seq_lens=mb.response_lens)
    loss = pg_loss
    if s.entropy_coef:
        loss = loss - s.entropy_coef * aggregate_loss(entropy, mask, s.loss_agg_mode, **agg)
    if s.policy_drift_coef:  # CPGD policy drift: KL(pi_old || pi) = E_old[r - 1 - log r], r = pi / pi_old
        drift = kl_estimate(old, logprobs, "k3")  # (B, T)
        loss = loss + s.policy_drift_coef * aggregate_loss(drift, mask, s.loss_agg_mode, **agg)
    if s.use_kl_loss:
        kl = kl_estimate(logprobs, mb.ref_logprobs, s.kl_estimator)  # (B, T)
        loss = loss + s.kl_coef * aggregate_loss(kl, mask, s.loss_agg_mode, **agg)
        metrics["kl"] = token_mean(kl.detach(), mask)
    # the mean of these over micro-batches and ranks is the step's policy loss
    metrics["policy_loss"] = pg_loss.detach() * s.micro_batches_per_step
    metrics["entropy"] = token_mean(entropy.detach(), mask)
    if ratio:
        metrics["pg_token_frac"] = token_mean(pg_mask.float(), mask)
    if s.tis_cap:
        metrics["is_weight_mean"] = token_mean(raw, mask)
        metrics["is_weight_max"] = ((raw * mask).max(), mask.any().float())  # Means skips it where no token
        metrics["is_capped_frac"] = token_mean(over.float(), mask)
    return loss, {**metrics, **engine_gap_metrics(mb, old, s.sample_sum)}


def engine_gap_metrics(mb, old: Tensor, sample_sum=None) -> dict:
    """Engine vs trainer logprobs where the engine gave them: Means' (sum, weight) and (max, has) pairs."""
    known = mb.rollout_known()  # (B, T)
    gap = torch.where(known, mb.rollout_logprobs - old, 0.0)  # (B, T)
    # per response, |log pi_rollout(y) - log pi_old(y)|: the log of --tis_level sequence's weight
    sums = torch.stack([gap.sum(-1), known.sum(-1).to(gap.dtype)], -1)  # (B, 2)
    sums = sample_sum(sums) if sample_sum is not None else sums
    rows = sums[:, 1] > 0  # (B,): the engine returns a row's logprobs whole or not at all
    return {"logprob_diff_mean": (gap.abs().sum(), known.sum()),
            "logprob_diff_max": (gap.abs().max(), known.any().float()),
            "logprob_diff_seq_mean": ((sums[:, 0].abs() * rows).sum(), rows.sum())}
