# python train.py [group=option ...] [key=value ...]      e.g.  python train.py backend=ddp launch.nproc_per_node=2
"""shardyard's one entry point. Hydra composes the config; ``shardyard.launching.run`` does the rest."""

import hydra
from omegaconf import DictConfig

from shardyard.launching.app import hydra_entry
from shardyard.config import register_configs, register_resolvers

register_configs()
register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from shardyard.launching.run import run  # torch and friends load only once a job really runs

    return run(cfg)  # a sweep's job returns its objective (sweep.objective) to the sweeper


if __name__ == "__main__":
    hydra_entry(main)  # launcher arguments, the run dir check, and exit code 2 for composition errors
