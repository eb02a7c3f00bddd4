"""SGLang rollout engine, colocated (`--engine_type sglang`): the vLLM engine's interface and behaviour.
Design: docs/engines.md; images and videos: docs/vision_language.md.

SGLang's offline `sglang.Engine` keeps its tokenizer manager in the calling process and runs the model in
one scheduler subprocess per GPU (its own CUDA context, on the trainer's GPU). The first rank of each group
of `--engine_tp_size` consecutive ranks owns the engine; every rank of the group sends it its prompts
(gathered) and gets back its own outputs, in order (broadcast). Token ids in, token ids out.

Step lifecycle, as vLLM's: generate -> sleep (release_memory_occupation: KV cache and weights) -> train ->
update_weights (resume the weights, load the new ones bucket by bucket with update_weights_from_tensor: CUDA
tensors travel as IPC handles; each scheduler loads its shard) -> wake_up (KV cache). The engine starts
from random weights (load_format dummy); the first sync, before step 0, gives it the trained model.

Sampling logprobs come from the temperature-scaled distribution before top-p (vLLM's are after it: equal at
the default top_p 1). SGLang runs without a tokenizer (it refuses stop texts then): it stops at EOS and the
stop token ids, and a response's stop texts are found after it returns (cut_at_stop, with the trainer's
tokenizer), so a turn that ends at a stop text still generates on to its limit.
"""

import asyncio
import os
import time

import torch

from rft_core.engines.base import Generation, cut_at_stop, wants_logprobs
from rft_core.engines.colocation import (
    engine_group,
    flatten_group,
    free_port,
    short_for_training,
    slice_for_rank,
    wake_error,
)
from rft_core.engines.sync import buckets, iter_weights
from rft_core.errors import ConfigError, OutOfMemory


def sampling_params(limits, temperature, top_p, stop_token_ids, blocked_token_ids=()):
    """One SGLang sampling-params dict per request (its own max_new_tokens); temperature 0 is greedy;
    stop_token_ids (EOS among them) end a response; blocked_token_ids are never sampled (-100 on their
    logits, vLLM's largest bias)."""
    bias = {"logit_bias": {str(t): -100.0 for t in blocked_token_ids}} if blocked_token_ids else {}
    return [{"max_new_tokens": limit, "temperature": temperature, "top_p": top_p if temperature else 1.0,
             "stop_token_ids": list(stop_token_ids), **bias} for limit in limits]


def processor_output(mm):
    """One prompt's images and videos as SGLang's pre-processed input (a list of one dict), or [None] for a
    text prompt: the trainer's pixel values and grids, so SGLang keeps the prompt's ids and runs no
    processor."""
    if mm is None:
        return [None]
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return [{"format": "processor_output", **{k: mm[k] for k in keys if k in mm}}]


def sglang_param_name(name):
    """A trainer parameter name as SGLang's load_weights expects it: a vision-language model's language model
    and vision tower sit at the top level there (transformers 5 nests both under `model.`)."""
    for old, new in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def generation_of(out, with_logprobs=True):
    """A Generation from one SGLang output dict: its token ids and (with_logprobs) each one's sampling logprob
    (meta_info["output_token_logprobs"] holds (logprob, token id, text) per generated token)."""
    ids = list(out["output_ids"])
    if not with_logprobs:
        return Generation(ids, None)
    pairs = out["meta_info"]["output_token_logprobs"]
    if [t for _, t, _ in pairs] != ids:
        raise RuntimeError(f"SGLang returned logprobs for other tokens than its output ids ({len(pairs)} "
                           f"logprobs, {len(ids)} tokens)")
    return Generation(ids, [float(lp) for lp, _, _ in pairs])


class SGLangEngine:
    def __init__(self, model_dir, eos_token_id, settings, max_total_tokens=None, weight_bytes=0,
                 blocked_token_ids=(), multimodal=False, dtype=torch.bfloat16, bucket_mb=256, tokenizer=None):
        """settings: an EngineSettings (engines/base.py); max_total_tokens: the KV cache's size in tokens
        (None: SGLang's share of mem_util); weight_bytes: the model's, all GPUs of the group together;
        tokenizer: the trainer's, which finds settings.stop's texts in a response (cut_at_stop)."""
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
        # the schedulers start without torchrun's (accelerate launch's) TORCHELASTIC_USE_AGENT_STORE: one
        # inheriting it makes every rank of its own process group a client of a store on SGLang's port that
        # nobody serves, and hangs for NCCL's ten-minute timeout, silently (pytorch/pytorch#192113). The
        # trainer's own group is already made; the variable comes back after.
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
        """Whether flag holds on any rank of the group (they act together)."""
        if self.tp_group is None:
            return bool(flag)
        t = torch.tensor(float(flag), device="cuda")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.tp_group)
        return bool(t.item())

    def generate(self, prompt_token_ids, max_new_tokens, temperature=1.0, top_p=1.0, mm=None,
                 logprob_every=1):
        """max_new_tokens: one for all, or a list (one per prompt)."""
        n = len(prompt_token_ids)
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
        mm = mm or [None] * n
        rows = [(list(p), limit, wants_logprobs(i, logprob_every), m)
                for i, (p, limit, m) in enumerate(zip(prompt_token_ids, limits, mm))]
        sizes = None
        if self.tp_group is not None:  # the group's first rank generates everyone's requests
            per_rank = [None] * len(self.group_ranks)
            torch.distributed.all_gather_object(per_rank, rows, group=self.tp_group)
            rows, sizes = flatten_group(per_rank)
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
        """Image prompts: one request each, all in flight together. (SGLang 0.5.17 processes a batch's image
        requests one after another and loses the result of one that finishes before the last is sent: a
        KeyError in its tokenizer manager.)"""
        async def each():
            return await asyncio.gather(*(
                self.llm.async_generate(input_ids=ids, sampling_params=p, return_logprob=want,
                                        image_data=processor_output(m) if m else None)
                for (ids, _, want, m), p in zip(rows, params)))

        return self.llm.loop.run_until_complete(each())

    def sleep(self, needed_bytes=None):
        """Free the engine's memory for training; auto: only when training is short of needed_bytes on some
        GPU of the group."""
        if self.sleep_mode == "never" or self.sleeping:
            return False
        short = self.sleep_mode == "always" or short_for_training(needed_bytes)
        if not self._any(short):
            return False
        before, _ = torch.cuda.mem_get_info()
        if self.llm is not None:
            self._flush()  # release asserts an idle scheduler
            self.llm.release_memory_occupation(tags=["kv_cache", "weights"])
        self._barrier()
        self.slept_bytes = torch.cuda.mem_get_info()[0] - before  # this GPU's weights and KV cache, measured
        self.sleeping = {"weights", "kv_cache"}
        return True

    def _wake_bytes(self, tags):
        need = {"weights": self.weight_bytes, "kv_cache": max(0, self.slept_bytes - self.weight_bytes)}
        return sum(need[t] for t in tags)

    def can_wake(self):
        """Whether what sleeps would fit on this GPU now (the trainer's cached blocks released)."""
        return wake_error("SGLang", self._wake_bytes(self.sleeping), self.sleeping) is None

    def wake_up(self, tags=None):
        """Map the slept memory back (tags: "weights", "kv_cache"; default both), once wake_error finds that
        it fits on every GPU of the group."""
        tags = [t for t in (tags or ["weights", "kv_cache"]) if t in self.sleeping]
        if not tags:
            return
        error = wake_error("SGLang", self._wake_bytes(tags), tags)
        if self._any(error is not None):
            raise error or OutOfMemory("SGLang cannot wake: another GPU of its group is short of memory (its "
                                       "rank's error says how much)")
        if self.llm is not None:
            self.llm.resume_memory_occupation(tags=tags)
        self._barrier()
        self.sleeping -= set(tags)

    @torch.no_grad()
    def update_weights(self, model):
        """Load the trainer's weights into the engine, bucket by bucket, cast to the engine's dtype. Every
        rank takes part in the gather (ZeRO-3 / FSDP2); the group's first rank sends."""
        self.wake_up(["weights"])  # the KV cache stays asleep until wake_up()
        # after the first sync, only what trains
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
        """Empty the prefix cache once the scheduler is idle: with overlap scheduling it may hold the last
        batch a moment after generate returned, and then SGLang declines the flush (its release asserts)."""
        deadline = time.monotonic() + timeout_s
        while not self.llm.flush_cache().success:
            if time.monotonic() > deadline:
                raise RuntimeError(f"SGLang's scheduler stayed busy {timeout_s:.0f} s after generating")
            time.sleep(0.005)
