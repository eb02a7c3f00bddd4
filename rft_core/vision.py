"""What train_ppo_vl.py alone needs: Qwen2-VL-family loading (a checkpoint, or a tiny random one), image
prompt rows and encoding, the vision critic; what engines also use: multimodal.py; the shapes task:
rft_core/tasks/shapes.py. Qwen2-VL merges 2 x 2 of an image's t x h x w grid of 14-pixel patches into a
token, so a prompt holds exactly t*h*w/4 `<|image_pad|>` per image (`<|video_pad|>` per video, frames
paired): `expand_image_tokens` writes them, `check_image_tokens` refuses a mismatch, vLLM expands one itself
(`vllm_prompt`). The policy never emits them (they read as image slots): `block_tokens` sets their logits to
-1e4 at the LM head, one distribution for sampling, trainer and reference (vLLM, SGLang: a -100 bias)."""

import copy
import functools
import os

import torch

from rft_core.data import load_prompt_rows
from rft_core.errors import DataError, MissingPath
from rft_core.experience import Sample
from rft_core.model_training import checkpointing_on
from rft_core.models import check_model_path
from rft_core.multimodal import VISION_TOKENS, ImageFile, ImageInputs, decode_pixels, vision_token_ids
from rft_core.tasks.shapes import COLOURS, IMAGE_SIZE, NUMBERS

SPECIAL = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS)
WORDS = ("user", "assistant", "system", "what", "colour", "is", "the", "shape", "how", "many", "shapes",
         "are", "there", "answer", "with", "a", "word", "?", ".", *COLOURS, *NUMBERS)


def load_image_rows(path, input_key, label_key, images_key, flag, log=print, strict=False):
    """Prompt rows, images_key's paths (relative to the file; a list: a video's frames) as ImageFiles; a row
    with a missing, unreadable or too large image is skipped and counted (strict: DataError)."""
    rows, _ = load_prompt_rows(path, input_key, label_key, flag, {images_key: "--images_key"} if images_key
                               else {}, log=log)
    base = path if os.path.isdir(path) else os.path.dirname(path)
    kept, bad = [], []
    for row in rows:
        paths = row.pop(images_key, None) or []
        paths = [paths] if isinstance(paths, str) else paths
        try:
            row["images"] = [image_file(base, p) if isinstance(p, str) else video_files(base, p)
                             for p in paths]
            kept.append(row)
        except (OSError, ValueError, TypeError) as e:  # missing, unreadable, not an image, too large
            where = f"{flag} {path!r}: row {row['row']}, column {images_key!r}: {type(e).__name__}: {e}"
            if strict:
                raise DataError(f"{where} (--strict_data; without it the row is skipped and counted)") from e
            bad.append(where)
    if bad:
        log(f"[data] skipped {len(bad)} rows whose images could not be read (first: {bad[0]})")
    if not kept:
        raise DataError(f"{flag} {path!r}: no row has readable images (first failure: {bad[0]})")
    return kept


def image_file(base, name):
    """base/name's ImageFile (header only); OSError / ValueError: missing, not an image, too many pixels."""
    import warnings

    from PIL import Image

    path = os.path.join(base, name)
    try:
        with warnings.catch_warnings():  # over the limit PIL warns; over twice the limit it raises
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                size = image.size
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise ValueError(f"{path}: {e} Shrink it (or raise PIL's Image.MAX_IMAGE_PIXELS)") from e
    if max(size) > 200 * min(size):  # (Qwen2-VL's processor refuses them)
        raise ValueError(f"{path}: {size[0]} x {size[1]} pixels, an aspect ratio over 200")
    return ImageFile(path, size)


def video_files(base, names):
    frames = [image_file(base, name) for name in names]
    if len({f.size for f in frames}) > 1:
        raise ValueError(f"the frames {names} have different sizes: {sorted({f.size for f in frames})}")
    return frames


def word_tokenizer():
    """A word tokenizer of the task's ~40 words: a random model says valid answers often enough for GRPO."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL, *WORDS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<|im_end|>", additional_special_tokens=list(SPECIAL[2:]))
    tokenizer.padding_side = "left"
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<|vision_start|> <|image_pad|> <|vision_end|> "
        "{% elif c['type'] == 'video' %}<|vision_start|> <|video_pad|> <|vision_end|> "
        "{% else %}{{ c['text'] }} {% endif %}{% endfor %}<|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    return tokenizer


def tiny_qwen2_vl(tokenizer, seed=0, arch="qwen2_vl"):
    """A random ~1 M-parameter Qwen2-VL (arch "qwen2_5_vl": Qwen2.5-VL) over the tokenizer's vocabulary."""
    import transformers

    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    vision = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  in_chans=3)
    if arch == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64)
    elif arch == "qwen2_5_vl":
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=56,
                      fullatt_block_indexes=[1])
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}: qwen2_vl or qwen2_5_vl")
    config = transformers.AutoConfig.for_model(arch, text_config=text, vision_config=vision,
                                               image_token_id=ids[2], video_token_id=ids[3],
                                               vision_start_token_id=ids[0], vision_end_token_id=ids[1])
    torch.manual_seed(seed)
    return transformers.AutoModelForImageTextToText.from_config(config)


def expand_image_tokens(text, image_grid_thw, merge_size=2, image_token="<|image_pad|>"):
    """text, each image placeholder repeated its image's t*h*w / merge^2 times (as Qwen2VLProcessor does)."""
    parts = text.split(image_token)
    if len(parts) - 1 != len(image_grid_thw):
        raise DataError(f"{len(parts) - 1} image placeholders in the prompt but {len(image_grid_thw)} "
                         "images")
    counts = [int(torch.as_tensor(thw).prod()) // merge_size**2 for thw in image_grid_thw]
    return parts[0] + "".join(image_token * n + part for n, part in zip(counts, parts[1:]))


def check_image_tokens(input_ids, image_grid_thw, image_token_id, merge_size=2, sample=None, kind="image"):
    """Raise, naming the sample, unless input_ids hold exactly the image (or video) tokens the images need."""
    want = sum(int(torch.as_tensor(thw).prod()) // merge_size**2 for thw in image_grid_thw)
    have = int((torch.as_tensor(input_ids) == image_token_id).sum())
    if have != want:
        grids = [list(map(int, g)) for g in image_grid_thw]
        raise DataError(f"sample {sample!r}: {have} {kind} tokens in the prompt but its {len(grids)} "
                         f"{kind}(s) need {want} (grids {grids})")


def block_tokens(model, token_ids, value=-1e4):
    """Stop `model` emitting token_ids: its LM head gives them `value` (finite: entropy's p * logit is 0)."""
    index = {}  # device -> the ids there, built once (a host-to-device copy per forward would sync)

    def hook(module, inputs, logits):
        if getattr(module, "computes_logprobs", False):  # logprobs.LinearLogprobs applies blocked_token_ids
            return logits
        if logits.device not in index:
            index[logits.device] = torch.tensor(token_ids, device=logits.device)
        return logits.index_fill(-1, index[logits.device], value)

    model.get_output_embeddings().register_forward_hook(hook)
    model.get_output_embeddings().blocked_token_ids = list(token_ids)
    return model


def load_vl_model(pretrain=None, min_pixels=IMAGE_SIZE**2, max_pixels=IMAGE_SIZE**2, dtype=torch.float32,
                  tiny="qwen2_vl"):
    """(model, tokenizer, PIL image processor) of a Qwen2-VL-family checkpoint or (None) the tiny one."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    if pretrain is None:
        tokenizer = word_tokenizer()
        model = tiny_qwen2_vl(tokenizer, arch=tiny).to(dtype)
    else:
        if not os.path.isdir(pretrain):
            raise MissingPath(f"--pretrain {pretrain!r}: not a model directory")
        check_model_path(pretrain)
        tokenizer = AutoTokenizer.from_pretrained(pretrain)
        tokenizer.padding_side = "left"
        model = AutoModelForImageTextToText.from_pretrained(pretrain, dtype=dtype)
    return block_tokens(model, vision_token_ids(tokenizer)), tokenizer, processor


def encode_vl_prompt(tokenizer, processor, prompt, images, image_token_id, sample=None, system_prompt=None,
                     pixels=None):
    """(prompt ids, ImageInputs or None), placeholders expanded and checked; pixels: shared decode cache."""
    content = [{"type": "video" if isinstance(x, list) else "image"} for x in images]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": prompt}]}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not images:
        return tokenizer(text, add_special_tokens=False)["input_ids"], None
    token_ids = {"image_token_id": image_token_id,
                 "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>")}
    mm = ImageInputs(processor, images, token_ids, pixels)
    for kind in ("image", "video"):
        text = expand_image_tokens(text, mm.get(f"{kind}_grid_thw", []), image_token=f"<|{kind}_pad|>")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for kind in ("image", "video"):
        check_image_tokens(ids, mm.get(f"{kind}_grid_thw", []), mm[f"{kind}_token_id"], sample=sample,
                           kind=kind)
    return ids, mm


def freeze(prefix, *models):
    for model in models if prefix else []:
        for name, p in model.named_parameters() if model is not None else []:
            p.requires_grad_(not name.startswith(prefix))


def encode_vl_rows(tokenizer, processor, rows, image_token_id, max_len, max_images, mixed=False,
                   system_prompt=None, keep=64):
    """(Samples, skipped: imageless unless mixed, over max_images or max_len); `keep` prompts stay decoded"""
    pixels = functools.lru_cache(maxsize=keep)(decode_pixels)
    usable = [r for r in rows if (r["images"] or mixed) and len(r["images"]) <= max_images]
    encoded = [encode_vl_prompt(tokenizer, processor, r["prompt"], r["images"], image_token_id, sample=i,
                                system_prompt=system_prompt, pixels=pixels) for i, r in enumerate(usable)]
    samples = [Sample(ids, r["label"], r["prompt"], mm, columns=r.get("columns"))
               for (ids, mm), r in zip(encoded, usable)]
    kept = [s for s in samples if len(s.prompt_ids) <= max_len]
    return kept, len(rows) - len(kept)


class VisionValueModel(torch.nn.Module):
    """A VL policy's critic (AutoModelForTokenClassification has no Qwen2-VL class): a copy of its backbone,
    vision tower included, and a zero head `score` per position; `.logits` (B, L, 1) like a classifier's."""

    def __init__(self, actor):
        super().__init__()
        self.model = copy.deepcopy(actor.model)  # Qwen2VLModel: vision tower + language model
        self.score = torch.nn.Linear(actor.get_output_embeddings().in_features, 1)
        torch.nn.init.zeros_(self.score.weight)
        torch.nn.init.zeros_(self.score.bias)

    def activation_checkpointing_enable(self, **kwargs):  # rft_core.model_training.checkpointing_on
        checkpointing_on(self.model)

    def forward(self, input_ids, attention_mask, position_ids=None, **mm_inputs):
        from transformers.modeling_outputs import TokenClassifierOutput

        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, **mm_inputs).last_hidden_state  # (B, L, H)
        return TokenClassifierOutput(logits=self.score(hidden))  # (B, L, 1)
