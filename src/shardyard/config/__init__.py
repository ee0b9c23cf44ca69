"""Config schemas (ConfigStore), resolvers and cross-group validation."""

from __future__ import annotations

import datetime
import os

from omegaconf import OmegaConf

from shardyard.config.schema import register_configs

__all__ = ["register_configs", "register_resolvers"]


def _run_dir(root: str = "outputs") -> str:
    """Hydra's run dir: one per run, and the same for every worker of an external launch (torchrun, srun)."""
    from shardyard import dist_env

    if os.environ.get("SHARDYARD_RUN_DIR"):
        return os.environ["SHARDYARD_RUN_DIR"]
    day = datetime.datetime.now().strftime("%Y-%m-%d")
    if dist_env.detect() is not None:
        return f"{root}/{day}/{dist_env.run_dir_name()}"
    return f"{root}/{day}/{datetime.datetime.now().strftime('%H-%M-%S-%f')[:-3]}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("sy_run_dir"):
        OmegaConf.register_new_resolver("sy_run_dir", _run_dir)
