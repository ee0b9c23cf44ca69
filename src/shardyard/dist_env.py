"""Who started this process? Maps every supported launcher onto RANK / WORLD_SIZE / LOCAL_RANK.

Supported: torch's elastic agent (our self-launch and ``torchrun``), ``deepspeed``, Slurm's ``srun``,
``horovodrun`` (gloo or MPI) and plain ``mpirun``. Import-light: no torch here.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    launcher: str
    """``elastic`` (torchrun / our launcher / deepspeed), ``slurm``, ``horovod`` or ``mpi``."""
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def _int(name: str, default: int = 0) -> int:
    v = os.environ.get(name)
    return int(v) if v else default


def detect() -> DistEnv | None:
    """The launcher that started this process as a worker, or None for a plain ``python train.py``."""
    # Horovod first: only horovodrun sets HOROVOD_*, while RANK/WORLD_SIZE may have been exported by us
    # (export_torch_env) for torch's env:// rendezvous in a worker of any launcher.
    if "HOROVOD_RANK" in os.environ:
        return DistEnv("horovod", _int("HOROVOD_RANK"), _int("HOROVOD_LOCAL_RANK", 0), _int("HOROVOD_SIZE"),
                       _int("HOROVOD_LOCAL_SIZE", _int("HOROVOD_SIZE")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return DistEnv("elastic", _int("RANK"), _int("LOCAL_RANK", 0), _int("WORLD_SIZE"),
                       _int("LOCAL_WORLD_SIZE", _int("WORLD_SIZE")))
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        return DistEnv("mpi", _int("OMPI_COMM_WORLD_RANK"), _int("OMPI_COMM_WORLD_LOCAL_RANK", 0),
                       _int("OMPI_COMM_WORLD_SIZE"), _int("OMPI_COMM_WORLD_LOCAL_SIZE", 1))
    # srun sets SLURM_STEP_NUM_TASKS for each task of a job step; a batch script alone does not.
    if "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:
        return DistEnv("slurm", _int("SLURM_PROCID"), _int("SLURM_LOCALID", 0), _int("SLURM_STEP_NUM_TASKS"),
                       _int("SLURM_STEP_TASKS_PER_NODE", 1) if os.environ.get("SLURM_STEP_TASKS_PER_NODE", "").isdigit() else 1)
    return None


def export_torch_env(env: DistEnv) -> None:
    """Set the variables ``torch.distributed``'s env:// rendezvous reads, for launchers that do not."""
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(env.local_world_size))
    if env.launcher == "slurm":
        os.environ.setdefault("MASTER_ADDR", _first_slurm_host())
        # One port per job step, so two steps of one allocation do not collide.
        os.environ.setdefault("MASTER_PORT", str(20000 + (_int("SLURM_JOB_ID", 0) + _int("SLURM_STEP_ID", 0)) % 20000))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def network_env(socket_ifname: str | None) -> None:
    """``launch.socket_ifname``: the interface gloo and NCCL open their connections on (a variable the user
    set themselves wins)."""
    if socket_ifname:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", socket_ifname)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", socket_ifname)


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        # Without scontrol: "node[01-04,07]" -> "node01"; "a,b" -> "a".
        m = re.match(r"([^\[,]+)(?:\[([^\],-]+))?", nodelist)
        return (m.group(1) + (m.group(2) or "")) if m else "127.0.0.1"


def run_dir_name() -> str:
    """A run-dir suffix every worker of one external launch agrees on (used by the ``sy_run_dir`` resolver)."""
    if os.environ.get("SLURM_JOB_ID") and "SLURM_STEP_NUM_TASKS" in os.environ:
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"torchrun-{run_id}"
    # torchrun without a run id, deepspeed, horovodrun: all local workers share the launcher as parent.
    return f"launch-{os.uname().nodename}-{os.getppid()}"
