"""``shardyard train ...`` (``python -m shardyard train ...``): ``train.py``'s Hydra app over the configs that ship
inside the package, so it runs from any directory, outside a checkout; also the app of a project made by
``shardyard new`` (its ``conf/`` first on the search path, shardyard's after it)."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig


def train(argv: list[str], conf_dir: Path | None = None, config_name: str = "train", prog: str = "shardyard train") -> None:
    import hydra

    from shardyard.cli import hydra_entry
    from shardyard.config import register_configs, register_resolvers
    from shardyard.recipes import CONF_DIR

    register_configs()
    register_resolvers()
    sys.argv = [prog, *argv]
    hydra_entry(hydra.main(version_base="1.3", config_path=str(conf_dir or CONF_DIR), config_name=config_name)(_task))


def _task(cfg: DictConfig) -> float | None:
    from shardyard.run import run  # torch and friends load only once a job really runs

    return run(cfg)  # a sweep's job returns its objective (sweep.objective) to the sweeper
