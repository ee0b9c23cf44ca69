"""``shardyard train ...`` (``python -m shardyard train ...``): ``train.py``'s Hydra app over the configs that ship
inside the package, so it runs from any directory, outside a checkout; also the app of a project made by
``shardyard new`` (its ``conf/`` first on the search path, shardyard's after it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from shardyard.core.errors import UserError, leave, report_and_exit


def train(argv: list[str], conf_dir: Path | None = None, config_name: str = "train", prog: str = "shardyard train") -> None:
    import hydra

    from shardyard.config import register_configs, register_resolvers
    from shardyard.config import CONF_DIR

    register_configs()
    register_resolvers()
    sys.argv = [prog, *argv]
    hydra_entry(hydra.main(version_base="1.3", config_path=str(conf_dir or CONF_DIR), config_name=config_name)(_task))


def _task(cfg: DictConfig) -> float | None:
    from shardyard.launching.run import run  # torch and friends load only once a job really runs

    return run(cfg)  # a sweep's job returns its objective (sweep.objective) to the sweeper


def hydra_entry(hydra_main) -> None:
    """``train.py``'s ``__main__``: take what launchers add to the command line, check a given run dir, run
    Hydra, and turn Hydra's exit code 1 for composition errors (unknown option, misspelt key, wrong type)
    into 2, like every other user error."""
    from shardyard.core import errors
    from shardyard.config import preflight
    from shardyard.training.rundir import check_command_line_dirs

    _take_local_rank_arg()
    if {"--help", "-h", "--hydra-help"} & set(sys.argv[1:]):
        _one_repository_for_help()
    try:
        check_command_line_dirs(sys.argv[1:])
        preflight.check_command_line(sys.argv[1:])  # a launcher plugin that is absent (Hydra could not compose it)
    except UserError as err:
        report_and_exit(err)
    try:
        hydra_main()
    except SystemExit as e:
        if e.code == 1 and not errors.JOB_STARTED:
            print("shardyard: the command line names a config group option, key or value that the schemas do "
                  "not accept (see above). `python train.py --help` lists groups and options; "
                  "`python train.py --cfg job` prints every key.", file=sys.stderr)
            leave(2)
        if e.code is None or isinstance(e.code, int):
            leave(e.code or 0)
        raise
    leave(0)


def _one_repository_for_help() -> None:
    """``--help`` lists every config group's options, and Hydra 1.3 builds a fresh config repository for each
    of the ~100 groups, deep-copying the whole ConfigStore every time (our schemas: about 70 ms each, 3-4 s in
    all). The search path is the same for all of them within one ``--help`` (same config name, same overrides),
    so this process builds it once. Only for a help process, which exits after printing."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    build = ConfigLoaderImpl._parse_overrides_and_create_caching_repo
    built: dict = {}

    def once(self: ConfigLoaderImpl, config_name: str | None, overrides: list[str]):
        key = (id(self), config_name, tuple(overrides))
        if key not in built:
            built[key] = build(self, config_name, overrides)
        return built[key]

    ConfigLoaderImpl._parse_overrides_and_create_caching_repo = once  # type: ignore[method-assign]


def _take_local_rank_arg() -> None:
    """`deepspeed train.py ...` appends --local_rank=N; Hydra would reject it, and LOCAL_RANK says the same."""
    for i, arg in enumerate(sys.argv[1:], start=1):
        if arg.startswith("--local_rank") or arg.startswith("--local-rank"):
            value = arg.split("=", 1)[1] if "=" in arg else sys.argv.pop(i + 1)
            os.environ.setdefault("LOCAL_RANK", value)
            del sys.argv[i]
            return
