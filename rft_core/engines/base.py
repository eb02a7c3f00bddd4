"""The rollout engine's interface: the `Engine` protocol (every call the loop and rft_core make on an
engine, so the scripts never branch on which one runs), the `Generation` record it returns,
`wants_logprobs`, which requests of a generate call return their logprobs, `EngineSettings`, the
record an engine is built from (the plan's `engine`), and `stop_end` / `cut_at_stop`, where a response's
first stop ends it (every engine cuts its output there after its own stopping)."""

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
    # "stop": EOS, a stop token or a stop text ended it; "length": the limit did; None: unknown (then it
    # ended where its last token is EOS)
    finish: Optional[str] = None


@dataclass(frozen=True)
class EngineSettings:
    """How the rollout engine is built: the plan's `engine` (rft_core/plan.py: engine_settings, from the
    --engine_* flags), read by create_engine and the engines."""
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
    """The length of `ids` up to and including the token that completes its first stop (a token of
    stop_token_ids, or a text of stop in the decoded prefix), or None where no stop occurs. Which prefix first
    holds a stop text is found by binary search on its length: O(log n) decodes."""
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
    """A Generation of the engine's sampled ids (and logprobs) up to its first stop (stop_end), finish "stop";
    without a stop all of them, finish "length". The stop text stays in the response as sampled."""
    end = stop_end(ids, tokenizer, stop, stop_token_ids)
    if end is None:
        return Generation(ids, logprobs, finish="length")
    return Generation(ids[:end], None if logprobs is None else logprobs[:end], finish="stop")


class Engine(Protocol):
    """What the loop (the scripts, rollout.py, evaluation.py, offload_after_update) calls on an engine:
    HFEngine (engines/hf.py), VLLMEngine (engines/vllm.py) and SGLangEngine (engines/sglang.py) all offer
    exactly these (tests/test_engine_protocol.py checks both sides). Step lifecycle: generate -> sleep ->
    train -> update_weights -> wake_up -> generate."""

    def generate(self, prompt_token_ids: list[list[int]], max_new_tokens: Union[int, list[int]],
                 temperature: float = 1.0, top_p: float = 1.0, mm: Optional[list] = None,
                 logprob_every: int = 1) -> list[Generation]:
        """One Generation per prompt, in order: the response token ids, ending at its first stop (EOS, or a
        stop of the engine's settings: cut_at_stop) unless the length limit cut it, its finish, and the
        logprob of each under the sampling distribution (temperature applied; temperature 0 means greedy,
        logprobs then at temperature 1), for every logprob_every-th prompt (0: none; the others' logprobs
        are None: returning them costs vLLM host work per token, up to 30% of a small model's generation).
        max_new_tokens: one for all, or a list (one per prompt). mm: per-prompt image inputs of a
        vision-language model (Experience.mm's form) or None."""
        ...

    def sleep(self, needed_bytes: Optional[int] = None) -> bool:
        """Free the engine's GPU memory for training; returns whether it slept. needed_bytes: the update's
        measured transient memory (None: unknown), by which the "auto" sleep mode decides."""
        ...

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Take the slept memory back: tags "weights", "kv_cache", or both (None)."""
        ...

    def can_wake(self) -> bool:
        """Whether what sleeps would fit on the GPU now (offload_after_update asks it after the first update,
        to decide whether the optimizer state must leave the GPU between updates)."""
        ...

    def update_weights(self, model: "torch.nn.Module") -> None:
        """Load the trainer's current weights (the unwrapped model); collective under ZeRO-3 / FSDP2 and in a
        tensor-parallel engine group."""
        ...
