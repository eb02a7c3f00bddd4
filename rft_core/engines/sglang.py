"""SGLang rollout engine, colocated (`--engine_type sglang`): the vLLM engine's interface and lifecycle.
Design: docs/engines.md; images and videos: docs/vision_language.md.

`sglang.Engine` runs the model in one scheduler subprocess per GPU. The first rank of each group of
`--engine_tp_size` consecutive ranks owns the engine and generates the group's prompts. Sampling logprobs are
taken before top-p (vLLM's after: equal at top_p 1). Without a tokenizer SGLang refuses stop texts: they are
cut after it returns (cut_at_stop), so a turn ending at one still generates on to its limit."""

import asyncio
import os
import time

import torch

from rft_core.engines.base import Generation, cut_at_stop, wants_logprobs
from rft_core.engines.colocation import Colocated, engine_group, free_port, slice_for_rank
from rft_core.engines.sync import buckets, iter_weights
from rft_core.errors import ConfigError


def sampling_params(limits, temperature, top_p, stop_token_ids, blocked_token_ids=()):
    """One SGLang sampling-params dict per request; blocked_token_ids get -100 (vLLM's largest bias)."""
    bias = {"logit_bias": {str(t): -100.0 for t in blocked_token_ids}} if blocked_token_ids else {}
    return [{"max_new_tokens": limit, "temperature": temperature, "top_p": top_p if temperature else 1.0,
             "stop_token_ids": list(stop_token_ids), **bias} for limit in limits]


def processor_output(mm):
    """A prompt's images as the trainer's pixels and grids, so SGLang keeps its ids and runs no processor."""
    if mm is None:
        return [None]
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return [{"format": "processor_output", **{k: mm[k] for k in keys if k in mm}}]


def sglang_param_name(name):
    """A parameter name as SGLang's load_weights expects it (transformers 5 nests a VL model's parts)."""
    for old, new in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def generation_of(out, with_logprobs=True):
    """A Generation from one SGLang output dict (output_token_logprobs: (logprob, id, text) per token)."""
    ids = list(out["output_ids"])
    if not with_logprobs:
        return Generation(ids, None)
    pairs = out["meta_info"]["output_token_logprobs"]
    if [t for _, t, _ in pairs] != ids:
        raise RuntimeError(f"SGLang returned logprobs for other tokens than its output ids ({len(pairs)} "
                           f"logprobs, {len(ids)} tokens)")
    return Generation(ids, [float(lp) for lp, _, _ in pairs])


class SGLangEngine(Colocated):
    name = "SGLang"

    def __init__(self, model_dir, eos_token_id, settings, max_total_tokens=None, weight_bytes=0,
                 blocked_token_ids=(), multimodal=False, dtype=torch.bfloat16, bucket_mb=256, tokenizer=None):
        """max_total_tokens: the KV cache's (None: mem_util's share); weight_bytes: the whole group's."""
        tp_size, static_prefix = settings.tp_size, settings.static_prefix
        self.group_ranks, self.group_index, self.tp_group = engine_group(tp_size)
        rank = self.group_ranks[self.group_index]
        self.sleep_mode, self.dtype, self.bucket_bytes = settings.sleep, dtype, bucket_mb << 20
        self.sleeping, self.slept_bytes, self.tokenizer = set(), 0, tokenizer
        self.stop, self.stop_token_ids = settings.stop, (eos_token_id, *settings.stop_token_ids)
        self.weight_bytes = weight_bytes // tp_size  # of this GPU's scheduler
        self.blocked_token_ids = list(blocked_token_ids)
        self.static_prefix, self.synced = static_prefix, False  # weights synced once (a frozen vision tower)
        self.llm = None
        if multimodal and not static_prefix:  # a trained vision tower: cached image embeddings go stale
            os.environ["SGLANG_VLM_CACHE_SIZE_MB"] = "0"  # read by the schedulers SGLang starts
        if self.group_index == 0:
            seed = settings.seed + rank // tp_size
            self.llm = self._start(model_dir, settings, seed, dtype, max_total_tokens)
        self._barrier()

    def _start(self, model_dir, settings, seed, dtype, max_total_tokens):
        import sglang
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # CUDA tensors sent to the schedulers name their GPU by UUID
        device, tp_size = torch.cuda.current_device(), settings.tp_size
        if tp_size > 1 and device + tp_size > torch.cuda.device_count():
            raise ConfigError(f"--engine_tp_size {tp_size}: the group's GPUs must be cuda:{device} and the "
                              "next ones on this node (one process per GPU, in local-rank order)")
        torch.cuda.empty_cache()  # SGLang takes its share of the memory free when it starts
        free, total = torch.cuda.mem_get_info()
        fraction = min(0.95, settings.mem_util * total / free)  # of the free memory: mem_util of the GPU
        extra = {"max_total_tokens": max_total_tokens} if max_total_tokens else {}
        # a scheduler inheriting torchrun's TORCHELASTIC_USE_AGENT_STORE waits on a store nobody serves and
        # hangs for NCCL's ten-minute timeout, silently (pytorch/pytorch#192113)
        agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        try:
            return sglang.Engine(
                model_path=model_dir, load_format="dummy", skip_tokenizer_init=True, log_level="error",
                dtype=str(dtype).removeprefix("torch."), tp_size=tp_size, base_gpu_id=device,
                nccl_port=free_port(), random_seed=seed, mem_fraction_static=fraction, **extra,
                context_length=settings.max_model_len, enable_memory_saver=settings.sleep != "never",
                disable_cuda_graph=settings.enforce_eager,
                enable_weights_cpu_backup=settings.sleep_level == 1)
        finally:
            if agent_store is not None:
                os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store

    def _barrier(self):
        if self.tp_group is not None:
            torch.distributed.barrier(group=self.tp_group)

    def _any(self, flag):
        if self.tp_group is None:
            return bool(flag)
        t = torch.tensor(float(flag), device="cuda")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.tp_group)
        return bool(t.item())

    def generate(self, prompt_token_ids, max_new_tokens, temperature=1.0, top_p=1.0, mm=None,
                 logprob_every=1):
        n = len(prompt_token_ids)
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
        mm = mm or [None] * n
        rows = [(list(p), limit, wants_logprobs(i, logprob_every), m)
                for i, (p, limit, m) in enumerate(zip(prompt_token_ids, limits, mm))]
        rows, sizes = self._gathered(rows)  # the group's first rank generates everyone's requests
        gens = []
        if self.llm is not None and rows:
            limits = [limit for _, limit, _, _ in rows]
            params = sampling_params(limits, temperature, top_p, self.stop_token_ids, self.blocked_token_ids)
            if any(m for *_, m in rows):
                outs = self._generate_each(rows, params)
            else:
                outs = self.llm.generate(input_ids=[ids for ids, *_ in rows], sampling_params=params,
                                         return_logprob=[want for _, _, want, _ in rows])
            for i, (out, (ids, *_)) in enumerate(zip(outs, rows)):
                made = out["meta_info"]["prompt_tokens"]
                if made != len(ids):  # image-token accounting
                    raise ConfigError(f"prompt {i}: SGLang made it {made} tokens, the trainer's has "
                                      f"{len(ids)}")
            gens = [generation_of(out, want) for out, (_, _, want, _) in zip(outs, rows)]
            gens = [cut_at_stop(g.token_ids, g.logprobs, self.tokenizer, self.stop, self.stop_token_ids)
                    for g in gens]
        if self.tp_group is not None:
            box = [gens]
            torch.distributed.broadcast_object_list(box, group_src=0, group=self.tp_group)
            gens = box[0]
        return slice_for_rank(gens, sizes, self.group_index) if sizes else gens

    def _generate_each(self, rows, params):
        """A request per image prompt, all in flight: SGLang 0.5.17 loses batched ones that finish early."""
        async def each():
            return await asyncio.gather(*(
                self.llm.async_generate(input_ids=ids, sampling_params=p, return_logprob=want,
                                        image_data=processor_output(m) if m else None)
                for (ids, _, want, m), p in zip(rows, params)))

        return self.llm.loop.run_until_complete(each())

    def _release(self):
        if self.llm is not None:
            self._flush()  # release asserts an idle scheduler
            self.llm.release_memory_occupation(tags=["kv_cache", "weights"])
        self._barrier()

    def _resume(self, tags):
        if self.llm is not None:
            self.llm.resume_memory_occupation(tags=tags)
        self._barrier()

    @torch.no_grad()
    def update_weights(self, model):
        """Every rank takes part in the gather (ZeRO-3 / FSDP2); the group's first rank sends."""
        self.wake_up(["weights"])  # the KV cache stays asleep until wake_up()
        weights = iter_weights(model, self.dtype, self.static_prefix if self.synced else None)
        weights = ((sglang_param_name(name), t) for name, t in weights)
        for bucket in buckets(weights, self.bucket_bytes):
            if self.llm is not None:
                ok, message = self.llm.update_weights_from_tensor(bucket, flush_cache=False)
                if not ok:
                    raise RuntimeError(f"SGLang refused the weights: {message}")
        self.synced = True
        if self.llm is not None:
            self._flush()  # cached KV blocks were computed by the old weights
        self._barrier()

    def _flush(self, timeout_s=60.0):
        """Empty the prefix cache once the scheduler is idle: overlap scheduling may hold the last batch a
        moment after generate returned, and SGLang declines the flush then."""
        deadline = time.monotonic() + timeout_s
        while not self.llm.flush_cache().success:
            if time.monotonic() > deadline:
                raise RuntimeError(f"SGLang's scheduler stayed busy {timeout_s:.0f} s after generating")
            time.sleep(0.005)
