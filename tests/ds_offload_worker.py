"""Run by tests/test_distributed.py under torchrun (one CPU rank, DS_ACCELERATOR=cpu): --optimizer_offload's
move under DeepSpeed ZeRO stage argv[1]. The ZeRO optimizer's state is its inner AdamW's: the moments of this
rank's partition move (to "meta", a stand-in for the GPU: a CPU-to-CPU move would show nothing), the CPU step
counter stays, and training goes on once they are back; adam_step_rms reads the partitions' state."""

import sys
from types import SimpleNamespace

import deepspeed
import torch

from rft_core.optim import adam_step_rms, move_optimizer_state


def main(stage):
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True}  # (accelerate's setting for a torch optimizer)
    engine, optimizer, _, _ = deepspeed.initialize(model=net, config=config,
                                                   optimizer=torch.optim.AdamW(net.parameters(), lr=0.1))

    def step():
        engine.backward(engine(torch.randn(1, 8)).sum())
        engine.step()

    step()
    wrapped = SimpleNamespace(optimizer=optimizer)  # as accelerate wraps it (DeepSpeedOptimizerWrapper)
    # AdamW's first step is m / sqrt(v) = g / |g|: 1 for every coordinate, read through ZeRO's partitions
    assert abs(adam_step_rms(wrapped).item() - 1) < 1e-4, adam_step_rms(wrapped)
    saved = {id(p): {k: v.clone() for k, v in state.items()} for p, state in optimizer.state.items()}
    assert saved, "no optimizer state to move"
    move_optimizer_state([wrapped], "meta")
    moved = {(k, v.device.type) for state in optimizer.state.values() for k, v in state.items()}
    assert moved == {("exp_avg", "meta"), ("exp_avg_sq", "meta"), ("step", "cpu")}, moved
    for p, state in optimizer.state.items():  # meta holds no data: the values back, then the move back
        state.update(saved[id(p)])
    move_optimizer_state([wrapped], "cpu")
    step()
    assert 0 < adam_step_rms(wrapped).item() < 1  # a second gradient unlike the first: a smaller step
    print(f"stage {stage}: {type(optimizer).__name__} state moved and back")


if __name__ == "__main__":
    main(int(sys.argv[1]))
