"""Rollout engines, one per `--engine_type`: hf (transformers `generate`: engines/hf.py), vllm and sglang
(colocated in every training process: engines/vllm.py, engines/sglang.py, sharing engines/sync.py). Each
offers the calls written down in `engines.base.Engine`, so the scripts never branch on it:

    generate(prompt_token_ids, max_new_tokens, ...) -> list[Generation]
    sleep(needed_bytes=None) -> bool, wake_up(tags=None), can_wake() -> bool, update_weights(model)

This module picks and builds one (`resolve_engine_type`, `create_engine`, whose keywords the plan makes:
rft_core/plan.py); vllm and sglang are imported only when asked for.
"""

import hashlib
import importlib.util
import os
import shutil
import tempfile

import torch

from rft_core.distributed import sharding
from rft_core.engines.hf import HFEngine
from rft_core.engines.sync import kv_cache_bytes
from rft_core.errors import ConfigError, MissingDependency
from rft_core.models import cache_root
from rft_core.multimodal import video_processor_like, vision_token_ids


def hf_architecture(model):
    """The transformers class name vLLM looks the model up by: a LoRA model's base, and under FSDP2 the
    class it swapped out (fully_shard subclasses it as FSDP<class>)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # remote code too
    return next(c.__name__ for c in type(base).__mro__ if not c.__name__.startswith("FSDP"))


def engine_dir(config, tokenizer, processor=None):
    """The directory vLLM and SGLang read the architecture, tokenizer and (a vision-language model's) image
    and video processing settings from: written aside, then kept under cache_root()/engine by a hash of its
    files, so that a later run with the same files finds the same path. vLLM keys its torch.compile cache by
    the model's path: a new directory every run would compile again (~20 s at 135M on an H100)."""
    root = cache_root()
    try:
        parent = os.path.join(root, "engine") if root else None
        if parent:
            os.makedirs(parent, exist_ok=True)
    except OSError:  # a read-only home: this run's own directory (compiled afresh)
        parent = None
    staged = tempfile.mkdtemp(prefix=".part-" if parent else "rft_engine_", dir=parent)
    config.save_pretrained(staged)
    tokenizer.save_pretrained(staged)
    if processor is not None:  # the trainer's image and video processing settings
        processor.save_pretrained(staged)
        video_processor_like(processor).save_pretrained(staged)  # vLLM's Qwen2-VL processor needs it
    if parent is None:
        return staged
    digest = hashlib.sha256()
    for name in sorted(os.listdir(staged)):
        with open(os.path.join(staged, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read() + b"\0")
    path = os.path.join(parent, digest.hexdigest()[:16])
    try:
        os.replace(staged, path)
    except OSError:  # there already (an earlier run, or another rank of this one): the same files
        shutil.rmtree(staged, ignore_errors=True)
    return path


def resolve_engine_type(engine_type):
    """"hf", "vllm" or "sglang" for --engine_type ("auto": with a GPU, vllm where installed, else sglang where
    installed; else hf); raises naming the fix when vllm or sglang is asked for and cannot run here."""
    if engine_type == "auto":
        installed = [e for e in ("vllm", "sglang") if importlib.util.find_spec(e) is not None]
        return installed[0] if installed and torch.cuda.is_available() else "hf"
    if engine_type not in ("hf", "vllm", "sglang"):
        raise ConfigError(f"--engine_type {engine_type!r}: choose auto, hf, vllm or sglang")
    install = {"vllm": "pip install vllm==0.26.0", "sglang": "pip install sglang==0.5.17"}
    if engine_type != "hf" and importlib.util.find_spec(engine_type) is None:
        raise MissingDependency(f"--engine_type {engine_type} needs {engine_type} ({install[engine_type]}); "
                                "or use --engine_type hf")
    if engine_type != "hf" and not torch.cuda.is_available():
        raise ConfigError(f"--engine_type {engine_type} needs a CUDA GPU; use --engine_type hf on CPU")
    return engine_type


def create_engine(engine_type, model, tokenizer, processor=None, *, micro_batch_size=32, bf16=False,
                  tp_size=1, mem_util=0.3, sleep="auto", sleep_level=1, enforce_eager=False,
                  max_model_len=2048, requests=None, limit_mm_per_prompt=None, static_prefix=None, seed=0,
                  prefix_caching=True):
    """The engine named by engine_type ("auto": resolve_engine_type's choice).

    micro_batch_size, bf16: the HF engine's generate batch and autocast. The rest is vLLM's: tp_size ranks per
    engine, mem_util of the GPU for weights and KV cache, sleep "auto" | "always" | "never" at sleep_level,
    max_model_len (prompt + response), requests (one generate call's, per rank: sizes the KV cache of a small
    model), seed, prefix_caching (vLLM's: off where no call repeats a context). processor: a vision-language
    model's image processor. vLLM processes the images itself,
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
    model.config.architectures = [hf_architecture(model)]
    model_dir = engine_dir(model.config, tokenizer, processor)  # weights come by sync below
    max_len = min(max_model_len, getattr(text_config, "max_position_embeddings", 1 << 30))
    vision = {}
    if processor is not None:
        vision = dict(limit_mm_per_prompt=limit_mm_per_prompt, blocked_token_ids=vision_token_ids(tokenizer),
                      static_prefix=static_prefix)  # a frozen vision tower is synced once
    budget = mem_util * torch.cuda.mem_get_info()[1]
    kv_bytes = kv_cache_bytes(model.config, max(1, requests or 1) * tp_size, max_len, budget)
    if engine_type == "sglang":  # (each engine's module is imported only when it runs)
        from rft_core.engines.sglang import SGLangEngine

        # the same cap of a small model's KV cache, in tokens; bf16 weights, per engine
        tokens = 2 * max(1, requests or 1) * tp_size * max_len if kv_bytes else None
        weight_bytes = 2 * sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        vision = {k: v for k, v in vision.items() if k != "limit_mm_per_prompt"}
        engine = SGLangEngine(model_dir, tokenizer.eos_token_id, tp_size, mem_util, sleep, sleep_level, seed,
                              max_len, enforce_eager, max_total_tokens=tokens, weight_bytes=weight_bytes,
                              multimodal=processor is not None, **vision)
    else:
        from rft_core.engines.vllm import VLLMEngine

        engine = VLLMEngine(model_dir, tokenizer.eos_token_id, tp_size, mem_util, sleep, sleep_level, seed,
                            max_len, enforce_eager, kv_bytes=kv_bytes, max_batch=(requests or 1) * tp_size,
                            prefix_caching=prefix_caching, **vision)
    engine.update_weights(model)
    return engine
