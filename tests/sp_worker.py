"""Run by tests/test_sequence_parallel.py under `accelerate launch --config_file deepspeed_zero3_sp2.yaml`
(2 CPU ranks, gloo, DS_ACCELERATOR=cpu; or 4 with parallelism_config_dp_shard_size 2: two data-parallel groups
that both take the batch) or fsdp2_cp2.yaml (two GPUs): the same batch through the unsharded model in one
process (SP 1) and through Ulysses SP 2 under ZeRO-3 or context parallelism 2 under FSDP2, as the training
scripts do it. Writes OUT_DIR/rank<r>.json per rank: the largest differences of the logprobs
(batched_logprobs, summed over the group), of the loss (summed over the ranks) and of every parameter's
gradient, per loss aggregation mode (and TIS level: a sample's weight summed over its slices).
(Context parallelism needs CUDA: Accelerate runs FSDP on GPUs only and torch's ring attention has no CPU
kernel; tests/cp_layout_worker.py checks its layout on CPU.)

    accelerate launch --config_file accelerate_configs/deepspeed_zero3_sp2.yaml tests/sp_worker.py \
        MODEL_DIR CHUNK_SIZE OUT_DIR        (CHUNK_SIZE 0: the model's own logits)
"""

import copy
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

from rft_core.distributed import configure_deepspeed, process_group_kwargs
from rft_core.experience import Experience, Forward, batched_logprobs, micro_batch_logprobs
from rft_core.losses import LossSettings, actor_loss

model_dir = sys.argv[1]
chunk_size = int(sys.argv[2]) or None
torch.manual_seed(0)
whole = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")  # before ZeRO-3 exists
trained = copy.deepcopy(whole)

# three rows of different prompt and response lengths: [pad prompt | response pad], as build_experience; over
# 96 tokens, so that context parallelism's padded width of 128 gives both ranks tokens
prompt_lens, response_lens = [5, 9, 3], [70, 4, 120]
P, T = max(prompt_lens), max(response_lens)
input_ids = torch.zeros(3, P + T, dtype=torch.long)
attention_mask = torch.zeros(3, P + T, dtype=torch.long)
action_mask = torch.zeros(3, T, dtype=torch.long)
for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
    input_ids[b, P - p:P + r] = torch.randint(5, 400, (p + r,))
    attention_mask[b, P - p:P + r] = 1
    action_mask[b, :r] = 1
exp = Experience(input_ids, attention_mask, action_mask, rollout_logprobs=torch.zeros(3, T),
                 advantages=torch.randn(3))
with torch.no_grad():
    want_logprobs = micro_batch_logprobs(whole, exp, Forward(1.0, chunk_size))[0]
# the engine's and the reference's logprobs near the policy's, so the TIS weights and the KL stay moderate
exp.rollout_logprobs = (want_logprobs + 0.1 * torch.randn(3, T)) * action_mask
exp.ref_logprobs = (want_logprobs + 0.1 * torch.randn(3, T)) * action_mask


def loss_of(model, mb, mode, num_tokens, sp=None, groups=1):
    """groups: data-parallel groups, each with this same batch (its sequences count once per group). mode:
    the loss aggregation, and after a "+" the TIS level (default token)."""
    logprobs, entropy = micro_batch_logprobs(model, mb, Forward(1.0, chunk_size, sp=sp), "grad")
    agg, _, level = mode.partition("+")
    settings = LossSettings(loss_agg_mode=agg, entropy_coef=0.01, use_kl_loss=True, kl_coef=0.1, tis_cap=2.0,
                            tis_level=level or "token", sample_sum=sp.sum if sp else None,
                            num_tokens=num_tokens, num_pg_tokens=num_tokens, num_seqs=3 * groups, max_len=T)
    return actor_loss(logprobs, entropy, mb, settings)[0]


modes = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-mean+sequence",
         "seq-mean-token-sum-norm+geometric"]
want = {}
for mode in modes:  # SP 1: the plain padded path, in this process alone
    whole.zero_grad()
    loss = loss_of(whole, exp, mode, torch.tensor(float(action_mask.sum())))
    loss.backward()
    want[mode] = loss.item(), {n: p.grad.clone() for n, p in whole.named_parameters()}

from accelerate import Accelerator  # noqa: E402  (after the unsharded model: ZeRO-3 would partition it)

from rft_core.sequence_parallel import SequenceParallel, sliced  # noqa: E402

accelerator = Accelerator(kwargs_handlers=process_group_kwargs())
ulysses = accelerator.state.deepspeed_plugin is not None  # else FSDP2's context parallelism
if not ulysses:  # torch's ring attention runs on the flash / efficient / cuDNN kernels, and in fp32 with
    # grouped KV heads sdpa takes the math kernel: here transformers repeats the heads itself, so the
    # efficient kernel computes in fp32 as the reference does (the scripts refuse CP without --bf16)
    import transformers.integrations.sdpa_attention as sdpa

    sdpa.use_gqa_in_sdpa = lambda *args, **kwargs: False
configure_deepspeed(accelerator, 1, None, 1e9)
optimizer = torch.optim.SGD(trained.parameters(), lr=0.0)
sp = SequenceParallel.from_accelerator(accelerator, trained)
model, optimizer = accelerator.prepare(trained, optimizer)
world = accelerator.num_processes
on = accelerator.device  # the reference ran on the CPU
exp = Experience(**{k: v.to(on) if torch.is_tensor(v) else v for k, v in vars(exp).items()})
want_logprobs = want_logprobs.to(on)
out = {"rank": accelerator.process_index, "sp_rank": sp.rank, "sp_size": sp.size, "world": world}
if ulysses:
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import safe_get_full_grad

    assert sp.rank == parallel_state_sp.get_sequence_parallel_rank()  # consecutive ranks, as assumed


def full_grads():
    named = accelerator.unwrap_model(model).named_parameters()
    return {n: safe_get_full_grad(p) if ulysses else p.grad.full_tensor() for n, p in named}


mb = sp.shard(exp)
out["owned"] = int(mb.action_mask.sum())
logprobs = batched_logprobs(model, exp, Forward(1.0, chunk_size, sp=sp), micro_batch_size=2)
out["logprobs"] = ((logprobs - want_logprobs) * exp.action_mask).abs().max().item()
for mode in modes:
    num_tokens = accelerator.reduce(mb.action_mask.sum().float(), "sum")  # each token counted once
    with sliced(sp, model, mb):  # the forward and the backward (context parallelism's ring attention)
        loss = loss_of(model, mb, mode, num_tokens, sp, groups=world // sp.size)
        # the scripts' scale: the mean over the world; DeepSpeed's own backward, which does not step
        (model.backward if ulysses else accelerator.backward)(loss * world)
    total = accelerator.reduce(loss.detach().clone(), "sum").item()
    grads = full_grads()
    worst = max((grads[n].cpu() - g).abs().max().item() / (g.abs().max().item() + 1e-12)
                for n, g in want[mode][1].items())
    out[mode] = {"loss": total, "want": want[mode][0], "grad_rel": worst}
    (model.optimizer if ulysses else optimizer).zero_grad()  # (accelerate's DeepSpeed wrapper's is a no-op)
with open(os.path.join(sys.argv[3], f"rank{accelerator.process_index}.json"), "w") as f:
    json.dump(out, f)
