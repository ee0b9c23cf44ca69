"""Issue 59: a choice whose optional package the venv lacks is refused before any process starts (exit 2), naming
the one command that installs it (``shardyard.config.preflight``); ``make train`` sets up only the core and DeepSpeed.

These run in the full venv, where every package is installed: ``hide`` makes exactly one module (and its
submodules) absent for the test, to ``importlib.util.find_spec`` and to ``import`` alike."""

import importlib.abc
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from shardyard.core import errors
from shardyard.testing import CONF_DIR, compose

ROOT = Path(__file__).resolve().parents[2]


def hide(monkeypatch, module: str) -> None:
    """``module`` and its submodules are not installed, as far as this process can tell."""
    def hidden(name: str) -> bool:
        return name == module or name.startswith(module + ".")

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if hidden(name) else real(name, *a, **k))

    class Hider(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if hidden(name):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    monkeypatch.setattr(sys, "meta_path", [Hider(), *sys.meta_path])
    for name in [n for n in sys.modules if hidden(n)]:
        monkeypatch.delitem(sys.modules, name)


def refused(capsys, call) -> str:
    """``call`` exits 2 with shardyard's one-paragraph error (no traceback); returns that paragraph."""
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("shardyard: error in `") and "Traceback" not in err, err
    return " ".join(err.split())  # the paragraph is wrapped at 100 columns


@pytest.mark.parametrize("overrides, module, extra", [
    (["backend=horovod", "launch.nproc_per_node=2"], "horovod", "horovod"),
    (["backend=zero3", "launch.nproc_per_node=2"], "deepspeed", "deepspeed"),
    (["monitor=[console,wandb]"], "wandb", "monitors"),
    (["monitor=[console,mlflow]"], "mlflow", "monitors"),
    (["train.eval_tasks=[stdlib_qa]"], "lm_eval", "eval"),
    (["peft=lora"], "peft", "finetune"),
    (["peft=qlora", "backend=single"], "bitsandbytes", "finetune"),
    (["precision=fp8"], "torchao", "fp8"),
])
def test_a_run_choosing_a_missing_extra_exits_2_naming_its_install(overrides, module, extra, monkeypatch, capsys,
                                                                     tmp_path):
    from shardyard.launching import run

    hide(monkeypatch, module)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(errors, "JOB_STARTED", False)
    cfg = compose(overrides, run_dir=str(tmp_path / "run"))
    text = refused(capsys, lambda: run.run(cfg))
    assert f"`make setup EXTRAS={extra}`" in text and f"`{module}`" in text, text
    assert not (tmp_path / "run").exists()  # refused before anything was written or started


def test_the_sweeper_refuses_before_its_launcher_or_any_job(monkeypatch, capsys):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from hydra_plugins.shardyard_sweepers import OptunaSweeper

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = hydra_compose("train", overrides=["hydra/sweeper=optuna", "run_dir=unused"], return_hydra_config=True)
    hide(monkeypatch, "optuna")
    monkeypatch.chdir(ROOT)
    sweeper = OptunaSweeper(params={}, n_trials=2, n_jobs=1, sampler="tpe", seed=0, pruner="median",
                            pruner_startup_trials=1, pruner_warmup_steps=0, study_name=None)
    text = refused(capsys, lambda: sweeper.setup(hydra_context=None, task_function=None, config=cfg))
    assert "error in `hydra/sweeper` (value: 'optuna')" in text and "`make setup EXTRAS=sweep`" in text, text
    assert not hasattr(sweeper, "launcher")


@pytest.mark.parametrize("option, module, extra", [("submitit_slurm", "hydra_plugins.hydra_submitit_launcher", "slurm"),
                                                   ("joblib", "hydra_plugins.hydra_joblib_launcher", "sweep")])
def test_a_launcher_whose_plugin_is_missing_is_named_before_hydra_composes(option, module, extra, monkeypatch,
                                                                           capsys):
    from shardyard.launching.app import hydra_entry

    hide(monkeypatch, module)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", f"hydra/launcher={option}", "optim.lr=1e-3,3e-3"])

    def hydra_main():
        raise AssertionError("Hydra ran")

    text = refused(capsys, lambda: hydra_entry(hydra_main))
    assert f"`make setup EXTRAS={extra}`" in text, text


def test_every_missing_extra_in_one_command_and_the_command_outside_a_checkout(monkeypatch, tmp_path):
    from shardyard.config import preflight
    from shardyard.core.errors import UserError

    for module in ("wandb", "lm_eval"):
        hide(monkeypatch, module)
    cfg = compose(["monitor=[console,wandb]", "train.eval_tasks=[stdlib_qa]"])
    monkeypatch.chdir(tmp_path)  # elsewhere: make -C names the checkout
    with pytest.raises(UserError) as e:
        preflight.check(cfg)
    assert (e.value.key, e.value.value) == ("monitor", "wandb")
    assert f"`make -C {ROOT} setup EXTRAS=monitors,eval`" in e.value.fix, e.value.fix
    monkeypatch.setattr(preflight, "checkout", lambda: None)  # an installed wheel
    with pytest.raises(UserError) as e:
        preflight.check(cfg)
    assert "`pip install 'shardyard[monitors,eval]'`" in e.value.fix, e.value.fix


def test_the_default_recipe_and_zero3_need_nothing_beyond_make_train():
    from shardyard.config import preflight

    def extras(overrides):
        return [preflight.EXTRA.get(m, "core") for _, _, m in preflight.needs(compose(overrides))]

    assert extras([]) == ["core"]  # the tensorboard monitor
    assert extras(["backend=zero3"]) == ["deepspeed", "core"]


def test_the_table_names_real_extras_that_hold_each_module():
    """Every module of ``preflight.EXTRA`` is installed by the extra it names: a file of that module belongs to
    a distribution that pyproject.toml lists in that extra (horovod: setup.sh's own build step)."""
    from shardyard.config import preflight

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    script_extras = re.search(r'^ALL="([^"]+)"', setup, re.M).group(1).split()
    assert set(script_extras) == (set(extras) - {"bench"}) | {"horovod", "ops"}
    for module, extra in preflight.EXTRA.items():
        if extra == "horovod":
            continue
        names = [re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0] for r in extras[extra]]
        path = module.replace(".", "/") + "/"
        owners = [n for n in names if any(str(f).startswith(path) for f in importlib.metadata.files(n) or ())]
        assert owners, (module, extra, names)


# ---------------------------------------------------------------------------------------------- scripts/setup.sh
STUB = """#!/usr/bin/env bash
echo "{name} $*" >> {calls}
case "$1" in -c) echo "stub ${{STUB_TORCH:-}}" ;; esac
"""


def test_setup_installs_what_is_asked_once_and_a_venv_only_grows(tmp_path):
    """The stamp knows which extras a venv holds: `make train` installs the core + deepspeed; `make test`
    (EXTRAS=all) after it adds the rest; `make train` after that does nothing; another torch redoes it all. Stubs stand in for the venv's
    python and for uv, and record what setup.sh asks of them."""
    venv, tools, calls = tmp_path / "venv", tmp_path / "tools", tmp_path / "calls"
    for path, name in ((venv / "bin" / "python", "python"), (tools / "uv", "uv")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(STUB.format(name=name, calls=calls))
        path.chmod(0o755)

    def setup(**env: str) -> list[str]:
        calls.write_text("")
        out = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "VENV": str(venv), "PATH": f"{tools}:{os.environ['PATH']}",
                                              "SHARDYARD_SKIP_HOROVOD": "1", **env})
        assert out.returncode == 0, out.stdout + out.stderr
        return [c.replace(str(venv), "VENV") for c in calls.read_text().splitlines()
                if " install " in c or "op_builds" in c]

    core = "uv pip install -q --python VENV/bin/python -e "
    assert setup() == [core + ".[deepspeed]"]  # make train
    assert setup() == []  # again: up to date
    assert setup(EXTRAS="monitors") == [core + ".[deepspeed,monitors]"]  # what a run named
    assert setup(EXTRAS="all") == [core + ".[deepspeed,dev,eval,finetune,fp8,monitors,slurm,sweep]",  # make test
                                   "python -m shardyard.core.op_builds"]
    assert setup() == [] and setup(EXTRAS="all") == []  # make train, make test after it: nothing
    assert setup(EXTRAS="all", SHARDYARD_INSTALLER="pip") == []  # the installer does not change what is held
    # another torch in the venv (what its python reports of torch's distribution): Horovod and the ops were built
    # against the old one, so everything held is redone
    redone = [core + ".[deepspeed,dev,eval,finetune,fp8,monitors,slurm,sweep]", "python -m shardyard.core.op_builds"]
    assert setup(STUB_TORCH="2.14.0") == redone and setup(STUB_TORCH="2.14.0") == []
