"""A loaded model made ready to train, and its training forwards: `compile_blocks`, `checkpointing_on`, the
value head (`load_value_model`: critic or reward model), `response_values`, the ptx loss (`text_lm_loss`)."""

import copy
import os

import torch
from torch.nn.attention import sdpa_kernel

from rft_core.errors import MissingPath
from rft_core.logprobs import NOT_CUDNN, positions
from rft_core.models import pin_triton_cache


def checkpointing_on(model):
    """Non-reentrant checkpointing (with LoRA the inputs need no gradient), by transformers' name for it:
    activation_checkpointing_enable since ~5.2x, gradient_checkpointing_enable before."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_blocks(model, backend="inductor"):
    """torch.compile each ModuleList element (decoder layer) in place, dynamic: fuses the fp32 element-wise
    ops that cost a small model's update more than its matmuls (H100 profile). The embeddings' output requires
    grad even when frozen (LoRA), as later blocks' inputs do: else the first block needs its own graph."""
    pin_triton_cache()  # the kernels' cache: the same directory on every run

    def inputs_require_grad(module, inputs, output):
        if torch.is_grad_enabled():
            output.requires_grad_(True)

    embeddings = getattr(model, "get_input_embeddings", lambda: None)()  # the VL critic has none: it trains
    if embeddings is not None:
        embeddings.register_forward_hook(inputs_require_grad)
    for module in list(model.modules()):
        for block in module if isinstance(module, torch.nn.ModuleList) else []:
            block.compile(backend=backend, dynamic=True, options=inductor_options(backend))
    return model


def inductor_options(backend):
    """Inductor fuses the norms' weight-gradient reductions by micro-batch size (tokens x hidden >= 5 Mi and
    tokens >= 4096), a guard: a layer recompiles when a micro-batch crosses it (~10 s on an H100, no caches).
    Fusing at any size keeps one graph."""
    from torch._inductor import config

    if backend != "inductor" or not hasattr(config.triton, "mix_order_reduction_non_strict_mode"):
        return None
    return {"triton.mix_order_reduction_non_strict_mode": True}


def load_value_model(path=None, actor=None, dtype=torch.float32, flag="--critic_pretrain"):
    """A transformer with a scalar head `score` per position (AutoModelForTokenClassification, one label): the
    critic or a reward model. From `path`, a sequence- or token-classification checkpoint (both name the head
    `score`; a missing bias starts at 0), else `actor`'s weights and a zero head. flag: for a missing path."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    if path:
        if not os.path.isdir(path):
            raise MissingPath(f"{flag} {path!r}: not a model directory (a critic / reward model is an HF "
                              "checkpoint)")
        config = AutoConfig.from_pretrained(path, num_labels=1, classifier_dropout=0.0)
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype)
    else:
        config = copy.deepcopy(actor.config)
        config.num_labels, config.classifier_dropout = 1, 0.0
        model = AutoModelForTokenClassification.from_config(config, dtype=dtype)
        model.base_model.load_state_dict(actor.base_model.state_dict())
        for param in model.score.parameters():  # the weight, and the bias where the head has one
            torch.nn.init.zeros_(param)
    return model


def response_values(model, input_ids, attention_mask, num_actions, mm_inputs=None):
    """Critic values V(s_t) (B, T) before each response token (mm_inputs: a VL critic's; own positions)."""
    with sdpa_kernel(NOT_CUDNN):  # left pads: see NOT_CUDNN
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=None if mm_inputs else positions(attention_mask), **(mm_inputs or {}))
    return out.logits[:, -num_actions - 1:-1, 0].float()  # (B, T)


def lm_loss(model, input_ids, attention_mask):
    """Mean next-token cross-entropy over the attended tokens (the pretraining / ptx loss)."""
    # a target needs itself and its predecessor attended: a row's first token is not predicted from a pad
    previous = torch.nn.functional.pad(attention_mask, (1, 0))[:, :-1]  # (B, L)
    labels = input_ids.masked_fill((attention_mask == 0) | (previous == 0), -100)  # (B, L)
    with sdpa_kernel(NOT_CUDNN):  # left pads: see NOT_CUDNN
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=positions(attention_mask), labels=labels, use_cache=False).loss


def text_lm_loss(model, tokenizer, texts, max_len):
    enc = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_len)
    enc = enc.to(next(model.parameters()).device)  # model may be wrapped (DDP, DeepSpeed)
    return lm_loss(model, enc["input_ids"], enc["attention_mask"])
