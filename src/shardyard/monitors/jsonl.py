"""``metrics.jsonl``: one JSON object per logged step (and per evaluation), flushed as it is written."""

from __future__ import annotations

import json
import os


class JsonlMonitor:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.f = open(self.path, "a")

    def resume(self, step: int) -> None:
        """Keep the lines logged at steps <= ``step`` (and the error lines of failed attempts); a partial last
        line of a killed process goes too. Rewritten beside it and renamed over it: never half a file."""
        if os.path.getsize(self.path) == 0:
            return
        self.f.close()
        kept = []
        with open(self.path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                at = row.get("step", step) if isinstance(row, dict) else None
                if isinstance(at, int) and at <= step:
                    kept.append(line.rstrip("\n") + "\n")
        replace_atomically(self.path, "".join(kept))
        self.f = open(self.path, "a")

    def log(self, step: int, metrics: dict) -> None:
        self.f.write(json.dumps({"step": step, **metrics}) + "\n")
        self.f.flush()

    def close(self, summary: dict) -> None:
        self.f.close()

    def fail(self, error: str) -> None:
        self.f.write(json.dumps({"error": error}) + "\n")
        self.f.close()


def replace_atomically(path: str, text: str) -> None:
    """``path`` now holds ``text``: written to a temporary file beside it, fsynced, then renamed over it."""
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
