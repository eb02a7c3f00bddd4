"""Checkpoints never half-written: `accelerator.save_state` plus trainer_state.json (LoopState) and
tensors.pt, written to checkpoint-N.tmp, renamed once every rank is done, only then named in `latest`: a run
killed at any moment resumes from the last complete one. Resuming verifies its manifest
(rft_core/runs/integrity.py) and falls back to the newest intact one; a failed save (a full disk) is one line
and keeps the previous one. Resuming with other settings (`run_identity`) is refused; other flags may change
(config.json records them). More steps keep the checkpoint's learning-rate schedule (`schedule_length`)."""

import contextlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch

from rft_core.data import KINDS
from rft_core.errors import CheckpointError
from rft_core.models import content_digest
from rft_core.runs import integrity
from rft_core.runs.integrity import MANIFEST, is_full, manifest, nbytes, read_rows, size_text, write_whole
from rft_core.runs.run_dir import check_free, finished_step, on_main, previous_run, refuse_overwrite

LATEST = "latest"
RESUME_FLAGS = ("input_key", "label_key", "images_key", "seed", "rollout_batch_size", "n_samples_per_prompt",
                "partial_rollout", "lora_rank",
                "normalize_reward")  # (its running statistics are in the trainer state)
DATA_FLAGS = ("prompt_data", "eval_data", "pretrain_data")


def run_identity(args, accelerator, model=None):
    """What a resume must share with the run that wrote the checkpoint (JSON-ready): RESUME_FLAGS, the model
    (model: its path; the reference loads from it again) and DATA_FLAGS' files by content
    (models.content_digest: moved, they still resume), the processes and the states' format (ZeRO, FSDP)."""
    def digest(path, **how):  # (a built-in task's name, or None, as it is)
        return content_digest(path, **how) if path and os.path.exists(path) else path

    identity = {name: getattr(args, name) for name in RESUME_FLAGS if hasattr(args, name)}
    identity["model"] = digest(model, sampled=not str(model).endswith(".gguf"))
    identity["data"] = {name: digest(getattr(args, name, None), suffixes=tuple(KINDS)) for name in DATA_FLAGS}
    if args.lora_rank:
        identity["target_modules"] = args.target_modules
    teacher = getattr(args, "teacher_pretrain", None)
    if teacher:  # distilled from another teacher: another run
        identity["teacher"] = digest(teacher, sampled=not teacher.endswith(".gguf"))
    kind = accelerator.distributed_type.name
    deepspeed = accelerator.state.deepspeed_plugin
    states = f"ZeRO-{deepspeed.zero_stage}" if deepspeed else kind if kind == "FSDP" else "plain"
    return {**identity, "critic": args.advantage_estimator == "gae", "ema": args.ema_beta is not None,
            "processes": accelerator.num_processes, "states": states}


def resume_point(args, accelerator, model=None):
    """(the newest intact checkpoint in --output_dir, or None: --no_resume or none; run_identity). The main
    process looks (refusing a directory another live run holds), the others take its answer."""
    identity = run_identity(args, accelerator, model)

    def find():
        check_free(args.output_dir)
        if args.no_resume:
            return None
        ckpt = latest_checkpoint(args.output_dir, accelerator.print, identity)
        # a run there with nothing to resume is refused now, before any model loads (MetricsLog would)
        rows = read_rows(os.path.join(args.output_dir, "metrics.jsonl"))[0]
        if ckpt is None and (found := previous_run(args.output_dir, rows)):
            refuse_overwrite(args.output_dir, found)
        return ckpt
    return on_main(accelerator, find), identity


def checkpoint_step(ckpt):
    return int(ckpt.rsplit("-", 1)[1])


def finished_run(ckpt, num_steps, log):
    """Whether ckpt (None: not resuming) already ends a run of num_steps steps (said, with what to do). A
    last step's checkpoint without a whole export (run_dir.finished_step: a kill while exporting) resumes."""
    if ckpt is None or checkpoint_step(ckpt) < num_steps:
        return False
    if checkpoint_step(ckpt) == num_steps and finished_step(os.path.dirname(ckpt)) != num_steps:
        log(f"[resume] {ckpt} is step {num_steps} of {num_steps}, but the run's model was not exported whole "
            "(it was stopped while writing it): exporting it again")
        return False
    log(f"[done] {ckpt} is step {num_steps} of {num_steps}: the run is finished, nothing to do, and the "
        "output directory is left as it is (raise --max_steps to train further, or --no_resume to start "
        "afresh)")
    return True


def check_identity(ckpt, identity):
    """Refuse to resume ckpt with other settings than its trainer state's "run" (entries it lacks pass)."""
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        saved = json.load(f).get("run") or {}
    changed = [f"{name} {saved[name]!r} then, {value!r} now" for name, value in identity.items()
               if name in saved and saved[name] != value and name not in ("model", "teacher", "data")]
    for name, flag in (("model", "pretrain"), ("teacher", "teacher_pretrain")):
        if name in saved and saved[name] != identity.get(name):
            changed.append(f"--{flag}: another model (its files differ from those it started from)")
    changed += [f"--{name}: other data (the file was edited, or is another)" for name, path in
                identity.get("data", {}).items() if "data" in saved and saved["data"].get(name) != path]
    if changed:
        raise CheckpointError(f"{ckpt} was written with other settings ({'; '.join(changed)}): its data "
                              "position, buffers, model state and reference model belong to those. Resume "
                              "with them, or pass --no_resume to start afresh (or use another --output_dir)")


def schedule_length(ckpt, num_steps, num_updates, warmup_ratio, log):
    """The optimizer steps the LR schedule spans: num_updates, or ckpt's (a higher --max_steps goes on at the
    rate reached instead of stretching the warm-up). A run ending before ckpt's step is refused."""
    if ckpt is None:
        return num_updates
    if num_steps < checkpoint_step(ckpt):
        raise CheckpointError(f"{ckpt} is past this run's last step, {num_steps} (--max_steps, "
                              "--num_episodes): its later steps cannot be undone. Resume with --max_steps "
                              f"{checkpoint_step(ckpt)} or more, or pass --no_resume to start afresh (or use "
                              "another --output_dir)")
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        length = json.load(f).get("schedule") or num_updates  # (None in checkpoints from before it)
    kept, stretched = math.ceil(warmup_ratio * length), math.ceil(warmup_ratio * num_updates)
    if kept != stretched:
        log(f"[resume] the learning-rate warm-up keeps the length {os.path.basename(ckpt)} was written with, "
            f"{kept} optimizer steps, not {stretched} over this run's steps (the rate would fall back)")
    return length


@dataclass
class LoopState:
    """What the loop carries from step to step beside what accelerate saves. A field declared here is saved
    and resumed: an object by state_dict / load_state_dict (buffer_state into tensors.pt), a field marked
    tensors into tensors.pt, plain data into trainer_state.json."""
    rollouts: Any  # rollout.Rollouts: the prompt stream's position, partial rollout's buffer
    # run_identity's; merged under this run's, so entries new since the checkpoint reach the next one
    run: Optional[dict] = field(default=None, metadata={"merged": True})
    kl_coef: float = 0.0  # the KL coefficient, adaptive with --kl_target
    first_eval: Optional[dict] = None  # the step-0 held-out eval, for the run's summary
    moments: Any = None  # advantages.RunningMoments with --normalize_reward
    ema: Optional[list] = field(default=None, metadata={"tensors": True})  # the EMA weights, --ema_beta
    schedule: Optional[int] = None  # the optimizer steps the learning-rate schedule spans (schedule_length)

    def save(self):
        """(trainer_state.json's entries, tensors.pt's)."""
        state, tensors = {}, {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("tensors"):
                tensors[f.name] = value
            elif hasattr(value, "state_dict"):
                state[f.name] = value.state_dict()
                if hasattr(value, "buffer_state"):
                    tensors[f.name] = value.buffer_state()
            else:
                state[f.name] = value
        return state, tensors

    def load(self, state, tensors):
        """Every field from load_checkpoint's (state, tensors); returns the checkpoint's step."""
        tensors = tensors or {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("merged"):
                setattr(self, f.name, {**(state.get(f.name) or {}), **(value or {})})
            elif f.metadata.get("tensors"):
                setattr(self, f.name, tensors[f.name] if value is not None else None)
            elif hasattr(value, "load_state_dict"):
                saved = state.get(f.name, state)  # (before LoopState the rollouts' entries were top-level)
                args = (saved, tensors[f.name]) if hasattr(value, "buffer_state") else (saved,)
                value.load_state_dict(*args)
            else:
                setattr(self, f.name, state.get(f.name, value))
        return state["step"]


def save_checkpoint(accelerator, output_dir, step, state, tensors=None, max_ckpt_num=None):
    """Collective. Write checkpoint-{step}, keeping the newest max_ckpt_num up to it; a failure on any rank (a
    full disk) removes the partial one and is one line on every rank (`latest` names the previous one)."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"  # (one a killed save left was removed at the start: run_dir.clean_leftovers)
    error = None
    try:
        accelerator.save_state(tmp)
        if accelerator.is_main_process:
            write_whole(os.path.join(tmp, "trainer_state.json"), json.dumps({"step": step, **state}))
            if tensors:
                with open(os.path.join(tmp, "tensors.pt"), "wb") as f:  # (a full disk's errno kept)
                    torch.save(tensors, f)
    except Exception as e:  # (a full disk: OSError, or torch's `iostream error`)
        error = e
    if _on_any_rank(accelerator, error is not None):  # every rank's files are written, or one failed
        raise _save_failed(accelerator, output_dir, step, tmp, error, nbytes(tensors))
    if accelerator.is_main_process:
        try:
            write_whole(os.path.join(tmp, MANIFEST), json.dumps(manifest(tmp), indent=1))
            integrity.replace_dir(tmp, final)  # (over an older save of the same step)
            write_whole(os.path.join(output_dir, LATEST), os.path.basename(final))
        except OSError as e:
            error = e
            if not os.path.isdir(tmp):  # renamed, but `latest` names the previous one: not kept either
                shutil.rmtree(final, ignore_errors=True)
        # (newer ones, skipped as damaged by a resume, wait to be replaced by this run's save of their step)
        older = [c for c in list_checkpoints(output_dir) if checkpoint_step(c) < step] if not error else []
        for old in older[:max(0, len(older) - max_ckpt_num + 1)] if max_ckpt_num else []:
            shutil.rmtree(old)
    if _on_any_rank(accelerator, error is not None):
        raise _save_failed(accelerator, output_dir, step, tmp, error, nbytes(tensors))
    integrity.mark_written(final)  # on every rank: naming it later (a stop, a divergence) hashes nothing
    return final


def _on_any_rank(accelerator, flag):
    """Whether flag is true on any rank (collective)."""
    return accelerator.reduce(torch.tensor(float(flag), device=accelerator.device), "sum").item() > 0


def _size(path):
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names)


def _save_failed(accelerator, output_dir, step, tmp, error, tensor_bytes):
    """The one-line error of a save that failed on some rank (error: this rank's, or None), the partial one
    removed; a full disk says what it needs and what is free. Other errors keep their traceback."""
    previous = [c for c in list_checkpoints(output_dir) if checkpoint_step(c) < step]
    needed = max(_size(previous[-1]) if previous else 0, _size(tmp) + tensor_bytes)  # (no tmp: 0)
    full = error is not None and is_full(error, output_dir)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    if error is not None and not full and not isinstance(error, OSError):
        return error  # a bug of ours, not the disk's
    kept = (f"{os.path.basename(previous[-1])}, the previous checkpoint, is intact" if previous
            else "no earlier checkpoint exists")
    if full:
        what = (f"no space left on {output_dir}: checkpoint-{step} needs ~{size_text(needed)}"
                f"{'' if previous else ' or more'}, {size_text(shutil.disk_usage(output_dir).free)} free")
    else:
        how = f"in {output_dir} ({type(error).__name__}: {error})" if error else "by another process"
        what = f"checkpoint-{step} could not be written {how}"
    return CheckpointError(f"{what}; it was not kept and {kept}: free space there (or lower --max_ckpt_num) "
                           "and rerun the same command to resume from the newest intact checkpoint")


def list_checkpoints(output_dir):
    """Complete checkpoint directories in output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    steps = [int(m.group(1)) for name in os.listdir(output_dir)
             if (m := re.fullmatch(r"checkpoint-(\d+)", name))]
    return [os.path.join(output_dir, f"checkpoint-{s}") for s in sorted(steps)]


def latest_checkpoint(output_dir, log=None, identity=None):
    """The newest intact checkpoint (`latest`'s, else the newest older one, said), or None if there is none;
    a CheckpointError if none is intact, or if it was written with another identity (run_identity's)."""
    path, named, checkpoints = os.path.join(output_dir, LATEST), None, list_checkpoints(output_dir)
    log = log or (lambda message: None)
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        named = f.read().strip()
    if named is not None and not re.fullmatch(r"checkpoint-\d+", named):
        log(f"[resume] {path} names {named[:40]!r}, not a checkpoint: looking for the newest intact one")
        named = None
    named = named and os.path.join(output_dir, named)
    if named is None and not checkpoints:
        return None
    newest = checkpoint_step(named) if named else checkpoint_step(checkpoints[-1]) + 1
    older = [c for c in reversed(checkpoints) if checkpoint_step(c) < newest]
    for ckpt in ([named] if named else []) + older:
        problem = integrity.verify_checkpoint(ckpt)
        if problem is None:
            if identity is not None:
                check_identity(ckpt, identity)
            if named is None:
                log(f"[resume] {output_dir} has no `latest`: {os.path.basename(ckpt)} is its newest intact "
                    "checkpoint (by the manifests)")
            return ckpt
        log(f"[resume] {os.path.basename(ckpt)} is damaged ({problem}): skipping it")
    first = os.path.basename(named or checkpoints[-1])
    raise CheckpointError(f"{output_dir} holds no intact checkpoint ({first} and older ones are damaged or "
                          "missing): pass --no_resume to start afresh there, or use another --output_dir")


def load_checkpoint(accelerator, ckpt):
    """Restore save_checkpoint's (RNG states checked); returns (trainer state dict, tensors or None)."""
    try:
        accelerator.load_state(ckpt)
    except Exception as e:  # a checkpoint from before manifests can still be damaged
        raise CheckpointError(f"{ckpt} could not be loaded ({type(e).__name__}: {str(e)[:200]}): pass "
                              "--no_resume to start afresh, or delete it to resume from an older one") from e
    integrity.check_rng_restored(ckpt, accelerator)
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        state = json.load(f)
    path = os.path.join(ckpt, "tensors.pt")
    tensors = integrity.load_plain(path, map_location=accelerator.device) if os.path.exists(path) else None
    return state, tensors
