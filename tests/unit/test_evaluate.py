"""``shardyard eval``'s command line, its bad inputs (exit 2 naming the key), and the shipped local harness task.
(Scores and perplexities of trained runs: tests/e2e/test_eval_tasks.py.)"""

import importlib
import inspect
import json
import os
import sys

import pytest

from shardyard.inference import evaluate
from shardyard.evaluation import harness
from shardyard.core.errors import UserError


def test_keys_are_options_and_the_rest_train_py_overrides():
    path, opts, overrides = evaluate.parse(["outputs/run", "tasks=[stdlib_qa, hellaswag]", "limit=0.5",
                                            "batch_size=4", "perplexity=false", "data=text_files",
                                            "data.paths=[/c]", "eval_batches=0", "num_fewshot=3"])
    assert path == "outputs/run" and overrides == ["data=text_files", "data.paths=[/c]"]
    assert (opts.tasks, opts.limit, opts.batch_size, opts.perplexity, opts.eval_batches, opts.num_fewshot) == (
        ["stdlib_qa", "hellaswag"], 0.5, 4, False, 0, 3)
    assert evaluate.parse(["p", "limit=20"])[1].limit == 20


@pytest.mark.parametrize("arg,key", [("batch_size=0", "batch_size"), ("limit=-1", "limit"), ("limit=2.5", "limit"),
                                     ("perplexity=maybe", "perplexity"), ("num_fewshot=x", "num_fewshot")])
def test_bad_values_name_their_key(arg, key):
    with pytest.raises(UserError) as e:
        evaluate.parse(["outputs/run", arg])
    assert e.value.key == key


@pytest.mark.parametrize("args", [[], ["a", "b"]])
def test_one_path(args):
    with pytest.raises(UserError, match="one PATH"):
        evaluate.parse(args)


def test_help_lists_every_key_with_its_docstring():
    text = evaluate.keys_help()
    for f in evaluate.fields(evaluate.EvalOptions):
        assert f"  {f.name} " in text, f.name
    assert "lm-evaluation-harness tasks" in text


def test_an_existing_out_file_is_never_overwritten(tmp_path):
    (tmp_path / "r.json").write_text("{}")
    with pytest.raises(UserError) as e:
        evaluate._out_path(str(tmp_path / "r.json"), None)
    assert e.value.key == "out"
    assert evaluate._out_path(None, str(tmp_path)).startswith(str(tmp_path / "eval") + os.sep)


def test_without_lm_eval_tasks_exit_2_naming_the_extra(monkeypatch, capsys):
    from shardyard import cli

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` meets where it is not installed
    with pytest.raises(SystemExit) as e:  # "nowhere" is never read: the harness is looked for first
        cli.main(["eval", "nowhere", "tasks=[stdlib_qa]"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error in `tasks`" in err and "`make setup EXTRAS=eval`" in " ".join(err.split()), err  # the checkout's command


def test_an_unknown_task_exits_2_naming_tasks_and_close_names(capsys):
    pytest.importorskip("lm_eval", reason="the eval extra (pip install -e '.[eval]'): make setup installs it")
    from shardyard import cli

    with pytest.raises(SystemExit) as e:  # checked before any model loads (the path is never read)
        cli.main(["eval", "nowhere", "tasks=[stdlib_q]"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error in `tasks`" in err and "stdlib_qa" in err and "include_path" in err, err


def test_shipped_stdlib_qa_rows_are_right_about_the_stdlib():
    """Every row: four distinct modules, and the target is the module that defines the function (checked here by
    importing it), the others ones that do not."""
    sys.path.insert(0, os.path.join(harness.TASKS_DIR, "stdlib_qa"))
    try:
        task = importlib.import_module("stdlib_qa")
    finally:
        sys.path.pop(0)
    rows = [json.loads(line) for line in open(task.DATA)]
    assert 50 <= len(rows) <= 200
    assert len({r["module"] for r in rows}) >= 30
    for r in rows:
        mods = [c.split(" import ")[0].strip() for c in r["choices"]]
        assert len(set(mods)) == 4 and r["choices"][r["answer"]] == f" {r['module']} import {r['name']}", r
        module = importlib.import_module(mods[r["answer"]])
        fn = getattr(module, r["name"])
        assert inspect.isfunction(fn) and fn.__module__ == module.__name__, r  # os.path's: posixpath (ntpath)
        assert all(getattr(importlib.import_module(m), r["name"], None) is not fn for i, m in enumerate(mods)
                   if i != r["answer"]), r
        assert r["question"].startswith(f"# {r['name']}: ") and r["question"].endswith("\nfrom")
    loaded = task.load()["test"]  # the task's custom_dataset, as lm-eval calls it
    assert len(loaded) == len(rows) and loaded[0]["choices"] == rows[0]["choices"]
    yaml_text = open(os.path.join(harness.TASKS_DIR, "stdlib_qa", "stdlib_qa.yaml")).read()
    assert "task: stdlib_qa" in yaml_text and "output_type: multiple_choice" in yaml_text


@pytest.mark.parametrize("device", ["foo", "cuda:x", "cuda:99"])
def test_a_device_that_is_not_there_is_refused_naming_device(device):
    """The same device rule as ``shardyard generate`` (``options.device``), checked before the path is read."""
    with pytest.raises(UserError) as e:
        evaluate.main(["nowhere", f"device={device}"])
    assert (e.value.key, e.value.value) == ("device", device)


def test_limit_is_a_count_or_a_fraction_below_1():
    """``options.limit``: None, a whole count (an int) or a fraction in (0, 1); else a ``UserError`` naming the
    key it was given."""
    from shardyard.config import options

    assert options.limit("limit", None) is None
    assert options.limit("limit", 100.0) == 100 and isinstance(options.limit("limit", 100.0), int)
    assert options.limit("limit", 0.25) == 0.25
    for bad in (0, -1, 2.5, float("nan"), float("inf"), True, "3"):
        with pytest.raises(UserError) as e:
            options.limit("train.eval_tasks_limit", bad)
        assert e.value.key == "train.eval_tasks_limit", bad
    assert evaluate.parse(["p", "limit=none"])[1].limit is None
    assert evaluate.parse(["p", "limit=3"])[1].limit == 3 and isinstance(evaluate.parse(["p", "limit=3"])[1].limit, int)


def test_an_include_path_without_tasks_is_refused_naming_it(tmp_path):
    """A directory of task YAMLs that no ``tasks=`` asks for is a mistake, not silently ignored (before the path is
    read)."""
    with pytest.raises(UserError) as e:
        evaluate.main(["nowhere", f"include_path={tmp_path}"])
    assert (e.value.key, e.value.value) == ("include_path", str(tmp_path))


@pytest.mark.parametrize("arg,key", [("out=", "out"), ("include_path=", "include_path"), ("tasks=", "tasks"),
                                     ("dtype=", "dtype"), ("device= ", "device"), ("limit=nan", "limit"),
                                     ("seed=4294967296", "seed"), ("batch_size=", "batch_size")])
def test_empty_and_unusable_values_are_refused_at_parsing(arg, key):
    """Every key's empty value (a variable that expanded to nothing), a limit that is no number, a seed numpy
    cannot take: refused while the command line is read, naming the key (issue 53). (Before: ``out=`` was read as
    a file named '', whose writing failed after the whole evaluation; ``seed=2**32`` failed in numpy after the
    model loaded; ``include_path=`` was ignored.)"""
    with pytest.raises(UserError) as e:
        evaluate.parse(["outputs/run", arg])
    assert e.value.key == key, e.value.paragraph()


def test_an_out_that_cannot_be_written_is_refused_before_anything_loads(tmp_path):
    """``out=`` an existing directory, or a file under a path that passes through a file, is refused before the
    model loads (PATH is never read), naming ``out``; a file under directories that do not exist yet is made with
    them, and a results file that cannot be written after all goes beside it (issue 53: nothing computed is lost).
    (Before: the directory was called an existing file; the file-parent case failed after the evaluation.)"""
    (tmp_path / "plain").write_text("x")
    for out, says in ((tmp_path, "is a directory"), (tmp_path / "plain" / "r.json", "is a file")):
        with pytest.raises(UserError) as e:
            evaluate.main([str(tmp_path / "never-read"), f"out={out}", "tasks=[stdlib_qa]"])
        assert (e.value.key, e.value.value) == ("out", str(out)) and says in e.value.problem, e.value.paragraph()
    assert evaluate._out_path(str(tmp_path / "new" / "r.json"), None) == str(tmp_path / "new" / "r.json")
    taken = tmp_path / "taken.json"
    taken.write_text("{}")  # made while the evaluation ran
    written = evaluate._write(str(taken), {"tasks": {"t": {"acc": 0.5}}})
    assert written != str(taken) and json.load(open(written)) == {"tasks": {"t": {"acc": 0.5}}}
    assert taken.read_text() == "{}"
