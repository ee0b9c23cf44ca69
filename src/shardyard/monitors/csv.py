"""``<run_dir>/metrics.csv``: one row per logged step, one fixed column per metric (``monitors.METRICS``).

The columns are the same for every engine and device, so CSVs of different runs line up; a metric not
reported at a step (eval metrics between evaluations, MFU on CPU) is an empty cell. The training and the
evaluation metrics of one step share its row. A run with ``train.eval_tasks`` gains a column per harness metric
(``eval/<task>/<metric>``) when the first evaluation reports it (the file is rewritten once with the wider header).
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
        tasks = (config.get("train") or {}).get("eval_tasks") or []
        self.task_prefixes = tuple(f"eval/{t}/" for t in tasks)  # their metrics' columns, added as they come
        if not self.fresh:  # an earlier attempt's columns (its harness metrics) stay
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
        import io

        from shardyard.monitors.jsonl import replace_atomically

        if self.fresh:
            return
        self.f.close()
        with open(self.path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if (r.get("step") or "").isdigit() and int(r["step"]) <= step
                    and None not in r.values()]  # a short row (killed mid-write) has missing cells
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=self.fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        replace_atomically(self.path, out.getvalue())
        self._open()

    def log(self, step: int, metrics: dict) -> None:
        if self.row and self.row["step"] != step:
            self._flush()
        new = [k for k in metrics if k not in self.fields and k.startswith(self.task_prefixes)]
        if new:
            self._widen(new)
        self.row.setdefault("step", step)
        self.row.update(metrics)

    def _widen(self, columns: list[str]) -> None:
        """New columns at the right: the rows so far rewritten under the wider header, beside the file and renamed
        over it."""
        import io

        from shardyard.monitors.jsonl import replace_atomically

        self.f.close()
        with open(self.path, newline="") as f:
            rows = list(csv.DictReader(f))
        self.fields += columns
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
