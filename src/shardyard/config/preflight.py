"""The optional packages a run's choices need, checked before any process starts (one table, one check).

``make train`` sets up the core and DeepSpeed's Python package only; everything else is an *extra* that the user
installs when a config first chooses it (docs/development.md, "Setup"). What a choice needs is said by the class
that its ``_target_`` names (the owner of the choice, never a name compared here): a ``requires`` attribute, a
module name or a tuple of them, as on ``HorovodBackend``, ``DeepSpeedBackend``, the monitors, ``LoRA``/``QLoRA``
and the Optuna sweeper; ``precision=fp8`` (the ``Precision`` enum) and ``train.eval_tasks`` (any task) are read
here. :data:`EXTRA` maps each such module to the extra that installs it. A missing one is a ``UserError`` (exit 2)
naming the one command that installs it: ``make setup EXTRAS=<extra>`` in a checkout, ``pip install
'shardyard[<extra>]'`` for an installed wheel.

Three calls, one per place a choice becomes known: ``validate.validate`` (the job's choices: :func:`check`), the
sweepers before their launcher is built (``hydra/sweeper``: :func:`check_hydra`), and ``app.hydra_entry`` before
Hydra composes (``hydra/launcher`` options whose plugin is absent, which Hydra could not compose at all:
:func:`check_command_line`). Absence is asked with ``importlib.util.find_spec``, which imports nothing.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Iterator

from omegaconf import DictConfig

from shardyard.core.errors import UserError

EXTRA: dict[str, str] = {
    "deepspeed": "deepspeed",
    "accelerate": "deepspeed",
    "horovod": "horovod",  # not a pip extra: scripts/build_horovod.sh builds it from its sdist
    "wandb": "monitors",
    "mlflow": "monitors",
    "lm_eval": "eval",
    "optuna": "sweep",
    "hydra_plugins.hydra_joblib_launcher": "sweep",
    "submitit": "slurm",
    "hydra_plugins.hydra_submitit_launcher": "slurm",
    "peft": "finetune",
    "bitsandbytes": "finetune",
    "torchao": "fp8",
}
"""Module -> the extra that installs it (pyproject.toml's ``[project.optional-dependencies]``, checked by
tests/unit/test_preflight.py). A module missing from here is part of the core (``make setup`` installs it)."""

LAUNCHER_PLUGINS: dict[str, str] = {
    "submitit_slurm": "hydra_plugins.hydra_submitit_launcher",
    "submitit_local": "hydra_plugins.hydra_submitit_launcher",
    "joblib": "hydra_plugins.hydra_joblib_launcher",
}
"""``hydra/launcher`` options that a plugin package brings: without it Hydra cannot compose them, so no class of
theirs is there to ask; the command line names them."""

INSTEAD: dict[str, str] = {
    "backend": "or pick an engine of the core setup (backend=ddp, fsdp, zero1/2/3, ...)",
    "monitor": "or drop it from the list, e.g. 'monitor=[console,tensorboard]'",
    "train.eval_tasks": "or leave train.eval_tasks unset",
    "peft": "or use peft=none",
    "precision": "or use precision=bf16",
    "hydra/sweeper": "or leave hydra/sweeper at its default (shardyard's grid)",
    "hydra/launcher": "or use hydra/launcher=parallel (several local jobs at once, no plugin)",
}
"""What to do instead of installing, per key that chose the package."""

TAKES = {"horovod": " (it builds Horovod 0.28.1 from source: about 3 minutes on 2 cores, once per machine)"}


def requires(target: str) -> tuple[str, ...]:
    """The modules the class ``target`` (a ``_target_``) says it needs: its ``requires``, a name or a tuple."""
    from hydra.utils import get_object

    need = getattr(get_object(target), "requires", ())
    return (need,) if isinstance(need, str) else tuple(need)


def needs(cfg: DictConfig) -> Iterator[tuple[str, Any, str]]:
    """(the key that chose it, its value, a module) for each optional module the job's config chooses."""
    from shardyard.config.schema import Precision

    for key, node in (("backend", cfg.backend), ("peft", cfg.get("peft"))):
        if node is not None and node.get("_target_"):
            for module in requires(node._target_):
                yield key, node.get("name"), module
    for name, node in (cfg.get("monitor") or {}).items():
        for module in requires(node._target_):
            yield "monitor", name, module
    if Precision(cfg.precision.name) is Precision.fp8:
        yield "precision", "fp8", "torchao"
    tasks = list(cfg.train.get("eval_tasks") or [])
    if tasks:
        yield "train.eval_tasks", tasks, "lm_eval"


def check(cfg: DictConfig) -> None:
    """The job's choices (backend, peft, monitors, precision, train.eval_tasks): each module they need is
    importable, or one ``UserError`` naming the first choice and the one command that installs every missing one."""
    _refuse_missing(list(needs(cfg)))


def check_hydra(hydra: DictConfig) -> None:
    """A sweep's own choices, before its launcher is built: the sweeper's (``hydra/sweeper=optuna``) modules."""
    target = hydra.sweeper.get("_target_")
    option = hydra.get("runtime", {}).get("choices", {}).get("hydra/sweeper") or str(target).rpartition(".")[2]
    _refuse_missing([("hydra/sweeper", option, m) for m in (requires(target) if target else ())])


def check_command_line(argv: list[str]) -> None:
    """``hydra/launcher=NAME`` of a plugin that is not installed (Hydra would refuse to compose it, listing only
    the installed options)."""
    found = []
    for arg in argv:
        group, _, option = arg.lstrip("+~").partition("=")
        if group.strip("/") == "hydra/launcher" and option in LAUNCHER_PLUGINS:
            found.append(("hydra/launcher", option, LAUNCHER_PLUGINS[option]))
    _refuse_missing(found)


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package that is absent, or one without a spec
        return True


def _refuse_missing(wanted: list[tuple[str, Any, str]]) -> None:
    missing = [(key, value, module) for key, value, module in wanted if _missing(module)]
    if not missing:
        return
    key, value, _ = missing[0]
    modules = list(dict.fromkeys(m for _, _, m in missing))
    extras = list(dict.fromkeys(EXTRA.get(m, "core") for m in modules))
    chose = f"{key}={value}" if not isinstance(value, list) else f"{key}=[{','.join(map(str, value))}]"
    packages = ", ".join(f"`{m}`" for m in modules)
    which = " and ".join(f"the {e} extra" if e != "core" else "the core" for e in extras)
    raise UserError(key, value, f"{chose} needs {packages}, which this environment does not have (it comes with "
                    f"{which}; `make train` sets up only the core and DeepSpeed).",
                    f"Install it once with `{install_command(extras)}`{TAKES.get(extras[0], '')}, "
                    f"{INSTEAD.get(key, 'or choose otherwise')}.")


def checkout() -> str | None:
    """The shardyard checkout this package runs from (its Makefile and scripts/setup.sh beside src/), or None
    for an installed wheel."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if os.path.isfile(os.path.join(root, "Makefile")) and os.path.isfile(os.path.join(root, "scripts", "setup.sh")):
        return root
    return None


def install_command(extras: list[str]) -> str:
    """The one command that installs ``extras`` into this environment."""
    root = checkout()
    names = [e for e in extras if e != "core"]
    if root is not None:
        where = "" if os.path.realpath(os.getcwd()) == os.path.realpath(root) else f"-C {root} "
        return f"make {where}setup" + (f" EXTRAS={','.join(names)}" if names else "")
    if "horovod" in names:  # no pip extra: its sdist needs C++17 to build against torch >= 2.1
        return "the build of shardyard's scripts/build_horovod.sh (Horovod 0.28.1 from its sdist, C++17)"
    return f"pip install 'shardyard[{','.join(names)}]'" if names else "pip install --force-reinstall shardyard"
