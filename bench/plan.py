"""The plan as a user meets it: how long the headline command takes to be refused on this machine, and the
deepseek7b table for 8 x H100-80GB beside the published rules of thumb.

    python bench/plan.py [--repeats 3]

Prints, never asserts (the e2e tier checks what the refusal says; tests/dist/test_plan.py checks the figures).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "train.py", "backend=zero3", "model=deepseek7b",
                               f"hydra.run.dir={tempfile.mkdtemp(prefix='bench-plan-')}"], cwd=ROOT,
                              capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        assert proc.returncode == 2, proc.stderr[-2000:]
    print(f"`python train.py backend=zero3 model=deepseek7b` refused (exit 2) in {statistics.median(times):.1f} s "
          f"(median of {a.repeats}: {', '.join(f'{t:.1f}' for t in times)}); target < 15 s")
    print(proc.stderr)
    table = subprocess.run([sys.executable, "train.py", "backend=zero3", "model=deepseek7b", "precision=bf16",
                            "data.seq_len=4096", "train.micro_batch_size=1", "plan.only=true",
                            "plan.hardware=8xH100-80GB"], cwd=ROOT, capture_output=True, text=True)
    print(table.stdout)


if __name__ == "__main__":
    main()
