"""Checkpoints that are never half-written: save, find the latest, prune, resume.

A checkpoint is `accelerator.save_state` (models, optimizers, schedulers, every rank's RNG states)
plus `trainer_state.json` (the step counter, data position, KL controller, reward statistics...)
and any extra tensors (the EMA weights). It is written to `checkpoint-N.tmp`, renamed to
`checkpoint-N` once every rank has finished, and only then named in `latest`, itself replaced
atomically; so a run killed at any moment resumes from the last complete checkpoint.

Each checkpoint records in `manifest.json` the size of every file it holds and the SHA-256 of the small
ones (states, RNG, trainer state). Resuming verifies them: a damaged or missing latest checkpoint is named
and the newest intact one before it is used instead, never a damaged RNG state.

The trainer state also records the settings the checkpoint's contents depend on (`run_identity`): the data
stream's order and batch, the per-rank buffers, the models and their layout. A run that would resume it
with other values of them is refused in one line before anything loads; the other flags (learning rate,
clipping, lengths, steps...) may change on resume.
"""

import hashlib
import json
import os
import re
import shutil

import torch

from rft_core.errors import CheckpointError

LATEST = "latest"
MANIFEST = "manifest.json"
HASHED_BYTES = 64 << 20  # files up to this size get a SHA-256 too; larger ones (weights, optimizer): a size
RESUME_FLAGS = ("pretrain", "prompt_data", "input_key", "label_key", "images_key", "seed",
                "rollout_batch_size", "n_samples_per_prompt", "partial_rollout", "lora_rank")


def run_identity(args, accelerator):
    """What a run resuming a checkpoint must share with the run that wrote it (JSON-ready): RESUME_FLAGS
    (paths made absolute), LoRA's target modules, whether a critic trains, the processes, and the format of
    the saved states (DeepSpeed and its ZeRO stage, FSDP, or plain: DDP and one process save alike)."""
    identity = {name: getattr(args, name) for name in RESUME_FLAGS if hasattr(args, name)}
    for name in ("pretrain", "prompt_data"):
        if identity.get(name) and os.path.exists(identity[name]):  # (not a built-in task's name)
            identity[name] = os.path.abspath(identity[name])
    if args.lora_rank:
        identity["target_modules"] = args.target_modules
    kind = accelerator.distributed_type.name
    deepspeed = accelerator.state.deepspeed_plugin
    states = f"ZeRO-{deepspeed.zero_stage}" if deepspeed else kind if kind == "FSDP" else "plain"
    return {**identity, "critic": args.advantage_estimator == "gae", "processes": accelerator.num_processes,
            "states": states}


def resume_point(args, accelerator):
    """(the checkpoint to resume: the newest intact one in --output_dir, or None with --no_resume or none
    there, refused if written with other settings; run_identity, which the run's checkpoints record)."""
    identity = run_identity(args, accelerator)
    ckpt = None if args.no_resume else latest_checkpoint(args.output_dir, accelerator.print, identity)
    return ckpt, identity


def checkpoint_step(ckpt):
    """The step a checkpoint-N directory was written after: N."""
    return int(ckpt.rsplit("-", 1)[1])


def finished_run(ckpt, num_steps, log):
    """Whether ckpt (None: not resuming) already ends a run of num_steps steps; if so, it says what to do."""
    if ckpt is None or checkpoint_step(ckpt) < num_steps:
        return False
    log(f"[done] {ckpt} is step {num_steps} of {num_steps}: the run is finished, nothing to do, and the "
        "output directory is left as it is (raise --max_steps to train further, or --no_resume to start "
        "afresh)")
    return True


def check_identity(ckpt, identity):
    """Refuse to resume ckpt with settings other than those it was written with (its trainer state's "run";
    checkpoints from before it was recorded pass)."""
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        saved = json.load(f).get("run") or {}
    changed = [f"{name} {saved[name]!r} then, {value!r} now" for name, value in identity.items()
               if name in saved and saved[name] != value]
    if changed:
        raise CheckpointError(f"{ckpt} was written with other settings ({'; '.join(changed)}): its data "
                              "position, buffers and model state belong to those. Resume with them, or pass "
                              "--no_resume to start afresh (or use another --output_dir)")


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
    accelerator.wait_for_everyone()  # every rank's files are written
    if accelerator.is_main_process:
        _write_atomically(os.path.join(tmp, MANIFEST), json.dumps(_manifest(tmp), indent=1))
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


def _files(ckpt):
    for root, _, names in os.walk(ckpt):
        for name in names:
            path = os.path.join(root, name)
            if os.path.relpath(path, ckpt) != MANIFEST:
                yield os.path.relpath(path, ckpt), path


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest(ckpt):
    """{file: {"bytes": size, "sha256": digest (small files only)}} of a checkpoint directory."""
    out = {}
    for rel, path in sorted(_files(ckpt)):
        size = os.path.getsize(path)
        out[rel] = {"bytes": size, **({"sha256": _sha256(path)} if size <= HASHED_BYTES else {})}
    return out


def verify_checkpoint(ckpt):
    """None if the checkpoint is whole, else what is wrong with it (missing, a file missing or of another size
    or digest than when it was written). A checkpoint from before manifests is taken as whole if its
    trainer_state.json reads."""
    if not os.path.isdir(ckpt):
        return "missing"
    path = os.path.join(ckpt, MANIFEST)
    if not os.path.exists(path):
        try:
            with open(os.path.join(ckpt, "trainer_state.json")) as f:
                json.load(f)
            return None
        except (OSError, ValueError) as e:
            return f"trainer_state.json unreadable ({e})"
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return f"{MANIFEST} unreadable ({e})"
    for rel, want in manifest.items():
        file = os.path.join(ckpt, rel)
        if not os.path.isfile(file):
            return f"{rel} is missing"
        if os.path.getsize(file) != want["bytes"]:
            return f"{rel} has {os.path.getsize(file)} bytes, {want['bytes']} when written"
        if "sha256" in want and _sha256(file) != want["sha256"]:
            return f"{rel} changed since it was written (SHA-256)"
    return None


def latest_checkpoint(output_dir, log=None, identity=None):
    """The newest intact checkpoint: the one `latest` names (it is only written once that checkpoint is
    complete) if it verifies, else the newest older one that does, saying why through log(message). None if
    there is none at all; an error naming the fix if checkpoints exist but none is intact, or (identity:
    run_identity's) if it was written with other settings."""
    path = os.path.join(output_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        named = os.path.join(output_dir, f.read().strip())
    older = [c for c in reversed(list_checkpoints(output_dir)) if checkpoint_step(c) < checkpoint_step(named)]
    for ckpt in [named] + older:
        problem = verify_checkpoint(ckpt)
        if problem is None:
            if identity is not None:
                check_identity(ckpt, identity)
            return ckpt
        if log:
            log(f"[resume] {os.path.basename(ckpt)} is damaged ({problem}): skipping it")
    raise CheckpointError(f"{output_dir} holds no intact checkpoint ({os.path.basename(named)} and older "
                          "ones are damaged or missing): pass --no_resume to start afresh there, or use "
                          "another --output_dir")


def load_checkpoint(accelerator, ckpt):
    """Restore what save_checkpoint wrote; returns (trainer state dict, extra tensors or None)."""
    try:
        accelerator.load_state(ckpt)
    except Exception as e:  # a checkpoint from before manifests can still be damaged
        raise CheckpointError(f"{ckpt} could not be loaded ({type(e).__name__}: {str(e)[:200]}): pass "
                              "--no_resume to start afresh, or delete it to resume from an older one") from e
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        state = json.load(f)
    path = os.path.join(ckpt, "tensors.pt")
    tensors = torch.load(path, map_location=accelerator.device) if os.path.exists(path) else None
    return state, tensors
