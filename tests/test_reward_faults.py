"""Reward code is user code and a reward server is someone else's: whatever they do (exit, interrupt, mutate
their inputs, reseed, change directory, hang, start children, answer HTTP 500 or HTML, redirect) ends as the
reward's failure, named in one line, quickly, and leaves the trainer as it was; a real Ctrl-C stays the
user's."""

import http.server
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import run_script

from rft_core.errors import ConfigError, RewardError
from rft_core.experience import Sample
from rft_core.reward_sources import load_reward_fn, remote_reward_fn
from rft_core.rewards import RewardScorer, ServiceDown, math_reward, score

TINY = ["--max_steps", "2", "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
        "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4", "--generate_max_len", "8"]

REWARDS = '''import os, random, subprocess, sys, time
def exit0(p, c, l, **kw):
    sys.exit(0)
def exit3(p, c, l, **kw):
    sys.exit(3)
def interrupt(p, c, l, **kw):
    raise KeyboardInterrupt
def generator_exit(p, c, l, **kw):
    raise GeneratorExit("closed")
def pops(p, c, l, **kw):
    c.pop()
    return [1.0] * len(c)
def sleeps(p, c, l, **kw):
    time.sleep(2)
    return [1.0] * len(c)
def reseeds(p, c, l, **kw):
    import numpy as np
    random.seed(0)
    np.random.seed(0)
    return [random.random() for _ in c]
def chdir(p, c, l, **kw):
    here = os.path.exists("marker")
    os.chdir("/")
    return [float(here)] * len(c)
def os_exit(p, c, l, **kw):
    if "exit" in c:
        os._exit(0)
    return [float(os.getpid())] * len(c)
def late(p, c, l, **kw):
    if "slow" in c:
        time.sleep(0.3)
        open(l[0], "w").close()
    return [float(os.getpid())] * len(c)
def child(p, c, l, **kw):
    return [float(subprocess.Popen(["sleep", "30"]).pid)] * len(c)
'''


def samples(*completions):
    return [Sample([1], "x", "p", completion=c) for c in completions]


@pytest.fixture(scope="module")
def rewards(tmp_path_factory):
    """The REWARDS file's functions by name, each in a worker process of its own (started once)."""
    path = tmp_path_factory.mktemp("rewards") / "rw.py"
    path.write_text(REWARDS)
    loaded = {}

    def reward(name, timeout=5.0):
        if name not in loaded:
            loaded[name] = load_reward_fn(f"{path}:{name}", timeout=timeout)
        return loaded[name]
    yield reward
    for fn in loaded.values():
        fn.workers.close()


@pytest.mark.parametrize("name, raised, line", [("exit0", "SystemExit(0)", 3), ("exit3", "SystemExit(3)", 5),
                                                ("interrupt", "KeyboardInterrupt()", 7),
                                                ("generator_exit", "GeneratorExit('closed')", 9)])
def test_whatever_a_reward_raises_is_its_failure_named(tmp_path, name, raised, line):
    """sys.exit(0) / sys.exit(3) / KeyboardInterrupt / GeneratorExit raised by the reward: its samples fail,
    each message names the exception, the function, its file and line (it was exit 0 or 3 without a word, or
    'interrupted: rerun to resume')."""
    path = tmp_path / "rw.py"
    path.write_text(REWARDS)
    said = []
    scorer = RewardScorer([("rule", load_reward_fn(f"{path}:{name}"))], log=said.append)
    assert scorer(samples("a", "b")) == 2
    want = f"{raised} raised by {name} in {path} line {line}: a reward function returns its values"
    assert len(said) == 1 and want in said[0]
    with pytest.raises(RewardError, match=re.escape(want)):
        scorer.check(2, 2, 1)
    _, _, failures = score(scorer.sources[0][1], ["p"], ["a"], ["l"])  # one sample: the same
    assert failures == [(0, failures[0][1])] and want in failures[0][1]


def test_a_real_ctrl_c_during_a_reward_call_is_still_the_users(tmp_path):
    """SIGINT delivered to the process while the reward runs interrupts the run as before (a KeyboardInterrupt
    in the main thread), unlike a KeyboardInterrupt the reward raises."""
    (tmp_path / "rw.py").write_text(REWARDS)
    scorer = RewardScorer([("rule", load_reward_fn(f"{tmp_path}/rw.py:sleeps"))])
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            scorer(samples("a"))
        assert time.perf_counter() - start < 1.5  # at once, not after the reward's 2 s
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_reward_that_reseeds_leaves_the_trainers_random_streams(rewards):
    """random.seed(0) / np.random.seed(0) in the reward changed the trainer's streams (then --seed 0 and
    --seed 1 sampled alike from step 2); in its worker they are the worker's, seeded from the run's seed."""
    random.seed(1)
    np.random.seed(1)
    want = random.random(), np.random.rand()
    random.seed(1)
    np.random.seed(1)
    rewards_, _, failures = score(rewards("reseeds"), ["p"] * 2, ["a", "b"], ["l"] * 2)
    assert failures == [] and (random.random(), np.random.rand()) == want
    seeded = random.Random(0)
    assert rewards_ == [seeded.random(), seeded.random()]  # it ran, reseeded, in the worker


def test_a_reward_that_changes_directory_leaves_the_trainers(rewards, tmp_path, monkeypatch):
    """os.chdir in the reward moved the trainer (its next metrics write failed with a wrong error); a worker
    starts in the trainer's directory and keeps its own."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "marker").write_text("")
    reward = load_reward_fn(f"{rewards('chdir').path}:chdir")  # started here
    assert score(reward, ["p"], ["a"], ["l"])[0] == [1.0] and os.getcwd() == str(tmp_path)
    reward.workers.close()


def test_a_reward_that_ends_its_process_fails_its_batch_and_the_run_goes_on(rewards):
    """os._exit(0) in the reward ended the run with status 0 mid-step, without a word: now the batch fails,
    named, not retried sample by sample, and the next call runs in a new worker."""
    before = score(rewards("os_exit"), ["p"], ["a"], ["l"])[0]
    out, _, failures = score(rewards("os_exit"), ["p"] * 3, ["a", "exit", "b"], ["l"] * 3, fallback=-1.0)
    assert out == [-1.0] * 3 and len(failures) == 3
    assert "WorkerLost('its worker process ended during the call (exit status 0" in failures[0][1]
    after = score(rewards("os_exit"), ["p"], ["a"], ["l"])[0]
    assert after != before and rewards("os_exit").workers.restarts["ended"] == 1


def test_a_timed_out_reward_is_stopped(rewards, tmp_path):
    """A call past --call_timeout went on in its thread (here it would write a file 0.1 s later); now its
    worker is killed at the timeout and the next call runs in a new one."""
    mark = str(tmp_path / "written")
    first = score(rewards("late", timeout=0.2), ["p"], ["a"], [mark])[0]
    _, _, failures = score(rewards("late"), ["p"], ["slow"], [mark])
    assert "no result within --call_timeout 0.2 s: the call was stopped" in failures[0][1]
    time.sleep(0.3)
    assert not os.path.exists(mark) and score(rewards("late"), ["p"], ["a"], [mark])[0] != first


@pytest.mark.slow
def test_a_hung_reward_and_a_child_it_started_let_the_process_end(tmp_path):
    """A reward that starts a sleeping child kept the run's stdout open for ever, and a hung call kept the
    finished process alive; now the hung call is stopped at its timeout, and when the process ends its
    workers' process groups are killed, the child too."""
    (tmp_path / "rw.py").write_text(REWARDS)
    code = ("from rft_core.reward_sources import load_reward_fn\nfrom rft_core.rewards import score\n"
            f"child = load_reward_fn('{tmp_path}/rw.py:child')\n"
            f"sleeps = load_reward_fn('{tmp_path}/rw.py:sleeps', timeout=0.5)\n"
            "print(int(child(['p'], ['a'], ['l'])[0]), score(sleeps, ['p'], ['a'], ['l'])[2], flush=True)\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0 and time.monotonic() - start < 15, out.stderr[-2000:]
    pid, said = out.stdout.splitlines()[-1].split(" ", 1)
    assert "no result within --call_timeout 0.5 s" in said
    if os.path.exists(f"/proc/{pid}/stat"):  # killed: gone, or a zombie until something reaps it
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().rpartition(")")[2].split()[0] == "Z"


@pytest.mark.parametrize("body, why", [
    ("import sys\nsys.exit(0)\n", "(line 2): SystemExit(0): a reward file cannot end or interrupt the run"),
    ("import sys\nsys.exit(3)\n", "(line 2): SystemExit(3): a reward file cannot end or interrupt the run"),
    ("raise KeyboardInterrupt\n", "(line 1): KeyboardInterrupt(): a reward file cannot end or interrupt"),
])
def test_a_reward_file_that_exits_at_import_is_one_line(tmp_path, body, why):
    """sys.exit(0) at import ended the run with exit 0 and nothing trained."""
    (tmp_path / "rw.py").write_text(body)
    with pytest.raises(ConfigError, match=re.escape(f"loading {tmp_path / 'rw.py'} failed {why}")):
        load_reward_fn(f"{tmp_path / 'rw.py'}:f")


def test_a_reward_file_that_parses_argv_sees_none_of_the_trainers_flags(tmp_path, monkeypatch):
    """argparse at import read train_ppo.py's flags and printed an error about them."""
    (tmp_path / "rw.py").write_text(
        "import argparse, sys\nARGV = list(sys.argv)\nparser = argparse.ArgumentParser()\n"
        "parser.add_argument('--scale', type=float, default=2.0)\nARGS = parser.parse_args()\n"
        "def f(p, c, l, **kw):\n    return [ARGS.scale + (ARGV == [__file__])] * len(c)\n")
    monkeypatch.setattr(sys, "argv", ["train_ppo.py", "--pretrain", "m", "--reward_fn", "rw.py:f"])
    fn = load_reward_fn(f"{tmp_path / 'rw.py'}:f")
    assert fn(None, ["c"], [None]) == [3.0]  # ARGS.scale 2, plus 1: ARGV == [its own path]
    assert sys.argv == ["train_ppo.py", "--pretrain", "m", "--reward_fn", "rw.py:f"]


class _Stop(KeyboardInterrupt):
    """What a stop handler raises (run.StopNow is one): the signal's, never the reward file's."""


def _stop(signum, frame):
    raise _Stop("SIGTERM during start-up")


@pytest.mark.parametrize("sig, handler, raised", [
    (signal.SIGINT, signal.default_int_handler, KeyboardInterrupt), (signal.SIGTERM, _stop, _Stop)])
def test_a_real_signal_during_a_reward_files_import_is_still_the_users(tmp_path, sig, handler, raised):
    (tmp_path / "rw.py").write_text("import time\ntime.sleep(2)\n")
    previous = signal.signal(sig, handler)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), sig)).start()
        with pytest.raises(raised):
            load_reward_fn(f"{tmp_path / 'rw.py'}:f")
        assert signal.getsignal(sig) is handler  # the handler is given back
    finally:
        signal.signal(sig, previous)


def test_a_reward_that_mutates_its_inputs_and_returns_the_wrong_length_is_named(tmp_path):
    """A reward popping from completions and returning one value fewer: an IndexError deep in rewards.py.
    It gets copies (the samples are intact) and its failure names it and both lengths."""
    path = tmp_path / "rw.py"
    path.write_text(REWARDS)
    said, batch = [], samples("a", "b", "c")
    scorer = RewardScorer([("rule", load_reward_fn(f"{path}:pops"))], log=said.append)
    assert scorer(batch) == 3 and [s.completion for s in batch] == ["a", "b", "c"]
    assert len(said) == 1 and f"pops in {path} returned 0 values, expected 1 (one per sample)" in said[0]


class _Server(http.server.BaseHTTPRequestHandler):
    """/500: HTTP 500 for every request (or only those holding the completion 'bad' under /500-bad); /html:
    a proxy's HTML page; /moved: a 302 to `elsewhere`. Requests are counted per path."""
    seen, elsewhere = [], None

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append(self.path)
        if self.path == "/500" or self.path == "/500-bad" and b'"bad"' in body:
            self.send_response(500)
            self.end_headers()
        elif self.path == "/html":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html><body>Please log in</body></html>")
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", self.elsewhere)
            self.end_headers()
        else:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"rewards": [1.0] * len(json.loads(body)["completions"])}).encode())

    def do_GET(self):  # what urllib made of a redirected POST: its body gone
        self.seen.append(f"GET {self.path}")
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"rewards": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]}')

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Server.seen.clear()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


@pytest.mark.parametrize("path, why", [("/500", "HTTP 500 Internal Server Error (an answer: not retried)"),
                                       ("/html", "not a valid answer (Expecting value")])
def test_a_reward_server_answering_errors_is_not_retried_and_stops_early(server, path, why):
    """HTTP 500 or an HTML page for every sample: the batch and the first two samples alone are sent once each
    (it was 3 tries with 1 + 2 s of back-off, for each sample: ~5 minutes for a 96-problem eval)."""
    start = time.perf_counter()
    rewards, _, failures = score(remote_reward_fn(server + path), ["p"] * 8, ["c"] * 8, ["l"] * 8,
                                 fallback=-1.0)
    assert time.perf_counter() - start < 2 and _Server.seen == [path] * 3
    assert rewards == [-1.0] * 8 and len(failures) == 8 and all(why in w for _, w in failures)


def test_a_server_failing_one_sample_still_finds_it(server):
    rewards, _, failures = score(remote_reward_fn(server + "/500-bad"), ["p"] * 4, ["c", "bad", "c", "c"],
                                 ["l"] * 4, fallback=-1.0)
    assert rewards == [1.0, -1.0, 1.0, 1.0] and [i for i, _ in failures] == [1] and len(_Server.seen) == 5


def test_a_redirect_is_not_followed(server):
    """A 302 to another host or scheme was followed as a GET without the body (the rewards read from it)."""
    _Server.elsewhere = "http://localhost:1/steal"
    with pytest.raises(ServiceDown, match=re.escape(f"--remote_rm_url {server}/moved: HTTP 302 redirect to "
                                                    "http://localhost:1/steal not followed")):
        remote_reward_fn(server + "/moved")(["p"], ["c"], ["l"])
    _Server.elsewhere = server + "/elsewhere"  # one that answers
    rewards, _, failures = score(remote_reward_fn(server + "/moved"), ["p"] * 8, ["c"] * 8, ["l"] * 8)
    assert len(failures) == 8 and _Server.seen == ["/moved", "/moved"]  # one request a batch, no GET


def test_a_reward_url_with_a_port_out_of_range_is_refused():
    """A port past 65535 wrapped around to another service (the prompts went there): refused in one line."""
    with pytest.raises(ConfigError, match=re.escape("--remote_rm_url 'http://localhost:70000/r': Port out of "
                                                    "range 0-65535")):
        remote_reward_fn("http://localhost:70000/r")
    with pytest.raises(ConfigError, match="not an http"):
        remote_reward_fn("ftp://localhost:21/r")


def test_math_reward_works_in_and_out_of_the_main_thread():
    """math-verify's signal.alarm timeouts raised 'doesn't support threaded environment' for every sample in
    a thread: --reward_fn math scored nothing. In process (as run) and from a thread alike."""
    pytest.importorskip("math_verify")
    args = ["p"] * 2, ["<answer>3/4</answer>", "<answer>1</answer>"], ["0.75", "2"]
    results = [score(math_reward, *args)]
    thread = threading.Thread(target=lambda: results.append(score(math_reward, *args)))
    thread.start()
    thread.join()
    for rewards_, _, failures in results:
        assert failures == [] and rewards_ == pytest.approx([1.1, 0.1])


@pytest.mark.slow
def test_a_reward_that_exits_ends_the_run_in_one_line(tiny_model_dir, tmp_path):
    """End to end: sys.exit(3) in the reward call, sys.exit(0) at import: status 2 and one line naming the
    reward (they were exit 3 without a word, and exit 0 with nothing trained)."""
    (tmp_path / "rw.py").write_text(REWARDS)
    (tmp_path / "bye.py").write_text("import sys\nsys.exit(0)\n")
    exit3 = f"SystemExit(3) raised by exit3 in {tmp_path}/rw.py line 5"
    exit0 = "(line 2): SystemExit(0): a reward file cannot end"
    for out, spec, said in [("a", f"{tmp_path}/rw.py:exit3", exit3), ("b", f"{tmp_path}/bye.py:f", exit0)]:
        proc = run_script("train_ppo.py", ["--pretrain", tiny_model_dir, *TINY, "--reward_fn", spec,
                                           "--output_dir", str(tmp_path / out)], check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and said in errors[0], proc.stderr[-3000:]
