"""What the test tiers pay per run, cold and with shardyard.testing's shared start-up:

    python bench/test_processes.py [--repeats 3]

1. `python train.py debug.fast_dev_run=true backend=single` as a real interpreter vs forked from the fork
   server (`testing.run_python`, what conftest.train_py uses);
2. a 2-rank zero2 run of 5 steps on freshly spawned ranks (the suite's old `run_many`) vs the kept pool
   (`testing.run_many` now), after the pool has been started once.

Prints medians and ratios (forked / cold, pool / fresh spawn). Caches are warmed first.
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
sys.path.insert(0, str(ROOT / "src"))

from shardyard import testing  # noqa: E402

RUN = [*testing.TINY, "train.steps=5", "train.eval_every_n_steps=0", "train.global_batch_size=8", "backend=zero2"]


def train_py(forked: bool) -> float:
    argv = [str(ROOT / "train.py"), "debug.fast_dev_run=true", "backend=single",
            f"hydra.run.dir={tempfile.mkdtemp(prefix='bench-tp-')}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SHARDYARD_TEST_COLD": "0" if forked else "1"}
    os.environ["SHARDYARD_TEST_COLD"] = env["SHARDYARD_TEST_COLD"]
    t0 = time.perf_counter()
    proc = testing.run_python(argv, str(ROOT), env, 600)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed ({'forked' if forked else 'cold'}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return elapsed


def spawned(fresh: bool) -> float:
    if fresh:
        testing._close_pools()  # the next call spawns and imports again, as every run_many call used to
    t0 = time.perf_counter()
    testing.run_many(2, [(RUN, tempfile.mkdtemp(prefix="bench-pool-"))])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    train_py(False)  # warm the data caches, the page cache and the fork server
    train_py(True)
    spawned(False)
    cases = {"train.py, cold interpreter": lambda: train_py(False), "train.py, forked": lambda: train_py(True),
             "2-rank zero2 run, fresh spawn": lambda: spawned(True), "2-rank zero2 run, kept pool": lambda: spawned(False)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.repeats):  # interleaved, so machine load drifts hit every case alike
        for name, case in cases.items():
            times[name].append(case())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"bench/test_processes.py on {os.cpu_count()} cores, medians of {a.repeats}:")
    for name, value in med.items():
        print(f"  {name:32} {value:6.2f} s   (runs: {', '.join(f'{t:.2f}' for t in times[name])})")
    print(f"  ratio forked / cold train.py:      {med['train.py, forked'] / med['train.py, cold interpreter']:.2f}")
    print(f"  ratio kept pool / fresh spawn:     "
          f"{med['2-rank zero2 run, kept pool'] / med['2-rank zero2 run, fresh spawn']:.2f}")


if __name__ == "__main__":
    main()
