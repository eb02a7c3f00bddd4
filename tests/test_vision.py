"""The vision-language pieces: the shapes task, the word tokenizer, the tiny Qwen2-VL, image-token
accounting."""

import importlib.util
import os

import pytest
import torch

from rft_core.multimodal import VISION_TOKENS, vllm_prompt
from rft_core.tasks.shapes import COLOURS, IMAGE_SIZE, NUMBERS, draw_shapes, shapes_task
from rft_core.vision import (
    block_tokens,
    check_image_tokens,
    encode_vl_prompt,
    expand_image_tokens,
    load_vl_model,
    tiny_qwen2_vl,
    word_tokenizer,
)


def quadrants_with(image, colour):
    cell = image.size[0] // 2
    pixels = image.load()
    return sum(any(pixels[x, y] == COLOURS[colour] for x in range(qx * cell, (qx + 1) * cell)
                   for y in range(qy * cell, (qy + 1) * cell)) for qx in range(2) for qy in range(2))


def test_shapes_task_labels_match_pictures():
    train, evals = shapes_task(num_train=40, num_eval=10, seed=3)
    for row in train + evals:
        image = row["images"][0]
        assert image.size == (IMAGE_SIZE, IMAGE_SIZE)
        if row["prompt"].startswith("what colour"):
            assert quadrants_with(image, row["label"]) == 1
        else:
            colour = next(c for c in COLOURS if quadrants_with(image, c))
            assert quadrants_with(image, colour) == NUMBERS.index(row["label"]) + 1
    assert [r["label"] for r in shapes_task(40, 10, seed=3)[0]] == [r["label"] for r in train]  # seeded
    assert [r["label"] for r in shapes_task(40, 10, seed=4)[1]] == [r["label"] for r in evals]  # eval fixed


def test_word_tokenizer():
    tok = word_tokenizer()
    ids = tok("what colour is the shape ? red", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == "what colour is the shape ? red"
    assert all(len(tok(w, add_special_tokens=False)["input_ids"]) == 1 for w in (*COLOURS, *NUMBERS))
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"


def test_image_token_accounting():
    import random

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok, processor = word_tokenizer(), Qwen2VLImageProcessorPil(min_pixels=IMAGE_SIZE**2, max_pixels=112**2)
    images = [draw_shapes("red", 1, random.Random(0)), draw_shapes("blue", 2, random.Random(1), size=112)]
    pixels = processor(images=images, return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 6, 6], [1, 8, 8]]
    text = expand_image_tokens("<|vision_start|> <|image_pad|> <|vision_end|> and "
                               "<|vision_start|> <|image_pad|> <|vision_end|>",
                               pixels["image_grid_thw"])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(image_id) == 9 + 16
    check_image_tokens(ids, pixels["image_grid_thw"], image_id)
    with pytest.raises(ValueError, match="sample 7: 24 image tokens in the prompt but its 2 image"):
        check_image_tokens(ids[:ids.index(image_id)] + ids[ids.index(image_id) + 1:],
                           pixels["image_grid_thw"], image_id, sample=7)
    # back to back, as Qwen2VLProcessor writes them: no extra tokens for a BPE tokenizer
    pad = "<|image_pad|>"
    assert (expand_image_tokens(f"<|vision_start|>{pad}<|vision_end|>hi", [[1, 4, 2]])
            == f"<|vision_start|>{pad}{pad}<|vision_end|>hi")
    with pytest.raises(ValueError, match="1 image placeholders in the prompt but 2 images"):
        expand_image_tokens("<|image_pad|>", pixels["image_grid_thw"])


def test_tiny_qwen2_vl_sees_the_image():
    import random

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok, processor = word_tokenizer(), Qwen2VLImageProcessorPil(min_pixels=IMAGE_SIZE**2,
                                                                max_pixels=IMAGE_SIZE**2)
    model = tiny_qwen2_vl(tok).eval()
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                 {"type": "text",
                                                                  "text": "what colour is the shape ?"}]}],
                                   add_generation_prompt=True, tokenize=False)
    logits = []
    for colour in ("red", "blue"):
        pixels = processor(images=[draw_shapes(colour, 1, random.Random(0))], return_tensors="pt")
        ids = torch.tensor([tok(expand_image_tokens(text, pixels["image_grid_thw"]),
                                add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                        pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                        mm_token_type_ids=(ids == model.config.image_token_id).long())
        logits.append(out.logits[0, -1])
    # the answer depends on the pixels
    assert logits[0].shape == (len(tok),) and not torch.allclose(logits[0], logits[1])


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_engine_and_trainer_logprobs_agree_with_images(arch):
    """The HF engine samples with images (rows of different lengths, left-padded, one text-only row); the
    trainer's logprobs of those samples, through Experience micro-batches, equal the engine's; and the VL
    critic's values are batching-invariant, see the image, and are its backbone's hidden states under its
    head."""
    import random
    from dataclasses import replace

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rft_core.engines.hf import HFEngine
    from rft_core.experience import batched_logprobs, batched_values, build_experience
    from rft_core.model_training import response_values
    from rft_core.vision import VisionValueModel

    tok, processor = word_tokenizer(), Qwen2VLImageProcessorPil(min_pixels=IMAGE_SIZE**2,
                                                                max_pixels=IMAGE_SIZE**2)
    model = tiny_qwen2_vl(tok, arch=arch)
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    prompts, mm = [], []
    for i, question in enumerate(["what colour is the shape ?", "how many shapes are there ?",
                                  "what is the colour ?"]):
        content = [{"type": "text", "text": question}]
        if i < 2:
            content.insert(0, {"type": "image"})
        text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=False)
        if i < 2:
            pixels = processor(images=[draw_shapes("green", i + 1, random.Random(i))], return_tensors="pt")
            text = expand_image_tokens(text, pixels["image_grid_thw"])
            mm.append({**pixels, "image_token_id": image_id})
        else:
            mm.append(None)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    # a video row: 4 frames -> 2 temporal patches of 6 x 6 (synthetic pixels: the video processor needs
    # torchvision)
    video_id = tok.convert_tokens_to_ids("<|video_pad|>")
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"},
                                                                 {"type": "text",
                                                                  "text": "what colour is the shape ?"}]}],
                                   add_generation_prompt=True, tokenize=False)
    prompts.append(tok(expand_image_tokens(text, [[2, 6, 6]], image_token="<|video_pad|>"),
                       add_special_tokens=False)["input_ids"])
    mm.append({"pixel_values_videos": torch.randn(72, 3 * 2 * 14 * 14,
                                                  generator=torch.Generator().manual_seed(0)),
               "video_grid_thw": torch.tensor([[2, 6, 6]]), "image_token_id": image_id,
               "video_token_id": video_id})
    assert prompts[-1].count(video_id) == 18
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    torch.manual_seed(0)
    vision_ids = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    block_tokens(model, vision_ids)  # as load_vl_model does: the placeholders are never sampled
    gens = HFEngine(model, tok, micro_batch_size=4).generate(prompts, 6, temperature=1.0, mm=mm)
    assert not any(t in vision_ids for g in gens for t in g.token_ids)
    exp = build_experience(prompts, gens, tok.pad_token_id, mm=mm)
    for micro_batch_size in (1, 2, 3, 4):
        logprobs = batched_logprobs(model, exp, micro_batch_size=micro_batch_size)
        assert torch.allclose(logprobs * exp.action_mask, exp.rollout_logprobs * exp.action_mask, atol=1e-4)
    video_row = exp.select([3])  # the video's pixels reach the model
    blank = [{**video_row.mm[0], "pixel_values_videos": torch.zeros(72, 3 * 2 * 14 * 14)}]
    assert not torch.allclose(batched_logprobs(model, video_row, micro_batch_size=1),
                              batched_logprobs(model, replace(video_row, mm=blank), micro_batch_size=1))

    # the VL critic: zero at the start; then, with a random head, the same values however the rows are
    # batched, and those of the policy's own backbone (its copy) under that head, with the images seen
    critic = VisionValueModel(model)
    assert batched_values(critic, exp, micro_batch_size=3).abs().max() == 0
    torch.nn.init.normal_(critic.score.weight)
    values = [batched_values(critic, exp, micro_batch_size=mbs) for mbs in (1, 2, 3)]
    assert all(torch.allclose(v, values[0], atol=1e-4) for v in values[1:]) and values[0].abs().max() > 0
    row, r = exp.split(1)[0], exp.action_mask.shape[1]  # row 0 has an image
    hidden = model.model(input_ids=row.input_ids, attention_mask=row.attention_mask,
                         **row.mm_inputs()).last_hidden_state
    want = critic.score(hidden)[0, -r - 1:-1, 0] * row.action_mask[0]
    assert torch.allclose(values[0][0, :r], want, atol=1e-4)
    with_image = response_values(critic, row.input_ids, row.attention_mask, r, mm_inputs=row.mm_inputs())
    blank = {**row.mm_inputs(), "pixel_values": torch.zeros_like(row.mm_inputs()["pixel_values"])}
    assert not torch.allclose(with_image, response_values(critic, row.input_ids, row.attention_mask, r,
                                                          mm_inputs=blank))


def test_vllm_prompt_collapses_each_image_to_one_placeholder():
    """vLLM expands one placeholder per image itself: the request must carry exactly one per image, the rest
    kept."""
    import random

    _, tok, processor = load_vl_model(max_pixels=112**2)
    images = [draw_shapes("red", 1, random.Random(0)), draw_shapes("blue", 2, random.Random(1), size=112)]
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    ids, mm = encode_vl_prompt(tok, processor, "how many shapes are there ?", images, image_id)
    request = vllm_prompt(ids, mm)
    assert (request["multi_modal_data"] == {"image": images}
            and request["prompt_token_ids"].count(image_id) == 2)
    # runs of 9 and 16 -> 1 each
    want = [t for i, t in enumerate(ids) if t != image_id or ids[i - 1] != image_id]
    assert request["prompt_token_ids"] == want and len(ids) - len(want) == 8 + 15
    assert vllm_prompt(ids[:5], None) == {"prompt_token_ids": ids[:5]}  # text only
    short = ids[:ids.index(image_id)] + ids[ids.index(image_id) + 1:]  # the first image one token short
    with pytest.raises(ValueError, match="sample 4: its image / video tokens do not match"):
        vllm_prompt(short, mm, sample=4)
    # a video (2 temporal patches of 6 x 6: 18 tokens) after an image (9): each run collapsed, both kinds
    # passed on
    video_id, frames = tok.convert_tokens_to_ids("<|video_pad|>"), images[:1] * 4
    mm = {"image_grid_thw": torch.tensor([[1, 6, 6]]), "video_grid_thw": torch.tensor([[2, 6, 6]]),
          "images": images[:1], "videos": [frames], "image_token_id": image_id, "video_token_id": video_id}
    ids = [1, image_id] + [image_id] * 8 + [2, video_id] + [video_id] * 17 + [3]
    assert vllm_prompt(ids, mm) == {"prompt_token_ids": [1, image_id, 2, video_id, 3],
                                    "multi_modal_data": {"image": images[:1], "video": [frames]}}
    with pytest.raises(ValueError, match="sample 5"):
        vllm_prompt(ids[:-3] + [3], mm, sample=5)  # the video one token short
    with pytest.raises(ValueError, match="sample 6"):
        vllm_prompt(ids[:11] + [3], mm, sample=6)  # the video's placeholders missing altogether
    resumed = {k: v for k, v in mm.items() if k not in ("images", "videos")}  # as a checkpoint keeps it
    with pytest.raises(ValueError, match="sample 7: vLLM needs its images, which the checkpoint it was"):
        vllm_prompt(ids, resumed, sample=7)


def test_blocked_tokens_leave_a_normalised_distribution():
    """block_tokens: the vision placeholders get logit -1e4 in every forward, so they are never sampled and
    the remaining tokens' probabilities sum to 1, with the entropy finite; other logits are untouched."""
    from rft_core.logprobs import response_logprobs

    tok = word_tokenizer()
    plain = tiny_qwen2_vl(tok).eval()
    blocked, _, _ = load_vl_model()  # the same seed, blocked by the loader
    ids = torch.tensor([tok("<|im_start|> user what colour is the shape ? <|im_end|> <|im_start|> "
                            "assistant red", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        a, b = plain(input_ids=ids).logits, blocked.eval()(input_ids=ids).logits  # (1, L, V)
    vision = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    keep = [i for i in range(len(tok)) if i not in vision]
    assert torch.equal(a[..., keep], b[..., keep]) and (b[..., vision] == -1e4).all()
    assert torch.allclose(torch.log_softmax(b, -1).exp()[..., keep].sum(-1), torch.ones(1, ids.shape[1]))
    logprobs, entropy = response_logprobs(blocked, ids, torch.ones_like(ids), 3, with_entropy=True)
    want = torch.log_softmax(a[0, -4:-1, keep], -1)  # the distribution over the allowed tokens alone
    targets = [keep.index(t) for t in ids[0, -3:].tolist()]
    assert torch.allclose(logprobs[0], want[torch.arange(3), targets], atol=1e-5)
    assert torch.allclose(entropy[0], -(want.exp() * want).sum(-1), atol=1e-5)
    chunked = response_logprobs(blocked, ids, torch.ones_like(ids), 3, with_entropy=True, chunk_size=2)
    assert torch.allclose(chunked[0], logprobs, atol=1e-5) and torch.allclose(chunked[1], entropy, atol=1e-5)


def test_image_inputs_save_as_plain_data():
    """A prompt's ImageInputs in a checkpoint (partial rollout's buffer holds started samples) is plain data
    that torch.load(weights_only=True) takes: its grids, ids and pixel values (PIL images made the resume
    refuse the checkpoint)."""
    import copy
    import io
    import random

    _, tok, processor = load_vl_model()
    image, image_id = draw_shapes("red", 1, random.Random(0)), tok.convert_tokens_to_ids("<|image_pad|>")
    ids, mm = encode_vl_prompt(tok, processor, "what colour is the shape ?", [image], image_id)
    assert copy.deepcopy(mm) is mm  # (dataclasses.asdict of its Sample: nothing to copy)
    buffer = io.BytesIO()
    torch.save({"samples": [{"prompt_ids": ids, "mm": mm}]}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)["samples"][0]["mm"]
    assert set(saved) == {"image_token_id", "video_token_id", "image_grid_thw", "pixel_values"}
    assert all(torch.equal(torch.as_tensor(saved[k]), torch.as_tensor(mm[k])) for k in saved)


def test_engine_processor_config_gives_the_trainers_grids(tmp_path):
    """vLLM builds its image processor from the engine directory: saved from the trainer's, it must give the
    same grids (a resized, non-square image included)."""
    import random

    from transformers import AutoImageProcessor

    _, _, processor = load_vl_model(max_pixels=112**2)
    processor.save_pretrained(tmp_path)
    reloaded = AutoImageProcessor.from_pretrained(tmp_path)
    image = draw_shapes("red", 3, random.Random(0), size=300).crop((0, 0, 300, 170))
    assert reloaded.size == processor.size  # min / max pixels as shortest / longest edge
    assert torch.equal(reloaded(images=[image], return_tensors="pt")["image_grid_thw"],
                       processor(images=[image], return_tensors="pt")["image_grid_thw"])


@pytest.mark.skipif(not importlib.util.find_spec("torchvision"),
                    reason="transformers' Qwen2-VL video processor needs torchvision")
def test_encode_vl_prompt_with_an_image_and_a_video():
    """A video (a list of frames) goes through the video processor with the image processor's limits: 4 frames
    of 84 x 84 -> 2 temporal patches of 6 x 6 -> 18 <|video_pad|> tokens, after the image's 9
    <|image_pad|>."""
    import random

    _, tok, processor = load_vl_model()
    image = draw_shapes("red", 1, random.Random(0))
    frames = [draw_shapes("blue", 2, random.Random(i)) for i in range(4)]
    ids, mm = encode_vl_prompt(tok, processor, "what colour is the shape ?", [image, frames],
                               tok.convert_tokens_to_ids("<|image_pad|>"))
    assert mm["video_grid_thw"].tolist() == [[2, 6, 6]] and mm["image_grid_thw"].tolist() == [[1, 6, 6]]
    assert ids.count(mm["video_token_id"]) == 18 and ids.count(mm["image_token_id"]) == 9
    assert ids.index(mm["image_token_id"]) < ids.index(mm["video_token_id"])  # in the order given
    assert mm["pixel_values_videos"].shape == (72, 3 * 2 * 14 * 14) and mm["videos"] == [frames]


def test_load_image_rows_reads_videos_as_frame_lists(tmp_path):
    """images_key entries: a path is an image, a list of paths a video (its frames, in order); none: text
    only."""
    import json
    import random

    from rft_core.vision import load_image_rows

    for i, colour in enumerate(("red", "blue", "green")):
        draw_shapes(colour, 1, random.Random(i)).save(tmp_path / f"{colour}.png")
    rows = [{"prompt": "a", "label": "x", "images": "red.png"},
            {"prompt": "b", "label": "y", "images": ["red.png", ["blue.png", "green.png", "blue.png"]]},
            {"prompt": "c", "label": "z"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    got = load_image_rows(str(tmp_path / "d.jsonl"), "prompt", "label", "images", "--prompt_data",
                          log=lambda *a: None)
    assert [len(r["images"]) for r in got] == [1, 2, 0]
    video = got[1]["images"][1]
    assert isinstance(video, list) and len(video) == 3 and not isinstance(got[1]["images"][0], list)
    assert [os.path.basename(f.path) for f in video] == ["blue.png", "green.png", "blue.png"]


def test_images_are_decoded_when_a_prompt_is_read_not_at_start_up(tmp_path, monkeypatch):
    """Start-up reads each image's header alone (100k rows of full-size pixels would need ~390 GiB before step
    1): encoding N rows decodes none. A prompt's pixels are decoded when it is read, resized once to the
    processor's grid, the same pixels the processor makes of the whole image; only the prompts read last
    stay decoded. A file damaged after its header is one line naming it when its prompt is read."""
    import json
    import random
    import re

    from PIL import Image, ImageFile

    from rft_core.errors import UserError
    from rft_core.multimodal import mm_inputs
    from rft_core.vision import encode_vl_rows, load_image_rows

    for i in range(6):  # 200 x 150 pixels: resized to 84 x 56 (the tiny processor's 84 x 84 at most)
        image = draw_shapes("red", 1 + i % 3, random.Random(i), size=200).crop((0, 0, 200, 150))
        image.save(tmp_path / f"{i}.png")
    rows = [{"prompt": "how many shapes are there ?", "images": [f"{i}.png"], "label": "x"} for i in range(6)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    decoded, load = [], ImageFile.ImageFile.load  # the files whose pixels were decoded (tile: not yet)
    monkeypatch.setattr(ImageFile.ImageFile, "load",
                        lambda self: (self.tile and decoded.append(self.filename)) or load(self))
    _, tok, processor = load_vl_model()
    got = load_image_rows(str(tmp_path / "d.jsonl"), "prompt", "label", "images", "--prompt_data",
                          log=print)
    samples, skipped = encode_vl_rows(tok, processor, got, tok.convert_tokens_to_ids("<|image_pad|>"), 1024,
                                      4, keep=2)
    assert skipped == 0 and decoded == []  # headers only
    assert [s.mm["image_grid_thw"].tolist() for s in samples] == [[[1, 4, 6]]] * 6
    ids = torch.tensor([samples[3].prompt_ids])
    assert torch.equal(mm_inputs([samples[3].mm], ids)["pixel_values"], processor(
        images=[Image.open(tmp_path / "3.png").convert("RGB")], return_tensors="pt")["pixel_values"])
    assert decoded == [str(tmp_path / "3.png")] * 2  # the prompt's, then the test's own whole image
    assert samples[3].mm["images"][0].size == (84, 56) and len(decoded) == 2
    for s in samples[:3]:  # three more prompts read: the first read is dropped, read again it decodes again
        s.mm["pixel_values"]
    samples[1].mm["pixel_values"]
    assert len(decoded) == 5
    samples[3].mm["pixel_values"]
    assert len(decoded) == 6
    data = (tmp_path / "5.png").read_bytes()  # damaged after its header: one line naming it, when drawn
    (tmp_path / "5.png").write_bytes(data[:len(data) // 2])
    with pytest.raises(UserError, match=re.escape(f"image {tmp_path / '5.png'}: its pixels cannot be read")):
        samples[5].mm["pixel_values"]
