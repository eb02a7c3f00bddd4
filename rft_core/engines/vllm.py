"""vLLM rollout engine, colocated: one `vllm.LLM` in every training process, joined to the trainer's world
(`external_launcher`); groups of `--engine_tp_size` consecutive ranks share one. Design: docs/engines.md.

Lifecycle: generate -> sleep -> train -> update_weights (wakes the weights alone) -> wake_up (KV cache), so
old weights, new weights and the KV cache are never resident together. Sleep costs 0.6 s (H100): "auto"
sleeps only when memory is short. The engine starts from random weights; the first sync loads the model."""

import gc
import os
from dataclasses import dataclass

import torch

from rft_core.engines.base import cut_at_stop, wants_logprobs
from rft_core.engines.colocation import Colocated, engine_group, free_port, memory_error, slice_for_rank
from rft_core.engines.sync import buckets, iter_weights
from rft_core.errors import ConfigError
from rft_core.models import pin_triton_cache
from rft_core.multimodal import vllm_prompt


def cuda_graph_config(max_batch, enforce_eager=False):
    """CUDA graphs up to max_batch sequences: vLLM's default stops at 512 and decodes larger batches eagerly
    (partial rollout's rounds, --inflight_ratio > 1)."""
    if enforce_eager or max_batch <= 512:
        return {}
    return {"compilation_config": {"max_cudagraph_capture_size": min(-(-int(max_batch) // 16) * 16, 1024)}}


@dataclass
class Request:
    """n samples of one prompt: one request of n costs vLLM's host a fraction of n requests of one."""
    ids: list  # the trainer's prompt token ids
    prompt: dict  # the request vLLM takes (vllm_prompt)
    limit: int  # new tokens at most
    want: bool  # its samples return their logprobs
    n: int = 1


def engine_requests(prompt_token_ids, limits, mm, logprob_every, group=True):
    """A generate call's requests: consecutive prompts alike in ids, images, limit and want of logprobs are
    one request of n samples, which come back in the prompts' order (group=False: one each)."""
    requests = []
    for i, (p, m, limit) in enumerate(zip(prompt_token_ids, mm, limits)):
        ids, want, last = list(p), wants_logprobs(i, logprob_every), requests[-1] if requests else None
        if group and last and last.ids == ids and (last.limit, last.want) == (limit, want) and m is mm[i - 1]:
            last.n += 1
        else:
            requests.append(Request(ids, vllm_prompt(ids, m, sample=i), limit, want))
    return requests


class VLLMEngine(Colocated):
    name = "vLLM"

    def __init__(self, model_dir, eos_token_id, settings, kv_bytes=None, max_batch=256, blocked_token_ids=(),
                 dtype=torch.bfloat16, bucket_mb=256, tokenizer=None):
        """kv_bytes: the KV cache's (None: mem_util's share); max_batch: sequences per generate call."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # else a 2-minute JIT at start-up
        pin_triton_cache()  # its Triton kernels: the same cache on every run
        # external_launcher reads RANK / LOCAL_RANK and a rendezvous, which plain `python` does not set
        rendezvous = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        for key, value in rendezvous.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        from vllm import LLM

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        s, mem_util, mm = settings, settings.mem_util, settings.limit_mm_per_prompt
        self.sleep_mode, self.sleep_level, self.dtype = s.sleep, s.sleep_level, dtype
        self.bucket_bytes = bucket_mb << 20
        self.seed, self.calls, self.sleeping = s.seed + rank // s.tp_size, 0, set()  # sleeping: tags asleep
        self.slept_bytes = 0  # what the last sleep freed (weights and KV cache), measured
        self.stop, self.stop_token_ids, self.tokenizer = s.stop, (eos_token_id, *s.stop_token_ids), tokenizer
        # never sampled; -100 is vLLM's largest bias, e^-100 is as good as 0 (processed logprobs renormalise)
        self.logit_bias = {int(t): -100.0 for t in blocked_token_ids} or None
        self.static_prefix, self.synced = s.static_prefix, False  # synced once (a frozen vision tower)
        self.multimodal = bool(mm)
        extra = {"limit_mm_per_prompt": {"image": mm, "video": mm}} if mm else {}
        if kv_bytes:  # takes precedence over mem_util for the KV cache
            extra["kv_cache_memory_bytes"] = kv_bytes
        extra.update(cuda_graph_config(max_batch, s.enforce_eager))
        start = f"start (--engine_mem_util {mem_util} of the GPU)"  # vLLM's own refusal is a traceback
        if not kv_bytes and (error := memory_error("vLLM", mem_util * torch.cuda.mem_get_info()[1], start)):
            raise error
        self.llm = LLM(model=model_dir, load_format="dummy", tensor_parallel_size=s.tp_size, dtype=dtype,
                       distributed_executor_backend="external_launcher", gpu_memory_utilization=mem_util,
                       enable_sleep_mode=s.sleep != "never", seed=self.seed, max_model_len=s.max_model_len,
                       enforce_eager=s.enforce_eager, logprobs_mode="processed_logprobs",
                       enable_prefix_caching=s.prefix_caching, **extra)
        self.group_ranks, self.group_index, self.tp_group = engine_group(s.tp_size)

    def _runner_model(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    def generate(self, prompt_token_ids, max_new_tokens, temperature=1.0, top_p=1.0, mm=None,
                 logprob_every=1):
        from vllm import SamplingParams

        mm = mm or [None] * len(prompt_token_ids)
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(mm)
        # greedy: vLLM takes no request of n (a sample each)
        requests = engine_requests(prompt_token_ids, limits, mm, logprob_every, group=temperature > 0)
        # every rank of a group must submit the same requests; sizes in samples, as the outputs come
        requests, sizes = self._gathered(requests, lambda mine: sum(r.n for r in mine))
        self.calls += 1
        if not requests:  # (partial rollout: a rank may have nothing left to generate in a round)
            return []
        # flat_logprobs: flat float lists, not an object per token; vLLM returns a step's tokens past a stop
        # text too (cut_at_stop drops them)
        common = dict(temperature=temperature, top_p=top_p if temperature else 1.0, top_k=-1,
                      detokenize=bool(self.stop), stop=list(self.stop), include_stop_str_in_output=True,
                      skip_special_tokens=False, stop_token_ids=list(self.stop_token_ids),
                      logit_bias=self.logit_bias, flat_logprobs=True)
        seed = self.seed * 1_000_003 + self.calls * 10_007
        params, shared, first = [], {}, 0
        for r in requests:
            # per-request seeds, identical across a TP group, keep its ranks in step; vLLM gives sample j of
            # a request of n the seed + j, so each sample has the seed of its place in the call
            key = (r.limit, r.want, r.n, (seed + first) % 2**31 if self.tp_group is not None else None)
            if key not in shared:
                shared[key] = SamplingParams(max_tokens=r.limit, logprobs=0 if r.want else None, n=r.n,
                                             seed=key[3], **common)
            params.append(shared[key])
            first += r.n
        # no garbage collection in the call: vLLM's decode loop allocates per token, and each collection
        # would walk the trainer's heap
        collecting = gc.isenabled()
        gc.disable()
        try:
            outputs = self.llm.generate([r.prompt for r in requests], params, use_tqdm=False)
        finally:
            if collecting:
                gc.enable()
        gens = []
        for r, out in zip(requests, outputs):
            if "multi_modal_data" in r.prompt and list(out.prompt_token_ids) != r.ids:
                raise ConfigError(f"prompt {len(gens)}: vLLM expanded it to {len(out.prompt_token_ids)} "
                                 f"tokens, the trainer's has {len(r.ids)}: "
                                 "is the engine's image processor (min / max pixels) the trainer's?")
            for c in out.outputs:  # the n samples, in order
                gens.append(cut_at_stop(list(c.token_ids), list(c.logprobs.logprobs) if r.want else None,
                                        self.tokenizer, self.stop, self.stop_token_ids))
        return slice_for_rank(gens, sizes, self.group_index) if sizes else gens

    def _release(self):
        self.llm.sleep(level=self.sleep_level)

    def _resume(self, tags):
        self.llm.wake_up(tags=tags)

    @property
    def weight_bytes(self):
        return sum(p.numel() * p.element_size() for p in self._runner_model().parameters())

    @torch.no_grad()
    def update_weights(self, model):
        self.wake_up(["weights"])  # the KV cache stays asleep until wake_up()
        target = self._runner_model()
        weights = iter_weights(model, self.dtype, self.static_prefix if self.synced else None)
        for bucket in buckets(weights, self.bucket_bytes):
            target.load_weights(bucket)
        self.synced = True
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        if self.multimodal:  # and cached image embeddings by the old vision tower
            self.llm.llm_engine.reset_encoder_cache()
