"""SFT data (issue 15): labels on the assistant's tokens only, at exact positions; packed conversations
never see each other (a packed row's logits equal each conversation run alone)."""

import numpy as np
import pytest
import torch

from shardyard.data import sft
from shardyard.core.errors import UserError
from shardyard.models.loss import causal_lm_loss, packed_kwargs

CONV = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And the sky's colour?"},
        {"role": "assistant", "content": "Blue, mostly."}]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["### Question:\n### Answer:\nParis is the capital. The sky is blue."] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


@pytest.mark.parametrize("template", ["plain", "chatml"])
def test_only_assistant_tokens_carry_labels(tok, template):
    ids, labels = sft.encode(tok, CONV, sft.TEMPLATES[template])
    marked = [k for k, v in enumerate(labels) if v != sft.IGNORE]
    assert all(labels[k] == ids[k] for k in marked)
    runs = np.split(marked, np.where(np.diff(marked) != 1)[0] + 1)  # contiguous runs: one per assistant turn
    assert len(runs) == 2
    end = "<|endoftext|>\n\n" if template == "plain" else "<|im_end|>\n"
    assert [tok.decode([ids[k] for k in r]) for r in runs] == ["Paris." + end, "Blue, mostly." + end]
    # Exact positions: each run starts right after the template's assistant header, and nothing of the
    # system or user turns is labelled.
    header = "### Answer:\n" if template == "plain" else "<|im_start|>assistant\n"
    for r in runs:
        assert tok.decode(ids[: r[0]]).endswith(header)
    labelled = tok.decode([ids[k] for k in marked])
    assert "terse" not in labelled and "France" not in labelled and "colour" not in labelled


def test_targets_are_the_next_labelled_token_and_padding_is_ignored(tok):
    ids, labels = sft.encode(tok, CONV, sft.TEMPLATES["plain"])
    rows = sft.pack([(ids, labels[1:] + [sft.IGNORE])], 128, tok.pad_token_id, packing=True)
    n = len(ids)
    t = rows["targets"][0]
    assert list(t[: n - 1]) == labels[1:] and (t[n - 1:] == sft.IGNORE).all()
    assert list(rows["position_ids"][0][:n]) == list(range(n)) and rows["position_ids"][0][n] == 0


def test_packing_fills_rows_and_restarts_positions():
    docs = [([1] * 5, [2] * 5), ([3] * 4, [4] * 4), ([5] * 6, [6] * 6)]
    packed = sft.pack(docs, 10, 0, packing=True)
    assert packed["input_ids"].tolist() == [[1] * 5 + [3] * 4 + [0], [5] * 6 + [0] * 4]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]]
    padded = sft.pack(docs, 10, 0, packing=False)
    assert len(padded["input_ids"]) == 3 and (padded["targets"][1][4:] == sft.IGNORE).all()


def test_truncation_policy_is_applied_and_counted(tok, tmp_path):
    path = tmp_path / "chat.jsonl"
    long = {"messages": [{"role": "user", "content": "Q " * 5}, {"role": "assistant", "content": "word " * 200}]}
    short = {"instruction": "Say hi", "output": "hi"}
    import json

    path.write_text(json.dumps(long) + "\n" + json.dumps(short) + "\n")
    for policy, kept in (("truncate", 2), ("drop", 1)):
        out = sft.SFTData([str(path)], truncation=policy).tokenize_rows(tok, 64, lambda name: False)
        assert out["stats"]["truncated"] == 1 and out["stats"]["dropped"] == 2 - kept
        assert (out["train"]["targets"] != sft.IGNORE).any()


def test_bad_records_and_templates_are_named(tok, tmp_path):
    with pytest.raises(UserError) as e:
        sft.to_messages({"text": "x"}, "f.jsonl:1")
    assert e.value.key == "data.paths"
    with pytest.raises(UserError) as e:
        sft.template_for(tok, "nonsense")
    assert e.value.key == "data.chat_template"


def test_json_files_are_the_users_data_never_the_embedded_set(tmp_path):
    """data.paths=[DIR] with .json files (an array, and one object per line) trains on those records; a DIR
    without a known file exits 2 (it trained on the embedded stdlib set before, issue 30)."""
    import json

    from shardyard.data import pipeline as data
    from shardyard.testing import compose

    pairs = [{"question": f"What is {i} + {i}?", "answer": f"It is {2 * i}."} for i in range(30)]
    (tmp_path / "chats").mkdir()
    (tmp_path / "chats" / "a.json").write_text(json.dumps(pairs[:20], indent=1))
    (tmp_path / "chats" / "b.json").write_text("".join(json.dumps(r) + "\n" for r in pairs[20:]))
    src = sft.SFTData([str(tmp_path / "chats")])
    convs = list(src.conversations())
    assert [(m[0]["content"], m[1]["content"]) for _, m in convs] == [(r["question"], r["answer"]) for r in pairs]
    assert convs[19][0] == "a.json:19" and convs[20][0] == "b.json:0"
    cfg = compose(["data=sft", f"data.paths=[{tmp_path / 'chats'}]", "data.tokenizer.vocab_size=300",
                   "data.seq_len=64", f"data.cache_dir={tmp_path}/cache", "data.val_fraction=0.3"])
    assert data.prepare(cfg).stats["conversations"] == 30  # the embedded set has thousands
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "notes.txt").write_text("hello")
    for paths in ([str(tmp_path / "txt")], [str(tmp_path / "txt" / "notes.txt")], [str(tmp_path / "nothing*")]):
        with pytest.raises(UserError) as e:
            sft.SFTData(paths)
        assert e.value.key == "data.paths" and e.value.value == paths[0], e.value.paragraph()


GOOD = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'


@pytest.mark.parametrize("second,problem", [
    ("not json", "not JSON"),
    ("42", "is a number"),  # JSON, not an object (was a TypeError traceback)
    ('{"messages": [{"role": "bot", "content": "x"}]}', "role 'bot'"),
    ('{"messages": [{"role": "user", "content": null}]}', "`content` is null"),
    ('{"instruction": "Say hi", "output": 3}', "`output` is a number"),
    ('{"text": "x"}', "neither `messages`"),
])
def test_every_malformed_conversation_exits_2_naming_file_and_line(tmp_path, second, problem):
    path = tmp_path / "chat.jsonl"
    path.write_text(GOOD + "\n" + second + "\n")
    with pytest.raises(UserError) as e:
        list(sft.SFTData([str(path)]).conversations())
    assert e.value.key == "data.paths" and e.value.value == f"{path}:2" and problem in e.value.problem, e.value.paragraph()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_row_equals_each_conversation_run_alone(attn):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, attn_implementation=attn)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 97, (n,), generator=g) for n in (7, 5, 9)]
    targets = [torch.randint(0, 97, (len(d),), generator=g) for d in docs]
    for t in targets:
        t[:2] = sft.IGNORE  # "prompt" tokens
    row = {"input_ids": torch.cat(docs)[None], "position_ids": torch.cat([torch.arange(len(d)) for d in docs])[None]}
    with torch.no_grad():
        packed = model(**packed_kwargs(model, row)).logits[0]
        alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
        assert (packed - alone).abs().max() <= 1e-5
        # The loss of the row is the mean over all its labelled tokens of the conversations run alone.
        loss = causal_lm_loss(model, row, torch.cat(targets)[None])
        ce = [torch.nn.functional.cross_entropy(model(input_ids=d[None]).logits[0], t, reduction="sum")
              for d, t in zip(docs, targets)]
        n = sum(int((t != sft.IGNORE).sum()) for t in targets)
        assert torch.allclose(loss, sum(ce) / n, atol=1e-6)


def test_embedded_instruction_set_is_stable():
    a = list(sft.stdlib_qa(50))
    assert a == list(sft.stdlib_qa(50)) and len(a) == 50
    name, msgs = a[0]
    assert name.startswith("stdlib:") and [m["role"] for m in msgs] == ["system", "user", "assistant"]


def test_health_warns_on_rising_eval_loss_and_stops_early(capsys):
    from omegaconf import OmegaConf

    from shardyard.training.loop import Health

    cfg = OmegaConf.create({"train": {"steps": 100, "warn_after_evals": 2, "early_stopping_patience": 3}})
    h = Health(cfg.train, rank0=True)
    stops = [h.on_eval(step, loss) for step, loss in [(0, 3.0), (10, 2.0), (20, 2.1), (30, 2.2), (40, 2.15)]]
    assert stops == [False, False, False, False, True]  # 3 evaluations without beating 2.0
    assert any("rose 2 evaluations in a row" in w for w in h.warnings)
    out = capsys.readouterr().out
    assert "overfitting" in out and "early stopping after step 40" in out
    flat = Health(cfg.train, rank0=False)
    for step in range(10, 60, 10):
        flat.on_train(step, 5.0 + 0.001 * step)
    assert any("has not fallen" in w for w in flat.warnings)
    swing = Health(OmegaConf.create({"steps": 10, "warn_after_evals": 0, "early_stopping_patience": None}), False)
    for step, loss in enumerate([4.0, 5.0, 4.0, 5.0, 4.0, 5.0], 1):
        swing.on_train(step, loss)
    assert any("oscillates" in w for w in swing.warnings)
    quiet = Health(cfg.train, rank0=False)  # an ordinary falling curve: nothing to say
    for step, loss in enumerate([5.0, 4.5, 4.2, 4.0, 3.9, 3.85, 3.8], 1):
        quiet.on_train(step * 10, loss)
        quiet.on_eval(step * 10, loss + 0.1)
    assert quiet.warnings == []


def test_a_split_every_conversation_was_left_out_of_is_refused_with_the_count_and_the_key(tok, tmp_path):
    """Every conversation longer than data.seq_len under truncation=drop, or cut before its first assistant token,
    or without an assistant turn (issue 53): refused naming the key at fault (data.seq_len; data.paths for
    conversations with nothing to learn), the count and why. (Before: an empty split, reported later as "no
    conversation" without a count.)"""
    import json

    path = tmp_path / "chat.jsonl"
    long = {"messages": [{"role": "user", "content": "Q " * 60}, {"role": "assistant", "content": "Paris."}]}
    path.write_text((json.dumps(long) + "\n") * 2)
    for policy, why in (("drop", "2 longer than data.seq_len=32"), ("truncate", "2 with every response token past")):
        with pytest.raises(UserError) as e:
            sft.SFTData([str(path)], truncation=policy).tokenize_rows(tok, 32, lambda name: False)
        assert (e.value.key, e.value.value) == ("data.seq_len", 32) and why in e.value.problem, e.value.paragraph()
        assert "All 2 conversations" in e.value.problem and str(path) in e.value.problem
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello?"}]}) + "\n")
    with pytest.raises(UserError) as e:
        sft.SFTData([str(path)]).tokenize_rows(tok, 32, lambda name: False)
    assert e.value.key == "data.paths" and "1 with no assistant turn" in e.value.problem, e.value.paragraph()
