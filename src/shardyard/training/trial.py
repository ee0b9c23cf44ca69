"""A job of ``hydra/sweeper=optuna``: its Optuna trial, reported to and asked for pruning from inside training.
Its own module, below the sweep and the worker, so the worker does not climb to the sweep's orchestration."""

from __future__ import annotations

import sys
from typing import Any

from shardyard.core.errors import UserError


PRUNER_ATTR = "shardyard_pruner"
"""The study's user attribute holding the sweeper's pruner settings: Optuna does not store the pruner, and every
trial's job must prune as the sweeper was told to."""


def make_pruner(name: str, startup: int, warmup: int) -> Any:
    import optuna

    pruners = {"median": lambda: optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=warmup),
               "hyperband": lambda: optuna.pruners.HyperbandPruner(),
               "none": lambda: optuna.pruners.NopPruner()}
    if name not in pruners:
        raise UserError("hydra.sweeper.pruner", name, "Unknown pruner.", "Use median, hyperband or none.")
    return pruners[name]()


class Trial:
    """A job of ``hydra/sweeper=optuna`` (``sweep.trial`` set): rank 0 reports each evaluation's objective to
    its Optuna trial and asks the pruner (built from the sweeper's settings, stored in the study); one
    all-reduce per evaluation tells every rank, so all stop together. A journal that cannot be read or
    written only means no pruning (with a warning): never a rank left waiting in the all-reduce."""

    def __init__(self, sweep: Any, backend: Any) -> None:
        """``sweep``: the run's ``sweep`` section (objective, storage, study, trial number)."""
        self.backend, self.metric, self.trial = backend, str(sweep.objective), None
        if backend.rank == 0:
            try:
                import optuna
                from optuna.storages import JournalStorage
                from optuna.storages.journal import JournalFileBackend

                storage = JournalStorage(JournalFileBackend(str(sweep.storage)))
                name = str(sweep.study)
                study_id = storage.get_study_id_from_name(name)
                settings = storage.get_study_user_attrs(study_id).get(PRUNER_ATTR, {"name": "median", "startup": 5,
                                                                                    "warmup": 0})
                study = optuna.load_study(study_name=name, storage=storage, pruner=make_pruner(
                    settings["name"], int(settings["startup"]), int(settings["warmup"])))
                trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, int(sweep.trial))
                self.trial = optuna.Trial(study, trial_id)
            except Exception as e:  # noqa: BLE001
                print(f"shardyard | this trial cannot reach its Optuna study ({type(e).__name__}: {e}); it runs "
                      "without pruning", file=sys.stderr, flush=True)

    @classmethod
    def of(cls, sweep: Any, backend: Any) -> Trial | None:
        """The run's trial when it is a job of ``hydra/sweeper=optuna`` (``sweep.trial`` set), else None.
        ``sweep``: the run's ``sweep`` section, or None where the config has none."""
        return cls(sweep, backend) if sweep is not None and sweep.get("trial") is not None else None

    def should_stop(self, step: int, metrics: dict) -> bool:
        import torch

        prune = 0.0
        if self.trial is not None and step > 0 and self.metric in metrics:  # step 0: the untrained baseline
            try:
                self.trial.report(float(metrics[self.metric]), step)
                prune = float(self.trial.should_prune())
            except Exception as e:  # noqa: BLE001 - the other ranks are waiting in the all-reduce below
                print(f"shardyard | Optuna report failed at step {step} ({type(e).__name__}: {e}); not pruning",
                      file=sys.stderr, flush=True)
        return bool(self.backend.all_reduce_mean(torch.tensor(prune, device=self.backend.device)).item() > 0)
