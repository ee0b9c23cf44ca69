# python bench/memory.py [--worlds 2 4]          (CPU, gloo; ~4 min; prints, never asserts)
"""Bytes per rank held in parameters, gradients and optimizer state, per engine, bf16 mixed precision + Adam,
beside the ZeRO paper's expectation (P = parameters, N = world size; 16 bytes per parameter in all):
DDP 16P, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 and FSDP 16P/N.

Measured on the tensors each rank really holds (local shards and flat buffers, fp32 master copies
included; each storage once) after step 1 and the backward of step 2, i.e. with gradients and optimizer
state both alive.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

ENGINES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
MODEL = ["model.hidden_size=512", "model.intermediate_size=1376", "model.num_layers=8", "model.num_heads=8",
         "model.num_kv_heads=8", "data.seq_len=32", "train.micro_batch_size=1", "precision=bf16", "optim=adamw",
         "monitor=[]", "checkpoint.save_final=false"]
# The plan's own figures for these runs are asserted in tests/dist/test_plan.py; this prints the paper's.


def expected(engine: str, P: int, N: int) -> dict:
    return {"ddp": {"params": 2 * P, "grads": 2 * P, "optimizer": 12 * P},
            "zero1": {"params": 2 * P, "grads": 2 * P, "optimizer": 12 * P / N},
            "zero2": {"params": 2 * P, "grads": 2 * P / N, "optimizer": 12 * P / N},
            "zero3": {"params": 2 * P / N, "grads": 2 * P / N, "optimizer": 12 * P / N},
            "fsdp": {"params": 2 * P / N, "grads": 2 * P / N, "optimizer": 12 * P / N}}[engine]


def main() -> None:
    from shardyard.testing import run_measurements

    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--load", nargs="+", help="re-print from the per-world JSON files of an earlier run")
    a = ap.parse_args()
    table = {}
    if a.load:
        for path in a.load:
            res = json.loads(Path(path).read_text())
            table[res.pop("world")] = res
    for world in ([] if a.load else a.worlds):
        got = run_measurements(world, [[*MODEL, f"backend={e}"] for e in ENGINES])
        table[world] = {e: r for e, r in zip(ENGINES, got)}
        out = Path(tempfile.mktemp(suffix=".json", prefix=f"shardyard-memory-w{world}-"))
        out.write_text(json.dumps({"world": world, **table[world]}))
        print(f"raw results: {out}")
    P = table[a.worlds[0]]["ddp"]["P"]
    mib = 1 / 2 ** 20
    print(f"\nbench/memory.py: {P / 1e6:.1f}M parameters, bf16 mixed precision, AdamW; MiB per rank "
          "(measured / ZeRO-paper expectation)")
    print(f"{'engine':8} {'N':>2} | {'params':>17} | {'grads':>17} | {'optimizer':>17} | {'total':>17} | off by")
    for world, res in table.items():
        for engine in ENGINES:
            got, exp = res[engine], expected(engine, P, world)
            tot_g, tot_e = sum(got[k] for k in exp), sum(exp.values())
            cells = " | ".join(f"{got[k] * mib:7.1f} / {exp[k] * mib:7.1f}" for k in exp)
            print(f"{engine:8} {world:>2} | {cells} | {tot_g * mib:7.1f} / {tot_e * mib:7.1f} | {100 * (tot_g / tot_e - 1):+5.1f}%")
    if len(table) >= 2:
        w0, w1 = sorted(table)[:2]
        print(f"\nsharded categories, N={w0} -> N={w1} (each should halve when N doubles):")
        for engine in ENGINES:
            e0, e1 = expected(engine, P, w0), expected(engine, P, w1)
            sharded = [k for k in e0 if e0[k] != e1[k]]
            if not sharded:
                print(f"  {engine:6}: nothing sharded (a full replica per rank)")
                continue
            cells = ", ".join(f"{k} {table[w0][engine][k] * mib:.1f} -> {table[w1][engine][k] * mib:.1f} MiB "
                              f"(ratio {table[w1][engine][k] / table[w0][engine][k]:.3f})" for k in sharded)
            print(f"  {engine:6}: {cells}")

if __name__ == "__main__":
    main()
