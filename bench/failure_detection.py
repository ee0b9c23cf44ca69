# python bench/failure_detection.py [--timeout-s 20]
#   How soon a job ends after it loses a worker or a node. This is where that latency is measured: printed
#   here, never asserted in a test. The tests (tests/e2e/test_fault_tolerance.py, tests/cluster/test_multinode.py)
#   check that the job ends, exits non-zero and names what it lost, behind a hang guard of 600 s only.
#   1. one host, 2 ranks (ddp): kill -9 one worker; seconds until `python train.py` exits.
#   2. two namespace hosts (root and iproute2 only; tests/cluster/hosts.py), 1 rank each: node 1 killed
#      (kill -9 of everything in it) or unplugged (its link down); seconds until node 0 exits, against
#      launch.timeout_s. The target: a kill within seconds, an unplugged node within launch.timeout_s + 30 s.
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "cluster")]
from shardyard.testing import TINY  # noqa: E402

RUN = [*TINY, "train.steps=2000", "train.eval_every_n_steps=0", "train.global_batch_size=8", "backend=ddp",
       "train.log_every_n_steps=1"]


def wait_for_step(log: Path, proc: subprocess.Popen, step: int = 10) -> None:
    deadline = time.monotonic() + 300
    while not re.search(rf"step +{step}/", log.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the job did not reach step {step}: {log.read_text()[-2000:]}")
        time.sleep(0.1)


def one_host(tmp: Path, timeout_s: int) -> float:
    import psutil

    log = tmp / "one_host.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "train.py", f"hydra.run.dir={tmp / 'one'}", *RUN,
                                 "launch.nproc_per_node=2", f"launch.timeout_s={timeout_s}"], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_for_step(log, proc)
    parent = psutil.Process(proc.pid)
    workers = [c for c in parent.children(recursive=True) if "shardyard.training.worker" in " ".join(c.cmdline())
               or c.cmdline() == parent.cmdline()]
    t = time.monotonic()
    workers[-1].send_signal(signal.SIGKILL)
    try:
        code = proc.wait(timeout=timeout_s + 120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        sys.exit("one host: the job was still running 120 s after the collective timeout")
    took = time.monotonic() - t
    print(f"1. one host, 2 ranks, a worker killed: the job exited {code} after {took:.1f} s "
          f"(launch.timeout_s={timeout_s}; the target: within seconds)", flush=True)
    return took


def two_hosts(tmp: Path, timeout_s: int, how: str) -> None:
    import hosts as nshosts

    h = nshosts.make(2)
    try:
        cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp / how}", *RUN, "launch.nnodes=2",
               "launch.nproc_per_node=1", f"launch.rdzv_endpoint={h.addrs[0]}:29476",
               f"launch.socket_ifname={h.ifname}", f"launch.timeout_s={timeout_s}"]
        logs = [tmp / f"{how}-node{i}.log" for i in range(2)]
        procs = []
        for i in range(2):
            with open(logs[i], "w") as out:
                procs.append(h.popen(i, [*cmd, f"launch.node_rank={i}"], cwd=ROOT, stdout=out,
                                     stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        try:
            wait_for_step(logs[0], procs[0])
            t = time.monotonic()
            if how == "kill":
                pids = subprocess.run(["ip", "netns", "pids", h.names[1]], capture_output=True, text=True).stdout
                for pid in pids.split():
                    os.kill(int(pid), signal.SIGKILL)
            else:
                h.link(1, up=False)
            code = procs[0].wait(timeout=timeout_s + 120)
            took = time.monotonic() - t
        finally:
            h.link(1, up=True)
            for p in procs:
                p.kill()
        what = "killed" if how == "kill" else "unplugged"
        print(f"2. two hosts, node 1 {what}: node 0 exited {code} after {took:.1f} s; launch.timeout_s={timeout_s}, "
              f"ratio {took / timeout_s:.2f} (target: within launch.timeout_s + 30 s)", flush=True)
    finally:
        nshosts.teardown(h.names)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout-s", type=int, default=20, help="launch.timeout_s of the runs (default 20)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        one_host(tmp, args.timeout_s)
        import hosts as nshosts

        why = nshosts.unavailable()
        if why:
            print(f"2. two hosts: not measured here ({why})")
            return
        for how in ("kill", "cable"):
            two_hosts(tmp, args.timeout_s, how)


if __name__ == "__main__":
    main()
