"""Config schemas (ConfigStore), resolvers and cross-group validation."""

from __future__ import annotations

import datetime
import os
from typing import Callable

from omegaconf import OmegaConf

from shardyard.config.schema import register_configs

__all__ = ["register_configs", "register_resolvers", "run_dir_defaulted"]

_TIMESTAMPED: list[str] = []
"""Run dirs this process named by the clock (``sy_run_dir``), which another node would name differently."""


def run_dir_defaulted() -> bool:
    return bool(_TIMESTAMPED)


def _run_dir(root: str = "outputs") -> str:
    """Hydra's run dir: one per run, and the same for every worker of an external launch (torchrun, srun)."""
    from shardyard import dist_env

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
