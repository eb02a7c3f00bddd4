import http.server
import itertools
import json
import math
import os
import socket
import threading

import pytest
import torch

from rft_core.advantages import RunningMoments
from rft_core.evaluation import pass_at_k
from rft_core.reward_sources import load_reward_fn, remote_reward_fn, reward_model_fn, reward_sources
from rft_core.rewards import (
    RewardScorer,
    answer_reward,
    describe,
    math_label,
    math_reward,
    overlong_penalty,
    parse_answer,
    score,
)


@pytest.mark.parametrize("completion, answer, well_formed", [
    ("12 + 3 = 15\n<answer>15</answer>", "15", True),
    ("<answer> 15 </answer>\n", "15", True),
    ("<answer>15</answer> and more text", "15", False),  # trailing text
    ("<answer>1</answer><answer>15</answer>", "15", False),  # extra tags: last one counts
    ("<answer>15</answr>", None, False),  # malformed closing tag
    ("<answer>15", None, False),  # missing closing tag
    ("15", None, False),  # no tags at all
    ("", None, False),
    ("<answer><answer>15</answer>", "<answer>15", False),  # stray opening tag
    ("<answer>\n-7\n</answer>", "-7", True),
])
def test_parse_answer(completion, answer, well_formed):
    assert parse_answer(completion) == (answer, well_formed)


def test_answer_reward():
    completions = ["<answer>15</answer>", "<answer>14</answer>", "15", "<answer>15</answer> trailing"]
    parts = answer_reward(None, completions, ["15", "15", "15", 15])
    assert parts["correct"] == [1.0, 0.0, 0.0, 1.0]
    assert parts["format"] == pytest.approx([0.1, 0.1, 0.0, 0.0])
    rewards, components, errors = score(answer_reward, [None] * 4, completions, ["15", "15", "15", 15])
    assert (rewards == pytest.approx([1.1, 0.1, 0.0, 1.0]) and errors == []
            and set(components) == {"correct", "format"})


def test_exact_match_is_exact():
    parts = answer_reward(None, ["<answer>015</answer>", "<answer>15.0</answer>"], ["15", "15"])
    assert parts["correct"] == [0.0, 0.0]


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="2 completions but 1 labels"):
        answer_reward(None, ["a", "b"], ["1"])


def flaky(prompts, completions, labels, **kwargs):
    """Raises on 'boom', NaN on 'nan', a wrong-length list for 'short' batches, else len(completion)."""
    if "boom" in completions:
        raise RuntimeError("boom")
    if "short" in completions and len(completions) > 1:
        return [1.0]
    return [math.nan if c == "nan" else float(len(c)) for c in completions]


def test_score_contains_failures():
    completions = ["ab", "boom", "nan", "abcd"]
    rewards, components, errors = score(flaky, [None] * 4, completions, ["x"] * 4, fallback=-1.0)
    assert rewards == [2.0, -1.0, -1.0, 4.0] and [i for i, _ in errors] == [1, 2]
    assert "RuntimeError('boom')" in errors[0][1] and "non-finite" in errors[1][1]
    assert components["reward"][0] == 2.0 and math.isnan(components["reward"][1])
    rewards, _, errors = score(flaky, [None] * 2, ["short", "abc"], ["x"] * 2)
    assert rewards == [5.0, 3.0] and errors == []  # wrong length for the batch: rescored one by one


def test_strict_rewards_show_the_sample():
    with pytest.raises(RuntimeError, match="sample 1: completion='boom'"):
        score(flaky, [None] * 2, ["ab", "boom"], ["x", "y"], strict=True)
    with pytest.raises(RuntimeError, match="sample 0: completion='nan'"):
        score(flaky, [None], ["nan"], ["x"], strict=True)


def test_load_reward_fn(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def length(prompts, completions, labels, **kw):\n"
                    "    return {'len': [len(c) for c in completions]}\n")
    fn = load_reward_fn(f"{path}:length")
    assert fn(None, ["abc"], [None]) == {"len": [3]}
    with pytest.raises(AttributeError, match="no function 'nope'"):
        load_reward_fn(f"{path}:nope")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_reward_fn(f"{tmp_path / 'missing.py'}:length")
    with pytest.raises(ValueError, match="expected path/to/file.py:function"):
        load_reward_fn("just_a_name")


def test_a_reward_file_runs_in_a_worker_process_without_torch(tmp_path):
    """A --reward_fn file (rft_core's own too) runs in a worker process, which imports no torch (it starts in
    a fraction of a second) and is named by its file in messages; a built-in rule needs no worker."""
    from rft_core.reward_sources import start_workers

    (tmp_path / "mods.py").write_text("import os, sys\ndef f(p, c, l, **kw):\n"
                                      "    return [float('torch' in sys.modules), float(os.getpid())]\n")
    workers = start_workers("rft_core/rewards.py:answer_reward", None, 1, 30)
    fn = load_reward_fn("rft_core/rewards.py:answer_reward", workers)
    assert fn(None, ["<answer>15</answer>"], ["15"]) == {"correct": [1.0], "format": [0.1]}
    assert describe(fn) == "answer_reward in rft_core/rewards.py"
    assert describe(answer_reward) == "answer_reward"  # rft_core's own, in process
    workers.close()
    torch_loaded, pid = load_reward_fn(f"{tmp_path}/mods.py:f")(None, ["a", "b"], [None, None])
    assert torch_loaded == 0.0 and pid != os.getpid()
    assert start_workers("answer", None, 1, 30) is None


class _Handler(http.server.BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).calls == 1:  # the first request fails: the client must retry
            self.send_response(503)
            self.end_headers()
            return
        out = json.dumps({"rewards": [float(c == l)
                                      for c, l in zip(body["completions"], body["labels"])]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def test_remote_reward_model_on_loopback():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        fn = remote_reward_fn(f"http://127.0.0.1:{server.server_port}/score", timeout=5, retries=3,
                              backoff=0.01)
        rewards, _, errors = score(fn, ["p", "q"], ["7", "8"], ["7", "9"])
        assert rewards == [1.0, 0.0] and errors == [] and _Handler.calls == 2
    finally:
        server.shutdown()


def test_remote_reward_model_gives_up_clearly():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fn = remote_reward_fn(f"http://127.0.0.1:{port}/score", timeout=1, retries=2, backoff=0.01)
    with pytest.raises(ConnectionError, match="no valid answer after 2 tries"):
        fn(["p"], ["c"], ["l"])


@pytest.mark.parametrize("n, c, k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (5, 5, 2), (6, 1, 6), (4, 3, 2)])
def test_pass_at_k_matches_enumeration(n, c, k):
    """Probability that a random k-subset of the n samples holds a correct one, by enumeration."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    expected = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize("label, gold", [
    ("Natalia sold 48 clips... 48 + 24 = 72 clips.\n#### 72", "72"),
    ("so it is 1,000\n#### 1,000", "1000"),
    ("Thus the answer is $\\boxed{\\frac{3}{4}}$.", "\\frac{3}{4}"),
    ("\\boxed{x^2+1} and more", "x^2+1"),
    ("42", "42"),
])
def test_math_label(label, gold):
    assert math_label(label) == gold


def test_math_reward_is_equivalence_not_string_match():
    completions = ["<answer>0.75</answer>", "<answer>3/4</answer>", "<answer>0.7</answer>",
                   "The total is \\boxed{72}.", "<answer>1+x^2</answer>", "no answer here"]
    labels = ["\\boxed{\\frac{3}{4}}", "#### 0.75", "#### 0.75", "#### 72", "\\boxed{x^2+1}", "#### 5"]
    parts = math_reward(None, completions, labels)
    assert parts["correct"] == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert parts["format"] == pytest.approx([0.1, 0.1, 0.1, 0.0, 0.1, 0.0])
    assert load_reward_fn("math") is math_reward and load_reward_fn("answer") is answer_reward


def test_overlong_penalty():
    # max 10 tokens, buffer 4: free up to 6, then -1/4 per token down to -factor at 10
    got = [overlong_penalty(n, 10, 4, factor=2.0) for n in (3, 6, 7, 8, 10)]
    assert got == pytest.approx([0, 0, -0.5, -1.0, -2.0])


def test_running_moments_match_concatenation():
    batches = [[1.0, 2.0, 4.0], [0.5], [3.0, -1.0, 2.5, 7.0]]
    m = RunningMoments()
    for b in batches:
        m.update(b)
    allv = [v for b in batches for v in b]
    mean = sum(allv) / len(allv)
    assert m.mean == pytest.approx(mean)
    assert m.std == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in allv) / len(allv)))
    again = RunningMoments()
    again.load_state_dict(m.state_dict())
    assert (again.mean, again.std, again.count) == (m.mean, m.std, m.count)


def test_reward_model_fn_scores_like_the_classifier(tiny_rm_dir):
    """Scores equal the sequence classifier's own logits on the same text, in the RM's tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    fn = reward_model_fn(tiny_rm_dir, batch_size=2)
    prompts = ["What is 2 + 2?", [{"role": "user", "content": "Name a colour."}], "Hi"]
    completions = [" 4", "Blue, I think.", " there, how are you today?"]
    got = fn(prompts, completions, ["", "", ""])
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_rm_dir)
    texts = [prompts[0] + completions[0],
             tok.apply_chat_template(prompts[1] + [{"role": "assistant", "content": completions[1]}],
                                     tokenize=False),
             prompts[2] + completions[2]]
    with torch.no_grad():
        want = [rm(**tok(t, return_tensors="pt", add_special_tokens=False)).logits.item() for t in texts]
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(got)) == 3


def test_reward_scorer_sets_each_samples_reward_and_components():
    """Sources summed with their weights; the rule's components keep their names, a model is one component;
    a failure gives that source's fallback to the sample and is counted."""
    from rft_core.experience import Sample

    def rule(prompts, completions, labels, **kw):
        return {"correct": [float(c == lab) for c, lab in zip(completions, labels)],
                "format": [0.1] * len(labels)}

    def model(prompts, completions, labels, **kw):
        if "boom" in completions:
            raise RuntimeError("down")
        return [len(c) for c in completions]

    samples = [Sample([1], "ab", "p", completion=c) for c in ("ab", "xyz", "boom")]
    errors = RewardScorer([("rule", rule), ("rm0", model)], [1.0, 0.5], fallback=-1.0,
                          log=lambda m: None)(samples)
    assert errors == 1
    assert [s.reward for s in samples] == pytest.approx([1.1 + 1.0, 0.1 + 1.5, 0.1 - 0.5])
    assert samples[0].components == {"correct": 1.0, "format": 0.1, "rm0": 2.0}
    assert samples[2].components["rm0"] == -1.0
    with pytest.raises(ValueError, match="--reward_weights has 1 values for 2 reward sources"):
        RewardScorer([("rule", rule), ("rm0", model)], [1.0])


def test_default_rule_and_first_word():
    """With no reward flag the script's default rule is the source: answer for text, first_word for images."""
    (name, fn), = reward_sources(default_rule="first_word")
    assert name == "rule" and (fn(None, ["red circle", "a red", ""], ["red", "red", "red"])
                               == {"correct": [1, 0, 0]})
    assert reward_sources()[0][1] is answer_reward


def test_a_reward_server_that_never_answers_fails_the_batch_at_once():
    """An unreachable --remote_rm_url fails every sample of the batch after its retries, without retrying each
    sample alone (that waited retries x backoff per sample: ~5 minutes for a 96-problem eval); a server that
    answers badly (HTTP 500) is still retried sample by sample, which finds a sample that breaks it."""
    from rft_core.reward_sources import remote_reward_fn
    from rft_core.rewards import ServiceDown, score

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = remote_reward_fn(f"http://127.0.0.1:{port}/x", timeout=1, retries=2, backoff=0.01)
    calls = []

    def counted(prompts, completions, labels):
        calls.append(len(completions))
        return remote(prompts, completions, labels)

    rewards, _, failures = score(counted, ["p"] * 4, ["c"] * 4, ["l"] * 4, fallback=-1.0)
    assert calls == [4] and rewards == [-1.0] * 4 and [i for i, _ in failures] == [0, 1, 2, 3]
    assert all("unreachable" in why and "ServiceDown" in why for _, why in failures)

    def broken_by_one(prompts, completions, labels):  # a ConnectionError that is not ServiceDown
        calls.append(len(completions))
        if "bad" in completions:
            raise ConnectionError("HTTP 500")
        return [1.0] * len(completions)

    calls.clear()
    rewards, _, failures = score(broken_by_one, ["p"] * 3, ["c", "bad", "c"], ["l"] * 3, fallback=-1.0)
    assert calls == [3, 1, 1, 1] and rewards == [1.0, -1.0, 1.0] and [i for i, _ in failures] == [1]
    assert issubclass(ServiceDown, ConnectionError)


EPISODE_REWARDS = '''def with_episode(prompts, completions, labels, turns, info):
    out = [len(t) + i.get("calls", 0) / 10 for t, i in zip(turns, info)]
    turns[0].append("edited")  # its own copy
    return out

def plain(prompts, completions, labels):
    return [1.0] * len(completions)
'''


def test_rewards_given_the_episode_where_they_take_it(tmp_path):
    """With --env, a reward that names turns / info (or takes **kwargs) gets each episode's turns and the
    environment's last info; one that takes neither is called as before; outside --env none is passed."""
    from rft_core.episodes import Episode
    from rft_core.experience import Sample

    (tmp_path / "rw.py").write_text(EPISODE_REWARDS)
    seen = {}

    def kwargs(prompts, completions, labels, **kw):
        seen.update(kw)
        return [0.0] * len(completions)

    turns = [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "2"},
             {"role": "assistant", "content": "b"}]
    samples = [Sample([1], "l", "p", completion="b", episode=Episode(list(turns), info={"calls": 1.0})),
               Sample([1], "l", "p", completion="c", episode=Episode(turns[:1]))]
    sources = [("rule", load_reward_fn(f"{tmp_path}/rw.py:with_episode")),
               ("plain", load_reward_fn(f"{tmp_path}/rw.py:plain")), ("kw", kwargs)]
    assert RewardScorer(sources, log=print)(samples) == 0
    assert [s.components["reward"] for s in samples] == [3.1, 1.0] and samples[0].episode.turns == turns
    assert seen == {"turns": [turns, turns[:1]], "info": [{"calls": 1.0}, {}]}
    seen.clear()
    said = []
    plain = [Sample([1], "l", "p", completion="b")]
    assert RewardScorer(sources, log=said.append)(plain) == 1 and seen == {}  # with_episode lacks them
    assert "missing 2 required positional arguments: 'turns' and 'info'" in said[0]


COLUMN_REWARDS = '''def by_solution(prompts, completions, labels, solution, meta):
    if "boom" in completions:
        raise RuntimeError("boom")
    return [float(c == s) + m["w"] for c, s, m in zip(completions, solution, meta)]

def plain(prompts, completions, labels):
    return [1.0] * len(completions)
'''


def column_samples(completions, solutions):
    from rft_core.experience import Sample

    return [Sample([1], "l", "p", completion=c, columns={"solution": s, "meta": {"w": i / 4}})
            for i, (c, s) in enumerate(zip(completions, solutions))]


def test_a_rows_columns_reach_the_reward_as_keyword_arguments(tmp_path):
    """A reward gets the rows' other columns, a list each aligned with completions, by the names its signature
    takes (all with **kwargs), also when a failed batch is scored sample by sample in the file's worker; one
    that names none is called as before; the built-in rules take them and ignore them."""
    (tmp_path / "rw.py").write_text(COLUMN_REWARDS)
    seen = {}

    def kwargs(prompts, completions, labels, **kw):
        seen.update(kw)
        return [0.0] * len(completions)

    sources = [("rule", load_reward_fn(f"{tmp_path}/rw.py:by_solution")),
               ("plain", load_reward_fn(f"{tmp_path}/rw.py:plain")), ("kw", kwargs)]
    samples = column_samples(["4", "5", "7"], ["4", "x", "6"])
    assert RewardScorer(sources, log=print)(samples) == 0
    assert [s.components["reward"] for s in samples] == [1.0, 0.25, 0.5]
    assert seen == {"solution": ["4", "x", "6"], "meta": [{"w": 0.0}, {"w": 0.25}, {"w": 0.5}]}
    samples = column_samples(["4", "boom", "7"], ["4", "x", "7"])  # the batch fails: one by one, aligned
    said = []
    assert RewardScorer(sources[:1], fallback=-1.0, log=said.append)(samples) == 1
    assert [s.reward for s in samples] == [1.0, -1.0, 1.5] and "RuntimeError('boom')" in said[0]
    samples = column_samples(["<answer>4</answer>", "red"], ["4", "x"])
    first_word = reward_sources(default_rule="first_word")[0][1]
    RewardScorer([("rule", answer_reward), ("shapes", first_word)])(samples)
    assert [(s.components["correct"], s.components["shapes"]) for s in samples] == [(0.0, 0.0), (0.0, 0.0)]
    samples = column_samples(["<answer>l</answer>"], ["4"])
    RewardScorer([("rule", answer_reward)])(samples)
    assert samples[0].components == {"correct": 1.0, "format": 0.1}


def test_evaluation_scores_with_the_rows_columns(tmp_path):
    """evaluate() scores through the same RewardScorer: a reward that needs a column gets it there too."""
    from rft_core.engines.base import Generation
    from rft_core.evaluation import evaluate

    class Engine:
        def wake_up(self):
            pass

        def generate(self, ids, max_len, temperature=0.0, mm=None, logprob_every=1):
            return [Generation([7], [0.0]) for _ in ids]

    class Accel:
        process_index, num_processes, device = 0, 1, "cpu"

        def reduce(self, t, op):
            return t

    class Tok:
        def batch_decode(self, ids, skip_special_tokens=True):
            return ["7" for _ in ids]

    def by_solution(prompts, completions, labels, solution):
        return {"correct": [float(c == s) for c, s in zip(completions, solution)]}

    prompts = column_samples([None] * 4, ["7", "1", "7", "7"])
    scorer = RewardScorer([("rule", by_solution)])
    metrics = evaluate(Engine(), Tok(), prompts, scorer, Accel(), 4, n_samples=2)
    assert metrics["eval/accuracy"] == 0.75 and metrics["eval/pass@2"] == 0.75
    assert metrics["eval/reward_errors"] == 0


def test_a_strict_run_goes_on_while_no_reward_fails():
    """--reward_failure_limit 0 stops at the first failure, not at a step where none failed (0 >= 0 did)."""
    scorer = RewardScorer([("rule", answer_reward)], failure_limit=0.0)
    scorer.check(0, 4, step=1)
    with pytest.raises(RuntimeError, match="the rewards of 1 of 4 samples failed at step 1"):
        scorer.check(1, 4, step=1)


COLUMN_REWARD_FILE = '''def by_solution(prompts, completions, labels, solution, meta):
    return {"correct": [float(s == l and m == {"id": l}) for s, l, m in zip(solution, labels, meta)]}
'''


@pytest.mark.slow
def test_a_run_gives_the_rows_columns_to_a_reward_file(tiny_model_dir, tmp_path):
    """Through train_ppo.py: a --reward_fn file (in its worker process) that needs two columns of
    --prompt_data / --eval_data gets them in training and evaluation (any failure stops the run)."""
    from conftest import read_metrics, run_script

    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("\n".join(json.dumps({"q": f"What is {i} + 1?", "a": str(i + 1), "solution": str(i + 1),
                                          "meta": {"id": str(i + 1)}}) for i in range(4)))
    (tmp_path / "data" / "rw.py").write_text(COLUMN_REWARD_FILE)
    run_script("train_ppo.py", [
        "--pretrain", tiny_model_dir, "--max_steps", "2", "--rollout_batch_size", "2",
        "--n_samples_per_prompt", "2", "--micro_rollout_batch_size", "4", "--generate_max_len", "8",
        "--micro_train_batch_size", "2", "--prompt_data", str(data), "--eval_data", str(data),
        "--input_key", "q", "--label_key", "a", "--reward_fn", f"{tmp_path / 'data' / 'rw.py'}:by_solution",
        "--reward_failure_limit", "0", "--output_dir", str(tmp_path / "out")])
    steps, evals = read_metrics(str(tmp_path / "out"))
    assert [r["rollout/reward/correct"] for r in steps] == [1.0, 1.0]
    assert [r["eval/accuracy"] for r in evals] == [1.0, 1.0]
