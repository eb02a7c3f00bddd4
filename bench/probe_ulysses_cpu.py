"""Issue 18 groundwork: does Accelerate's DeepSpeed Ulysses sequence parallelism run on this CPU machine?

Launch with a ZeRO-3 config that has `parallelism_config_sp_size: 2` (deepspeed_zero3.yaml plus the keys):

    DS_ACCELERATOR=cpu accelerate launch --config_file Z3_SP2.yaml bench/probe_ulysses_cpu.py [MODEL_DIR]

Each rank feeds its half of one sequence (global position_ids) through the prepared model and compares its
logits with an unsharded forward of the whole sequence (eager attention, loaded before the Accelerator so
ZeRO-3 does not partition it). Prints, per rank, accelerate's process_index / num_processes, the torch rank,
the sequence-parallel rank and the largest logit difference.
Seen 2026-11-23 (tiny Llama, sdpa): differences 1.8e-7 and 1.2e-7. Accelerate reported 1 process, index 0 on
both ranks: a bare Accelerator() under DeepSpeed without a GPU names no process-group backend, so it sees
one process (the scripts pass distributed.process_group_kwargs(): gloo, two processes). The training
scripts' version of this is rft_core/sequence_parallel.py, checked by tests/test_sequence_parallel.py.
"""

import sys

import torch
from transformers import AutoModelForCausalLM

model_dir = sys.argv[1] if len(sys.argv) > 1 else "/tmp/rft_tiny/model"
L = 16
ids = torch.randint(5, 100, (1, L), generator=torch.Generator().manual_seed(1))
pos = torch.arange(L).unsqueeze(0)
whole = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
with torch.no_grad():
    full = whole(input_ids=ids, position_ids=pos, use_cache=False).logits  # (1, L, V)

from accelerate import Accelerator  # noqa: E402  (after the unsharded model: ZeRO-3 would partition it)
from deepspeed.utils import groups  # noqa: E402

accelerator = Accelerator()
model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
model, optimizer = accelerator.prepare(model, optimizer)
rank, size = groups._get_sequence_parallel_rank(), groups._get_sequence_parallel_world_size()
part = slice(rank * L // size, (rank + 1) * L // size)
model.train()
logits = model(input_ids=ids[:, part], position_ids=pos[:, part], use_cache=False).logits  # (1, L / sp, V)
print(f"process_index {accelerator.process_index} of {accelerator.num_processes} | torch rank "
      f"{torch.distributed.get_rank()} | sp rank {rank} of {size} | max logit diff "
      f"{(logits.detach() - full[:, part]).abs().max().item():.3g}", flush=True)
