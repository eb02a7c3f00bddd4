"""Where a run's rewards come from: a --reward_fn file's function (or a built-in rule), a remote reward server
(--remote_rm_url, JSON over HTTP), local reward models (--reward_pretrain): `reward_sources` gives a run's
list for rewards.RewardScorer. `start_workers` starts the user code's workers."""

import json
import time
import urllib.error
import urllib.parse
import urllib.request

from rft_core.environments import load_env
from rft_core.errors import ConfigError
from rft_core.logprobs import positions
from rft_core.model_training import load_value_model
from rft_core.rewards import BUILTIN_REWARDS, ServerError, ServiceDown, file_reward
from rft_core.workers import Workers


def start_workers(reward_fn, env, size, timeout, seed=0, rank=0, log=print, env_concurrency=0):
    """The --workers processes running the --reward_fn file's function and the --env, or None; a load failure
    is one line here, before any model loads. env_concurrency: env calls in flight at most (0, sync: size)."""
    if env_concurrency < 0:
        raise ConfigError(f"--env_concurrency {env_concurrency}: must be >= 0 (0: as many as --workers)")
    targets = {"env": (load_env, env)} if env else {}
    if reward_fn and reward_fn not in BUILTIN_REWARDS:
        targets["reward_fn"] = (file_reward, reward_fn)
    workers = Workers(targets, size, timeout, seed, rank, log, env_concurrency) if targets else None
    if env and env_concurrency > size and not workers.concurrent["env"]:
        log(f"[workers] --env_concurrency {env_concurrency}: the --env's reset and step are not async, so at "
            f"most --workers {size} calls run at once; raise --workers or make step async (async def)")
    return workers


def load_reward_fn(spec, workers=None, timeout=60.0):
    """A built-in reward by name, else one running 'path/to/file.py:NAME' in `workers` (or its own)."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    workers = workers or Workers({"reward_fn": (file_reward, spec)}, timeout=timeout)

    def fn(prompts, completions, labels, **kwargs):  # those the file's function takes (rewards.file_reward)
        return workers.call("reward_fn", None, (prompts, completions, labels, kwargs), timeout)

    fn.path, _, fn.__qualname__ = spec.rpartition(":")  # how reward messages name it (rewards.describe)
    fn.workers = workers
    return fn


def remote_reward_fn(url, timeout=30.0, retries=3, backoff=1.0):
    """A reward function POSTing {"prompts", "completions", "labels"} to `url`, reading {"rewards": [...]}
    (or components). Unreachable, timed out or busy (HTTP 429, 502-504): retried with backoff, then
    ServiceDown (so is a redirect); another error status or a body not its JSON: ServerError, not retried."""
    parts = urllib.parse.urlsplit(url)
    try:
        _ = parts.port  # raises past 65535, where a request would wrap around to another service
    except ValueError as e:
        raise ConfigError(f"--remote_rm_url {url!r}: {e} (e.g. http://host:5000/reward)") from e
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"--remote_rm_url {url!r}: not an http(s) URL (e.g. http://host:5000/reward)")
    no_redirect = urllib.request.HTTPRedirectHandler()
    # a redirect comes back as its HTTPError: urllib would resend the POST as a GET without its body
    no_redirect.redirect_request = lambda *args: None
    opener = urllib.request.build_opener(no_redirect)

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
    """A reward function scoring prompt + completion with the reward model at `path` in its own tokenizer
    and chat template; place(model) -> model puts it where it costs least (sharded like the actor)."""
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
                   workers=None, timeout=60.0, place=None, default_rule="answer"):
    """A run's (name, fn) sources: "rule" (--reward_fn in `workers`, or --remote_rm_url, else default_rule
    when there is none), then "rm0", "rm1"... for --reward_pretrain's; timeout: a call's, in seconds."""
    rule = (load_reward_fn(reward_fn, workers, timeout) if reward_fn
            else remote_reward_fn(remote_rm_url, timeout) if remote_rm_url else None)
    models = reward_pretrain.split(",") if reward_pretrain else []
    sources = [("rule", rule or BUILTIN_REWARDS[default_rule])] if rule or not models else []
    return sources + [(f"rm{i}", reward_model_fn(path, device, dtype, place=place))
                      for i, path in enumerate(models)]
