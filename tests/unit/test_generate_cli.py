"""``shardyard generate`` (issue 45) on a tiny HF export built here (a 2-layer Llama with a byte-level BPE tokenizer
and a chat template): stop strings cut the completion where the unstopped one holds them first, streaming prints
the completion's exact text, a seed fixes sampled completions, rows of messages go through the chat template, and
bad inputs (a prompt file's bad line, an existing out file, a path that is nothing loadable) exit 2 naming them."""

import io
import json

import pytest
import torch

from conftest import byte_bpe
from shardyard.inference import generate, loading as inference
from shardyard.core.errors import UserError

TEXT = "def main(args):\n    return parse(args)\nimport os\nclass Parser:\n    pass\n" * 4
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("export")
    tok = byte_bpe(TEXT)
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a larger init than HF's 0.02: completions that vary with the prompt
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else None
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def trained(export):
    return inference.load(export)


def rows(trained, prompts, **keys):
    opts = generate.GenerateOptions(**{"max_new_tokens": 24, **keys})
    return generate.complete(trained.model, trained.tokenizer, prompts, opts)


def test_stop_strings_cut_where_the_unstopped_completion_holds_them(trained):
    full = rows(trained, ["def main("])[0]
    assert full["tokens"] == 24 and full["stop_reason"] == "length", full
    text = full["completion"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    want = text[:text.find(stop)]
    got = rows(trained, ["def main("], stop=[stop])[0]
    assert (got["completion"], got["stop_reason"]) == (want, "stop"), (got, want, stop)
    assert got["tokens"] < 24
    assert generate.cut("ab<x>cd<y>", ["<y>", "<x>"]) == ("ab", True)


def test_streaming_prints_the_completion(trained, export):
    """One prompt: the text printed as tokens come is the completion of the non-streamed run (stop strings held
    back until they cannot start one)."""
    for stop in ([], ["s"]):
        want = rows(trained, ["import os\n"], stop=stop)[0]["completion"]
        out = io.StringIO()
        got = generate.main([export, "prompt=import os\n", "max_new_tokens=24", "device=cpu",
                             *(f"stop={s}" for s in stop)], stdout=out)
        assert got is not None and got[0]["completion"] == want
        assert out.getvalue() == want + "\n", (out.getvalue(), want)
        assert len(want) > 5


def test_seed_fixes_sampled_completions(trained):
    prompts = ["def main(", "class Parser:"]
    a = rows(trained, prompts, temperature=1.0, top_k=50, seed=3)
    b = rows(trained, prompts, temperature=1.0, top_k=50, seed=3)
    c = rows(trained, prompts, temperature=1.0, top_k=50, seed=4)
    assert a == b and a != c


def test_chat_rows_go_through_the_template(trained):
    messages = [{"role": "user", "content": "def main("}]
    rendered = trained.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<user>def main(\n<assistant>"
    chat = rows(trained, [messages])[0]
    plain_chat = rows(trained, ["def main("], chat=True)[0]
    raw, text = rows(trained, ["def main(", rendered])  # batched: left-padded, as generation.generate takes them
    assert chat["completion"] == plain_chat["completion"] == text["completion"]  # chat=true: one user message
    assert chat["completion"] != raw["completion"]


def test_prompt_file_bad_line_names_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n{"prompt": 3}\n')
    with pytest.raises(UserError) as err:
        generate.read_prompts(generate.parse(["x", f"file={f}"])[1])
    assert (err.value.key, err.value.value) == ("file", f"{f}:4")
    f.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(UserError) as err:
        generate.read_prompts(generate.parse(["x", f"file={f}"])[1])
    assert err.value.value == f"{f}:2"
    got = generate.read_prompts(generate.parse(["x", "prompt=z", "file=-"])[1],
                                io.StringIO('{"messages": [{"role": "user", "content": "b"}]}\n'))
    assert got == ["z", [{"role": "user", "content": "b"}]]


def test_out_file_is_never_overwritten(trained, export, tmp_path):
    out = tmp_path / "rows.jsonl"
    generate.main([export, "prompt=a", "prompt=b", f"out={out}", "max_new_tokens=3", "device=cpu"])
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in written] == ["a", "b"] and all(r["tokens"] == 3 for r in written)
    assert set(written[0]) == {"prompt", "completion", "tokens", "stop_reason"}
    with pytest.raises(UserError) as err:
        generate.main([export, "prompt=a", f"out={out}"])
    assert (err.value.key, err.value.value) == ("out", str(out))
    assert [json.loads(line) for line in out.read_text().splitlines()] == written


def test_cli_generates_and_refuses_a_path_that_is_nothing_loadable(export, tmp_path):
    """Two runs of the command (``python -m shardyard generate``, forked warm as train_py runs are): a completion
    printed; a directory that is no run dir, checkpoint or export exits 2 with one paragraph naming it."""
    from conftest import shardyard_cli

    ok = shardyard_cli("generate", export, "prompt=def main(", "max_new_tokens=5", "prompt=import os")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert [json.loads(line)["tokens"] for line in ok.stdout.splitlines()] == [5, 5]
    (tmp_path / "notes.txt").write_text("x")
    bad = shardyard_cli("generate", str(tmp_path), "prompt=x")
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "error in `path`" in bad.stderr and str(tmp_path) in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_cli_forwards_path_and_keys(command, tmp_path, capsys):
    """``shardyard generate`` and ``shardyard eval`` hand PATH and the KEY=VALUE arguments to their module: a path
    that is not there exits 2 with the paragraph naming it (in-process: a success ends in ``os._exit``)."""
    from shardyard import cli

    with pytest.raises(SystemExit) as done:
        cli.main([command, str(tmp_path / "missing"), "max_new_tokens=4" if command == "generate" else "batches=1"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "error in `path`" in err and "missing" in err, err


def test_values_are_literal_and_lists_come_from_repeated_keys():
    """``prompt=[1, 2, 3]`` is one prompt (no YAML reading of values); stop strings likewise, ``\\n`` a newline."""
    _, opts = generate.parse(["x", "prompt=[1, 2, 3]", "prompt=[1, 2] sorted is", "stop=[", "stop=a\\nb",
                              "stop=[{a: 1}]"])
    assert opts.prompt == ["[1, 2, 3]", "[1, 2] sorted is"]
    assert opts.stop == ["[", "a\nb", "[{a: 1}]"]


def test_refusals_before_loading(export, tmp_path):
    """stream with several prompts, out= in a missing directory, an empty prompt file: exit 2 naming each."""
    cases = [([export, "prompt=a", "prompt=b", "stream=true"], "stream", True),
             ([export, "prompt=a", f"out={tmp_path / 'no' / 'rows.jsonl'}"], "out", str(tmp_path / "no" / "rows.jsonl")),
             ([export, f"file={tmp_path / 'empty.jsonl'}"], "file", str(tmp_path / "empty.jsonl"))]
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    for args, key, value in cases:
        with pytest.raises(UserError) as err:
            generate.main(args)
        assert (err.value.key, err.value.value) == (key, value), err.value


def test_prompt_longer_than_the_model_positions_is_refused_naming_it(export, trained, tmp_path):
    """The export takes 256 positions (max_position_embeddings): a prompt of n tokens leaves 256 - n for
    max_new_tokens; one more is refused naming the prompt's file:line."""
    long = "def main(args):\n    return parse(args)\n" * 6
    n = len(trained.tokenizer(long, add_special_tokens=False).input_ids)  # the independent count
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": long}) + "\n")
    with pytest.raises(UserError) as err:
        generate.main([export, f"file={f}", f"max_new_tokens={256 - n + 1}", "device=cpu"])
    assert (err.value.key, err.value.value) == ("max_new_tokens", 256 - n + 1)
    assert f"{f}:2 is {n} tokens" in err.value.problem and f"max_new_tokens<={256 - n}" in err.value.fix
    assert generate.positions(trained.model, None) == (256, "its config's max_position_embeddings")


def test_rows_end_at_the_generation_config_eos_too(trained):
    """A token of ``generation_config.eos_token_id`` (a list beside the tokenizer's eos) ends a row: the
    completion is the unstopped one up to that token, which is counted and not printed."""
    from shardyard.models.generation import generate as plain

    tok = trained.tokenizer
    prompt = torch.tensor([tok("def main(", add_special_tokens=False).input_ids])
    out, _ = plain(trained.model, prompt, torch.ones_like(prompt), max_new_tokens=24, temperature=0.0,
                   eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    ids = out[0].tolist()  # the unstopped greedy tokens (24: no eos among them, test_stop_strings_... says)
    k = len(ids) // 2
    config = trained.model.generation_config
    was = config.eos_token_id
    config.eos_token_id = [trained.tokenizer.eos_token_id, ids[k]]
    try:
        got = rows(trained, ["def main("])[0]
    finally:
        config.eos_token_id = was
    first = ids.index(ids[k])
    assert (got["stop_reason"], got["tokens"]) == ("eos", first + 1), got
    assert got["completion"] == tok.decode(ids[:first], skip_special_tokens=True)


def test_stop_check_decodes_a_tail_window(trained):
    """Each token decodes only the last few tokens of a row (the longest stop string's bytes + 8), not the whole
    completion: the longest decode asked for stays at that window however long the completion."""
    class Counting:
        def __init__(self, tok):
            self.tok, self.longest = tok, 0

        def decode(self, ids, **kw):
            self.longest = max(self.longest, len(ids))
            return self.tok.decode(ids, **kw)

    tok = Counting(trained.tokenizer)
    watcher = generate.Watcher(tok, ["never there"])
    ids = torch.tensor([trained.tokenizer("def main(args): return 1\n" * 20, add_special_tokens=False).input_ids])
    assert ids.size(1) > 60
    for t in range(1, ids.size(1) + 1):
        assert not watcher(ids[:, :t]).any()
    assert tok.longest == len("never there") + 8
    assert watcher(torch.tensor([trained.tokenizer("x never there", add_special_tokens=False).input_ids])).all()


def test_cli_success_in_process_returns_through_system_exit(export, tmp_path):
    """A successful ``shardyard generate`` called in-process ends with ``SystemExit(0)`` (not ``os._exit``, which
    would end this test's process)."""
    from shardyard import cli

    out = tmp_path / "rows.jsonl"
    with pytest.raises(SystemExit) as done:
        cli.main(["generate", export, "prompt=a", "max_new_tokens=2", f"out={out}", "device=cpu"])
    assert done.value.code == 0 and json.loads(out.read_text())["tokens"] == 2


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("name,damage", [
    ("config.yaml", lambda d: (d / "config.yaml").write_text("model: [unclosed\n")),
    ("config.json", lambda d: (d / "config.json").write_text("{bad")),
    ("config.json", lambda d: (d / "config.json").write_text(
        (d / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "no_such_model"'))),
    ("model.safetensors", lambda d: _truncate(d / "model.safetensors")),
    ("tokenizer.json", lambda d: (d / "tokenizer.json").write_text("{bad")),
], ids=["run-config-yaml", "config-not-json", "unknown-model-type", "truncated-weights", "tokenizer-not-json"])
def test_a_damaged_file_exits_2_naming_path_and_the_file(export, tmp_path, name, damage):
    """A damaged file of a run dir or an HF export is a ``UserError`` naming PATH and the file (exit 2), not a
    traceback from yaml, transformers, safetensors or json. ``config.yaml`` is a run dir's: the run holds the
    export as ``hf/``."""
    import shutil

    run = tmp_path / "run"
    hf = run / "hf" if name == "config.yaml" else run
    shutil.copytree(export, hf)
    if name == "config.yaml":
        (run / "config.yaml").write_text("seed: 0\n")
    damage(run)
    with pytest.raises(UserError) as err:
        generate.main([str(run), "prompt=a", "max_new_tokens=1", "device=cpu"])
    assert (err.value.key, err.value.value) == ("path", str(run)), err.value
    assert str(run / name) in err.value.problem, err.value.problem


def test_a_refused_generate_leaves_no_out_file(export, tmp_path):
    """max_new_tokens past the model's 256 positions is refused after loading: no (empty) out file is left to
    block the rerun, which then writes its rows there."""
    out = tmp_path / "rows.jsonl"
    with pytest.raises(UserError) as err:
        generate.main([export, "prompt=a", "max_new_tokens=300", f"out={out}", "device=cpu"])
    assert err.value.key == "max_new_tokens" and not out.exists()
    generate.main([export, "prompt=a", "max_new_tokens=2", f"out={out}", "device=cpu"])
    assert json.loads(out.read_text())["tokens"] == 2


@pytest.mark.parametrize("device", ["foo", "cuda:x", "cpu:0", "cuda:99"])
def test_a_device_that_is_not_there_is_refused_naming_device(export, device):
    """``device=`` takes cpu, cuda, cuda:N (a GPU this process sees) and auto: another is a ``UserError`` naming
    it before anything loads (cuda:99: no machine here has 100 GPUs)."""
    with pytest.raises(UserError) as err:
        generate.main([export, "prompt=a", f"device={device}"])
    assert (err.value.key, err.value.value) == ("device", device)


@pytest.mark.parametrize("arg,key", [("out=", "out"), ("prompt=", "prompt"), ("stop=", "stop"), ("file=", "file"),
                                     ("chat_template=", "chat_template"), ("dtype=", "dtype"), ("device=", "device"),
                                     ("max_new_tokens=", "max_new_tokens"), ("temperature=nan", "temperature"),
                                     ("top_p=inf", "top_p"), ("stream=", "stream")])
def test_empty_and_unusable_values_are_refused_at_parsing(arg, key):
    """Every key's empty value, and a number that is not finite, are refused while the command line is read,
    naming the key (issue 53). (Before: ``out=`` was read as a file named '', whose opening failed after the
    first batch was generated; ``prompt=`` generated from nothing; ``temperature=nan`` sampled from NaNs.)"""
    with pytest.raises(UserError) as err:
        generate.parse(["x", arg])
    assert err.value.key == key, err.value.paragraph()


@pytest.mark.parametrize("args,key,says", [
    (["chat_template=nonsense"], "chat_template", "neither a built-in"),
    (["chat_template={% if %}"], "chat_template", "does not compile"),
    (["seed=-1"], "seed", "from 0"),
    (["out=."], "out", "is a directory"),
])
def test_values_that_need_no_model_are_refused_before_it_loads(tmp_path, args, key, says):
    """A chat template that is no name and does not compile, a negative seed, ``out=`` a directory: refused
    naming the key before PATH is read (issue 53). (Before: the template failed after the model loaded, naming
    data.chat_template or nothing; the directory was called an existing file.)"""
    with pytest.raises(UserError) as err:
        generate.main([str(tmp_path / "never-read"), "prompt=a", *args])
    assert err.value.key == key and says in err.value.problem, err.value.paragraph()


def test_a_prompt_file_that_is_not_utf8_names_the_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "caf\xe9"}\n')  # latin-1
    with pytest.raises(UserError) as err:
        generate.read_prompts(generate.parse(["x", f"file={f}"])[1])
    assert (err.value.key, err.value.value) == ("file", str(f)) and "UTF-8" in err.value.problem
    with pytest.raises(UserError) as err:
        generate.read_prompts(generate.parse(["x", "file=-"])[1],
                              io.TextIOWrapper(io.BytesIO(b'{"prompt": "caf\xe9"}\n'), encoding="utf-8"))
    assert (err.value.key, err.value.value) == ("file", "<stdin>")
