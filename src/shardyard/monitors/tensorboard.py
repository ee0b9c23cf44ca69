"""TensorBoard event files in ``<run_dir>/<subdir>`` (``tensorboard --logdir outputs``)."""

from __future__ import annotations

import os

from omegaconf import DictConfig


class TensorBoardMonitor:
    requires = "tensorboard"

    def __init__(self, run_dir: str, config: DictConfig, subdir: str = "tensorboard"):
        from torch.utils.tensorboard import SummaryWriter  # lazy: pulls in tensorboard

        self.writer = SummaryWriter(os.path.join(run_dir, subdir))

    def log(self, step: int, metrics: dict) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, step)

    def close(self, summary: dict) -> None:
        self.writer.flush()
        self.writer.close()

    def fail(self, error: str) -> None:
        self.writer.add_text("error", error)
        self.close({})
