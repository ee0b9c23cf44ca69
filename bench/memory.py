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
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

ENGINES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
MODEL = ["model.hidden_size=512", "model.intermediate_size=1376", "model.num_layers=8", "model.num_heads=8",
         "model.num_kv_heads=8", "data.seq_len=32", "train.micro_batch_size=1", "precision=bf16", "optim=adamw",
         "monitor=[]", "checkpoint.save_final=false"]


def expected(engine: str, P: int, N: int) -> dict:
    return {"ddp": {"params": 2 * P, "grads": 2 * P, "optimizer": 12 * P},
            "zero1": {"params": 2 * P, "grads": 2 * P, "optimizer": 12 * P / N},
            "zero2": {"params": 2 * P, "grads": 2 * P / N, "optimizer": 12 * P / N},
            "zero3": {"params": 2 * P / N, "grads": 2 * P / N, "optimizer": 12 * P / N},
            "fsdp": {"params": 2 * P / N, "grads": 2 * P / N, "optimizer": 12 * P / N}}[engine]


def _rank(rank: int, world: int, ports: list[int], out: str) -> None:
    import torch

    from shardyard import data
    from shardyard.config.validate import validate
    from shardyard.dist_env import detect
    from shardyard.memory import held_by
    from shardyard.model import build_model, param_count
    from shardyard.testing import compose

    import hydra.utils

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    results = {}
    for port, engine in zip(ports, ENGINES):
        os.environ["MASTER_PORT"] = str(port)
        cfg = compose([*MODEL, f"backend={engine}", "train.steps=2"], run_dir=tempfile.mkdtemp(prefix="bench-mem-"))
        plan = validate(cfg, detect())
        backend = hydra.utils.get_object(cfg.backend._target_)(cfg, plan)
        backend.init()
        built = {}

        def build(allow_meta):
            built["m"] = build_model(cfg.model, cfg.seed)
            built["P"] = param_count(built["m"])
            return built["m"]

        backend.prepare(build, 2)
        prep = data.prepare(cfg)
        stream = data.TrainStream(data.PackedSequences(f"{prep.token_dir}/train.npy", cfg.data.seq_len), 0,
                                  plan.global_batch_size, plan.micro_batch_size, rank, world)
        x, y = stream.micro_batch(0, 0)
        backend.forward_backward(x, y, True)
        backend.step()
        x, y = stream.micro_batch(1, 0)
        backend.forward_backward(x, y, True)  # gradients of step 2 alive, optimizer state from step 1
        # What the engine's optimizer object is: DeepSpeed's ZeRO optimizer, or the torch one of the stepper.
        optimizer = backend.engine.optimizer if hasattr(backend, "engine") else backend.stepper.optimizer
        results[engine] = {"P": built["P"], **held_by(backend.hf_model(), optimizer)}
        backend.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, **results}))


def main() -> None:
    import torch.multiprocessing as mp

    from shardyard.launch import free_port

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
        out = tempfile.mktemp(suffix=".json", prefix=f"shardyard-memory-w{world}-")
        mp.start_processes(_rank, args=(world, [free_port() for _ in ENGINES], out), nprocs=world, start_method="spawn")
        table[world] = json.loads(Path(out).read_text())
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
