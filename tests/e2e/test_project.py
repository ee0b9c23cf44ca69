"""Copying recipes out: a built wheel installed into a fresh venv, `shardyard new` outside the checkout, and the
project trained there on ddp and zero2, with the user's own model YAML and `_target_` data source, and with
shardyard's other engines by name. A project locked to another version is told what changed."""

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, TINY
from shardyard import __version__

QUICK = [*TINY, "train.steps=2", "train.eval_every_n_steps=0"]
MY_MODEL = """\
# python train.py model=mymodel      (shardyard's deepseek_tiny, wider: a user's option inheriting one of shardyard's)
defaults:
  - deepseek_tiny
  - _self_
name: mymodel
hidden_size: 96
num_heads: 4
"""
MY_DATA = """\
defaults:
  - /schema_data_plugin@_here_
  - _self_
_target_: mydata.arithmetic
documents: 300
tokenizer:
  vocab_size: 512
"""
MY_DATA_PY = '''
def arithmetic(documents: int):
    """The user's own document source: any iterable of texts."""
    return [f"def f{i}(x):\\n    return x * {i % 7} + {i % 11}\\n" * 4 for i in range(documents)]
'''
MY_ZERO3 = "defaults:\n  - zero3\n  - _self_\nname: my_zero3\nstage3_prefetch_bucket_size: 1e6\n"


def run(cmd, cwd, env=None, timeout=600):
    full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full.pop("PYTHONPATH", None)  # the installed wheel, not the checkout's src/
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv holding the wheel built from this checkout; torch and the other dependencies come from the
    test environment (a .pth line, as --system-site-packages would give an installed torch)."""
    tmp = tmp_path_factory.mktemp("wheel")
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"),
                 str(ROOT)], cwd=tmp)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp / "dist").glob("shardyard-*.whl"))
    env_dir = tmp / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=tmp)
    assert made.returncode == 0, made.stderr
    py = env_dir / "bin" / "python"
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).stdout.strip())
    (site / "test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    inst = run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)],
               cwd=tmp)
    assert inst.returncode == 0, inst.stderr[-3000:]
    where = run([str(py), "-c", "import shardyard; print(shardyard.__file__)"], cwd=tmp).stdout.strip()
    assert where.startswith(str(site)), where  # the wheel's copy, not the checkout
    assert (site / "shardyard" / "conf" / "recipe" / "deepseek_tiny_zero2.yaml").is_file()
    return env_dir


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_new_project_from_the_wheel_trains_everywhere(venv, tmp_path):
    py, shardyard = venv / "bin" / "python", venv / "bin" / "shardyard"
    listing = run([str(shardyard), "recipes"], cwd=tmp_path)
    assert listing.returncode == 0 and "deepseek7b_zero3" in listing.stdout, listing.stderr
    made = run([str(shardyard), "new", "proj", "--recipe", "deepseek_tiny_ddp2", "--recipe", "deepseek_tiny_zero2"],
               cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    proj = tmp_path / "proj"
    assert f'"shardyard=={__version__}"' in (proj / "pyproject.toml").read_text()
    assert yaml.safe_load((proj / "shardyard.lock.yaml").read_text())["shardyard_version"] == __version__
    assert len((proj / "train.py").read_text().splitlines()) < 15
    again = run([str(shardyard), "new", "proj"], cwd=tmp_path)  # never over what exists
    assert again.returncode == 2 and "not empty" in again.stderr and "Traceback" not in again.stderr

    def train(*overrides, name):
        proc = run([str(py), "train.py", *QUICK, f"hydra.run.dir={tmp_path / name}", *overrides], cwd=proj)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc, yaml.safe_load((tmp_path / name / "config.yaml").read_text())

    proc, cfg = train(name="ddp")  # the copied recipe, as `python train.py` runs it
    assert cfg["backend"]["name"] == "ddp" and "world size 2" in proc.stdout
    _, cfg = train("recipe=deepseek_tiny_zero2", name="zero2")
    assert cfg["backend"]["name"] == "zero2" and cfg["train"]["global_batch_size"] == 16

    (proj / "conf" / "model" / "mymodel.yaml").write_text(MY_MODEL)
    (proj / "conf" / "data" / "mydata.yaml").write_text(MY_DATA)
    (proj / "mydata.py").write_text(textwrap.dedent(MY_DATA_PY))
    # the user's own model and data, on shardyard's own backend=fsdp (an option nothing copied): one run for both
    proc, cfg = train("model=mymodel", "data=mydata", f"data.cache_dir={tmp_path / 'cache'}", "model.hidden_size=96",
                      "backend=fsdp", name="mine")
    assert cfg["model"]["name"] == "mymodel" and cfg["data"]["_target_"] == "mydata.arithmetic"
    assert cfg["backend"]["name"] == "fsdp" and "world size 2" in proc.stdout
    losses = [v for _, v in summary(tmp_path / "mine")["train_losses"]]
    assert len(losses) == 2 and all(map(lambda v: v == v, losses))
    assert sorted(p.name for p in (proj / "conf" / "backend").iterdir()) == [".keep"]

    elsewhere = run([str(py), "-m", "shardyard", "train", "recipe=deepseek_tiny_ddp2", *QUICK,
                     f"hydra.run.dir={tmp_path / 'anywhere'}"], cwd=tmp_path)
    assert elsewhere.returncode == 0, elsewhere.stderr[-3000:]
    assert summary(tmp_path / "anywhere")["train_losses"]


def test_a_project_locked_to_another_version_is_told_what_changed(tmp_path):
    """Made by this checkout's shardyard, then edited as if an older version had made it: the recipe sets a key
    that 0.1.0 renamed, and the lock remembers another default."""
    cli = [sys.executable, "-m", "shardyard"]
    made = subprocess.run([*cli, "new", str(tmp_path / "p")], capture_output=True, text=True, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    proj = tmp_path / "p"
    (proj / "conf" / "backend" / "my_zero3.yaml").write_text(MY_ZERO3)
    lock_path = proj / "shardyard.lock.yaml"
    lock = yaml.safe_load(lock_path.read_text())
    assert lock["recipes"]["deepseek_tiny_ddp2"]["sched.min_lr_ratio"] == 0.1
    lock["shardyard_version"] = "0.0.9"
    lock["recipes"]["deepseek_tiny_ddp2"]["sched.min_lr_ratio"] = 0.05
    lock_path.write_text(yaml.safe_dump(lock))
    recipe = proj / "conf" / "recipe" / "deepseek_tiny_ddp2.yaml"
    original = recipe.read_text()
    recipe.write_text(original + "optim:\n  name: adamw\n")

    def train(*overrides):
        return subprocess.run([sys.executable, "train.py", *QUICK, "backend=single", f"hydra.run.dir={tmp_path / 'run'}",
                               *overrides], capture_output=True, text=True, cwd=proj)

    refused = train()
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    said = " ".join(refused.stderr.split())  # the paragraph is wrapped
    assert "optim.name (now optim._target_" in said and "shardyard 0.0.9" in said
    assert not (tmp_path / "run").exists()

    recipe.write_text(original)
    told = train("backend=my_zero3", "--cfg", "job")  # the user's backend option extends shardyard's zero3
    assert told.returncode == 0, told.stderr[-3000:]
    assert "sched.min_lr_ratio default changed: 0.05 -> 0.1" in told.stdout
    assert "name: my_zero3" in told.stdout and "stage: 3" in told.stdout
    relocked = subprocess.run([*cli, "lock", str(proj)], capture_output=True, text=True)
    assert relocked.returncode == 0, relocked.stderr
    assert "default changed" not in train("--cfg", "job").stdout
