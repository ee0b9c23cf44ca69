"""Preference data (issue 44, data=preference): one pair per row [n, 2, seq_len], the prompt and the response
rendered as SFT renders them, labels on the response only; bad records exit 2 naming file:line."""

import json

import numpy as np
import pytest

from conftest import byte_bpe

from shardyard.data import sft, synthetic
from shardyard.core.errors import UserError
from shardyard.data.preference import PreferenceData

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok():
    return byte_bpe("### Question:\n### Answer:\nParis is the capital of France. Lyon. Hello there.", EOS)


def write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def by_hand(tok, prompt_text: str, response_text: str, L: int):
    """The reference: the prompt's and the response's tokens one after the other, targets the next token where
    that token is the response's, right-padded with the pad id (targets -100, positions restarting at 0)."""
    p = tok(prompt_text, add_special_tokens=False)["input_ids"]
    r = tok(response_text, add_special_tokens=False)["input_ids"]
    ids = p + r
    targets = [ids[t + 1] if t + 1 >= len(p) and t + 1 < len(ids) else -100 for t in range(len(ids))]
    pad = tok.pad_token_id
    return (ids + [pad] * (L - len(ids)), targets + [-100] * (L - len(ids)),
            list(range(len(ids))) + list(range(L - len(ids))))


@pytest.mark.parametrize("template", ["plain", "chatml"])
def test_pair_rows_equal_a_hand_built_encoding(tok, tmp_path, template):
    path = write(tmp_path / "p.jsonl", [{"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon, surely."}])
    out = PreferenceData([path], chat_template=template).tokenize_rows(tok, 96, lambda name: False)
    assert out["train"]["input_ids"].shape == (1, 2, 96) and out["val"]["input_ids"].shape == (0, 2, 96)
    if template == "plain":
        prompt, end = "### Question:\nCapital of France?\n\n### Answer:\n", f"{EOS}\n\n"
    else:
        prompt, end = "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>\n"
    for side, reply in ((0, "Paris."), (1, "Lyon, surely.")):
        ids, targets, pos = by_hand(tok, prompt, reply + end, 96)
        assert out["train"]["input_ids"][0, side].tolist() == ids
        assert out["train"]["targets"][0, side].tolist() == targets
        assert out["train"]["position_ids"][0, side].tolist() == pos
    k = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert (out["train"]["input_ids"][0, 0, :k] == out["train"]["input_ids"][0, 1, :k]).all()  # one shared prompt
    assert out["stats"]["pairs"] == 1 and out["stats"]["dropped"] == 0


def test_only_the_response_is_labelled_and_trl_forms_read_alike(tok, tmp_path):
    """A multi-turn prompt's own assistant turn carries no label; TRL's explicit- and implicit-prompt
    conversational records give the same rows as prompt + response lists."""
    turns = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Capital of France?"}]
    good, bad = {"role": "assistant", "content": "Paris."}, {"role": "assistant", "content": "Lyon."}
    forms = [{"prompt": turns, "chosen": [good], "rejected": [bad]},
             {"prompt": turns, "chosen": turns + [good], "rejected": turns + [bad]},  # explicit prompt, repeated
             {"chosen": turns + [good], "rejected": turns + [bad]}]  # implicit prompt
    rows = [PreferenceData([write(tmp_path / f"{i}.jsonl", [f])], chat_template="plain").tokenize_rows(
        tok, 64, lambda name: False)["train"] for i, f in enumerate(forms)]
    for r in rows[1:]:
        assert all((r[a] == rows[0][a]).all() for a in rows[0])
    t = rows[0]["targets"][0, 0]
    labelled = tok.decode([int(x) for x in t[t != -100]])
    assert labelled == f"Paris.{EOS}\n\n"  # not the prompt's "Hello." turn
    ids, labels = sft.encode(tok, turns + [good], sft.TEMPLATES["plain"])  # SFT labels both assistant turns
    assert tok.decode([i for i, lab in zip(ids, labels) if lab != -100]).startswith("Hello.")


BAD = [
    ({"prompt": "q", "rejected": "r"}, "`chosen`"),
    ({"prompt": "q", "chosen": "c"}, "`rejected`"),
    ({"chosen": "c", "rejected": "r"}, "`prompt`"),
    ({"prompt": "q", "chosen": 3, "rejected": "r"}, "`chosen` is a number"),
    ({"prompt": ["q"], "chosen": "c", "rejected": "r"}, "`prompt`'s element 0"),
    ({"prompt": "q", "chosen": [{"role": "bot", "content": "c"}], "rejected": "r"}, "role 'bot'"),
    ({"prompt": "q", "chosen": "c", "rejected": [{"role": "user", "content": "r"}]}, "no assistant turn"),
    ({"prompt": "q", "chosen": "c", "rejected": []}, "empty list"),
    ('["not", "an object"]', "not a JSON object"),
]


@pytest.mark.parametrize("record,problem", BAD)
def test_bad_records_exit_2_naming_file_and_line(tok, tmp_path, record, problem):
    path = write(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "c", "rejected": "r"}, record])
    with pytest.raises(UserError) as e:
        PreferenceData([path]).tokenize_rows(tok, 48, lambda name: False)
    assert e.value.key == "data.paths" and e.value.value == f"{path}:2", e.value.paragraph()
    assert problem in e.value.problem, e.value.problem


def test_truncation_policy_and_pairs_left_without_labels(tok, tmp_path):
    path = write(tmp_path / "p.jsonl", [
        {"prompt": "Hi", "chosen": "Paris " * 40, "rejected": "Lyon."},  # chosen too long: truncated, labels kept
        {"prompt": "Hello there " * 40, "chosen": "Paris.", "rejected": "Lyon."},  # prompt alone fills the row
        {"prompt": "Hi", "chosen": "Paris.", "rejected": "Lyon."}])
    for policy, kept, dropped in (("truncate", 2, 1), ("drop", 1, 2)):
        out = PreferenceData([path], truncation=policy).tokenize_rows(tok, 40, lambda name: False)
        assert len(out["train"]["input_ids"]) == kept
        assert (out["stats"]["pairs"], out["stats"]["truncated"], out["stats"]["dropped"]) == (3, 2, dropped)
        assert all((out["train"]["targets"][:, s] != -100).any(axis=1).all() for s in (0, 1))


def test_generated_pairs_prefer_the_right_answer(tok):
    src = PreferenceData([], max_examples=50, digits=2, ops="+-*", seed=3)
    pairs = list(src.pairs())
    assert len(pairs) == 50 and len({n for n, *_ in pairs}) == 50
    for name, prompt, chosen, rejected in pairs:
        a, op, b = prompt[0]["content"].removeprefix("What is ").split("?")[0].split()
        right = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert chosen[0]["content"] == f"{a} {op} {b} = {right}. Answer: {right}"
        wrong = int(rejected[0]["content"].rsplit("Answer: ", 1)[1])
        assert wrong != right and rejected[0]["content"] == f"{a} {op} {b} = {wrong}. Answer: {wrong}"
        assert not synthetic.held_out(synthetic.Problem(int(a), op, int(b)))
    assert [p[0] for p in PreferenceData([], max_examples=50, digits=2, ops="+-*", seed=3).pairs()] == [
        p[0] for p in pairs]  # deterministic from the seed
    rows = src.tokenize_rows(tok, 96, lambda name: False)["train"]
    assert rows["input_ids"].shape == (50, 2, 96) and not (rows["input_ids"][:, 0] == rows["input_ids"][:, 1]).all()
    first = [(rows["targets"][:, s] != -100).argmax(axis=1) for s in (0, 1)]  # the response starts at one column
    assert np.array_equal(first[0], first[1])


def test_pairs_whose_prompts_all_fill_the_row_are_refused_with_the_count_and_the_key(tok, tmp_path):
    """Every pair's prompt longer than data.seq_len (issue 53): each policy leaves every pair out, and the refusal
    names data.seq_len, the count, why, the file and the longest pair, not "the train split has no conversation".
    (Before: an empty split, reported later by data.prepare naming data.paths without a count.)"""
    path = write(tmp_path / "p.jsonl", [{"prompt": "Hello there " * 40, "chosen": "Paris.", "rejected": "Lyon."}] * 3)
    longest = max(len(ids) for ids, _ in [sft.encode(tok, [{"role": "user", "content": "Hello there " * 40},
                                                           {"role": "assistant", "content": r}],
                                                     sft.TEMPLATES["plain"], first=1) for r in ("Paris.", "Lyon.")])
    for policy, why in (("truncate", "with every response token past data.seq_len=40"),
                        ("drop", "longer than data.seq_len=40 (data.truncation=drop)")):
        with pytest.raises(UserError) as e:
            PreferenceData([path], truncation=policy).tokenize_rows(tok, 40, lambda name: False)
        assert (e.value.key, e.value.value) == ("data.seq_len", 40), e.value.paragraph()
        assert f"All 3 preference pairs of data.paths ({tmp_path / 'p.jsonl'}) in the train split" in e.value.problem
        assert f"3 {why}" in e.value.problem and f"{longest:,} tokens" in e.value.fix, e.value.paragraph()


def test_pairs_without_a_preference_are_left_out_counted_and_refused_when_nothing_is_left(tok, tmp_path):
    """A pair whose chosen and rejected are the same (or one of them empty) has DPO's loss log 2 and gradient 0
    (issue 53): left out and counted beside the pairs kept, and refused naming data.paths and the count when no
    pair is left; a pair that differs only past data.seq_len is the same pair within the row: left out too.
    (Before: such pairs were kept, and a set of them trained at loss log 2 with a zero gradient.)"""
    same = {"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Paris."}
    same_msgs = {"prompt": [{"role": "user", "content": "Capital?"}],
                 "chosen": [{"role": "assistant", "content": "Lyon."}],
                 "rejected": [{"role": "assistant", "content": "Lyon."}]}
    empty = {"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "  "}
    good = {"prompt": "Hi", "chosen": "Paris.", "rejected": "Lyon."}
    path = write(tmp_path / "p.jsonl", [same, good, empty, same_msgs])
    out = PreferenceData([path]).tokenize_rows(tok, 96, lambda name: False)
    assert len(out["train"]["input_ids"]) == 1 and out["stats"]["no_preference"] == 3
    assert "3 left out with no preference" in out["stats"]["summary"]
    path = write(tmp_path / "p.jsonl", [same, empty, same_msgs])
    with pytest.raises(UserError) as e:
        PreferenceData([path]).tokenize_rows(tok, 96, lambda name: False)
    assert e.value.key == "data.paths" and str(tmp_path / "p.jsonl") in e.value.value, e.value.paragraph()
    assert "All 3 preference pairs" in e.value.problem and "2 whose chosen and rejected are the same" in e.value.problem
    assert "1 with an empty chosen or rejected reply" in e.value.problem, e.value.problem
    late = {"prompt": "Hi", "chosen": "Paris " * 30 + "yes", "rejected": "Paris " * 30 + "no"}
    with pytest.raises(UserError) as e:
        PreferenceData([write(tmp_path / "late.jsonl", [late])]).tokenize_rows(tok, 40, lambda name: False)
    assert e.value.key == "data.seq_len" and "are the same tokens within data.seq_len=40" in e.value.problem


def test_a_run_refused_for_its_data_leaves_nothing_that_refuses_the_corrected_rerun(tmp_path):
    """``train.py objective=dpo`` on pairs none of which fits data.seq_len (issue 53): refused while the parent
    prepares the data, after it wrote the run dir's config.yaml and plan.json; those are taken back, so the
    corrected rerun into the same ``hydra.run.dir`` is not refused as another run's results. (Before: they stayed,
    and the rerun was refused naming hydra.run.dir.)"""
    from shardyard.training import rundir
    from shardyard.launching.run import _run
    from shardyard.testing import TINY, compose

    path = write(tmp_path / "p.jsonl", [{"prompt": "Hello there " * 40, "chosen": "Paris.", "rejected": "Lyon."}] * 8)
    run_dir = tmp_path / "run"
    overrides = [*TINY, "objective=dpo", "data=preference", f"data.paths=[{path}]", "data.seq_len=32",
                 f"data.cache_dir={tmp_path / 'cache'}", "data.tokenizer.vocab_size=300", "train.steps=1"]
    with pytest.raises(UserError) as e:
        _run(compose(overrides, str(run_dir)))
    assert e.value.key == "data.seq_len" and "All " in e.value.problem, e.value.paragraph()
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "plan.json").exists()
    assert rundir.find(compose(overrides, str(run_dir))) is None
