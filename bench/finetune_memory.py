# python bench/finetune_memory.py [--world 2]          (CPU, gloo; ~2 min; prints, never asserts)
"""Memory per rank of LoRA (``peft=lora``) against full fine-tuning, per engine, measured beside the plan.

Measured as bench/memory.py measures (the tensors each rank really holds after one step and the backward of
the next: parameters, gradients, optimizer state with master weights), next to the plan's figures for the
same run (``plan.memory``: what ``python train.py ... plan.only=true`` prints). bf16 mixed precision, AdamW,
a 512-wide 8-layer DeepSeek-LLM-architecture model, LoRA r=16 on every projection.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

ENGINES = ["ddp", "fsdp", "zero2", "zero3"]
MODEL = ["model.hidden_size=512", "model.intermediate_size=1376", "model.num_layers=8", "model.num_heads=8",
         "model.num_kv_heads=8", "data.seq_len=32", "train.micro_batch_size=1", "precision=bf16", "optim=adamw",
         "monitor=[]", "checkpoint.save_final=false"]


def main() -> None:
    from shardyard.testing import run_measurements

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    jobs = [(e, peft) for e in ENGINES for peft in ("none", "lora")]
    got = run_measurements(a.world, [[*MODEL, f"backend={e}", f"peft={p}"] for e, p in jobs])
    res = dict(zip(jobs, got))
    mib = 1 / 2 ** 20
    P = got[0]["P"]
    print(f"\nbench/finetune_memory.py: {P / 1e6:.1f}M parameters, {got[1]['trainable'] / 1e6:.2f}M trainable with "
          f"LoRA r=16, bf16, AdamW, world {a.world}; MiB per rank, measured / planned")
    print(f"{'engine':6} {'peft':5} | {'params':>15} | {'grads':>15} | {'optimizer':>15} | {'total':>15} | LoRA/full")
    for e in ENGINES:
        totals = {}
        for peft in ("none", "lora"):
            r = res[(e, peft)]
            dev = r["plan"]["device"]
            planned = {"params": dev.get("params", 0), "grads": dev.get("grads", 0),
                       "optimizer": dev.get("optimizer", 0) + dev.get("master", 0)}
            cells = " | ".join(f"{r[k] * mib:6.1f} / {planned[k] * mib:6.1f}" for k in planned)
            tot, tot_p = sum(r[k] for k in planned), sum(planned.values())
            totals[peft] = tot
            ratio = f"{totals['lora'] / totals['none']:.2f}" if peft == "lora" else ""
            print(f"{e:6} {peft:5} | {cells} | {tot * mib:6.1f} / {tot_p * mib:6.1f} | {ratio}")


if __name__ == "__main__":
    main()
