"""Sequence parallelism (DeepSpeed's Ulysses, through Accelerate's parallelism config): the ranks of a group
train the same samples, each on its own slice of every row's tokens.

accelerate_configs/deepspeed_zero3_sp2.yaml sets `parallelism_config_sp_size` and `sp_backend: deepspeed`.
Accelerate then registers DeepSpeed's UlyssesSPAttentionHF as the model's attention: it exchanges heads for
sequence (all-to-all) so each rank attends over the whole row, and DeepSpeed averages the gradients over all
ranks. What is left to the trainer is here:
- samples: each rank rolls out its own prompts, as without SP; then the group shares them (Accelerate's
  gather_object), so every rank of a group holds the group's samples in the same order;
- layout: Ulysses drops attention masks (causal attention over the gathered position ids), so a row is laid
  out from its first token, [prompt | response | pad], positions 0, 1, ...; padding only trails, where no
  real token sees it. The width is a multiple of the group size, and the targets are shifted before the
  split, so the token after a slice's last position is still that position's target;
- the loss: a rank scores the response tokens its slice predicts (`shard` narrows the action mask to them).
  The step's normalisers count each token once over all ranks, and a sequence's length (seq-mean-token-mean)
  is its whole length, so the ranks' losses sum to the step's loss; the all-to-all's backward carries each
  rank's share of the gradient to the others, and DeepSpeed's mean over the world, times the world (the
  scripts' `scale`), is the step's gradient;
- logprob passes (no gradient): each rank computes its slice, and a sum over the group (zeros elsewhere)
  gives every rank the whole (B, T).
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from rft_core.errors import ConfigError
from rft_core.logprobs import token_logprobs


@dataclass
class RowSlice:
    """A rank's slice of a micro-batch's rows (SequenceParallel.layout)."""
    inputs: dict  # the model's keywords: input_ids, position_ids (B, w)
    targets: torch.Tensor  # (B, w): the token after each position
    where: torch.Tensor  # (B, T): the column of the slice predicting each response token (clamped)
    owned: torch.Tensor  # (B, T): the response tokens this slice predicts


@dataclass
class SequenceParallel:
    size: int  # ranks in a group
    rank: int  # this rank's place in its group: groups are consecutive ranks, as DeepSpeed builds them

    @classmethod
    def from_accelerator(cls, accelerator, model):
        """This rank's place in its group, or None without sequence parallelism. Before accelerator.prepare:
        refuses in one line a model whose attention heads do not divide over the group (DeepSpeed's own
        check, in prepare, is a traceback)."""
        config = accelerator.parallelism_config
        if config is None or (config.sp_size or 1) == 1:
            return None
        heads = model.config.get_text_config().num_attention_heads
        if heads % config.sp_size:
            raise ConfigError(f"the model's {heads} attention heads do not divide over "
                              f"parallelism_config_sp_size {config.sp_size} (Ulysses gives each rank whole "
                              "heads): set an sp_size that divides them")
        return cls(config.sp_size, accelerator.process_index % config.sp_size)

    @property
    def group(self):
        """The torch process group of this rank's group (made by accelerator.prepare)."""
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        return parallel_state_sp.get_sequence_parallel_group()

    def gather_samples(self, samples, accelerator):
        """The samples of every rank of this group, in rank order (each rank rolled out its own)."""
        from accelerate.utils import gather_object

        per_rank = gather_object([samples])  # one list per rank, of all ranks
        first = accelerator.process_index - self.rank  # groups are consecutive ranks
        return [s for rank in range(first, first + self.size) for s in per_rank[rank]]

    def sum(self, tensor):
        """tensor summed over the group, in place (no gradient)."""
        torch.distributed.all_reduce(tensor, group=self.group)
        return tensor

    def layout(self, mb):
        """This rank's RowSlice of the micro-batch mb (an Experience)."""
        num_actions = mb.action_mask.shape[1]
        prompt_lens = mb.attention_mask[:, :-num_actions].sum(-1)  # (B,)
        lengths = mb.attention_mask.sum(-1)  # (B,)
        width = math.ceil(int(lengths.max()) / self.size) * self.size
        cols = torch.arange(width, device=lengths.device)
        # row b's tokens start at column P - prompt_lens[b] of the [pad prompt | response pad] layout
        start = mb.attention_mask.shape[1] - num_actions - prompt_lens  # (B,)
        index = (start[:, None] + cols).clamp(max=mb.input_ids.shape[1] - 1)  # (B, W)
        ids = mb.input_ids.gather(1, index).masked_fill(cols >= lengths[:, None], 0)  # (B, W)
        targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))  # (B, W)
        w = width // self.size
        part = slice(self.rank * w, (self.rank + 1) * w)
        # response token t of row b sits at column prompt_lens[b] + t, predicted by the column before it
        pred = prompt_lens[:, None] + torch.arange(num_actions, device=cols.device) - 1  # (B, T)
        owned = mb.action_mask.bool() & (pred // w == self.rank)
        positions = cols[part].expand(len(ids), w)
        inputs = dict(input_ids=ids[:, part], position_ids=positions)
        return RowSlice(inputs, targets[:, part], (pred - self.rank * w).clamp(0, w - 1), owned)

    def shard(self, mb):
        """mb with the action mask narrowed to the tokens this rank scores, and each row's whole response
        length kept (response_lens), for the loss."""
        owned = self.layout(mb).owned  # (B, T)
        response = mb.attention_mask[:, -mb.action_mask.shape[1]:]  # (B, T): the response columns
        return replace(mb, action_mask=owned.to(mb.action_mask.dtype), response_lens=response.sum(-1))

    def logprobs(self, model, mb, temperature=1.0, with_entropy=False, chunk_size=None):
        """(logprobs, entropy or None) (B, T) of mb's response tokens this rank's slice predicts, zeros
        elsewhere (as micro_batch_logprobs)."""
        part = self.layout(mb)
        rows = []
        with sharded_attention(model):
            for b in range(len(part.targets)):  # Ulysses takes DeepSpeed's micro-batch of one row per forward
                row = {key: value[b:b + 1] for key, value in part.inputs.items()}
                rows.append(token_logprobs(model, {**row, "attention_mask": None, "logits_to_keep": 0},
                                           part.targets[b:b + 1], temperature, with_entropy, chunk_size))
        pick = lambda x: torch.cat(x).gather(1, part.where) * part.owned  # noqa: E731  (B, w) each -> (B, T)
        logprobs = pick([lp for lp, _ in rows])
        entropy = pick([e for _, e in rows]) if with_entropy else None
        return logprobs, entropy


@contextmanager
def sharded_attention(model):
    """The model in training mode for the block: Accelerate registers Ulysses with disable_in_eval, and in
    eval mode the attention would see only this rank's slice."""
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was_training)
