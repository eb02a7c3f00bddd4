"""How far a merged-LoRA engine's policy is from the trainer's (CPU, the embedded SmolLM2-135M in bf16).

The trainer computes a LoRA layer as base(x) + scale * B(A(x)) with the base in bf16; the engines get the
merged weight bf16(W + scale * B A), which rounds every element by up to half a bf16 ulp once B is non-zero.
Prints the mean |trainer logprob - merged-model logprob| over 8 arithmetic prompts with a fixed answer, for
adapters of growing size (B drawn at each scale; A as peft initialises it).

    python bench/lora_merge_gap.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    from rft_core.data import arithmetic_task, encode_rows
    from rft_core.models import load_model_and_tokenizer, lora_model, merged_state_dict

    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer()
    rows, _ = arithmetic_task(seed=0)
    samples, _ = encode_rows(tokenizer, rows[:8], 256, True, None)
    answer = tokenizer("The answer is 42 because 6 times 7 is 42.", add_special_tokens=False)["input_ids"]
    ids = [s.prompt_ids + answer for s in samples]
    width = max(map(len, ids))
    ids = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids])
    mask = (ids != tokenizer.pad_token_id)[:, 1:]

    def logprobs(net):  # (B, T-1) of the tokens that follow
        with torch.no_grad():
            logits = net(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]

    lora = lora_model(model.to(torch.bfloat16), 16, 32)
    plain, _ = load_model_and_tokenizer()
    plain = plain.to(torch.bfloat16)
    for scale in (0.0, 1e-3, 3e-3, 1e-2):
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * scale)
        plain.load_state_dict(merged_state_dict(lora))
        gap = ((logprobs(lora) - logprobs(plain)).abs() * mask).sum() / mask.sum()
        print(f"lora_B ~ N(0, {scale:g}): mean |trainer - merged bf16| logprob {gap.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
