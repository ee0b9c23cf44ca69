"""Prompt data (issue 44, data=prompts): prompts rendered with the generation prompt and left-padded, every other
field kept; the generated prompts come from a part of the arithmetic space the SFT set never holds; the trained
tokenizer spells numbers digit by digit."""

import json

import pytest

from conftest import byte_bpe

from shardyard import data, sft, synthetic
from shardyard.errors import UserError
from shardyard.prompts import PromptData
from shardyard.testing import compose

EOS = "<|endoftext|>"


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
    assert [json.loads(f) for f in rows["fields"]] == [{"answer": "4", "level": 1}, {"answer": "Paris", "tags": ["geo"]}]
    assert rows["where"].tolist() == [f"{path}:1", f"{path}:2"]


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
    assert fields == train.fields_all()[0:4:3] and train.where([0]) == [train.where_all()[0]]
    tok = data.load_tokenizer(prep.tokenizer_dir)
    text = tok.decode(x["prompt_ids"][0][x["prompt_mask"][0].bool()])
    assert text.endswith("### Answer:\n") and fields[0]["answer"].isdigit()
    pieces = [tok.decode([i]) for i in tok("What is 123 + 4567? Answer: 4690", add_special_tokens=False)["input_ids"]]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("12345674690")
