"""Training health: stop a diverging run before its bad update is applied or saved (errors.TrainingDiverged
names the intact checkpoint and the fix). Before each optimizer step: non-finite gradients, or a norm
`explode_factor` times the run's median; every step and before a save: an entropy that reached log(V) from
well below (a collapse), non-finite weights, an update beyond `max_update_kl` nats per token. A resumed
checkpoint's weights must be finite (`check_resumed_weights`)."""

import math
import os
import statistics

import torch

from rft_core.errors import CheckpointError, TrainingDiverged
from rft_core.experience import micro_batch_logprobs
from rft_core.runs.checkpoint import checkpoint_step, latest_checkpoint, list_checkpoints


def nonfinite_inputs(exp):
    """The loss inputs of `exp` not finite on response tokens: "old_logprobs 3 tokens, ..." ("" if none)."""
    mask = exp.action_mask.bool()  # (B, T)
    found = []
    for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs", "advantages", "values", "returns",
                 "rewards"):
        values = getattr(exp, name)
        if values is None:
            continue
        values = values.unsqueeze(-1).expand(mask.shape) if values.dim() == 1 else values  # (B, T)
        bad = ~torch.isfinite(values) & mask
        if name == "rollout_logprobs":  # only on the rows the engine returned logprobs for
            bad &= exp.rollout_known().any(-1, keepdim=True)
        if bad.any():
            found.append(f"{name} {int(bad.sum())} tokens")
    return ", ".join(found)


@torch.no_grad()
def check_resumed_weights(models, ckpt, accelerator):
    """Collective. The weights just loaded from ckpt are finite, or a CheckpointError: a NaN weight would
    otherwise surface later as a sampling error far from its cause."""
    bad = [name for model in models for name, p in model.named_parameters()
           if not torch.isfinite(getattr(p, "ds_tensor", p)).all()]  # (ZeRO-3: this rank's shard)
    if not accelerator.reduce(torch.tensor(float(len(bad)), device=accelerator.device), "sum").item():
        return
    older = [c for c in list_checkpoints(os.path.dirname(ckpt)) if checkpoint_step(c) < checkpoint_step(ckpt)]
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    where = f" ({bad[0].removeprefix('module.')}{more}, on this rank)" if bad else ""
    fix = (f"delete it to resume from {os.path.basename(older[-1])}, or pass --no_resume to start afresh"
           if older else "pass --no_resume to start afresh (there is no older checkpoint)")
    raise CheckpointError(f"{ckpt}: its weights hold NaN or inf once loaded{where}, so it is damaged; {fix}")


class HealthGuard:
    def __init__(self, output_dir, vocab_size, explode_factor=1e4, max_update_kl=1.0):
        self.output_dir, self.explode_factor, self.max_update_kl = output_dir, explode_factor, max_update_kl
        self.max_entropy = math.log(vocab_size)  # the uniform distribution's
        self.norms, self.first_entropy = {}, None  # earlier gradient norms by key; the run's first entropy

    def grad_norm(self, key, norm, step, experience=None):
        """Before the optimizer step: `norm` (pre-clip) of `key` is finite and has not exploded."""
        if not math.isfinite(norm):
            found = nonfinite_inputs(experience) if experience is not None else ""
            where = f"; not finite in the step's inputs: {found}" if found else ""
            advice = None
            if experience is not None and not found and not self.norms.get(key):
                # the first update of this process: the weights are as loaded, so no learning rate made it
                advice = ("the step's inputs are finite and no update has run yet, so the model's forward "
                          "or backward gave it, not the learning rate: rerun with --torch_compile false")
            self.stop(f"non-finite loss or gradients ({key} {norm}{where})", step, advice)
        earlier = [x for x in self.norms.setdefault(key, []) if x > 0]
        if len(earlier) >= 3 and norm > self.explode_factor * statistics.median(earlier):
            times = norm / statistics.median(earlier)
            self.stop(f"the gradient norm exploded ({key} {norm:.3g}, {times:.0f} times the run's median)",
                      step)
        self.norms[key].append(norm)

    def entropy(self, entropy, step, what="the policy"):
        """A collapse of the mean entropy to uniform stops the run (one that starts near it is left alone)."""
        if entropy is None:
            return
        if not math.isfinite(entropy):
            self.stop(f"{what} is not finite (entropy {entropy})", step)
        self.first_entropy = entropy if self.first_entropy is None else self.first_entropy
        if self.first_entropy < 0.5 * self.max_entropy and entropy >= 0.9 * self.max_entropy:
            self.stop(f"{what} collapsed: entropy {entropy:.2f}, at the uniform bound log(V) = "
                      f"{self.max_entropy:.2f}, from {self.first_entropy:.2f} at the start", step)

    @torch.no_grad()
    def before_checkpoint(self, model, experience, split, fwd, accelerator, step):
        """Collective. The weights about to be saved are finite; on the first micro-batch, the entropy not
        collapsed, the k1 KL to the sampling policy within `max_update_kl` nats per token (sane: ~0.001)."""
        bad = sum(int(not torch.isfinite(p).all()) for p in model.parameters())
        if accelerator.reduce(torch.tensor(float(bad), device=accelerator.device), "sum").item():
            self.stop("the updated weights are not finite", step)
        mb = experience.split(**split, fwd=fwd)[0]  # split: Experience.split's sizes; fwd: a Forward
        # eager: compiled layers would compile again for no-grad forwards (~7 s at 135M on an H100)
        with accelerator.autocast(), torch.compiler.set_stance("force_eager"):
            logprobs, entropy = micro_batch_logprobs(model, mb, fwd, with_entropy=True)
        mask = mb.action_mask
        tokens = mask.sum().clamp(min=1)  # (a sequence-parallel slice may hold none)
        # k1 KL on the samples of the old policy whose engine logprobs are known
        known = mb.rollout_known()
        kl = torch.where(known, mb.rollout_logprobs - logprobs.float(), 0.0).sum() / known.sum().clamp(min=1)
        means = accelerator.reduce(torch.stack([(entropy * mask).sum() / tokens, kl]), "mean").tolist()
        self.entropy(means[0], step, "the updated policy")
        if not means[1] <= self.max_update_kl:
            self.stop(f"the update moved the policy by {means[1]:.3g} nats per token (KL to the policy that "
                      f"sampled the step; a sane update: about 0.001)", step)

    def stop(self, what, step, advice=None):
        """Raise TrainingDiverged naming the newest intact checkpoint and the fix (advice, or a lower LR)."""
        ckpt = latest_checkpoint(self.output_dir)
        fix = advice or f"rerun with a lower --actor_learning_rate{' (or other flags)' if ckpt else ''}"
        where = (f"{os.path.basename(ckpt)} is the newest intact checkpoint: {fix} and it resumes from "
                 "there, or add --no_resume to start afresh" if ckpt else
                 f"no checkpoint was written before it: {fix}")
        raise TrainingDiverged(f"{what} at step {step}, and nothing of it was saved; {where}")
