"""Prompt data (issue 44, data=prompts): prompts rendered with the generation prompt and left-padded, every other
field kept; the generated prompts come from a part of the arithmetic space the SFT set never holds; the trained
tokenizer spells numbers digit by digit."""

import json
import os

import numpy as np
import pytest

from conftest import byte_bpe

from shardyard.data import pipeline as data, sft, synthetic
from shardyard.core.errors import UserError
from shardyard.data.prompts import PromptData
from shardyard.testing import compose

EOS = "<|endoftext|>"


def column(arrays: dict, name: str) -> list[str]:
    """A string column of the arrays ``PromptRows`` reads, decoded row by row from its UTF-8 buffer and offsets."""
    buf, off = arrays[f"{name}.utf8"], arrays[f"{name}.offsets"]
    return [bytes(buf[a:b]).decode("utf-8") for a, b in zip(off[:-1], off[1:])]


@pytest.fixture(scope="module")
def tok():
    return byte_bpe("### Question:\n### Answer:\nWhat is the capital of France? Be brief.", EOS)


def test_prompts_are_left_padded_with_their_fields(tok, tmp_path):
    records = [{"prompt": "What is 2 + 2?", "answer": "4", "level": 1},
               {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital?"}],
                "answer": "Paris", "tags": ["geo"]},
               {"prompt": "France " * 40, "answer": "x"}]  # longer than the row: dropped, counted
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = PromptData([str(path)], chat_template="plain").tokenize_rows(tok, 40, lambda name: False)
    rows = out["train"]
    assert rows["prompt_ids"].shape == (2, 40) and out["stats"]["dropped"] == 1 and out["stats"]["prompts"] == 3
    for r, msgs in enumerate([[{"role": "user", "content": "What is 2 + 2?"}], records[1]["prompt"]]):
        text = tok.apply_chat_template(msgs, chat_template=sft.TEMPLATES["plain"], tokenize=False,
                                       add_generation_prompt=True)
        assert text.endswith("### Answer:\n")
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert rows["prompt_ids"][r].tolist() == [tok.pad_token_id] * (40 - len(ids)) + ids  # LEFT padding
        assert rows["prompt_mask"][r].tolist() == [0] * (40 - len(ids)) + [1] * len(ids)
    assert [json.loads(f) for f in column(rows, "fields")] == [{"answer": "4", "level": 1},
                                                               {"answer": "Paris", "tags": ["geo"]}]
    assert column(rows, "where") == [f"{path}:1", f"{path}:2"]


@pytest.mark.parametrize("record,key,problem", [
    ({"question": "q"}, "data.prompt_field", "no `prompt` field"),
    ({"prompt": 7}, "data.paths", "is a number"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "data.paths",
     "ends with the assistant's"),
])
def test_bad_prompts_exit_2_naming_file_and_line(tok, tmp_path, record, key, problem):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UserError) as e:
        PromptData([str(path)]).tokenize_rows(tok, 40, lambda name: False)
    assert e.value.key == key and f"{path}:2" in f"{e.value.value} {e.value.problem}", e.value.paragraph()
    assert problem in e.value.problem


def test_held_out_prompts_never_meet_the_sft_set():
    """The generated prompts are problems data=arithmetic never trains on, whatever the seeds; the answers are right."""
    sft_keys = {name for s in (0, 1) for name, _ in synthetic.ArithmeticData(max_examples=5000, ops="+-*", seed=s)
                .conversations()}
    pref_keys = {p[0] for p in synthetic.preference_pairs(2000, 2, "+-*", 0)}
    rows = list(PromptData([], max_examples=2000, ops="+-*", seed=5).rows())
    prompt_keys = {name for name, *_ in rows}
    assert len(sft_keys) > 5000 and len(prompt_keys) == 2000
    assert not prompt_keys & sft_keys and not prompt_keys & pref_keys
    # Every problem of the space is in exactly one part: the held-out share is about HELD_OUT_PERCENT of it.
    space = [synthetic.Problem(a, o, b) for o in "+-*" for a in range(100) for b in range(100) if o != "-" or a >= b]
    share = sum(map(synthetic.held_out, space)) / len(space)
    assert abs(share - synthetic.HELD_OUT_PERCENT / 100) < 0.01
    for name, where, msgs, fields in rows[:200]:
        a, op, b = msgs[0]["content"].removeprefix("What is ").split("?")[0].split()
        assert fields == {"answer": str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])}
        assert name == f"arithmetic:{a}{op}{b}" and where.startswith("generated:")


def test_prompt_rows_through_the_cache_and_a_digit_tokenizer(tmp_path):
    """data=prompts end to end (tokenizer, cache, PromptRows), and data=arithmetic's tokenizer: one token per
    digit, so no number is a token of its own."""
    cfg = compose(["data=prompts", "data.max_examples=300", f"data.cache_dir={tmp_path}"])
    prep = data.prepare(cfg)
    train, val = data.open_split(prep, "train", cfg.data.seq_len), data.open_split(prep, "val", cfg.data.seq_len)
    assert isinstance(train, data.PromptRows) and len(train) + len(val) == 300 and len(val) > 20
    x, fields = train.get([0, 3])
    assert x["prompt_ids"].shape == (2, cfg.data.seq_len) and x["prompt_mask"][:, -1].tolist() == [1, 1]
    assert fields == train.fields([0, 3]) and all(w.startswith("generated:") for w in train.where([0, 3]))
    tok = data.load_tokenizer(prep.tokenizer_dir)
    text = tok.decode(x["prompt_ids"][0][x["prompt_mask"][0].bool()])
    assert text.endswith("### Answer:\n") and fields[0]["answer"].isdigit()
    pieces = [tok.decode([i]) for i in tok("What is 123 + 4567? Answer: 4690", add_special_tokens=False)["input_ids"]]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("12345674690")


def test_a_huge_field_costs_its_row_only(tmp_path):
    """The string columns (each row's fields as JSON, and where it came from) are one UTF-8 buffer and row offsets:
    the cache holds about the rows' own bytes (measured: 129.5 KB for 127.5 KB of JSON and ``file:line``).
    Stored as numpy unicode (``np.str_``, before: cache key prompts-v1), every row was padded to the longest at 4
    bytes a character: 8.5 MB here (the train split's 53 rows x 4 x 40,028 characters of fields), 66x (and
    10^6 prompts with one 100 KB field: 400 GB). Rows read back equal the input, non-ASCII text included, and the
    cache's manifest hashes the new files."""
    big = "é漢🙂" * 13_333 + "x"  # 40,000 characters, 120 KB of UTF-8 (2-, 3- and 4-byte characters)
    records = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "note": "naïve ½ ✓"} for i in range(60)]
    records.insert(17, {"prompt": "Long one?", "answer": "0", "essay": big})
    folder = tmp_path / "données"
    folder.mkdir()
    path = folder / "p.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    cfg = compose(["data=prompts", f"data.paths=['{path}']", f"data.cache_dir={tmp_path / 'c'}",
                   "data.tokenizer.vocab_size=300", "data.seq_len=64"])
    prep = data.prepare(cfg)
    splits = {split: data.open_split(prep, split, cfg.data.seq_len) for split in ("train", "val")}
    want = {f"{path}:{i + 1}": {k: v for k, v in r.items() if k != "prompt"} for i, r in enumerate(records)}
    got = {}
    for rows in splits.values():
        every = list(range(len(rows)))
        got.update(zip(rows.where(every), rows.get(every)[1]))
    assert got == want and got[f"{path}:18"]["essay"] == big
    json_bytes = sum(len(json.dumps(f, ensure_ascii=False).encode()) + len(w.encode()) for w, f in want.items())
    files = [f"{split}.{c}.{a}.npy" for split in splits for c in ("fields", "where") for a in ("utf8", "offsets")]
    stored = sum(os.path.getsize(os.path.join(prep.token_dir, f)) for f in files)
    assert json_bytes < stored < 2 * json_bytes, (stored, json_bytes)
    manifest = json.loads(open(os.path.join(prep.token_dir, "shardyard_cache.json")).read())["files"]
    assert all(manifest[f]["size"] == os.path.getsize(os.path.join(prep.token_dir, f)) for f in files)
    assert np.load(os.path.join(prep.token_dir, "train.fields.offsets.npy")).dtype == np.int64


def test_a_slipping_teacher_forgets_every_carry_of_its_share_of_problems():
    """``data.slip``: the worked solutions of about that share of the problems drop every carry and state the sum
    that follows (each column right, the answer wrong); the others are exact; the split is stable per problem."""
    assert synthetic.worked_sum(47, 85) == ("47 + 85: 7 + 5 = 12, write 2 carry 1; 4 + 8 + 1 = 13, write 3 carry 1; "
                                            "write 1.", 132)
    assert synthetic.worked_sum(47, 85, forget_carries=True) == ("47 + 85: 7 + 5 = 12, write 2; 4 + 8 = 12, write 2.",
                                                                 22)
    assert synthetic.worked_sum(5, 7, forget_carries=True) == ("5 + 7: 5 + 7 = 12, write 2.", 2)
    sure, slipping = (synthetic.ArithmeticData(max_examples=3000, ops="+", worked=True, slip=s) for s in (0.0, 0.6))
    slipped = carrying = 0
    for (name, good), (name2, conv) in zip(sure.conversations(), slipping.conversations()):
        a, b = map(int, name.removeprefix("arithmetic:").split("+"))
        stated = int(conv[1]["content"].rsplit("Answer: ", 1)[1])
        assert name == name2 and good[1]["content"].endswith(f"Answer: {a + b}")
        carries = "carry" in good[1]["content"]
        carrying += carries
        if conv != good:  # a slip: no carry written, each column's own sum, the digits it wrote as the answer
            slipped += 1
            assert carries and "carry" not in conv[1]["content"] and stated != a + b
            assert stated == int("".join(str((int(x) + int(y)) % 10) for x, y in zip(f"{a:02d}", f"{b:02d}")))
    assert abs(slipped / carrying - 0.6) < 0.05, (slipped, carrying)  # the problems with a carry to forget
    assert sure.fingerprint() != slipping.fingerprint()
    with pytest.raises(UserError, match="data.slip"):
        synthetic.ArithmeticData(worked=True, slip=1.5)
    with pytest.raises(UserError, match="data.worked=true"):
        synthetic.ArithmeticData(slip=0.5)


def test_prompts_all_longer_than_the_row_are_refused_with_the_count_and_the_key(tok, tmp_path):
    """Every prompt longer than data.seq_len (issue 53): refused naming data.seq_len, the count, the file and
    the longest prompt. (Before: an empty split, reported later as "no conversation" naming data.paths.)"""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": "France " * (40 + i), "answer": "x"}) + "\n" for i in range(3)))
    text = tok.apply_chat_template([{"role": "user", "content": "France " * 42}], chat_template=sft.TEMPLATES["plain"],
                                   tokenize=False, add_generation_prompt=True)
    longest = len(tok(text, add_special_tokens=False)["input_ids"])
    with pytest.raises(UserError) as e:
        PromptData([str(path)], chat_template="plain").tokenize_rows(tok, 40, lambda name: False)
    assert (e.value.key, e.value.value) == ("data.seq_len", 40), e.value.paragraph()
    assert "All 3 prompts" in e.value.problem and "3 longer than data.seq_len=40" in e.value.problem
    assert str(path) in e.value.problem and f"{longest:,} tokens" in e.value.fix, e.value.paragraph()


@pytest.mark.parametrize("source", [PromptData, sft.SFTData])
def test_files_that_hold_no_record_are_named(tok, tmp_path, source):
    """An empty file (or an empty JSON array) in data.paths: refused naming data.paths and the file, not later as
    a split without conversations (issue 53)."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "none.json").write_text("[]")
    for f in ("empty.jsonl", "none.json"):
        with pytest.raises(UserError) as e:
            source([str(tmp_path / f)]).tokenize_rows(tok, 40, lambda name: False)
        assert (e.value.key, e.value.value) == ("data.paths", str(tmp_path / f)), e.value.paragraph()
        assert "no record at all" in e.value.problem, e.value.paragraph()
