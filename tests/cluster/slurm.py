"""A real Slurm on this machine: munged, one slurmctld and two slurmd (nodes ``synode1`` and ``synode2``,
both on this host at 127.0.0.1, told apart by their ports), from Debian's ``slurm-wlm`` and ``munge`` (the
setup script installs them where it can). Everything lives under a temp dir and is stopped at teardown.

Facts this relies on (measured; ``../shared/notes/cluster-on-one-machine.md``): ``SlurmdParameters=
config_overrides`` lets a node claim more CPUs than the host has; two ``slurmd -N`` on one host work when
each node has its own port; clients need ``SLURM_CONF``; without accounting ``sacct`` fails, so the job
records come from ``scontrol`` (and ``MinJobAge`` keeps finished jobs there long enough to read them)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from shardyard.launching.launch import free_port

NODES = ("synode1", "synode2")
CPUS = 2  # per node: two tasks per node on a 2-core host (config_overrides)


def unavailable() -> str | None:
    """Why a local Slurm cannot run here, or None."""
    missing = [b for b in ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "munged") if shutil.which(b) is None]
    if missing:
        return (f"no Slurm here ({', '.join(missing)} missing): the setup script installs Debian's slurm-wlm and "
                "munge as root with apt-get; install them to run this tier")
    if os.geteuid() != 0:
        return "a local Slurm (munged, slurmctld, slurmd as root) needs root"
    return None


CONF = """\
ClusterName=shardyard
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
{nodes}
PartitionName=debug Nodes={all_nodes} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    dir: Path
    conf: Path
    procs: list[subprocess.Popen]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), "PYTHONUNBUFFERED": "1"}

    def run(self, *cmd: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True, **kw)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_idle(self, timeout: float) -> None:
        """Until every node is idle (a killed job's steps have finished on them)."""
        deadline = time.monotonic() + timeout
        while self.run("sinfo", "-h", "-N", "-o", "%t").stdout.split() != ["idle"] * len(NODES):
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes not idle after {timeout} s: {self.run('sinfo', '-N').stdout}")
            time.sleep(0.3)

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not in {states} after {timeout} s: {info}")
            time.sleep(0.5)


def start(d: Path) -> Cluster:
    """munged (if none runs), slurmctld and one slurmd per node; returns when both nodes are idle."""
    host = socket.gethostname()
    (d / "state").mkdir(parents=True)
    (d / "spool").mkdir()
    nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={CPUS} RealMemory=8192 "
                      "State=UNKNOWN" for n in NODES)
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(host=host, ctld_port=free_port(), d=d, nodes=nodes, all_nodes=",".join(NODES)))
    procs = []
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode:
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"], check=True)
    cluster = Cluster(d, conf, procs)
    # -D: stay in the foreground, so the test owns the daemons and stops them.
    procs.append(subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], env=cluster.env,
                                  stdout=subprocess.DEVNULL, stderr=open(d / "slurmctld.err", "w")))
    for n in NODES:
        procs.append(subprocess.Popen(["slurmd", "-D", "-f", str(conf), "-N", n], env=cluster.env,
                                      stdout=subprocess.DEVNULL, stderr=open(d / f"slurmd-{n}.err", "w")))
    deadline = time.monotonic() + 60
    while True:
        out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
        if out.count("idle") == len(NODES):
            return cluster
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            stop(cluster)
            logs = "\n".join(f.read_text()[-1500:] for f in sorted(d.glob("*.log")) + sorted(d.glob("*.err")))
            raise RuntimeError(f"the local Slurm did not come up (sinfo: {out}):\n{logs}")
        time.sleep(0.3)


def stop(cluster: Cluster) -> None:
    """Cancel what still runs, stop the daemons (munged stays: it may be the machine's own)."""
    cluster.run("scancel", "--full", "-u", "root")
    for p in cluster.procs:
        p.send_signal(signal.SIGTERM)
    for p in cluster.procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
