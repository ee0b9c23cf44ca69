"""The config classes of shardyard's Hydra sweepers and launcher (``hydra/sweeper=shardyard|optuna``,
``hydra/launcher=parallel``). They live here, in the config layer, so that ``register_configs`` stores them
without importing the plug-in (``hydra_plugins.shardyard_sweepers``, which sits above the sweep and the run);
each names its plug-in class by ``_target_`` only."""

# No `from __future__ import annotations`: OmegaConf reads these dataclasses' annotations as types.
from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass
class GridSweeperConf:
    _target_: str = "hydra_plugins.shardyard_sweepers.GridSweeper"
    max_batch_size: Optional[int] = None
    """Jobs handed to the launcher at once (``null``: all); joblib then runs ``n_jobs`` of them side by side."""
    params: Optional[Dict[str, str]] = None
    """Sweep parameters in a recipe, as on the command line: ``optim.lr: 1e-3,3e-3``."""


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.shardyard_sweepers.OptunaSweeper"
    params: Dict[str, str] = field(default_factory=dict)
    """The search space in Hydra's override grammar: ``tag(log, interval(1e-4, 1e-2))`` (a float, log-uniform),
    ``interval(0, 1)``, ``range(10, 100, step=10)`` (integers), ``choice(a, b)``, or a single fixed value."""
    n_trials: int = 20
    """Trials that finish or are pruned, in all (a resumed sweep counts its earlier ones). A failed trial is
    retried with new parameters, at most ``n_trials`` times in one run."""
    n_jobs: int = 1
    """Trials launched together, one launcher batch (side by side with ``hydra/launcher=parallel``)."""
    sampler: str = "tpe"
    """``tpe``, ``random`` or ``grid`` (every ``choice``/``range`` combination; intervals need tpe or random)."""
    seed: Optional[int] = 0
    """The sampler's seed: the same sweep proposes the same trials."""
    pruner: str = "median"
    """``median`` (stop a trial whose evaluation is worse than the median of earlier trials at that step),
    ``hyperband``, or ``none``. Pruning needs an ``eval/*`` objective (``sweep.objective``)."""
    pruner_startup_trials: int = 2
    """Trials that always run to the end before the median pruner prunes any."""
    pruner_warmup_steps: int = 0
    """Optimizer steps of each trial before it can be pruned."""
    study_name: Optional[str] = None
    """The study's name in its journal; ``null``: ``shardyard``."""


@dataclass
class ParallelLauncherConf:
    _target_: str = "hydra_plugins.shardyard_sweepers.ParallelLauncher"
    n_jobs: int = 2
    """Jobs running at once on this machine, each in a slot of its own: a rendezvous port range
    (``sweep.base_port``), ``1/n_jobs`` of the visible GPUs and of the CPU cores."""


def register() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(group="hydra/sweeper", name="shardyard", node=GridSweeperConf, provider="shardyard")
    cs.store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="shardyard")
    cs.store(group="hydra/launcher", name="parallel", node=ParallelLauncherConf, provider="shardyard")
