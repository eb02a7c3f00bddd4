"""User code (a --reward_fn file's function, an --env) runs in worker processes, never the trainer's: whatever
it does (reseed random, chdir, exit, crash, hang, leak memory, leave a thread spinning, start children) is at
most that call's failure, and the worker is replaced.

    pool = Workers({"env": (load_env, "calculator")}, size=4, timeout=60, seed=args.seed, rank=rank)
    pool.call("env", "reset", (sample,))                # one call: its result, or it raises
    pool.map("env", "step", [(state, text), ...])       # spread over the workers: (ok, value) each

A worker (`python -m rft_core.workers FD`: no torch, ~0.15 s to start) has its own session, talks pickles over
a socket, and seeds random (numpy, torch) from (seed, rank, call number) before each call. Its group dies with
the pool or the trainer, by any path (within a second). An awaitable result (`async def`) is awaited on the
worker's event loop, cancelled at its timeout, `concurrency` at once over the pool (sync: one per worker);
its seeded random holds until its first await (seed a random.Random of your own for timing-free numbers).
"""

import asyncio
import collections
import contextlib
import importlib.util
import inspect
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from rft_core.errors import ConfigError, MissingPath, UserError

LEAK_BYTES = 1 << 30  # a worker whose resident memory grew this much since it started is replaced
BUSY_SHARE, BUSY_MIN_S = 0.5, 1.0  # ... and one that used this share of a CPU while idle (at least this long)
START_S = 120.0  # seconds a worker may take to load the user's file, at least (heavy imports take a while)
GRACE_S = 2.0  # an async call not cancelled this long past its timeout (its event loop blocked): killed


class UserCodeError(Exception):
    """What user code raised in its worker, read as the original (RuntimeError('boom')); `kind`: its type's
    name, `line`: its file's line, `interrupt`: no Exception (sys.exit...: user code cannot end the run)."""

    def __init__(self, what, kind, line=None, interrupt=False):
        super().__init__(what)
        self.kind, self.line, self.interrupt = kind, line, interrupt

    def __repr__(self):
        return self.args[0]


class WorkerLost(ChildProcessError):
    """The worker running a call ended during it (os._exit, a crash, the out-of-memory killer)."""


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    rss: int = 0  # resident bytes once it had loaded its targets


class Workers:
    """`size` workers building targets {name: (loader, spec)} as loader(spec) (a module-level function, no
    torch); a failed load raises here. concurrency: calls in flight at most (0: size)."""

    def __init__(self, targets, size=1, timeout=60.0, seed=0, rank=0, log=print, concurrency=0):
        self.targets, self.timeout, self.seed, self.rank, self.log = targets, timeout, seed, rank, log
        self.procs = [None] * size  # a _Worker, or None: stopped (started again at its next call)
        self.calls, self.restarts = 0, collections.Counter()
        self.cap = concurrency or size
        self.retiring, self.concurrent = {}, {}  # retiring: {worker: (kind, why)}, stopped once idle
        self.close = weakref.finalize(self, _stop_all, self.procs, os.getpid())  # also at exit
        try:
            for i in range(size):
                self._spawn(i)
            for i in range(size):
                self._ready(i)
        except BaseException:
            self.close()
            raise

    def _spawn(self, i):
        ours, theirs = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where rft_core is
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        with theirs:  # the worker's stdout is the run's stderr: the step lines stay apart from its prints
            proc = subprocess.Popen([sys.executable, "-m", "rft_core.workers", str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()], start_new_session=True, stdout=2,
                                    stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})
        self.procs[i] = _Worker(proc, Connection(ours.detach()))
        self.procs[i].conn.send((self.targets, self.seed, self.rank))

    def _ready(self, i):
        """Wait for worker i to build the targets; what failed there is raised here."""
        worker, named, limit = self.procs[i], self._named(), max(self.timeout, START_S)
        if not worker.conn.poll(limit):
            raise ConfigError(f"{named}: loading it took longer than {limit} s")
        try:
            reply = worker.conn.recv()
        except EOFError:
            status = _status(worker.proc)
            raise ConfigError(f"{named}: loading it ended its worker process ({status})") from None
        if reply[0] == "error":
            raise reply[1]
        worker.rss, self.concurrent = reply[1:]

    def call(self, name, method, args, timeout=None):
        """Target `name`'s `method` (None: itself) on args in a worker: its result; map's error raised."""
        (ok, value), = self.map(name, method, [args], timeout)
        if not ok:
            raise value
        return value

    def map(self, name, method, calls, timeout=None):
        """Each call (a tuple of arguments) run in a worker: per call (True, result) or (False, error): a
        UserCodeError, TimeoutError, WorkerLost or pickle.PicklingError (could not cross processes)."""
        timeout = self.timeout if timeout is None else timeout
        awaited = method in self.concurrent.get(name, ())  # cancelled in its worker; GRACE_S later, killed
        each = -(-self.cap // len(self.procs)) if awaited else 1  # calls in a worker at once
        results, todo = [None] * len(calls), collections.deque(range(len(calls)))
        running = {}  # call number: (its index in calls, worker, deadline)
        try:
            while todo or running:
                for i in [i for i in range(len(self.procs)) if i not in self.retiring]:
                    load = sum(w == i for _, w, _ in running.values())
                    for _ in range(min(each - load, self.cap - len(running), len(todo))):
                        k = todo.popleft()  # worker i takes the next call
                        if not (error := self._send(i, (name, method, calls[k], timeout))):
                            running[self.calls] = (k, i, time.monotonic() + timeout + GRACE_S * awaited)
                            continue
                        results[k] = (False, error)
                        if self.procs[i] is None:  # it ended, with the calls it was running
                            self._drop(i, running, results, error)
                if running:
                    self._collect(running, results, timeout)
        except BaseException:  # a real Ctrl-C while waiting: the calls under way are stopped
            for i in {w for _, w, _ in running.values()}:
                self._stop(i)
            raise
        return results

    def _send(self, i, message):
        """Start a call in worker i (started afresh if it was stopped); the call's error if not sent."""
        if self.procs[i] is None:
            try:
                self._spawn(i)
                self._ready(i)
            except BaseException:
                self._stop(i)
                raise
        self.calls += 1
        try:
            self.procs[i].conn.send((*message, self.calls))
        except OSError:
            return self._lost(i)
        except Exception as e:  # it did not pickle: nothing was sent
            return pickle.PicklingError(f"its arguments do not pickle (they go to a worker process): {e!r}")

    def _collect(self, running, results, timeout):
        """Wait for a call's end or deadline; take in results; stop workers past deadlines, retiring idle."""
        ends = min(deadline for _, _, deadline in running.values())
        busy = {i for _, i, _ in running.values()}
        ready = wait([self.procs[i].conn for i in busy], max(0.0, ends - time.monotonic()))
        for i in busy:
            if self.procs[i].conn in ready:
                self._receive(i, running, results)
        for _, i, deadline in list(running.values()):
            if time.monotonic() >= deadline and self.procs[i] is not None:
                self._stop(i, "timeout", f"a call ran past --call_timeout {timeout} s")
                self._drop(i, running, results, TimeoutError(
                    f"no result within --call_timeout {timeout} s: the call was stopped (its worker process "
                    "killed, a new one started)"))
        for i, (kind, why) in list(self.retiring.items()):
            if all(w != i for _, w, _ in running.values()):
                self._stop(i, kind, why)

    def _receive(self, i, running, results):
        """Take in a call's outcome; a worker grown LEAK_BYTES or burning CPU idle retires (replaced idle)."""
        worker = self.procs[i]
        try:
            number, (cpu, idle, rss), reply = worker.conn.recv()  # CPU and wall s idle, resident bytes
        except EOFError:
            return self._drop(i, running, results, self._lost(i))
        k, _, _ = running.pop(number)
        try:
            reply = pickle.loads(reply)
        except Exception as e:  # a result of a class only the user's file defines
            reply = ("error", pickle.PicklingError(f"its result cannot be read outside its worker: {e!r}; "
                                                   "return built-in types (numbers, strings, lists, dicts)"))
        if rss > worker.rss + LEAK_BYTES:
            self.retiring[i] = ("memory", f"a worker's memory grew to {rss / 2**30:.2f} GiB, by "
                                          f"{(rss - worker.rss) / 2**30:.2f} GiB since it started (a leak in "
                                          f"{self._named()}?)")
        elif cpu > max(BUSY_MIN_S, BUSY_SHARE * idle):
            self.retiring[i] = ("busy", f"a worker used {cpu:.1f} s of CPU in {idle:.1f} s between calls (a "
                                        f"thread of {self._named()} left running?)")
        results[k] = (reply[0] == "ok", UserCodeError(*reply[1:]) if reply[0] == "raised" else reply[1])

    def _drop(self, i, running, results, error):
        for number, (k, w, _) in list(running.items()):
            if w == i:
                del running[number]
                results[k] = (False, error)

    def _lost(self, i):
        status = _status(self.procs[i].proc)
        self._stop(i, "ended", f"a worker process ended during a call ({status})")
        return WorkerLost(f"its worker process ended during the call ({status}: os._exit, a crash or the "
                          "out-of-memory killer?); a new one takes its place")

    def _stop(self, i, kind=None, why=None):
        """Kill worker i and what it started (restarted at its next call); count a `kind`, say `why` once."""
        _kill(self.procs, i)
        self.retiring.pop(i, None)
        if kind:
            self.restarts[kind] += 1
            if self.restarts[kind] == 1:
                self.log(f"[workers] {why}: killed with whatever it started; a new worker takes its place "
                         "(said once per kind)")

    def _named(self):
        return " / ".join(f"--{name} {spec!r}" for name, (_, spec) in self.targets.items())


def _status(proc):
    """How a worker whose connection closed ended: its exit status, or the signal that killed it."""
    try:
        code = proc.wait(timeout=1)
    except subprocess.TimeoutExpired:
        return "it closed its connection"
    return f"killed by signal {-code} ({signal.strsignal(-code)})" if code < 0 else f"exit status {code}"


def _kill(procs, i):
    if procs[i] is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(procs[i].proc.pid, signal.SIGKILL)  # its group: the worker and what it started
        procs[i].proc.wait()
        procs[i].conn.close()
        procs[i] = None


def _stop_all(procs, owner):
    if os.getpid() == owner:  # not in a forked copy of the trainer: the workers are not its own
        for i in range(len(procs)):
            _kill(procs, i)


def line_in(error, path):
    """The line of file `path` where `error` was raised (the innermost frame there), or None."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) == path]
    return error.lineno if isinstance(error, SyntaxError) else frames[-1].lineno if frames else None


def load_from_file(spec, flag, kind, builtins=(), owner="a file"):
    """What 'path/to/file.py:NAME' names (None if no NAME), the file imported as a module of its own with
    sys.argv [path]; what it raises is one line. kind, builtins, owner ("a reward file"...): for messages."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ConfigError(f"{flag} {spec!r}: expected path/to/file.py:{kind}"
                          + (f" or one of {builtins}" if builtins else ""))
    return getattr(load_module(path, spec, flag, owner), name, None)


def load_module(path, spec, flag, owner="a file"):
    """The file at `path` imported as a module of its own, sys.argv [path]; what it raises: one line."""
    if not os.path.isfile(path):
        raise MissingPath(f"{flag} {spec!r}: no such file {path!r}")
    module_spec = importlib.util.spec_from_file_location(f"user_module_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.argv = [path]
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:  # the user's file, whatever it raised: where in it, a line
        line = line_in(e, os.path.abspath(path))
        what = f"{type(e).__name__}: {e.msg if isinstance(e, SyntaxError) else e}"
        if not isinstance(e, Exception):  # sys.exit, KeyboardInterrupt...
            what = f"{e!r}: {owner} cannot end or interrupt the run (imported with sys.argv [{path!r}])"
        raise ConfigError(f"{flag} {spec!r}: loading {path} failed{f' (line {line})' if line else ''}: "
                          f"{what}") from None
    return module


def _seed(*key):
    """random, and numpy and torch where the user's code imported them, seeded from key."""
    random.seed(repr(key))  # a string seeds through SHA-512: the same in every process
    value = random.getrandbits(32)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(value)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(value)


def _rss():
    """Resident bytes, 0 without /proc (not ru_maxrss: the peak, the trainer's kept through fork, exec)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _watch(parent):
    """Once the trainer is gone (killed without closing its workers), the worker's group goes too."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)


def serve(fd):
    """A worker's life: build the first message's targets (reply ("ready", rss, {target: its async_methods})
    or ("error", the UserError)), then answer calls (_Calls) until the trainer closes the socket."""
    conn = Connection(fd)
    targets, seed, rank = conn.recv()
    threading.Thread(target=_watch, args=(os.getppid(),), daemon=True).start()
    _seed(seed, rank)
    try:
        built = {name: loader(spec) for name, (loader, spec) in targets.items()}
    except UserError as e:
        return conn.send(("error", e))
    concurrent = {name: getattr(target, "async_methods", []) for name, target in built.items()}
    conn.send(("ready", _rss(), concurrent))
    _Calls(conn, built, targets, seed, rank).serve()


class _Calls:
    """Answers (name, method, args, timeout, number) with (number, (CPU s, wall s idle before, RSS), pickled
    ("ok", value) / ("raised", what, kind, line, interrupt) / ("error", exception)). An awaitable becomes an
    event-loop task, run while waiting for calls; other calls run outside the loop (asyncio.run works)."""

    def __init__(self, conn, built, targets, seed, rank):
        self.conn, self.built, self.seed, self.rank = conn, built, seed, rank
        files = {name: spec.removeprefix("tools:") for name, (_, spec) in targets.items()}  # or FILE:NAME
        self.paths = {name: os.path.abspath(file.rpartition(":")[0] or file) for name, file in files.items()}
        self.loop, self.running = asyncio.new_event_loop(), set()
        self.idle = time.process_time(), time.monotonic()  # since when no call has run

    def serve(self):
        while True:
            if self.running:
                self.loop.run_until_complete(self._readable())
            try:
                name, method, args, timeout, number = self.conn.recv()
            except EOFError:
                return
            usage = (0.0, 0.0) if self.running else (time.process_time() - self.idle[0],
                                                     time.monotonic() - self.idle[1])
            _seed(self.seed, self.rank, number)
            try:
                value = (self.built[name] if method is None else getattr(self.built[name], method))(*args)
                outcome = ("ok", value)
            except BaseException as e:  # the user's, whatever it is (sys.exit too): that call's failure
                outcome = self._raised(e, name)
            if outcome[0] == "ok" and inspect.isawaitable(value):
                self.running.add(self.loop.create_task(self._awaited(value, name, number, timeout, usage)))
            else:
                self._answer(number, usage, outcome)

    def _answer(self, number, usage, outcome):
        try:
            outcome = pickle.dumps(outcome)
        except Exception as e:  # what the trainer reads as PicklingError('its result does not pickle...')
            error = pickle.PicklingError(f"its result does not pickle (it comes back from a worker): {e!r}")
            outcome = pickle.dumps(("raised", repr(error), "PicklingError", None, False))
        self.conn.send((number, (*usage, _rss()), outcome))
        if not self.running:
            self.idle = time.process_time(), time.monotonic()

    def _raised(self, e, name):
        return "raised", repr(e), type(e).__name__, line_in(e, self.paths[name]), not isinstance(e, Exception)

    async def _awaited(self, value, name, number, timeout, usage):
        _seed(self.seed, self.rank, number)  # again: the call's code starts now
        limit = asyncio.timeout(timeout)
        try:
            async with limit:
                outcome = ("ok", await value)
        except BaseException as e:  # the user's, whatever it is (sys.exit too): that call's failure
            outcome = self._raised(e, name) if not limit.expired() else ("error", TimeoutError(
                f"no result within --call_timeout {timeout} s: the call was cancelled in its worker"))
        self.running.discard(asyncio.current_task())
        self._answer(number, usage, outcome)

    async def _readable(self):  # the tasks run until the next call comes
        ready, fd = self.loop.create_future(), self.conn.fileno()
        self.loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            self.loop.remove_reader(fd)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
