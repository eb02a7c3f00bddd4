"""Find where a non-finite gradient arises in a training script (or a wrapper of one, e.g.
bench/scripted_lengths.py). Two modes:

    python bench/nan_probe.py bench/scripted_lengths.py train_ppo.py ...            # anomaly mode
    RFT_PROBE=shapes python bench/nan_probe.py bench/scripted_lengths.py train_ppo.py ...

anomaly: autograd's anomaly mode; the first backward op whose output is not finite raises, with the
traceback of the forward op behind it (not with torch.compile). shapes: after every backward, the trained
model's gradients are checked; at the first non-finite one it prints the micro-batches' shapes so far (input
ids (B, L), left padding per row, response tokens), the parameters whose gradients are not finite, saves the
micro-batch's inputs to $OUT/nan_batch.pt and stops.
"""

import os
import runpy
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
seen, models, last = [], [], {}


def probe_shapes():
    from rft_core import logprobs, models as rft_models

    token_logprobs, compile_blocks, backward = logprobs.token_logprobs, rft_models.compile_blocks, \
        torch.Tensor.backward

    def record(model, inputs, targets, *args, **kwargs):
        mask = inputs.get("attention_mask")
        ids = inputs["input_ids"]
        pads = (mask == 0).long().cumprod(-1).sum(-1).tolist() if mask is not None else None
        seen.append({"shape": tuple(ids.shape), "left_pad": pads, "targets": tuple(targets.shape)})
        last.clear()  # only the newest micro-batch's inputs are kept (on the GPU, as the trainer has them)
        last.update(inputs, targets=targets)
        return token_logprobs(model, inputs, targets, *args, **kwargs)

    def capture(model, *args, **kwargs):
        models.append(model)
        return compile_blocks(model, *args, **kwargs)

    def checked(tensor, *args, **kwargs):
        backward(tensor, *args, **kwargs)
        bad = [n for m in models for n, p in m.named_parameters()
               if p.grad is not None and not torch.isfinite(p.grad).all()]
        if bad:
            print(f"[probe] non-finite gradients after micro-batch {len(seen)}: {len(bad)} parameters, "
                  f"first {bad[:6]}, last {bad[-3:]}", flush=True)
            for i, s in enumerate(seen):
                print(f"[probe] micro-batch {i + 1}: input {s['shape']} targets {s['targets']} "
                      f"left pad {s['left_pad']}", flush=True)
            saved = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in last.items()}
            torch.save(saved, os.path.join(os.environ.get("OUT", "/tmp"), "nan_batch.pt"))
            raise SystemExit(3)

    logprobs.token_logprobs, rft_models.compile_blocks, torch.Tensor.backward = record, capture, checked


if __name__ == "__main__":
    if os.environ.get("RFT_PROBE") == "shapes":
        probe_shapes()
    else:
        torch.autograd.set_detect_anomaly(True, check_nan=True)
    path, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(path, run_name="__main__")
