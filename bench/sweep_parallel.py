"""Jobs side by side: the same sweep run one job after another (Hydra's basic launcher) and two at a time
with shardyard's ``hydra/launcher=parallel`` (jobs forked from the sweep's process) and with Hydra's
``hydra/launcher=joblib`` (fresh loky interpreters), ``n_jobs=2``, each job its own slot (ports, threads, GPUs).

    python bench/sweep_parallel.py [--jobs 2] [--ranks 1] [--steps 30]

Prints the wall times, the ratios (parallel / sequential: below 1 is the gain), and each parallel job's slot,
rendezvous port and threads per rank, with the pairs that overlapped in time. On a 2-core box 2 one-rank jobs
gain from overlapping start-up, data loading and evaluation with training; on N GPUs, N/k jobs of k ranks
each gain up to N/k-fold.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.hidden_size=64", "model.intermediate_size=176", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=4", "data.seq_len=64", "train.micro_batch_size=4", "train.sample_tokens=0",
        "train.eval_batches=2", "checkpoint.save_final=false", "monitor=[console]"]


def sweep(launcher: list[str], jobs: int, ranks: int, steps: int) -> tuple[float, Path]:
    sweep_dir = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    lrs = ",".join(f"{1e-3 * (i + 1):g}" for i in range(jobs))
    backend = "single" if ranks == 1 else "ddp"
    cmd = [sys.executable, "train.py", "-m", f"backend={backend}", f"launch.nproc_per_node={ranks}", f"optim.lr={lrs}",
           *TINY, f"train.steps={steps}", f"hydra.sweep.dir={sweep_dir}", *launcher]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return wall, sweep_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    sweep([], 1, a.ranks, 2)  # warm the tokenizer and token caches
    seq, _ = sweep([], a.jobs, a.ranks, a.steps)
    par, sweep_dir = sweep(["hydra/launcher=parallel", "hydra.launcher.n_jobs=2"], a.jobs, a.ranks, a.steps)
    jl, _ = sweep(["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], a.jobs, a.ranks, a.steps)
    print(f"{a.jobs} jobs x {a.ranks} rank(s), {a.steps} steps: sequential {seq:.1f} s | 2 at a time: "
          f"hydra/launcher=parallel {par:.1f} s (ratio {par / seq:.2f}), hydra/launcher=joblib {jl:.1f} s "
          f"(ratio {jl / seq:.2f})")
    results = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/result.json"))]
    for r in results:
        print(f"  {r['job']}: slot {r.get('slot')} port {r.get('master_port')} threads/rank {r.get('threads_per_rank')} "
              f"{r['ended'] - r['started']:.1f} s")
    overlap = [(a_["job"], b["job"]) for i, a_ in enumerate(results) for b in results[i + 1:]
               if a_["started"] < b["ended"] and b["started"] < a_["ended"]]
    shared = [p for p in overlap if next(r for r in results if r["job"] == p[0]).get("master_port")
              == next(r for r in results if r["job"] == p[1]).get("master_port")]
    print(f"  overlapping pairs: {len(overlap)}, of them sharing a port: {len(shared)}")


if __name__ == "__main__":
    main()
