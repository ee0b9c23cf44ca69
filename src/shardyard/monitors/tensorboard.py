"""TensorBoard event files in ``<run_dir>/<subdir>`` (``tensorboard --logdir outputs``)."""

from __future__ import annotations

import glob
import os
from typing import Any

from omegaconf import DictConfig


class TensorBoardMonitor:
    requires = "tensorboard"

    def __init__(self, run_dir: str, config: DictConfig, subdir: str = "tensorboard"):
        self.logdir = os.path.join(run_dir, subdir)
        self.purge_step: int | None = None
        self._writer: Any = None  # made at the first event, so that `resume` can still set its purge step

    def resume(self, step: int) -> None:
        """Event files are append-only: a new one starts with TensorBoard's purge marker, and its readers drop
        the earlier files' events at steps > ``step``. Only where earlier events exist."""
        if glob.glob(os.path.join(self.logdir, "events.out.tfevents.*")):
            self.purge_step = step + 1

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # lazy: pulls in tensorboard

            self._writer = SummaryWriter(self.logdir, purge_step=self.purge_step)
        return self._writer

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
