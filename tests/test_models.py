"""The critic / reward-model head, and the ptx loss, against transformers' own outputs."""

import functools
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rft_core.model_training import lm_loss, load_value_model, response_values
from rft_core.reward_sources import sequence_scores


def test_critic_from_actor(tiny_model_dir):
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    critic = load_value_model(actor=actor)
    assert all(torch.equal(a, c) for a, c in zip(actor.base_model.state_dict().values(),
                                                 critic.base_model.state_dict().values()))
    ids = torch.randint(5, 100, (2, 7))
    mask = torch.ones_like(ids)
    assert response_values(critic, ids, mask, 3).abs().max() == 0  # zero head: values start at 0
    torch.nn.init.normal_(critic.score.weight)
    values = response_values(critic, ids, mask, 3)  # (2, 3): the states before the last 3 tokens
    hidden = actor.base_model(input_ids=ids).last_hidden_state
    want = critic.score(hidden)[:, -4:-1, 0]
    assert values.shape == (2, 3) and torch.allclose(values, want, atol=1e-5)


def test_sequence_scores_padding_invariant(tiny_rm_dir):
    """A left-padded row scores like the same row unpadded, and like the classifier itself."""
    rm = load_value_model(tiny_rm_dir).eval()
    reference = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir).eval()
    ids = torch.randint(5, 100, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    with torch.no_grad():
        alone = sequence_scores(rm, ids, torch.ones_like(ids))
        assert torch.allclose(alone, sequence_scores(rm, padded, mask), atol=1e-5)
        assert torch.allclose(alone, reference(ids).logits[:, 0], atol=1e-5)


def test_lm_loss_ignores_padding(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(5, 100, (1, 6))
    want = model(input_ids=ids, labels=ids).loss
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    assert torch.allclose(lm_loss(model, padded, mask), want, atol=1e-5)


def test_merged_state_dict_matches_peft_merge(tiny_model_dir):
    """LoRA weights for vLLM / export: the adapters merged under the base names, the live model untouched."""
    import copy

    from peft import LoraConfig, get_peft_model

    from rft_core.models import merged_state_dict

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # B starts at 0: make the delta non-zero
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_state_dict(model)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    assert all(torch.allclose(merged[k], want[k], atol=1e-6) for k in want)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_logprobs_against_full_log_softmax(tiny_model_dir, temperature):
    """Logprobs and entropy of the response tokens == a naive log_softmax over every position's full
    logits at that temperature, left padding included."""
    from rft_core.logprobs import response_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    logprobs, entropy = response_logprobs(model, ids, mask, 3, temperature, with_entropy=True)
    for b in range(2):
        real = mask[b].bool()
        # (L, V), no padding at all
        logits = model(input_ids=ids[b:b + 1, real]).logits[0].float() / temperature
        logp = torch.log_softmax(logits, -1)
        want = [logp[t - 1, ids[b, real][t]].item() for t in range(real.sum() - 3, real.sum())]
        want_entropy = [-(logp[t - 1].exp() * logp[t - 1]).sum().item()
                        for t in range(real.sum() - 3, real.sum())]
        assert logprobs[b].tolist() == pytest.approx(want, abs=1e-5)
        # fp32 sums over the vocab
        assert entropy[b].tolist() == pytest.approx(want_entropy, abs=1e-5, rel=1e-5)


@pytest.mark.parametrize("dtype, temperature", [(torch.float32, 1.0), (torch.float32, 0.7),
                                                (torch.bfloat16, 1.0), (torch.bfloat16, 0.6)])
def test_token_logprobs_gradient_against_autograd(dtype, temperature):
    """TokenLogprobs' hand-written backward ((onehot - softmax) g / T) == autograd through a naive
    log_softmax, for fp32 and bf16 logits (a sliced, non-contiguous view as the model gives), with the entropy
    returned but not differentiated; and its inputs are left untouched."""
    from rft_core.logprobs import TokenLogprobs

    g = torch.Generator().manual_seed(0)
    full = (torch.randn(3, 6, 50, generator=g) * 3).to(dtype)
    targets = torch.randint(0, 50, (3, 5, 1), generator=g)
    weights = torch.randn(3, 5, generator=g)  # an arbitrary upstream gradient
    before = full.clone()
    ours_in = full.clone().requires_grad_()
    logprobs, entropy = TokenLogprobs.apply(ours_in[:, :-1], targets, temperature, True)
    (logprobs * weights).sum().backward()
    ref_in = full.clone().requires_grad_()
    logp = torch.log_softmax(ref_in[:, :-1].float() / temperature, -1)  # (3, 5, 50)
    want = logp.gather(-1, targets).squeeze(-1)
    (want * weights).sum().backward()
    assert torch.allclose(logprobs, want, atol=1e-5) and not entropy.requires_grad
    assert torch.allclose(entropy, -(logp.exp() * logp).sum(-1).detach(), atol=1e-4)
    assert ours_in.grad.dtype == dtype
    assert torch.allclose(ours_in.grad.float(), ref_in.grad.float(),
                          atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert torch.equal(full, before)
    none_logprobs, no_entropy = TokenLogprobs.apply(full[:, :-1], targets, temperature, False)
    assert no_entropy is None and torch.allclose(none_logprobs, want.detach(), atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("autocast", [False, True])
def test_chunked_logprobs_equal_the_plain_path(tiny_model_dir, autocast, device):
    """--chunk_size (the fused LM head): logprobs, entropy (with its gradient, for an entropy bonus) and every
    parameter's gradient equal the model's own logits path, on rows of several lengths, prompts left-padded
    and responses right-padded, at a temperature, in fp32 and under bf16 autocast; chunks that do not divide
    the tokens. On a GPU the chunks' math is compiled."""
    from rft_core.engines.base import Generation
    from rft_core.experience import build_experience
    from rft_core.logprobs import response_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (5, 1, 3, 7)]
    gens = [Generation(torch.randint(3, 90, (n,), generator=g).tolist(), [0.0] * n) for n in (4, 6, 1, 3)]
    exp = build_experience(prompts, gens, pad_token_id=0, device=device)
    upstream = torch.randn(exp.action_mask.shape, generator=g).to(device) * exp.action_mask  # (B, T)
    results = []
    for chunk_size in (None, 5, 1000):
        model.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            logprobs, entropy = response_logprobs(model, exp.input_ids, exp.attention_mask,
                                                  exp.action_mask.shape[1], 0.8, with_entropy="grad",
                                                  chunk_size=chunk_size)
        ((logprobs + 0.3 * entropy) * upstream).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((logprobs.detach() * exp.action_mask, entropy.detach() * exp.action_mask, grads))
    atol = 3e-2 if autocast else 1e-5
    for logprobs, entropy, grads in results[1:]:
        assert (torch.allclose(logprobs, results[0][0], atol=atol)
                and torch.allclose(entropy, results[0][1], atol=atol))
        for name, grad in grads.items():
            want = results[0][2][name]
            assert torch.allclose(grad, want, atol=atol * want.abs().max().item() + 1e-7), name
    # tied head
    assert results[0][0].abs().sum() > 0 and results[0][2]["model.embed_tokens.weight"].abs().sum() > 0


@pytest.mark.slow  # seconds: it compiles
def test_fused_head_chunks_trace_whole_and_match_eager():
    """The fused LM head's per-chunk math (compiled on a GPU: one pass over a chunk's logits instead of one
    per operation) traces as one graph at any chunk length, with and without the entropy's gradient and
    blocked tokens, and equals the eager functions (aot_eager here: no Triton on a CPU)."""
    from rft_core.logprobs import _chunk_forward, _chunk_grad

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(0)
    forward = torch.compile(_chunk_forward, backend="aot_eager", dynamic=True, fullgraph=True)
    grad = torch.compile(_chunk_grad, backend="aot_eager", dynamic=True, fullgraph=True)
    for rows, entropy, blocked in ((7, True, None), (5, True, None), (3, False, [1, 4]), (6, False, [1, 4])):
        logits = torch.randn(rows, 11, generator=g).to(torch.bfloat16)
        targets = torch.randint(11, (rows,), generator=g)
        want = _chunk_forward(logits, targets, 0.7, blocked, entropy)
        got = forward(logits, targets, 0.7, blocked, entropy)
        assert all(b is None if a is None else torch.allclose(a, b, atol=1e-6) for a, b in zip(want, got))
        upstream = [torch.randn(rows, generator=g) for _ in range(2)]
        h = want[2] if entropy else None
        want_grad = _chunk_grad(logits, targets, want[0], upstream[0], h, upstream[1], 0.7, blocked)
        got_grad = grad(logits, targets, want[0], upstream[0], h, upstream[1], 0.7, blocked)
        assert got_grad.dtype == torch.bfloat16 and torch.equal(got_grad, want_grad)
    # one graph per function and setting (entropy or not, blocked or not), whatever the chunk's length
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4


def test_fused_head_compiles_once_at_any_length(monkeypatch):
    """Compiled, the fused head's chunk functions trace once (forward and backward), whatever a micro-batch's
    length: one chunk or several (a chunk's tensors are not views of the micro-batch's, whose length a graph
    would guard), and one whose last chunk would hold one row (a length compiled apart, mid-run). The
    gradients equal eager's."""
    from rft_core import logprobs

    weight = torch.randn(11, 6, requires_grad=True)
    cases = [(torch.randn(rows, 6), torch.randint(11, (rows,))) for rows in (5, 30, 45, 29, 8, 15)]

    def grads(hidden, targets):
        hidden = hidden.clone().requires_grad_()
        lp, _ = logprobs.LinearLogprobs.apply(hidden, weight, targets, 0.7, 7, True, None)
        return torch.autograd.grad(lp.sum(), (hidden, weight))

    eager = [grads(*case) for case in cases]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(logprobs, "fused", functools.partial(logprobs.fused, backend="aot_eager"))
    for case, want in zip(cases, eager):
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads(*case), want))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


@pytest.mark.slow  # seconds: it compiles
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compile_blocks_keeps_names_and_outputs(tiny_model_dir, checkpointing):
    """compile_blocks compiles each decoder layer in place: the same parameter names (checkpoints, weight
    sync), the same logits and gradients (the eager backend on a CPU; inductor on a GPU), also with the
    non-reentrant gradient checkpointing the scripts turn on when an update would not fit."""
    from rft_core.model_training import checkpointing_on, compile_blocks

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    compiled = compile_blocks(AutoModelForCausalLM.from_pretrained(tiny_model_dir), backend="eager")
    for model in (plain, compiled) if checkpointing else ():
        model.train()
        checkpointing_on(model)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in compiled.named_parameters()]
    ids = torch.tensor([[3, 4, 5, 6, 7], [0, 0, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    outs = [plain(input_ids=ids, attention_mask=mask).logits]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    outs.append(compiled(input_ids=ids, attention_mask=mask).logits)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # its layers ran as compiled graphs
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    for out in outs:
        out.sum().backward()
    assert torch.allclose(plain.model.layers[1].mlp.up_proj.weight.grad,
                          compiled.model.layers[1].mlp.up_proj.weight.grad, atol=1e-6)


@pytest.mark.slow  # torch.compile on a CPU: 5-8 s each
@pytest.mark.parametrize("fix", [False, True])
def test_compiled_lora_blocks_share_one_graph(tiny_model_dir, fix, monkeypatch):
    """Under LoRA the embeddings are frozen, so without compile_blocks' input hook the first decoder layer's
    input would not require gradients while every later one's does: a second graph (H100, 7B LoRA: a
    recompile per layer switch until dynamo's limit). With it, one graph serves every layer and shape."""
    from rft_core.model_training import compile_blocks
    from rft_core.models import lora_model

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = lora_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 4, 8)
    if not fix:
        monkeypatch.setattr(model.get_input_embeddings(), "register_forward_hook", lambda hook: None)
    compile_blocks(model, backend="eager")
    for width in (6, 9):  # two shapes, both padded
        ids = torch.randint(3, 100, (3, width))
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        model(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum().backward()  # as in training
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert (graphs == 1) == fix, graphs
    with torch.no_grad():  # one more graph for forwards without gradients, where no block's input needs them
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1


@pytest.mark.slow  # torch.compile on a CPU: 7 s
def test_the_memory_probe_compiles_every_graph_the_update_needs(tiny_model_dir, monkeypatch):
    """plan_update_memory's forwards (on a simulated GPU) compile the graphs of both kinds of update
    micro-batch: with padding, and without (equal lengths: transformers then passes no attention mask). The
    update's forwards, at other sizes, then compile nothing more (on a GPU, each was ~10 s in step 1 or
    later)."""
    from rft_core.logprobs import response_logprobs
    from rft_core.memory import plan_update_memory
    from rft_core.model_training import compile_blocks

    gib = 2**30
    simulated = {"is_available": lambda: True, "synchronize": lambda: None, "empty_cache": lambda: None,
                 "reset_peak_memory_stats": lambda: None, "memory_allocated": lambda: 0,
                 "max_memory_allocated": lambda: gib, "memory_reserved": lambda: 0,
                 "mem_get_info": lambda: (30 * gib, 80 * gib),  # and dynamo's saving of the CUDA RNG
                 "get_rng_state": lambda *a, **k: torch.empty(0), "set_rng_state": lambda *a, **k: None}
    for name, fn in simulated.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = compile_blocks(AutoModelForCausalLM.from_pretrained(tiny_model_dir), backend="eager")
    plan_update_memory(model, 16384, None, lambda: torch.autocast("cpu", enabled=False), log=lambda line: 0)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model.train()  # as in the update
    for rows, width, padded in ((8, 40, True), (5, 23, False), (3, 70, True), (16, 9, False)):
        ids = torch.randint(3, 100, (rows, width))
        mask = torch.ones_like(ids)
        mask[0, 0] = 0 if padded else 1
        logprobs, _ = response_logprobs(model, ids, mask, width // 2)  # as the update's forward
        logprobs.sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
def test_compiled_layers_keep_one_graph_as_micro_batches_grow(tiny_model_dir):
    """On a GPU (inductor, Triton), a compiled layer's graph holds from a small micro-batch to one past the
    size at which inductor would otherwise change its fusion of the norms' gradient reductions (nrow x ncol
    >= 5 MiB and nrow >= 4096 tokens: here 96 rows x 2048 tokens of a 32-wide model): no recompile."""
    from rft_core.logprobs import response_logprobs
    from rft_core.model_training import compile_blocks

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = compile_blocks(AutoModelForCausalLM.from_pretrained(tiny_model_dir).cuda())
    model.train()
    graphs = []
    for rows, width in ((2, 256), (96, 2048)):
        ids = torch.randint(3, 100, (rows, width), device="cuda")
        mask = torch.ones_like(ids)
        mask[0, 0] = 0
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logprobs, _ = response_logprobs(model, ids, mask, width // 2, chunk_size=4096)  # no whole logits
        logprobs.float().sum().backward()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0], graphs


def test_compiled_blocks_fuse_whatever_the_size():
    """inductor_options asks inductor to fuse the norms' gradient reductions whatever the number of tokens
    (a size-dependent choice would be a guard, and a recompile as micro-batches grow): the option exists in
    this torch, and only inductor gets it."""
    from torch._inductor import config

    from rft_core.model_training import inductor_options

    options = inductor_options("inductor")
    assert options == {"triton.mix_order_reduction_non_strict_mode": True}
    assert hasattr(config.triton, "mix_order_reduction_non_strict_mode")
    assert inductor_options("eager") is None


def test_compile_blocks_takes_the_vision_critic():
    """The VL script's critic (a Qwen2-VL backbone and a value head, no input-embeddings accessor of its own)
    compiles like the policy: its vision and language blocks, the same values."""
    import copy

    from rft_core.model_training import compile_blocks
    from rft_core.vision import VisionValueModel, tiny_qwen2_vl, word_tokenizer

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plain = VisionValueModel(tiny_qwen2_vl(word_tokenizer()))
    torch.nn.init.normal_(plain.score.weight)
    compiled = compile_blocks(copy.deepcopy(plain), backend="eager")
    ids, mask = torch.tensor([[3, 4, 5, 6], [0, 4, 5, 6]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    values = [plain(ids, mask).logits]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    values.append(compiled(ids, mask).logits)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # its blocks ran as compiled graphs
    assert torch.allclose(values[0], values[1], atol=1e-6)


def test_the_health_check_runs_compiled_layers_eagerly(tiny_model_dir, tmp_path):
    """The checkpoint's health check is the only forward without gradients of a compiled policy in a step
    that does not recompute old logprobs: it runs eagerly, so it compiles no graph of its own."""
    from accelerate import Accelerator

    from rft_core.engines.base import Generation
    from rft_core.experience import Forward, build_experience
    from rft_core.model_training import compile_blocks
    from rft_core.runs.health import HealthGuard

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = compile_blocks(AutoModelForCausalLM.from_pretrained(tiny_model_dir), backend="eager")
    gens = [Generation([7, 8, 9], [-1.0] * 3), Generation([7, 8], [-1.0] * 2)]
    exp = build_experience([[3, 4, 5], [3, 4]], gens, 0)
    mb = exp.split(micro_batch_size=2)[0]
    model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits.sum().backward()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 1
    guard = HealthGuard(str(tmp_path), model.config.vocab_size, max_update_kl=1e9)
    split = {"micro_batch_size": 2}
    guard.before_checkpoint(model, exp, split, Forward(), Accelerator(cpu=True), step=1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_the_health_check_measures_the_update_on_rows_with_engine_logprobs(tiny_model_dir, tmp_path):
    """Rows without engine logprobs (NaN: not asked for) leave the check's KL: unchanged weights pass it."""
    from accelerate import Accelerator

    from rft_core.engines.base import Generation
    from rft_core.errors import TrainingDiverged
    from rft_core.experience import Forward, batched_logprobs, build_experience
    from rft_core.runs.health import HealthGuard

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    exp = build_experience([[3, 4, 5], [3, 4]], [Generation([7, 8, 9], None), Generation([7, 8], None)], 0)
    model.eval()
    own = batched_logprobs(model, exp, micro_batch_size=2)  # (B, T): the engine, had it the same weights
    gens = [Generation([7, 8, 9], None), Generation([7, 8], own[1, :2].tolist())]
    exp = build_experience([[3, 4, 5], [3, 4]], gens, 0)
    guard = HealthGuard(str(tmp_path), model.config.vocab_size, max_update_kl=1e-4)
    split = {"micro_batch_size": 2}
    guard.before_checkpoint(model, exp, split, Forward(), Accelerator(cpu=True), step=1)  # passes
    # the known row's engine logprobs 0.01 above the model's: a KL of 0.01 nats per token, over the limit
    gens = [Generation([7, 8, 9], None), Generation([7, 8], (own[1, :2] + 0.01).tolist())]
    moved = build_experience([[3, 4, 5], [3, 4]], gens, 0)
    with pytest.raises(TrainingDiverged, match=r"moved the policy by 0\.01 nats per token"):
        guard.before_checkpoint(model, moved, split, Forward(), Accelerator(cpu=True), step=1)


def test_forwards_with_gradients_never_run_cudnn_attention(tiny_model_dir):
    """The trainer's forwards (logprobs plain and chunked, critic values, the ptx loss) run with cuDNN's SDPA
    kernel off (rft_core.logprobs.NOT_CUDNN): its backward turns a left pad's empty attention row into NaN
    gradients. A model wrapper records the flag at each forward; it is back on afterwards."""
    from rft_core.logprobs import response_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    seen = []
    forward = model.forward

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return forward(*args, **kwargs)

    model.forward = recording
    ids = torch.randint(3, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row
    before = torch.backends.cuda.cudnn_sdp_enabled()
    response_logprobs(model, ids, mask, 3)
    response_logprobs(model, ids, mask, 3, chunk_size=2)
    lm_loss(model, ids, mask)
    model.config.num_labels = 1
    response_values(model, ids, mask, 3)
    assert seen == [False] * 4 and before and torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.gpu
def test_left_padded_rows_give_finite_gradients_on_the_gpu():
    """On a GPU, a bf16 Qwen2 of head size 128 over a left-padded batch of 25 x 64 (the shape that stopped
    a 1.5B run), with cuDNN's SDPA kernel enabled and first in priority around the call: a plain
    forward then gives NaN gradients (the bug: skipped where this torch's cuDNN no longer has it, or has no
    kernel for the shape), and response_logprobs, which turns cuDNN off inside, gives finite ones."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rft_core.logprobs import response_logprobs

    config = Qwen2Config(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=512)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).cuda()
    ids = torch.randint(3, 1000, (25, 64), device="cuda")
    mask = torch.ones(25, 64, dtype=torch.long, device="cuda")
    mask[::2, 0] = 0  # left pads: a query row with nothing to attend to
    mask[:, -3:] = 0  # right pads after the responses
    cudnn_first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def gradients_finite(plain):
        model.zero_grad(set_to_none=True)
        with sdpa_kernel(cudnn_first, set_priority=True), torch.autocast("cuda", dtype=torch.bfloat16):
            if plain:
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                logprobs = logits[:, -13:-1].float().log_softmax(-1)[..., 0]
            else:
                logprobs, _ = response_logprobs(model, ids, mask, 12)
        logprobs.float().sum().backward()
        return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)

    if gradients_finite(plain=True):
        pytest.skip("cuDNN's kernel gives this batch finite gradients here (or was not picked)")
    assert gradients_finite(plain=False)


@pytest.mark.slow
def test_the_embedded_gguf_is_dequantised_once(tmp_path, monkeypatch):
    """The first load of a GGUF keeps its dequantised weights and tokenizer under $RFT_CACHE; later loads read
    them (the same weights, tokenizer and special tokens, in any dtype); a damaged entry is dequantised again;
    RFT_CACHE=off keeps nothing."""
    import os

    from rft_core.models import embedded_model_path, gguf_cache, load_model_and_tokenizer

    monkeypatch.setenv("RFT_CACHE", str(tmp_path / "cache"))
    cold, tokenizer = load_model_and_tokenizer()
    entry = gguf_cache(embedded_model_path())
    assert os.path.isfile(os.path.join(entry, "model.safetensors"))
    assert not list(tmp_path.glob("cache/*/.part-*"))
    warm, warm_tokenizer = load_model_and_tokenizer()

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))

    assert same(cold, warm) and type(cold) is type(warm)
    messages = [{"role": "user", "content": "2 * 3?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == warm_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer(prompt)["input_ids"] == warm_tokenizer(prompt)["input_ids"]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (warm_tokenizer.eos_token_id,
                                                                warm_tokenizer.pad_token_id)
    half, _ = load_model_and_tokenizer(dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert all(torch.equal(x, y.to(torch.bfloat16)) for x, y in zip(half.state_dict().values(),
                                                                      cold.state_dict().values()))
    with open(os.path.join(entry, "model.safetensors"), "wb") as f:
        f.write(b"damaged")
    again, _ = load_model_and_tokenizer()
    assert same(again, cold) and os.path.getsize(os.path.join(entry, "model.safetensors")) > 1e8
    monkeypatch.setenv("RFT_CACHE", "off")
    assert gguf_cache(embedded_model_path()) is None


def write_tiny_gguf(path, seed=0, hidden=16):
    """A 1-layer random Llama as a GGUF (float32 tensors; a byte-level tokenizer of 260 tokens and a chat
    template): loads through transformers' GGUF path as the embedded model does, in a fraction of a second."""
    import gguf
    import numpy as np

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's byte-to-unicode table
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(256 - len(printable))]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *chars, "hi"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // 2)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["h i"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                             "<|im_end|>\n{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rng = np.random.default_rng(seed)
    shapes = {"token_embd": (len(tokens), hidden), "output_norm": (hidden,), "blk.0.attn_norm": (hidden,),
              "blk.0.ffn_norm": (hidden,), "blk.0.attn_q": (hidden, hidden),
              "blk.0.attn_k": (hidden // 2, hidden), "blk.0.attn_v": (hidden // 2, hidden),
              "blk.0.attn_output": (hidden, hidden),
              "blk.0.ffn_gate": (32, hidden), "blk.0.ffn_up": (32, hidden), "blk.0.ffn_down": (hidden, 32)}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def rng_states():
    import random

    import numpy as np

    return torch.get_rng_state().tolist(), random.getstate(), str(np.random.get_state())


def test_a_cold_and_a_warm_gguf_load_leave_the_random_state_alike(tmp_path, monkeypatch):
    """A fresh machine's first run sampled otherwise than every later one: a cold load built the model at
    random (from_config) before copying the GGUF's weights in, a warm one read the cache. Now the random
    state after a load is the one before it, cold, warm or without a cache; the weights are the same, the
    cache keeps one entry per model (a copy of the file elsewhere, or a relative path, finds it)."""
    from rft_core.models import gguf_cache, load_model_and_tokenizer

    monkeypatch.setenv("RFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf")
    loaded = {}
    for load in ("cold", "warm", "uncached"):
        monkeypatch.setenv("RFT_CACHE", "off" if load == "uncached" else str(tmp_path / "cache"))
        torch.manual_seed(0)
        before = rng_states()
        loaded[load] = load_model_and_tokenizer("tiny.gguf")[0]  # (relative: its folder is '')
        assert rng_states() == before, load
    assert all(torch.equal(a, b) for model in (loaded["warm"], loaded["uncached"])
               for a, b in zip(loaded["cold"].state_dict().values(), model.state_dict().values()))
    monkeypatch.setenv("RFT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "copy").mkdir()
    copy = tmp_path / "copy" / "same.gguf"
    copy.write_bytes(open(gguf_file, "rb").read())
    assert gguf_cache(str(copy)) == gguf_cache(gguf_file)
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 1


def test_a_damaged_cache_entry_is_said_and_rebuilt(tmp_path, monkeypatch, capsys):
    """A cache entry whose weights changed on disk (a bit flipped, the same size) loaded silently and trained
    every later run from wrong weights: entries are checked against the digests written with them."""
    from rft_core.models import gguf_cache, load_model_and_tokenizer

    monkeypatch.setenv("RFT_CACHE", str(tmp_path / "cache"))
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf")
    cold = load_model_and_tokenizer(gguf_file)[0]
    weights = os.path.join(gguf_cache(gguf_file), "model.safetensors")
    assert f"[cache] the GGUF dequantised is kept in {gguf_cache(gguf_file)}" in capsys.readouterr().out
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) - 8)
        f.write(b"\x7f" * 8)  # the last weight's bytes
    again = load_model_and_tokenizer(gguf_file)[0]
    assert (f"[cache] {gguf_cache(gguf_file)} is not as it was written (its files' SHA-256, or the "
            "transformers version, differ from its digests.json): dequantising the GGUF again"
            in capsys.readouterr().out)
    assert all(torch.equal(a, b) for a, b in zip(cold.state_dict().values(), again.state_dict().values()))
    load_model_and_tokenizer(gguf_file)
    assert "[cache]" not in capsys.readouterr().out


def test_the_cache_is_absolute_and_dead_writers_leftovers_are_removed(tmp_path, monkeypatch, capsys):
    """A relative RFT_CACHE wrote 0.5 GB under whatever directory a run started in: it is made absolute (and
    said). A writer killed mid-write left its 0.5 GB temporary directory for ever: the next write removes it,
    not one a live writer is filling."""
    import subprocess

    from rft_core.models import _write_cache, cache_root

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RFT_CACHE", "cache")
    assert cache_root() == str(tmp_path / "cache") == os.environ["RFT_CACHE"]
    assert capsys.readouterr().out == (f"[cache] RFT_CACHE='cache' is relative: the cache is "
                                       f"{tmp_path / 'cache'} (set an absolute path to keep one cache "
                                       "whatever the current directory)\n")
    dead = subprocess.Popen(["true"])
    dead.wait()
    parent = tmp_path / "cache" / "gguf"
    for pid in (dead.pid, os.getpid()):
        (parent / f".part-{pid}-x").mkdir(parents=True)
    (parent / "0123456789abcdef").mkdir()  # an entry of an earlier format: no digests.json
    model = AutoModelForCausalLM.from_config(tiny_config())
    _write_cache(str(parent / "entry"), model, FakeTokenizer())
    assert sorted(p.name for p in parent.iterdir()) == [f".part-{os.getpid()}-x", "entry"]
    assert (f"[cache] removed from {parent} what earlier writes left unfinished or in an earlier format: "
            f".part-{dead.pid}-x, 0123456789abcdef" in capsys.readouterr().out)


class FakeTokenizer:
    def save_pretrained(self, path):
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write("{}")


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)
