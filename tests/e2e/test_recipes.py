"""The recipe book, every file of it, with no test written per recipe: a recipe added to recipes/ is covered.

For each: its header's launch command parses and names it; it composes; its plan fits the hardware its
header names and equals the header's figure; and it trains scaled down (+scale=smoke, through train.py as a
user runs it) with a finite, falling evaluation loss on the same held-out batch before and after.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, train_py
from shardyard import recipes

BOOK = recipes.catalogue(ROOT / "recipes")


def test_the_book_has_every_family():
    """GPU recipes for the seed setups, CPU recipes for every engine family (so CI runs each), and a sweep."""
    names = {r.name for r in BOOK}
    assert {"deepseek7b_zero3", "deepseek7b_zero3_offload", "deepseek7b_zero2", "deepseek7b_fsdp",
            "deepseek7b_horovod", "deepseek_moe_16b_fsdp", "sweep_lr_warmup"} <= names
    cpu_engines = {r.engine for r in BOOK if "cpu" in r.hardware}
    assert {"ddp", "fsdp", "zero2", "zero3", "horovod"} <= cpu_engines
    assert any(r.multirun for r in BOOK)
    assert (ROOT / "conf" / "recipe").resolve() == (ROOT / "recipes").resolve()


@pytest.mark.parametrize("recipe", BOOK, ids=[r.name for r in BOOK])
def test_header_command_and_plan_on_its_hardware(recipe):
    assert f"recipe={recipe.name}" in recipe.argv  # read() refuses a header whose command does not name it
    cfg = recipes.compose(recipe)
    assert cfg.backend.name == recipe.engine and cfg.model.name == recipe.model
    text, fits = recipes.planned(recipe)
    assert fits, f"{recipe.name} does not fit the {recipe.hardware} its header names: {text}"
    assert text == recipe.plan, (f"{recipe.name}: the header says `# plan: {recipe.plan}`, the plan now gives {text!r}; "
                                 "run `python -m shardyard.recipes --write-plans`")


@pytest.mark.parametrize("recipe", BOOK, ids=[r.name for r in BOOK])
def test_recipe_trains_scaled_down(recipe, tmp_path):
    args = [*recipe.argv, "+scale=smoke", "monitor.console.style=plain"]
    if recipe.multirun:  # the sweep, every job of it scaled down
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", *args, f"hydra.sweep.dir={tmp_path}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=900)
    else:
        proc = train_py(*args, run_dir=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "+scale=smoke: the recipe" in proc.stdout
    summaries = sorted(Path(tmp_path).rglob("summary.json"))
    assert summaries and (len(summaries) > 1) == recipe.multirun
    for path in summaries:
        summary = json.loads(path.read_text())
        (first_step, first), (last_step, last) = summary["eval_losses"][0], summary["eval_losses"][-1]
        assert (first_step, last_step) == (0, 3)
        assert math.isfinite(first) and math.isfinite(last) and last < first, (path, summary["eval_losses"])
        config = (path.parent / "config.yaml").read_text()
        assert f"name: {recipe.engine}\n" in config  # the recipe's own engine, not a stand-in
