"""Run train_ppo.py with response lengths set by a script, not by the model: the rollout's timing at real
sizes with random weights (which never stop on their own), on the counting task's length profile.

    python bench/scripted_lengths.py train_ppo.py --pretrain /tmp/qwen2-1.5b ...   # train_ppo.py's flags

Every call to the engine goes through Rollouts._generate, patched here: each group (a prompt) draws its N as
bench_partial.py's task does (80% in 3-15, 20% in 40-150), each of its answers is "1 2 ... N" long (a token
per digit and per space, and EOS) plus 0-4 tokens, and a share runs to --generate_max_len (12% of the long
groups' answers, 0.75% of the short ones': 3% in all, the GPU runs' share cut off). A request is given at
most what its answer has left (the scheduler's limit otherwise), and an answer that reaches its length ends
with EOS. EOS is blocked in the vLLM engine (a random model would stop at random; the transformers engine
has no logit bias, so there it may stop early, at 1 / vocabulary a token). The engine does the decoding
work of every token; only when an answer ends is scripted. Both the synchronous loop and partial rollout
go through the same patch, so their answers are the same length for the same prompt and sample.
"""

import os
import random
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rft_core import rollout  # noqa: E402

LONG_SHARE, RAMBLE_LONG, RAMBLE_SHORT = 0.2, 0.12, 0.0075


def answer_tokens(top):
    """'1 2 ... top' in SmolLM2's tokenizer: a token per digit and per space, and EOS."""
    return sum(len(str(i)) for i in range(1, top + 1)) + top


def scripted_length(prompt, j, max_len):
    """The length of answer j to this prompt (token ids): deterministic, so every arm draws the same."""
    rng = random.Random(hash(tuple(prompt)))
    long = rng.random() < LONG_SHARE
    top = rng.randint(40, 150) if long else rng.randint(3, 15)
    rng = random.Random(hash((tuple(prompt), j)))
    if rng.random() < (RAMBLE_LONG if long else RAMBLE_SHORT):
        return max_len
    return min(max_len, answer_tokens(top) + rng.randint(0, 4))


class Script:
    """Rollouts._generate with scripted answer lengths; `generate` is the unpatched one. It keeps each
    answer's (scripted length, tokens so far) by the token ids it continues from."""

    def __init__(self, generate):
        self.original, self.answers = generate, {}

    def __call__(self, rollouts, engine, prompts, limits, mm):
        eos, max_len = rollouts.settings.eos_token_id, rollouts.settings.max_new_tokens
        if hasattr(engine, "logit_bias"):  # vLLM's
            engine.logit_bias = {**(engine.logit_bias or {}), eos: -100.0}
        limits = limits if isinstance(limits, list) else [limits] * len(prompts)
        seen, plan = {}, []
        for p, limit in zip(prompts, limits):
            key = hash(tuple(p))
            if key in self.answers:  # a continued answer
                total, done = self.answers.pop(key)
            else:  # a new one: the j-th copy of its prompt in this call
                j = seen[key] = seen.get(key, -1) + 1
                total, done = scripted_length(p, j, max_len), 0
            plan.append((total, done, max(1, min(limit, total - done))))
        outputs = self.original(rollouts, engine, prompts, [cap for *_, cap in plan], mm)
        for p, (total, done, _), out in zip(prompts, plan, outputs):
            done += len(out.token_ids)
            if done >= total and total < max_len and out.token_ids:
                out.token_ids[-1] = eos  # the answer ends here
            elif not (out.token_ids and out.token_ids[-1] == eos):
                self.answers[hash(tuple(p) + tuple(out.token_ids))] = (total, done)
        return outputs


if __name__ == "__main__":
    script = Script(rollout.Rollouts._generate)
    rollout.Rollouts._generate = lambda self, engine, prompts, limits, mm: script(self, engine, prompts,
                                                                                  limits, mm)
    path, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(path, run_name="__main__")
