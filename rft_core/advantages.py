"""Advantage estimators: per-sequence (group baselines) and per-token (returns, GAE), whitening, and the
rewards' running normalisation before them (`RunningMoments`, `shape_rewards`).

rewards: (B,), B = num_prompts * n, a prompt's n samples contiguous. `outcome_scores` gives per-sequence
scores (B,): the advantage of a group estimator, the reward a token-level estimator starts from:

    group_norm          (r - mean_g) / (std_g + eps)          GRPO (Shao et al. 2024)
    dr_grpo             r - mean_g                            Dr.GRPO (Liu et al. 2025): no std division
    rloo                r - mean of the other n-1 samples     RLOO (Ahmadian et al. 2024)
    cpgd                (r - mean_g) / (pstd_g + eps)         CPGD (Liu et al. 2025), population std
    reinforce           r                                     REINFORCE++ (Hu et al. 2025)
    reinforce_baseline  r - mean_g                            REINFORCE++-baseline
    gae                 r                                     PPO (Schulman et al. 2017), with a critic
    distill             0                                     on-policy distillation: `distill_advantages`

std_g: unbiased (torch.std, as GRPO implementations use). Equal rewards score exactly 0 (a one-ulp residue of
the mean over a one-ulp std would be large). TOKEN_LEVEL (the last three): the score is the last response
token's reward (`token_rewards`), returns (REINFORCE++) or GAE whitened over the global batch (`whiten`),
skipping environment tokens (action_mask 0): the discount counts actions.
"""

import math
from typing import Callable, Optional

import torch
from torch import Tensor

ADVANTAGE_ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "cpgd", "reinforce", "reinforce_baseline", "gae",
                        "distill")
TOKEN_LEVEL = ("reinforce", "reinforce_baseline", "gae")


def outcome_scores(rewards: Tensor, n_samples_per_prompt: int, estimator: str = "group_norm",
                   eps: float = 1e-6) -> Tensor:
    """Per-sequence scores (B,) from rewards (B,), groups of n_samples_per_prompt contiguous samples."""
    n = n_samples_per_prompt
    if rewards.numel() % n:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {n}")
    grouped = rewards.float().view(-1, n)  # (num_prompts, n)
    mean = grouped.mean(-1, keepdim=True)  # (num_prompts, 1)
    if estimator in ("group_norm", "cpgd"):  # GRPO: the unbiased std (0 for a group of one); CPGD: population
        std = grouped.std(-1, keepdim=True, unbiased=estimator == "group_norm" and n > 1)
        adv = (grouped - mean) / (std + eps)
    elif estimator in ("dr_grpo", "reinforce_baseline"):
        adv = grouped - mean
    elif estimator == "rloo":
        if n < 2:
            raise ValueError("rloo needs --n_samples_per_prompt >= 2")
        adv = grouped - (grouped.sum(-1, keepdim=True) - grouped) / (n - 1)
    elif estimator in ("reinforce", "gae"):
        return grouped.view(-1)  # the reward itself: the advantages come per token
    elif estimator == "distill":
        return torch.zeros_like(grouped).view(-1)  # the teacher's logprobs alone
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ADVANTAGE_ESTIMATORS}")
    # (num_prompts, 1): no sample better than another
    tied = (grouped == grouped[:, :1]).all(-1, keepdim=True)
    return adv.masked_fill(tied, 0.0).view(-1)


def token_rewards(scores: Tensor, action_mask: Tensor, kl: Optional[Tensor] = None,
                  kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards (B, T): -kl_coef * kl_t per response token, the score on the last (InstructGPT's)."""
    mask = action_mask.to(torch.float32)
    rewards = torch.zeros_like(mask)  # (B, T)
    columns = torch.arange(mask.shape[1], device=mask.device)
    last = (mask * columns).argmax(-1)  # (B,): index of the last response token (0 if none)
    rewards.scatter_(1, last.unsqueeze(-1), scores.float().unsqueeze(-1))
    return rewards if kl is None else rewards - kl_coef * kl.float() * mask


def discounted_returns(rewards: Tensor, action_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + gamma * G_{t'} (B, T), t' the next response token in action_mask; 0 off the mask."""
    mask = action_mask.bool()
    returns = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # (B, T)
    running = torch.zeros_like(returns[:, 0])  # (B,)
    for t in reversed(range(mask.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running * mask[:, t]
    return returns


def gae(rewards: Tensor, values: Tensor, action_mask: Tensor, gamma: float = 1.0,
        lambd: float = 0.95) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016): (advantages, returns) (B, T). delta_t = r_t + gamma V_{t'} - V_t, t' the
    next response token (V = 0 past the last); A_t = delta_t + gamma lambd A_{t'}; returns_t = A_t + V_t."""
    mask = action_mask.bool()
    values = values.float() * mask  # (B, T)
    advantages = torch.zeros_like(values)
    running, next_value = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])  # (B,) each
    for t in reversed(range(mask.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(mask[:, t], delta + gamma * lambd * running, running)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        advantages[:, t] = running * mask[:, t]
    return advantages, advantages + values


def whiten(x: Tensor, action_mask: Tensor, reduce: Optional[Callable] = None, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the global batch's response tokens, 0 on padding. reduce: a sum over ranks
    (accelerator.reduce(t, "sum")), None for one process; population statistics: any split gives the same."""
    reduce = reduce or (lambda t: t)
    mask = action_mask.to(torch.float32)
    total = reduce(torch.stack([(x * mask).sum(), mask.sum()]))  # (2,)
    mean = total[0] / total[1].clamp(min=1)
    var = reduce(((x - mean).square() * mask).sum()) / total[1].clamp(min=1)
    return (x - mean) / (var.sqrt() + eps) * mask


def token_level_advantages(scores: Tensor, action_mask: Tensor, kl: Optional[Tensor] = None,
                           kl_coef: float = 0.0, values: Optional[Tensor] = None, gamma: float = 1.0,
                           lambd: float = 0.95, reduce: Optional[Callable] = None) -> tuple[Tensor, Tensor]:
    """(advantages, returns) (B, T): GAE with the critic's values (returns: its targets), else discounted
    returns (REINFORCE++; returns None), over token_rewards; the advantages whitened over the global batch."""
    rewards = token_rewards(scores, action_mask, kl, kl_coef)  # (B, T)
    if values is not None:
        advantages, returns = gae(rewards, values, action_mask, gamma, lambd)
    else:
        advantages, returns = discounted_returns(rewards, action_mask, gamma), None
    return whiten(advantages, action_mask, reduce), returns


def distill_advantages(advantages: Tensor, teacher_logprobs: Tensor, logprobs: Tensor, action_mask: Tensor,
                       coef: float = 1.0) -> Tensor:
    """advantages (B,) or (B, T) plus coef * (teacher_logprobs - logprobs) on each response token (B, T):
    on-policy distillation's per-token reverse KL (GKD, Agarwal et al. 2024), each token its own (discount 0),
    logprobs the sampling policy's. Not whitened: the gap is in nats, alike across batches."""
    mask = action_mask.to(torch.float32)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1) * mask  # (B, T)
    return advantages + coef * (teacher_logprobs.float() - logprobs.float()) * mask


def adaptive_kl_coef(kl_coef: float, current_kl: float, kl_target: float, n_steps: int,
                     kl_horizon: float = 10000) -> float:
    """Adaptive KL (Ziegler et al. 2019): kl_coef towards kl_target by <= +-20% x n_steps / kl_horizon (their
    horizon, in samples)."""
    error = min(max(current_kl / kl_target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / kl_horizon)


class RunningMoments:
    """Mean and std of every reward seen so far, merged batch by batch (Chan et al.'s parallel update)."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values):
        n = len(values)
        mean = sum(values) / n
        m2 = sum((v - mean) ** 2 for v in values)
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self):
        return math.sqrt(self.m2 / self.count) if self.count else 1.0

    def state_dict(self):
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state):
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]


def shape_rewards(rewards: Tensor, moments: Optional["RunningMoments"], clip: Optional[float],
                  gather: Callable) -> Tensor:
    """rewards (B,) normalised by all ranks' running moments (if moments), clipped to +-clip (if clip)."""
    if moments is not None:
        moments.update(gather(rewards).tolist())
        rewards = (rewards - moments.mean) / (moments.std + 1e-8)
    return rewards if clip is None else rewards.clamp(-clip, clip)
