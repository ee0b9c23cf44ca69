"""Nodes as Linux network namespaces: each "host" is a namespace with its own interface (``eth0``) and
address on a veth pair this module creates, and tears down. Addresses are used only inside these namespaces.
The file system is shared, as a cluster's shared file system is."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

SUBNET = "10.231.7"  # 10.231.7.1 and .2: only ever inside the two namespaces made here


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install iproute2)"
    probe = f"sy-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Hosts:
    names: list[str]
    addrs: list[str]
    ifname: str = "eth0"
    procs: list[subprocess.Popen] = field(default_factory=list)

    def popen(self, i: int, cmd: list[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` on host ``i`` (in its namespace)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd], **kw)
        self.procs.append(p)
        return p

    def run(self, i: int, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.names[i], *cmd], **kw)

    def link(self, i: int, up: bool) -> None:
        """Pull (or plug back) host ``i``'s network cable."""
        self.run(i, ["ip", "link", "set", self.ifname, "up" if up else "down"], check=True)


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def make(n: int = 2) -> Hosts:
    """``n`` = 2 hosts joined by one veth pair (a point-to-point link, like two nodes on one switch port)."""
    assert n == 2, "one veth pair joins two hosts"
    tag = f"{os.getpid() % 100000}"
    names = [f"sy-h{i}-{tag}" for i in range(n)]
    addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]
    ends = [f"syv{i}-{tag}" for i in range(n)]  # at most 15 characters
    teardown(names)
    for name in names:
        _sh("ip", "netns", "add", name)
    _sh("ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
    for name, end, addr in zip(names, ends, addrs):
        _sh("ip", "link", "set", end, "netns", name)
        _sh("ip", "-n", name, "link", "set", end, "name", "eth0")
        _sh("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
        _sh("ip", "-n", name, "link", "set", "eth0", "up")
        _sh("ip", "-n", name, "link", "set", "lo", "up")
    return Hosts(names, addrs)


def teardown(names: list[str]) -> None:
    """Kill what still runs in the namespaces, then delete them (their veth ends go with them)."""
    for name in names:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
