"""Where the vision-language engine's weight sync goes (one GPU with vllm): gathering the weights, vLLM's
load_weights, the prefix- and encoder-cache resets, and the whole update_weights, four rounds, synchronised.
On the H100 the prefix-cache reset took 0.28 s per sync before the KV cache was capped for small models
(rft_core/vllm_engine.py: kv_cache_bytes), 0.3 ms after.

    python bench/vl_sync_breakdown.py        # from the repository root
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    from rft_core.engine import create_engine
    from rft_core.vision import load_vl_model
    from rft_core.vllm_engine import iter_weights
    from tests.test_engine_vl import ENGINE

    model, tokenizer, processor = load_vl_model()
    model = model.cuda()
    engine = create_engine("vllm", model, tokenizer, processor, **ENGINE)

    def timed(fn):
        torch.cuda.synchronize()
        start = time.time()
        result = fn()
        torch.cuda.synchronize()
        return result, time.time() - start

    for _ in range(4):
        weights, t_iter = timed(lambda: list(iter_weights(model, torch.bfloat16)))
        _, t_load = timed(lambda: engine._runner_model().load_weights(weights))
        _, t_prefix = timed(engine.llm.reset_prefix_cache)
        _, t_encoder = timed(engine.llm.llm_engine.reset_encoder_cache)
        _, t_all = timed(lambda: engine.update_weights(model))
        print(f"iter {t_iter:.4f} load {t_load:.4f} reset_prefix {t_prefix:.4f} "
              f"reset_encoder {t_encoder:.4f} update_weights {t_all:.4f}", flush=True)


if __name__ == "__main__":
    main()
