"""Rewards. A reward function has the signature

    fn(prompts, completions, labels, **kwargs) -> list[float] | dict[str, list[float]]

and a dict's named components are summed into the reward (each is logged as rollout/reward/<name>).
Built in: `answer_reward` (exact match in <answer></answer> plus a format term); yours come from
`--reward_fn path/to/file.py:function` or a remote model at `--remote_rm_url`. `score` contains
failures: a sample whose reward raises, is not finite or is missing gets the fallback and is counted.
"""

import importlib.util
import json
import math
import os
import re
import time
import urllib.error
import urllib.request

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_answer(completion):
    """Return (answer, well_formed) for a completion.

    answer: the stripped text of the last complete <answer>...</answer> pair, or None.
    well_formed: exactly one pair, no stray tag, and nothing but whitespace after it.
    """
    matches = list(ANSWER_RE.finditer(completion))
    if not matches:
        return None, False
    last = matches[-1]
    stray = completion.count("<answer>") + completion.count("</answer>") != 2
    well_formed = len(matches) == 1 and not stray and not completion[last.end():].strip()
    return last.group(1).strip(), well_formed


def answer_reward(prompts, completions, labels, format_weight=0.1, **kwargs):
    """Exact-match correctness (1.0) plus `format_weight` for a well-formed answer tag, as components."""
    if len(completions) != len(labels):
        raise ValueError(f"{len(completions)} completions but {len(labels)} labels")
    correct, formatted = [], []
    for completion, label in zip(completions, labels):
        answer, well_formed = parse_answer(completion)
        correct.append(float(answer is not None and answer == str(label).strip()))
        formatted.append(format_weight * float(well_formed))
    return {"correct": correct, "format": formatted}


def math_label(label):
    """The reference answer of a GSM8K ('... #### 72') or MATH ('... \\boxed{3/4}') label, else the label."""
    label = str(label)
    if "####" in label:
        return label.rsplit("####", 1)[1].strip().replace(",", "")
    start = label.rfind("\\boxed{")
    if start < 0:
        return label.strip()
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(label)):  # the matching brace: boxed answers nest braces, as in \frac{3}{4}
        depth += {"{": 1, "}": -1}.get(label[j], 0)
        if depth == 0:
            return label[i:j].strip()
    return label[i:].strip()


def math_reward(prompts, completions, labels, format_weight=0.1, **kwargs):
    """Mathematical equivalence (math-verify: 0.75 == 3/4 == \\frac{3}{4}) of the <answer> tag's content,
    or of the last answer in the completion when it has no tag, plus a format term."""
    from math_verify import parse, verify  # optional: pip install math-verify

    correct, formatted = [], []
    for completion, label in zip(completions, labels):
        answer, well_formed = parse_answer(completion)
        predicted = parse(f"${answer}$") if answer is not None else parse(completion)
        correct.append(float(bool(predicted) and verify(parse(f"${math_label(label)}$"), predicted)))
        formatted.append(format_weight * float(well_formed))
    return {"correct": correct, "format": formatted}


BUILTIN_REWARDS = {"answer": answer_reward, "math": math_reward}


def load_reward_fn(spec):
    """A built-in reward by name (answer, math) or the function named by 'path/to/file.py:function'."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"--reward_fn {spec!r}: expected path/to/file.py:function or one of {sorted(BUILTIN_REWARDS)}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--reward_fn {spec!r}: no such file {path!r}")
    module_spec = importlib.util.spec_from_file_location(f"reward_module_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"--reward_fn {spec!r}: {path} defines no function {name!r}")
    return fn


def remote_reward_fn(url, timeout=30.0, retries=3, backoff=1.0):
    """A reward function that POSTs {"prompts", "completions", "labels"} as JSON to `url` and reads
    {"rewards": [...]} (or named components) back; retries with exponential backoff."""

    def fn(prompts, completions, labels, **kwargs):
        body = json.dumps({"prompts": prompts, "completions": completions, "labels": labels}).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        for attempt in range(retries):
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    out = json.loads(response.read())
                return out["rewards"] if "rewards" in out else out
            except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
                error = e
                if attempt + 1 < retries:
                    time.sleep(backoff * 2**attempt)
        raise ConnectionError(f"--remote_rm_url {url}: no valid answer after {retries} tries: {error!r}")

    return fn


def _rows(reward_fn, prompts, completions, labels):
    """One {component: value} dict per sample; raises if the output is malformed."""
    out = reward_fn(prompts, completions, labels)
    components = out if isinstance(out, dict) else {"reward": out}
    for name, values in components.items():
        if len(values) != len(completions):
            raise ValueError(f"component {name!r} has {len(values)} values for {len(completions)} samples")
    return [{name: float(values[i]) for name, values in components.items()} for i in range(len(completions))]


def score(reward_fn, prompts, completions, labels, fallback=0.0, strict=False):
    """Rewards (a list), components {name: list}, and how many samples got `fallback`.

    The batch is scored in one call; if that call fails (raises, wrong length), each sample is scored
    alone so one bad sample costs only itself. Non-finite values count as failures. strict=True
    raises on the first failure instead, showing the sample.
    """
    def fail(i, why):
        if strict:
            raise RuntimeError(f"reward failed on sample {i}: completion={completions[i]!r} label={labels[i]!r}: {why}")
        return None

    try:
        rows = _rows(reward_fn, prompts, completions, labels)
    except Exception:  # find the culprit(s): score one by one
        rows = []
        for i in range(len(completions)):
            try:
                rows += _rows(reward_fn, prompts[i:i + 1], completions[i:i + 1], labels[i:i + 1])
            except Exception as e:
                rows.append(fail(i, repr(e)))
    names = sorted({k for r in rows if r for k in r})
    for i, r in enumerate(rows):
        if r is not None and (set(r) != set(names) or not all(math.isfinite(v) for v in r.values())):
            rows[i] = fail(i, f"non-finite or missing components {r}")
    rewards = [fallback if r is None else sum(r.values()) for r in rows]
    components = {k: [math.nan if r is None else r[k] for r in rows] for k in names}
    return rewards, components, sum(r is None for r in rows)


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
