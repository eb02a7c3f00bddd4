"""Rewards: built-in rule rewards, scoring samples with any reward function, and shaping. A reward function:

    fn(prompts, completions, labels, **kwargs) -> list[float] | dict[str, list[float]]

a dict's components summed (each logged as rollout/reward/<name>); keyword arguments, where its signature
names them (all with **kwargs): the prompt rows' other columns, a list each, and with --env `turns` ({"role",
"content"} per episode) and `info` (the last info dict). Built in:
`answer_reward`, `math_reward`, `first_word_reward` (shapes); others (--reward_fn, --remote_rm_url, reward
models): rft_core/reward_sources.py. Shaping: DAPO's `overlong_penalty` (normalisation: advantages.py)."""

import inspect
import math
import re
import threading

from rft_core.errors import ConfigError, MissingName, RewardError
from rft_core.workers import UserCodeError, WorkerLost, load_from_file

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_answer(completion):
    """(last <answer> pair's stripped text or None, well_formed: one pair, no stray tag, nothing after)."""
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
    parsed = [parse_answer(completion) for completion in completions]  # (answer, well_formed)
    correct = [float(a is not None and a == str(label).strip()) for (a, _), label in zip(parsed, labels)]
    return {"correct": correct, "format": [format_weight * float(ok) for _, ok in parsed]}


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
    """math-verify equivalence (0.75 == 3/4) of the <answer> content (else the last answer), plus format."""
    from math_verify import parse, verify  # optional: pip install math-verify

    # math-verify's time bounds use signal.alarm, which only a main thread may set (elsewhere: unbounded)
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    correct, formatted = [], []
    for completion, label in zip(completions, labels):
        answer, well_formed = parse_answer(completion)
        predicted = parse(f"${answer}$" if answer is not None else completion, parsing_timeout=limit)
        correct.append(float(bool(predicted) and verify(
            parse(f"${math_label(label)}$", parsing_timeout=limit), predicted, timeout_seconds=limit)))
        formatted.append(format_weight * float(well_formed))
    return {"correct": correct, "format": formatted}


def first_word_reward(prompts, completions, labels, **kwargs):
    """The shapes task's reward: 1 when the completion's first word is the label."""
    return {"correct": [float(c.split()[:1] == [str(label)]) for c, label in zip(completions, labels)]}


BUILTIN_REWARDS = {"answer": answer_reward, "math": math_reward, "first_word": first_word_reward}


def file_reward(spec):
    """--reward_fn 'path/to/file.py:NAME', run in a worker with the keyword arguments its signature takes."""
    fn = load_from_file(spec, "--reward_fn", "function", sorted(BUILTIN_REWARDS), "a reward file")
    if not callable(fn):
        raise MissingName(f"--reward_fn {spec!r}: {spec.rpartition(':')[0]} defines no function "
                          f"{spec.rpartition(':')[2]!r}")
    return lambda prompts, completions, labels, kwargs: fn(prompts, completions, labels, **taken(fn, kwargs))


def taken(fn, kwargs):
    """Those of kwargs that fn's signature takes: by name, or all with **kwargs (none if it has none)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    return {k: v for k, v in kwargs.items() if any(p.name == k and p.kind is not p.POSITIONAL_ONLY
                                                   for p in params)}


def overlong_penalty(length, max_len, buffer_len, factor=1.0):
    """DAPO's overlong penalty (Yu et al. 2025): 0 to max_len - buffer_len, linear to -factor at max_len."""
    start = max_len - buffer_len
    return -factor * min(max(length - start, 0) / buffer_len, 1.0)


class ServiceDown(ConnectionError):
    """reward_sources.remote_reward_fn's server down, timing out, busy or redirecting: every sample fails."""


class ServerError(ConnectionError):
    """An error status or a non-JSON body: scored one by one until the first two samples alone fail alike."""


def describe(fn, error=None):
    """How messages name a reward function: 'name in path/to/file.py line N' for a file's, else its name."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    path, line = getattr(fn, "path", None), getattr(error, "line", None)
    return f"{name} in {path}" + (f" line {line}" if line else "") if path else name


def _rows(reward_fn, prompts, completions, labels, kwargs):
    """One {component: value} dict per sample, or raises; the reward gets copies of the lists (may pop)."""
    n = len(completions)
    try:
        kwargs = {k: list(v) for k, v in taken(reward_fn, kwargs).items()}
        out = reward_fn(list(prompts), list(completions), list(labels), **kwargs)
    except UserCodeError as e:
        if not e.interrupt:
            raise
        raise RewardError(f"{e!r} raised by {describe(reward_fn, e)}: a reward function returns its values "
                          "or raises an Exception, it cannot end or interrupt the run") from None
    components = out if isinstance(out, dict) else {"reward": out}
    for name, values in components.items():
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise ValueError(f"component {name!r} is {type(values).__name__}, not a list of numbers")
        if len(values) != n:
            raise ValueError(f"{describe(reward_fn)} returned {len(values)} values, expected {n} (one per "
                             "sample)" + (f" in component {name!r}" if isinstance(out, dict) else ""))
    return [{name: float(values[i]) for name, values in components.items()} for i in range(n)]


def _why(e):  # a RewardError's message reads as it is; any other exception as its repr, its type first
    return str(e) if isinstance(e, RewardError) else repr(e)


def score(reward_fn, prompts, completions, labels, fallback=0.0, strict=False, kwargs=None):
    """(rewards, components {name: list}, failures [(index, why)] given `fallback`; strict: raise). A failed
    batch is retried sample by sample unless it timed out, ended its worker or found the server down."""
    kwargs, failures = kwargs or {}, []

    def fail(i, why):
        if strict:
            raise RewardError(f"reward failed on sample {i}: completion={completions[i]!r} "
                              f"label={labels[i]!r}: {why} (--reward_failure_limit 0)")
        failures.append((i, why))  # its row: None

    try:
        rows = _rows(reward_fn, prompts, completions, labels, kwargs)
    except (TimeoutError, WorkerLost, ServiceDown) as e:
        rows = [fail(i, _why(e)) for i in range(len(completions))]
    except Exception as batch_error:  # find the culprit(s): score one by one
        rows, alike = [], 0  # alike: the first samples alone that the server failed as it failed the batch
        for i in range(len(completions)):
            if alike == 2:  # it fails whatever it is sent: the rest are not sent
                rows.append(fail(i, _why(batch_error)))
                continue
            try:
                rows += _rows(reward_fn, prompts[i:i + 1], completions[i:i + 1], labels[i:i + 1],
                              {k: v[i:i + 1] for k, v in kwargs.items()})
            except Exception as e:
                rows.append(fail(i, _why(e)))
                alike += i == alike and isinstance(e, ServerError) and str(e) == str(batch_error)
    names = sorted({k for r in rows if r for k in r})
    for i, r in enumerate(rows):
        if r is not None and (set(r) != set(names) or not all(math.isfinite(v) for v in r.values())):
            rows[i] = fail(i, f"non-finite or missing components {r}")
    rewards = [fallback if r is None else sum(r.values()) for r in rows]
    components = {k: [math.nan if r is None else r[k] for r in rows] for k in names}
    return rewards, components, failures


class RewardScorer:
    """Sets each Sample's reward (the sources' weighted sum) and components; returns the fallback count."""

    def __init__(self, sources, weights=None, fallback=0.0, failure_limit=1.0, log=print):
        self.sources, self.weights = sources, weights or [1.0] * len(sources)
        if len(self.weights) != len(sources):
            raise ConfigError(f"--reward_weights has {len(self.weights)} values for {len(sources)} reward "
                              f"sources ({', '.join(name for name, _ in sources)})")
        self.fallback, self.failure_limit, self.log = fallback, failure_limit, log
        self.seen, self.last_failure = set(), None

    def __call__(self, samples, strict=False):
        prompts, labels = [s.prompt for s in samples], [s.label for s in samples]
        completions = [s.completion for s in samples]
        names = dict.fromkeys(k for s in samples for k in s.columns or {})  # the rows' other columns
        kwargs = {k: [(s.columns or {}).get(k) for s in samples] for k in names}
        episodes = [s.episode for s in samples if s.episode is not None]  # --env's: turns, info
        if len(episodes) == len(samples):
            kwargs.update(turns=[e.turns for e in episodes], info=[e.info for e in episodes])
        total, components, failed = [0.0] * len(samples), [{} for _ in samples], set()
        for (name, reward_fn), weight in zip(self.sources, self.weights):
            rewards, comps, failures = score(reward_fn, prompts, completions, labels, self.fallback, strict,
                                             kwargs)
            total = [t + weight * r for t, r in zip(total, rewards)]
            named = comps if name == "rule" else {name: rewards}
            for i, sample_components in enumerate(components):
                sample_components.update({key: values[i] for key, values in named.items()})
            for i, why in failures:
                self.last_failure, kind = f"{name}: {why}", (name, why.split("(", 1)[0][:80])
                if kind not in self.seen:
                    self.seen.add(kind)
                    self.log(f"[reward] {name} failed on a sample (completion {completions[i][:80]!r}, label "
                             f"{labels[i]!r}): {why}; it gets --reward_fallback {self.fallback}, counted in "
                             "rollout/reward_errors (shown once per kind)")
            failed.update(i for i, _ in failures)
        for sample, reward, sample_components in zip(samples, total, components):
            sample.reward, sample.components = reward, sample_components
        return len(failed)

    def check(self, failed, total, step, env_failed=0):
        """Stop (RewardError) when `failed` of `total` samples got the fallback (env_failed: by theirs)."""
        if failed and failed / total >= self.failure_limit:  # (0: strict, a step without failures goes on)
            what, fix = f"the rewards of {int(failed)} of {int(total)} samples failed", "the reward"
            if env_failed:
                what = (f"{int(failed)} of {int(total)} samples failed ({int(env_failed)} in the "
                        "environment, rollout/env_errors)")
                fix = "the reward or the environment"
            raise RewardError(f"{what} at step {step} (last: {self.last_failure}): training on fallback "
                              f"rewards learns nothing; fix {fix}, or raise --reward_failure_limit (above 1: "
                              "never stop)")
