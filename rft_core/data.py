"""Prompt data: local files through `datasets`, the prompt stream, and prompt encoding (built-in tasks:
rft_core/tasks/). A row: {"prompt": str | chat messages, "label": str, "columns": the rest} (and "images")."""

import itertools
import json
import os
import random
import re
import tempfile

from rft_core.errors import DataError, MissingColumn, MissingPath
from rft_core.experience import Sample
from rft_core.models import HUB_ID

KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}  # file readers
JSON_TYPES = {type(None): "null", bool: "boolean", list: "list", dict: "object"}  # as JSON names them
REWARD_ARGS = ("prompts", "completions", "labels", "turns", "info")  # named by rewards.RewardScorer
JSON_ARROW = ("string", "large_string", "bool", "null", "int", "uint", "halffloat", "float", "double")


def load_prompt_rows(path, input_key="prompt", label_key="label", flag="--prompt_data", extra_keys=(),
                     log=None):
    """(rows, number of unusable rows skipped) from a local JSONL / JSON / parquet / arrow file, a directory
    of them, or a `save_to_disk` directory; errors name `flag`, the file, the line or column. extra_keys:
    {column: its flag}, required columns copied into the rows. log(message): told what was skipped."""
    ds = _load_dataset(path, flag, log) if os.path.exists(path) else _load_hub(path, flag)
    for key, key_flag in [(input_key, "--input_key"), (label_key, "--label_key"), *dict(extra_keys).items()]:
        if key is not None and key not in ds.column_names:
            raise MissingColumn(f"{flag} {path!r} has no column {key!r} (columns: {ds.column_names}); set "
                                f"{key_flag if flag != '--pretrain_data' else '--pretrain_key'}")
    others = {k: ds.features.type.field(k).type for k in ds.column_names
              if k not in (input_key, label_key, *dict(extra_keys))}
    columns = [k for k, kind in others.items() if k not in REWARD_ARGS and _json_like(kind)]
    rows, skipped, coerced = [], [], {}  # coerced: {JSON type of a label: [(row, text it is read as)]}
    for i, row in enumerate(ds):
        if _usable(row[input_key]):
            label = None if label_key is None else row[label_key]
            text = "" if label is None else str(label)
            if isinstance(label, (list, dict)):
                text = json.dumps(label, ensure_ascii=False, default=str)
            if label_key and (not isinstance(label, (str, int, float)) or isinstance(label, bool)):
                coerced.setdefault(JSON_TYPES.get(type(label), type(label).__name__), []).append((i, text))
            rows.append({"prompt": row[input_key], "label": text, "row": i,
                         "columns": {k: row[k] for k in columns}, **{k: row[k] for k in dict(extra_keys)}})
        else:
            skipped.append(i)
    if not rows:
        raise DataError(f"{flag} {path!r}: none of its {len(ds)} rows has a usable {input_key!r} "
                        "(a non-empty string or a list of chat messages with role and content)")
    if log and skipped:
        first = ds[skipped[0]][input_key]
        log(f"[data] {path}: skipped {len(skipped)} rows whose {input_key!r} is empty or malformed (first: "
            f"row {skipped[0]}, {type(first).__name__} {str(first)[:60]!r})")
    if log and coerced:  # a number is the usual label: read as its text, unsaid
        kinds = [f"{kind} in {len(at)} row{'s' if len(at) > 1 else ''} (first: row {at[0][0]}, read as "
                 f"{at[0][1][:40]!r})" for kind, at in coerced.items()]
        log(f"[data] {path}: {sum(map(len, coerced.values()))} {label_key!r} values are not text or numbers: "
            f"{', '.join(kinds)}; the reward gets each as text (lists and objects: their JSON)")
    if log and (dropped := [f"{k!r} ({kind})" for k, kind in others.items() if k not in columns]):
        log(f"[data] {path}: columns {', '.join(dropped)} do not reach the reward: rename one named like a "
            f"reward argument ({', '.join(REWARD_ARGS)}); cast one whose values are not JSON to text")
    return rows, len(skipped)


def _json_like(kind):
    """Whether an Arrow type's values are JSON: text, numbers, booleans, nulls, lists and structs of them."""
    kind = getattr(kind, "storage_type", kind)  # an extension type's (datasets' Json: text)
    if kind.num_fields:  # a list's values, a struct's fields
        return all(_json_like(kind.field(i).type) for i in range(kind.num_fields))
    return str(kind).startswith(JSON_ARROW)


def _load_dataset(path, flag, log=None):
    """The rows of a data file or directory through `datasets`; a bad file is one error naming it (for JSON,
    the first line that is not UTF-8, does not parse, or repeats a key)."""
    import datasets  # heavy; only needed for files

    if any(os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json")):
        return _load_saved(path, flag, log)
    entries = [os.path.join(path, f) for f in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
    files = [f for f in entries if os.path.isfile(f) and os.path.splitext(f)[1] in KINDS]
    other = [os.path.basename(f) + "/" * os.path.isdir(f) for f in entries if f not in files]
    found = {KINDS[os.path.splitext(f)[1]] for f in files}
    if log and other:
        log(f"[data] {path}: skipped {len(other)} entries that are not .jsonl/.json/.parquet/.arrow files: "
            f"{', '.join(other[:5])}{' ...' if len(other) > 5 else ''}")
    if len(found) != 1:
        raise DataError(f"{flag} {path!r}: expected .jsonl/.json/.parquet/.arrow files of one kind, found "
                        f"{found or 'none'}{' in that directory' * os.path.isdir(path)}")
    for f in files:
        if os.path.getsize(f) == 0 or (f.endswith((".json", ".jsonl"))
                                       and not open(f, "rb").read(1 << 16).strip(b" \t\r\n\xef\xbb\xbf")):
            raise DataError(f"{flag} {f!r}: the file is empty")
    kind = found.pop()
    try:  # datasets' own cache is keyed by path and modification time: it served an edited file's old rows
        with tempfile.TemporaryDirectory() as cache:
            ds = datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache,
                                       keep_in_memory=True)
        ds.data.table.validate(full=True)  # pyarrow reads JSON that is not UTF-8, to fail on its rows later
        return ds
    except Exception as e:  # datasets' own error buries the file and line in a long chain
        for f in files:
            if problem := _json_problem(f) if kind == "json" else _table_problem(f, kind):
                raise DataError(f"{flag} {f!r}: {problem}") from e
        raise DataError(f"{flag} {path!r}: could not be read as {kind} "
                        f"({type(e).__name__}: {str(e)[:300]})") from e


def _load_hub(path, flag):
    """A hub dataset, `org/name[:config[:split]]` (split: train), through `datasets` and its cache (read
    alone offline: HF_HUB_OFFLINE)."""
    import datasets

    name, config, split = (path.split(":", 2) + ["", ""])[:3]
    if not re.fullmatch(HUB_ID, name) or name.endswith(tuple(KINDS)):  # (a missing data/train.jsonl)
        raise MissingPath(f"{flag} {path!r}: no such file or directory, nor a hub dataset name "
                          "(org/name[:config[:split]]; built-in tasks: train_ppo.py: arithmetic, multiply; "
                          "train_ppo_vl.py: shapes)")
    try:
        return datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as e:  # (not found, gated, no such config or split, offline and not cached...)
        fix = ("; offline runs read datasets' cache (HF_DATASETS_CACHE): load it once where the hub is "
               "reachable, or pass a local file" if isinstance(e, ConnectionError) else "")
        raise DataError(f"{flag} {path!r}: not a local path, and the hub dataset could not be loaded "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:300]}){fix}") from e


def _load_saved(path, flag, log=None):
    """A `save_to_disk` Dataset, or a DatasetDict's "train" split; a damaged Arrow file is one error."""
    import datasets

    try:
        ds = datasets.load_from_disk(path)
        for split in ds.values() if isinstance(ds, datasets.DatasetDict) else [ds]:
            split.data.table.validate(full=True)
    except Exception as e:
        for f in sorted(os.path.join(root, n) for root, _, names in os.walk(path) for n in names):
            if f.endswith(".arrow") and (problem := _table_problem(f, "arrow")):
                raise DataError(f"{flag} {f!r}: {problem}") from e
        raise DataError(f"{flag} {path!r}: could not be read as a save_to_disk directory "
                        f"({type(e).__name__}: {str(e)[:300]})") from e
    if not isinstance(ds, datasets.DatasetDict):
        return ds
    if "train" not in ds:
        raise DataError(f"{flag} {path!r} is a DatasetDict without a 'train' split (splits: {list(ds)}): "
                        f"pass one split's directory, e.g. {os.path.join(path, next(iter(ds)))}")
    if log and len(ds) > 1:
        log(f"[data] {path}: a DatasetDict: its 'train' split is read (splits: {', '.join(ds)}; pass "
            "another's directory to read that)")
    return ds["train"]


def _table_problem(path, kind):
    """What makes a parquet or Arrow file unreadable (pyarrow's words and the fix), or None."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            pq.read_table(path)
        else:  # datasets writes Arrow streams; the file format reads too
            try:
                pa.ipc.open_stream(path).read_all()
            except pa.ArrowInvalid:
                pa.ipc.open_file(path).read_all()
    except (pa.ArrowException, OSError) as e:
        said = " ".join(str(e).split())[:150]  # (pyarrow's messages hold line breaks)
        return (f"not a readable {kind} file, damaged or cut short ({type(e).__name__}: {said}): "
                "write it again (Dataset.save_to_disk, to_parquet)")
    return None


def _json_problem(path):
    """Why a JSON / JSON lines file is unreadable (not UTF-8, a line that does not parse...), or None."""
    stem, ext = os.path.splitext(path)
    with open(path, "rb") as f:
        encoding = json.detect_encoding(f.read(4))  # by a byte order mark, or the NUL bytes of ASCII text
        if not encoding.startswith("utf-8"):
            name = encoding.upper() if encoding in ("utf-16", "utf-32") else None  # (a byte order mark's)
            return (f"the file is {name or 'UTF-16 or UTF-32 (it holds NUL bytes)'}, but JSON files must be "
                    f"UTF-8: convert it, e.g. `iconv -f {name or 'UTF-16'} -t UTF-8 {path} > "
                    f"{stem}.utf8{ext}`")
        f.seek(0)
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as bad:
                return (f"line {number} is not UTF-8 (byte {raw[bad.start]:#04x}, the line's byte "
                        f"{bad.start + 1}), but JSON files must be UTF-8: convert it, e.g. for Latin-1 "
                        f"`iconv -f LATIN1 -t UTF-8 {path} > {stem}.utf8{ext}`")
            if ext == ".jsonl" and line.strip():
                try:
                    json.loads(line, object_pairs_hook=_unique_keys)
                except KeyError as twice:  # a JSON parser keeps the last; datasets' fails without a word
                    return (f"line {number}: the key {twice.args[0]!r} appears twice in one object (datasets "
                            "cannot read such a line): keep one")
                except ValueError as bad:
                    return f"line {number} is not valid JSON ({bad})"
    return None


def _unique_keys(pairs):
    keys = [key for key, _ in pairs]
    if len(set(keys)) < len(keys):  # the first key seen again
        raise KeyError(next(key for i, key in enumerate(keys) if key in keys[:i]))
    return dict(pairs)


def batches(rows, rollout_batch_size, seed):
    """Global prompt batches, reshuffled every episode (identically on every rank), without end."""
    for episode in itertools.count():
        order = list(range(len(rows)))
        random.Random(seed + episode).shuffle(order)
        for i in range(0, len(order) - rollout_batch_size + 1, rollout_batch_size):
            yield [rows[j] for j in order[i:i + rollout_batch_size]]


def text_batches(path, key, batch_size, rank=0, world=1):
    """Endless batches of this rank's texts of column `key` (the ptx loss's), read now: errors come early."""
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
    """([Sample], number longer than max_len skipped), tokenized in one batch (a call each took 2 s)."""
    texts = [prompt_text(tokenizer, r["prompt"], apply_chat_template, system_prompt) for r in rows]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    samples = [Sample(list(i), r["label"], r["prompt"], columns=r.get("columns")) for i, r in zip(ids, rows)]
    kept = [s for s in samples if len(s.prompt_ids) <= max_len]
    return kept, len(samples) - len(kept)


TOOLS_TEXT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""  # Qwen2.5's (Hermes-style) words, for a template that does not render tools


def prompt_text(tokenizer, prompt, apply_chat_template=True, system_prompt=None, tools=None):
    """The text the model reads for a prompt: a string (as is without the chat template) or chat messages.
    tools: JSON schemas, rendered by the template where it takes them, else as TOOLS_TEXT in a system one."""
    tools_text = TOOLS_TEXT.format("\n".join(json.dumps(t) for t in tools)) if tools else None
    if isinstance(prompt, str):
        if not apply_chat_template:
            return f"{tools_text}\n\n{prompt}" if tools else prompt
        prompt = [{"role": "user", "content": prompt}]
    if system_prompt and prompt[0]["role"] != "system":
        prompt = [{"role": "system", "content": system_prompt}] + list(prompt)

    def render(messages, **tools):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **tools)

    text = render(prompt)
    if not tools or (with_tools := render(prompt, tools=tools)) != text:
        return with_tools if tools else text  # with tools the template writes
    if prompt[0]["role"] == "system":  # the schemas join the system message
        tools_text, prompt = f"{prompt[0]['content']}\n\n{tools_text}", prompt[1:]
    return render([{"role": "system", "content": tools_text}, *prompt])


def encode_prompt(tokenizer, prompt, apply_chat_template=True, system_prompt=None):
    """Token ids of prompt_text (the template holds the special tokens, so none are added)."""
    return tokenizer(prompt_text(tokenizer, prompt, apply_chat_template, system_prompt),
                     add_special_tokens=False)["input_ids"]
