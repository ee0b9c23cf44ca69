"""The recipe book, every file of it, with no test written per recipe: a recipe added to recipes/ is covered.

For each: its header's launch command parses and names it; it composes; its plan fits the hardware its
header names and equals the header's figure; its dry run at that size agrees with the plan; and it trains scaled down (+scale=smoke, through train.py as a
user runs it) with a finite, falling evaluation loss on the same held-out batch before and after.
"""

import json
import math
import re
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


def figures_off(stdout: str) -> set:
    """(rank, figure) of every cell the dry run's table marks ``!``."""
    from shardyard.dryrun import FIGURES

    off = set()
    for line in stdout.splitlines():
        m = re.match(r"\s+(\d+) ", line)
        if m and line.count("(") == len(FIGURES):
            cells = re.findall(r"\)(.)", line + " ")
            off |= {(int(m.group(1)), f) for f, c in zip(FIGURES, cells) if c == "!"}
    return off


@pytest.mark.parametrize("recipe", BOOK, ids=[r.name for r in BOOK])
def test_dry_run_at_the_headers_size_agrees_with_the_plan(recipe, tmp_path):
    """The recipe at its header's hardware and node count (deepseek_v3_pipeline_ep: 256 ranks), simulated here one
    rank role at a time on a fake process group and fake tensors (``plan.dry_run=true``): every figure within 10%
    of the plan and exit 0, and never the real parameters in this
    process (a 7B replica would be 100 GiB)."""
    proc = train_py(*recipe.argv, "plan.dry_run=true", f"plan.hardware={recipe.hardware}",
                    f"plan.nodes={recipe.nodes}", run_dir=tmp_path, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert figures_off(proc.stdout) == set(), proc.stdout[-6000:]
    assert "every figure within 10% of the plan" in proc.stdout
    world = recipe.nodes * int(recipe.hardware.split("x")[0])
    assert f"at world {world} " in proc.stdout
    used = float(re.search(r"([0-9.]+) GiB of this machine's memory at most", proc.stdout).group(1))
    assert used < 3.0, proc.stdout[-2000:]
    assert not list(Path(tmp_path).iterdir()), "a dry run writes nothing"


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
        assert math.isfinite(first) and math.isfinite(last), (path, summary["eval_losses"])
        if "eval/ppl" not in summary["final_eval"]:  # post-training (DPO, GRPO): smoke drops model.weights, so it
            # starts from a random init (no reward to earn, no preference to learn in 3 steps): it runs end to end;
            # the recipes' learning is tests/e2e/test_post_training_e2e.py's
            assert all(math.isfinite(v) for _, v in summary["train_losses"]) and summary["steps"] == 3, summary
        else:
            assert last < first, (path, summary["eval_losses"])
        config = (path.parent / "config.yaml").read_text()
        assert f"name: {recipe.engine}\n" in config  # the recipe's own engine, not a stand-in
