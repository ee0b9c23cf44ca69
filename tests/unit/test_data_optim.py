"""Data sharding, determinism and schedules."""

import numpy as np
import pytest
import torch

from shardyard.data import pipeline as data
from shardyard.core.dist_env import DistEnv, detect
from shardyard.backends.optim import build_schedule
from shardyard.testing import compose


@pytest.fixture(scope="module")
def seqs(tmp_path_factory):
    return data.PackedSequences(np.arange(10_000, dtype=np.uint16) % 1000, 16)


def test_ranks_partition_the_global_batch(seqs):
    single = data.TrainStream(seqs, 7, global_batch=8, micro_batch=4, rank=0, world=1)
    ranks = [data.TrainStream(seqs, 7, global_batch=8, micro_batch=2, rank=r, world=2) for r in range(2)]
    for step in (0, 1, 5, single.steps_per_epoch + 2):
        ref = torch.cat([single.micro_batch(step, a)[0] for a in range(2)])
        got = torch.cat([ranks[r].micro_batch(step, a)[0] for r in range(2) for a in range(2)])
        assert torch.equal(ref, got)


def test_targets_are_inputs_shifted_by_one(seqs):
    x, y = data.TrainStream(seqs, 0, 4, 4, 0, 1).micro_batch(0, 0)
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_epochs_reshuffle_deterministically(seqs):
    s = data.TrainStream(seqs, 0, 4, 4, 0, 1)
    e0, e1 = s.micro_batch(0, 0)[0], s.micro_batch(s.steps_per_epoch, 0)[0]
    assert not torch.equal(e0, e1)
    assert torch.equal(e1, data.TrainStream(seqs, 0, 4, 4, 0, 1).micro_batch(s.steps_per_epoch, 0)[0])
    assert s.position(s.steps_per_epoch + 3) == {"epoch": 1, "step_in_epoch": 3, "samples_seen": 4 * (s.steps_per_epoch + 3)}


def test_stdlib_corpus_is_fixed_order_and_split_is_stable():
    import sysconfig

    src = data.StdlibCode(["test", "tests", "idlelib", "site-packages"])
    files = src.files()
    root = sysconfig.get_paths()["stdlib"]
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(files) > 300  # a fixed order, and the corpus is all there
    assert not any(part in ("test", "tests", "idlelib") for r in rel for part in r.split("/")[:-1])
    names = [name for name, _ in src.documents()]
    assert names == [name for name, _ in data.StdlibCode(src.exclude_dirs).documents()]
    frac = np.mean([data.is_val(n, 0.05) for n in names])
    assert 0.01 < frac < 0.12


def test_prepare_builds_tokenizer_and_tokens():
    cfg = compose([])
    p = data.prepare(cfg)
    tok = data.load_tokenizer(p.tokenizer_dir)
    assert len(tok) == cfg.data.tokenizer.vocab_size == p.vocab_size
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_text_files_corpus_and_its_caches_are_verified(tmp_path, capsys):
    """.txt, .jsonl and .json (an array) are read whole; a cut-short token or tokenizer cache is rebuilt, saying
    so, never used (issue 30)."""
    import json
    import os

    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 300)
    with open(tmp_path / "b.jsonl", "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"record {i}: lorem ipsum dolor sit amet"}) + "\n")
    (tmp_path / "c.json").write_text(json.dumps([{"text": f"array item {i}"} for i in range(40)], indent=1))
    cfg = compose(["data=text_files", f"data.paths=[{tmp_path}]", "data.tokenizer.vocab_size=300",
                   "data.seq_len=16", f"data.cache_dir={tmp_path}/cache", "data.val_fraction=0.2"])
    docs = dict(data.TextFiles([str(tmp_path)]).documents())
    assert len(docs) == 1 + 300 + 40 and docs["c.json:39"] == "array item 39" and docs["b.jsonl:7"].startswith("record 7:")
    p = data.prepare(cfg)
    assert p.vocab_size == 300
    n = len(data.open_split(p, "train", 16))
    assert n > 10
    for victim in (f"{p.token_dir}/train-00000.bin", f"{p.tokenizer_dir}/tokenizer.json"):
        os.truncate(victim, os.path.getsize(victim) // 2)
        capsys.readouterr()
        again = data.prepare(cfg)
        out = capsys.readouterr().out
        assert f"{os.path.dirname(victim)} does not verify ({os.path.basename(victim)} has" in out and "rebuilding" in out, out
        assert again == p and len(data.open_split(p, "train", 16)) == n
    with open(f"{p.token_dir}/train-00000.bin", "r+b") as f:  # one byte changed in place, the size kept: the
        first = f.read(1)                                     # stamp (mtime, ctime) no longer holds
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    capsys.readouterr()
    data.prepare(cfg)
    assert "train-00000.bin does not match the sha256" in capsys.readouterr().out
    data.prepare(cfg)
    assert "does not verify" not in capsys.readouterr().out  # verified, used as is


@pytest.mark.parametrize("name,content,key,where", [
    ("a.jsonl", '{"text": "ok"}\nnot json\n', "data.paths", ":2"),
    ("a.jsonl", '{"text": "ok"}\n\n42\n', "data.paths", ":3"),  # JSON, not an object
    ("a.jsonl", '{"text": 5}\n', "data.text_field", ":1"),  # not a string (was a TypeError traceback)
    ("a.jsonl", '{"body": "x"}\n', "data.text_field", ":1"),  # missing
    ("a.json", '[{"text": "ok"},\n {"text": null}]', "data.text_field", ":2"),
    ("a.json", '[{"text": "ok"}\n {"text": "b"}]', "data.paths", ":2"),  # a comma missing
    ("a.json", '[{"text": "ok"},\n ["x"]]', "data.paths", ":2"),
    ("a.json", '[{"text": "ok"}', "data.paths", ":1"),  # cut short
    ("a.json", '{"text": "ok"}\n{"text": 1}\n', "data.text_field", ":2"),  # one object per line
])
def test_every_malformed_record_exits_2_naming_file_and_line(tmp_path, name, content, key, where):
    from shardyard.core.errors import UserError

    (tmp_path / name).write_text(content)
    with pytest.raises(UserError) as e:
        list(data.TextFiles([str(tmp_path)]).documents())
    assert e.value.key == key and f"{tmp_path / name}{where}" in e.value.paragraph().replace("\n", " "), e.value.paragraph()


def test_paths_that_match_no_readable_file_exit_2(tmp_path):
    from shardyard.core.errors import UserError

    (tmp_path / "notes.xlsx").write_text("a,b\n")
    (tmp_path / "rows.parquet.gz").write_text("")  # Parquet compresses inside: no outer codec
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "\xff"}\n')
    for paths, value in (([str(tmp_path / "notes.xlsx")], "notes.xlsx"), ([str(tmp_path / "none*")], "none*"),
                         ([str(tmp_path / "rows.parquet.gz")], "rows.parquet.gz")):
        with pytest.raises(UserError) as e:
            data.TextFiles(paths)
        assert e.value.key == "data.paths" and str(e.value.value).endswith(value)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.xlsx").write_text("")
    with pytest.raises(UserError) as e:
        data.TextFiles([str(empty)])
    assert e.value.value == str(empty) and "no .txt/.jsonl/.json/.parquet/.arrow/.csv" in e.value.problem
    with pytest.raises(UserError) as e:
        list(data.TextFiles([str(tmp_path / "bad.jsonl")]).documents())
    assert "not UTF-8" in e.value.problem


def test_a_broken_tokenizer_or_cut_short_weights_are_refused_at_validation(tmp_path):
    import os

    from safetensors.numpy import save_file

    from shardyard.planning.rules import _safetensors_problem
    from shardyard.core.errors import UserError

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")  # no tokenizer.json: was a traceback
    with pytest.raises(UserError) as e:
        data.check_tokenizer("data.tokenizer.path", str(tmp_path / "tok"))
    assert e.value.key == "data.tokenizer.path" and "tokenizer.json" in e.value.problem
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0", "truncation": null, "padd')
    with pytest.raises(UserError) as e:
        data.check_tokenizer("data.tokenizer.path", str(tmp_path / "tok"))
    assert "cannot be loaded" in e.value.problem
    weights = tmp_path / "w" / "model.safetensors"
    weights.parent.mkdir()
    save_file({"a": np.zeros((64, 64), np.float32), "b": np.ones(10, np.float32)}, str(weights))
    assert _safetensors_problem(str(weights)) is None
    os.truncate(weights, os.path.getsize(weights) - 4)
    assert "up to byte" in _safetensors_problem(str(weights))
    with pytest.raises(UserError) as e:
        from shardyard.planning.validate import validate

        validate(compose([f"model.weights={weights.parent}"]), None)
    assert e.value.key == "model.weights" and e.value.value == str(weights), e.value.paragraph()


@pytest.mark.parametrize("name,expect_end", [("cosine", 0.1), ("linear", 0.1), ("constant", 1.0)])
def test_schedules(name, expect_end):
    factor = build_schedule(compose([f"sched={name}", "sched.warmup_steps=10"]).sched)
    assert factor(0, 100) == pytest.approx(0.1)
    assert factor(9, 100) == pytest.approx(1.0)
    assert factor(100, 100) == pytest.approx(expect_end)


@pytest.mark.parametrize("listing,node,tasks", [("4", 0, 4), ("4(x2)", 1, 4), ("2(x3),1", 3, 1), ("3,5", 1, 5)])
def test_slurm_tasks_per_node_listing(listing, node, tasks):
    from shardyard.core.dist_env import slurm_tasks_on_node

    assert slurm_tasks_on_node(listing, node) == tasks


def test_launcher_detection(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
              "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SUBMITIT_EXECUTOR"):
        monkeypatch.delenv(k, raising=False)
    assert detect() is None
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert detect() is None  # inside an sbatch script, not a task of srun
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x1),6")  # srun -n 8 over two nodes: 2 here, then 6
    assert detect() == DistEnv("slurm", 3, 1, 8, 6)
    for k in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(k)
    # A horovodrun worker stays a Horovod worker after we export RANK/WORLD_SIZE for torch.
    monkeypatch.setenv("HOROVOD_RANK", "1")
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert detect().launcher == "horovod"
