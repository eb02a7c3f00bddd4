"""Sequence parallelism via Accelerate's parallelism config (backends, configs, attention: docs/scaling.md):
a group's ranks train the same samples, each on a slice of every row's tokens. Ulysses (DeepSpeed,
`parallelism_config_sp_size`): a contiguous 1 / size of the row, one row per forward; context parallelism
(FSDP2, `parallelism_config_cp_size`): the columns torch's ring attention balances onto the rank, several
rows per forward, forward and backward inside its context (`block`). Here: the group shares its ranks'
rollouts (gather_object); a row is [prompt | response | pad] from column 0, no attention mask, targets
shifted before the split; a rank scores the response tokens its slice predicts (`shard`), normalisers and
lengths whole, so the ranks' losses sum to the step's and the world mean of gradients (FSDP2: over
dp_shard_cp) times the world (`scale`) is the step's; logprob passes: slices summed over the group."""

import math
from contextlib import contextmanager, nullcontext
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
    rank: int  # this rank's place in its group of consecutive ranks (DeepSpeed's; the mesh's, checked)
    context_parallel: object = None  # FSDP2: accelerator.maybe_context_parallel (None: Ulysses)
    cp_group: object = None  # FSDP2: the group's torch process group (Accelerate's "cp" mesh)

    @classmethod
    def from_accelerator(cls, accelerator, model):
        """This rank's place in its group, or None; ConfigError if Ulysses cannot split the heads."""
        config = accelerator.parallelism_config
        if (getattr(config, "cp_size", None) or 1) > 1:
            mesh = accelerator.torch_device_mesh["cp"]
            ranks = mesh.mesh.flatten().tolist()
            assert ranks == list(range(ranks[0], ranks[0] + config.cp_size)), ranks  # gather_samples' groups
            return cls(config.cp_size, mesh.get_local_rank(), accelerator.maybe_context_parallel,
                       mesh.get_group())
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
        """The torch process group of this rank's group (Ulysses': made by accelerator.prepare)."""
        if self.cp_group is not None:
            return self.cp_group
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        return parallel_state_sp.get_sequence_parallel_group()

    def gather_samples(self, samples, accelerator):
        """The samples of every rank of this group, in rank order (each rank rolled out its own)."""
        from accelerate.utils import gather_object

        per_rank = gather_object([samples])  # one list per rank, of all ranks
        first = accelerator.process_index - self.rank  # groups are consecutive ranks
        return [s for rank in range(first, first + self.size) for s in per_rank[rank]]

    def sum(self, tensor):
        torch.distributed.all_reduce(tensor, group=self.group)
        return tensor

    def width(self, mb):
        """mb's longest row, to a multiple of the group; under CP, of 2 x group 32-multiple chunks (the
        efficient sdpa kernel's logsumexp has blocks of 32 that the ring merge keeps: seen on two H200s)."""
        multiple = self.size * (64 if self.context_parallel else 1)
        return math.ceil(int(mb.attention_mask.sum(-1).max()) / multiple) * multiple

    def columns(self, width, device):
        """(width / size,) the columns of a row of `width` that this rank computes."""
        if self.context_parallel is None:
            w = width // self.size
            return torch.arange(self.rank * w, (self.rank + 1) * w, device=device)
        if width not in self._columns:  # cached: a nested context switches ring attention off as it leaves
            assert not self._inside, "columns of a new width inside a block"
            with self.block(None, width, device):
                pass
        return self._columns[width]

    @contextmanager
    def block(self, model, width, device):
        """Where forwards over rows of `width` and their backward run: Ulysses in training mode (Accelerate's
        disable_in_eval: else attention sees one slice), CP in its context (ring attention); re-entrant."""
        if self._inside:
            yield
            return
        self._inside = True
        try:
            if self.context_parallel is None:
                was_training = model.training
                model.train()
                try:
                    yield
                finally:
                    model.train(was_training)
            else:  # the context balances its shards by the width of its buffers: a column index of this width
                cols = torch.arange(width, device=device)[None]
                with self.context_parallel(buffers=[cols], buffer_seq_dims=[1], no_restore_buffers={cols}):
                    self._columns[width] = cols[0]
                    yield
        finally:
            self._inside = False

    def __post_init__(self):
        self._inside = False  # in a block
        self._columns = {}  # context parallelism: width -> this rank's columns

    def layout(self, mb):
        num_actions = mb.action_mask.shape[1]
        prompt_lens = mb.attention_mask[:, :-num_actions].sum(-1)  # (B,)
        lengths = mb.attention_mask.sum(-1)  # (B,)
        width, device = self.width(mb), lengths.device
        cols = torch.arange(width, device=device)
        # row b's tokens start at column P - prompt_lens[b] of the [pad prompt | response pad] layout
        start = mb.attention_mask.shape[1] - num_actions - prompt_lens  # (B,)
        index = (start[:, None] + cols).clamp(max=mb.input_ids.shape[1] - 1)  # (B, W)
        ids = mb.input_ids.gather(1, index).masked_fill(cols >= lengths[:, None], 0)  # (B, W)
        targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))  # (B, W)
        mine = self.columns(width, device)  # (w,)
        slot = torch.full((width,), -1, device=device)
        slot[mine] = torch.arange(len(mine), device=device)  # each column's place in the slice, -1: not mine
        # response token t of row b sits at column prompt_lens[b] + t, predicted by the column before it
        pred = prompt_lens[:, None] + torch.arange(num_actions, device=device) - 1  # (B, T)
        where = slot[pred.clamp(max=width - 1)]  # (B, T): the predicting column's place in the slice
        owned = mb.action_mask.bool() & (where >= 0)
        inputs = dict(input_ids=ids[:, mine], position_ids=mine.expand(len(ids), -1))
        return RowSlice(inputs, targets[:, mine], where.clamp(min=0), owned)

    def shard(self, mb):
        """mb, its action mask narrowed to the tokens this rank scores, whole lengths kept (response_lens)."""
        owned = self.layout(mb).owned  # (B, T)
        return replace(mb, action_mask=owned.to(mb.action_mask.dtype), response_lens=mb.action_mask.sum(-1))

    def logprobs(self, model, mb, temperature=1.0, with_entropy=False, chunk_size=None):
        """(logprobs, entropy or None) (B, T) on tokens this slice predicts, else 0; backward in `block`."""
        part = self.layout(mb)
        # Ulysses takes DeepSpeed's micro-batch of one row per forward; context parallelism takes them all
        step = len(part.targets) if self.context_parallel else 1
        out = []
        with self.block(model, part.targets.shape[1] * self.size, mb.input_ids.device):
            for b in range(0, len(part.targets), step):
                rows = {key: value[b:b + step] for key, value in part.inputs.items()}
                out.append(token_logprobs(model, {**rows, "attention_mask": None, "logits_to_keep": 0},
                                          part.targets[b:b + step], temperature, with_entropy, chunk_size))
        pick = lambda x: torch.cat(x).gather(1, part.where) * part.owned  # noqa: E731  (B, w) each -> (B, T)
        return pick([lp for lp, _ in out]), pick([e for _, e in out]) if with_entropy else None


def group_size(parallelism):
    """The ranks that share samples, each computing a slice of every row (sp_size or cp_size; 1 without)."""
    return (getattr(parallelism, "sp_size", None) or 1) * (getattr(parallelism, "cp_size", None) or 1)


def sliced(sp, model, mb):
    """SequenceParallel.block at mb's width for the update's forward and backward; none without SP or CP."""
    return sp.block(model, sp.width(mb), mb.input_ids.device) if sp is not None else nullcontext()
