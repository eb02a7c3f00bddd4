import json

import pytest

from rft_core.data import encode_prompt, load_prompt_rows
from rft_core.tasks.arithmetic import arithmetic_task


def question(row):
    return row["prompt"][-1]["content"]


def test_arithmetic_task_seeded_and_held_out():
    train, evals = arithmetic_task(num_train=500, seed=3)
    train_again, evals_again = arithmetic_task(num_train=500, seed=3)
    assert train == train_again and evals == evals_again
    other_train, other_evals = arithmetic_task(num_train=500, seed=4)
    assert other_evals == evals and other_train != train  # the eval split does not move with --seed
    assert len(evals) == 96 and len({question(r) for r in evals}) == 96
    assert not {question(r) for r in evals} & {question(r) for r in train}
    for row in train[:50] + evals:
        a, op, b = question(row)[len("What is "):-1].split()
        assert str(eval(f"{a} {op} {b}")) == row["label"]
    ops = [question(r).split()[3] for r in train]
    assert {op: ops.count(op) > 100 for op in "+-*"} == {"+": True, "-": True, "*": True}


def test_load_jsonl_parquet_and_directory(tmp_path):
    rows = [{"question": "What is 1 + 1?", "answer": 2}, {"question": "What is 2 + 2?", "answer": 4}]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    loaded, skipped = load_prompt_rows(str(path), "question", "answer")
    assert skipped == 0 and loaded == [{"prompt": "What is 1 + 1?", "label": "2", "row": 0, "columns": {}},
                                       {"prompt": "What is 2 + 2?", "label": "4", "row": 1, "columns": {}}]

    import datasets
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "part.parquet"))
    assert load_prompt_rows(str(tmp_path / "part.parquet"), "question", "answer")[0] == loaded
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert load_prompt_rows(str(tmp_path / "saved"), "question", "answer")[0] == loaded
    arrow = next((tmp_path / "saved").glob("*.arrow"))  # a bare .arrow file, outside its save_to_disk dir
    (tmp_path / "bare").mkdir()
    arrow.rename(tmp_path / "bare" / "train.arrow")
    assert load_prompt_rows(str(tmp_path / "bare" / "train.arrow"), "question", "answer")[0] == loaded
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.jsonl").write_text(json.dumps(rows[0]))
    (tmp_path / "dir" / "b.jsonl").write_text(json.dumps(rows[1]))
    assert load_prompt_rows(str(tmp_path / "dir"), "question", "answer")[0] == loaded


def test_bad_paths_and_columns(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such.jsonl"):
        load_prompt_rows(str(tmp_path / "no_such.jsonl"))
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a"}))
    with pytest.raises(KeyError, match="no column 'prompt'.*--input_key"):
        load_prompt_rows(str(path))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="expected .jsonl"):
        load_prompt_rows(str(tmp_path / "notes.txt"))


def test_encode_prompt(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = encode_prompt(tok, "What is 1 + 1?", apply_chat_template=False)
    assert tok.decode(plain) == "What is 1 + 1?"
    chat = tok.decode(encode_prompt(tok, "What is 1 + 1?", system_prompt="Be brief."))
    assert (chat.startswith("<|im_start|>system\nBe brief.<|im_end|>")
            and chat.endswith("<|im_start|>assistant\n"))
    messages = [{"role": "user", "content": "hello"}]
    assert encode_prompt(tok, messages) == encode_prompt(tok, "hello")


def test_unusable_rows_counted_and_all_bad_is_an_error(tmp_path):
    rows = [{"prompt": "fine", "label": 1}, {"prompt": "", "label": 2}, {"prompt": None, "label": 3},
            {"prompt": [{"role": "user", "content": "hi"}], "label": 4},
            {"prompt": [{"content": 5}], "label": 5}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    loaded, skipped = load_prompt_rows(str(path))
    assert skipped == 3 and [(r["label"], r["row"]) for r in loaded] == [("1", 0), ("4", 3)]
    path.write_text(json.dumps({"prompt": "  ", "label": 1}))
    with pytest.raises(ValueError, match="none of its 1 rows has a usable 'prompt'"):
        load_prompt_rows(str(path))


def test_text_batches_name_their_flag(tmp_path):
    from rft_core.data import text_batches

    with pytest.raises(FileNotFoundError, match="--pretrain_data"):
        next(text_batches(str(tmp_path / "missing.jsonl"), "text", 2))
    path = tmp_path / "ptx.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n')
    stream = text_batches(str(path), "text", 2, rank=1, world=2)
    # rank 1 of 2 gets the odd rows, endlessly
    assert [next(stream) for _ in range(3)] == [["b"], ["b"], ["b"]]
    with pytest.raises(KeyError, match="--pretrain_data .* has no column 'body'"):
        next(text_batches(str(path), "body", 2))


def test_an_edited_file_is_read_afresh(tmp_path):
    """datasets' cache, keyed by path and modification time, served an edited file's old rows (an edit that
    kept the size and time: a copy with `cp -p`, a checkout); every load reads the file now."""
    import os
    import time

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "What is 1 + 1?", "label": "2"}))
    stat = os.stat(path)
    assert load_prompt_rows(str(path))[0][0]["label"] == "2"
    time.sleep(0.02)
    path.write_text(json.dumps({"prompt": "What is 1 + 2?", "label": "3"}))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert load_prompt_rows(str(path))[0][0]["label"] == "3"


def test_a_dataset_dict_directory_gives_its_train_split(tmp_path):
    """A save_to_disk DatasetDict was read as a JSON file of one row (`no column 'prompt' (columns:
    ['splits'])`): its 'train' split is read and said; without one, its splits are named."""
    import datasets

    train = datasets.Dataset.from_list([{"prompt": "a", "label": "1"}, {"prompt": "b", "label": "2"}])
    datasets.DatasetDict({"train": train, "test": train.select([0])}).save_to_disk(str(tmp_path / "dd"))
    said = []
    rows, _ = load_prompt_rows(str(tmp_path / "dd"), log=said.append)
    assert [r["label"] for r in rows] == ["1", "2"]
    assert said == [f"[data] {tmp_path / 'dd'}: a DatasetDict: its 'train' split is read (splits: train, "
                    "test; pass another's directory to read that)"]
    datasets.DatasetDict({"validation": train}).save_to_disk(str(tmp_path / "dv"))
    with pytest.raises(ValueError, match=r"--prompt_data .*dv' is a DatasetDict without a 'train' split "
                                         r"\(splits: \['validation'\]\): pass one split's directory, e.g. "
                                         r".*dv/validation$"):
        load_prompt_rows(str(tmp_path / "dv"))


def test_damaged_arrow_files_and_directories_named_like_data_are_one_line(tmp_path):
    """A save_to_disk directory whose Arrow file is cut short was a pyarrow traceback; a directory of Arrow
    files named the directory, not the damaged file; a directory `x.jsonl` inside a data directory was an
    IsADirectoryError traceback. Each is one line naming the file (the directory is skipped and said)."""
    import datasets

    data = datasets.Dataset.from_list([{"prompt": "a" * 100, "label": "1"}] * 200)
    data.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    with open(arrow, "r+b") as f:
        f.truncate(arrow.stat().st_size // 2)
    with pytest.raises(ValueError, match=rf"--eval_data '{arrow}': not a readable arrow file, damaged or cut "
                                         r"short \(.*\): write it again"):
        load_prompt_rows(str(tmp_path / "saved"), flag="--eval_data")
    (tmp_path / "arrows").mkdir()
    (tmp_path / "arrows" / "a.arrow").write_bytes(b"not arrow" * 10)
    with pytest.raises(ValueError, match=r"arrows/a.arrow': not a readable arrow file"):
        load_prompt_rows(str(tmp_path / "arrows"))
    (tmp_path / "dir" / "x.jsonl").mkdir(parents=True)
    (tmp_path / "dir" / "y.jsonl").write_text(json.dumps({"prompt": "q", "label": "1"}))
    said = []
    assert len(load_prompt_rows(str(tmp_path / "dir"), log=said.append)[0]) == 1
    assert said == [f"[data] {tmp_path / 'dir'}: skipped 1 entries that are not .jsonl/.json/.parquet/.arrow "
                    "files: x.jsonl/"]
    with pytest.raises(ValueError, match=r"x.jsonl': expected .jsonl/.json/.parquet/.arrow files of one "
                                         r"kind, found none in that directory$"):
        load_prompt_rows(str(tmp_path / "dir" / "x.jsonl"))
