# python train.py [group=option ...] [key=value ...]      e.g.  python train.py backend=ddp launch.nproc_per_node=2
"""shardyard's one entry point. Hydra composes the config; ``shardyard.run`` does the rest."""

import sys

import hydra
from omegaconf import DictConfig

from shardyard.config import register_configs, register_resolvers

register_configs()
register_resolvers()
_started = False


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    global _started
    _started = True
    from shardyard.run import run  # torch and friends load only once a job really runs

    run(cfg)


def _take_local_rank_arg() -> None:
    """`deepspeed train.py ...` appends --local_rank=N; Hydra would reject it, and LOCAL_RANK says the same."""
    import os

    for i, arg in enumerate(sys.argv[1:], start=1):
        if arg.startswith("--local_rank") or arg.startswith("--local-rank"):
            value = arg.split("=", 1)[1] if "=" in arg else sys.argv.pop(i + 1)
            os.environ.setdefault("LOCAL_RANK", value)
            del sys.argv[i]
            return


if __name__ == "__main__":
    _take_local_rank_arg()
    try:
        main()
    except SystemExit as e:
        # Hydra exits 1 on composition errors (unknown option, misspelt key, wrong type) after printing
        # them; those are user errors, so they leave with 2 like every other user error.
        if e.code == 1 and not _started:
            print("shardyard: the command line names a config group option, key or value that the schemas do "
                  "not accept (see above). `python train.py --help` lists groups and options; "
                  "`python train.py --cfg job` prints every key.", file=sys.stderr)
            sys.exit(2)
        raise
