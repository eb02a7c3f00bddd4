"""Image and video inputs as the rollout engines and the trainer pass them (vision-language models). A
prompt's images travel as `mm`: None for text only, else vision.encode_vl_prompt's ImageInputs. `mm_inputs`
turns a batch's into model inputs, `vllm_prompt` one into a vLLM request."""

import collections
import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rft_core.errors import DataError, MissingDependency

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


@dataclass(frozen=True)
class ImageFile:
    """An image file as start-up read it: its header (size) only; ImageInputs decodes its pixels."""
    path: str
    size: tuple  # (width, height)


def grid(processor, size, frames=1):
    """[t, h, w]: the patches the processor cuts an image (frames 1) or a video of this size (width, height)
    into, from its own resize rule (smart_resize: 28-pixel multiples within its min / max pixels)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patch = processor.patch_size
    h, w = smart_resize(size[1], size[0], patch * processor.merge_size, processor.size.shortest_edge,
                        processor.size.longest_edge)
    return [-(-frames // processor.temporal_patch_size), h // patch, w // patch]


def decode(image, processor):
    """An image (an ImageFile, or a PIL image in memory) in RGB, resized once to the size the processor gives
    it (which its own resize then keeps): a large image is never held at full size beyond this call."""
    from PIL import Image

    _, h, w = grid(processor, image.size)
    size = (w * processor.patch_size, h * processor.patch_size)
    if not isinstance(image, ImageFile):
        return image.convert("RGB").resize(size, processor.resample)
    try:
        with Image.open(image.path) as f:
            return f.convert("RGB").resize(size, processor.resample)
    except (OSError, ValueError) as e:  # (its header was read at start-up: damaged further in, or changed)
        raise DataError(f"image {image.path}: its pixels cannot be read ({type(e).__name__}: {e}); replace "
                        "the file or drop its row") from e


class ImageInputs(Mapping):
    """A prompt's images and videos (`mm`) as a dict: grids (from the sizes), placeholder ids, and pixels (and
    PIL images for vLLM) decoded when read by `pixels`, decode_pixels behind an lru_cache a split's prompts
    share: memory holds the pixels of the prompts read last, whatever the number of rows."""
    __eq__, __hash__ = object.__eq__, object.__hash__  # (the lru_cache's key)

    def __init__(self, processor, images, token_ids, pixels=None):
        self.processor, self.pixels = processor, pixels or functools.lru_cache(maxsize=1)(decode_pixels)
        self.stills = [x for x in images if not isinstance(x, list)]
        self.videos = [x for x in images if isinstance(x, list)]
        self.known, self.decoded = dict(token_ids), []  # decoded: the keys decode_pixels gives
        for kind, frames in (("image", [[x] for x in self.stills]), ("video", self.videos)):
            if frames:
                thw = [grid(processor, f[0].size, len(f)) for f in frames]
                self.known[f"{kind}_grid_thw"] = torch.tensor(thw)
                self.decoded += ["pixel_values" if kind == "image" else "pixel_values_videos", f"{kind}s"]

    def __getitem__(self, key):
        return self.known[key] if key in self.known or key not in self.decoded else self.pixels(self)[key]

    def __contains__(self, key):  # (Mapping's would read the value: decode the pixels)
        return key in self.known or key in self.decoded

    def __iter__(self):
        return iter([*self.known, *self.decoded])

    def __len__(self):
        return len(self.known) + len(self.decoded)

    def __deepcopy__(self, memo):  # (dataclasses.asdict of a Sample) nothing in it changes once made
        return self

    def __reduce__(self):  # saved (partial rollout's buffer) as plain data torch.load's weights_only takes
        pixels = [(key, self[key]) for key in self.decoded if key.startswith("pixel_values")]
        return collections.OrderedDict, ([*self.known.items(), *pixels],)


def decode_pixels(inputs):
    """An ImageInputs' pixels: its images and videos decoded, resized (decode), then processed unresized."""
    out, processor = {}, inputs.processor
    if inputs.stills:
        stills = [decode(x, processor) for x in inputs.stills]
        out.update(processor(images=stills, do_resize=False, return_tensors="pt"), images=stills)
    if inputs.videos:
        videos = [[decode(f, processor) for f in v] for v in inputs.videos]
        out.update(video_processor_like(processor)(videos=videos, do_resize=False, return_tensors="pt"),
                   videos=videos)
    for grids in ("image_grid_thw", "video_grid_thw"):  # the sizes read at start-up made the prompt's tokens
        if grids in out and not torch.equal(out.pop(grids), inputs[grids]):
            raise DataError(f"the images {inputs.stills + inputs.videos} changed size since the run started")
    return out


def vllm_prompt(ids, mm, sample=None):
    """A vLLM request: each image's placeholder run back to one token (vLLM expands it), multi_modal_data."""
    if mm is None:
        return {"prompt_token_ids": list(ids)}
    # placeholder id -> the run lengths of its images / videos, in order (2 x 2 patches a token)
    want = {mm[f"{kind}_token_id"]: [int(thw.prod()) // 4 for thw in mm[f"{kind}_grid_thw"]]
            for kind in ("image", "video") if f"{kind}_grid_thw" in mm}
    out, runs = [], {t: [] for t in want}
    for t, run in itertools.groupby(ids):
        run = list(run)
        if t in runs:
            runs[t].append(len(run))
            run = run[:1]
        out += run
    if runs != want:
        raise DataError(f"sample {sample!r}: its image / video tokens do not match its images and videos")
    data = {kind: mm[f"{kind}s"] for kind in ("image", "video") if f"{kind}s" in mm}
    if len(data) < len(want):  # resumed: a checkpoint keeps an unfinished sample's pixel values, not images
        raise DataError(f"sample {sample!r}: vLLM needs its images, which the checkpoint it was resumed from "
                        "does not keep: resume with --engine_type hf or sglang, or start afresh: --no_resume")
    return {"prompt_token_ids": out, "multi_modal_data": data}


def vision_token_ids(tokenizer):
    return tokenizer.convert_tokens_to_ids([t for t in VISION_TOKENS if t in tokenizer.get_vocab()])


def mm_inputs(mm, input_ids):
    """A batch's image and video model inputs (mm: per row None or an ImageInputs), concatenated in row order
    as Qwen2-VL expects; mm_token_type_ids marks image tokens 1, video tokens 2. None if no row has any."""
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


@functools.lru_cache(maxsize=None)  # one per image processor: encoding calls it for every video prompt
def video_processor_like(processor):
    """Qwen2-VL's video processor with the image processor's pixel limits and patching."""
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        raise MissingDependency("video inputs need torchvision (transformers' Qwen2-VL video processor uses "
                                "it)")
    from transformers import Qwen2VLVideoProcessor

    same = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    return Qwen2VLVideoProcessor(min_pixels=processor.size.shortest_edge,
                                 max_pixels=processor.size.longest_edge,
                                 **{name: getattr(processor, name) for name in same})
