# python bench/gloo_groups.py [--worlds 4 8 16]        (CPU; prints, never asserts)
"""The host's gloo beside an accelerator's library (issue 41): what every group serving CPU tensors costs a rank.

On a GPU, ``process_group.init_process_group`` creates ``cuda:nccl,cpu:gloo`` groups, and gloo connects to a
peer on first use there (``TORCH_GLOO_LAZY_INIT``). Here each of ``W`` ranks plays that run on this CPU
(``shardyard.testing.accelerator_groups``: the same string, gloo for both device types), builds the expert-parallel
FSDP mesh (W/2 x 2: the world, two sub-group dimensions and their flattening) and all-reduces a CPU scalar on every
group, as the offloaded gradient norm does. Reports the socket descriptors a rank holds (rank 1: rank 0 also
serves the rendezvous store, one socket per rank either way) and the seconds from start to the last all-reduce,
eager (TORCH_GLOO_LAZY_INIT=0) and lazy (the default we set), and their ratios."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return n


def rank_main(rank: int, world: int, port: int, lazy: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh

    from shardyard.backends.process_group import init_process_group
    from shardyard.testing import accelerator_groups

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCH_GLOO_LAZY_INIT=lazy)
    cfg = OmegaConf.create({"launch": {"timeout_s": 600, "nnodes": 1, "rdzv_endpoint": None}})
    t0 = time.perf_counter()
    with accelerator_groups("cuda"):
        init_process_group(cfg, torch.device("cuda", rank))
        mesh = init_device_mesh("cuda", (world // 2, 2), mesh_dim_names=("edp", "ep"))
        groups = [dist.group.WORLD, mesh["edp"].get_group(), mesh["ep"].get_group(),
                  mesh["edp", "ep"]._flatten("dp").get_group()]
    for group in groups:
        t = torch.ones(())
        dist.all_reduce(t, group=group)
    seconds = time.perf_counter() - t0
    if rank == 1:
        with open(out, "w") as f:
            f.write(f"{sockets()} {seconds}")
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, lazy: str) -> tuple[int, float]:
    import tempfile

    import torch.multiprocessing as mp

    from shardyard.launching.launch import free_port

    out = tempfile.mktemp(prefix="gloo-groups-")
    mp.spawn(rank_main, args=(world, free_port(), lazy, out), nprocs=world)
    with open(out) as f:
        n, s = f.read().split()
    os.remove(out)
    return int(n), float(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    args = ap.parse_args()
    print(f"{'world':>5} {'sockets eager':>13} {'lazy':>5} {'lazy/eager':>10} {'s eager':>8} {'s lazy':>7} "
          f"{'lazy/eager':>10}")
    for world in args.worlds:
        (se, te), (sl, tl) = run(world, "0"), run(world, "1")
        print(f"{world:>5} {se:>13} {sl:>5} {sl / se:>10.2f} {te:>8.2f} {tl:>7.2f} {tl / te:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
