"""``<run_dir>/metrics.csv``: one row per logged step, one fixed column per metric (``monitors.METRICS``).

The columns are the same for every engine and device, so CSVs of different runs line up; a metric not
reported at a step (eval metrics between evaluations, MFU on CPU) is an empty cell. The training and the
evaluation metrics of one step share its row. An evaluation metric outside those (``monitors.extra_eval_metric``:
a harness score of ``train.eval_tasks``, ``eval/<task>/<metric>`` for each task a group or tag runs, a source's
loss) gains a column when it is first reported (the file is rewritten with the wider header).
"""

from __future__ import annotations

import csv
import os

from omegaconf import DictConfig


class CsvMonitor:
    def __init__(self, run_dir: str, config: DictConfig, file: str = "metrics.csv"):
        from shardyard.monitors import METRICS

        self.path, self.fields = os.path.join(run_dir, file), ["step", *METRICS]
        self.fresh = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        if not self.fresh:  # an earlier attempt's columns (its extra eval metrics) stay
            with open(self.path, newline="") as f:
                header = next(csv.reader(f), [])
            self.fields += [c for c in header if c not in self.fields]
        self._open()
        if self.fresh:  # a resumed run appends below the header it wrote before
            self.writer.writeheader()
        self.row: dict = {}

    def _open(self) -> None:
        self.f = open(self.path, "a", newline="")
        self.writer = csv.DictWriter(self.f, fieldnames=self.fields, extrasaction="ignore")

    def resume(self, step: int) -> None:
        """Keep the rows of steps <= ``step`` (a partial last row of a killed process goes too), under the
        header; rewritten beside the file and renamed over it."""
        if self.fresh:
            return
        with open(self.path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if (r.get("step") or "").isdigit() and int(r["step"]) <= step
                    and None not in r.values()]  # a short row (killed mid-write) has missing cells
        self._rewrite(rows)

    def log(self, step: int, metrics: dict) -> None:
        from shardyard.monitors import extra_eval_metric

        if self.row and self.row["step"] != step:
            self._flush()
        new = [k for k in metrics if k not in self.fields and extra_eval_metric(k)]
        if new:  # new columns at the right: the rows so far (each flushed) under the wider header
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
            self.fields += new
            self._rewrite(rows)
        self.row.setdefault("step", step)
        self.row.update(metrics)

    def _rewrite(self, rows: list[dict]) -> None:
        """The file as ``rows`` under the header of ``self.fields``: written beside it and renamed over it, then
        opened again for appending."""
        import io

        from shardyard.monitors.jsonl import replace_atomically

        self.f.close()
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=self.fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        replace_atomically(self.path, out.getvalue())
        self._open()

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
