"""Run train_ppo.py with the rollout engine RFT_LAG weight versions behind the trainer: a pure delay through
the synchronous loop (no buffer, no partial rollout code, every sample from one version), the control for
partial rollout's staleness (issue 16).

    RFT_LAG=1 python bench/lagged_engine.py train_ppo.py --tis_cap 2 ...        # train_ppo.py's flags
    python bench/bench_partial.py --engine_lag 1 --modes sync_tis ...           # the same, through the bench

Each weight sync keeps the trainer's weights as a version and loads into the engine the one RFT_LAG syncs
older (the oldest there is until then), so from step RFT_LAG + 1 on every sample is exactly RFT_LAG versions
old. The loss sees it as partial rollout's is seen: with --tis_cap, the importance weights between the
trainer's logprobs before the update and the engine's (here: the old version's). Greedy calls (the held-out
evaluation) load the live weights, and the next sampling call the old ones again: the evaluation measures
the trainer. vLLM (versions kept on the GPU in its dtype: 0.27 GB a version at 135M) and the transformers
engine (a copy of the model). Session 16 ran the transformers half as a patch
(bench/results/partial_cpu/pure_delay.patch).
"""

import copy
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rft_core import engine as hf_engine  # noqa: E402
from rft_core import vllm_engine  # noqa: E402

LAG = int(os.environ.get("RFT_LAG", "1"))


def vllm_update_weights(self, model):
    """Keep this version; load the one LAG syncs older (the first sync, at start, is version 0)."""
    self.wake_up(["weights"])
    self.versions = getattr(self, "versions", []) + [list(vllm_engine.iter_weights(model, self.dtype))]
    self.versions = self.versions[-(LAG + 1):]
    self.loaded = None  # the list moved on: the index of what the engine holds no longer says which
    self.load_version(0)


def vllm_load_version(self, index):
    """Load self.versions[index] (0: the oldest kept, -1: the live weights) into the engine."""
    index %= len(self.versions)
    if getattr(self, "loaded", None) == index:
        return
    target = self._runner_model()
    for bucket in vllm_engine.buckets(iter(self.versions[index]), self.bucket_bytes):
        target.load_weights(bucket)
    self.llm.reset_prefix_cache()  # cached KV blocks were computed by other weights
    self.loaded = index


def hf_start(self, model):
    """The transformers engine samples with self.model: a copy holds the old weights, `live` the trainer."""
    if not hasattr(self, "old"):
        self.live, self.old, self.versions = model, copy.deepcopy(model), [copy.deepcopy(model.state_dict())]


def hf_update_weights(self, model):
    hf_start(self, model)
    self.live = model
    self.versions = (self.versions + [copy.deepcopy(model.state_dict())])[-(LAG + 1):]
    self.old.load_state_dict(self.versions[0])


def engine_generate(original, hf):
    def generate(self, prompt_token_ids, max_new_tokens, temperature=1.0, *args, **kwargs):
        greedy = temperature == 0  # the held-out evaluation: the live weights; sampling: the old ones
        if hf:
            hf_start(self, self.model)  # (before the first sync the engine's model is version 0)
            self.model = self.live if greedy else self.old
        else:
            self.load_version(-1 if greedy else 0)
        return original(self, prompt_token_ids, max_new_tokens, temperature, *args, **kwargs)
    return generate


def install():
    if LAG < 1:
        raise SystemExit(f"RFT_LAG={LAG}: a lag of at least one version (0 is the plain synchronous loop)")
    V, H = vllm_engine.VLLMEngine, hf_engine.HFEngine
    V.update_weights, V.load_version = vllm_update_weights, vllm_load_version
    V.generate = engine_generate(V.generate, hf=False)
    H.update_weights, H.generate = hf_update_weights, engine_generate(H.generate, hf=True)


if __name__ == "__main__":
    install()
    path, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(path, run_name="__main__")
