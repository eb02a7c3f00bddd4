"""The transformers engine (`--engine_type hf`): `generate` on the training model itself, weights shared.
The engine on a CPU, or where neither vLLM nor SGLang is installed."""

from contextlib import nullcontext
from dataclasses import replace

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from rft_core.engines.base import cut_at_stop, wants_logprobs
from rft_core.multimodal import mm_inputs


class StopTexts(StoppingCriteria):
    """Ends a row once its response's last tokens (the longest stop's UTF-8 bytes + 2: a token is a byte at
    least) hold a stop text; cut_at_stop then cuts the response there."""

    def __init__(self, tokenizer, stop, prompt_len):
        self.tokenizer, self.stop, self.prompt_len = tokenizer, stop, prompt_len
        self.span = max(len(s.encode()) for s in stop) + 2

    def __call__(self, input_ids, scores, **kwargs):
        tails = input_ids[:, self.prompt_len:][:, -self.span:].tolist()  # (B, <= span)
        texts = [self.tokenizer.decode(t, skip_special_tokens=False) for t in tails]
        return torch.tensor([any(s in text for s in self.stop) for text in texts], device=input_ids.device)


class HFEngine:
    def __init__(self, model, tokenizer, micro_batch_size=32, autocast_dtype=None, synced_gpus=False, stop=(),
                 stop_token_ids=()):
        self.model = model  # the unwrapped training model: always the current weights
        # sharded weights (ZeRO-3, FSDP2): every forward is a collective, so ranks step until all are done
        self.synced_gpus, self.tokenizer = synced_gpus, tokenizer
        self.micro_batch_size, self.autocast_dtype = micro_batch_size, autocast_dtype
        self.stop = tuple(stop)  # texts that end a response (EngineSettings.stop)
        self.stop_token_ids = tuple(t for t in (tokenizer.eos_token_id, *stop_token_ids) if t is not None)

    def sleep(self, needed_bytes=None):
        return False

    def wake_up(self, tags=None):
        pass

    def can_wake(self):
        return True

    def update_weights(self, model):
        self.model = model

    @torch.no_grad()
    def generate(self, prompt_token_ids, max_new_tokens, temperature=1.0, top_p=1.0, mm=None,
                 logprob_every=1):
        """max_new_tokens: one for all, or a list (one per prompt: requests of equal limits run together)."""
        was_training = self.model.training
        self.model.eval()  # also turns gradient checkpointing off, which `generate` cannot use
        mm = mm or [None] * len(prompt_token_ids)
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(mm)
        out = [None] * len(mm)
        for limit in dict.fromkeys(limits):  # in order of first appearance
            idx = [i for i, m in enumerate(limits) if m == limit]
            for j in range(0, len(idx), self.micro_batch_size):
                part = idx[j:j + self.micro_batch_size]
                gens = self._generate_batch([prompt_token_ids[i] for i in part], limit, temperature, top_p,
                                            [mm[i] for i in part])
                for i, g in zip(part, gens):
                    out[i] = g if wants_logprobs(i, logprob_every) else replace(g, logprobs=None)
        self.model.train(was_training)
        return out

    def _generate_batch(self, prompts, max_new_tokens, temperature, top_p, mm):
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + [*p] for p in prompts], device=device)  # (B, P)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        images = mm_inputs(mm, input_ids) or {}  # a vision-language model's, as the trainer builds them
        greedy = temperature == 0
        sampling = ({"do_sample": False} if greedy
                    else {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0})
        autocast = (torch.autocast(device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                    else nullcontext())
        stops = StoppingCriteriaList([StopTexts(self.tokenizer, self.stop, width)] if self.stop else [])
        with autocast:
            res = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      max_new_tokens=max_new_tokens, pad_token_id=pad,
                                      eos_token_id=list(self.stop_token_ids) or None,
                                      output_logits=True, return_dict_in_generate=True,
                                      synced_gpus=self.synced_gpus, stopping_criteria=stops, **sampling,
                                      **images)
        responses = res.sequences[:, width:]  # (B, T)
        logits = torch.stack(res.logits, 1).float() / (1.0 if greedy else temperature)  # (B, T, V), raw
        lse = torch.logsumexp(logits, -1)  # (B, T)
        logprobs = logits.gather(-1, responses.unsqueeze(-1)).squeeze(-1) - lse  # (B, T)
        # up to and including the stop (EOS too: it is an action); the rest pads the batch
        return [cut_at_stop(ids, lps, self.tokenizer, self.stop, self.stop_token_ids)
                for ids, lps in zip(responses.tolist(), logprobs.tolist())]
