"""What the colocated engines (vLLM, SGLang) share: tensor-parallel groups of consecutive ranks, sleep and
wake (`Colocated`) with the GPU memory checks around them, and the KV cache size of a small model
(`kv_cache_bytes`)."""

import socket

import torch

from rft_core.errors import ConfigError, OutOfMemory


def tp_groups(world_size, tp_size):
    """Rank lists of the tensor-parallel groups: consecutive ranks, as vLLM forms them."""
    if world_size % tp_size:
        raise ConfigError(f"world size {world_size} is not divisible by --engine_tp_size {tp_size}")
    return [list(range(i, i + tp_size)) for i in range(0, world_size, tp_size)]


def engine_group(tp_size):
    """(this rank's group's ranks, its index in them, their subgroup or None). Collective."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    groups = tp_groups(world, tp_size)
    subgroup = torch.distributed.new_subgroups_by_enumeration(groups)[0] if tp_size > 1 else None
    return groups[rank // tp_size], rank % tp_size, subgroup


def memory_error(engine, need, what):
    """The OutOfMemory to raise if `need` bytes (for `what`) do not fit in free GPU memory, else None."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()  # (PyTorch's own counters include the engine's unmapped memory)
    if need + (256 << 20) <= free:
        return None
    return OutOfMemory(
        f"{engine} needs {need / 2**30:.1f} GiB to {what}, but only {free / 2**30:.1f} of "
        f"{total / 2**30:.1f} GiB are free, the rest held by the trainer's weights, gradients and optimizer "
        "state (and the engine's awake parts): lower --engine_mem_util, or add --optimizer_offload or "
        "--lora_rank, or shard further (fsdp2.yaml, an *_offload.yaml config, more GPUs)")


def slice_for_rank(flat, sizes, index):
    """This rank's part of a group-wide list built by Colocated._gathered (index: rank within the group)."""
    start = sum(sizes[:index])
    return flat[start:start + sizes[index]]


def free_port():
    """A TCP port on this host that nothing listens on now (a rendezvous's, or SGLang's NCCL port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_cache_bytes(config, requests, max_len, budget_bytes):
    """Twice the bf16 KV cache of `requests` sequences of max_len if under a quarter of budget_bytes, else
    None (the whole --engine_mem_util share): else a small model gets millions of blocks, which vLLM's
    prefix-cache reset walks after every sync (0.28 s a step, tiny Qwen2-VL, H100)."""
    c = config.get_text_config()
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    per_token = 2 * c.num_hidden_layers * (getattr(c, "num_key_value_heads", None) or heads) * head_dim * 2
    need = 2 * requests * max_len * per_token
    return need if need < budget_bytes / 4 else None


class Colocated:
    """sleep, wake_up and can_wake of a colocated engine (vLLM, SGLang) around its own _release and _resume;
    weight_bytes: this GPU's; _any: whether any rank of the engine's group says so."""
    name = "the engine"  # in messages

    def sleep(self, needed_bytes=None):
        """auto: only when free and PyTorch-cached memory is short of needed_bytes (None, the first step: yes)
        on some GPU of the group."""
        if self.sleep_mode == "never" or self.sleeping:
            return False
        before, _ = torch.cuda.mem_get_info()
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        short = needed_bytes is None or before + cached <= needed_bytes * 1.1 + (1 << 30)
        if not self._any(self.sleep_mode == "always" or short):
            return False
        self._release()
        self.slept_bytes = torch.cuda.mem_get_info()[0] - before  # this GPU's weights and KV cache, measured
        self.sleeping = {"weights", "kv_cache"}
        return True

    def can_wake(self):
        return self._wake_error(self.sleeping) is None

    def _wake_error(self, tags):
        """memory_error for waking `tags`; the trainer's cached blocks are released first: the engine maps
        memory of its own, which PyTorch's cache would hold on to (the 0.4B crash of issue 15)."""
        need = {"weights": self.weight_bytes, "kv_cache": max(0, self.slept_bytes - self.weight_bytes)}
        return memory_error(self.name, sum(need[t] for t in tags), f"wake its {' and '.join(tags)}")

    def wake_up(self, tags=None):
        """Raises unless the slept memory fits (on every GPU of the group)."""
        tags = [t for t in (tags or ["weights", "kv_cache"]) if t in self.sleeping]
        if not tags:
            return
        error = self._wake_error(tags)
        if self._any(error is not None):
            raise error or OutOfMemory(f"{self.name} cannot wake: another GPU of its group is short of "
                                       "memory (its rank's error says how much)")
        self._resume(tags)
        self.sleeping -= set(tags)

    def _any(self, flag):  # vLLM: each rank's engine decides alone
        return bool(flag)

    def _gathered(self, items, count=len):
        """(the group's items in rank order, each rank's count(its items)); without a group (items, None)."""
        if self.tp_group is None:
            return items, None
        per_rank = [None] * len(self.group_ranks)
        torch.distributed.all_gather_object(per_rank, items, group=self.tp_group)
        return [x for mine in per_rank for x in mine], [count(mine) for mine in per_rank]
