"""Directories written by HF datasets' save_to_disk (a Dataset or a DatasetDict) are read as that dataset by every
data option (issue 44, item 5): the same rows as the JSONL file holding them; a DatasetDict's train split trains and
its validation split is held out whole."""

import json

import datasets
import numpy as np
import pytest

from conftest import byte_bpe

from shardyard.data import pipeline as data, sft
from shardyard.core.errors import UserError
from shardyard.data.preference import PreferenceData
from shardyard.data.prompts import PromptData
from shardyard.data.sources import TextFiles, is_val
from shardyard.testing import compose

EOS = "<|endoftext|>"
SFT_ROWS = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(12)]
PREF_ROWS = [{"prompt": f"What is {i} + 1?", "chosen": f"{i + 1}", "rejected": f"{i + 2}"} for i in range(12)]
PROMPT_ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(12)]


@pytest.fixture(scope="module")
def tok():
    return byte_bpe("### Question:\n### Answer:\nWhat is 1 + 2? It is 3.", EOS)


def saved(tmp_path, rows, name, split: dict | None = None):
    """``rows`` as a JSONL file and as a saved Dataset; with ``split`` ({split: row slice}) a saved DatasetDict."""
    jsonl = tmp_path / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / name
    if split is None:
        datasets.Dataset.from_list(rows).save_to_disk(str(out))
    else:
        datasets.DatasetDict({s: datasets.Dataset.from_list(rows[sl]) for s, sl in split.items()}).save_to_disk(str(out))
    return str(jsonl), str(out)


def test_text_files_reads_a_saved_dataset_like_its_jsonl(tmp_path):
    """The issue's repro: data=text_files 'data.paths=[DIR]' read dataset_info.json as JSON lines and exited 2."""
    rows = [{"text": f"document {i} " * (i + 1), "id": i} for i in range(40)]
    jsonl, ds = saved(tmp_path, rows, "corpus")
    assert [t for _, t in TextFiles([ds]).documents()] == [t for _, t in TextFiles([jsonl]).documents()]
    assert TextFiles([str(tmp_path)]).files() == [tmp_path / "corpus", tmp_path / "corpus.jsonl"]  # one entry
    cfg = compose(["data=text_files", f"data.paths=[{ds}]", "data.tokenizer.vocab_size=300", "data.seq_len=16",
                   f"data.cache_dir={tmp_path}/cache", "data.val_fraction=0.2"])
    prep = data.prepare(cfg)
    assert len(data.open_split(prep, "train", 16)) > 0 and len(data.open_split(prep, "val", 16)) > 0
    with pytest.raises(UserError) as e:
        list(TextFiles([ds], text_field="body").documents())
    assert e.value.key == "data.text_field" and ds in e.value.problem


def test_a_saved_dataset_dict_keeps_its_splits(tmp_path):
    rows = [{"text": f"doc {i}"} for i in range(30)]
    _, dd = saved(tmp_path, rows, "dd", {"train": slice(0, 20), "validation": slice(20, 30), "extra": slice(0, 5)})
    names = [(p.name, p.text) for p in TextFiles([dd]).pieces()]
    assert [t for _, t in names] == [r["text"] for r in rows]  # train then validation; `extra` left out
    for fraction in (0.0, 0.5, 1.0):  # the data decides, not data.val_fraction
        assert [is_val(n, fraction) for n, _ in names] == [False] * 20 + [True] * 10
    _, only_train = saved(tmp_path, rows, "tr", {"train": slice(0, 30)})  # no held-out split: the hash decides
    assert 0 < sum(is_val(p.name, 0.5) for p in TextFiles([only_train]).pieces()) < 30
    _, unclear = saved(tmp_path, rows, "un", {"a": slice(0, 10), "b": slice(10, 20)})
    with pytest.raises(UserError) as e:
        list(TextFiles([unclear]).pieces())
    assert e.value.key == "data.paths" and e.value.value == unclear and "a" in e.value.problem
    assert [p.text for p in TextFiles([f"{unclear}/b"]).pieces()] == [r["text"] for r in rows[10:20]]


@pytest.mark.parametrize("kind", ["sft", "preference", "prompts"])
def test_row_sources_read_saved_datasets_like_jsonl(tok, tmp_path, kind):
    rows, make = {"sft": (SFT_ROWS, lambda p: sft.SFTData(p, chat_template="plain", packing=False)),
                  "preference": (PREF_ROWS, lambda p: PreferenceData(p, chat_template="plain")),
                  "prompts": (PROMPT_ROWS, lambda p: PromptData(p, chat_template="plain"))}[kind]
    jsonl, ds = saved(tmp_path, rows, "rows")
    _, dd = saved(tmp_path, rows, "dd", {"train": slice(0, 8), "test": slice(8, 12)})
    never = lambda name: False  # noqa: E731

    def rows_of(built: dict) -> dict:  # string columns (prompts: data.utf8_column) decoded, one str per row
        def strings(arrays: dict) -> dict:
            out = {a: v for a, v in arrays.items() if not a.endswith((".utf8", ".offsets"))}
            for a in [a[:-5] for a in arrays if a.endswith(".utf8")]:
                buf, off = arrays[f"{a}.utf8"], arrays[f"{a}.offsets"]
                out[a] = np.array([bytes(buf[i:j]).decode() for i, j in zip(off[:-1], off[1:])], dtype=object)
            return out
        return {k: strings(v) if k in ("train", "val") else v for k, v in built.items()}

    want = rows_of(make([jsonl]).tokenize_rows(tok, 64, never))
    got = rows_of(make([ds]).tokenize_rows(tok, 64, never))
    split = rows_of(make([dd]).tokenize_rows(tok, 64, lambda name: is_val(name, 0.0)))
    for a in want["train"]:
        if a == "where":
            assert got["train"][a].tolist() == [f"{ds} row {i}" for i in range(12)]
            continue
        assert np.array_equal(got["train"][a], want["train"][a]), a
        assert np.array_equal(np.concatenate([split["train"][a], split["val"][a]]), want["train"][a]), a
    assert len(split["val"][next(iter(split["val"]))]) == 4  # the test split, whole


def test_bad_rows_in_a_saved_dataset_name_the_directory_and_row(tok, tmp_path):
    rows = PREF_ROWS[:3] + [{"prompt": "q", "chosen": "c", "rejected": None}]
    _, ds = saved(tmp_path, rows, "bad")
    with pytest.raises(UserError) as e:
        PreferenceData([ds]).tokenize_rows(tok, 64, lambda name: False)
    assert e.value.value == f"{ds} row 3" and "`rejected`" in e.value.problem


@pytest.mark.parametrize("damage,fault", [
    (lambda d: (d / "dataset_info.json").unlink(), "dataset_info.json"),
    (lambda d: (d / "state.json").unlink(), "state.json"),
    (lambda d: (d / "data-00000-of-00001.arrow").unlink(), "data-00000-of-00001.arrow"),
    (lambda d: (d / "state.json").write_text('{"_fingerprint": "x"}'), "state.json"),
    (lambda d: (d / "train" / "dataset_info.json").unlink(), "train/dataset_info.json"),
    (lambda d: (d / "dataset_dict.json").write_text('{"splits": ["train", "validation"]}'), "validation"),
], ids=["no-dataset-info", "no-state", "no-arrow-file", "state-without-data-files", "dict-split-no-info",
        "dict-split-not-there"])
def test_a_save_to_disk_dir_missing_a_file_is_named_by_that_file(tmp_path, damage, fault):
    """A ``save_to_disk`` directory that lacks a file ``load_from_disk`` reads (issue 53) is told by its marker
    files (``dataset_info.json``, a ``state.json`` listing ``_data_files``, ``dataset_dict.json``): every data
    option refuses it naming data.paths and the missing file, named directly or found under a named directory.
    (Before: without dataset_info.json it was read as a directory of JSON files, and its valid state.json blamed.)"""
    split = {"train": slice(0, 8), "test": slice(8, 12)} if fault.startswith(("train/", "validation")) else None
    _, ds = saved(tmp_path, SFT_ROWS, "chat", split)
    damage(tmp_path / "chat")
    for source in (lambda p: sft.SFTData([p]), lambda p: TextFiles([p], text_field="messages")):
        for named in (ds, str(tmp_path)):
            with pytest.raises(UserError) as e:
                source(named)
            assert e.value.key == "data.paths" and e.value.value == str(tmp_path / "chat" / fault), e.value.paragraph()
            assert "save_to_disk" in e.value.problem, e.value.paragraph()
