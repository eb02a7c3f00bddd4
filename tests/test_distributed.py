"""Sharded training on CPU: DeepSpeed ZeRO (2 gloo ranks, DS_ACCELERATOR=cpu) through the real config
files, the layer-wise weight gather under FSDP2 and ZeRO-3, and every accelerate config file."""

import glob
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_train_smoke import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "accelerate_configs", "*.yaml")))
RUN = ["--max_steps", "2", "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
       "--micro_train_batch_size", "1", "--micro_rollout_batch_size", "4", "--generate_max_len", "8",
       "--use_kl_loss", "--init_kl_coef", "0.1", "--actor_learning_rate", "1e-3"]


def launch_env(**env):
    """A launched process's environment: this checkout first on the path, DeepSpeed on the CPU unless env
    says otherwise."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "DS_ACCELERATOR": "cpu", **env}


def launch(cmd, timeout=600, **env):
    env = launch_env(**env)
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # a hang: what it printed until then (bytes, whatever text= says)
        printed = "".join((x or b"").decode(errors="replace")[-4000:] for x in (e.stdout, e.stderr))
        pytest.fail(f"no exit in {timeout} s; its output ends:\n{printed}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout


def launch_machines(config, args, log_dir, timeout=600, **env):
    """An accelerate config for several machines (multi_node.yaml) as two machines of one process each on
    this host, the way a multi-node job runs: the same command on both, --machine_rank 0 and 1, the head at
    127.0.0.1. On a GPU host each machine sees one GPU of its own. The output of both (machine 0's first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runs = []
    for rank in range(2):
        log = open(os.path.join(log_dir, f"machine{rank}.log"), "w+")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_machines",
               "2", "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
               "--main_process_port", str(port), *args]
        gpu = {"CUDA_VISIBLE_DEVICES": str(rank)} if torch.cuda.is_available() else {}
        proc = subprocess.Popen(cmd, cwd=log_dir, env=launch_env(**env, **gpu), stdout=log,
                                stderr=subprocess.STDOUT)
        runs.append((proc, log))
    codes = []
    for proc, _ in runs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append("timeout")
    printed = []
    for _, log in runs:
        log.seek(0)
        printed.append(log.read())
        log.close()
    assert codes == [0, 0], f"exit codes {codes}; machine 0's output ends:\n{printed[0][-4000:]}"
    return "".join(printed)


def test_config_files_load():
    """Each config parses as accelerate's own launcher reads it, with the backend its name promises."""
    from accelerate.commands.config.config_args import load_config_from_file

    names = {os.path.basename(p)[:-5] for p in CONFIGS}
    assert names >= {"single_gpu", "multi_gpu", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3",
                     "deepspeed_zero3_offload", "fsdp2", "fsdp2_offload", "multi_node"}
    for path in CONFIGS:
        config, name = load_config_from_file(path), os.path.basename(path)
        if name.startswith("deepspeed") or name == "multi_node":
            stage = int(name[len("deepspeed_zero")]) if name.startswith("deepspeed") else 3
            assert (config.distributed_type.name == "DEEPSPEED"
                    and config.deepspeed_config["zero_stage"] == stage)
            assert ((config.deepspeed_config["offload_optimizer_device"] == "cpu")
                    == name.endswith("offload.yaml"))
        if name.startswith("fsdp2"):
            assert config.distributed_type.name == "FSDP" and config.fsdp_config["fsdp_version"] == 2
            assert config.fsdp_config["fsdp_offload_params"] == name.endswith("offload.yaml")
        assert config.mixed_precision == "no"  # the script picks bf16 itself


@pytest.mark.slow
def test_full_weights_sharded(tiny_model_dir):
    """The vLLM weight sync's gather under FSDP2 and ZeRO-3, with and without LoRA: every weight exact (LoRA
    merged), one layer or tensor at a time."""
    modes = ["fsdp2"] + (["zero3"] if importlib.util.find_spec("deepspeed") else [])
    out = launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                  os.path.join(ROOT, "tests", "gather_worker.py"), tiny_model_dir, *modes])
    assert out.count("OK") == 2 * 2 * len(modes)


@pytest.mark.slow
def test_deepspeed_zero3_matches_ddp_resumes_and_spans_machines(tiny_model_dir, tiny_rm_dir, tmp_path,
                                                                 chars_reward):
    """ZeRO-3 through accelerate_configs/deepspeed_zero3.yaml, with the actor, the reference model (KL loss),
    a teacher (distillation) and a reward model all sharded: the same rewards, grad norms, KL, the teacher's
    gap and exported weights as DDP on the same seed (DDP by one-sample micro-batches, ZeRO-3 by a token
    budget, with --optimizer_offload); stopped after step 1 and resumed, step 2 is still DDP's step 2. And
    multi_node.yaml run as two machines of one process each (machine ranks 0 and 1 on this host): the same
    steps again (its DeepSpeed launcher once made each machine a job of its own without a word)."""
    pytest.importorskip("deepspeed")
    args = [os.path.join(ROOT, "train_ppo.py"), "--pretrain", tiny_model_dir, *RUN,
            "--reward_fn", chars_reward, "--reward_pretrain", tiny_rm_dir, "--reward_weights", "1", "1",
            "--teacher_pretrain", tiny_model_dir, "--distill_coef", "0.5"]
    launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *args,
            "--output_dir", str(tmp_path / "ddp")], ACCELERATE_USE_CPU="true")
    # ZeRO-3 with micro-batches by tokens: a budget of about one sample, so the ranks' counts can differ (and
    # are synced to the max); the same step as one sample per micro-batch
    i = args.index("--micro_train_batch_size")
    by_tokens = args[:i] + args[i + 2:]
    zero3 = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
             os.path.join(ROOT, "accelerate_configs", "deepspeed_zero3.yaml"), *by_tokens,
             "--save_steps", "1", "--max_tokens_per_micro_batch", "30", "--optimizer_offload",
             "--output_dir", str(tmp_path / "z3")]
    launch([*zero3, "--max_steps", "1"])  # the later --max_steps wins
    assert os.path.isdir(tmp_path / "z3" / "checkpoint-1")
    out = launch(zero3)
    assert "[resume] from" in out and "2 processes" in out
    ddp, _ = read_metrics(str(tmp_path / "ddp"))
    z3, _ = read_metrics(str(tmp_path / "z3"))
    assert [r["step"] for r in z3] == [1, 2]
    for a, b in zip(ddp, z3):
        for key in ("train/grad_norm", "train/kl", "train/policy_loss", "rollout/reward_mean",
                    "rollout/reward/rm0", "train/distill_kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert z3[1]["train/kl"] > 0 and z3[1]["train/distill_kl"] != 0  # the sharded frozen models are in use
    want, got = (load_file(str(tmp_path / d / "model" / "model.safetensors")) for d in ("ddp", "z3"))
    assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    assert json.load(open(tmp_path / "z3" / "config.json"))["world_size"] == 2

    out = launch_machines(os.path.join(ROOT, "accelerate_configs", "multi_node.yaml"),
                          [*by_tokens, "--max_tokens_per_micro_batch", "30",
                           "--output_dir", str(tmp_path / "mn")], str(tmp_path))
    assert out.count("2 processes") == 2  # each machine's log: one job of two processes
    nodes, _ = read_metrics(str(tmp_path / "mn"))
    assert [r["step"] for r in nodes] == [1, 2] and set(nodes[0]) == set(z3[0])
    for a, b in zip(ddp, nodes):
        for key in ("train/grad_norm", "train/kl", "rollout/reward_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


def test_hf_architecture_names_the_transformers_class(tiny_model_dir):
    """vLLM looks the model up by class name: FSDP2's FSDP<class> subclass and peft's wrapper map back."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rft_core.engines import hf_architecture

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert hf_architecture(model) == "LlamaForCausalLM"
    from torch.distributed.fsdp import FSDPModule

    model.__class__ = type("FSDPLlamaForCausalLM", (FSDPModule, type(model)), {})  # as fully_shard does
    assert hf_architecture(model) == "LlamaForCausalLM"
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                          LoraConfig(r=2, target_modules="all-linear"))
    assert hf_architecture(lora) == "LlamaForCausalLM"


def test_move_optimizer_state():
    """--optimizer_offload: AdamW's moments move, its CPU step counter stays, and training goes on."""
    from rft_core.optim import move_optimizer_state

    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    want = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in net.parameters()}
    move_optimizer_state([opt], "meta")  # a stand-in for the GPU
    assert all({k: v.device.type for k, v in opt.state[p].items()}
               == {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}
               for p in net.parameters())
    for p in net.parameters():  # meta holds no data: put the values back, then a round trip to the CPU
        opt.state[p].update(want[p])
    move_optimizer_state([opt], "cpu")
    assert all(torch.equal(opt.state[p][k], v) for p in net.parameters() for k, v in want[p].items())
    opt.step()


def test_host_copy_keeps_a_dtensors_layout():
    """FSDP2's moments are DTensors: their CPU copy (pinned with a GPU; here not) holds the local shard
    in a buffer reused by the next move, and keeps the mesh, placements and global shape, so moving it back
    gives the DTensor it was (on one gloo rank: a mesh of 1)."""
    import socket

    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from rft_core.optim import host_copy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
        moment, buffers = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]), {}
        first = host_copy(moment, buffers, ("p", "exp_avg"), pin=False)
        assert isinstance(first, DTensor) and first.placements == moment.placements
        assert first.shape == moment.shape and first.device_mesh is moment.device_mesh
        assert torch.equal(first.to_local(), moment.to_local()) and first.to_local() is not moment.to_local()
        again = host_copy(moment * 2, buffers, ("p", "exp_avg"), pin=False)  # the next move: the same buffer
        assert again.to_local().data_ptr() == buffers["p", "exp_avg"].data_ptr()
        assert torch.equal(again.full_tensor(), moment.full_tensor() * 2)
        plain = host_copy(torch.ones(3), buffers, ("q", "exp_avg_sq"), pin=False)
        assert type(plain) is torch.Tensor and plain is buffers["q", "exp_avg_sq"]
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.gpu
def test_move_optimizer_state_reuses_pinned_buffers():
    """With a GPU the moments go to pinned CPU buffers, made on the first move and reused by the next ones,
    holding the values they had on the GPU."""
    from rft_core.optim import move_optimizer_state

    net = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    buffers = []
    for _ in range(2):
        net(torch.randn(4, 64, device="cuda")).sum().backward()
        opt.step()
        want = {(p, k): v.cpu() for p in net.parameters() for k, v in opt.state[p].items() if k != "step"}
        move_optimizer_state([opt], "cpu")
        moved = {(p, k): opt.state[p][k] for p, k in want}
        assert all(v.device.type == "cpu" and v.is_pinned() and torch.equal(v, want[key])
                   for key, v in moved.items())
        buffers.append({key: v.data_ptr() for key, v in moved.items()})
        move_optimizer_state([opt], "cuda")
        assert all(opt.state[p][k].is_cuda for p, k in want)
    assert buffers[0] == buffers[1]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_move_optimizer_state_under_deepspeed(stage):
    """--optimizer_offload under DeepSpeed ZeRO-1 and ZeRO-3 moves the inner AdamW's moments, and the next
    optimizer step runs (tests/ds_offload_worker.py, one CPU rank)."""
    pytest.importorskip("deepspeed")
    out = launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                  os.path.join(ROOT, "tests", "ds_offload_worker.py"), str(stage)])
    assert f"stage {stage}: " in out, out[-2000:]


def test_adam_step_rms_against_adams_recurrences():
    """adam_step_rms: m_hat / (sqrt(v_hat) + eps) of the step AdamW just took, RMS over the parameters,
    against the recurrences written out for scalar gradients; 1 for a repeated gradient, small after large
    gradients (as partial rollout's first batches of short answers leave in AdamW's moments); chunked
    alike."""
    from rft_core.optim import adam_step_rms

    param = torch.nn.Parameter(torch.zeros(5))
    optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    scales = [10.0] * 3 + [0.1] * 12
    direction = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])
    m = v = 0.0
    for t, scale in enumerate(scales, 1):
        param.grad = scale * direction
        optimizer.step()
        m, v = 0.9 * m + 0.1 * scale, 0.95 * v + 0.05 * scale ** 2  # per unit of |direction|
        want = (m / (1 - 0.9 ** t)) / math.sqrt(v / (1 - 0.95 ** t))  # eps: negligible here
        assert adam_step_rms(optimizer).item() == pytest.approx(want, rel=1e-5), t
        assert adam_step_rms(optimizer, chunk=2).item() == pytest.approx(want, rel=1e-5)
    # a hundred times smaller gradients after large ones: momentum carries the large ones a few steps, the
    # second moment longer, so twelve steps on the step is still about a quarter of a repeated gradient's
    assert 0.2 < want < 0.35
    assert adam_step_rms(torch.optim.SGD([param], lr=0.1)) is None  # not Adam: no figure


def test_choose_budget():
    """The update's token budget: beside the awake engine where 8192+ tokens fit there, else while it sleeps
    (4096+), else gradient checkpointing; capped at 32768; a user's budget is kept, checkpointing decided for
    it. Figures: 1 MiB per token, room and engine in GiB (the 135M, 0.5B, 1.5B and 7B cases seen on an
    H100)."""
    from rft_core.memory import AUTO_MAX_TOKENS, choose_budget

    mib, gib = 2**20, 2**30
    assert AUTO_MAX_TOKENS == 32768
    assert choose_budget(mib, 64 * gib, 22 * gib, True, 16384, False) == (False, 32768, True)  # capped
    assert choose_budget(mib, 38 * gib, 22 * gib, True, 16384, False) == (False, 16384, True)  # 16 GiB beside
    # 7k beside
    assert choose_budget(2 * mib, 36 * gib, 22 * gib, True, 16384, False) == (False, 18432, False)
    # never sleeps
    assert choose_budget(2 * mib, 36 * gib, 22 * gib, False, 16384, False) == (False, 7168, True)
    assert choose_budget(4 * mib, 12 * gib, 0, True, 16384, False) == (True, 16384, False)  # 3k tokens: ckpt
    assert choose_budget(mib, 64 * gib, 22 * gib, True, 50000, True) == (False, 50000, False)  # the user's
    assert choose_budget(mib, 40 * gib, 22 * gib, True, 50000, True) == (True, 50000, False)
    # a tiny model whose activations are below the measurement's noise (-154 KiB a token, seen on the tiny
    # Qwen2-VL with SGLang): the largest budget, no checkpointing, not a checkpointed run
    assert choose_budget(-154 * 2**10, 66 * gib, 24 * gib, True, 16384, False) == (False, 32768, True)


def test_cpu_budget_follows_the_activations_and_the_memory_available(tiny_model_dir, monkeypatch):
    """On a CPU the update's token budget keeps the activations within CPU_ACTIVATIONS and half the memory
    available (less gradients and AdamW's moments): the activations a token keeps are measured (linear in the
    tokens: the same per token at two sizes); at least 512 tokens; a user's budget kept; the run's random
    streams untouched."""
    from types import SimpleNamespace

    import psutil

    from rft_core import memory
    from rft_core.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(tiny_model_dir)
    model.train()
    small, large = memory.saved_bytes(model, 128), memory.saved_bytes(model, 256)
    per_token = (large - small) / 128
    assert per_token > 0
    assert abs((memory.saved_bytes(model, 384) - large) / 128 - per_token) < 0.01 * per_token
    states = 12 * sum(p.numel() for p in model.parameters())
    for available, want in ((1 << 40, 16384), (2 * states + 2 * 2048 * per_token, 2048), (2 * states, 512)):
        memory_left = SimpleNamespace(available=available)
        monkeypatch.setattr(psutil, "virtual_memory", lambda memory_left=memory_left: memory_left)
        monkeypatch.setattr(memory, "CPU_ACTIVATIONS", 1 << 40)
        got = memory.plan_cpu_memory(model, 16384, log=lambda m: None)
        assert got == (False, want) or want == 2048 and got == (False, 1536), (available, got)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1 << 40))
    monkeypatch.setattr(memory, "CPU_ACTIVATIONS", int(1024 * per_token))  # the cap: 1024 tokens' worth
    rng = torch.get_rng_state()  # the measurement draws from its own generator: sampling stays as it was
    assert memory.plan_cpu_memory(model, 16384, log=lambda m: None) == (False, 1024)
    assert torch.equal(torch.get_rng_state(), rng)
    assert memory.plan_cpu_memory(model, 300, fixed_budget=True, log=lambda m: None) == (False, 300)


def test_zero3_gradient_bytes_counts_what_prepare_made():
    """The update's plan does not count twice the gradient partition ZeRO-3 allocated in prepare: its bytes,
    where it is off the CPU (a meta tensor stands in for the GPU's); none for other models or ZeRO-Offload."""
    from types import SimpleNamespace

    from rft_core.memory import zero3_gradient_bytes

    def engine(buffer):
        return SimpleNamespace(optimizer=SimpleNamespace(grad_partitions_flat_buffer=buffer))

    assert zero3_gradient_bytes(engine(torch.empty(1000, device="meta"))) == 4000
    assert zero3_gradient_bytes(engine(torch.empty(1000, dtype=torch.bfloat16, device="meta"))) == 2000
    assert zero3_gradient_bytes(engine(torch.empty(1000))) == 0  # offloaded: on the CPU
    assert zero3_gradient_bytes(engine(None)) == 0
    assert zero3_gradient_bytes(torch.nn.Linear(2, 2)) == 0


def test_evaluate_pads_ranks_to_equal_work():
    """With sharded weights every generate call is a collective: each rank generates for as many rows,
    and the padding rows are not counted."""
    from rft_core.engines.base import Generation
    from rft_core.evaluation import eval_line, evaluate
    from rft_core.experience import Sample

    class Engine:
        def __init__(self):
            self.sizes = []

        def wake_up(self):
            pass

        def generate(self, ids, max_len, temperature=0.0, mm=None, logprob_every=1):
            self.sizes.append(len(ids))
            return [Generation([7], [0.0]) for _ in ids]

    class Accel:
        def __init__(self, rank):
            self.process_index, self.num_processes, self.device = rank, 2, "cpu"

        def reduce(self, t, op):
            return t

    class Tok:
        def batch_decode(self, ids, skip_special_tokens=True):
            return ["x" for _ in ids]

    rows = [Sample([1], str(i), "p") for i in range(5)]  # rank 0 gets 3 rows, rank 1 gets 2 (+1 padding)

    def score(samples):  # the reward of problem 0 fails (the fallback, 0): counted, padding copies not
        for s in samples:
            failed = s.label == "0"
            s.reward, s.components = (0.0, {"correct": math.nan}) if failed else (1.0, {"correct": 1.0})
        return sum(s.label == "0" for s in samples)
    for rank, count, failed in ((0, 3, 1 + 2), (1, 2, 0)):  # rank 1's padding row is a copy of problem 0
        engine = Engine()
        metrics = evaluate(engine, Tok(), rows, score, Accel(rank), 4, n_samples=2)
        assert engine.sizes == [3, 6] and metrics["eval/num_problems"] == count
        assert metrics["eval/accuracy"] == (count - (rank == 0)) / count
        assert metrics["eval/reward_errors"] == failed
    line = eval_line(0, {"eval/reward_mean": 0.5, "eval/num_problems": 5, "eval/reward_errors": 3}, 1)
    assert line == ("[eval] step 0 | greedy reward 0.500 on 5 held-out problems (3 rewards failed and count "
                    "as --reward_fallback)")


# ---- GPU ----

@pytest.mark.slow
@pytest.mark.gpu(count=2, needs="vllm")
@pytest.mark.parametrize("config", ["deepspeed_zero3", "fsdp2", "multi_node"])
def test_sharded_configs_with_vllm(tmp_path, config):
    """The embedded model, sharded over 2 GPUs with vLLM colocated: the layer-wise sync keeps vLLM's
    logprobs on the trainer's, and the export loads. multi_node: ZeRO-3 over two machines of one GPU each
    (machine ranks 0 and 1 on this host)."""
    if config != "fsdp2":
        pytest.importorskip("deepspeed")
    path = os.path.join(ROOT, "accelerate_configs", f"{config}.yaml")
    args = [os.path.join(ROOT, "train_ppo.py"), "--engine_type", "vllm", "--engine_enforce_eager",
            "--use_kl_loss", "--max_steps", "2", "--output_dir", str(tmp_path / "run")]
    if config == "multi_node":
        assert launch_machines(path, args, str(tmp_path), DS_ACCELERATOR="cuda").count("2 processes") == 2
    else:
        launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", path, *args],
               DS_ACCELERATOR="cuda")
    steps, _ = read_metrics(str(tmp_path / "run"))
    assert len(steps) == 2 and all(r["rollout/logprob_diff_mean"] < 0.05 and r["train/kl"] >= 0
                                   for r in steps)
    assert os.path.isfile(tmp_path / "run" / "model" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.gpu(needs="sglang")
@pytest.mark.parametrize("config", ["deepspeed_zero3", "fsdp2"])
def test_sharded_configs_on_one_gpu_with_sglang(tmp_path, config):
    """SGLang colocated under ZeRO-3 / FSDP2 (one process): the sync gathers one layer at a time into SGLang's
    update_weights_from_tensor, and SGLang's logprobs stay on the trainer's."""
    if config.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            os.path.join(ROOT, "accelerate_configs", f"{config}.yaml"), "--num_processes", "1",
            os.path.join(ROOT, "train_ppo.py"), "--engine_type", "sglang", "--engine_enforce_eager",
            "--use_kl_loss", "--max_steps", "2", "--output_dir", str(tmp_path)],
           timeout=270, DS_ACCELERATOR="cuda")
    steps, _ = read_metrics(str(tmp_path))
    assert len(steps) == 2
    assert all(r["rollout/logprob_diff_mean"] < 0.05 and r["train/kl"] >= 0 for r in steps)


@pytest.mark.slow
@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_tensor_parallel_over_two_gpus(tmp_path, engine):
    """--engine_tp_size 2 on two GPUs (DDP, two processes): both ranks' prompts go to the one engine the pair
    shares and each rank gets its own outputs back, in order, so every step trains and the engine's logprobs
    stay on the trainer's after each sync. The model is bench_sizes.py's random Qwen2 of the 0.5B shape (14
    heads, 2 KV heads: SmolLM2-135M's 9 heads do not split over 2 ranks), with its pseudo-random reward, so
    every step moves the weights the engine must follow."""
    if importlib.util.find_spec(engine) is None:
        pytest.skip(f"needs {engine}")
    sys.path.insert(0, ROOT)
    from bench.bench_sizes import make_model

    model = make_model("0.5b", str(tmp_path))
    launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            os.path.join(ROOT, "accelerate_configs", "multi_gpu.yaml"), os.path.join(ROOT, "train_ppo.py"),
            "--pretrain", model, "--reward_fn", os.path.join(ROOT, "bench", "bench_sizes.py") + ":reward",
            "--engine_type", engine, "--engine_tp_size", "2", "--engine_enforce_eager", "--max_steps", "3",
            "--rollout_batch_size", "16", "--n_samples_per_prompt", "4", "--generate_max_len", "64",
            "--output_dir", str(tmp_path / "run")], timeout=400, DS_ACCELERATOR="cuda")
    steps, _ = read_metrics(str(tmp_path / "run"))
    assert len(steps) == 3 and all(r["train/grad_norm"] > 0 for r in steps)
    assert all(r["rollout/logprob_diff_mean"] < 0.05 and r["rollout/tokens_generated"] > 0 for r in steps)


@pytest.mark.gpu
def test_fsdp2_moments_move_to_pinned_buffers():
    """FSDP2 (fully_shard on one GPU): --optimizer_offload moves the AdamW moments, DTensors, into pinned
    buffers (a pageable copy cost ~15x more a move), keeping their layout, and the next step trains on them
    back on the GPU."""
    import socket

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from rft_core.optim import move_optimizer_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        net = fully_shard(torch.nn.Linear(64, 64).cuda())
        opt = torch.optim.AdamW(net.parameters(), lr=0.1)
        for _ in range(2):
            net(torch.randn(4, 64, device="cuda")).sum().backward()
            opt.step()
            want = {(p, k): v.full_tensor().cpu() for p in net.parameters() for k, v in opt.state[p].items()
                    if k != "step"}
            move_optimizer_state([opt], "cpu")
            for (p, k), value in want.items():
                moved = opt.state[p][k]
                assert isinstance(moved, DTensor) and moved.to_local().is_pinned()
                assert torch.equal(moved.to_local(), value)  # one rank: the shard is the whole tensor
            move_optimizer_state([opt], "cuda")
            assert all(v.is_cuda for p in net.parameters() for k, v in opt.state[p].items() if k != "step")
    finally:
        torch.distributed.destroy_process_group()


def moments_of(state):
    """Every AdamW moment tensor (exp_avg, exp_avg_sq) in a loaded DeepSpeed optimizer checkpoint."""
    if isinstance(state, dict):
        return [t for k, v in state.items()
                for t in ([v] if k in ("exp_avg", "exp_avg_sq") else moments_of(v))]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in moments_of(v)]
    return []


@pytest.mark.slow
@pytest.mark.gpu(needs="vllm")
def test_zero3_optimizer_offload_on_one_gpu_with_vllm(tmp_path):
    """DeepSpeed ZeRO-3 on one GPU, vLLM colocated, --optimizer_offload: the inner AdamW's moments are on
    the CPU between updates (the checkpoint saved after step 1 holds them there), the run resumes from it
    (DeepSpeed loads them back beside the parameters) and step 2 trains, with the layer-wise sync keeping
    vLLM's logprobs on the trainer's."""
    pytest.importorskip("deepspeed")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(ROOT, "accelerate_configs", "deepspeed_zero3.yaml"), "--num_processes", "1",
           os.path.join(ROOT, "train_ppo.py"), "--engine_type", "vllm", "--engine_enforce_eager",
           "--optimizer_offload", "--save_steps", "1", "--output_dir", str(tmp_path)]
    launch([*cmd, "--max_steps", "1"], DS_ACCELERATOR="cuda")
    [optim] = glob.glob(str(tmp_path / "checkpoint-1" / "**" / "*optim_states.pt"), recursive=True)
    moments = moments_of(torch.load(optim, map_location=None, weights_only=False))
    assert moments and {t.device.type for t in moments} == {"cpu"}
    out = launch([*cmd, "--max_steps", "2"], DS_ACCELERATOR="cuda")
    assert "[resume] from" in out
    steps, _ = read_metrics(str(tmp_path))
    assert [r["step"] for r in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["train/grad_norm"])) for r in steps)
    assert steps[1]["rollout/logprob_diff_mean"] < 0.05


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_adamw_warmup_is_transformers_constant_with_warmup(warmup):
    """The scripts' schedule (a torch LambdaLR: importing transformers' get_scheduler pulled in peft, 7 s of
    every start) gives the learning rates of transformers' constant_with_warmup, step for step."""
    from transformers import get_constant_schedule_with_warmup

    from rft_core.optim import adamw_with_warmup

    def rates(optimizer, scheduler):
        out = []
        for _ in range(8):
            out.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out

    reference = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    theirs = rates(reference, get_constant_schedule_with_warmup(reference, warmup))
    assert rates(*adamw_with_warmup(torch.nn.Linear(2, 2), 1e-3, warmup)) == pytest.approx(theirs)
