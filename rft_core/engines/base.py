"""The rollout engine's interface: the `Engine` protocol, the `Generation` it returns, the `EngineSettings` it
is built from, and `cut_at_stop`, which every engine's output passes (a response ends at its first stop)."""

import bisect
from dataclasses import dataclass
from typing import Optional, Protocol, Union

import torch


@dataclass
class Generation:
    token_ids: list
    logprobs: list  # the engine's sampling logprob of each token (None: not asked for)
    versions: list = None  # partial rollout: the policy version (weight syncs so far) that sampled each token
    mask: list = None  # multi-turn: 1 on the tokens the engine sampled, 0 on the environment's (None: all 1)
    # "stop": EOS or a stop ended it; "length": the limit did; None: unknown (then: its last token is EOS)
    finish: Optional[str] = None


@dataclass(frozen=True)
class EngineSettings:
    """How the rollout engine is built: the plan's `engine` (rft_core/plan.py: engine_settings)."""
    type: str = "hf"  # hf, vllm or sglang
    micro_batch_size: int = 32  # the transformers engine's prompts per generate batch
    bf16: bool = False  # the transformers engine's autocast
    tp_size: int = 1  # ranks per colocated engine (tensor parallel)
    mem_util: float = 0.3  # the GPU's share for a colocated engine's weights and KV cache
    sleep: str = "auto"  # auto (only when an update needs the memory), always or never
    sleep_level: int = 1  # 1: the weights wait on the CPU; 2: discarded, the next sync reloads them
    enforce_eager: bool = False  # no CUDA graphs
    max_model_len: int = 2048  # prompt + response
    requests: int = 1  # one generate call's, per rank: sizes a small model's KV cache
    seed: int = 0
    prefix_caching: bool = True  # vLLM's; off where no call sends a context again
    limit_mm_per_prompt: Optional[int] = None  # images per prompt (vision-language models)
    static_prefix: Optional[str] = None  # parameters synced only once (a frozen vision tower)
    stop: tuple = ()  # texts that end a response (--stop and the environment's; plan.with_stops)
    stop_token_ids: tuple = ()  # token ids that end a response, besides EOS


def wants_logprobs(index: int, every: int) -> bool:
    """Whether request `index` of a generate call returns its logprobs (every: 1 all, k every k-th, 0 none)"""
    return bool(every) and index % every == 0


def stop_end(ids, tokenizer, stop=(), stop_token_ids=()):
    """The length of `ids` through the token completing its first stop, or None; the first prefix holding a
    stop text is found by binary search: O(log n) decodes."""
    end = next((i + 1 for i, t in enumerate(ids) if t in stop_token_ids), None)
    if not stop:
        return end

    def has_stop(k):  # False up to the first prefix that holds a stop text, True from there on
        text = tokenizer.decode(ids[:k], skip_special_tokens=False)
        return any(s in text for s in stop)

    before = len(ids) if end is None else end - 1  # a stop text completed before the stop token?
    first = bisect.bisect_left(range(1, before + 1), True, key=has_stop) + 1
    return first if first <= before else end


def cut_at_stop(ids, logprobs, tokenizer, stop=(), stop_token_ids=()):
    """A Generation cut at its first stop (stop_end), finish "stop", else whole, "length"; the stop stays."""
    end = stop_end(ids, tokenizer, stop, stop_token_ids)
    if end is None:
        return Generation(ids, logprobs, finish="length")
    return Generation(ids[:end], None if logprobs is None else logprobs[:end], finish="stop")


class Engine(Protocol):
    """What the loop calls on an engine; every engine offers exactly these (tests/test_engine_protocol.py).
    Step lifecycle: generate -> sleep -> train -> update_weights -> wake_up -> generate."""

    def generate(self, prompt_token_ids: list[list[int]], max_new_tokens: Union[int, list[int]],
                 temperature: float = 1.0, top_p: float = 1.0, mm: Optional[list] = None,
                 logprob_every: int = 1) -> list[Generation]:
        """One Generation per prompt, in order, with each token's sampling logprob (temperature applied;
        greedy: at 1) for every logprob_every-th prompt (0: none), else None: they cost vLLM host work per
        token, up to 30% of a small model's generation. max_new_tokens: one, or one per prompt; mm:
        per-prompt VL inputs (Experience.mm's form) or None."""
        ...

    def sleep(self, needed_bytes: Optional[int] = None) -> bool:
        """Free the engine's GPU memory; returns whether it slept. needed_bytes (None: unknown): for auto."""
        ...

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Take the slept memory back: tags "weights", "kv_cache", or both (None)."""
        ...

    def can_wake(self) -> bool:
        """Whether what sleeps would fit on the GPU now (offload_after_update decides by it)."""
        ...

    def update_weights(self, model: "torch.nn.Module") -> None:
        """Load the unwrapped model's weights; collective under ZeRO-3 / FSDP2 and in a TP engine group."""
        ...
