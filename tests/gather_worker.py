"""Run by tests/test_distributed.py under torchrun (2 CPU ranks, gloo): shard a tiny Llama with FSDP2
and with DeepSpeed ZeRO-3 (if installed), each with and without LoRA, and check full_weights against the
unsharded weights."""

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import rft_core.distributed as D
import rft_core.engines.sync as S
from rft_core.models import merged_state_dict


def check(model_dir, mode, lora):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p)  # B starts at 0: make the merge matter
    want = {k: v.clone() for k, v in merged_state_dict(model).items()}  # the unsharded answer
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.base_model.model.model.layers if lora else model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        import deepspeed

        model = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                          "zero_optimization": {"stage": 3}})[0].module
    assert D.sharding(model) == mode
    units, gather = [], S.gathered

    def counting(tensors):  # the size of each unit gathered at once
        units.append(sum(D_numel(t) for t in tensors))
        return gather(tensors)

    S.gathered = counting
    try:
        got = dict(S.full_weights(model, torch.float32))
    finally:
        S.gathered = gather
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst == 0.0, worst
    layers = [sum(v.numel() for k, v in want.items() if k.startswith(f"model.layers.{i}.")) for i in range(2)]
    # a layer or a single tensor (embedding)
    biggest = max(max(layers), max(v.numel() for v in want.values()))
    assert max(units) <= biggest and len(units) >= 4, units  # one piece at a time, never the whole model
    print(f"OK {mode} lora={lora} rank={dist.get_rank()} units={units}")


def D_numel(t):
    return t.ds_numel if hasattr(t, "ds_numel") else t.numel()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for mode in sys.argv[2:]:
        for lora in (False, True):
            check(sys.argv[1], mode, lora)
