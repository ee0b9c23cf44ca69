"""What a sweep or a test pays per job: `python train.py debug.fast_dev_run=true` (build, 2 steps, one eval
batch, exit), single process and 2 DDP ranks, beside the bare `import torch, transformers` it cannot avoid.

    python bench/startup.py [--repeats 3]

Prints the medians and the ratios (targets: single <= 1.5x the bare import, 2 ranks <= 2x). Caches (tokenizer,
token arrays) are warmed first; each run gets a fresh run dir.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BARE = [sys.executable, "-c", "import torch, transformers; from transformers import LlamaForCausalLM"]


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return elapsed


def train(*overrides: str) -> list[str]:
    run_dir = tempfile.mkdtemp(prefix="bench-startup-")
    return [sys.executable, "train.py", "debug.fast_dev_run=true", f"hydra.run.dir={run_dir}", *overrides]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    timed(train("backend=single"))  # warm the data caches and the OS page cache
    cases = {"bare import": lambda: BARE, "fast_dev_run, single": lambda: train("backend=single"),
             "fast_dev_run, 2 DDP ranks": lambda: train("launch.nproc_per_node=2")}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.repeats):  # interleaved, so machine load drifts hit every case alike
        for name, cmd in cases.items():
            times[name].append(timed(cmd()))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"bench/startup.py on {os.cpu_count()} cores, medians of {a.repeats}:")
    for name, value in med.items():
        print(f"  {name:28} {value:6.2f} s   (runs: {', '.join(f'{t:.2f}' for t in times[name])})")
    base = med["bare import"]
    print(f"  ratio single / bare import: {med['fast_dev_run, single'] / base:.2f}  (target <= 1.5)")
    print(f"  ratio 2 ranks / bare import: {med['fast_dev_run, 2 DDP ranks'] / base:.2f}  (target <= 2.0)")


if __name__ == "__main__":
    main()
