"""The experience batch: rollouts as padded tensors, their logprobs, and micro-batches of it.

Layout of one row: [pad ... prompt | response ... pad], prompts left-padded to P and responses
right-padded to R, so the response always occupies the last R columns.
"""

from dataclasses import dataclass, fields, replace

import torch

from rft_core.models import response_logprobs, response_values
from rft_core.vision import mm_inputs


@dataclass
class Experience:
    input_ids: torch.Tensor  # (B, P + R)
    attention_mask: torch.Tensor  # (B, P + R)
    action_mask: torch.Tensor  # (B, R): 1 on response tokens
    rollout_logprobs: torch.Tensor  # (B, R): the engine's sampling logprobs
    old_logprobs: torch.Tensor = None  # (B, R): trainer logprobs before the update
    ref_logprobs: torch.Tensor = None  # (B, R): frozen reference model
    values: torch.Tensor = None  # (B, R): the critic's V(s_t) before the update (gae)
    returns: torch.Tensor = None  # (B, R): the critic's regression targets (gae)
    rewards: torch.Tensor = None  # (B,)
    mm: list = None  # per row, for vision-language models: {"pixel_values", "image_grid_thw", "image_token_id"} or None
    advantages: torch.Tensor = None  # (B,) per sequence, broadcast over tokens by the loss, or (B, R) per token

    def __len__(self):
        return self.input_ids.shape[0]

    def select(self, idx):
        """The rows idx (a list or 1-D tensor of indices), untrimmed."""
        idx = torch.as_tensor(idx, device=self.input_ids.device)
        picked = {f.name: getattr(self, f.name)[idx] for f in fields(self) if torch.is_tensor(getattr(self, f.name))}
        if self.mm is not None:
            picked["mm"] = [self.mm[i] for i in idx.tolist()]
        return replace(self, **picked)

    def mm_inputs(self):
        """The model's image inputs for these rows (None for a text-only batch)."""
        return mm_inputs(self.mm, self.input_ids)

    def split(self, micro_batch_size):
        """Micro-batches in order, each trimmed to its own longest prompt and response."""
        return [self.select(range(i, min(i + micro_batch_size, len(self))))._trim() for i in range(0, len(self), micro_batch_size)]

    def _trim(self):
        """Drop the padding columns that no row of this batch uses."""
        num_actions = self.action_mask.shape[1]
        keep_r = int(self.action_mask.sum(-1).max().clamp(min=1))  # longest response here
        used = self.attention_mask[:, :-num_actions].any(0).nonzero()
        start = int(used[0]) if len(used) else 0  # first prompt column any row uses
        end = self.input_ids.shape[1] - num_actions + keep_r
        trimmed = {"input_ids": self.input_ids[:, start:end], "attention_mask": self.attention_mask[:, start:end]}
        for key in ("action_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs", "values", "returns", "advantages"):
            if getattr(self, key) is not None and getattr(self, key).dim() == 2:
                trimmed[key] = getattr(self, key)[:, :keep_r]
        return replace(self, **trimmed)


def build_experience(prompt_ids, generations, pad_token_id, device="cpu", mm=None):
    """Pad prompts (left) and generations (right) into an Experience; one generation per prompt.
    mm: per-prompt image inputs of a vision-language model (see Experience.mm)."""
    if len(prompt_ids) != len(generations):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(generations)} generations")
    P = max(len(p) for p in prompt_ids)
    R = max(1, max(len(g.token_ids) for g in generations))
    B = len(prompt_ids)
    input_ids = torch.full((B, P + R), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)
    action_mask = torch.zeros((B, R), dtype=torch.long)
    rollout_logprobs = torch.zeros((B, R), dtype=torch.float32)
    for i, (p, g) in enumerate(zip(prompt_ids, generations)):
        n = len(g.token_ids)
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + n] = torch.tensor(g.token_ids, dtype=torch.long)
        attention_mask[i, P - len(p):P + n] = 1
        action_mask[i, :n] = 1
        rollout_logprobs[i, :n] = torch.tensor(g.logprobs, dtype=torch.float32)
    return Experience(input_ids.to(device), attention_mask.to(device), action_mask.to(device), rollout_logprobs.to(device), mm=mm)


@torch.no_grad()
def batched_forward(experience, micro_batch_size, fn):
    """fn(micro_batch) -> (b, r) per response token, over the whole experience in micro-batches: (B, R)."""
    out = torch.zeros_like(experience.rollout_logprobs)  # (B, R)
    for i, mb in enumerate(experience.split(micro_batch_size)):
        values = fn(mb)  # (b, r), r <= R after trimming
        lo = i * micro_batch_size
        out[lo:lo + len(mb), :values.shape[1]] = values * mb.action_mask
    return out


def batched_logprobs(model, experience, micro_batch_size, temperature=1.0):
    """Response logprobs (B, R) of `model` over the whole experience, in micro-batches."""
    return batched_forward(experience, micro_batch_size, lambda mb: response_logprobs(
        model, mb.input_ids, mb.attention_mask, mb.action_mask.shape[1], temperature, mm_inputs=mb.mm_inputs())[0])


def batched_values(critic, experience, micro_batch_size):
    """The critic's values (B, R) over the whole experience, in micro-batches."""
    return batched_forward(experience, micro_batch_size, lambda mb: response_values(
        critic, mb.input_ids, mb.attention_mask, mb.action_mask.shape[1], mm_inputs=mb.mm_inputs()))
