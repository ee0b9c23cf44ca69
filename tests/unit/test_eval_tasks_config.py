"""``train.eval_tasks`` (issue 45) is checked before any worker starts: an unknown task, a missing harness, a
generation task and an engine that splits the model into stages are refused naming ``train.eval_tasks``; a known
task passes. And the scores a tag or group reports under its member tasks' names reach the CSV and the console."""

import sys

import pytest

from shardyard.errors import UserError
from shardyard.testing import TINY, compose
from shardyard.validate import validate


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
    assert err.key == "train.eval_tasks" and "shardyard[eval]" in err.paragraph(), err.paragraph()


def test_pipeline_stages_and_a_bad_limit_are_refused():
    err = _refusal("backend=pipeline", "backend.stages=2", "backend.microbatches=2", "launch.nproc_per_node=2",
                   "train.eval_tasks=[stdlib_qa]")
    assert err.key == "train.eval_tasks" and "pipeline" in err.paragraph(), err.paragraph()
    assert _refusal("train.eval_tasks=[stdlib_qa]", "train.eval_tasks_limit=2.5").key == "train.eval_tasks_limit"


def _task_dir(tmp_path, output_type: str | None) -> str:
    """A task directory: ``gen_rows`` (with ``output_type`` when given: the harness's default is generate_until),
    tagged ``gen_tag``, and ``gen_group``, a group holding it."""
    kind = f"output_type: {output_type}\n" if output_type else ""
    (tmp_path / "gen.yaml").write_text(
        f"task: gen_rows\ntag: gen_tag\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: none.jsonl\n"
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
