import importlib.util
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(items):
    """A test marked gpu (pytest.ini) skips with fewer CUDA GPUs than its count (default 1), or without the
    package its mark names: @pytest.mark.gpu(count=2, needs="vllm")."""
    for item in items:
        mark = item.get_closest_marker("gpu")
        if mark is None:
            continue
        count, needs = mark.kwargs.get("count", 1), mark.kwargs.get("needs")
        if torch.cuda.device_count() < count:
            item.add_marker(pytest.mark.skip(reason=f"needs {count} CUDA GPU{'s' if count > 1 else ''}"))
        elif needs and importlib.util.find_spec(needs) is None:
            item.add_marker(pytest.mark.skip(reason=f"needs {needs}"))


def pytest_sessionfinish(session, exitstatus):
    """The process group an in-process vLLM engine set up (the GPU tests share one), torn down while the
    interpreter is whole: left to the interpreter's exit, NCCL's teardown can hold the finished process
    (PyTorch's shutdown notes; pytorch/pytorch#122358)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def save_tiny_model(path):
    """A 2-layer random Llama with the embedded SmolLM2 tokenizer, saved as an HF directory at path."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rft_core.models import embedded_model_path

    gguf = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_eos_prone(model, eos_token_id, p=0.2):
    """Edit a random model so that, whatever the context, it samples eos with probability about p and every
    other token alike: its turns end after a few tokens, as a trained chat model's do (multi-turn tests). A
    residual-stream component held at 10 by every embedding is all the final norm passes on, so each logit
    is that component times the token's weight on it, eos's raised."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    norm = [m for name, m in model.named_modules()
            if name.split(".")[-1] == "norm" and "layers" not in name and "visual" not in name][-1]
    with torch.no_grad():
        emb[:, 0] = 10.0
        head[:, 0] = 10.0
        norm.weight.zero_()
        norm.weight[0] = 1.0
        model.eval()
        logits = model(input_ids=torch.randint(0, emb.shape[0], (2, 16))).logits.float()  # (2, 16, V)
        scale = (logits[..., eos_token_id] / 10.0).mean()  # the component after the norm: the same for all
        head[eos_token_id, 0] += math.log(p / (1 - p) * (emb.shape[0] - 1)) / scale
    return model


def save_eos_model(path):
    """The tiny Llama (save_tiny_model) whose turns end after a few tokens (make_eos_prone), at path."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    save_tiny_model(path)
    model = LlamaForCausalLM.from_pretrained(path)
    make_eos_prone(model, AutoTokenizer.from_pretrained(path).eos_token_id)
    model.save_pretrained(path)
    return str(path)


def save_eos_vl_model(path):
    """The built-in tiny Qwen2-VL (rft_core/vision.py) whose turns end after a few tokens, at path."""
    from rft_core.vision import tiny_qwen2_vl, word_tokenizer

    tokenizer = word_tokenizer()
    make_eos_prone(tiny_qwen2_vl(tokenizer), tokenizer.eos_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def eos_model_dir(tmp_path_factory):
    return save_eos_model(tmp_path_factory.mktemp("eos_llama"))


def save_tiny_rm(path, tokenizer_dir):
    """A 1-layer random Llama sequence classifier (a reward model) with tokenizer_dir's tokenizer, at path."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


CHARS_REWARD = "def chars(p, completions, l, **kw):\n    return [len(c) / 10 for c in completions]\n"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_rm_dir(tiny_model_dir, tmp_path_factory):
    return save_tiny_rm(tmp_path_factory.mktemp("tiny_rm"), tiny_model_dir)


@pytest.fixture
def chars_reward(tmp_path_factory):
    """A reward that varies between samples even for a random tiny model, so gradients are not zero (in a
    folder of its own: a run refuses an --output_dir that holds its reward file, and tests write to
    tmp_path)."""
    path = tmp_path_factory.mktemp("reward") / "chars.py"
    path.write_text(CHARS_REWARD)
    return f"{path}:chars"


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script, args, launcher=(sys.executable,), check=True, env=None, timeout=900):
    """Run train_ppo.py / train_ppo_vl.py (script) with args in a subprocess from the repo root; with check,
    assert it exits 0 and show its output's tail if not."""
    import subprocess

    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT at exit, seen once in CI) prints its Python stacks
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "2",
           **(env or {})}
    proc = subprocess.run([*launcher, os.path.join(ROOT, script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_metrics(out):
    """(step rows, eval rows) of a run's metrics.jsonl."""
    import json

    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "train/policy_loss" in r], [r for r in rows if "eval/reward_mean" in r]
