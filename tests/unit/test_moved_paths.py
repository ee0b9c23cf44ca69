"""Issue 55 moved src/shardyard's modules into packages by concern; an old module path (a copied recipe's
``_target_``, an old run dir's config.yaml, ``import shardyard.model``, a pickle) still resolves to the same
object, through one table (``shardyard.core.moved.MOVED``), with one deprecation line naming old and new path."""

from __future__ import annotations

import importlib
import importlib.util
import io
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardyard.core.moved import MOVED, NAMES_MOVED, NOW_PACKAGES

ROOT = Path(__file__).resolve().parents[2]

OLD_RECIPE = """\
# @package _global_
# a recipe copied before issue 55: every _target_ names a module's old path
defaults:
  - override /model: deepseek_tiny
  - override /data: sft
model:
  _target_: shardyard.model.llama
data:
  _target_: shardyard.sft.SFTData
sched:
  _target_: shardyard.optim.WarmupCosine
"""

RESOLVE = """\
import sys
from hydra.utils import get_object
from shardyard import config
from shardyard.planning.keys import check_keys

cfg = config.compose(["recipe=old_paths"], conf_dir=sys.argv[1])
check_keys(cfg)  # every _target_ imports, every key is a schema field or a parameter of its _target_
from shardyard.backends.optim import WarmupCosine
from shardyard.data.pipeline import mixture
from shardyard.data.sft import SFTData
from shardyard.models.build import llama
assert get_object(cfg.model._target_) is llama
assert get_object(cfg.data._target_) is SFTData
assert get_object(cfg.sched._target_) is WarmupCosine
assert get_object("shardyard.data.mixture") is mixture  # old data.py's name, now a package's
import shardyard.model, shardyard.models.build
assert shardyard.model is shardyard.models.build
assert shardyard.models.build.__spec__.name == "shardyard.models.build"
from shardyard.models import loss, prepare
from shardyard.models.build import causal_lm_loss_sum  # a name models/build.py held before its split
assert causal_lm_loss_sum is loss.causal_lm_loss_sum and shardyard.model.SpeedProbe is prepare.SpeedProbe
from shardyard.training import integrity
from shardyard.training.checkpoint import verify  # a name training/checkpoint.py held before integrity.py
assert verify is integrity.verify
print("resolved")
"""


def test_a_recipe_with_old_target_paths_composes_and_resolves_with_one_deprecation_line_each(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf, ignore=shutil.ignore_patterns("__pycache__"))
    (conf / "recipe" / "old_paths.yaml").write_text(OLD_RECIPE)
    out = subprocess.run([sys.executable, "-c", RESOLVE, str(conf)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resolved" in out.stdout
    lines = [line for line in out.stderr.splitlines() if "is deprecated" in line]
    for old, new in [("shardyard.model", "shardyard.models.build"), ("shardyard.sft", "shardyard.data.sft"),
                     ("shardyard.optim", "shardyard.backends.optim"),
                     ("shardyard.data.mixture", "shardyard.data.pipeline.mixture"),
                     ("shardyard.models.build.causal_lm_loss_sum", "shardyard.models.loss.causal_lm_loss_sum"),
                     ("shardyard.models.build.SpeedProbe", "shardyard.models.prepare.SpeedProbe"),
                     ("shardyard.training.checkpoint.verify", "shardyard.training.integrity.verify")]:
        said = [line for line in lines if f"`{old}` is deprecated, it moved to `{new}`" in line]
        assert len(said) == 1, out.stderr  # once per old path and process, however often it resolves


def test_an_old_module_path_in_a_pickle_still_loads_through_safe_load():
    from shardyard.core.facts import ParallelDims
    from shardyard.core.safe_load import FastExactUnpickler, Refused, _pairs, exact_loads

    dims = ParallelDims(world_size=2, dp_replicate=2)
    new = pickle.dumps(dims, protocol=2)  # GLOBAL names the module as a text line
    assert b"shardyard.core.facts\n" in new
    old = new.replace(b"shardyard.core.facts\n", b"shardyard.facts\n")
    allowed = _pairs(ParallelDims)  # the exact set names the new module only
    assert exact_loads(old, allowed) == dims
    fast = FastExactUnpickler(io.BytesIO(old), allowed).load()  # the C unpickler's stand-in of the same class
    assert (fast.world_size, fast.dp_replicate) == (2, 2)
    with pytest.raises(Refused):  # an old path outside the set is refused all the same
        exact_loads(old.replace(b"ParallelDims\n", b"Plan\n"), allowed)


def test_every_old_path_names_a_module_that_exists_and_no_old_module_is_left():
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        assert old in NOW_PACKAGES or not (ROOT / "src" / (old.replace(".", "/") + ".py")).exists(), old
    for old, new in NAMES_MOVED.items():  # names that left a module that stayed: gone from it, in their new one
        module, name = old.rsplit(".", 1)
        assert name not in vars(importlib.import_module(module)), old
        assert name in vars(importlib.import_module(new)), (old, new)
