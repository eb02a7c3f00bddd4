"""What changes when the actor is sharded (DeepSpeed ZeRO-3, FSDP2) or run by a DeepSpeed engine.

Accelerate does the sharding; this module covers the few places the scripts touch whole weights:
- `full_weights(model)`: every weight as a full tensor, gathering one unit at a time (a transformer
  layer, or one other module's own parameters), never the whole model on one rank. The weight sync
  to vLLM and nothing else uses it; a LoRA model's adapters are merged unit by unit.
- `prepare_frozen`: the reference model sharded like the actor (ZeRO-3: its own inference engine;
  FSDP2: accelerate's fully_shard recipe), else a replica on the device.
- `configure_deepspeed`: the batch sizes and clipping DeepSpeed wants in its config, from our flags.
- `sharding(model)`: "zero3", "fsdp2" or None, read off the parameters themselves.
"""

import contextlib
import copy
import os

import torch


def process_group_kwargs():
    """Accelerator kwargs_handlers: DeepSpeed without a GPU (the CPU tests) needs its backend named, or
    accelerate sees one process."""
    from accelerate.utils import InitProcessGroupKwargs

    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and not torch.cuda.is_available():
        return [InitProcessGroupKwargs(backend="gloo")]
    return None


def end_run(accelerator):
    """Every rank's last call: wait for the others (the main one writes the model), then end the trackers and
    tear down the process groups together. (A rank that exited alone while the other still wrote aborted once
    at exit: gloo, ZeRO-3 + Ulysses on CPU, `terminate called without an active exception`.)"""
    accelerator.wait_for_everyone()
    accelerator.end_training()


def sharding(model):
    """"zero3" (DeepSpeed partitioned parameters), "fsdp2" (DTensor parameters) or None."""
    from torch.distributed.tensor import DTensor

    param = next(model.parameters(), None)
    if param is None:
        return None
    if hasattr(param, "ds_id"):
        return "zero3"
    return "fsdp2" if isinstance(param, DTensor) else None


@contextlib.contextmanager
def gathered(tensors):
    """Full copies of `tensors` for the duration of the block: ZeRO-3 parameters are all-gathered in
    place (and released after), FSDP2 DTensors all-gathered into new tensors, plain tensors passed through.
    Collective: every rank must enter with the same tensors in the same order."""
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
    """(prefix, module, recurse): the model cut into the pieces gathered one at a time. An element of
    a ModuleList (a transformer layer) and a LoRA layer (base weight + adapters, merged together) are
    whole units; any other module contributes its own parameters and buffers."""
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
    """(name, full tensor cast to dtype) for every parameter and persistent buffer, under the names of
    model.state_dict() (a LoRA model: merged, under the base model's names). Collective under ZeRO-3 and
    FSDP2; the tensors are copies, valid after the gather is released."""
    from rft_core.models import merged_state_dict

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


def configure_deepspeed(accelerator, rows_per_update, micro_batch_size, max_norm):
    """Fill what DeepSpeed's config needs and cannot infer without a dataloader (call before prepare).
    rows_per_update: a rank's samples per optimizer step; micro_batch_size: per forward, or None when the
    micro-batches go by tokens (then DeepSpeed's nominal accumulation count is one per sample: it only sets
    the loss scale, which accumulation_divisor reads back, and accumulate_over decides the boundaries)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    if getattr(accelerator.parallelism_config, "sp_size", 1) > 1:
        micro_batch_size = None  # Ulysses is set up for DeepSpeed's micro-batch: one row per forward
    micro_batch_size = micro_batch_size or 1
    grad_accum = rows_per_update // micro_batch_size
    plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=micro_batch_size,
                                   gradient_accumulation_steps=grad_accum,
                                   train_batch_size=micro_batch_size * grad_accum * accelerator.num_processes,
                                   gradient_clipping=max_norm,
                                   # with optimizer offload, keep our AdamW (stepping on the CPU):
                                   # accelerate would swap in DeepSpeedCPUAdam with only lr and weight
                                   # decay carried over, not betas
                                   zero_force_ds_cpu_optimizer=False)
    # ZeRO-3 steps AdamW over sub-groups of sub_group_size fp32 parameters, and each step's temporaries are a
    # sub-group's size: DeepSpeed's default, 1e9, asks for 3.7 GiB at once, which crashed the 3B shape on one
    # H100 beside the sleeping engine; 1e8 asks for 0.37 (a config file's own value stays)
    plugin.deepspeed_config.setdefault("zero_optimization", {}).setdefault("sub_group_size", 10**8)
    if plugin.zero_stage == 3 and not plugin.zero3_init_flag:
        # accelerate registers its config with transformers all the same, which then builds every model
        # partitioned (zero.Init): a GGUF rebuild or a model made from a config breaks. Load them whole, as
        # the flag says; prepare() partitions them.
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


def accumulate_over(accelerator, num_micro_batches):
    """Make the next num_micro_batches `accelerator.accumulate` blocks one optimizer step: gradients sync (and
    DeepSpeed steps) on the last. Token-budget micro-batches vary in number from step to step."""
    accelerator.gradient_accumulation_steps = num_micro_batches
    accelerator.step = 0  # accumulate() syncs when its counter reaches a multiple of the count


def accumulation_divisor(accelerator):
    """What `accelerator.backward` divides the loss by: DeepSpeed's configured accumulation count, else
    accelerate's (set by accumulate_over)."""
    if accelerator.state.deepspeed_plugin is not None:
        return accelerator.deepspeed_engine_wrapped.engine.gradient_accumulation_steps()
    return accelerator.gradient_accumulation_steps


def prepare_frozen(accelerator, model):
    """Place a frozen model (the reference) where it costs least: sharded like the actor under ZeRO-3
    (an inference-only DeepSpeed engine, parameters offloaded too if the actor's are) and FSDP2
    (per layer, with the actor's mixed precision and offload policy), a replica on the device otherwise
    (DDP, ZeRO-1/2: it is small next to the optimizer state they shard)."""
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


def grad_norm_value(norm):
    """accelerator.clip_grad_norm_'s result as a float: a tensor, an FSDP2 DTensor, or DeepSpeed's
    float / None."""
    from torch.distributed.tensor import DTensor

    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float("nan") if norm is None else float(norm)


def step_optimizers(accelerator, stepped, max_norm, metrics, check):
    """Step every (net, optimizer, scheduler) in stepped (a dict by the name its gradient norm is logged
    under); on the optimizer step's last micro-batch first clip each net's gradients, put the norms in metrics
    and pass them to check(name, norm) (the one host sync per optimizer step). Before it, accelerate's
    wrapped optimizers and schedulers skip their step (gradient accumulation)."""
    if accelerator.sync_gradients:
        for key, (net, _, _) in stepped.items():
            metrics[key] = grad_norm_value(accelerator.clip_grad_norm_(net.parameters(), max_norm))
        for key in stepped:
            check(key, metrics[key])
    for key, (_, optimizer, scheduler) in stepped.items():
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if accelerator.sync_gradients and (rms := adam_step_rms(optimizer)) is not None:
            metrics[key.replace("grad_norm", "adam_step_rms")] = rms


def adam_step_rms(optimizer, chunk=1 << 24):
    """The RMS over this rank's parameters (its shard under ZeRO / FSDP2) of the step AdamW just took, before
    the learning rate: m_hat / (sqrt(v_hat) + eps). About 1 for a gradient that repeats step after step, less
    where AdamW's second moment holds larger gradients than the step's own (e.g. from earlier batches of a
    different make-up): the step's size relative to AdamW's scale. A tensor (no host sync); None where the
    state is not Adam's, or sits on the CPU while the model is on a GPU (ZeRO-Offload: a slow pass)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper (ZeRO's passes state on)
    if not optimizer.param_groups or "betas" not in optimizer.param_groups[0]:
        return None
    # ZeRO-3 empties its param groups between steps (it swaps sub-groups in), so the state is read on its own
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    total, count = 0.0, 0
    for param, state in optimizer.state.items():
        if "exp_avg" not in state:
            continue
        group = groups.get(id(param), optimizer.param_groups[0])
        (beta1, beta2), eps = group["betas"], group["eps"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if hasattr(m, "to_local"):  # FSDP2's DTensors: this rank's shard
            m, v = m.to_local(), v.to_local()
        if m.device.type == "cpu" and torch.cuda.is_available():
            return None
        t = float(state.get("step", group.get("step", 0)))
        if t == 0:  # no step taken yet
            continue
        m_scale, v_scale = 1 - beta1 ** t, 1 - beta2 ** t  # the bias corrections
        with torch.no_grad():  # a chunk at a time: bounded temporaries
            for mc, vc in zip(m.reshape(-1).split(chunk), v.reshape(-1).split(chunk)):
                step = (mc.float() / m_scale) / ((vc.float() / v_scale).sqrt() + eps)
                total = total + step.square().sum()
        count += m.numel()
    return (total / count).sqrt() if count else None


HOST_COPIES = {}  # (id(parameter), state key) -> the pinned CPU tensor its optimizer state moves to


def with_local(value, local):
    """value (a tensor or a DTensor) with its data, or its DTensor's local shard, replaced by local. Built
    as FSDP2 builds its offloaded shards: DTensor.from_local would move a CPU shard back to the mesh's GPU."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, value._spec, requires_grad=False) if isinstance(value, DTensor) else local


def host_copy(value, key, pin=True):
    """value (a CUDA tensor, or a DTensor of CUDA shards: FSDP2's moments) copied into key's CPU buffer, made
    on its first use (pinned if pin) and reused after; a DTensor keeps its mesh, placements and global shape
    around the copied local shard. The copy is asynchronous: synchronize before reading it."""
    from torch.distributed.tensor import DTensor

    local = value.to_local() if isinstance(value, DTensor) else value
    host = HOST_COPIES.get(key)
    if host is None or (host.shape, host.dtype) != (local.shape, local.dtype):
        host = torch.empty_like(local, device="cpu", pin_memory=pin)
        HOST_COPIES[key] = host
    host.copy_(local, non_blocking=True)
    return with_local(value, host)


def move_optimizer_state(optimizers, device):
    """Move the optimizers' state tensors (AdamW's moments; FSDP2's are DTensors) to `device`: to the CPU
    after an update, so the rollout's KV cache never shares the GPU with them, and back before the next.
    With a GPU, a tensor (a DTensor's local shard) goes into a pinned CPU buffer made on its first move and
    reused after (ZeRO-3's 21 GiB of moments, 3B shape, one H100: +1.6 s an update, against +25 s with fresh
    pageable memory on every move; pinning them costs the first update ~28 s once)."""
    from torch.distributed.tensor import DTensor

    to_host = torch.device(device).type == "cpu"
    pin = to_host and torch.cuda.is_available()
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # under accelerate's AcceleratedOptimizer
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if not torch.is_tensor(value) or key == "step":  # Adam keeps its step counter on the CPU
                    continue
                local = value.to_local() if isinstance(value, DTensor) else value
                if pin and local.is_cuda:
                    state[key] = host_copy(value, (id(param), key))
                else:  # (from pinned: async)
                    state[key] = with_local(value, local.to(device, non_blocking=not to_host))
    if pin:
        torch.cuda.synchronize()  # the copies are done before their blocks go back to the driver
        torch.cuda.empty_cache()  # hand the freed blocks back, for vLLM's wake-up


def zero_offloads_optimizer(deepspeed):
    """Whether accelerate's DeepSpeed plugin (or None) runs ZeRO-Offload: the optimizer on the CPU already."""
    zero = (getattr(deepspeed, "deepspeed_config", None) or {}).get("zero_optimization", {})
    return zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)


def offload_after_update(optimizers, offload, engine, deepspeed, log):
    """After an update, --optimizer_offload: the optimizer state to the CPU if offload; None (auto) decides
    it now, once: on only if the engine could not wake beside the state (under ZeRO-Offload the state is on
    the CPU already: off). Under DeepSpeed the state moved is its inner AdamW's, the moments of this rank's
    partition. Returns the decision."""
    if offload is None and not zero_offloads_optimizer(deepspeed):
        offload = not engine.can_wake()
        log(f"[memory] optimizer state on the CPU between updates: {offload}")
    if offload:
        move_optimizer_state(optimizers, "cpu")
    return offload


def adamw_with_warmup(net, lr, warmup):
    """(AdamW over net's parameters, its schedule: linear warm-up over `warmup` optimizer steps, then
    constant: transformers' constant_with_warmup, as a torch LambdaLR)."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = lambda i: min(1.0, i / warmup) if warmup else 1.0  # noqa: E731
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
