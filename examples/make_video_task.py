"""A small file dataset of videos for train_ppo_vl.py: each prompt is a clip of 4 drawn frames (84 x 84 PNGs)
in which every shape has one colour, asked "what colour is the shape ?" (answer: the colour). It exercises the
video path end to end (the file loader, the video processor, vLLM video requests); writes DIR/train.jsonl and
DIR/eval.jsonl.

    python examples/make_video_task.py DIR [--num_train 256 --num_eval 32]
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    from rft_core.tasks.shapes import COLOURS, draw_shapes

    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--num_train", type=int, default=256)
    parser.add_argument("--num_eval", type=int, default=32)
    args = parser.parse_args()
    os.makedirs(os.path.join(args.dir, "frames"), exist_ok=True)
    rng = random.Random(0)
    for split, n in (("train", args.num_train), ("eval", args.num_eval)):
        with open(os.path.join(args.dir, f"{split}.jsonl"), "w") as f:
            for i in range(n):
                colour, paths = rng.choice(list(COLOURS)), []
                for t in range(4):
                    path = f"frames/{split}{i}_{t}.png"
                    draw_shapes(colour, rng.randint(1, 3), rng).save(os.path.join(args.dir, path))
                    paths.append(path)
                f.write(json.dumps({"prompt": "what colour is the shape ?", "label": colour,
                                    "images": [paths]}) + "\n")


if __name__ == "__main__":
    main()
