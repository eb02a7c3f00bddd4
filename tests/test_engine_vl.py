"""Image rollouts on vLLM and SGLang (GPU, marked, skipped elsewhere; each engine where it is installed): the
tiny Qwen2-VL served with its images and a video, prompts kept exactly as the trainer's (vLLM expands them
itself; SGLang takes the trainer's pixels and ids), weight sync of the language model and the vision tower,
sampling logprobs that match the trainer's, and (vLLM) an accounting mismatch that names the prompt.
RFT_TEST_VL_ARCH=qwen2_5_vl runs the same on a tiny Qwen2.5-VL."""

import importlib.util
import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
ENGINES = [pytest.param(e, marks=pytest.mark.skipif(not importlib.util.find_spec(e), reason=f"needs {e}"))
           for e in ("vllm", "sglang")]

GENERATE_MAX_LEN = 16
ENGINE = dict(bf16=True, micro_batch_size=64, mem_util=0.2, sleep="never", enforce_eager=True,
              max_model_len=256 + GENERATE_MAX_LEN, requests=12 * 8, limit_mm_per_prompt=2)


@pytest.fixture(scope="module", params=ENGINES)
def vl(request):
    from rft_core.engines import create_engine
    from rft_core.engines.base import EngineSettings
    from rft_core.tasks.shapes import shapes_task
    from rft_core.vision import encode_vl_prompt, load_vl_model

    arch = os.environ.get("RFT_TEST_VL_ARCH", "qwen2_vl")  # or qwen2_5_vl
    model, tokenizer, processor = load_vl_model(tiny=arch)
    model = model.cuda()
    image_id = model.config.image_token_id
    _, rows = shapes_task(num_eval=12)
    rows[1]["images"].append(rows[2]["images"][0])  # two images in one prompt
    rows[3]["images"] = []  # a text-only prompt among them
    rows[4]["images"] = [[rows[4]["images"][0], rows[5]["images"][0]] * 2]  # a video of 4 frames
    encoded = [encode_vl_prompt(tokenizer, processor, r["prompt"], r["images"], image_id, sample=i)
               for i, r in enumerate(rows)]
    engine = create_engine(EngineSettings(request.param, **ENGINE), model, tokenizer, processor)
    return engine, model, tokenizer, [ids for ids, _ in encoded], [mm for _, mm in encoded]


def _logprob_diff(engine, model, tokenizer, prompts, mm):
    """Mean |engine sampling logprob - trainer logprob| over the response tokens of 4 samples per prompt."""
    from rft_core.experience import batched_logprobs, build_experience

    prompts, mm = [p for p in prompts for _ in range(4)], [m for m in mm for _ in range(4)]
    gens = engine.generate(prompts, GENERATE_MAX_LEN, temperature=1.0, mm=mm)
    exp = build_experience(prompts, gens, tokenizer.pad_token_id, "cuda", mm=mm)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        trainer = batched_logprobs(model, exp, micro_batch_size=16)
    return (((trainer - exp.rollout_logprobs).abs() * exp.action_mask).sum() / exp.action_mask.sum()).item()


def test_vllm_prompts_are_the_trainers_and_placeholders_never_sampled(vl):
    from rft_core.multimodal import VISION_TOKENS

    engine, model, tokenizer, prompts, mm = vl
    # raises if a prompt was expanded otherwise
    gens = engine.generate(prompts * 8, 16, temperature=1.0, mm=mm * 8)
    vision = set(tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)))
    assert len(gens) == 8 * len(prompts) and not any(t in vision for g in gens for t in g.token_ids)


def test_greedy_equals_transformers_with_images(vl):
    import copy

    from rft_core.engines.hf import HFEngine

    engine, model, tokenizer, prompts, mm = vl
    ours = [g.token_ids for g in engine.generate(prompts, 12, temperature=0.0, mm=mm)]
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    theirs = [g.token_ids for g in HFEngine(bf16, tokenizer).generate(prompts, 12, 0.0, mm=mm)]
    assert sum(a == b for a, b in zip(ours, theirs)) >= len(prompts) - 2, (ours, theirs)


def test_sync_covers_the_vision_tower(vl):
    """Move the vision tower's weights: the engine's copy changes only with a sync, which then makes it the
    trainer's (in bf16; vLLM's is read directly, under vLLM's names; SGLang's, in its scheduler, through the
    logprobs); with the tower declared frozen (--freeze_prefix) later syncs leave it alone."""
    engine, model, tokenizer, prompts, mm = vl
    direct = hasattr(engine, "_runner_model")  # vLLM runs the model in this process

    def same():
        if not direct:
            return None
        theirs = engine._runner_model().visual.merger.ln_q.weight.float()
        return torch.equal(theirs, model.model.visual.merger.ln_q.weight.detach().to(torch.bfloat16).float())

    def move():
        with torch.no_grad():
            for p in model.model.visual.parameters():
                p.add_(torch.randn_like(p) * 0.1 * p.std().clamp(min=0.02))

    before = _logprob_diff(engine, model, tokenizer, prompts, mm)
    assert same() in (True, None) and before < 0.02
    move()
    assert same() in (False, None)
    stale = _logprob_diff(engine, model, tokenizer, prompts, mm)
    engine.update_weights(model)
    synced = _logprob_diff(engine, model, tokenizer, prompts, mm)
    print(f"logprob diff: before {before:.4f} | vision moved, not synced {stale:.4f} | synced {synced:.4f}")
    assert same() in (True, None) and synced < 0.02 and synced < stale / 3  # no stale image embeddings
    engine.static_prefix = "model.visual"  # what --freeze_prefix model.visual sets
    try:
        move()
        engine.update_weights(model)
        frozen = _logprob_diff(engine, model, tokenizer, prompts, mm)
        assert same() in (False, None) and frozen > 3 * synced, (frozen, synced)
    finally:
        engine.static_prefix = None
        engine.update_weights(model)
    assert same() in (True, None) and _logprob_diff(engine, model, tokenizer, prompts, mm) < 0.02


def test_image_token_mismatch_names_the_prompt(vl):
    """A prompt encoded with another processor (112 px images kept whole: 16 tokens) than the engine's (84 x
    84 at most: 9 tokens) is refused, naming it, instead of generating from a corrupted prompt."""
    from rft_core.tasks.shapes import draw_shapes
    from rft_core.vision import encode_vl_prompt, load_vl_model

    engine, model, tokenizer, prompts, mm = vl
    if not hasattr(engine, "_runner_model"):
        pytest.skip("SGLang takes the trainer's pixels and ids: there is no processing of its own to differ")
    _, _, big = load_vl_model(max_pixels=112**2)
    image = draw_shapes("red", 1, random.Random(0), size=112)
    ids, m = encode_vl_prompt(tokenizer, big, "what colour is the shape ?", [image],
                              model.config.image_token_id)
    with pytest.raises(ValueError, match="prompt 1: vLLM expanded it to .* tokens, the trainer's has"):
        engine.generate([prompts[0], ids], 4, temperature=1.0, mm=[mm[0], m])
