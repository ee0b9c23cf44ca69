"""Process groups for the torch-native engines (and DeepSpeed, which adopts ours): create, average, tear down."""

from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist
from omegaconf import DictConfig


ACCELERATOR_BACKENDS = {"cuda": "nccl"}
"""The collective library of each accelerator's own tensors (``backend.dist_backend=auto``)."""


def backend_string(device: torch.device, dist_backend: str = "auto") -> str:
    """The process group's backend for each device type its collectives meet (``init_process_group``'s string).

    1. A CPU run: ``cpu:gloo``, CPU tensors only.
    2. An accelerator: its own library for its tensors, and gloo for the host's: FSDP2's CPU offload keeps the
       gradient shards in host memory, so the gradient norm and the fp16 found-inf flags are all-reduced there
       (NCCL alone refuses them: "No backend type associated with device type cpu"). torchtitan and torchtune
       create ``cuda:nccl,cpu:gloo`` too. Every group made from it (``new_group``, a DeviceMesh's sub-groups,
       split or not) inherits both.
    """
    if device.type == "cpu":
        return "cpu:gloo"  # 1
    own = ACCELERATOR_BACKENDS[device.type] if dist_backend == "auto" else dist_backend
    return f"{device.type}:{own},cpu:gloo"  # 2


def init_process_group(cfg: DictConfig, device: torch.device, dist_backend: str = "auto") -> None:
    """env:// rendezvous (set by the elastic agent, torchrun, srun mapping, ...) with the recipe's timeout; one
    group for every device this run's collectives meet (``backend_string``)."""
    if dist.is_initialized():
        return
    if device.type != "cpu":
        # The host's gloo connects to a peer on first use: eagerly, each gloo group (the world's, every mesh
        # sub-group's) would open a socket to each of its members at start, descriptors per rank growing with
        # the world, for collectives that mostly talk to ring neighbours (measured: bench/gloo_groups.py). A
        # user's own TORCH_GLOO_LAZY_INIT stays.
        os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    timeout = datetime.timedelta(seconds=cfg.launch.timeout_s)
    store: dict = {}
    attempt = _attempt(cfg, timeout)
    if attempt is not None:
        # The elastic agent's store lives for the whole job, and workers use it without a per-attempt
        # prefix: after a restart, gloo would read the dead workers' addresses and fail to connect.
        # Each attempt therefore gets its own namespace.
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        store = dict(store=dist.PrefixStore(f"shardyard/attempt-{attempt}", agent),
                     rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend_string(device, dist_backend), timeout=timeout,
                            device_id=device if device.type == "cuda" else None, **store)


def _attempt(cfg: DictConfig, timeout: datetime.timedelta) -> str | None:
    """A name for this start of the workers that every worker of the job agrees on (None: not under an
    elastic agent that shares its store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    return f"attempt-{elastic_start(cfg, timeout)}"


def elastic_start(cfg: DictConfig, timeout: datetime.timedelta | None = None) -> int:
    """How many times the workers of this job have been started before this start, the same number on
    every node (0 outside an elastic agent).

    1. One node: the agent's restart count.
    2. Several nodes (our c10d launch): not the restart count, which each node's agent keeps for itself: a
       failed node's agent counts its restart, the others restart for the new round without counting it.
       Every worker reads the rendezvous round instead, from the rendezvous state at launch.rdzv_endpoint
       (torch's c10d backend keeps it there, pickled, under ``torch.rendezvous.<run id>``).
    """
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if cfg.launch.nnodes == 1 or not cfg.launch.rdzv_endpoint or "TORCHELASTIC_RUN_ID" not in os.environ:
        return count  # 1
    import base64

    from shardyard.core.safe_load import exact_loads, rendezvous_globals

    host, port = cfg.launch.rdzv_endpoint.rsplit(":", 1)  # 2
    rdzv = dist.TCPStore(host, int(port), is_master=False,
                         timeout=timeout or datetime.timedelta(seconds=cfg.launch.timeout_s))
    state = exact_loads(base64.b64decode(rdzv.get("torch.rendezvous." + os.environ["TORCHELASTIC_RUN_ID"])),
                        rendezvous_globals())  # the state's classes only: the store is reachable on the network
    return int(state.round)


def teardown(backend, *attrs: str, destroy=None) -> None:
    """Free an engine's wrapped model/optimizer while the process group is alive, then destroy the group.

    DDP's Reducer (and FSDP's mesh, DeepSpeed's engine) hold the last reference to the gloo group. Freed
    after ``destroy_process_group``, its destructor joins gloo's worker thread while holding the GIL, and
    that thread is waiting for the GIL to drop a tensor: a deadlock at exit or between two in-process runs.
    A failed run (``worker.main`` sets ``backend.run_failed``) skips the barrier: the other ranks are in another
    collective, or gone, and a rank that raised would wait there for them until the group's timeout instead of
    ending the job.
    """
    for name in attrs:
        backend.__dict__.pop(name, None)
    gc.collect()
    if dist.is_initialized():
        if not getattr(backend, "run_failed", False):
            dist.barrier()  # queued collectives are finished (and their work objects gone) before teardown
        (destroy or dist.destroy_process_group)()
    _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches its redistribution plans by device mesh *equality* and keeps the mesh alive in them
    (torch 2.13: ``_redistribute._planner_cache``, ``_gen_transform_infos``, the sharding propagator's Python and
    C++ caches, ``MeshTopoInfo``). A later
    run in this process (in-process sweeps, the test pools) whose mesh has the same layout got the destroyed
    run's mesh back, and its collectives named process groups that no longer exist ("Could not resolve the
    process group registered under the name 4": FSDP with experts on an (edp, ep) mesh, then a pipeline)."""
    from torch.distributed.tensor import _collective_utils, _redistribute, debug

    _redistribute.clear_redistribute_planner_cache()
    getattr(_redistribute._gen_transform_infos, "cache_clear", lambda: None)()
    debug._clear_sharding_prop_cache()  # the Python propagator's and the C++ fast path's
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """``Backend.all_reduce_mean`` of the engines on this process group (a ``staticmethod`` in each)."""
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # gloo has no AVG
    return t / dist.get_world_size()


def barrier() -> None:
    """``Backend.barrier`` of the engines on this process group."""
    dist.barrier()
