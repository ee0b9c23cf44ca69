"""The config layer: schemas (ConfigStore), resolvers, plug-in building (``plugins``), migrations, the sweepers'
config classes, ``+key`` help (``options``), the extras a config's choices need (``preflight``), and the one
``compose()`` outside a Hydra app. Cross-group validation lives above it (``shardyard.planning.validate``).

May import: ``core`` only."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from shardyard.config.schema import register_configs

__all__ = ["CONF_DIR", "compose", "register_configs", "register_resolvers", "run_dir_defaulted"]

CONF_DIR = (Path(__file__).parents[1] / "conf").resolve()
"""shardyard's configs: the checkout's ``conf/`` (``src/shardyard/conf`` links to it), or the copy in the wheel."""

_TIMESTAMPED: list[str] = []
"""Run dirs this process named by the clock (``sy_run_dir``), which another node would name differently."""


def run_dir_defaulted() -> bool:
    return bool(_TIMESTAMPED)


def _run_dir(root: str = "outputs") -> str:
    """Hydra's run dir: one per run, and the same for every worker of an external launch (torchrun, srun)."""
    from shardyard.core import dist_env

    if os.environ.get("SHARDYARD_RUN_DIR"):
        return os.environ["SHARDYARD_RUN_DIR"]
    day = datetime.datetime.now().strftime("%Y-%m-%d")
    if dist_env.detect() is not None:
        return f"{root}/{day}/{dist_env.run_dir_name()}"
    name = f"{root}/{day}/{datetime.datetime.now().strftime('%H-%M-%S-%f')[:-3]}"
    _TIMESTAMPED.append(name)
    return name


def _short(name: str, limit: int = 60) -> str:
    """Sweep job dir names stay readable and below the file-system limit: long ones keep a hash."""
    import hashlib

    name = name.replace("/", "_")
    if len(name) <= limit:
        return name
    return f"{name[:limit - 9]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def register_resolvers() -> None:
    resolvers: dict[str, Callable[..., str]] = {"sy_run_dir": _run_dir, "sy_short": _short}
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def compose(overrides: list[str], conf_dir: Path | str = CONF_DIR, config_name: str = "train",
            run_dir: str = "RUN_DIR") -> Any:
    """The config ``python train.py <overrides>`` composes (typed, as ``run.validate`` sees it), outside a Hydra
    app: the one composer of the recipe book, ``shardyard sbatch``, projects and the tests. ``run_dir`` stands in
    for the run's directory (``rundir.resolved`` turns the config into what the workers get)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    register_resolvers()
    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir)):
        return hydra_compose(config_name, overrides=[*overrides, f"run_dir={run_dir}"])


def checkpointing_mode(m: Any) -> str:
    """``model.activation_checkpointing`` as ``none``, ``full`` or ``selective`` (``false``/``true`` are the
    first two: recipes written before ``selective`` existed)."""
    from shardyard.core.errors import UserError

    value = m.activation_checkpointing
    mode = {False: "none", True: "full"}[value] if isinstance(value, bool) else str(value).lower()
    mode = {"false": "none", "true": "full"}.get(mode, mode)
    if mode not in ("none", "full", "selective"):
        raise UserError("model.activation_checkpointing", value, "It is none, full or selective (false and true "
                        "mean none and full).", "Use model.activation_checkpointing=selective (or full, or none).")
    return mode


def checkpointed_fraction(m: Any, blocks: int) -> float:
    """The share of the blocks ``apply_activation_checkpointing`` checkpoints (the plan's figure)."""
    if checkpointing_mode(m) == "none" or blocks == 0:
        return 0.0
    every = int(m.get("activation_checkpointing_every", 1))
    return len(range(0, blocks, every)) / blocks
