"""Image and video inputs as the rollout engines and the trainer pass them (for vision-language models).

A prompt's images travel as `mm`: None for a text-only prompt, else a dict from vision.encode_vl_prompt with
pixel_values / image_grid_thw (and pixel_values_videos / video_grid_thw), the placeholder token ids, and the
PIL images themselves for vLLM, which processes its own. `mm_inputs` turns a batch's into model inputs;
`vllm_prompt` turns one into a vLLM request.
"""

import functools

import torch

from rft_core.errors import DataError, MissingDependency

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def vllm_prompt(ids, mm, sample=None):
    """A vLLM request for an encoded prompt: each image's and video's run of placeholders collapsed back to
    one token (vLLM expands it from the pixels it processes), and the images and videos as
    multi_modal_data."""
    if mm is None:
        return {"prompt_token_ids": list(ids)}
    mismatch = f"sample {sample!r}: its image / video tokens do not match its images and videos"
    # placeholder id -> the run lengths of its images / videos, in order (2 x 2 patches a token)
    runs = {mm[f"{kind}_token_id"]: iter([int(thw.prod()) // 4 for thw in mm[f"{kind}_grid_thw"]])
            for kind in ("image", "video") if f"{kind}_grid_thw" in mm}
    out, i = [], 0
    while i < len(ids):
        t, n = ids[i], 1
        if t in runs:
            n = next(runs[t], 0)  # 0: more runs than images / videos
            if n == 0 or ids[i:i + n] != [t] * n:
                raise DataError(mismatch)
        out.append(t)
        i += n
    if any(next(run, None) is not None for run in runs.values()):  # an image or video without its run
        raise DataError(mismatch)
    data = {kind: mm[f"{kind}s"] for kind in ("image", "video") if f"{kind}s" in mm}
    return {"prompt_token_ids": out, "multi_modal_data": data}


def vision_token_ids(tokenizer):
    """The ids of the vision special tokens the tokenizer has (placeholders, start / end markers)."""
    return tokenizer.convert_tokens_to_ids([t for t in VISION_TOKENS if t in tokenizer.get_vocab()])


def mm_inputs(mm, input_ids):
    """A vision-language model's image and video inputs for a batch: mm holds per row None (text only) or a
    dict from encode_vl_prompt; pixels and grids are concatenated in row order, as Qwen2-VL expects, and
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


@functools.lru_cache(maxsize=None)  # one per image processor: encoding calls it for every video prompt
def video_processor_like(processor):
    """Qwen2-VL's video processor with the image processor's pixel limits and patching (transformers' needs
    torchvision)."""
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        raise MissingDependency("video inputs need torchvision (transformers' Qwen2-VL video processor uses "
                                "it)")
    from transformers import Qwen2VLVideoProcessor

    same = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    return Qwen2VLVideoProcessor(min_pixels=processor.size.shortest_edge,
                                 max_pixels=processor.size.longest_edge,
                                 **{name: getattr(processor, name) for name in same})
