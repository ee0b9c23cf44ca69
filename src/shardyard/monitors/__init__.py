"""Metric sinks. ``jsonl`` is always on; the ``monitor`` list group picks the others. Rank 0 only.

Each plugin module is imported only when selected (tensorboard, and later wandb/mlflow, are heavy).
"""

from __future__ import annotations

import importlib
from typing import Protocol

from omegaconf import DictConfig


class Monitor(Protocol):
    def log(self, step: int, metrics: dict) -> None: ...

    def close(self, summary: dict) -> None: ...


PLUGINS = {
    "console": "shardyard.monitors.console:ConsoleMonitor",
    "tensorboard": "shardyard.monitors.tensorboard:TensorBoardMonitor",
}


class Monitors:
    """Fans every call out to the selected monitors."""

    def __init__(self, monitors: list[Monitor]):
        self.monitors = monitors

    def log(self, step: int, metrics: dict) -> None:
        for m in self.monitors:
            m.log(step, metrics)

    def close(self, summary: dict) -> None:
        for m in self.monitors:
            m.close(summary)


def build(cfg: DictConfig, run_dir: str, total_steps: int, is_rank0: bool) -> Monitors:
    if not is_rank0:
        return Monitors([])
    from shardyard.monitors.jsonl import JsonlMonitor

    out: list[Monitor] = [JsonlMonitor(run_dir)]
    for name, mcfg in (cfg.monitor or {}).items():
        module, cls = PLUGINS[name].split(":")
        out.append(getattr(importlib.import_module(module), cls)(mcfg, run_dir, total_steps))
    return Monitors(out)
