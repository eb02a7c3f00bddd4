"""The rollout as records (`Sample`, one per response) and as one padded batch (`Experience`), its logprobs,
and micro-batches of it.

A row: [pad ... prompt | response ... pad], prompts left-padded to P, responses right-padded to T (the last T
columns). A multi-turn response holds environment tokens: in attention_mask (`response_lengths` counts them),
not in action_mask, which every loss and statistic reads.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Optional, Union

import torch

from rft_core.engines.base import Generation
from rft_core.logprobs import packed_logprobs, response_logprobs, unwrap
from rft_core.model_training import response_values
from rft_core.multimodal import mm_inputs


@dataclass(frozen=True)
class Forward:
    """How the trainer's forwards over micro-batches run, alike in every pass (old, ref, values, update)."""
    temperature: float = 1.0  # logprobs of softmax(logits / temperature), the sampling distribution
    chunk_size: Optional[int] = None  # the fused LM head's tokens per chunk (None: the model's own logits)
    packed: bool = False  # a micro-batch's rows as one row without padding (text only)
    sp: object = None  # sequence_parallel.SequenceParallel: this rank computes a slice of every row


@dataclass
class Sample:
    """One prompt and, once rolled out, one response to it with its reward."""
    prompt_ids: list  # the encoded prompt (chat template applied; image placeholders expanded)
    label: str  # the reference answer the reward compares with
    prompt: object  # the prompt as the reward sees it: a string or a list of chat messages
    mm: dict = None  # a vision-language prompt's images and videos (multimodal.py), None for text
    generation: object = None  # engines.base.Generation: the response's token ids and sampling logprobs
    completion: str = None  # the response decoded
    reward: float = None  # as scored: the weighted sum of the reward sources, plus shaping
    components: dict = None  # name -> value, each logged as rollout/reward/<name>
    episode: object = None  # episodes.Episode: a multi-turn rollout's turns and how it ended (--env)
    columns: dict = None  # the prompt row's other columns by name: the reward's keyword arguments


@dataclass
class Experience:
    input_ids: torch.Tensor  # (B, P + T)
    attention_mask: torch.Tensor  # (B, P + T)
    action_mask: torch.Tensor  # (B, T): 1 on the response tokens the policy sampled (not the environment's)
    rollout_logprobs: torch.Tensor  # (B, T): the engine's sampling logprobs (NaN on rows it did not return)
    old_logprobs: torch.Tensor = None  # (B, T): trainer logprobs before the update
    ref_logprobs: torch.Tensor = None  # (B, T): frozen reference model
    values: torch.Tensor = None  # (B, T): the critic's V(s_t) before the update (gae)
    returns: torch.Tensor = None  # (B, T): the critic's regression targets (gae)
    rewards: torch.Tensor = None  # (B,)
    mm: list = None  # per row, for vision-language models: image inputs (multimodal.py) or None
    advantages: torch.Tensor = None  # (B,) per sequence (broadcast over tokens), or (B, T) per token
    response_lens: torch.Tensor = None  # (B,) whole action-token counts, where action_mask holds an SP slice

    def __len__(self):
        return self.input_ids.shape[0]

    def select(self, idx):
        """The rows idx (a list or 1-D tensor of indices), untrimmed."""
        idx = torch.as_tensor(idx, device=self.input_ids.device)
        picked = {f.name: getattr(self, f.name)[idx] for f in fields(self)
                  if torch.is_tensor(getattr(self, f.name))}
        if self.mm is not None:
            picked["mm"] = [self.mm[i] for i in idx.tolist()]
        return replace(self, **picked)

    def rollout_known(self):
        """(B, T) bool: the response tokens whose engine logprob the engine returned (not NaN)."""
        return self.action_mask.bool() & ~self.rollout_logprobs.isnan()

    def response_lengths(self):
        """(B,) each row's response tokens in the layout, the environment's included."""
        return self.attention_mask[:, -self.action_mask.shape[1]:].sum(-1)

    def mm_inputs(self):
        return mm_inputs(self.mm, self.input_ids)

    def split(self, micro_batch_size=None, max_tokens=None, sync_count=None, fwd=Forward()):
        """Micro-batches (micro_batch_rows), each trimmed to its longest prompt and response; with fwd.sp,
        narrowed to this rank's tokens (SequenceParallel.shard)."""
        batches = [self.select(rows)._trim()
                   for rows in self.micro_batch_rows(micro_batch_size, max_tokens, sync_count, fwd.packed)]
        return [fwd.sp.shard(mb) for mb in batches] if fwd.sp is not None else batches

    def micro_batch_rows(self, micro_batch_size=None, max_tokens=None, sync_count=None, packed=False):
        """Row lists of the micro-batches: micro_batch_size consecutive rows, or rows of similar length within
        max_tokens each (cost below; a longer row alone). sync_count(n) -> the count every rank uses (under
        ZeRO-3 / FSDP2 each forward is a collective); the costliest micro-batches are halved to make it up."""
        if not max_tokens:
            return [list(range(i, min(i + micro_batch_size, len(self))))
                    for i in range(0, len(self), micro_batch_size)]
        num_actions = self.action_mask.shape[1]
        prompt_lens = self.attention_mask[:, :-num_actions].sum(-1).tolist()
        response_lens = self.response_lengths().tolist()

        def cost(rows):  # packed: the rows' lengths; padded: rows x (longest prompt + response, to 8s: _trim)
            if packed:
                return sum(prompt_lens[i] + response_lens[i] for i in rows)
            width = max(prompt_lens[i] for i in rows) + max(response_lens[i] for i in rows)
            return len(rows) * (width + -width % 8)

        order = sorted(range(len(self)), key=lambda i: prompt_lens[i] + response_lens[i], reverse=True)
        groups = [[]]
        for i in order:  # longest first: a row joins the current group while the group fits
            if groups[-1] and cost(groups[-1] + [i]) > max_tokens:
                groups.append([])
            groups[-1].append(i)
        count = sync_count(len(groups)) if sync_count else len(groups)
        while len(groups) < count:
            largest = max((g for g in groups if len(g) > 1), key=cost, default=None)
            if largest is None:
                raise ValueError(f"{len(self)} rows cannot make {count} micro-batches")
            groups.remove(largest)
            groups += [largest[:len(largest) // 2], largest[len(largest) // 2:]]
        return groups

    def pack(self):
        """One packed row: (input_ids, position_ids) (1, N), no padding, positions restarting at 0 per row;
        keep (K,), the positions predicting response tokens; (rows, cols) (K,), those tokens in (B, T)."""
        num_actions = self.action_mask.shape[1]
        lengths = self.attention_mask.sum(-1).tolist()
        response_lens = self.response_lengths().tolist()
        device = self.input_ids.device
        input_ids = self.input_ids[self.attention_mask.bool()].unsqueeze(0)  # (1, N): rows in order
        position_ids = torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)  # (1, N)
        starts = torch.tensor([0] + lengths[:-1], device=device).cumsum(0).tolist()
        keep = torch.cat([torch.arange(r, device=device) + start + n - r - 1
                          for start, n, r in zip(starts, lengths, response_lens)])  # (K,)
        rows = torch.cat([torch.full((r,), b, device=device) for b, r in enumerate(response_lens)])
        cols = torch.cat([torch.arange(r, device=device) for r in response_lens])
        assert int(rows.numel()) == sum(response_lens) and max(response_lens) <= num_actions
        return input_ids, position_ids, keep, (rows, cols)

    def _trim(self):
        """Drop the padding columns that no row of this batch uses, then widen to a multiple of 8 columns
        where there is padding for it (one shape class for a compiled model, --torch_compile)."""
        width, num_actions = self.input_ids.shape[1], self.action_mask.shape[1]
        longest = int(self.response_lengths().max().clamp(min=1))  # longest response here
        used = self.attention_mask[:, :-num_actions].any(0).nonzero()
        start = int(used[0]) if len(used) else 0  # first prompt column any row uses
        short = -(width - num_actions + longest - start) % 8  # columns to add for a multiple of 8
        short = short if short <= num_actions - longest + start else 0  # not if the padding is narrower
        keep_t = longest + min(short, num_actions - longest)  # the responses' padding first
        start -= short - (keep_t - longest)  # then the prompts'
        end = width - num_actions + keep_t
        trimmed = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value) and value.dim() == 2:  # (B, P + T) or (B, T)
                trimmed[f.name] = value[:, start:end] if value.shape[1] == width else value[:, :keep_t]
        return replace(self, **trimmed)


def build_experience(prompt_ids: list[list[int]], generations: list[Generation], pad_token_id: int,
                     device: Union[str, torch.device] = "cpu", mm: Optional[list] = None) -> "Experience":
    """Pad prompts (left) and generations (right, one per prompt) into an Experience of P + T columns, a
    multiple of 8 (one shape class for a compiled model). mm: per-prompt image inputs (Experience.mm)."""
    if len(prompt_ids) != len(generations):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(generations)} generations")
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(g.token_ids) for g in generations))
    T += -(P + T) % 8  # response padding to a width of a multiple of 8, which _trim then always keeps
    B = len(prompt_ids)
    input_ids = torch.full((B, P + T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    action_mask = torch.zeros((B, T), dtype=torch.long)
    rollout_logprobs = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, g) in enumerate(zip(prompt_ids, generations)):
        n = len(g.token_ids)
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + n] = torch.tensor(g.token_ids, dtype=torch.long)
        attention_mask[i, P - len(p):P + n] = 1
        action_mask[i, :n] = 1 if g.mask is None else torch.tensor(g.mask, dtype=torch.long)
        known = g.logprobs is not None  # (the engine returns them for some samples only)
        rollout_logprobs[i, :n] = torch.tensor(g.logprobs, dtype=torch.float32) if known else math.nan
    mm = mm if mm is not None and any(m is not None for m in mm) else None  # None: a text-only batch
    return Experience(input_ids.to(device), attention_mask.to(device), action_mask.to(device),
                      rollout_logprobs.to(device), mm=mm)


def micro_batch_logprobs(model: torch.nn.Module, mb: "Experience", fwd: Forward = Forward(),
                         with_entropy: Union[bool, str] = False
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Response logprobs (and entropy, as response_logprobs) (B, T) of mb: from its padded rows, or packed
    (fwd.packed: logprobs.packed_logprobs, text only); with fwd.sp (sequence_parallel.SequenceParallel),
    those this rank's slice predicts, zeros elsewhere."""
    temperature, chunk_size = fwd.temperature, fwd.chunk_size
    if fwd.sp is not None:
        return fwd.sp.logprobs(model, mb, temperature, with_entropy, chunk_size)
    if not fwd.packed:
        return response_logprobs(model, mb.input_ids, mb.attention_mask, mb.action_mask.shape[1], temperature,
                                 with_entropy, mb.mm_inputs(), chunk_size)
    input_ids, position_ids, keep, where = mb.pack()
    logprobs, entropy = packed_logprobs(model, input_ids, position_ids, keep, temperature, with_entropy,
                                        chunk_size)  # (1, K)

    def unpack(x):  # (1, K) -> (B, T), zeros on the padding
        return x.new_zeros(mb.action_mask.shape).index_put(where, x[0])
    return unpack(logprobs), unpack(entropy) if entropy is not None else None


def micro_batch_values(critic: torch.nn.Module, mb: "Experience", fwd: Forward = Forward()) -> torch.Tensor:
    """The critic's values V(s_t) (B, T) on the micro-batch mb, padded or packed (fwd.packed)."""
    if not fwd.packed:
        return response_values(critic, mb.input_ids, mb.attention_mask, mb.action_mask.shape[1],
                               mm_inputs=mb.mm_inputs())
    input_ids, position_ids, keep, where = mb.pack()
    # use_cache=False: with a cache transformers does not read the position restarts as sample boundaries
    values = critic(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                    use_cache=False).logits  # (1, N, 1)
    return values.new_zeros(mb.action_mask.shape).index_put(where, values[0, keep, 0]).float()


@torch.no_grad()
def batched_forward(experience, fn, fwd=Forward(), micro_batch_size=None, max_tokens=None, sync_count=None):
    """fn(micro_batch) -> (b, t) over the whole experience in micro-batches (as Experience.split): (B, T).
    With fwd.sp, fn gives this rank's slice's tokens, summed over the group."""
    out = torch.zeros_like(experience.rollout_logprobs)  # (B, T)
    for rows in experience.micro_batch_rows(micro_batch_size, max_tokens, sync_count, fwd.packed):
        mb = experience.select(rows)._trim()
        values = fn(mb)  # (b, t), t <= T after trimming
        # (fp32, whatever the pass computed in: FSDP2's bf16 reference model gives bf16)
        out[rows, :values.shape[1]] = (values * mb.action_mask).to(out.dtype)
    return fwd.sp.sum(out) if fwd.sp is not None else out


def batched_logprobs(model: torch.nn.Module, experience: "Experience", fwd: Forward = Forward(),
                     **split) -> torch.Tensor:
    """Response logprobs (B, T) of `model` over the experience (split: batched_forward's sizes)."""
    return batched_forward(experience, lambda mb: micro_batch_logprobs(model, mb, fwd)[0], fwd, **split)


def batched_values(critic: torch.nn.Module, experience: "Experience", fwd: Forward = Forward(),
                   **split) -> torch.Tensor:
    return batched_forward(experience, lambda mb: micro_batch_values(critic, mb, fwd), fwd, **split)


def logprob_passes(experience, policy, reference, critic, fwd, split, old=True, ref=False, lora=False):
    """(old, ref logprobs, critic values) before the update, (B, T) each or None where not asked for; with
    lora, ref is the policy with its adapters off. split: batched_forward's sizes."""
    base = unwrap(policy).disable_adapter() if lora and ref else nullcontext()
    with base:
        ref_logprobs = batched_logprobs(reference or policy, experience, fwd, **split) if ref else None
    return (batched_logprobs(policy, experience, fwd, **split) if old else None, ref_logprobs,
            batched_values(critic, experience, fwd, **split) if critic is not None else None)


def optimizer_chunks(experience: "Experience", rows_per_step: int, max_epochs: int, seed: int):
    """Each optimizer step's rows: per epoch a seeded permutation (a resumed run draws the same), cut."""
    for epoch in range(max_epochs):
        order = torch.randperm(len(experience), generator=torch.Generator().manual_seed(seed + epoch))
        for first in range(0, len(experience), rows_per_step):
            yield experience.select(order[first:first + rows_per_step])
