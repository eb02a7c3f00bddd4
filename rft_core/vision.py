"""Vision-language pieces (groundwork for train_ppo_vl.py): the built-in shapes task, an offline
word-level tokenizer and tiny Qwen2-VL, and image-token accounting.

Qwen2-VL turns an image into a t x h x w grid of 14-pixel patches and merges 2 x 2 of them into one
language-model token, so a prompt must carry exactly t*h*w/4 `<|image_pad|>` tokens per image;
`expand_image_tokens` writes them and `check_image_tokens` refuses any mismatch, naming the sample.
A video (a list of frames) is the same with `<|video_pad|>`, its frames paired into temporal patches.
vLLM expands the placeholders itself: it gets one per image or video (`vllm_prompt`) and the pixels.

The policy never emits the vision placeholders (in a response they would be taken for image slots):
`block_tokens` sets their logits to -1e4 at the LM head, so sampling, the trainer's logprobs and the
reference model all use the one distribution without them; vLLM applies the same as a logit bias.
"""

import copy
import functools
import os
import random

import torch

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
NUMBERS = ("one", "two", "three")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
SPECIAL = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS)
WORDS = ("user", "assistant", "system", "what", "colour", "is", "the", "shape", "how", "many", "shapes", "are",
         "there", "answer", "with", "a", "word", "?", ".", *COLOURS, *NUMBERS)
IMAGE_SIZE = 84  # 6 x 6 patches of 14 px -> 9 language-model tokens per image


def draw_shapes(colour, count, rng, size=IMAGE_SIZE):
    """A white image with `count` non-overlapping filled shapes (circle, square or triangle) of one colour."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    draw, cell = ImageDraw.Draw(image), size // 2
    for i in rng.sample(range(4), count):  # one shape per quadrant
        x0, y0 = (i % 2) * cell + rng.randint(2, 8), (i // 2) * cell + rng.randint(2, 8)
        side = rng.randint(cell // 2, cell - 12)
        box, kind = (x0, y0, x0 + side, y0 + side), rng.choice(("circle", "square", "triangle"))
        if kind == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif kind == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(x0, y0 + side), (x0 + side, y0 + side), (x0 + side // 2, y0)], fill=COLOURS[colour])
    return image


def shapes_task(num_train=2048, num_eval=64, seed=0):
    """(train rows, eval rows) of {"images": [PIL image], "prompt": str, "label": str}: "what colour is the
    shape?" (one shape, 4 colours) and "how many shapes are there?" (1-3 shapes). The eval split comes from
    its own fixed seed, whatever `seed` is."""
    def rows(n, rng):
        out = []
        for i in range(n):
            colour = rng.choice(list(COLOURS))
            if i % 2 == 0:
                out.append({"images": [draw_shapes(colour, 1, rng)], "prompt": "what colour is the shape ?", "label": colour})
            else:
                count = rng.randint(1, 3)
                out.append({"images": [draw_shapes(colour, count, rng)], "prompt": "how many shapes are there ?",
                            "label": NUMBERS[count - 1]})
        return out
    return rows(num_train, random.Random(seed)), rows(num_eval, random.Random(10**6 + 7))


def load_image_rows(path, input_key, label_key, images_key, flag, log=print):
    """Prompt rows of a data file or directory ({"prompt", "label", "images": [...]}): the images_key column holds
    a path or a list of paths, relative to the data file, each an image, or itself a list of frame paths: a video
    (a list of PIL images). Empty or missing: a text-only prompt."""
    from PIL import Image

    from rft_core.data import load_prompt_rows

    rows, _ = load_prompt_rows(path, input_key, label_key, flag, (images_key,), log=log)
    base = path if os.path.isdir(path) else os.path.dirname(path)
    load = lambda p: Image.open(os.path.join(base, p)).convert("RGB")  # noqa: E731
    for row in rows:
        paths = row.pop(images_key, None) or []
        row["images"] = [load(p) if isinstance(p, str) else [load(f) for f in p] for p in ([paths] if isinstance(paths, str) else paths)]
    return rows


def word_tokenizer():
    """A word-level fast tokenizer over the task's vocabulary (built offline; a random model over ~40
    tokens says a valid answer by chance often enough for GRPO to get a signal)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL, *WORDS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<|im_end|>", additional_special_tokens=list(SPECIAL[2:]))
    tokenizer.padding_side = "left"
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {% for c in m['content'] %}"
                               "{% if c['type'] == 'image' %}<|vision_start|> <|image_pad|> <|vision_end|> "
                               "{% elif c['type'] == 'video' %}<|vision_start|> <|video_pad|> <|vision_end|> "
                               "{% else %}{{ c['text'] }} {% endif %}{% endfor %}<|im_end|> {% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    return tokenizer


def tiny_qwen2_vl(tokenizer, seed=0, arch="qwen2_vl"):
    """A random-initialised Qwen2-VL (about 1 M parameters; arch "qwen2_5_vl": a Qwen2.5-VL, whose vision tower
    has windowed attention and a gated MLP) whose vocabulary is the tokenizer's."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    vision = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_chans=3)
    if arch == "qwen2_vl":
        config_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision.update(embed_dim=32, hidden_size=64)
    elif arch == "qwen2_5_vl":
        config_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}: qwen2_vl or qwen2_5_vl")
    config = config_cls(text_config=text, vision_config=vision, image_token_id=ids[2], video_token_id=ids[3],
                        vision_start_token_id=ids[0], vision_end_token_id=ids[1])
    torch.manual_seed(seed)
    return model_cls(config)


def expand_image_tokens(text, image_grid_thw, merge_size=2, image_token="<|image_pad|>"):
    """Replace each image placeholder in `text`, in order, by the t*h*w / merge^2 tokens its image takes
    (the placeholders back to back, as Qwen2VLProcessor writes them)."""
    parts = text.split(image_token)
    if len(parts) - 1 != len(image_grid_thw):
        raise ValueError(f"{len(parts) - 1} image placeholders in the prompt but {len(image_grid_thw)} images")
    counts = [int(torch.as_tensor(thw).prod()) // merge_size**2 for thw in image_grid_thw]
    return parts[0] + "".join(image_token * n + part for n, part in zip(counts, parts[1:]))


def check_image_tokens(input_ids, image_grid_thw, image_token_id, merge_size=2, sample=None, kind="image"):
    """Raise, naming the sample, unless input_ids hold exactly the image (or video) tokens the images need."""
    want = sum(int(torch.as_tensor(thw).prod()) // merge_size**2 for thw in image_grid_thw)
    have = int((torch.as_tensor(input_ids) == image_token_id).sum())
    if have != want:
        raise ValueError(f"sample {sample!r}: {have} {kind} tokens in the prompt but its {len(image_grid_thw)} "
                         f"{kind}(s) need {want} (grids {[list(map(int, g)) for g in image_grid_thw]})")


def vllm_prompt(ids, mm, sample=None):
    """A vLLM request for an encoded prompt: each image's and video's run of placeholders collapsed back to one
    token (vLLM expands it from the pixels it processes), and the images and videos as multi_modal_data."""
    if mm is None:
        return {"prompt_token_ids": list(ids)}
    runs = {}  # placeholder id -> the run length of each of its images / videos, in order
    for kind in ("image", "video"):
        if f"{kind}_grid_thw" in mm:
            runs[mm[f"{kind}_token_id"]] = [int(thw.prod()) // 4 for thw in mm[f"{kind}_grid_thw"]]  # 2 x 2 patches a token
    out, i, seen = [], 0, {t: 0 for t in runs}
    while i < len(ids):
        out.append(ids[i])
        t = ids[i]
        if t in runs:
            k = seen[t]
            if k == len(runs[t]) or ids[i:i + runs[t][k]] != [t] * runs[t][k]:
                raise ValueError(f"sample {sample!r}: its image / video tokens do not match its images and videos")
            i, seen[t] = i + runs[t][k], k + 1
        else:
            i += 1
    if any(seen[t] != len(runs[t]) for t in runs):  # an image or video without its placeholders
        raise ValueError(f"sample {sample!r}: its image / video tokens do not match its images and videos")
    data = {kind: mm[f"{kind}s"] for kind in ("image", "video") if f"{kind}s" in mm}
    return {"prompt_token_ids": out, "multi_modal_data": data}


def vision_token_ids(tokenizer):
    """The ids of the vision special tokens the tokenizer has (placeholders, start / end markers)."""
    return tokenizer.convert_tokens_to_ids([t for t in VISION_TOKENS if t in tokenizer.get_vocab()])


def block_tokens(model, token_ids, value=-1e4):
    """Make `model` never emit token_ids: its LM head's output for them becomes `value` (finite, so the
    entropy's p * logit stays 0), whatever runs the forward (generate, the trainer, the reference)."""
    index = {}  # device -> the ids there, built once (a host-to-device copy per forward would sync)

    def hook(module, inputs, logits):
        if logits.device not in index:
            index[logits.device] = torch.tensor(token_ids, device=logits.device)
        return logits.index_fill(-1, index[logits.device], value)

    model.get_output_embeddings().register_forward_hook(hook)
    return model


def mm_inputs(mm, input_ids):
    """A vision-language model's image and video inputs for a batch: mm holds per row None (text only) or a dict
    from encode_vl_prompt; pixels and grids are concatenated in row order, as Qwen2-VL expects, and
    mm_token_type_ids marks image tokens 1 and video tokens 2. None if no row has any."""
    rows = [m for m in mm or [] if m is not None]
    if not rows:
        return None
    out = {}
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if any(grid in m for m in rows):
            out[pixels] = torch.cat([m[pixels] for m in rows if grid in m]).to(input_ids.device)
            out[grid] = torch.cat([m[grid] for m in rows if grid in m]).to(input_ids.device)
    image_id = rows[0]["image_token_id"]
    video_id = next((m["video_token_id"] for m in rows if "video_token_id" in m), -1)
    out["mm_token_type_ids"] = (input_ids == image_id).long() + 2 * (input_ids == video_id).long()
    return out


def first_word_reward(prompts, completions, labels, **kwargs):
    """The shapes task's reward: 1 when the completion's first word is the label."""
    return {"correct": [float(c.split()[:1] == [str(label)]) for c, label in zip(completions, labels)]}


def load_vl_model(pretrain=None, min_pixels=IMAGE_SIZE**2, max_pixels=IMAGE_SIZE**2, dtype=torch.float32, tiny="qwen2_vl"):
    """(model, tokenizer, image processor): a Qwen2-VL-family checkpoint directory, or (None) the built-in tiny
    Qwen2-VL with the word tokenizer. The image processor is the PIL one: it needs no torchvision."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    if pretrain is None:
        tokenizer = word_tokenizer()
        return block_tokens(tiny_qwen2_vl(tokenizer, arch=tiny).to(dtype), vision_token_ids(tokenizer)), tokenizer, processor
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    if not os.path.isdir(pretrain):
        raise FileNotFoundError(f"--pretrain {pretrain!r}: not a model directory")
    tokenizer = AutoTokenizer.from_pretrained(pretrain)
    tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(pretrain, dtype=dtype)
    return block_tokens(model, vision_token_ids(tokenizer)), tokenizer, processor


@functools.lru_cache(maxsize=None)  # one per image processor: encoding calls it for every video prompt
def video_processor_like(processor):
    """Qwen2-VL's video processor with the image processor's pixel limits and patching (transformers' needs
    torchvision)."""
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        raise ImportError("video inputs need torchvision (transformers' Qwen2-VL video processor uses it)")
    from transformers import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor(min_pixels=processor.size.shortest_edge, max_pixels=processor.size.longest_edge,
                                 patch_size=processor.patch_size, temporal_patch_size=processor.temporal_patch_size,
                                 merge_size=processor.merge_size, image_mean=processor.image_mean, image_std=processor.image_std)


def encode_vl_prompt(tokenizer, processor, prompt, images, image_token_id, sample=None):
    """(prompt ids, image / video inputs or None) for a text prompt and its images (PIL) and videos (lists of PIL
    frames), in that order before the text: each placeholder expanded to the tokens its pixels take, the counts
    checked."""
    content = [{"type": "video" if isinstance(x, list) else "image"} for x in images] + [{"type": "text", "text": prompt}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    if not images:
        return tokenizer(text, add_special_tokens=False)["input_ids"], None
    video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    mm = {"image_token_id": image_token_id, "video_token_id": video_token_id}
    stills, videos = [x for x in images if not isinstance(x, list)], [x for x in images if isinstance(x, list)]
    if stills:  # images: for vLLM, which processes its own
        mm.update(processor(images=stills, return_tensors="pt"), images=stills)
    if videos:
        mm.update(video_processor_like(processor)(videos=videos, return_tensors="pt"), videos=videos)
    for kind in ("image", "video"):
        text = expand_image_tokens(text, mm.get(f"{kind}_grid_thw", []), image_token=f"<|{kind}_pad|>")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for kind in ("image", "video"):
        check_image_tokens(ids, mm.get(f"{kind}_grid_thw", []), mm[f"{kind}_token_id"], sample=sample, kind=kind)
    return ids, mm


class VisionValueModel(torch.nn.Module):
    """The PPO critic of a vision-language policy (AutoModelForTokenClassification has no Qwen2-VL class):
    a copy of the policy's backbone, vision tower included, and a scalar head `score` on every position,
    zero-initialised so values start at 0. Its output's `.logits` (B, L, 1) reads like a token classifier's."""

    def __init__(self, actor):
        super().__init__()
        self.model = copy.deepcopy(actor.model)  # Qwen2VLModel: vision tower + language model
        self.score = torch.nn.Linear(actor.get_output_embeddings().in_features, 1)
        torch.nn.init.zeros_(self.score.weight)
        torch.nn.init.zeros_(self.score.bias)

    def gradient_checkpointing_enable(self, **kwargs):
        self.model.gradient_checkpointing_enable(**kwargs)

    def forward(self, input_ids, attention_mask, position_ids=None, **mm_inputs):
        from transformers.modeling_outputs import TokenClassifierOutput

        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, **mm_inputs).last_hidden_state  # (B, L, H)
        return TokenClassifierOutput(logits=self.score(hidden))  # (B, L, 1)
