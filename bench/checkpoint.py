"""python bench/checkpoint.py [--steps 4] [--world 2] [--backend fsdp] [--export-hf]

What a checkpoint save costs the training on this machine, synchronous vs ``checkpoint.async_save=true``, on
FSDP at two model sizes (deepseek_tiny's default, and 8 layers of width 768: about 10x the bytes). Every step
saves (``checkpoint.every_n_steps=1``); from each save's line (``shardyard | saved step-N ...``) it prints

1. the time the step waited for the save (sync: the whole save; async: staging the state in host memory),
2. for async, how long the background write, hashing and publish took,
3. the hashing share: how much of the checkpoint's bytes each rank hashed and fsynced (``meta.json``'s
   ``hashed_bytes``: each rank its own files and its pieces of the large files one rank wrote for all, in
   parallel), in MB per rank beside the plan's even share (the checkpoint's bytes / world), and rank 0's hashing
   time. ``--export-hf`` puts an HF export in each checkpoint (its shards hashed by the ranks that wrote them);
   ``--backend zero2`` shows the whole 16-bit model file hashed in pieces (``checkpoint.async_save`` is refused
   there: the async columns are then left out),
4. for async, the host copy each rank staged (``meta.json``'s ``staged_bytes``: one buffer per rank, reused by every
   save) beside the plan's ``checkpoint_staging`` for a rank (the run dir's plan.json).

The first save of a run is left out (it builds DCP's plan and the gloo group of background saves). Prints;
asserts nothing (timings belong here, not in tests).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"tiny (default)": [], "x10 (8 layers, width 768)": ["model.num_layers=8", "model.hidden_size=768",
                                                               "model.intermediate_size=2048", "model.num_heads=12"]}
LINE = re.compile(r"saved (step-\d+) \(([^)]*)\): the step waited ([0-9.]+) s(?:, then the background write, hashing "
                  r"and publish took ([0-9.]+) s)?; rank 0 hashed and fsynced its files in ([0-9.]+) s")


def run(extra: list[str], background: bool, steps: int, world: int, run_dir: str, backend: str = "fsdp") -> dict:
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", f"backend={backend}", f"launch.nproc_per_node={world}",
           f"train.steps={steps}", "train.eval_every_n_steps=0", "train.sample_tokens=0", "checkpoint.save_final=false",
           "checkpoint.every_n_steps=1", "checkpoint.keep_last=0", f"checkpoint.async_save={str(background).lower()}",
           "monitor.console.style=plain", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stdout[-2000:] + proc.stderr[-4000:])
    saves = [m.groups() for m in LINE.finditer(proc.stdout)][1:]
    metas = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(run_dir, "checkpoints/step-*/meta.json")))]
    hashed = metas[-1]["hashed_bytes"]
    planned = json.load(open(os.path.join(run_dir, "plan.json")))["memory"]["device"].get("checkpoint_staging", 0.0)
    return {"staged": metas[-1].get("staged_bytes"), "staged_plan": planned,"size": saves[-1][1], "waited": statistics.median(float(s[2]) for s in saves),
            "background": statistics.median(float(s[3]) for s in saves) if background else None,
            "hash0": statistics.median(float(s[4]) for s in saves),
            "share": [h / sum(hashed) for h in hashed], "hashed": hashed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", default="fsdp")
    ap.add_argument("--export-hf", action="store_true", help="an HF export in each checkpoint")
    a = ap.parse_args()
    both = a.backend not in ("zero1", "zero2", "zero3")  # async_save is refused on the ZeRO engines
    export = ["checkpoint.export_hf=true"] if a.export_hf else []
    print(f"checkpoint saves on {a.backend} x{a.world}{' with an HF export' if a.export_hf else ''}, every step of "
          f"{a.steps} (medians over saves 2-{a.steps})")
    print(f"{'model':28} {'checkpoint':>10} | {'sync: step waits':>16} | {'async: step waits':>17} "
          f"{'background':>10} {'ratio':>6} | {'MB hashed per rank':>22} {'plan: even share':>16} "
          f"{'rank 0 hash s':>13} | {'async: MB staged per rank':>25} {'plan':>6}")
    for name, extra in SIZES.items():
        with tempfile.TemporaryDirectory() as d:
            sync = run([*extra, *export], False, a.steps, a.world, os.path.join(d, "sync"), a.backend)
            bg = run([*extra, *export], True, a.steps, a.world, os.path.join(d, "async"), a.backend) if both else None
        per_rank = " ".join(f"{h / 1e6:.1f}" for h in sync["hashed"])
        even = sum(sync["hashed"]) / a.world / 1e6
        background = (f"{bg['waited']:>15.2f} s {bg['background']:>8.2f} s {bg['waited'] / sync['waited']:>6.2f}"
                      if bg else f"{'-':>17} {'-':>10} {'-':>6}")
        staged = (" ".join(f"{b / 1e6:.1f}" for b in bg["staged"]), f"{bg['staged_plan'] / 1e6:.1f}") \
            if bg and bg["staged"] else ("-", "-")
        print(f"{name:28} {sync['size']:>10} | {sync['waited']:>14.2f} s | {background} | {per_rank:>22} "
              f"{even:>16.1f} {sync['hash0']:>11.2f} s | {staged[0]:>25} {staged[1]:>6}")


if __name__ == "__main__":
    main()
