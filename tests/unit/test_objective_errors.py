"""Post-training's bad values exit 2 naming the key (issue 44, item 6): a preference row without `chosen` or
`rejected` and a GRPO prompt without the field a reward reads name the data file:line, as ``python train.py``
prints them (exit 2, one paragraph on stderr, no traceback); the objectives' own values (beta, epsilon, G,
temperature), an unknown reward or objective ``_target_``, a key a user's objective does not take, an engine
or a data option or a model key the objective cannot use are refused by validation, before any worker starts,
each naming its key."""

import json
import textwrap

import pytest
import torch

from conftest import TINY, train_py
from shardyard.core.errors import UserError
from shardyard.testing import compose
from shardyard.planning.validate import validate

DPO = ["objective=dpo", "data=preference"]
GRPO = ["objective=grpo", "data=prompts"]
PIPELINE = ["backend=pipeline", "launch.nproc_per_node=2", "train.micro_batch_size=2"]


class UserObjective:
    """A user's own objective, plugged in by ``_target_`` (``objective/mine.yaml`` below): what matters here is
    only the keys its constructor takes."""

    data_kind = "text"

    def __init__(self, name: str = "mine", temperature: float = 1.0):
        self.name, self.temperature = name, temperature


def refused(overrides: list[str]) -> UserError:
    cfg = compose(overrides)
    with pytest.raises(UserError) as e:
        validate(cfg, None)
    text = e.value.paragraph()
    assert "Fix:" in text and "\n\n" not in text, text
    return e.value


@pytest.mark.parametrize("overrides,key,value,says", [
    ([*DPO, "objective.beta=-1"], "objective.beta", -1.0, "above 0"),
    ([*GRPO, "objective.beta=-1"], "objective.beta", -1.0, "cannot be negative"),
    ([*GRPO, "objective.epsilon=0"], "objective.epsilon", 0.0, "above 0"),
    ([*GRPO, "objective.num_generations=1"], "objective.num_generations", 1, "fewer than 2"),
    ([*GRPO, "objective.temperature=0"], "objective.temperature", 0.0, "identical"),
    ([*GRPO, "objective.rewards=[{_target_: shardyard.objectives.rewards.NoSuchReward}]"],
     "objective.rewards[0]._target_", "shardyard.objectives.rewards.NoSuchReward", "cannot be imported"),
    ([*DPO, *PIPELINE], "backend", "pipeline", "pipeline stages"),
    ([*GRPO, *PIPELINE], "backend", "pipeline", "pipeline stages"),
    (["objective=dpo", "data=prompts"], "data", "shardyard.data.prompts.PromptData", "objective=dpo trains on data=preference"),
    (["objective=grpo", "data=preference"], "data", "shardyard.data.preference.PreferenceData",
     "objective=grpo trains on data=prompts"),
    (["objective=lm", "data=preference"], "data", "shardyard.data.preference.PreferenceData", "objective=lm trains on a text"),
    ([*DPO, "model.loss_chunk=1024"], "model.loss_chunk", 1024, "log-probability"),
    ([*DPO, "objective._target_=no_such_package.MyObjective"], "objective._target_", "no_such_package.MyObjective",
     "cannot be imported"),
    ([*DPO, "+objective.gamma=1"], "objective.gamma", 1, "No schema or plug-in reads this key"),
    ([*GRPO, "objective.eval_max_new_tokens=0"], "objective.eval_max_new_tokens", 0, "at least one token"),
    ([*DPO, "peft=lora", "objective.reference_weights=/somewhere"], "objective.reference_weights", "/somewhere",
     "adapters disabled"),
    ([*GRPO, "objective.reference_weights=/somewhere"], "objective.reference_weights", "/somewhere",
     "no reference model"),
    ([*DPO, "objective.reference_weights="], "objective.reference_weights", "", "empty"),  # issue 53: was ignored
    ([*DPO, "model.weights="], "model.weights", "", "empty"),  # issue 53: was a fresh init, silently
])
def test_bad_objective_values_name_their_key(overrides, key, value, says):
    e = refused(overrides)
    assert (e.key, e.value) == (key, value), e.paragraph()
    assert says in " ".join(e.paragraph().split()), e.paragraph()


def test_a_key_a_user_objective_does_not_take_is_named(tmp_path):
    """A user's objective option (their own YAML on the search path, open to its ``_target_``'s arguments): a
    misspelt key is named as ``objective.<key>`` with the keys the class takes; the spelt one validates."""
    (tmp_path / "objective").mkdir()
    (tmp_path / "objective" / "mine.yaml").write_text(textwrap.dedent(f"""\
        defaults:
          - /schema_objective_plugin@_here_
          - _self_
        _target_: {__name__}.UserObjective
        name: mine
        """))
    mine = [f"hydra.searchpath=[file://{tmp_path}]", "objective=mine"]
    validate(compose([*mine, "+objective.temperature=0.5"]), None)  # the key it takes: accepted
    e = refused([*mine, "+objective.temperatur=0.5"])
    assert (e.key, e.value) == ("objective.temperatur", 0.5), e.paragraph()
    assert "name, temperature" in e.paragraph(), e.paragraph()


# --------------------------------------------------------------------------------- as a user runs train.py
TINY_RUN = [*TINY, "backend=single", "train.steps=1", "train.eval_every_n_steps=0"]


def exits_2_naming(proc, key: str, value: str) -> str:
    """``train.py`` left with exit 2 and printed one paragraph on stderr, no traceback, naming ``key`` and ``value``."""
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in err and "\n\n" not in err, err
    flat = " ".join(err.split())
    assert flat.startswith(f"shardyard: error in `{key}` (value: {value!r}).") and "Fix:" in flat, err
    return flat


@pytest.mark.parametrize("field", ["chosen", "rejected"])
def test_a_preference_row_without_a_side_names_its_file_and_line(tmp_path, field):
    good = {"prompt": "What is 2 + 3?", "chosen": "5. Answer: 5", "rejected": "6. Answer: 6"}
    bad = {k: v for k, v in good.items() if k != field}
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good, good, bad, good]))
    proc = train_py(*TINY_RUN, *DPO, f"data.paths=[{path}]", run_dir=tmp_path / "run")
    flat = exits_2_naming(proc, "data.paths", f"{path}:3")
    assert f"The record has no `{field}`" in flat, flat


def test_a_grpo_prompt_without_the_field_a_reward_reads_names_its_file_and_line(tmp_path):
    """Checked when the run starts (``GRPO.setup``, in the worker), over the train and held-out rows: the
    shipped ``NumericAnswer`` reads each row's `answer`."""
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)]
    rows[6] = {"prompt": "What is 6 + 1?", "solution": "7"}
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = train_py(*TINY_RUN, *GRPO, f"data.paths=[{path}]", "train.micro_batch_size=2",
                    "train.global_batch_size=2", "objective.num_generations=2", "objective.max_new_tokens=4",
                    run_dir=tmp_path / "run")
    flat = exits_2_naming(proc, "data.paths", f"{path}:7")
    assert "no field 'answer', which the reward numeric_answer needs" in flat, flat


def test_an_objective_target_that_does_not_import_exits_2(tmp_path):
    proc = train_py(*TINY_RUN, *DPO, "objective._target_=no_such_package.MyObjective", run_dir=tmp_path / "run")
    flat = exits_2_naming(proc, "objective._target_", "no_such_package.MyObjective")
    assert "No module named 'no_such_package'" in flat, flat


def test_a_reference_checkpoint_of_another_shape_is_refused_naming_the_tensor(tmp_path):
    """``objective.reference_weights``: a checkpoint whose tensors are not the policy's (here a model with a wider
    hidden size) exits 2 naming the key and the first tensor that differs; the policy's own shape passes."""
    from safetensors.torch import save_file

    from shardyard.models.build import shape_model
    from shardyard.models.shape import signature

    for name, hidden in (("same", 64), ("wider", 96)):
        cfg = compose([*TINY, *DPO, f"model.hidden_size={hidden}"])
        (tmp_path / name).mkdir()
        save_file({k: torch.zeros(shape) for k, shape in signature(shape_model(cfg.model)).items()},
                  str(tmp_path / name / "model.safetensors"))
    validate(compose([*TINY, *DPO, f"objective.reference_weights={tmp_path}/same"]), None)
    e = refused([*TINY, *DPO, f"objective.reference_weights={tmp_path}/wider"])
    assert e.key == "objective.reference_weights" and "model.embed_tokens.weight" in e.paragraph(), e.paragraph()


@pytest.mark.parametrize("damage,fault", [
    ("cut-short", "model.safetensors"),
    ("not-safetensors", "model.safetensors"),
    ("shard-missing", "model-00002-of-00002.safetensors"),
    ("bin-only", None),
])
def test_a_damaged_reference_checkpoint_is_refused_naming_the_key_and_the_file(tmp_path, damage, fault):
    """``objective.reference_weights`` gets the checks ``model.weights`` gets (issue 53): a cut-short or foreign
    safetensors file, a shard its index lists that is not there, or .bin pickles alone exit 2 naming the key and
    the file, at validation. (Before: safetensors' own exception, a traceback; .bin alone named model.weights.)"""
    import os

    from safetensors.torch import save_file

    from shardyard.models.build import shape_model
    from shardyard.models.shape import signature

    ref = tmp_path / "ref"
    ref.mkdir()
    tensors = {k: torch.zeros(shape) for k, shape in signature(shape_model(compose([*TINY, *DPO]).model)).items()}
    if damage == "shard-missing":
        (ref / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
            k: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, k in enumerate(tensors)}}))
        save_file({k: v for i, (k, v) in enumerate(tensors.items()) if i % 2 == 0},
                  str(ref / "model-00001-of-00002.safetensors"))
    elif damage == "bin-only":
        torch.save(tensors, ref / "pytorch_model.bin")
    else:
        save_file(tensors, str(ref / "model.safetensors"))
        f = ref / "model.safetensors"
        if damage == "cut-short":
            os.truncate(f, os.path.getsize(f) // 2)
        else:
            f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"{not a header}  " + b"\x00" * 64)
    e = refused([*TINY, *DPO, f"objective.reference_weights={ref}"])
    assert e.key == "objective.reference_weights", e.paragraph()
    assert e.value == (str(ref / fault) if fault else str(ref)), e.paragraph()
    if fault is None:
        assert ".bin" in e.problem and "safetensors" in e.fix, e.paragraph()
