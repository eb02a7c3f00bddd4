"""Replay the micro-batch bench/nan_probe.py saved (RFT_PROBE=shapes): the trainer's logprobs of its targets,
forward and backward (the gradient of their sum), under bf16 autocast as the trainer runs, eager, with each
SDPA backend alone, and with a 4D mask in which a fully masked query row (a left pad) attends to itself:
which of them give finite gradients? The model is bench_sizes.py's random Qwen2 of that size (the same
seed; SmolLM2's vocabulary size and EOS, so no tokenizer is needed).

    python bench/nan_replay.py 1.5b bench/results/partial_h100/session18/nan_batch.pt
"""

import json
import os
import sys
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_sizes import shape_config  # noqa: E402
from rft_core.logprobs import token_logprobs  # noqa: E402


def make(size):
    config = shape_config(size, 49152, eos_token_id=2, bos_token_id=1)  # SmolLM2's vocabulary, EOS, BOS
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    return model.float().train()  # the trainer's fp32 weights, bf16 autocast


def self_attending_mask(mask):
    """(B, L) padding mask -> (B, 1, L, L) boolean: causal and padding, plus each fully masked query row
    (a left pad) attending to itself."""
    n = mask.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    full = causal[None] & mask.bool()[:, None, :]  # (B, L, L)
    empty = ~full.any(-1)  # (B, L)
    full |= torch.diag_embed(empty)
    return full[:, None]


def replay(model, batch, backend=None, mask4d=False):
    model.zero_grad(set_to_none=True)
    inputs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items() if k != "targets"}
    if mask4d:
        inputs["attention_mask"] = self_attending_mask(inputs["attention_mask"])
    context = sdpa_kernel([backend]) if backend else nullcontext()
    try:
        with context, torch.autocast("cuda", dtype=torch.bfloat16):
            logprobs, _ = token_logprobs(model, inputs, batch["targets"].cuda())
        logprobs.float().sum().backward()
    except RuntimeError as e:
        return {"backend": str(backend), "mask4d": mask4d, "error": str(e)[:120]}
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    grads = [p.grad for p in model.parameters() if p.grad is not None and torch.isfinite(p.grad).all()]
    return {"backend": str(backend), "mask4d": mask4d,
            "logprobs_finite": bool(torch.isfinite(logprobs).all()),
            "logprob_sum": float(logprobs.float().sum()), "bad_grads": len(bad), "first_bad": bad[:3],
            "grad_norm": float(torch.stack([g.norm() for g in grads]).norm()) if grads else None}


if __name__ == "__main__":
    batch = torch.load(sys.argv[2])
    print(json.dumps({k: list(v.shape) if torch.is_tensor(v) else v for k, v in batch.items()}), flush=True)
    model = make(sys.argv[1])
    for backend in (None, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        print(json.dumps(replay(model, batch, backend)), flush=True)
    print(json.dumps(replay(model, batch, None, mask4d=True)), flush=True)
    print(json.dumps(replay(model, batch, SDPBackend.MATH, mask4d=True)), flush=True)
