"""Token log-probabilities under the policy: of a padded batch's responses or of a packed row, from the
model's logits (TokenLogprobs) or with the LM head chunked (LinearLogprobs), each with a hand-written
backward."""

from contextlib import contextmanager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from rft_core.losses import entropy_from_logits

# SDPA kernels for a forward with gradients: any but cuDNN's, whose backward turns a left pad (a query row
# with nothing to attend to) into NaN gradients for every weight below it, for some batch shapes only (runs
# stopped at random); efficient and math give it zero gradients (replayed on a 1.5B batch that stopped a run).
NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def positions(attention_mask):
    """Position ids of left-padded rows: (B, L), 0 at each row's first attended token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_logprobs(model, input_ids, attention_mask, num_actions, temperature=1.0, with_entropy=False,
                      mm_inputs=None, chunk_size=None):
    """(logprobs, entropy or None) (B, T) of the last T = num_actions tokens of input_ids (B, P + T), under
    softmax(logits / temperature), the rollout's sampling distribution. with_entropy: "grad" (entropy bonus)
    or True (detached, for logging). mm_inputs: a VL model's image inputs (it then computes its own mRoPE
    positions). chunk_size: the LM head chunked (LinearLogprobs): (B, T, vocab) logits never exist whole."""
    # logits_to_keep: the LM head on the last T + 1 positions only; the last has no target (a 0, dropped)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=num_actions + 1,
                  position_ids=None if mm_inputs else positions(attention_mask), **(mm_inputs or {}))
    targets = torch.nn.functional.pad(input_ids[:, -num_actions:], (0, 1))  # (B, T + 1)
    logprobs, entropy = token_logprobs(model, inputs, targets, temperature, with_entropy, chunk_size)
    return logprobs[:, :-1], entropy[:, :-1] if entropy is not None else None


def packed_logprobs(model, input_ids, position_ids, keep, temperature=1.0, with_entropy=False,
                    chunk_size=None):
    """Logprobs (and entropy, as response_logprobs) (1, K) of the tokens after positions `keep` (K,) of one
    packed row (1, N) whose positions restart at 0 per sample: without an attention mask transformers reads
    the restarts as boundaries (flash varlen; sdpa / eager: block-diagonal causal): none attends across."""
    inputs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=None, logits_to_keep=keep)
    targets = input_ids[:, keep + 1]  # (1, K)
    return token_logprobs(model, inputs, targets, temperature, with_entropy, chunk_size)


def token_logprobs(model, inputs, targets, temperature=1.0, with_entropy=False, chunk_size=None):
    """(logprobs, entropy) (b, t) of targets (b, t) at the positions inputs' logits_to_keep selects: by
    LinearLogprobs with chunk_size, else from the logits. Any SDPA kernel but cuDNN's (NOT_CUDNN)."""
    if chunk_size:
        # the head runs inside the forward (where DDP, ZeRO-3, FSDP2 expect it) -> (b, t, 2): logprob, entropy
        head = unwrap(model).get_output_embeddings()
        logprob_head = _head_computes_logprobs(head, targets, temperature, chunk_size, with_entropy)
        with logprob_head, sdpa_kernel(NOT_CUDNN):
            out = model(**inputs, use_cache=False).logits
        return out[..., 0], out[..., 1] if with_entropy else None
    with sdpa_kernel(NOT_CUDNN):
        logits = model(**inputs, use_cache=False).logits  # (b, t, V)
    if with_entropy == "grad" and torch.is_grad_enabled():
        # the entropy bonus needs autograd through the whole distribution: (lse, logprobs, entropy) (b, t)
        return _chunk_forward(logits, targets, temperature, None, True)[1:]
    return TokenLogprobs.apply(logits, targets.unsqueeze(-1), temperature, bool(with_entropy))


class TokenLogprobs(torch.autograd.Function):
    """(log softmax(logits / temperature) at targets, entropy or None), (B, T) each, in fp32. A pass over the
    (B, T, vocab) logits is the update's main cost after the matmuls (H100 profile); autograd would keep an
    fp32 copy and take ~7 passes in backward. This recomputes z = logits / T once and writes the gradient
    (onehot - softmax(z)) g / T in place. The entropy is for logging: no gradient."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy):
        # (B, T) each: logsumexp, logprobs, entropy or None
        lse, logprobs, entropy = _chunk_forward(logits, targets.squeeze(-1), temperature, None, with_entropy)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        t = ctx.temperature
        z = _scaled(logits, t, None)  # (B, T, V); may be `logits` itself: not modified
        grad = (z - lse.unsqueeze(-1)).exp_()  # softmax(z), a fresh tensor
        g = grad_logprobs.unsqueeze(-1)  # (B, T, 1)
        grad.mul_(-g).scatter_add_(-1, targets, g)  # (onehot - softmax) g
        if t != 1.0:
            grad.div_(t)
        return grad.to(logits.dtype), None, None, None


def unwrap(model):
    while hasattr(model, "module"):  # DDP, DeepSpeed
        model = model.module
    return model


@contextmanager
def _head_computes_logprobs(head, targets, temperature, chunk_size, with_entropy):
    """Within the block, `head` maps hidden (b, t, H) to (b, t, 2): logprob of targets (b, t) and entropy, by
    LinearLogprobs, with vision.block_tokens' blocked ids (its hook stood down)."""
    def forward(hidden):
        b, t, h = hidden.shape
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        weight = head.weight.to(dtype, copy=True)  # a copy: ZeRO-3 / FSDP2 reshard the parameter later
        logprobs, entropy = LinearLogprobs.apply(hidden.reshape(-1, h).to(dtype), weight, targets.reshape(-1),
                                                 temperature, chunk_size, with_entropy, blocked)
        if entropy is None:
            entropy = torch.zeros_like(logprobs)
        return torch.stack([logprobs, entropy], -1).view(b, t, 2)

    blocked = getattr(head, "blocked_token_ids", None)
    head.forward, head.computes_logprobs = forward, True
    try:
        yield
    finally:
        del head.forward, head.computes_logprobs


class LinearLogprobs(torch.autograd.Function):
    """LM head to logprobs and entropy, chunk_size rows at a time (peak memory: one chunk's logits): hidden
    (N, H), weight (V, H) -> (N,) each, fp32. Backward recomputes each chunk's logits and writes dh = dz W,
    dW += dz^T h (dz: _chunk_grad). blocked: token ids at -1e4 (never emitted; no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, blocked):
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32) if with_entropy else None
        lse = hidden.new_empty(n, dtype=torch.float32)
        chunk_forward = fused(_chunk_forward, hidden)
        for rows in _chunks(n, chunk_size):
            logits = hidden[rows] @ weight.T  # (c, V)
            # a copy, not a view: compiled, a view would guard its base's length (the micro-batch's)
            out = chunk_forward(logits, targets[rows].clone(), temperature, blocked, bool(with_entropy))
            lse[rows], logprobs[rows] = out[0], out[1]
            if with_entropy:
                entropy[rows] = out[2]
        ctx.save_for_backward(hidden, weight, targets, lse, entropy if with_entropy == "grad" else None)
        ctx.settings = temperature, chunk_size, blocked
        if with_entropy and with_entropy != "grad":
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk_size, blocked = ctx.settings
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        chunk_grad = fused(_chunk_grad, hidden)
        if entropy is None or grad_entropy is None:  # no entropy term
            entropy = grad_entropy = None
        for rows in _chunks(hidden.shape[0], chunk_size):
            chunk = [t[rows].clone() if t is not None else None  # copies, as in forward
                     for t in (targets, lse, grad_logprobs, entropy, grad_entropy)]
            grad_z = chunk_grad(hidden[rows] @ weight.T, *chunk, temperature, blocked)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_z @ weight
            if grad_weight is not None:
                grad_weight += grad_z.T @ hidden[rows]
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None


def _scaled(logits, temperature, blocked):
    """A chunk's logits (c, V) in fp32, divided by the temperature, blocked token ids at -1e4."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if blocked is not None:
        z = z.index_fill(-1, torch.tensor(blocked, device=z.device), -1e4)
    return z


def _chunk_forward(logits, targets, temperature, blocked, with_entropy):
    """A chunk's logits (c, V) in the head's dtype -> (logsumexp of z, z at the targets, the entropy or None),
    (c,) each in fp32, where z = logits / temperature (or (B, T, V) -> (B, T) each, as token_logprobs')."""
    z = _scaled(logits, temperature, blocked)
    lse = torch.logsumexp(z, -1)
    logprobs = z.gather(-1, targets[..., None]).squeeze(-1) - lse
    return lse, logprobs, entropy_from_logits(z, lse) if with_entropy else None


def _chunk_grad(logits, targets, lse, grad_logprobs, entropy, grad_entropy, temperature, blocked):
    """dz (c, V) in the logits' dtype: ((onehot - p) g_logprob - p (log p + H) g_entropy) / temperature."""
    logp = _scaled(logits, temperature, blocked) - lse[:, None]  # log softmax
    p = logp.exp()
    grad_z = (p * -grad_logprobs[:, None]).scatter_add(-1, targets[:, None], grad_logprobs[:, None])
    if entropy is not None:  # dH/dz = -p (log p + H)
        grad_z = grad_z - p * (logp + entropy[:, None]) * grad_entropy[:, None]
    if blocked is not None:
        grad_z = grad_z.index_fill(-1, torch.tensor(blocked, device=grad_z.device), 0.0)
    return (grad_z / temperature).to(logits.dtype)


def _chunks(n, size):
    """Slices of n rows, size at a time; a last chunk of one row takes a row from the one before (compiled,
    the chunk functions specialise on a length of 1: a compile of its own, mid-run)."""
    starts = list(range(0, n, size))
    if size > 1 and len(starts) > 1 and n - starts[-1] == 1:
        starts[-1] -= 1
    return [slice(a, b) for a, b in zip(starts, starts[1:] + [n])]


_FUSED = {}


def fused(fn, like, backend="inductor"):
    """fn compiled where `like` is on a GPU (one Triton kernel or two instead of a pass over the (c, V) logits
    per operation); itself elsewhere, unless a backend is named (tests)."""
    if like.device.type != "cuda" and backend == "inductor":
        return fn
    if (fn, backend) not in _FUSED:
        _FUSED[fn, backend] = torch.compile(fn, dynamic=True, fullgraph=True, backend=backend)
    return _FUSED[fn, backend]
