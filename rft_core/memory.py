"""The update's memory plan: the tokens an update micro-batch may hold and whether gradient checkpointing
must go on, from activations measured at start-up (rft_core/plan.py decides with them)."""

import torch

from rft_core.logprobs import response_logprobs, unwrap

AUTO_MAX_TOKENS = 32768  # larger micro-batches gain little and take memory from the engine
CPU_ACTIVATIONS = 1 << 30  # bytes of activations a CPU update micro-batch may keep: larger ones are no faster


def choose_budget(per_token, room, engine_bytes, engine_sleeps, max_tokens, fixed_budget):
    """(checkpointing, tokens, engine awake during updates): the largest budget that fits beside the awake
    engine (>= 8192 tokens), else while it sleeps (>= 4096): smaller micro-batches beat recomputing."""
    per_token = max(per_token, 1)  # below the noise (a tiny model): not what limits the budget
    awake = int((room - engine_bytes) / per_token) // 1024 * 1024  # tokens that fit beside the engine
    asleep = int(room / per_token) // 1024 * 1024 if engine_sleeps else awake
    if fixed_budget:
        return asleep < max_tokens, max_tokens, awake >= max_tokens
    if awake >= 8192:
        return False, min(AUTO_MAX_TOKENS, awake), True
    if asleep >= 4096:  # (an engine that never sleeps: asleep is awake)
        return False, min(AUTO_MAX_TOKENS, asleep), not engine_sleeps
    return True, max_tokens, not engine_sleeps


def zero3_gradient_bytes(model):
    """The bytes of ZeRO-3's GPU gradient buffer (else 0), which DeepSpeed 0.19 makes in prepare."""
    buffer = getattr(getattr(model, "optimizer", None), "grad_partitions_flat_buffer", None)
    on_gpu = torch.is_tensor(buffer) and buffer.device.type != "cpu"  # (ZeRO-Offload's is on the CPU)
    return buffer.numel() * buffer.element_size() if on_gpu else 0


def local_numel(p):
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor.numel()
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def measure_activations(net, chunk_size, autocast):
    """(bytes kept per token, fixed bytes: autocast's weight copies) of an update's forward, measured."""
    peaks, was_training = [], net.training
    net.train()  # as in the update: a compiled layer's graph depends on the mode (and dropout on it)
    # two rows (a compiled model would specialise on 1); the first forwards, unused, take the one-off
    # allocations (compiling, workspaces): unpadded (no attention mask: a graph of its own) and padded, with a
    # backward where unsharded, so its graphs compile before the engine starts
    sharded = any(hasattr(p, "ds_tensor") or hasattr(p, "to_local") for p in net.parameters())
    for i, (n, padded) in enumerate(((512, False), (512, True), (512, True), (1024, True))):
        ids = synthetic_rows(net, n)
        mask = torch.ones_like(ids)
        mask[1, 0] = 0 if padded else 1  # one padded column, as in training (and so in the same graph)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with autocast():  # as the update: with the entropy (it logs it), the backward under autocast
            kept = response_logprobs(net, ids, mask, n // 4, with_entropy=True, chunk_size=chunk_size)
            peaks.append(torch.cuda.max_memory_allocated() - before)
            if i < 2 and not sharded:
                kept[0].sum().backward()
                net.zero_grad(set_to_none=True)
        del kept
    net.train(was_training)
    per_token = (peaks[3] - peaks[2]) / 512
    return per_token, peaks[2] - 512 * per_token


def plan_update_memory(model, max_tokens, chunk_size, autocast, engine_share=0.0, engine_sleeps=True,
                       fixed_budget=False, log=print, sliced=False):
    """(gradient checkpointing on, tokens per update micro-batch) that fit this GPU beside gradients and
    AdamW's moments (fp32). autocast: returns the trainer's autocast context. sliced (SP / CP): on a CPU the
    budget is kept (a whole-row forward cannot measure a rank's slice)."""
    if not torch.cuda.is_available():
        return plan_cpu_memory(model, max_tokens, chunk_size, fixed_budget or sliced, log)
    net = unwrap(model)
    per_token, fixed = measure_activations(net, chunk_size, autocast)
    states = 12 * sum(local_numel(p) for p in net.parameters() if p.requires_grad)
    states -= zero3_gradient_bytes(model)  # made in prepare(): already out of the free memory below
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()  # what other processes hold is not ours either
    # what PyTorch reserves beyond the live tensors, after empty_cache, is held by fragmented segments
    allocated, reserved = torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30
    log(f"[memory] loaded: the trainer's tensors take {allocated:.1f} GiB and PyTorch reserves "
        f"{reserved:.1f} on this GPU; {free / 2**30:.1f} of {total / 2**30:.1f} GiB are free")
    engine_bytes = engine_share * total
    room = 0.85 * free - states - fixed
    checkpointing, tokens, beside = choose_budget(per_token, room, engine_bytes, engine_sleeps, max_tokens,
                                                  fixed_budget)
    log(f"[memory] an update keeps {per_token / 2**10:.0f} KiB of activations per token and "
        f"{room / 2**30:.1f} GiB are left for them ({(room - engine_bytes) / 2**30:.1f} beside the awake "
        f"engine): micro-batches of {tokens} tokens, gradient checkpointing "
        f"{'on' if checkpointing else 'off'}, sized for the engine {'awake' if beside else 'asleep'} during "
        "updates (auto sleep follows each update's measured peak)")
    return checkpointing, tokens


def synthetic_rows(net, tokens):
    """Two rows of tokens / 2 random ids, from a generator of their own (the run's streams are untouched)."""
    vocab = net.config.get_text_config().vocab_size
    ids = torch.randint(vocab, (2, tokens // 2), generator=torch.Generator().manual_seed(0))
    return ids.to(next(net.parameters()).device)


def saved_bytes(net, tokens, chunk_size=None):
    """The bytes a forward of synthetic_rows keeps for its backward (views once, parameters not at all)."""
    ids = synthetic_rows(net, tokens)
    params, kept = {p.data_ptr() for p in net.parameters()}, {}

    def pack(t):
        if t.data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        response_logprobs(net, ids, torch.ones_like(ids), tokens // 4, chunk_size=chunk_size)
    return sum(kept.values())


def plan_cpu_memory(model, max_tokens, chunk_size=None, fixed_budget=False, log=print):
    """(gradient checkpointing on, tokens per update micro-batch) on a CPU: the tokens whose activations fit
    in CPU_ACTIVATIONS, or half the available memory less AdamW's state if less; a fixed_budget is kept."""
    import psutil

    if fixed_budget:
        return False, max_tokens
    net = unwrap(model)
    was_training = net.training
    net.train()
    per_token = max(1.0, (saved_bytes(net, 256, chunk_size) - saved_bytes(net, 128, chunk_size)) / 128)
    net.train(was_training)
    states = 12 * sum(p.numel() for p in net.parameters() if p.requires_grad)
    available = psutil.virtual_memory().available
    room = min(CPU_ACTIVATIONS, 0.5 * available - states)
    tokens = min(max_tokens, max(512, int(room / per_token) // 512 * 512))
    log(f"[memory] CPU: an update keeps {per_token / 2**10:.0f} KiB of activations per token; "
        f"{available / 2**30:.1f} GiB available: micro-batches of {tokens} tokens")
    return False, tokens


def micro_batch_splits(args, plan, accelerator, sp=None):
    """(update, logprob passes): Experience.split's sizes, the passes (no activations kept) at twice the
    budget. sp (SequenceParallel): a rank computes a 1 / sp.size slice of each row."""
    device = accelerator.device
    sync_count = lambda n: int(accelerator.reduce(torch.tensor(n, device=device), "max"))  # noqa: E731
    budget = plan.max_tokens_per_micro_batch
    if budget and sp is not None:
        budget *= sp.size
    update = dict(micro_batch_size=args.micro_train_batch_size, max_tokens=budget, sync_count=sync_count)
    passes = dict(update, micro_batch_size=args.micro_rollout_batch_size, max_tokens=budget and 2 * budget)
    return update, passes
