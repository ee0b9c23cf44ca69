"""``metrics.jsonl``: one JSON object per logged step (and per evaluation), flushed as it is written."""

from __future__ import annotations

import json
import os


class JsonlMonitor:
    def __init__(self, run_dir: str):
        self.f = open(os.path.join(run_dir, "metrics.jsonl"), "a")

    def log(self, step: int, metrics: dict) -> None:
        self.f.write(json.dumps({"step": step, **metrics}) + "\n")
        self.f.flush()

    def close(self, summary: dict) -> None:
        self.f.close()

    def fail(self, error: str) -> None:
        self.f.write(json.dumps({"error": error}) + "\n")
        self.f.close()
