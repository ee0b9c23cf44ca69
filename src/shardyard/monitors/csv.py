"""``<run_dir>/metrics.csv``: one row per logged step, one fixed column per metric (``monitors.METRICS``).

The columns are the same for every engine and device, so CSVs of different runs line up; a metric not
reported at a step (eval metrics between evaluations, MFU on CPU) is an empty cell. The training and the
evaluation metrics of one step share its row.
"""

from __future__ import annotations

import csv
import os

from omegaconf import DictConfig


class CsvMonitor:
    def __init__(self, run_dir: str, config: DictConfig, file: str = "metrics.csv"):
        from shardyard.monitors import METRICS

        path = os.path.join(run_dir, file)
        fresh = not os.path.exists(path) or os.path.getsize(path) == 0
        self.f = open(path, "a", newline="")
        self.writer = csv.DictWriter(self.f, fieldnames=["step", *METRICS], extrasaction="ignore")
        if fresh:  # a resumed run appends below the header it wrote before
            self.writer.writeheader()
        self.row: dict = {}

    def log(self, step: int, metrics: dict) -> None:
        if self.row and self.row["step"] != step:
            self._flush()
        self.row.setdefault("step", step)
        self.row.update(metrics)

    def _flush(self) -> None:
        if self.row:
            self.writer.writerow(self.row)
            self.f.flush()
            self.row = {}

    def close(self, summary: dict) -> None:
        self._flush()
        self.f.close()

    def fail(self, error: str) -> None:
        self.close({})
