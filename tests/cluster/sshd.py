"""An sshd inside each namespace host (``hosts.py``), for the launchers that log in to every host with ssh
(DeepSpeed's pdsh runner, ``horovodrun -H``): a throwaway host key and client key under a temp dir, root
login by that key only, listening only on the host's own address. ``bin/ssh`` is put first on PATH: the
system ssh with that key and without touching ``~/.ssh/known_hosts`` (the keys die with the test).

Each host's sshd sees an ``/etc/netns/<host>/hosts`` (``ip netns exec`` mounts it over /etc/hosts) in which
this machine's hostname is that host's own address, as a cluster node's name resolves to its address: the
processes it starts over ssh then advertise an address the other host can reach (the launchers and
Horovod's gloo fall back to the hostname; here it would otherwise resolve to 127.0.0.1)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD_CONF = """\
ListenAddress {addr}
Port 22
HostKey {d}/host_key
PidFile {d}/sshd-{i}.pid
AuthorizedKeysFile {d}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitUserEnvironment no
"""


def unavailable() -> str | None:
    missing = [b for b in ("sshd", "ssh", "ssh-keygen") if shutil.which(b, path="/usr/sbin:/usr/bin:/sbin:/bin") is None]
    if missing:
        return (f"no {', '.join(missing)} here: the ssh-based launchers need an sshd per host (make test installs "
                "openssh-server with apt-get as root)")
    return None


@dataclass
class Ssh:
    dir: Path
    path: str
    """PATH with the ``ssh`` shim first."""
    procs: list[subprocess.Popen]
    hosts: list[str]


def start(hosts, d: Path) -> Ssh:
    d.mkdir(parents=True, exist_ok=True)
    for key in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "id.pub", d / "authorized_keys")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    procs = []
    for name, addr in zip(hosts.names, hosts.addrs):
        Path(f"/etc/netns/{name}").mkdir(parents=True, exist_ok=True)
        Path(f"/etc/netns/{name}/hosts").write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
    for i, addr in enumerate(hosts.addrs):
        conf = d / f"sshd-{i}.conf"
        conf.write_text(SSHD_CONF.format(addr=addr, d=d, i=i))
        procs.append(hosts.popen(i, ["/usr/sbin/sshd", "-D", "-e", "-f", str(conf)], stdout=subprocess.DEVNULL,
                                 stderr=open(d / f"sshd-{i}.log", "w")))
    bin_dir = d / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "ssh"
    shim.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -i {d}/id -o UserKnownHostsFile=/dev/null "
                    "-o StrictHostKeyChecking=no -o LogLevel=ERROR -o BatchMode=yes \"$@\"\n")
    shim.chmod(0o755)
    ssh = Ssh(d, f"{bin_dir}:{os.environ['PATH']}", procs, list(hosts.names))
    deadline = time.monotonic() + 30
    for i, addr in enumerate(hosts.addrs):  # each host reaches the other's sshd
        while hosts.run(1 - i, [str(shim), addr, "true"], capture_output=True).returncode:
            if time.monotonic() > deadline:
                stop(ssh)
                raise RuntimeError(f"sshd on {addr} did not answer: {(d / f'sshd-{i}.log').read_text()[-2000:]}")
            time.sleep(0.2)
    return ssh


def stop(ssh: Ssh) -> None:
    for p in ssh.procs:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    for name in ssh.hosts:
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
