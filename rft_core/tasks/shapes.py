"""The shapes task, train_ppo_vl.py's default: drawn shapes, a colour or a count to name in one word."""

import random

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
NUMBERS = ("one", "two", "three")
IMAGE_SIZE = 84  # 6 x 6 patches of 14 px -> 9 language-model tokens per image


def draw_shapes(colour, count, rng, size=IMAGE_SIZE):
    """A white image with `count` non-overlapping filled shapes (circle, square or triangle) of one colour."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    draw, cell = ImageDraw.Draw(image), size // 2
    for i in rng.sample(range(4), count):  # one shape per quadrant
        x0, y0 = (i % 2) * cell + rng.randint(2, 8), (i // 2) * cell + rng.randint(2, 8)
        side = rng.randint(cell // 2, cell - 12)
        kind = rng.choice(("circle", "square", "triangle"))
        box = (x0, y0, x0 + side, y0 + side)
        triangle = [(x0, y0 + side), (x0 + side, y0 + side), (x0 + side // 2, y0)]
        shape = {"circle": draw.ellipse, "square": draw.rectangle, "triangle": draw.polygon}[kind]
        shape(triangle if kind == "triangle" else box, fill=COLOURS[colour])
    return image


def shapes_task(num_train=2048, num_eval=64, seed=0):
    """(train, eval) rows {"images": [PIL image], "prompt", "label"}: "what colour is the shape?" (4 colours)
    and "how many shapes are there?" (1-3); the eval split has its own fixed seed."""
    def rows(n, rng):
        out = []
        for i in range(n):
            colour = rng.choice(list(COLOURS))
            if i % 2 == 0:
                count, prompt, label = 1, "what colour is the shape ?", colour
            else:
                count = rng.randint(1, 3)
                prompt, label = "how many shapes are there ?", NUMBERS[count - 1]
            out.append({"images": [draw_shapes(colour, count, rng)], "prompt": prompt, "label": label})
        return out
    return rows(num_train, random.Random(seed)), rows(num_eval, random.Random(10**6 + 7))
