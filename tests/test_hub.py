"""Hub ids for models (org/name: their snapshot in the HF cache, rft_core/models.py hub_snapshot) and for
datasets (org/name[:config[:split]] through `datasets`, rft_core/data.py), offline from local caches: the
hub cache's layout (models--org--name/refs/main, snapshots/<commit>/) and datasets' (org___name/...)."""

import os
import shutil

import pytest
from conftest import read_metrics, run_script

from rft_core.errors import DataError, MissingPath

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TINY = ["--max_steps", "1", "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
        "--generate_max_len", "4", "--eval_steps", "0"]


def hub_cache(root, tiny_model_dir):
    """A hub cache at root holding org/tiny (the tiny model's files) at COMMIT, as `hf download` leaves it."""
    repo = root / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(tiny_model_dir, repo / "snapshots" / COMMIT)
    return str(repo / "snapshots" / COMMIT)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Offline, with empty hub and datasets caches under tmp_path (the libraries read their environment at
    import: their constants are set too)."""
    import datasets
    from huggingface_hub import constants

    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_CACHE", str(tmp_path / "hub")),
                        ("HF_DATASETS_CACHE", str(tmp_path / "datasets"))):
        monkeypatch.setenv(name, value)
        for module in (constants, datasets.config):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, value if name != "HF_HUB_OFFLINE" else True)
    return tmp_path


def test_a_hub_id_loads_offline_from_the_hub_cache(offline, tiny_model_dir, monkeypatch):
    from rft_core.models import hub_snapshot, load_model_and_tokenizer
    from rft_core.plan import local_models
    from train_ppo import Args

    snapshot = hub_cache(offline / "hub", tiny_model_dir)
    assert hub_snapshot("org/tiny") == snapshot
    model, tokenizer = load_model_and_tokenizer("org/tiny")
    assert model.config.num_hidden_layers == 2 and tokenizer.eos_token
    args = local_models(Args(pretrain="org/tiny", reward_pretrain=f"{tiny_model_dir},org/tiny"))
    assert (args.pretrain, args.reward_pretrain) == (snapshot, f"{tiny_model_dir},{snapshot}")
    # a local path wins over a hub id of the same name; a path that is no hub id is left to the loaders
    (offline / "org" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(offline)
    assert hub_snapshot("org/tiny") == "org/tiny"
    assert hub_snapshot("/no/such/model") == "/no/such/model"


def test_an_uncached_hub_id_offline_is_one_line_naming_the_fix(offline):
    from rft_core.models import hub_snapshot

    with pytest.raises(MissingPath) as caught:
        hub_snapshot("org/absent", "--critic_pretrain")
    said = str(caught.value)
    assert said.startswith("--critic_pretrain 'org/absent': not a local path, and the hub could not be "
                           "reached (HF_HUB_OFFLINE is set)")
    assert "`hf download org/absent`" in said and str(offline / "hub") in said and "\n" not in said


def test_a_missing_private_or_gated_hub_model_is_one_line(monkeypatch):
    """What the hub refuses (404, or 401 / 403 for a private or gated repo) is one line naming the fix; only
    what a model needs is downloaded."""
    import huggingface_hub
    from huggingface_hub import errors

    from rft_core.models import hub_snapshot

    asked = []

    def refuse(repo_id, **how):
        asked.append(how["allow_patterns"])
        raise errors.GatedRepoError.__new__(errors.GatedRepoError)  # (its __init__ wants an HTTP response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(MissingPath) as caught:
        hub_snapshot("org/gated")
    assert str(caught.value) == (
        "--pretrain 'org/gated': not a local path, and the hub has no model of that name you may read (a "
        "private or gated one: `hf auth login`, and accept a gated one's terms at https://huggingface.co/org/gated)")
    assert set(asked[0]) >= {"*.json", "*.safetensors"} and "*.bin" not in asked[0]


def test_a_hub_dataset_loads_offline_from_the_datasets_cache(offline):
    """`datasets` offline reads its own cache (a dataset loaded once), not the hub cache: one is built by
    hand where it looks (HF_DATASETS_CACHE/org___toy/<config>/<version>/<hash>/)."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    from rft_core.data import load_prompt_rows

    ds = datasets.Dataset.from_dict({"question": ["1 + 1", "2 + 2"], "answer": [2, 4]})
    where = offline / "datasets" / "org___toy" / "default" / "0.0.0" / "0123456789abcdef"
    where.mkdir(parents=True)
    ds.info.splits = datasets.SplitDict({split: datasets.SplitInfo(split, num_examples=2, dataset_name="toy")
                                         for split in ("train", "test")})
    ds.info.config_name = "default"
    ds.info.write_to_directory(str(where))
    for split in ("train", "test"):
        with ArrowWriter(path=str(where / f"toy-{split}.arrow")) as writer:
            writer.write_table(ds.data.table)
            writer.finalize()
    rows, skipped = load_prompt_rows("org/toy", "question", "answer")
    assert [(r["prompt"], r["label"]) for r in rows] == [("1 + 1", "2"), ("2 + 2", "4")] and skipped == 0
    assert len(load_prompt_rows("org/toy:default:test", "question", "answer")[0]) == 2


def test_dataset_names_dispatch_and_their_errors(offline, monkeypatch):
    """Local paths win over hub names; what is neither is named as a missing path, without asking the hub;
    an uncached hub dataset offline is one line naming the fix."""
    import datasets

    from rft_core.data import load_prompt_rows

    local = offline / "org" / "set"
    local.mkdir(parents=True)
    (local / "train.jsonl").write_text('{"prompt": "local", "label": "1"}\n')
    monkeypatch.chdir(offline)
    assert load_prompt_rows("org/set")[0][0]["prompt"] == "local"
    real, asked = datasets.load_dataset, []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: asked.append(a))
    for missing in ("data/train.jsonl", "nohub", "/abs/org/name"):
        with pytest.raises(MissingPath, match=rf"--eval_data '{missing}': no such file or directory, nor a "
                                              r"hub dataset name \(org/name\[:config\[:split\]\]"):
            load_prompt_rows(missing, flag="--eval_data")
    assert asked == []
    monkeypatch.setattr(datasets, "load_dataset", real)
    with pytest.raises(DataError) as caught:
        load_prompt_rows("org/absent:main")
    said = str(caught.value)
    assert said.startswith("--prompt_data 'org/absent:main': not a local path, and the hub dataset could not "
                           "be loaded (ConnectionError: ") and "\n" not in said
    assert said.endswith("offline runs read datasets' cache (HF_DATASETS_CACHE): load it once where the hub "
                         "is reachable, or pass a local file")


@pytest.mark.slow
def test_train_ppo_takes_a_hub_id_offline(tmp_path, tiny_model_dir, chars_reward):
    """`train_ppo.py --pretrain org/tiny` from the hub cache, offline: it trains, and its config names the
    snapshot; a rerun resumes (the same snapshot, the same model digest)."""
    snapshot = hub_cache(tmp_path / "hub", tiny_model_dir)
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    out = str(tmp_path / "out")
    args = ["--pretrain", "org/tiny", *TINY, "--reward_fn", chars_reward, "--output_dir", out,
            "--save_steps", "1"]
    run_script("train_ppo.py", args, env=env)
    assert len(read_metrics(out)[0]) == 1
    with open(os.path.join(out, "config.json")) as f:
        assert snapshot in f.read()
    proc = run_script("train_ppo.py", [*args, "--max_steps", "2"], env=env)
    assert "[resume]" in proc.stdout + proc.stderr and len(read_metrics(out)[0]) == 2
