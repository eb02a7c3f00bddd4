"""Sequence parallelism (issue 18): DeepSpeed's Ulysses and FSDP2's context parallelism through Accelerate's
parallelism config.

On CPU Accelerate and DeepSpeed allow Ulysses under ZeRO-3 (gloo, DS_ACCELERATOR=cpu, sdpa). They do not allow
FSDP2's context parallelism (Accelerate runs FSDP on GPUs only; torch's ring attention is CUDA only): on CPU
its layout is checked with torch's own context on a gloo mesh, the rest on two GPUs (marked). Nor
flash-attention (so no packed rows under SP)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import read_metrics, run_script

from rft_core.experience import Experience, Forward, micro_batch_logprobs
from rft_core.sequence_parallel import SequenceParallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SP2 = os.path.join(ROOT, "accelerate_configs", "deepspeed_zero3_sp2.yaml")
CP2 = os.path.join(ROOT, "accelerate_configs", "fsdp2_cp2.yaml")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")


def batch(prompt_lens=(5, 9, 3), response_lens=(11, 4, 20), seed=0):
    """An Experience of rows [pad prompt | response pad] of these lengths (as build_experience lays them)."""
    g = torch.Generator().manual_seed(seed)
    P, T = max(prompt_lens), max(response_lens)
    input_ids = torch.zeros(len(prompt_lens), P + T, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    action_mask = torch.zeros(len(prompt_lens), T, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        input_ids[b, P - p:P + r] = torch.randint(5, 400, (p + r,), generator=g)
        attention_mask[b, P - p:P + r] = 1
        action_mask[b, :r] = 1
    return Experience(input_ids, attention_mask, action_mask, torch.zeros(len(prompt_lens), T))


def test_slices_own_each_response_token_once():
    """Every response token is scored by exactly one rank of a group, for groups of 2, 3 and 4; each rank's
    slice is 1 / size of the row, which starts at position 0 and carries the next token as its target."""
    exp = batch()
    for size in (2, 3, 4):
        owned = [SequenceParallel(size, rank).layout(exp).owned for rank in range(size)]
        assert torch.equal(sum(o.long() for o in owned), exp.action_mask)
        part = SequenceParallel(size, 1).layout(exp)
        targets, width = part.targets, part.inputs["input_ids"].shape[1]
        assert width * size >= int(exp.attention_mask.sum(-1).max())
        assert part.inputs["position_ids"][0, 0] == width
        whole = SequenceParallel(1, 0).layout(exp).targets  # the unsplit row's
        n = min(width, whole.shape[1] - width)
        assert torch.equal(targets[:, :n], whole[:, width:width + n]) and not targets[:, n:].any()


def test_one_rank_and_the_first_slice_equal_the_padded_path(tiny_model_dir):
    """The unpadded-from-the-start layout of one rank (size 1) gives the padded path's logprobs and entropy;
    the first of two slices (a prefix: causal attention needs no other rank) gives them on the tokens it owns.
    Gradients too."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    exp = batch()
    mask = exp.action_mask.float()
    want, want_entropy = micro_batch_logprobs(model, exp, Forward(0.7, 8), "grad")
    (want * mask).sum().backward()
    want_grad = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    got, entropy = micro_batch_logprobs(model, exp, Forward(0.7, 8, sp=SequenceParallel(1, 0)), "grad")
    (got * mask).sum().backward()
    torch.testing.assert_close(got * mask, want * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy * mask, want_entropy * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.model.embed_tokens.weight.grad, want_grad, rtol=1e-4, atol=1e-6)
    first = SequenceParallel(2, 0)
    owned = first.shard(exp).action_mask.float()
    assert 0 < owned.sum() < mask.sum()
    with torch.no_grad():
        got = micro_batch_logprobs(model, exp, Forward(0.7, 8, sp=first))[0]
    torch.testing.assert_close(got * owned, want.detach() * owned, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_context_parallel_slices_are_the_contexts_columns(tmp_path):
    """Context parallelism's layout on two CPU ranks with torch's context_parallel
    (tests/cp_layout_worker.py): a rank's columns are those the context gives it (two chunks, head and tail,
    of a width that is a multiple of 128), together every column once; each column keeps its position and its
    next token as target; every response token is scored on exactly one rank, at the place of its predicting
    column."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          os.path.join(ROOT, "tests", "cp_layout_worker.py"), str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    exp = batch()
    width = ranks[0]["width"]
    assert width % 128 == 0 and width >= int(exp.attention_mask.sum(-1).max())
    assert sorted(ranks[0]["columns"] + ranks[1]["columns"]) == list(range(width))
    q = width // 4
    assert ranks[0]["columns"] == [*range(q), *range(3 * q, width)]  # head and tail: balanced causal work
    whole = SequenceParallel(1, 0).layout(exp).targets  # the unsplit rows' (width of the longest row)
    whole = torch.nn.functional.pad(whole, (0, width - whole.shape[1]))
    for r in ranks:
        cols = torch.tensor(r["columns"])
        assert torch.equal(torch.tensor(r["targets"]), whole[:, cols])
        assert all(row == r["columns"] for row in r["positions"])
    assert torch.equal(torch.tensor(ranks[0]["owned"]) + torch.tensor(ranks[1]["owned"]), exp.action_mask)
    prompt_lens = exp.attention_mask[:, :-exp.action_mask.shape[1]].sum(-1)
    for r in ranks:  # response token t of row b is predicted by column prompt_lens[b] + t - 1
        for b, t in torch.tensor(r["owned"]).nonzero().tolist():
            assert r["columns"][r["where"][b][t]] == prompt_lens[b] + t - 1


two_gpus = pytest.mark.gpu(count=2)
two_gpus_deepspeed = pytest.mark.gpu(count=2, needs="deepspeed")


@pytest.mark.slow
@pytest.mark.parametrize("config, device, groups", [
    pytest.param(SP2, "cpu", 1, marks=needs_deepspeed), pytest.param(SP2, "cpu", 2, marks=needs_deepspeed),
    pytest.param(SP2, "cuda", 1, marks=two_gpus_deepspeed), pytest.param(CP2, "cuda", 1, marks=two_gpus)],
    ids=["ulysses-cpu", "ulysses-dp2-cpu", "ulysses-cuda", "context-cuda"])
def test_sp2_equals_sp1_logprobs_losses_and_gradients(tiny_model_dir, tmp_path, config, device, groups):
    """Ulysses SP 2 under ZeRO-3 (accelerate_configs/deepspeed_zero3_sp2.yaml) and context parallelism 2 under
    FSDP2 (fsdp2_cp2.yaml), through tests/sp_worker.py on two ranks (CPU: gloo; cuda: two GPUs, NCCL), and
    Ulysses with data parallelism on four CPU ranks (two groups of 2, parallelism_config_dp_shard_size 2): the
    logprob pass summed over the group, the loss summed over the ranks and every parameter's gradient equal
    the unsharded model's on one process, for three loss aggregations (with the KL loss, the entropy bonus and
    TIS; the LM head chunked), and with sample-level TIS weights (sequence, geometric: summed over the
    slices)."""
    if groups > 1:  # the same config with data parallelism as well
        text = open(config).read().replace("num_processes: 2", f"num_processes: {2 * groups}")
        config = tmp_path / "dp_sp.yaml"
        key = "parallelism_config_dp_shard_size"
        config.write_text(text.replace(f"{key}: 1", f"{key}: {groups}"))
    path = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])  # the checkout first
    env = {**os.environ, "PYTHONPATH": path, "DS_ACCELERATOR": device, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                          os.path.join(ROOT, "tests", "sp_worker.py"), tiny_model_dir, "4", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2 * groups)]
    assert [r["sp_rank"] for r in ranks] == [0, 1] * groups and all(r["sp_size"] == 2 for r in ranks)
    assert all(r["owned"] > 0 for r in ranks)  # both ranks score tokens
    tolerance = 1e-5 if device == "cpu" else 1e-4  # the GPU's kernels against the CPU's reference
    for r in ranks:
        assert r["logprobs"] < tolerance
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-mean+sequence",
                     "seq-mean-token-sum-norm+geometric"):
            assert abs(r[mode]["loss"] - r[mode]["want"]) <= tolerance * abs(r[mode]["want"]), (mode, r)
            assert r[mode]["grad_rel"] < 10 * tolerance, (mode, r)


@pytest.mark.slow
@pytest.mark.parametrize("config", [pytest.param(SP2, marks=needs_deepspeed, id="ulysses-cpu"),
                                    pytest.param(CP2, marks=two_gpus, id="context-cuda")])
def test_train_ppo_runs_with_sequence_parallelism(tiny_model_dir, tmp_path, chars_reward, config):
    """train_ppo.py end to end under deepspeed_zero3_sp2.yaml on two CPU ranks (and fsdp2_cp2.yaml on two
    GPUs, with vLLM where installed), with the KL loss against a sharded reference model and sample-level
    TIS weights (a collective in the loss, summing each sample's slices): both ranks of the
    group train the group's 8 samples (gathered), the policy moves, a checkpoint and the model are written
    (resuming is the sharded resume tests' path: per-rank states by process index)."""
    prompts = tmp_path / "prompts.jsonl"  # a file without an eval split: no held-out eval (time)
    rows = [json.dumps({"prompt": f"Count to {i}.", "label": str(i)}) + "\n" for i in range(16)]
    prompts.write_text("".join(rows))
    args = ["--pretrain", tiny_model_dir, "--prompt_data", str(prompts), "--reward_fn", chars_reward,
            "--rollout_batch_size", "4",
            "--n_samples_per_prompt", "2", "--generate_max_len", "12", "--actor_learning_rate", "1e-3",
            "--use_kl_loss", "--init_kl_coef", "0.1", "--tis_cap", "2", "--tis_level", "sequence",
            "--max_steps", "2", "--save_steps", "1", "--output_dir", str(tmp_path / "run")]
    cuda = config == CP2
    args += ["--engine_enforce_eager"] if cuda and importlib.util.find_spec("vllm") else []
    env = {"DS_ACCELERATOR": "cuda" if cuda else "cpu", "OMP_NUM_THREADS": "1"}
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--config_file", config)
    out = run_script("train_ppo.py", args, launcher=launcher, env=env).stdout
    assert "2 processes" in out
    steps, _ = read_metrics(str(tmp_path / "run"))
    assert [m["step"] for m in steps] == [1, 2] and all(m["train/grad_norm"] > 0 for m in steps)
    # the engine sampled the whole rows that the ranks scored in slices: the same logprobs; and the reference
    # model's sliced pass equals the policy's before the first update
    assert max(m["rollout/logprob_diff_mean"] for m in steps) < (0.02 if cuda else 1e-4)  # (bf16 on GPUs)
    # so a whole sample's weight is near 1 too (its slices' sums added), and its log is logged
    assert all(abs(m["train/is_weight_mean"] - 1) < (0.5 if cuda else 1e-3) for m in steps)
    assert max(m["rollout/logprob_diff_seq_mean"] for m in steps) < (0.5 if cuda else 1e-3)
    assert abs(steps[0]["train/kl"]) < 1e-6 < steps[1]["train/kl"]
    assert os.path.isdir(tmp_path / "run" / "checkpoint-2") and os.path.isfile(tmp_path / "run" / "model" /
                                                                                "config.json")


def test_groups_and_the_heads_check():
    """A rank's place in its group is its index modulo the group size (DeepSpeed's consecutive groups; the SP
    worker checks it against DeepSpeed's); without SP there is no group; a model whose attention heads do not
    divide over the group is refused in one line before DeepSpeed's traceback in prepare."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from rft_core.errors import ConfigError

    def accelerator(sp_size, index):
        return SimpleNamespace(parallelism_config=SimpleNamespace(sp_size=sp_size), process_index=index)

    model = SimpleNamespace(config=LlamaConfig(num_attention_heads=6, hidden_size=48))
    assert SequenceParallel.from_accelerator(accelerator(2, 3), model) == SequenceParallel(2, 1)
    assert SequenceParallel.from_accelerator(accelerator(3, 7), model) == SequenceParallel(3, 1)
    assert SequenceParallel.from_accelerator(accelerator(1, 1), model) is None
    assert SequenceParallel.from_accelerator(SimpleNamespace(parallelism_config=None), model) is None
    message = "the model's 6 attention heads do not divide over parallelism_config_sp_size 4 .*: set an sp"
    with pytest.raises(ConfigError, match=message):
        SequenceParallel.from_accelerator(accelerator(4, 0), model)
