"""Outcome-reward advantage estimators over groups of samples of the same prompt.

rewards: (B,) with B = num_prompts * n and the n samples of a prompt contiguous. Each returns
per-sequence advantages (B,), broadcast over the response tokens by the loss.

    group_norm          (r - mean_g) / (std_g + eps)          GRPO (Shao et al. 2024)
    dr_grpo             r - mean_g                            Dr.GRPO (Liu et al. 2025): no std division
    rloo                r - mean of the other n-1 samples     RLOO (Ahmadian et al. 2024)
    reinforce_baseline  (r - mean_g) / (std_batch + eps)      REINFORCE++-baseline (Hu et al. 2025)

std_g is the unbiased standard deviation of the group (torch.std, as GRPO implementations use).
"""

import torch

ADVANTAGE_ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")


def compute_advantages(rewards, n_samples_per_prompt, estimator="group_norm", eps=1e-6):
    """Advantages (B,) from rewards (B,), groups of n_samples_per_prompt contiguous samples."""
    n = n_samples_per_prompt
    if rewards.numel() % n:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {n}")
    grouped = rewards.float().view(-1, n)  # (num_prompts, n)
    mean = grouped.mean(-1, keepdim=True)  # (num_prompts, 1)
    if estimator == "group_norm":
        std = grouped.std(-1, keepdim=True) if n > 1 else torch.zeros_like(mean)
        adv = (grouped - mean) / (std + eps)
    elif estimator == "dr_grpo":
        adv = grouped - mean
    elif estimator == "rloo":
        if n < 2:
            raise ValueError("rloo needs --n_samples_per_prompt >= 2")
        adv = grouped - (grouped.sum(-1, keepdim=True) - grouped) / (n - 1)
    elif estimator == "reinforce_baseline":
        centred = grouped - mean
        adv = centred / (centred.std() + eps) if centred.numel() > 1 else centred
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ADVANTAGE_ESTIMATORS}")
    return adv.view(-1)
