"""Prompt data: the built-in tasks (arithmetic for text, shapes for images), local files through `datasets`,
and prompt encoding.

A prompt row is {"prompt": str | list of chat messages, "label": str} (and "images" for the shapes task).
"""

import itertools
import json
import os
import random

from rft_core.errors import DataError, MissingColumn, MissingPath

# Few-shot turns: SmolLM2-135M never emits <answer> tags unprompted (0 of 2,560 samples measured),
# but copies the format from two worked examples and gets easy problems right. The worked form
# "a + b = c" lets the model use the arithmetic it knows before committing to the tagged answer.
ARITHMETIC_SYSTEM = ("Solve the arithmetic problem. Write the equation, then the final answer in "
                     "<answer></answer> tags.")
ARITHMETIC_SHOTS = (("2 + 3", 5), ("4 * 2", 8))


def _arithmetic_pools():
    """All problems, by family: 2-digit +/- 1-digit and 1-digit x 1-digit (784 in all)."""
    pools = {
        "+": [(a, b, a + b) for a in range(10, 50) for b in range(1, 10)],
        "-": [(a, b, a - b) for a in range(10, 50) for b in range(1, 10)],
        "*": [(a, b, a * b) for a in range(2, 10) for b in range(2, 10)],
    }
    shots = {q for q, _ in ARITHMETIC_SHOTS}
    return {op: [p for p in ps if f"{p[0]} {op} {p[1]}" not in shots] for op, ps in pools.items()}


def _arithmetic_row(a, op, b, c):
    messages = [{"role": "system", "content": ARITHMETIC_SYSTEM}]
    for question, answer in ARITHMETIC_SHOTS:
        messages += [{"role": "user", "content": f"What is {question}?"},
                     {"role": "assistant", "content": f"{question} = {answer}\n<answer>{answer}</answer>"}]
    messages.append({"role": "user", "content": f"What is {a} {op} {b}?"})
    return {"prompt": messages, "label": str(c)}


def arithmetic_task(num_train=4096, num_eval=96, seed=0):
    """Seeded train/eval rows; eval problems (fixed, family-balanced) never appear in train."""
    pools = _arithmetic_pools()
    eval_rng = random.Random(1234)  # the eval split is the same whatever --seed is
    eval_rows, train_pools = [], {}
    for op, problems in pools.items():
        held = set(eval_rng.sample(range(len(problems)), num_eval // len(pools)))
        eval_rows += [_arithmetic_row(a, op, b, c) for i, (a, b, c) in enumerate(problems) if i in held]
        train_pools[op] = [p for i, p in enumerate(problems) if i not in held]
    rng = random.Random(seed)
    train_rows = []
    for _ in range(num_train):  # families equally likely, so easy and hard problems mix in a batch
        op = rng.choice(sorted(train_pools))
        a, b, c = rng.choice(train_pools[op])
        train_rows.append(_arithmetic_row(a, op, b, c))
    return train_rows, eval_rows


# The shapes task (train_ppo_vl.py's default): drawn shapes, a colour or a count to name in one word.
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
        box, kind = (x0, y0, x0 + side, y0 + side), rng.choice(("circle", "square", "triangle"))
        if kind == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif kind == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(x0, y0 + side), (x0 + side, y0 + side), (x0 + side // 2, y0)],
                         fill=COLOURS[colour])
    return image


def shapes_task(num_train=2048, num_eval=64, seed=0):
    """(train rows, eval rows) of {"images": [PIL image], "prompt": str, "label": str}: "what colour is the
    shape?" (one shape, 4 colours) and "how many shapes are there?" (1-3 shapes). The eval split comes from
    its own fixed seed, whatever `seed` is."""
    def rows(n, rng):
        out = []
        for i in range(n):
            colour = rng.choice(list(COLOURS))
            if i % 2 == 0:
                out.append({"images": [draw_shapes(colour, 1, rng)],
                            "prompt": "what colour is the shape ?", "label": colour})
            else:
                count = rng.randint(1, 3)
                out.append({"images": [draw_shapes(colour, count, rng)],
                            "prompt": "how many shapes are there ?", "label": NUMBERS[count - 1]})
        return out
    return rows(num_train, random.Random(seed)), rows(num_eval, random.Random(10**6 + 7))


def load_prompt_rows(path, input_key="prompt", label_key="label", flag="--prompt_data", extra_keys=(),
                     log=None):
    """(rows, number of unusable rows skipped) from a local JSONL / JSON / parquet / arrow file, a
    directory of them, or a `save_to_disk` directory; errors name `flag`, the file, the line or column.
    extra_keys: {column: its flag}, columns that must exist, copied into the rows as they are.
    log(message): told the skipped rows, if any, and the first of them."""
    if not os.path.exists(path):
        raise MissingPath(f"{flag} {path!r}: no such file or directory (built-in tasks: arithmetic in "
                          "train_ppo.py, shapes in train_ppo_vl.py)")
    ds = _load_dataset(path, flag)
    for key, key_flag in [(input_key, "--input_key"), (label_key, "--label_key"), *dict(extra_keys).items()]:
        if key is not None and key not in ds.column_names:
            raise MissingColumn(f"{flag} {path!r} has no column {key!r} (columns: {ds.column_names}); set "
                                f"{key_flag if flag != '--pretrain_data' else '--pretrain_key'}")
    rows, skipped = [], []
    for i, row in enumerate(ds):
        if _usable(row[input_key]):
            label = "" if label_key is None or row[label_key] is None else str(row[label_key])
            rows.append({"prompt": row[input_key], "label": label, "row": i,
                         **{k: row[k] for k in dict(extra_keys)}})
        else:
            skipped.append(i)
    if not rows:
        raise DataError(f"{flag} {path!r}: none of its {len(ds)} rows has a usable {input_key!r} "
                        "(a non-empty string or a list of chat messages with role and content)")
    if log and skipped:
        first = ds[skipped[0]][input_key]
        log(f"[data] {path}: skipped {len(skipped)} rows whose {input_key!r} is empty or malformed (first: "
            f"row {skipped[0]}, {type(first).__name__} {str(first)[:60]!r})")
    return rows, len(skipped)


def _load_dataset(path, flag):
    """The rows of a data file or directory through `datasets`; a bad file is one error naming it (and for
    JSON lines, the first line that does not parse)."""
    import datasets  # heavy; only needed for files

    if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
        ds = datasets.load_from_disk(path)
        return ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
    files = [os.path.join(path, f) for f in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
    kinds = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
    files = [f for f in files if os.path.splitext(f)[1] in kinds]
    found = {kinds[os.path.splitext(f)[1]] for f in files}
    if len(found) != 1:
        raise DataError(f"{flag} {path!r}: expected .jsonl/.json/.parquet/.arrow files of one kind, "
                        f"found {found or 'none'}")
    for f in files:
        if os.path.getsize(f) == 0 or (f.endswith((".json", ".jsonl")) and not open(f).read(1 << 16).strip()):
            raise DataError(f"{flag} {f!r}: the file is empty")
    try:
        return datasets.load_dataset(next(iter(found)), data_files=files, split="train")
    except Exception as e:  # datasets' own error buries the file and line in a long chain
        for f in files if files[0].endswith(".jsonl") else []:
            with open(f) as lines:
                for number, line in enumerate(lines, 1):
                    try:
                        json.loads(line) if line.strip() else None
                    except ValueError as bad:
                        raise DataError(f"{flag} {f!r}: line {number} is not valid JSON ({bad})") from e
        raise DataError(f"{flag} {path!r}: could not be read as {next(iter(found))} "
                        f"({type(e).__name__}: {str(e)[:300]})") from e


def batches(rows, rollout_batch_size, seed):
    """Global prompt batches, reshuffled every episode (identically on every rank), without end."""
    for episode in itertools.count():
        order = list(range(len(rows)))
        random.Random(seed + episode).shuffle(order)
        for i in range(0, len(order) - rollout_batch_size + 1, rollout_batch_size):
            yield [rows[j] for j in order[i:i + rollout_batch_size]]


def text_batches(path, key, batch_size, rank=0, world=1):
    """Endless batches of this rank's texts from the column `key` of a data file (the ptx loss's data). The
    file is read now, so a bad one is an error before training starts."""
    texts = [r["prompt"] for r in load_prompt_rows(path, key, None, "--pretrain_data")[0]
             if isinstance(r["prompt"], str)]
    if not texts:
        raise DataError(f"--pretrain_data {path!r}: no text rows in column {key!r}")
    texts = texts[rank::world] if len(texts) >= world else texts
    return (texts[i:i + batch_size] for _ in itertools.count() for i in range(0, len(texts), batch_size))


def _usable(prompt):
    if isinstance(prompt, str):
        return bool(prompt.strip())
    return (isinstance(prompt, list) and len(prompt) > 0
            and all(isinstance(m, dict) and "role" in m and isinstance(m.get("content"), str)
                    for m in prompt))


def encode_rows(tokenizer, rows, max_len, apply_chat_template=True, system_prompt=None):
    """([Sample] of the rows' prompts encoded, number skipped for being longer than max_len tokens). The texts
    are tokenized in one batch: a call per prompt took 2 s of every run's start on the built-in task."""
    from rft_core.experience import Sample

    texts = [prompt_text(tokenizer, r["prompt"], apply_chat_template, system_prompt) for r in rows]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    samples = [Sample(list(i), r["label"], r["prompt"]) for i, r in zip(ids, rows)]
    kept = [s for s in samples if len(s.prompt_ids) <= max_len]
    return kept, len(samples) - len(kept)


def prompt_text(tokenizer, prompt, apply_chat_template=True, system_prompt=None):
    """The text the model reads for a prompt given as a string (as is, without the chat template) or a list of
    chat messages (through the tokenizer's chat template, with the generation prompt)."""
    if isinstance(prompt, str):
        if not apply_chat_template:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    if system_prompt and prompt[0]["role"] != "system":
        prompt = [{"role": "system", "content": system_prompt}] + list(prompt)
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def encode_prompt(tokenizer, prompt, apply_chat_template=True, system_prompt=None):
    """Token ids of a prompt given as a string or a list of chat messages (the template holds the special
    tokens, so none are added)."""
    return tokenizer(prompt_text(tokenizer, prompt, apply_chat_template, system_prompt),
                     add_special_tokens=False)["input_ids"]
