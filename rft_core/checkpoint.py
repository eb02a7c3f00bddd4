"""Checkpoints that are never half-written: save, find the latest, prune, resume.

A checkpoint is `accelerator.save_state` (models, optimizers, schedulers, every rank's RNG states)
plus `trainer_state.json` (the step counter, data position, KL controller, reward statistics...)
and any extra tensors (the EMA weights). It is written to `checkpoint-N.tmp`, renamed to
`checkpoint-N` once every rank has finished, and only then named in `latest`, itself replaced
atomically; so a run killed at any moment resumes from the last complete checkpoint.
"""

import json
import os
import re
import shutil

import torch

LATEST = "latest"


def _write_atomically(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def save_checkpoint(accelerator, output_dir, step, state, tensors=None, max_ckpt_num=None):
    """Write checkpoint-{step} (collective: every rank calls it); keep the newest max_ckpt_num."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process and os.path.exists(tmp):
        shutil.rmtree(tmp)  # left by a run killed while saving
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    if accelerator.is_main_process:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": step, **state}, f)
        if tensors:
            torch.save(tensors, os.path.join(tmp, "tensors.pt"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if os.path.exists(final):  # an older save of the same step
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomically(os.path.join(output_dir, LATEST), os.path.basename(final))
        for old in list_checkpoints(output_dir)[:-max_ckpt_num] if max_ckpt_num else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def list_checkpoints(output_dir):
    """Complete checkpoint directories in output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    steps = [int(m.group(1)) for name in os.listdir(output_dir)
             if (m := re.fullmatch(r"checkpoint-(\d+)", name))]
    return [os.path.join(output_dir, f"checkpoint-{s}") for s in sorted(steps)]


def latest_checkpoint(output_dir):
    """The checkpoint `latest` names (it is only written once that checkpoint is complete), or None."""
    path = os.path.join(output_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        ckpt = os.path.join(output_dir, f.read().strip())
    if not os.path.isfile(os.path.join(ckpt, "trainer_state.json")):
        raise FileNotFoundError(f"{path} names {ckpt}, which is incomplete or missing: "
                                "pass --no_resume to start fresh")
    return ckpt


def load_checkpoint(accelerator, ckpt):
    """Restore what save_checkpoint wrote; returns (trainer state dict, extra tensors or None)."""
    accelerator.load_state(ckpt)
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        state = json.load(f)
    path = os.path.join(ckpt, "tensors.pt")
    tensors = torch.load(path, map_location=accelerator.device) if os.path.exists(path) else None
    return state, tensors
