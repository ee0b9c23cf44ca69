"""``train.eval_tasks`` (issue 45) is checked before any worker starts: an unknown task, a missing harness and an
engine that splits the model into stages are refused naming ``train.eval_tasks``; a known task passes."""

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
