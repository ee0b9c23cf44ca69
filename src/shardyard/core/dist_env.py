"""Who started this process? Maps every supported launcher onto RANK / WORLD_SIZE / LOCAL_RANK.

Supported: torch's elastic agent (our self-launch and ``torchrun``), ``deepspeed``, Slurm's ``srun`` (also
inside an ``sbatch`` script), Hydra's submitit launcher (its Slurm and local executors), ``horovodrun`` (gloo
or MPI) and plain ``mpirun``. Import-light: no torch here (submitit only inside a submitit job).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    launcher: str
    """``elastic`` (torchrun / our launcher / deepspeed), ``submitit``, ``slurm``, ``horovod`` or ``mpi``."""
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
        # deepspeed's launcher says LOCAL_SIZE where torch's says LOCAL_WORLD_SIZE.
        return DistEnv("elastic", _int("RANK"), _int("LOCAL_RANK", 0), _int("WORLD_SIZE"),
                       _int("LOCAL_WORLD_SIZE", _int("LOCAL_SIZE", _int("WORLD_SIZE"))))
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        return DistEnv("mpi", _int("OMPI_COMM_WORLD_RANK"), _int("OMPI_COMM_WORLD_LOCAL_RANK", 0),
                       _int("OMPI_COMM_WORLD_SIZE"), _int("OMPI_COMM_WORLD_LOCAL_SIZE", 1))
    # Hydra's submitit launcher: its local executor sets SUBMITIT_LOCAL_* and no SLURM_*, its Slurm executor
    # runs the tasks under srun; submitit's JobEnvironment reads either.
    if "SUBMITIT_EXECUTOR" in os.environ:
        import submitit

        job = submitit.JobEnvironment()
        return DistEnv("submitit", job.global_rank, job.local_rank, job.num_tasks,
                       max(1, job.num_tasks // max(1, job.num_nodes)))
    # srun sets SLURM_STEP_NUM_TASKS for each task of a job step; a batch script alone does not.
    if "SLURM_PROCID" in os.environ and "SLURM_STEP_NUM_TASKS" in os.environ:
        return DistEnv("slurm", _int("SLURM_PROCID"), _int("SLURM_LOCALID", 0), _int("SLURM_STEP_NUM_TASKS"),
                       slurm_tasks_on_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1"), _int("SLURM_NODEID")))
    return None


def slurm_tasks_on_node(tasks_per_node: str, node: int) -> int:
    """The task count of node ``node`` in Slurm's compressed list: ``"2(x3),1"`` -> 2, 2, 2, 1."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return 1
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if node < len(counts) else 1


def export_torch_env(env: DistEnv) -> None:
    """Set the variables ``torch.distributed``'s env:// rendezvous reads, for launchers that do not."""
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(env.local_world_size))
    if env.launcher == "submitit" and os.environ["SUBMITIT_EXECUTOR"] == "local":
        # All tasks on this machine; the controller's job id is its pid, shared by the tasks.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(20000 + _int("SUBMITIT_LOCAL_JOB_ID", 0) % 20000))
    elif env.launcher in ("slurm", "submitit") and "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = slurm_master_address()
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


DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple",
                     "HOROVOD_FUSION_THRESHOLD": "0"}
"""``train.deterministic``'s environment: cuBLAS reads its workspace setting when its first handle is made, NCCL
its algorithm and protocol when its first communicator is made, so they are set before any worker starts.
Horovod fuses the tensors ready within a cycle into one buffer, so what shares a ring step depends on timing:
without fusion every tensor is reduced on its own, in a fixed order."""
_SET_HERE: dict[str, str] = {}  # what deterministic_env set in this process (an in-process sweep's later jobs)


def deterministic_env(on: bool) -> None:
    """``train.deterministic``: DETERMINISTIC_ENV in this process, which every worker inherits (the elastic
    agent's, Horovod's runner's, or this very process's under an external launcher); a variable the user set
    themselves wins. Off, it takes back what an earlier job of this process (an in-process sweep) set."""
    for key, value in DETERMINISTIC_ENV.items():
        if on and key not in os.environ:
            os.environ[key] = _SET_HERE[key] = value
        elif not on and key in _SET_HERE and os.environ.get(key) == _SET_HERE.pop(key):
            del os.environ[key]


def slurm_master_address() -> str:
    """Where rank 0 listens: the first node of the step (or job), by name when the name resolves (the usual
    cluster), else by the address Slurm itself uses to reach that node (its ``NodeAddr``; one controller
    call, made only for names the resolver does not know)."""
    import socket

    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        first = out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        # Without scontrol: "node[01-04,07]" -> "node01"; "a,b" -> "a".
        m = re.match(r"([^\[,]+)(?:\[([^\],-]+))?", nodelist)
        return (m.group(1) + (m.group(2) or "")) if m else "127.0.0.1"
    try:
        socket.getaddrinfo(first, None)
        return first
    except OSError:
        pass
    try:
        out = subprocess.run(["scontrol", "-o", "show", "node", first], capture_output=True, text=True, check=True)
        addr = re.search(r"\bNodeAddr=(\S+)", out.stdout)
        return addr.group(1) if addr else first
    except (OSError, subprocess.CalledProcessError):
        return first


def run_dir_name() -> str:
    """A run-dir suffix every worker of one external launch agrees on (used by the ``sy_run_dir`` resolver)."""
    if os.environ.get("SLURM_JOB_ID") and "SLURM_STEP_NUM_TASKS" in os.environ:
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"
    if os.environ.get("SUBMITIT_LOCAL_JOB_ID"):
        return f"submitit-{os.environ['SUBMITIT_LOCAL_JOB_ID']}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"torchrun-{run_id}"
    # torchrun without a run id, deepspeed, horovodrun: all local workers share the launcher as parent.
    return f"launch-{os.uname().nodename}-{os.getppid()}"


def interface_address(ifname: str | None) -> str | None:
    """The IPv4 address of a network interface (Linux), or None for none named."""
    if not ifname:
        return None
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
    return socket.inet_ntoa(packed[20:24])
