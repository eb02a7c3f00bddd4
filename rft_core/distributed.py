"""Processes and shards: Accelerate shards (DeepSpeed ZeRO-3, FSDP2); here, the process groups, DeepSpeed's
config from our flags, how a model is sharded, and the frozen reference placed like the actor. The optimizer
(AdamW, accumulation, offload) is rft_core/optim.py's."""

import copy
import os

import torch

from rft_core.errors import ConfigError


def process_group_kwargs():
    """kwargs_handlers: DeepSpeed without a GPU (CPU tests) needs gloo, else accelerate sees one rank."""
    from accelerate.utils import InitProcessGroupKwargs

    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and not torch.cuda.is_available():
        return [InitProcessGroupKwargs(backend="gloo")]
    return None


def cpu_ranks():
    """Accelerator's `cpu`: True for several processes without a GPU (multi_gpu.yaml on a CPU machine), which
    then join over gloo; accelerate would take each for the only one. DeepSpeed's: process_group_kwargs."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or torch.cuda.is_available():
        return False
    if os.environ.get("ACCELERATE_USE_FSDP") == "true":  # accelerate would run DDP instead, without a word
        raise ConfigError("FSDP needs GPUs: on CPU use the multi_gpu.yaml or deepspeed_zero*.yaml config")
    return os.environ.get("ACCELERATE_USE_DEEPSPEED") != "true"


def end_run(accelerator):
    """Every rank's last call: wait (the main one writes the model), then end together (one exiting alone
    aborted once: gloo, ZeRO-3 + Ulysses on CPU, `terminate called without an active exception`)."""
    accelerator.wait_for_everyone()
    accelerator.end_training()


def sharding(model):
    """"zero3" (DeepSpeed partitioned parameters), "fsdp2" (DTensor parameters) or None."""
    from torch.distributed.tensor import DTensor

    param = next(model.parameters(), None)
    return "zero3" if hasattr(param, "ds_id") else "fsdp2" if isinstance(param, DTensor) else None


def configure_deepspeed(accelerator, rows_per_update, micro_batch_size, max_norm):
    """Fill what DeepSpeed's config cannot infer without a dataloader (before prepare). micro_batch_size None:
    by tokens (nominal accumulation one per sample: only the loss scale, which optim.accumulation_divisor
    reads back; optim.accumulate_over decides the boundaries)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    if not micro_batch_size or getattr(accelerator.parallelism_config, "sp_size", 1) > 1:
        micro_batch_size = 1  # (Ulysses is set up for DeepSpeed's micro-batch: one row per forward)
    grad_accum = rows_per_update // micro_batch_size
    plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=micro_batch_size,
                                   gradient_accumulation_steps=grad_accum,
                                   train_batch_size=micro_batch_size * grad_accum * accelerator.num_processes,
                                   gradient_clipping=max_norm,
                                   # keep our AdamW: DeepSpeedCPUAdam would drop its betas
                                   zero_force_ds_cpu_optimizer=False)
    # ZeRO-3's AdamW temporaries are a sub-group's size: DeepSpeed's default 1e9 asks 3.7 GiB at once, which
    # crashed the 3B shape on one H100 beside the sleeping engine; 1e8 asks 0.37 (a config file's value stays)
    plugin.deepspeed_config.setdefault("zero_optimization", {}).setdefault("sub_group_size", 10**8)
    if plugin.zero_stage == 3 and not plugin.zero3_init_flag:
        # else transformers builds every model partitioned (zero.Init; accelerate registers the config all the
        # same): a GGUF rebuild or a model from a config breaks. Load whole; prepare() partitions them.
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


def prepare_frozen(accelerator, model):
    """Place a frozen model (the reference) where it costs least: sharded like the actor under ZeRO-3 (an
    inference-only engine, offloaded if the actor is) and FSDP2 (the actor's mixed precision and offload),
    else a replica on the device (DDP, ZeRO-1/2: small next to the optimizer state they shard)."""
    model.requires_grad_(False).eval()
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.zero_stage == 3:
        import deepspeed

        config = copy.deepcopy(plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        config["zero_optimization"].pop("offload_optimizer", None)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # returns None, unlike nn.Module.eval
        return engine
    # accelerate's prepare() wants an optimizer with the model
    if accelerator.distributed_type.name == "FSDP":
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, model).eval()
    return model.to(accelerator.device)


def zero_offloads_optimizer(deepspeed):
    """Whether accelerate's DeepSpeed plugin (or None) runs ZeRO-Offload: the optimizer on the CPU already."""
    zero = (getattr(deepspeed, "deepspeed_config", None) or {}).get("zero_optimization", {})
    return zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
