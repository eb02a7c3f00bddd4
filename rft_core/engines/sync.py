"""The weight sync from the trainer to a colocated engine (vLLM, SGLang): weights gathered whole one unit (a
layer) at a time, never the whole model on one rank, LoRA adapters merged, sent in `buckets`."""

import contextlib

import torch

from rft_core.models import merged_state_dict

# torch.compile, FSDP, ckpt
WRAPPER_SEGMENTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


@contextlib.contextmanager
def gathered(tensors):
    """Full copies of `tensors` within the block. Collective: every rank enters with the same tensors."""
    from torch.distributed.tensor import DTensor

    zero3 = [t for t in tensors if hasattr(t, "ds_id")]
    with contextlib.ExitStack() as stack:
        if zero3:
            import deepspeed

            stack.enter_context(deepspeed.zero.GatheredParameters(zero3, modifier_rank=None))
        # CPU-offloaded FSDP2 shards gather through the GPU (NCCL), far faster than gloo on CPU tensors
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        yield [(t.to(device) if device and t.device.type == "cpu" else t).full_tensor()
               if isinstance(t, DTensor) else t.data for t in tensors]


def units(model):
    """(prefix, module, recurse) of the units gathered one at a time: a ModuleList's element (a layer) or a
    LoRA layer whole; any other module its own parameters and buffers."""
    whole = {id(child) for m in model.modules() if isinstance(m, torch.nn.ModuleList) for child in m}
    whole |= {id(m) for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    inside = None  # prefix of the whole unit being skipped over
    for name, module in model.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        recurse = id(module) in whole
        inside = f"{name}." if recurse else inside
        yield name, module, recurse


def full_weights(model, dtype):
    """(name, full tensor cast to dtype) of model.state_dict() (LoRA merged, under the base's names); copies,
    valid after the gather. Collective under ZeRO-3 and FSDP2."""
    served = set(model.state_dict().keys())  # parameters and persistent buffers; no communication
    for prefix, module, recurse in units(model):
        named = [(f"{prefix}.{n}" if prefix else n, t) for n, t in
                 [*module.named_parameters(recurse=recurse), *module.named_buffers(recurse=recurse)]]
        named = [(n, t) for n, t in named if n in served]
        if not named:
            continue
        with gathered([t for _, t in named]) as full:
            state = dict(zip([n for n, _ in named], full))
            # only this unit's modules can hold its LoRA layers: no walk over the whole model per unit
            for name, tensor in merged_state_dict(model, state, module.named_modules(prefix=prefix)).items():
                yield name, tensor.detach().to(dtype, copy=True)


def vllm_param_name(name):
    """HF parameter name, wrapper prefixes removed: vLLM maps the rest itself (q/k/v -> qkv_proj...)."""
    parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
    while parts and parts[0] == "module":  # DDP / DeepSpeed wrap the whole model once (or twice)
        parts.pop(0)
    return ".".join(parts)


def iter_weights(model, dtype, skip_prefix=None):
    """full_weights under vLLM's names, less those under skip_prefix (a frozen vision tower, synced once)."""
    for name, tensor in full_weights(model, dtype):
        name = vllm_param_name(name)
        if not (skip_prefix and name.startswith(skip_prefix)):
            yield name, tensor


def buckets(weights, bucket_bytes):
    bucket, size = [], 0
    for name, tensor in weights:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
