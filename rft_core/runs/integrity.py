"""Files of the output directory written whole and read back checked. A checkpoint's `manifest.json` holds
every file's size and SHA-256 (~750 MB/s a core, in parallel; integrity, not authenticity) for
`verify_checkpoint`; pickles load as plain data only (`load_plain`); metrics.jsonl rows are appended whole
(`append`) and a cut one dropped when read (`read_rows`); a full disk is said as such (`write_error`)."""

import contextlib
import errno
import hashlib
import json
import os
import pickle
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from rft_core.errors import CheckpointError, ConfigError

MANIFEST = "manifest.json"
_written = {}  # checkpoint -> its manifest's mtime: written whole by this process, not hashed again


def size_text(size):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / 2**shift:.1f} {unit}"
    return f"{size} bytes"


def is_full(error, directory):
    """Whether error (raised writing into directory; torch's writer says only `iostream error`) came from a
    full disk or quota: ENOSPC / EDQUOT in its chain (or in its text: safetensors'), or under 64 MiB left."""
    for _ in range(8):  # the error and what caused it
        if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or re.search(
                rf"os error ({errno.ENOSPC}|{errno.EDQUOT})\b", str(error)):  # (safetensors' Rust error)
            return True
        error = error and (error.__cause__ or error.__context__)
    with contextlib.suppress(OSError):
        return shutil.disk_usage(directory).free < 64 << 20
    return False


def write_error(error, directory):
    """What went wrong writing into directory, in words: `no space left on <dir> (N free)`, or the error."""
    if is_full(error, directory):
        with contextlib.suppress(OSError):
            return f"no space left on {directory} ({size_text(shutil.disk_usage(directory).free)} free)"
        return f"no space left on {directory}"
    return f"{type(error).__name__}: {error}"


def write_whole(path, data, mode=None):
    """Replace path by data (text or bytes) via a synced path.tmp renamed over it: never half-written."""
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    with open(fd, "wb") as f:
        if mode is not None:
            os.fchmod(fd, mode)
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(fd)
    os.replace(path + ".tmp", path)


def replace_dir(tmp, final):
    """Rename the synced directory tmp to final (an older one via final.old): a kill never leaves half."""
    for root, _, names in os.walk(tmp):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    if os.path.exists(final):
        shutil.rmtree(final + ".old", ignore_errors=True)
        os.rename(final, final + ".old")
    os.rename(tmp, final)
    shutil.rmtree(final + ".old", ignore_errors=True)


def nbytes(tensors):
    """The bytes of the tensors in a (nested) dict, list or tuple: what torch.save will need, about."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return sum(map(nbytes, values)) if isinstance(tensors, (dict, list, tuple)) else 0


def _write(path, text):
    with open(path, "a") as f:
        f.write(text)


def append(path, text, what):
    """Append text to path whole or not at all: a failed write (a full disk) is cut back and said."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        _write(path, text)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise ConfigError(f"{write_error(e, os.path.dirname(path))}: {what} could not be appended to {path} "
                          "(cut back to its last whole row); free space there and rerun the same command to "
                          "resume from the newest checkpoint") from e


def read_rows(path, log=None):
    """(rows, their lines as bytes) of a metrics.jsonl; a line that does not parse is dropped, said (log)."""
    rows, lines, bad = [], [], []
    if not os.path.exists(path):
        return rows, lines
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                step = row["step"] if line.strip() else None
            except (ValueError, KeyError, TypeError):
                bad.append(number)
                continue
            if isinstance(step, int):
                rows.append(row)
                lines.append(line if line.endswith(b"\n") else line + b"\n")
    if bad and log:
        last = "its last line is cut" if bad == [number] else f"lines {bad} are unreadable"
        log(f"[resume] {path}: {last} (a write interrupted, e.g. by a full disk): dropped")
    return rows, lines


def _sha256_all(paths):
    """Each file's SHA-256, several at once (hashlib lets go of the GIL: sharded states hash in parallel)."""
    def sha256(path):
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256, paths))


def mark_written(ckpt):
    path = os.path.join(ckpt, MANIFEST)
    if os.path.exists(path):  # (a rank on another node may not see it)
        _written[ckpt] = os.stat(path).st_mtime_ns


def manifest(ckpt):
    """{file: {"bytes": size, "sha256": digest}} of a checkpoint directory (its manifest left out)."""
    found = (os.path.join(root, name) for root, _, names in os.walk(ckpt) for name in names)
    rels = sorted(rel for rel in (os.path.relpath(path, ckpt) for path in found) if rel != MANIFEST)
    paths = [os.path.join(ckpt, rel) for rel in rels]
    return {rel: {"bytes": os.path.getsize(path), "sha256": digest}
            for rel, path, digest in zip(rels, paths, _sha256_all(paths))}


def verify_checkpoint(ckpt):
    """None if the checkpoint is whole, else what is wrong: a file missing, or of another size or SHA-256
    (no manifest: trainer_state.json must read). One this process wrote is not hashed again."""
    if not os.path.isdir(ckpt):
        return "missing"
    path = os.path.join(ckpt, MANIFEST)
    if os.path.exists(path) and _written.get(ckpt) == os.stat(path).st_mtime_ns:
        return None
    name = MANIFEST if os.path.exists(path) else "trainer_state.json"
    try:
        with open(os.path.join(ckpt, name)) as f:
            files = json.load(f)
    except (OSError, ValueError) as e:
        return f"{name} unreadable ({e})"
    if name != MANIFEST:
        return None
    for rel, want in files.items():
        file = os.path.join(ckpt, rel)
        if not os.path.isfile(file):
            return f"{rel} is missing"
        if os.path.getsize(file) != want["bytes"]:
            return f"{rel} has {os.path.getsize(file)} bytes, {want['bytes']} when written"
    hashed = [rel for rel, want in files.items() if "sha256" in want]
    for rel, digest in zip(hashed, _sha256_all([os.path.join(ckpt, rel) for rel in hashed])):
        if digest != files[rel]["sha256"]:
            return f"{rel} changed since it was written (SHA-256)"
    return None


def load_plain(path, **kwargs):
    """torch.load(path, weights_only=True) whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says (accelerate's load
    adds an RNG state's numpy types); a file holding more, or unreadable, is a CheckpointError."""
    from accelerate.utils import load

    try:
        return load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:  # weights_only's refusal
        said = f"it holds more than tensors and plain data: {str(e).splitlines()[0][:150]}"
    except (RuntimeError, EOFError) as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        said = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
    raise CheckpointError(f"{path} was refused by torch.load(weights_only=True) ({said}): this trainer does "
                          "not write such a file; delete its checkpoint to resume from an older one, or pass "
                          "--no_resume")


def check_rng_restored(ckpt, accelerator):
    """Refuse a checkpoint whose RNG states load_state did not restore (accelerate skips a failing one at
    info level, and the resumed run would not repeat the uninterrupted one): compared with random_states."""
    path = os.path.join(ckpt, f"random_states_{accelerator.process_index}.pkl")
    if not os.path.exists(path):
        problem = "its file is missing"
    else:
        saved = load_plain(path)
        now = {"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
               "torch_manual_seed": torch.get_rng_state()}
        if torch.cuda.is_available() and "torch_cuda_manual_seed" in saved:
            now["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
        problem = next((f"{key} differs" for key in now if not _same(saved.get(key), now[key])), None)
    if problem:
        raise CheckpointError(f"{path}: the RNG state was not restored ({problem}), so the resumed run "
                              "would not repeat the uninterrupted one: delete that checkpoint to resume from "
                              "an older one, or pass --no_resume")


def _same(a, b):
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (torch.Tensor, np.ndarray)) or isinstance(b, (torch.Tensor, np.ndarray)):
        return a is not None and b is not None and np.array_equal(np.asarray(a), np.asarray(b))
    return a == b
