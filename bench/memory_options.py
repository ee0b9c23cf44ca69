"""What the memory options buy and cost: activation checkpointing (none, selective, full, full on every 2nd block)
and chunked cross-entropy (``model.loss_chunk``) at 32k and 128k vocabularies, each measured on one forward +
backward of the same micro-batch: the bytes kept after forward, the peak through backward (above parameters and
gradients), the plan's figure for it, and the time of a forward + backward as a ratio to no option.

    python bench/memory_options.py                  # CPU: 4 layers, hidden 256, 4 x 512 tokens, fp32
    python bench/memory_options.py --rows 8 --seq 1024

Each case runs in its own process started with MALLOC_MMAP_THRESHOLD_=65536, so the resident size follows the
live tensors (``shardyard.testing.activation_memory``). Prints, never asserts.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["model.hidden_size=256", "model.intermediate_size=688", "model.num_layers=4", "model.num_heads=4",
         "precision=fp32"]
CASES = [  # (name, overrides, the case whose step time it is compared with)
    ("checkpointing none", [], "checkpointing none"),
    ("selective", ["model.activation_checkpointing=selective"], "checkpointing none"),
    ("full", ["model.activation_checkpointing=full"], "checkpointing none"),
    ("full, every 2nd block", ["model.activation_checkpointing=full", "model.activation_checkpointing_every=2"],
     "checkpointing none"),
    ("vocab 32k", ["model.vocab_size=32768"], "vocab 32k"),
    ("vocab 32k, loss_chunk 512", ["model.vocab_size=32768", "model.loss_chunk=512"], "vocab 32k"),
    ("vocab 128k", ["model.vocab_size=131072"], "vocab 128k"),
    ("vocab 128k, loss_chunk 512", ["model.vocab_size=131072", "model.loss_chunk=512"], "vocab 128k")]

PROBE = """
import json, sys, time
import torch
from shardyard.testing import activation_memory, compose
from shardyard.models.build import build_model
from shardyard.models.loss import causal_lm_loss_sum
from shardyard.models.prepare import prepare_replica
overrides, rows, seq = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
out = activation_memory(overrides, rows, seq)
cfg = compose(overrides)
model = prepare_replica(build_model(cfg.model, 0), cfg, torch.device("cpu")).train()
x = torch.randint(0, cfg.model.vocab_size, (rows, seq))
times = []
for _ in range(4):
    t = time.perf_counter()
    causal_lm_loss_sum(model, x, x).backward()
    times.append(time.perf_counter() - t)
out["step_s"] = sorted(times[1:])[1]  # the median of the 3 after a warm-up
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": os.path.join(ROOT, "src")}
    print(f"model: 4 layers, hidden 256, fp32 | micro-batch {args.rows} x {args.seq} = {args.rows * args.seq:,} tokens")
    print(f"{'case':30} {'kept MiB':>9} {'peak MiB':>9} {'plan MiB':>9} {'plan/peak':>9} {'step s':>8} {'x time':>7}")
    step: dict[str, float] = {}
    for name, extra, base in CASES:
        proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(MODEL + extra), str(args.rows), str(args.seq)],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"{name:30} failed: {proc.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(proc.stdout.splitlines()[-1])
        step[name] = r["step_s"]
        mib = 2 ** 20
        print(f"{name:30} {r['kept'] / mib:9.1f} {r['peak'] / mib:9.1f} {r['plan'] / mib:9.1f} "
              f"{r['plan'] / r['peak']:9.2f} {r['step_s']:8.3f} {r['step_s'] / step.get(base, r['step_s']):7.2f}")


if __name__ == "__main__":
    main()
