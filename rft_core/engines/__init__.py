"""Rollout engines, one per `--engine_type`: hf (engines/hf.py), vllm and sglang (colocated in every training
process: engines/vllm.py, engines/sglang.py). Each offers `engines.base.Engine`'s calls, so the scripts never
branch on it; vllm and sglang are imported only when asked for."""

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import replace

import torch

from rft_core.distributed import sharding
from rft_core.engines.colocation import kv_cache_bytes
from rft_core.engines.hf import HFEngine
from rft_core.errors import ConfigError, MissingDependency
from rft_core.models import cache_root
from rft_core.multimodal import video_processor_like, vision_token_ids


def hf_architecture(model):
    """The class name vLLM looks the model up by: a LoRA model's base's, not FSDP2's FSDP<class>."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return next(c.__name__ for c in type(base).__mro__ if not c.__name__.startswith("FSDP"))


def engine_dir(config, tokenizer, processor=None):
    """The config, tokenizer and processor directory the engine reads, kept under cache_root()/engine by a
    hash of its files: vLLM keys its compile cache by the path (a new one recompiles: ~20 s at 135M)."""
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
    """hf, vllm or sglang for --engine_type; raises naming the fix when the one asked for cannot run."""
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


def create_engine(settings, model, tokenizer, processor=None):
    """The engine of settings (the plan's `engine`), with the model's current weights. processor (a VL
    model's): vLLM processes images with its settings, SGLang takes the trainer's pixels; neither samples the
    vision placeholders (the trainer's LM head blocks them too: vision.py)."""
    kind = resolve_engine_type(settings.type)  # (the plan's is resolved already; a direct call's may not be)
    if kind == "hf":
        dtype = torch.bfloat16 if settings.bf16 else None
        return HFEngine(model, tokenizer, settings.micro_batch_size, dtype,
                        synced_gpus=sharding(model) is not None, stop=settings.stop,
                        stop_token_ids=settings.stop_token_ids)
    text_config = model.config.get_text_config()
    heads, tp_size = getattr(text_config, "num_attention_heads", None), settings.tp_size
    if heads and heads % tp_size:  # SmolLM2-135M has 9 heads: TP 1 only
        raise ConfigError(f"--engine_tp_size {tp_size} must divide the model's {heads} attention heads")
    model.config.architectures = [hf_architecture(model)]
    model_dir = engine_dir(model.config, tokenizer, processor)  # weights come by sync below
    # a prompt that would not fit beside a whole response was skipped at encoding (checks.prompt_limit)
    max_len = min(settings.max_model_len, getattr(text_config, "max_position_embeddings", 1 << 30))
    settings = replace(settings, max_model_len=max_len)
    if processor is None:
        settings = replace(settings, limit_mm_per_prompt=None, static_prefix=None)
    blocked = vision_token_ids(tokenizer) if processor is not None else ()
    budget = settings.mem_util * torch.cuda.mem_get_info()[1]
    requests = max(1, settings.requests) * tp_size
    kv_bytes = kv_cache_bytes(model.config, requests, max_len, budget)
    if kind == "sglang":  # (each engine's module is imported only when it runs)
        from rft_core.engines.sglang import SGLangEngine

        # the same cap of a small model's KV cache, in tokens; bf16 weights, per engine
        tokens = 2 * requests * max_len if kv_bytes else None
        weight_bytes = 2 * sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        engine = SGLangEngine(model_dir, tokenizer.eos_token_id, settings, max_total_tokens=tokens,
                              weight_bytes=weight_bytes, blocked_token_ids=blocked,
                              multimodal=processor is not None, tokenizer=tokenizer)
    else:
        from rft_core.engines.vllm import VLLMEngine

        engine = VLLMEngine(model_dir, tokenizer.eos_token_id, settings, kv_bytes=kv_bytes,
                            max_batch=requests, blocked_token_ids=blocked, tokenizer=tokenizer)
    engine.update_weights(model)
    return engine
