"""Save the built-in tiny vision-language model (random weights, the word-level tokenizer) as an HF directory,
so `train_ppo_vl.py --pretrain DIR` goes through the checkpoint path (AutoModelForImageTextToText,
AutoTokenizer).

    python examples/save_tiny_vl.py DIR [--arch qwen2_vl|qwen2_5_vl]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    from rft_core.vision import tiny_qwen2_vl, word_tokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--arch", default="qwen2_vl")
    args = parser.parse_args()
    tokenizer = word_tokenizer()
    tiny_qwen2_vl(tokenizer, arch=args.arch).save_pretrained(args.dir)
    tokenizer.save_pretrained(args.dir)


if __name__ == "__main__":
    main()
