"""A real Weights & Biases run: the resolved config as the run config, every metric at its step.

Without an API key (``WANDB_API_KEY`` or a ``wandb login``), ``mode=auto`` runs offline: the run's files
go to ``<run_dir>/wandb/offline-run-*`` and ``wandb sync <that dir>`` uploads them later.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf


def _has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.expanduser(os.environ.get("NETRC", "~/.netrc"))  # where `wandb login` stores the key
    return os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read()


class WandbMonitor:
    requires = "wandb"

    def __init__(self, run_dir: str, config: DictConfig, project: str = "shardyard", entity: str | None = None,
                 name: str | None = None, mode: str = "auto", tags: list[str] | tuple = ()):
        import wandb  # lazy: heavy, and only when selected

        mode = mode if mode != "auto" else ("online" if _has_credentials() else "offline")
        run_config: Any = OmegaConf.to_container(config, resolve=True)
        if mode == "offline":
            print(f"shardyard | wandb: no API key, running offline (sync later: wandb sync {run_dir}/wandb/offline-run-*)",
                  flush=True)
        self.run = wandb.init(project=project, entity=entity, name=name or os.path.basename(run_dir),
                              dir=run_dir, mode=mode, tags=list(tags),  # type: ignore[arg-type]  # validated Enum
                              config=run_config,
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def close(self, summary: dict) -> None:
        for key in ("final_train_loss", "final_eval_ppl", "tokens", "tokens_per_s", "params", "wall_s"):
            if key in summary:
                self.run.summary[key] = summary[key]
        self.run.finish()

    def fail(self, error: str) -> None:
        self.run.summary["error"] = error
        self.run.finish(exit_code=1)
