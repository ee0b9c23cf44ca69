# python bench/overhead.py [--steps 40] [--world 2]        (CPU, gloo; prints, never asserts)
"""Our training loop vs a plain hand-written PyTorch DDP loop: same model, data, optimizer, 2 ranks, fp32.

Both loops run inside the same 2 processes, alternating (plain, ours, plain, ours), so machine noise hits
both alike. Each step is timed wall-clock from its start to the end of its logging; evaluation is excluded
from both. Reports the median step time of each and their ratio (target: ours/plain <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

OVERRIDES = ["backend=ddp", "train.micro_batch_size=8", "train.eval_every_n_steps=0", "train.eval_batches=1",
             "train.sample_tokens=0", "checkpoint.save_final=false", "monitor=[console]", "monitor.console.style=plain"]


def plain_ddp_loop(cfg, steps: int) -> list[float]:
    """What a user would write by hand: DDP + AdamW + LambdaLR + clip, no framework."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shardyard.data import pipeline as data
    from shardyard.models.build import build_model
    from shardyard.backends.optim import build_scheduler, param_groups

    rank, world = dist.get_rank(), dist.get_world_size()
    prep = data.prepare(cfg)
    seqs = data.open_split(prep, "train", cfg.data.seq_len)
    mb = cfg.train.micro_batch_size
    model = DDP(build_model(cfg.model, cfg.seed), gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas))
    sched = build_scheduler(opt, cfg.sched, steps)
    perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        start = step * mb * world + rank * mb
        x, y = seqs.get(perm[start:start + mb])
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % cfg.train.log_every_n_steps == 0:  # a hand-written loop logs too
            t = loss.detach().clone()
            dist.all_reduce(t)
            if rank == 0:
                print(f"plain step {step + 1}: loss {t.item() / world:.4f}", flush=True)
        times.append(time.perf_counter() - t0)
    return times


def _rank(rank: int, world: int, port: int, steps: int, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from shardyard.training import worker
    from shardyard.planning.validate import validate
    from shardyard.core.dist_env import detect
    from shardyard.testing import compose

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = compose([*OVERRIDES, f"train.steps={steps}"], run_dir=tempfile.mkdtemp(prefix="bench-ours-"))
    plan = validate(cfg, detect())
    res = {"plain": [], "ours": []}
    for r in range(rounds):
        # A fresh store port per process group: the previous one may still be closing.
        os.environ["MASTER_PORT"] = str(port + 2 * r)
        dist.init_process_group("gloo")
        res["plain"] += plain_ddp_loop(cfg, steps)[5:]  # skip warm-up steps
        dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(port + 2 * r + 1)
        res["ours"] += worker.main(cfg, plan)["step_wall_s"][5:]  # inits and destroys its own process group
    if rank == 0:
        Path(out).write_text(json.dumps(res))


def main() -> None:
    import statistics

    import torch.multiprocessing as mp

    from shardyard.launching.launch import free_port

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(_rank, args=(a.world, free_port(), a.steps, a.rounds, out), nprocs=a.world, start_method="spawn")
    res = json.loads(Path(out).read_text())
    plain, ours = statistics.median(res["plain"]), statistics.median(res["ours"])
    print(f"\nbench/overhead.py: deepseek_tiny, micro 8 x seq 128, world {a.world} (gloo, CPU), fp32, "
          f"{a.rounds} x {a.steps} steps each, alternating")
    print(f"  plain hand-written DDP loop: median step {plain * 1e3:8.1f} ms")
    print(f"  shardyard loop (DDPBackend): median step {ours * 1e3:8.1f} ms")
    print(f"  ratio ours/plain: {ours / plain:.3f}   (target <= 1.05)")


if __name__ == "__main__":
    main()
