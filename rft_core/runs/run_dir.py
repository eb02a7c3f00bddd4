"""The output directory: one run at a time (`run.lock` names its holder), a killed run's leftovers cleaned up,
no credential written. A dead holder's lock is taken over: on this host once its pid is gone, from another
once its heartbeat stays still for WATCH_S on this host's monotonic clock (two hosts' clocks are never
compared: one running ahead took a live lock). A new run over a previous run's steps is refused unless
--no_resume, which moves it into previous-N/ (so `latest`, pruning and metrics.jsonl never mix two runs)."""

import atexit
import contextlib
import json
import os
import re
import shutil
import socket
import sys
import threading
import time

from rft_core.errors import ConfigError, UserError

LOCK, FINISHED = "run.lock", "finished.json"
HEARTBEAT_S, WATCH_S = 10, 60  # a live run touches its lock every HEARTBEAT_S; one still for WATCH_S is dead
# what a run writes at the top of its output directory, moved together into previous-N/
RUN_FILES = ("config.json", "metrics.jsonl", "samples.jsonl", "curves.png", "gen_len.png", "latest", "model",
             "ema_model", FINISHED)
RUN_DIRS = re.compile(r"(checkpoint|hf-step)-\d+")
LEFTOVER = re.compile(r".+\.(tmp|old)")  # what a killed writer leaves aside
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
_held = set()  # output directories (absolute) whose lock this process holds
_dead = {}  # lock path -> its beat when watched and found still: not watched again while unchanged


def redact(value):
    """value (a string, or nested dicts, lists, tuples of them) with URLs' passwords and queries as ***."""
    if isinstance(value, dict):
        return {key: redact(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return _URL.sub(_hide, value) if isinstance(value, str) else value


def _hide(match):
    head, mark, query = re.sub(r"^([^:]+://)[^/?#]*@", r"\1***@", match.group()).partition("?")
    return head + mark + re.sub(r"=[^&#]*", "=***", query)


class Redacting:
    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        return self.stream.write(redact(text))

    def __getattr__(self, name):  # flush, fileno, isatty...
        return getattr(self.stream, name)


def redact_output():
    """Hide credentials on sys.stdout / stderr; again once wandb started (it copies the stream it found)."""
    sys.stdout, sys.stderr = Redacting(sys.stdout), Redacting(sys.stderr)


def on_main(accelerator, fn):
    """fn() on the main process alone, its result (or the UserError it raised) shared with every rank."""
    error, result = None, None
    if accelerator is None or accelerator.is_main_process:
        try:
            result = fn()
        except UserError as e:
            error = e
    if getattr(accelerator, "num_processes", 1) > 1:
        from accelerate.utils import broadcast_object_list

        box = [(result, None if error is None else (type(error), str(error)))]
        broadcast_object_list(box)
        result, said = box[0]
        error = error or (said and said[0](said[1]))
    if error:
        raise error
    return result


def _start_ticks(pid):
    """When the process started (clock ticks after boot; None without /proc): tells a reused pid apart."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    return None


def _read_lock(path):
    """(holder's record, beat), or None without a lock; one being written or unreadable reads as {}."""
    holder = {}
    try:
        with contextlib.suppress(PermissionError, ValueError), open(path) as f:  # (revalidates NFS's mtime)
            holder = json.load(f)
        beat = os.stat(path)
    except FileNotFoundError:
        return None
    return (holder if isinstance(holder, dict) else {}), (beat.st_ino, beat.st_mtime_ns, beat.st_size)


def _mine(holder):
    return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


def _alive(path, holder, beat, log):
    """Whether the holder may run: on this host, its pid and start time; elsewhere, its beat over WATCH_S."""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, another user's
            pass
        start = _start_ticks(holder["pid"])
        return None in (start, holder.get("start")) or start == holder["start"]
    if _dead.get(path) == beat:
        return False
    log(f"[output] {path} is held by a run of another host ({_who(holder)}): watching its heartbeat for "
        f"{WATCH_S:g} s to tell whether that run is alive")
    end = time.monotonic() + WATCH_S
    while time.monotonic() < end:
        time.sleep(min(1.0, WATCH_S / 10))
        found = _read_lock(path)
        if found is None or found[1] != beat:
            return found is not None  # it beats; or it was released meanwhile
    _dead[path] = beat
    return False


def _who(holder):
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')}: "
            f"{str(holder.get('command', '?'))[:120]}")


def _refuse_busy(output_dir, found, log):
    path = os.path.join(output_dir, LOCK)
    if found is None or _mine(found[0]) or not _alive(path, *found, log):
        return
    raise ConfigError(f"--output_dir {output_dir} is in use by another run ({_who(found[0])}): wait for it "
                      f"to end or use another --output_dir (if that run is gone, delete {path})")


def check_free(output_dir, log=print):
    """Refuse a directory another live run holds; else clean_leftovers (checkpoints are then whole)."""
    _refuse_busy(output_dir, _read_lock(os.path.join(output_dir, LOCK)), log)
    clean_leftovers(output_dir, log)


def take_lock(output_dir, log=print):
    """Hold output_dir's lock until exit (a live holder refused, a dead one's taken over); clean_leftovers."""
    path = os.path.join(output_dir, LOCK)
    os.makedirs(output_dir, exist_ok=True)
    if not any(_acquire(path, output_dir, log) for _ in range(5)):  # (any stops at the first that holds it)
        raise ConfigError(f"--output_dir {output_dir}: its lock {path} keeps changing hands; use another "
                          "--output_dir")
    if not _held:
        threading.Thread(target=_heartbeat, daemon=True, name="run.lock heartbeat").start()
    _held.add(os.path.abspath(output_dir))
    atexit.register(release_lock, output_dir)
    clean_leftovers(output_dir, log)


def _acquire(path, output_dir, log):
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        found = _read_lock(path)
        if found is None or _mine(found[0]):  # released meanwhile; or held already (a second record)
            return found is not None
        _refuse_busy(output_dir, found, log)
        aside = f"{path}.stale-{os.getpid()}"  # taken over by a rename: only one taker gets the dead lock
        try:
            os.replace(path, aside)
        except FileNotFoundError:
            return False
        if (_read_lock(aside) or ({},))[0] != found[0]:  # another taker's fresh lock: put it back
            os.replace(aside, path)
            return False
        os.remove(aside)
        log(f"[output] {path}: its run ({_who(found[0])}) is gone; this run takes it over")
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "start": _start_ticks(os.getpid()),
                   "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": redact(" ".join(sys.argv))}, f)
    return True


def _heartbeat():
    while True:
        time.sleep(HEARTBEAT_S)
        for output_dir in list(_held):
            with contextlib.suppress(OSError):
                os.utime(os.path.join(output_dir, LOCK))


def release_lock(output_dir):
    _held.discard(os.path.abspath(output_dir))
    path = os.path.join(output_dir, LOCK)
    found = _read_lock(path)
    if found is not None and _mine(found[0]):
        with contextlib.suppress(OSError):
            os.remove(path)


def clean_leftovers(output_dir, log=print):
    """Remove what a killed writer left aside (LEFTOVER), said; a cut --no_resume's is moved back."""
    if not os.path.isdir(output_dir):
        return
    removed = []
    for name in sorted(n for n in os.listdir(output_dir) if LEFTOVER.fullmatch(n)):
        path = os.path.join(output_dir, name)
        if re.fullmatch(r"previous-\d+\.tmp", name):
            _move_back(output_dir, path, log)
        elif os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
            removed.append(name + "/")
        else:
            os.remove(path)
            removed.append(name)
    if removed:
        log(f"[output] {output_dir}: removed what a killed run left half-written: {', '.join(removed)}")


def _move_back(output_dir, aside, log):
    """Undo move_previous's first half (entries whose name was taken since go to the next previous-N/)."""
    for name in os.listdir(aside):
        if not os.path.exists(os.path.join(output_dir, name)):
            os.rename(os.path.join(aside, name), os.path.join(output_dir, name))
    named = os.listdir(aside) and _previous_dir(output_dir)
    if named:
        os.rename(aside, named)
    else:
        os.rmdir(aside)
    log(f"[output] {aside}/: a --no_resume stopped while moving the previous run aside; its files are back "
        f"in {output_dir}{f' (but those now in {named}/)' if named else ''}")


def finished_step(output_dir):
    """The last step whose exports are whole in output_dir (FINISHED, written after them), or None."""
    with (contextlib.suppress(OSError, ValueError, KeyError, TypeError),
          open(os.path.join(output_dir, FINISHED)) as f):
        return json.load(f)["step"]
    return None


def previous_run(output_dir, rows):
    """(a previous run's leftovers in words, its entries, whether it finished); None if it trained no step."""
    if not os.path.isdir(output_dir):
        return None
    names = sorted(n for n in os.listdir(output_dir) if n in RUN_FILES or RUN_DIRS.fullmatch(n))
    kept = [n for n in names if os.path.isdir(os.path.join(output_dir, n))]
    step = max((row["step"] for row in rows if "train/policy_loss" in row or "rollout/reward_mean" in row),
               default=0)
    if not step and not kept:
        return None
    parts = ([f"metrics.jsonl to step {step}"] if step else []) + [f"{n}/" for n in kept[:4]]
    parts += [f"{len(kept) - 4} more directories"] if len(kept) > 4 else []
    return ", ".join(parts), names, "model" in names


def _previous_dir(output_dir):
    numbers = [int(m.group(1)) for n in os.listdir(output_dir) if (m := re.fullmatch(r"previous-(\d+)", n))]
    return os.path.join(output_dir, f"previous-{max(numbers, default=0) + 1}")


def refuse_overwrite(output_dir, found):
    what = "a finished run" if found[2] else "a run that left no checkpoint to resume"
    raise ConfigError(f"--output_dir {output_dir} holds {what} ({found[0]}): pass --no_resume to start a "
                      f"new run there (that one moves to {_previous_dir(output_dir)}/), or use another "
                      "--output_dir")


def move_previous(output_dir, found, log=print):
    """previous_run's entries into previous-N/ via previous-N.tmp/ (a kill between: clean_leftovers)."""
    target = _previous_dir(output_dir)
    os.makedirs(target + ".tmp")
    for name in found[1]:
        os.rename(os.path.join(output_dir, name), os.path.join(target + ".tmp", name))
    os.rename(target + ".tmp", target)
    log(f"[output] --no_resume: the previous run ({found[0]}) moved from {output_dir} to {target}/")


def _flat(config, prefix=""):
    out = {}
    for key, value in config.items():
        nested = isinstance(value, dict) and value
        out.update(_flat(value, f"{prefix}{key}.") if nested else {prefix + key: value})
    return out


def with_segments(path, config, step, log):
    """config with "resumed": config.json's list plus {"step", "changed": {key: [before, now]}}, the changed
    flags said; an attempt that trained nothing (an entry at the same step) gives way to this one."""
    old = None
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        old = json.load(f)
    if not isinstance(old, dict):
        return {**config, "resumed": [{"step": step, "changed": None}]}  # (config.json lost: unknown)
    resumed, before = old.pop("resumed", []), _flat(old)
    if resumed and resumed[-1]["step"] == step:  # the last segment is what ran before that attempt
        before.update({k: v[0] for k, v in (resumed.pop()["changed"] or {}).items()})
    now = _flat(json.loads(json.dumps(config)))  # as JSON holds it (tuples as lists)
    changed = {k: [before.get(k), now.get(k)] for k in sorted(before.keys() | now.keys())
               if before.get(k) != now.get(k) and k != "no_resume"}  # (how a segment starts, no setting)
    flags = [f"{k} {v[0]!r} -> {v[1]!r}" for k, v in changed.items() if "." not in k]
    plan = len(changed) - len(flags)
    if changed:
        log(f"[resume] changed since step {step}: {'; '.join(flags) or 'no flag'}"
            f"{f' (and {plan} plan values)' if plan else ''}; config.json keeps the earlier values under "
            "\"resumed\"")
    return {**config, "resumed": [*resumed, {"step": step, "changed": changed}]}
