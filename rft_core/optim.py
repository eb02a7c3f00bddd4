"""The optimizer: AdamW with its warm-up and step, gradient accumulation over a varying number of
micro-batches, and --optimizer_offload (the state on the CPU while the rollout's KV cache needs the GPU)."""

import torch

from rft_core.distributed import zero_offloads_optimizer


def adamw_with_warmup(net, lr, warmup):
    """(AdamW, its schedule: linear warm-up over `warmup` steps, then constant, as constant_with_warmup)."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = lambda i: min(1.0, i / warmup) if warmup else 1.0  # noqa: E731
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def accumulate_over(accelerator, num_micro_batches):
    """Make the next num_micro_batches `accelerator.accumulate` blocks one optimizer step (their number
    varies from step to step)."""
    accelerator.gradient_accumulation_steps = num_micro_batches
    accelerator.step = 0  # accumulate() syncs when its counter reaches a multiple of the count


def accumulation_divisor(accelerator):
    """What `accelerator.backward` divides the loss by: DeepSpeed's accumulation count, else accelerate's."""
    if accelerator.state.deepspeed_plugin is not None:
        return accelerator.deepspeed_engine_wrapped.engine.gradient_accumulation_steps()
    return accelerator.gradient_accumulation_steps


def step_optimizers(accelerator, stepped, max_norm, metrics, check):
    """Step every (net, optimizer, scheduler) in stepped (keyed by its gradient norm's metric); on a step's
    last micro-batch first clip, log the norms and check(name, norm) them (one host sync per step)."""
    from torch.distributed.tensor import DTensor

    if accelerator.sync_gradients:
        for key, (net, _, _) in stepped.items():
            norm = accelerator.clip_grad_norm_(net.parameters(), max_norm)  # DeepSpeed's: a float or None
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # (FSDP2)
            metrics[key] = float("nan") if norm is None else float(norm)
        for key in stepped:
            check(key, metrics[key])
    for key, (_, optimizer, scheduler) in stepped.items():
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if accelerator.sync_gradients and (rms := adam_step_rms(optimizer)) is not None:
            metrics[key.replace("grad_norm", "adam_step_rms")] = rms


def adam_step_rms(optimizer, chunk=1 << 24):
    """The RMS of AdamW's last step before the learning rate, m_hat / (sqrt(v_hat) + eps), over this rank's
    shard: about 1 for a repeating gradient. A tensor (no host sync); None where the state is not Adam's or
    sits on the CPU beside a GPU (ZeRO-Offload: a slow pass)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper (ZeRO's passes state on)
    if not optimizer.param_groups or "betas" not in optimizer.param_groups[0]:
        return None
    # ZeRO-3 empties its param groups between steps, so the state is read on its own
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    total, count = 0.0, 0
    for param, state in optimizer.state.items():
        group = groups.get(id(param), optimizer.param_groups[0])
        t = float(state.get("step", group.get("step", 0)))
        if "exp_avg" not in state or t == 0:  # no step taken yet
            continue
        (beta1, beta2), eps = group["betas"], group["eps"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if hasattr(m, "to_local"):  # FSDP2's DTensors: this rank's shard
            m, v = m.to_local(), v.to_local()
        if m.device.type == "cpu" and torch.cuda.is_available():
            return None
        m_scale, v_scale = 1 - beta1 ** t, 1 - beta2 ** t  # the bias corrections
        with torch.no_grad():  # a chunk at a time: bounded temporaries
            for mc, vc in zip(m.reshape(-1).split(chunk), v.reshape(-1).split(chunk)):
                step = (mc.float() / m_scale) / ((vc.float() / v_scale).sqrt() + eps)
                total = total + step.square().sum()
        count += m.numel()
    return (total / count).sqrt() if count else None


def with_local(value, local):
    """value with its data (a DTensor's local shard) replaced by local, as FSDP2 builds its offloaded
    shards: DTensor.from_local would move a CPU shard back to the mesh's GPU."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, value._spec, requires_grad=False) if isinstance(value, DTensor) else local


def host_copy(value, buffers, key, pin=True):
    """value copied into buffers[key], a CPU tensor made on first use (pinned if pin) and reused after.
    Asynchronous: synchronize before reading it."""
    from torch.distributed.tensor import DTensor

    local = value.to_local() if isinstance(value, DTensor) else value
    host = buffers.get(key)
    if host is None or (host.shape, host.dtype) != (local.shape, local.dtype):
        host = torch.empty_like(local, device="cpu", pin_memory=pin)
        buffers[key] = host
    host.copy_(local, non_blocking=True)
    return with_local(value, host)


def move_optimizer_state(optimizers, device):
    """Move the optimizers' state tensors to `device`; to the CPU, into pinned buffers kept on the optimizer
    (ZeRO-3's 21 GiB of moments, one H100: +1.6 s an update, against +25 s with fresh pageable memory each
    move; pinning costs ~28 s once)."""
    from torch.distributed.tensor import DTensor

    to_host = torch.device(device).type == "cpu"
    pin = to_host and torch.cuda.is_available()
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # under accelerate's AcceleratedOptimizer
        buffers = vars(optimizer).setdefault("offload_buffers", {})  # (id(parameter), state key) -> CPU copy
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if not torch.is_tensor(value) or key == "step":  # Adam keeps its step counter on the CPU
                    continue
                local = value.to_local() if isinstance(value, DTensor) else value
                if pin and local.is_cuda:
                    state[key] = host_copy(value, buffers, (id(param), key))
                else:  # (from pinned: async)
                    state[key] = with_local(value, local.to(device, non_blocking=not to_host))
    if pin:
        torch.cuda.synchronize()  # the copies are done before their blocks go back to the driver
        torch.cuda.empty_cache()  # hand the freed blocks back, for vLLM's wake-up


def offload_after_update(optimizers, offload, engine, deepspeed, log):
    """After an update, the optimizer state to the CPU if offload; None (auto) decides it now, once: on only
    if the engine could not wake beside the state (off under ZeRO-Offload). Returns the decision."""
    if offload is None and not zero_offloads_optimizer(deepspeed):
        offload = not engine.can_wake()
        log(f"[memory] optimizer state on the CPU between updates: {offload}")
    if offload:
        move_optimizer_state(optimizers, "cpu")
    return offload
