"""Where a run's rewards come from: a --reward_fn file's function (or a built-in rule by name), a remote
reward server (--remote_rm_url, JSON over HTTP), and local reward models (--reward_pretrain); `reward_sources`
gives a run's list of them, which rewards.RewardScorer scores.
"""

import importlib.util
import json
import os
import signal
import sys
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request

from rft_core.errors import ConfigError, MissingName, MissingPath
from rft_core.logprobs import positions
from rft_core.model_training import load_value_model
from rft_core.rewards import BUILTIN_REWARDS, ServerError, ServiceDown


def load_reward_fn(spec):
    """A built-in reward by name (answer, math) or the function named by 'path/to/file.py:function'."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    fn = load_from_file(spec, "--reward_fn", "function", sorted(BUILTIN_REWARDS), "a reward file")
    if not callable(fn):
        raise MissingName(f"--reward_fn {spec!r}: {spec.rpartition(':')[0]} defines no function "
                          f"{spec.rpartition(':')[2]!r}")
    return fn


def load_from_file(spec, flag, kind, builtins=(), owner="a file"):
    """What 'path/to/file.py:NAME' names (None if the file defines no NAME), the file imported as a module
    of its own; a file that fails to import, exits or is interrupted at import is one line naming the flag
    and the line. kind: what NAME should be; builtins: the names the flag also takes; owner: "a reward
    file"... (for the messages)."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ConfigError(f"{flag} {spec!r}: expected path/to/file.py:{kind}"
                          + (f" or one of {builtins}" if builtins else ""))
    if not os.path.isfile(path):
        raise MissingPath(f"{flag} {spec!r}: no such file {path!r}")
    module_spec = importlib.util.spec_from_file_location(f"user_module_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    argv, handlers, raised = sys.argv, {}, []

    def noted(signum, frame):  # what a signal's handler raises (a real Ctrl-C...) stays the signal's
        try:
            handlers[signum](signum, frame)
        except BaseException as e:
            raised.append(e)
            raise

    for sig in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(sig)) and threading.current_thread() is threading.main_thread():
            handlers[sig] = signal.signal(sig, noted)
    sys.argv = [path]  # a file that parses arguments at import sees none of the trainer's flags
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:  # the user's file, whatever it raised: where in it, a line (RFT_DEBUG=1: all)
        if any(e is r for r in raised):
            raise
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if os.path.abspath(f.filename) == os.path.abspath(path)]
        line = e.lineno if isinstance(e, SyntaxError) else frames[-1].lineno if frames else None
        where = f" (line {line})" if line else ""
        what = f"{type(e).__name__}: {e.msg if isinstance(e, SyntaxError) else e}"
        if not isinstance(e, Exception):  # sys.exit, KeyboardInterrupt...
            what = f"{e!r}: {owner} cannot end or interrupt the run (imported with sys.argv [{path!r}])"
        raise ConfigError(f"{flag} {spec!r}: loading {path} failed{where}: {what}") from e
    finally:
        sys.argv = argv
        for sig, handler in handlers.items():
            if signal.getsignal(sig) is noted:  # unless the file installed its own
                signal.signal(sig, handler)
    return getattr(module, name, None)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect comes back as its HTTPError: urllib would resend the POST as a GET without its body, to
    wherever it points (another host or scheme too)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def remote_reward_fn(url, timeout=30.0, retries=3, backoff=1.0):
    """A reward function that POSTs {"prompts", "completions", "labels"} as JSON to `url` and reads
    {"rewards": [...]} (or named components) back. A server that cannot be reached, times out or is busy
    (HTTP 429, 502-504) is retried with exponential backoff, then fails the batch (ServiceDown); one that
    answers with another error status or a body that is not its JSON is not retried (ServerError); a redirect
    is not followed (ServiceDown). Each names the URL and the failure."""
    parts = urllib.parse.urlsplit(url)
    try:
        _ = parts.port  # raises past 65535, where a request would wrap around to another service
    except ValueError as e:
        raise ConfigError(f"--remote_rm_url {url!r}: {e} (e.g. http://host:5000/reward)") from e
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"--remote_rm_url {url!r}: not an http(s) URL (e.g. http://host:5000/reward)")
    opener = urllib.request.build_opener(_NoRedirect)

    def fn(prompts, completions, labels, **kwargs):
        body = json.dumps({"prompts": prompts, "completions": completions, "labels": labels}).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        for attempt in range(retries):
            try:
                with opener.open(request, timeout=timeout) as response:
                    out = json.loads(response.read())
                if not isinstance(out, dict):
                    raise ValueError(f"expected a JSON object, got {type(out).__name__}")
                return out["rewards"] if "rewards" in out else out
            except urllib.error.HTTPError as e:
                if 300 <= e.code < 400:
                    raise ServiceDown(f"--remote_rm_url {url}: HTTP {e.code} redirect to "
                                      f"{e.headers.get('Location')} not followed (the POST would lose its "
                                      "body): give the URL that serves the rewards") from e
                if e.code not in (429, 502, 503, 504):
                    raise ServerError(f"--remote_rm_url {url}: HTTP {e.code} {e.reason} (an answer: not "
                                      "retried)") from e
                error = f"HTTP {e.code} {e.reason}"
            except urllib.error.URLError as e:
                error = f"unreachable ({e.reason})"
            except (OSError, TimeoutError) as e:
                error = f"no answer ({e!r})"
            except ValueError as e:
                raise ServerError(f"--remote_rm_url {url}: not a valid answer ({e}; not retried)") from e
            if attempt + 1 < retries:
                time.sleep(backoff * 2**attempt)
        # a server that never answered fails the batch: its samples are not retried one by one
        raise ServiceDown(f"--remote_rm_url {url}: no valid answer after {retries} tries: {error}")

    fn.__qualname__ = f"--remote_rm_url {url}"  # how reward messages name it
    return fn


def sequence_scores(model, input_ids, attention_mask):
    """Reward-model scores (B,): the head's output at each row's last attended token."""
    values = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=positions(attention_mask)).logits[..., 0]  # (B, L)
    last = attention_mask.shape[1] - 1 - attention_mask.flip(-1).argmax(-1)  # (B,)
    return values.gather(1, last.unsqueeze(-1)).squeeze(-1).float()


def reward_model_fn(path, device="cpu", dtype=None, batch_size=32, place=None):
    """A reward function scoring prompt + completion with the reward model at `path` (a sequence- or
    token-classification checkpoint), in the reward model's own tokenizer and chat template.
    place(model) -> model puts it where it costs least (sharded like the actor); default: on `device`."""
    import torch
    from transformers import AutoTokenizer

    model = load_value_model(path, dtype=dtype or torch.float32, flag="--reward_pretrain")
    model = model.eval().requires_grad_(False)
    model = place(model) if place else model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

    def text(prompt, completion):
        if isinstance(prompt, str):
            return prompt + completion
        if tokenizer.chat_template is None:
            return "\n".join(m["content"] for m in prompt) + "\n" + completion
        return tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": completion}],
                                             tokenize=False)

    @torch.no_grad()
    def fn(prompts, completions, labels, **kwargs):
        texts, scores = [text(p, c) for p, c in zip(prompts, completions)], []
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(texts[i:i + batch_size], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
            scores += sequence_scores(model, enc["input_ids"], enc["attention_mask"]).tolist()
        return scores

    return fn


def reward_sources(reward_fn=None, remote_rm_url=None, reward_pretrain=None, device="cpu", dtype=None,
                   place=None, default_rule="answer"):
    """A run's (name, fn) reward sources: "rule" (--reward_fn or --remote_rm_url; the built-in default_rule
    when no source is given at all), then "rm0", "rm1"... for the comma-separated --reward_pretrain."""
    rule = (load_reward_fn(reward_fn) if reward_fn
            else remote_reward_fn(remote_rm_url) if remote_rm_url else None)
    models = reward_pretrain.split(",") if reward_pretrain else []
    sources = [("rule", rule or BUILTIN_REWARDS[default_rule])] if rule or not models else []
    return sources + [(f"rm{i}", reward_model_fn(path, device, dtype, place=place))
                      for i, path in enumerate(models)]
