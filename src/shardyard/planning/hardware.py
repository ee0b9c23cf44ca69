"""The hardware a plan is for: ``plan.hardware`` by name (``8xH100-80GB``, ``2xcpu``) with ``plan.nodes``, or the
machine this process runs on; and what each rank's runtime holds there before any tensor.

A module of the ``planning`` package: it imports ``core`` and ``config`` (the layers below), and ``psutil``,
``nvidia-smi`` or torch only inside the functions that look at this machine.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from omegaconf import DictConfig

from shardyard.config.schema import Precision
from shardyard.core.errors import UserError
from shardyard.core.facts import GPUS, Plan, find_gpu, split_hardware

GiB = float(2 ** 30)

CPU_RUNTIME_BYTES = 0.45 * GiB
"""One CPU worker's own footprint before any tensor: Python, torch, transformers, numpy, the tokenizer and
gloo (VmRSS of a fresh worker measured at 0.38-0.45 GiB with torch 2.13 on x86-64 Linux)."""
CPU_ALLOCATOR_SLACK = 0.3
"""On CPU, what glibc's allocator keeps resident of the step's freed temporaries, as a fraction of the tensors' own
peak: the default run's resident high-water mark was 0.91 GiB for 0.45 of runtime and 0.34 of tensors at their
peak (the dry run's tracker, which agrees with the plan's 0.35 to 3%)."""
CUDA_RUNTIME_BYTES = 1.0 * GiB
"""Per GPU outside ``max_memory_allocated``: the CUDA context, cuBLAS/NCCL workspaces and the caching
allocator's slack. Counted when checking the fit, not in the allocated peak the gpu tier compares."""

NCCL_BASE_S = 8.4e-6
"""Fixed cost of one collective call, seconds: NCCL's own cost model (``src/graph/tuning.cc``, ``baseLat`` of the ring
algorithm with the Simple protocol, which large transfers use)."""
NCCL_NVLINK_STEP_S = 3.4e-6
"""Per ring step over NVLink, seconds (``tuning.cc``, ``hwLat[NVLINK][RING][SIMPLE]``)."""
NCCL_NET_STEP_S = 9.6e-6
"""Per ring step over the network, seconds (``tuning.cc``, ``hwLat[NET][RING][SIMPLE]``)."""


@dataclass(frozen=True)
class Hardware:
    """What each rank of a job has. On CPU the ranks of a node share its RAM (``device_bytes`` is None)."""

    name: str
    device: str
    ranks_per_node: int
    nodes: int
    device_bytes: float | None
    host_bytes: float
    """Host RAM of one node the job may use (available now on this machine; the table's figure for a named GPU)."""
    nvme_bytes: float | None
    peak_flops: float | None
    """Per rank, in the recipe's compute dtype; None when unknown (CPU)."""
    intra_bw: float
    """Bytes/s per rank per direction between the ranks of one node (NVLink; the table's ``intra_gbs``)."""
    inter_bw: float
    """Bytes/s per rank per direction between nodes (its NIC; the table's ``inter_gbs``)."""
    this_machine: bool
    memory_bw: float | None = None
    """Device memory bandwidth, bytes/s (the table's ``hbm_tbs``); None when unknown (CPU)."""
    host_link_bw: float = 32e9
    """Bytes/s per direction between a rank's device and host RAM (PCIe), which offload crosses."""
    source: str = ""
    """Where the figures come from (the GPU table's ``source``)."""

    matmul_efficiency: float | None = None
    """The part's own matmul efficiency (``facts.GPU.matmul_efficiency``); None: the step-time model's."""
    intra_latency: float = NCCL_NVLINK_STEP_S
    """Seconds per step of a ring inside a node (``NCCL_NVLINK_STEP_S``)."""
    inter_latency: float = NCCL_NET_STEP_S
    """Seconds per step of a ring that crosses nodes (``NCCL_NET_STEP_S``)."""

    @property
    def world(self) -> int:
        return self.ranks_per_node * self.nodes


def hardware(cfg: DictConfig, batch: Plan) -> Hardware:
    """``plan.hardware`` (``8xH100-80GB``, ``H100-80GB``, ``cpu``) with ``plan.nodes``, or this machine."""
    spec = cfg.plan.hardware
    if spec is None:
        return this_machine(cfg, batch)
    return named(spec, cfg.plan.nodes, cfg.precision.name, cfg.backend.get("nvme_path"))


def named(spec: str, nodes: int, precision: str = "bf16", nvme_path: str | None = None) -> Hardware:
    count, name = split_hardware(spec)
    if count < 1:
        raise UserError("plan.hardware", spec, f"It names {count} devices per node; a node has at least 1.",
                        "Use e.g. plan.hardware=8xH100-80GB (GPUs per node x GPU), or plan.hardware=2xcpu.")
    if nodes < 1:
        raise UserError("plan.nodes", nodes, "It is the number of nodes of plan.hardware, at least 1.",
                        "Use plan.nodes=1 or more.")
    if name.lower() == "cpu":
        import psutil

        mem = psutil.virtual_memory().total
        return Hardware(f"{count}x cpu", "cpu", count, nodes, None, mem, _nvme_free(nvme_path), None, 10e9, 10e9, False)
    gpu = find_gpu(name)
    if gpu is None:
        known = ", ".join(g.name for g in GPUS)
        raise UserError("plan.hardware", spec, f"It names no GPU the plan knows ({known}).",
                        "Use e.g. plan.hardware=8xH100-80GB (GPUs per node x GPU) with plan.nodes=N, or leave it "
                        "unset to plan for this machine.")
    flops = (gpu.fp32_tflops if Precision(precision) is Precision.fp32 else gpu.bf16_tflops) * 1e12
    return Hardware(f"{count}x{gpu.name}", "cuda", count, nodes, gpu.memory_gib * GiB, gpu.host_gib_per_gpu * count * GiB,
                    _nvme_free(nvme_path), flops, gpu.intra_gbs * 1e9, gpu.inter_gbs * 1e9, False,
                    gpu.hbm_tbs * 1e12 or None, gpu.pcie_gbs * 1e9, gpu.source, gpu.matmul_efficiency or None)


def this_machine(cfg: DictConfig, batch: Plan) -> Hardware:
    """The devices this process sees, without creating a CUDA context (a forked worker must not inherit one)."""
    import psutil

    nodes = max(1, batch.world_size // batch.nproc_per_node)  # under torchrun/srun: the launch's real nodes
    nvme = _nvme_free(cfg.backend.get("nvme_path"))
    host = psutil.virtual_memory().available
    if batch.device_type == "cuda":
        name, total = _gpu_name_and_memory()
        gpu = next((g for g in GPUS if name and g.name.split("-")[0] in name), None)
        fp32 = Precision(cfg.precision.name) is Precision.fp32
        flops = None if gpu is None else (gpu.fp32_tflops if fp32 else gpu.bf16_tflops) * 1e12
        intra, inter = (gpu.intra_gbs, gpu.inter_gbs) if gpu else (64.0, 12.5)
        return Hardware(f"{batch.nproc_per_node}x {name or 'GPU'} (this machine)", "cuda", batch.nproc_per_node, nodes,
                        total, host, nvme, flops, intra * 1e9, inter * 1e9, True,
                        gpu.hbm_tbs * 1e12 if gpu else None, gpu.pcie_gbs * 1e9 if gpu else 32e9, gpu.source if gpu else "",
                        (gpu.matmul_efficiency or None) if gpu else None)
    return Hardware(f"this machine ({os.cpu_count()} cores, {host / GiB:.1f} GiB RAM available)", "cpu",
                    batch.nproc_per_node, nodes, None, host, nvme, None, 10e9, 10e9, True)


def _gpu_name_and_memory() -> tuple[str | None, float | None]:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        rows = [line.rsplit(",", 1) for line in out if "," in line]
        return rows[0][0].strip(), min(float(r[1]) for r in rows) * 2 ** 20
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        import torch  # no nvidia-smi: ask torch (this creates a CUDA context in the parent)

        props = torch.cuda.get_device_properties(0)
        return props.name, float(props.total_memory)


def _nvme_free(path: str | None) -> float | None:
    if not path or not os.path.isdir(path):
        return None
    return float(shutil.disk_usage(path).free)
