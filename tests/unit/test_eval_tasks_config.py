"""``train.eval_tasks`` (issue 45) is checked before any worker starts: an unknown task, a missing harness, a
generation task and an engine that splits the model into stages are refused naming ``train.eval_tasks``; a known
task passes. And the scores a tag or group reports under its member tasks' names reach the CSV and the console."""

import sys

import pytest

from shardyard.core.errors import UserError
from shardyard.testing import TINY, compose
from shardyard.planning.validate import validate


def _refusal(*overrides: str) -> UserError:
    with pytest.raises(UserError) as e:
        validate(compose([*TINY, *overrides]), None)
    return e.value


def test_an_unknown_task_is_refused_naming_train_eval_tasks_and_close_names():
    err = _refusal("train.eval_tasks=[stdlib_qaa]")
    assert err.key == "train.eval_tasks" and err.value == "stdlib_qaa", err.paragraph()
    assert "stdlib_qa" in err.paragraph() and "train.eval_tasks_include_path" in err.paragraph()


def test_known_tasks_pass_and_a_missing_include_path_is_named(tmp_path):
    validate(compose([*TINY, "train.eval_tasks=[stdlib_qa]", "train.eval_tasks_limit=8"]), None)
    err = _refusal("train.eval_tasks=[stdlib_qa]", f"train.eval_tasks_include_path={tmp_path}/none")
    assert err.key == "train.eval_tasks_include_path", err.paragraph()


def test_without_lm_eval_the_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` meets where it is not installed
    err = _refusal("train.eval_tasks=[stdlib_qa]")
    assert err.key == "train.eval_tasks" and "setup EXTRAS=eval`" in err.paragraph(), err.paragraph()


def test_pipeline_stages_and_a_bad_limit_are_refused():
    err = _refusal("backend=pipeline", "backend.stages=2", "backend.microbatches=2", "launch.nproc_per_node=2",
                   "train.eval_tasks=[stdlib_qa]")
    assert err.key == "train.eval_tasks" and "pipeline" in err.paragraph(), err.paragraph()
    assert _refusal("train.eval_tasks=[stdlib_qa]", "train.eval_tasks_limit=2.5").key == "train.eval_tasks_limit"


def _task_dir(tmp_path, output_type: str | None) -> str:
    """A task directory: ``gen_rows`` (with ``output_type`` when given: the harness's default is generate_until),
    tagged ``gen_tag``, and ``gen_group``, a group holding it."""
    kind = f"output_type: {output_type}\n" if output_type else ""
    (tmp_path / "gen_rows.jsonl").write_text('{"q": "1+1=", "t": "2"}\n')  # tasks are built at validation
    (tmp_path / "gen.yaml").write_text(
        f"task: gen_rows\ntag: gen_tag\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'gen_rows.jsonl'}\n"
        f"{kind}test_split: test\ndoc_to_text: '{{{{q}}}}'\ndoc_to_target: '{{{{t}}}}'\nmetadata:\n  version: 1\n")
    (tmp_path / "group.yaml").write_text("group: gen_group\ntask:\n  - gen_rows\n")
    return str(tmp_path)


@pytest.mark.parametrize("asked", ["gen_rows", "gen_tag", "gen_group"])
def test_a_generation_task_is_refused_before_any_worker_starts(tmp_path, asked):
    """A task whose YAML says (or defaults to) ``output_type: generate_until``, asked for by name, by its tag or
    by a group, is refused naming ``train.eval_tasks`` and the task; as a log-likelihood task it passes."""
    include = f"train.eval_tasks_include_path={_task_dir(tmp_path, None)}"
    err = _refusal(f"train.eval_tasks=[stdlib_qa,{asked}]", include)
    assert err.key == "train.eval_tasks" and err.value == "gen_rows", err.paragraph()
    assert "generate_until" in err.paragraph() and "shardyard eval" in err.paragraph(), err.paragraph()
    validate(compose([*TINY, f"train.eval_tasks=[{asked}]",
                      f"train.eval_tasks_include_path={_task_dir(tmp_path, 'loglikelihood')}"]), None)


def test_a_tags_member_scores_reach_the_csv_and_the_console_line(tmp_path, capsys):
    """A tag (or group) reports its member tasks' scores under their own names (``eval/<member>/<metric>``, not
    ``eval/<tag>/...``): the CSV gives each a column at the first evaluation, the console's eval line shows them
    (the stderr left to the files)."""
    import csv

    from omegaconf import OmegaConf

    from shardyard.monitors.console import ConsoleMonitor
    from shardyard.monitors.csv import CsvMonitor

    config = OmegaConf.create({"train": {"steps": 2, "eval_tasks": ["gen_tag"]}})
    table, console = CsvMonitor(str(tmp_path), config), ConsoleMonitor(str(tmp_path), config, style="plain")
    logged = [(0, {"eval/loss": 2.5, "eval/gen_rows/acc": 0.25, "eval/gen_rows/acc_stderr": 0.1}),
              (1, {"train/loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0}),
              (2, {"eval/loss": 2.0, "eval/gen_rows/acc": 0.75, "eval/other/acc": 0.5})]
    for step, metrics in logged:
        for m in (table, console):
            m.log(step, metrics)
    table.close({})
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv", newline="")))
    assert [(r["step"], r["eval/gen_rows/acc"], r["eval/gen_rows/acc_stderr"], r["eval/other/acc"]) for r in rows] \
        == [("0", "0.25", "0.1", ""), ("1", "", "", ""), ("2", "0.75", "", "0.5")]
    out = capsys.readouterr().out
    assert "eval @ step 0: loss 2.5000 | gen_rows/acc 0.2500\n" in out, out
    assert "eval @ step 2: loss 2.0000 | gen_rows/acc 0.7500 | other/acc 0.5000\n" in out, out


def test_the_eval_tasks_keys_are_checked_without_tasks_too(tmp_path):
    """A bad limit or an include path with no task is refused even when train.eval_tasks is empty (never ignored)."""
    assert _refusal("train.eval_tasks_limit=-1").key == "train.eval_tasks_limit"
    assert _refusal(f"train.eval_tasks_include_path={tmp_path}").key == "train.eval_tasks_include_path"
    err = _refusal("train.eval_tasks=[stdlib_qa]", "train.eval_tasks_include_path=")  # issue 53: was ignored
    assert err.key == "train.eval_tasks_include_path" and "empty" in err.problem, err.paragraph()


GOOD_TASK = ("task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {rows}\n"
             "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{{{q}}}}'\n"
             "doc_to_choice: '{{{{choices}}}}'\ndoc_to_target: a\nmetric_list:\n  - metric: acc\nmetadata:\n"
             "  version: 1\n")
"""A local multiple-choice task over ``rows`` (a JSONL file of ``q``, ``choices``, ``a``)."""


def _local_task(tmp_path, name: str = "mine", **damage: str) -> tuple[str, str]:
    """A directory holding ``<name>.yaml`` (``GOOD_TASK``, with ``damage``: a line replaced, ``old=new``) and its
    rows: ``(the directory, the YAML's path)``."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"q": "2+2=", "choices": ["4", "5"], "a": 0}\n{"q": "1+2=", "choices": ["2", "3"], "a": 1}\n')
    text = GOOD_TASK.format(name=name, rows=rows)
    for old, new in damage.values():
        assert old in text, old
        text = text.replace(old, new)
    tasks = tmp_path / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / f"{name}.yaml").write_text(text)
    return str(tasks), str(tasks / f"{name}.yaml")


DAMAGE = {  # what a user gets wrong in a task YAML: the field at fault, and the line that is wrong
    "misspelt-output-type": ("output_type", ("multiple_choice", "multiple_choise")),
    "missing-data-file": ("dataset_kwargs.data_files.test", ("rows.jsonl", "rowz.jsonl")),
    "misspelt-split": ("test_split", ("test_split: test", "test_split: tset")),
    "undefined-field": ("doc_to_target", ("doc_to_target: a", "doc_to_target: '{{answer}}'")),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_task_yaml_that_does_not_build_is_refused_before_any_rank_naming_it_and_the_field(tmp_path, case):
    """A local task YAML the harness indexes but cannot build (issue 53) is built at validation, in
    ``train.eval_tasks`` and in ``shardyard eval`` alike (before the model loads: PATH is never read), and refused
    naming the key, the task, the YAML and the field; the corrected YAML passes. (Before: validation passed, and
    training crashed at its first evaluation, ``shardyard eval`` after loading the model.)"""
    from shardyard.inference import evaluate

    field, line = DAMAGE[case]
    directory, yaml = _local_task(tmp_path, damage=line)
    err = _refusal("train.eval_tasks=[mine]", f"train.eval_tasks_include_path={directory}")
    assert (err.key, err.value) == ("train.eval_tasks", "mine"), err.paragraph()
    assert yaml in err.problem and f"`{field}`" in err.problem, err.paragraph()
    with pytest.raises(UserError) as e:
        evaluate.main([str(tmp_path / "never-read"), "tasks=[mine]", f"include_path={directory}"])
    assert (e.value.key, e.value.value) == ("tasks", "mine") and yaml in e.value.problem, e.value.paragraph()
    _local_task(tmp_path)
    validate(compose([*TINY, "train.eval_tasks=[mine]", f"train.eval_tasks_include_path={directory}"]), None)


def test_a_task_yaml_that_does_not_parse_is_named_not_called_unknown(tmp_path):
    """lm-eval's index skips a YAML that does not parse without a word, so the task it declares was "unknown":
    the YAML is named, with the parser's line; a member of a group built alone names its own YAML."""
    directory, yaml = _local_task(tmp_path, damage=("doc_to_target: a", "doc_to_target: [a\n"))
    err = _refusal("train.eval_tasks=[mine]", f"train.eval_tasks_include_path={directory}")
    assert (err.key, err.value) == ("train.eval_tasks_include_path", yaml), err.paragraph()
    assert "line" in err.problem and "not registered" in err.problem, err.paragraph()
    _local_task(tmp_path, damage=("output_type: multiple_choice", "output_type: multiple_choise"))
    (tmp_path / "tasks" / "grp.yaml").write_text("group: grp\ntask:\n  - mine\n")
    err = _refusal("train.eval_tasks=[grp]", f"train.eval_tasks_include_path={directory}")
    assert err.value == "grp" and "task mine (of grp)" in err.problem and yaml in err.problem, err.paragraph()


def test_a_run_refused_for_its_task_leaves_nothing_that_refuses_the_corrected_rerun(tmp_path):
    """``train.py`` with a task YAML that does not build (issue 53): refused before the run dir holds anything of
    a run, so the corrected rerun into the same ``hydra.run.dir`` is not refused as another run's results.
    (Before: the run dir was written, training crashed at its first evaluation, and the rerun was refused.)"""
    from shardyard.training import rundir
    from shardyard.launching.run import _run

    directory, _ = _local_task(tmp_path, damage=("rows.jsonl", "rowz.jsonl"))
    run_dir = tmp_path / "run"
    overrides = [*TINY, "train.steps=1", "train.eval_tasks=[mine]", f"train.eval_tasks_include_path={directory}"]
    with pytest.raises(UserError) as e:
        _run(compose(overrides, str(run_dir)))
    assert e.value.key == "train.eval_tasks"
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "plan.json").exists()
    _local_task(tmp_path)
    fixed = compose(overrides, str(run_dir))
    validate(fixed, None)
    assert rundir.find(fixed) is None
    rundir.prepare(fixed)  # what the rerun does first: not refused
