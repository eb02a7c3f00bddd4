"""Rollout engines. Every engine offers the same four calls, so the scripts never branch on it:

    generate(prompt_token_ids, max_new_tokens, temperature, top_p, mm=None, logprob_every=1)
            -> list[Generation]
        one Generation per prompt, in order: the response token ids (ending with EOS unless the
        length limit cut it) and the logprob of each under the sampling distribution
        (temperature applied; temperature 0 means greedy, logprobs then at temperature 1), for every
        logprob_every-th prompt (0: none; the others' logprobs are None: vLLM builds a Python object per
        token it returns a logprob for, which costs up to 30% of a small model's generation);
        mm: per-prompt image inputs of a vision-language model (Experience.mm's form) or None
    sleep(needed_bytes)     free the engine's GPU memory for training (returns whether it slept)
    wake_up(tags=None)      take it back ("weights", "kv_cache", or both)
    update_weights(model)   load the trainer's current weights

HFEngine uses transformers `generate` on the training model itself: weights are shared, so
sleep / wake_up / update_weights have nothing to do. It is the engine wherever vLLM is absent.
"""

import importlib.util
import math
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from rft_core.distributed import sharding
from rft_core.errors import ConfigError, MissingDependency
from rft_core.multimodal import mm_inputs, video_processor_like, vision_token_ids


@dataclass
class Generation:
    token_ids: list
    logprobs: list  # the engine's sampling logprob of each token (None: not asked for)
    versions: list = None  # partial rollout: the policy version (weight syncs so far) that sampled each token


class HFEngine:
    def __init__(self, model, tokenizer, micro_batch_size=32, autocast_dtype=None, synced_gpus=False):
        self.model = model  # the unwrapped training model: always the current weights
        # sharded weights (ZeRO-3, FSDP2): every forward is a collective, so ranks keep stepping until all
        # are done
        self.synced_gpus = synced_gpus
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        self.autocast_dtype = autocast_dtype

    def sleep(self, needed_bytes=None):
        return False

    def wake_up(self, tags=None):
        pass

    def can_wake(self):
        return True

    def update_weights(self, model):
        self.model = model

    @torch.no_grad()
    def generate(self, prompt_token_ids, max_new_tokens, temperature=1.0, top_p=1.0, mm=None,
                 logprob_every=1):
        """max_new_tokens: one for all, or a list (one per prompt: requests of equal limits run together)."""
        was_training = self.model.training
        self.model.eval()  # also turns gradient checkpointing off, which `generate` cannot use
        mm = mm or [None] * len(prompt_token_ids)
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(mm)
        out = [None] * len(mm)
        for limit in dict.fromkeys(limits):  # in order of first appearance
            idx = [i for i, m in enumerate(limits) if m == limit]
            for j in range(0, len(idx), self.micro_batch_size):
                part = idx[j:j + self.micro_batch_size]
                gens = self._generate_batch([prompt_token_ids[i] for i in part], limit, temperature, top_p,
                                            [mm[i] for i in part])
                for i, g in zip(part, gens):
                    out[i] = g if wants_logprobs(i, logprob_every) else Generation(g.token_ids, None)
        self.model.train(was_training)
        return out

    def _generate_batch(self, prompts, max_new_tokens, temperature, top_p, mm):
        device = next(self.model.parameters()).device
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        width = max(len(p) for p in prompts)
        # (B, P)
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        # a vision-language model's image inputs, as the trainer builds them
        images = mm_inputs(mm, input_ids) or {}
        greedy = temperature == 0
        sampling = ({"do_sample": False} if greedy
                    else {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0})
        autocast = (torch.autocast(device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                    else nullcontext())
        with autocast:
            res = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                                      output_logits=True, return_dict_in_generate=True,
                                      synced_gpus=self.synced_gpus, **sampling, **images)
        responses = res.sequences[:, width:]  # (B, T)
        logits = torch.stack(res.logits, 1).float() / (1.0 if greedy else temperature)  # (B, T, V), raw
        lse = torch.logsumexp(logits, -1)  # (B, T)
        logprobs = logits.gather(-1, responses.unsqueeze(-1)).squeeze(-1) - lse  # (B, T)
        gens = []
        for ids, lps in zip(responses.tolist(), logprobs.tolist()):
            end = ids.index(eos) + 1 if eos in ids else len(ids)  # keep the EOS: it is an action too
            gens.append(Generation(ids[:end], lps[:end]))
        return gens


def wants_logprobs(index, every):
    """Whether request `index` of a generate call returns its logprobs (every: 1 all, k every k-th, 0 none)"""
    return bool(every) and index % every == 0


def hf_architecture(model):
    """The transformers class name vLLM looks the model up by: a LoRA model's base, and under FSDP2 the
    class it swapped out (fully_shard subclasses it as FSDP<class>)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # remote code too
    return next(c.__name__ for c in type(base).__mro__ if not c.__name__.startswith("FSDP"))


def resolve_engine_type(engine_type):
    """"hf", "vllm" or "sglang" for --engine_type ("auto": vllm with a GPU and vllm installed, else hf);
    raises naming the fix when vllm or sglang is asked for and cannot run here."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if engine_type == "auto":
        return "vllm" if has_vllm and torch.cuda.is_available() else "hf"
    if engine_type not in ("hf", "vllm", "sglang"):
        raise ConfigError(f"--engine_type {engine_type!r}: choose auto, hf, vllm or sglang")
    install = {"vllm": "pip install vllm==0.26.0", "sglang": "pip install sglang==0.5.17"}
    if engine_type != "hf" and importlib.util.find_spec(engine_type) is None:
        raise MissingDependency(f"--engine_type {engine_type} needs {engine_type} ({install[engine_type]}); "
                                "or use --engine_type hf")
    if engine_type != "hf" and not torch.cuda.is_available():
        raise ConfigError(f"--engine_type {engine_type} needs a CUDA GPU; use --engine_type hf on CPU")
    return engine_type


def engine_options(args, requests, sp_size=1):
    """create_engine's keywords from the training scripts' engine flags; requests: one generate call's.
    sp_size > 1 (sequence or context parallelism: Accelerate drops the prepared models' attention masks): the
    transformers engine generates one prompt at a time, without padding."""
    sleep = "always" if args.enable_engine_sleep else "never" if args.disable_engine_sleep else "auto"
    micro_batch_size = 1 if sp_size > 1 else args.micro_rollout_batch_size
    if args.partial_rollout:  # a generation round holds --inflight_ratio steps' worth of groups
        start = args.partial_order == "start"  # (start order: K + 1 in its first step)
        requests = math.ceil(requests * (args.max_staleness + 1 if start else args.inflight_ratio))
    return dict(micro_batch_size=micro_batch_size, bf16=args.bf16, tp_size=args.engine_tp_size,
                mem_util=args.engine_mem_util, sleep=sleep, sleep_level=args.engine_sleep_level,
                enforce_eager=args.engine_enforce_eager, requests=requests, seed=args.seed,
                max_model_len=args.prompt_max_len + args.generate_max_len)


def create_engine(engine_type, model, tokenizer, processor=None, *, micro_batch_size=32, bf16=False,
                  tp_size=1, mem_util=0.3, sleep="auto", sleep_level=1, enforce_eager=False,
                  max_model_len=2048, requests=None, limit_mm_per_prompt=None, static_prefix=None, seed=0):
    """The engine named by engine_type ("auto": vllm with a GPU and vllm installed, else hf).

    micro_batch_size, bf16: the HF engine's generate batch and autocast. The rest is vLLM's: tp_size ranks per
    engine, mem_util of the GPU for weights and KV cache, sleep "auto" | "always" | "never" at sleep_level,
    max_model_len (prompt + response), requests (one generate call's, per rank: sizes the KV cache of a small
    model), seed. processor: a vision-language model's image processor. vLLM processes the images itself,
    with this processor's settings (so its image grids are the trainer's), at most limit_mm_per_prompt images
    per prompt; SGLang takes the trainer's pixels. Both never sample the vision placeholders (the trainer's
    model blocks them at its LM head: vision.py) and sync the parameters under static_prefix (a frozen vision
    tower) once.
    """
    engine_type = resolve_engine_type(engine_type)
    if engine_type == "hf":
        dtype = torch.bfloat16 if bf16 else None
        return HFEngine(model, tokenizer, micro_batch_size, dtype, synced_gpus=sharding(model) is not None)
    text_config = model.config.get_text_config()
    heads = getattr(text_config, "num_attention_heads", None)
    if heads and heads % tp_size:  # SmolLM2-135M has 9 heads: TP 1 only
        raise ConfigError(f"--engine_tp_size {tp_size} must divide the model's {heads} attention heads")
    from rft_core.vllm_engine import VLLMEngine, kv_cache_bytes

    # vLLM reads the architecture and tokenizer from a directory; weights come by sync below.
    model_dir = tempfile.mkdtemp(prefix="rft_engine_")
    model.config.architectures = [hf_architecture(model)]
    model.config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    max_len = min(max_model_len, getattr(text_config, "max_position_embeddings", 1 << 30))
    vision = {}
    if processor is not None:  # the trainer's image and video processing settings
        processor.save_pretrained(model_dir)
        # vLLM's Qwen2-VL processor needs torchvision too
        video_processor_like(processor).save_pretrained(model_dir)
        vision = dict(limit_mm_per_prompt=limit_mm_per_prompt, blocked_token_ids=vision_token_ids(tokenizer),
                      static_prefix=static_prefix)  # a frozen vision tower is synced once
    budget = mem_util * torch.cuda.mem_get_info()[1]
    kv_bytes = kv_cache_bytes(model.config, max(1, requests or 1) * tp_size, max_len, budget)
    if engine_type == "sglang":
        from rft_core.sglang_engine import SGLangEngine

        # the same cap of a small model's KV cache, in tokens; bf16 weights, per engine
        tokens = 2 * max(1, requests or 1) * tp_size * max_len if kv_bytes else None
        weight_bytes = 2 * sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        vision = {k: v for k, v in vision.items() if k != "limit_mm_per_prompt"}
        engine = SGLangEngine(model_dir, tokenizer.eos_token_id, tp_size, mem_util, sleep, sleep_level, seed,
                              max_len, enforce_eager, max_total_tokens=tokens, weight_bytes=weight_bytes,
                              multimodal=processor is not None, **vision)
    else:
        engine = VLLMEngine(model_dir, tokenizer.eos_token_id, tp_size, mem_util, sleep, sleep_level, seed,
                            max_len, enforce_eager, kv_bytes=kv_bytes, max_batch=(requests or 1) * tp_size,
                            **vision)
    engine.update_weights(model)
    return engine
