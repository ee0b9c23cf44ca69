"""python bench/long_context.py [--budget-gib 1.0] [--sp 1 2 4] [--longest 65536]

How long a sequence trains within a fixed memory budget per rank on this machine, with Ulysses sequence
parallelism (``backend.sp``) at each degree: deepseek_tiny (4 heads, its default width) on DDP, one sequence a step,
activation checkpointing on, no packed documents (causal: the CPU's flash kernel, no T x T mask). For each sp:

1. the longest power-of-two sequence whose *planned* peak per rank fits ``--budget-gib`` (the plan, in process, for
   this CPU box: the device pool is host RAM);
2. that run for real, 2 steps on ``sp`` gloo ranks: rank 0's measured peak RSS beside the plan's peak for a rank
   (``summary.json``), the step time, and the loss.

Context parallelism (``backend.cp``) is not built yet: no column. Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2 ** 30


def overrides(sp: int, seq: int) -> list[str]:
    return ["backend=ddp", f"backend.sp={sp}", f"launch.nproc_per_node={sp}", f"data.seq_len={seq}",
            f"model.max_position_embeddings={seq}", "train.micro_batch_size=1", "train.global_batch_size=1",
            "model.activation_checkpointing=true", "train.steps=2", "train.eval_every_n_steps=0",
            "train.sample_tokens=0", "checkpoint.save_final=false", "monitor=[console]", "monitor.console.style=plain",
            "metrics.report=false"]


def planned_peak(sp: int, seq: int) -> float:
    from shardyard.planning.hardware import hardware
    from shardyard.planning.plan import estimate
    from shardyard.planning.validate import validate
    from shardyard.testing import compose

    cfg = compose(overrides(sp, seq))
    plan = validate(cfg, None)
    return estimate(cfg, plan, hardware(cfg, plan)).device_peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--longest", type=int, default=65536)
    a = ap.parse_args()
    print(f"budget {a.budget_gib:.2f} GiB per rank (planned peak), deepseek_tiny on DDP, 1 sequence a step, "
          "activation checkpointing")
    print(f"{'sp':>3} {'longest seq':>12} {'plan GiB':>9} {'measured GiB':>13} {'step s':>7} {'loss':>7}")
    for sp in a.sp:
        seq, best = 1024, None
        while seq <= a.longest and planned_peak(sp, seq) <= a.budget_gib * GiB:
            best, seq = seq, seq * 2
        if best is None:
            print(f"{sp:>3} {'none':>12}")
            continue
        run_dir = tempfile.mkdtemp(prefix=f"bench-long-sp{sp}-")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "train.py", f"hydra.run.dir={run_dir}", *overrides(sp, best)], cwd=ROOT,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            print(f"{sp:>3} {best:>12,} failed: {proc.stderr[-800:]}")
            continue
        s = json.load(open(os.path.join(run_dir, "summary.json")))
        step = s.get("median_step_s", wall / 2)
        print(f"{sp:>3} {best:>12,} {s['memory_plan_bytes'] / GiB:>9.2f} {s['memory_peak_bytes'] / GiB:>13.2f} "
              f"{step:>7.1f} {s['final_train_loss']:>7.3f}", flush=True)


if __name__ == "__main__":
    main()
