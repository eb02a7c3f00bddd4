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
    assert skipped == 0 and loaded == [{"prompt": "What is 1 + 1?", "label": "2", "row": 0},
                                       {"prompt": "What is 2 + 2?", "label": "4", "row": 1}]

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
