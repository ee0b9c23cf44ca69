"""Starting workers: torch's elastic agent (single/ddp/fsdp/zero*) or an engine's own runner.

A backend names its launcher with the class attribute ``launcher``; ``for_backend`` maps that name to one
of the functions here, so run.py never branches on the engine.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from typing import Any, Callable

import hydra.utils
from omegaconf import DictConfig

from shardyard.config.validate import Plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> None:
    """A world of one, trained in this process: the env:// rendezvous variables of rank 0 of 1."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def elastic(run_dir: str, plan: Plan, launch_cfg: DictConfig) -> None:
    """``torchrun --standalone`` in-process: torch's elastic agent starts, watches and restarts workers."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = launch_cfg.master_port or free_port()
    # On CPU the workers fork from this process, which has imported torch and transformers already (about 5 s
    # per worker saved, the bulk of a short job's start-up). A CUDA context must never exist before a fork,
    # so GPU workers start as fresh interpreters (this process never initialises CUDA either way).
    fork = plan.device_type == "cpu"
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=plan.nproc_per_node,
        # One node and a fixed membership: the static rendezvous (rank 0 of 1 agent) skips the c10d backend's
        # join rounds (about half a second per start); restarts work the same.
        run_id=f"shardyard-{uuid.uuid4().hex[:8]}", rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"timeout": launch_cfg.timeout_s, "rank": 0}, max_restarts=launch_cfg.max_restarts,
        monitor_interval=0.2, start_method="fork" if fork else "spawn",
    )
    if plan.device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # N workers on a CPU box share its cores; oversubscribed intra-op threads make every step slower.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // plan.nproc_per_node))
    # A failed worker has printed its own error (a user error's paragraph, or its traceback), and we name the
    # rank and exit code below; the agent's own report of it (with a traceback of its process join) is noise.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_without_child_failure_reports)
    env_keep = {k: v for k, v in os.environ.items() if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    assert not env_keep, f"parent must not look like a worker: {env_keep}"
    try:
        if fork:
            from shardyard.worker import from_run_dir

            elastic_launch(config, from_run_dir)(run_dir)
        else:
            elastic_launch(config, sys.executable)("-m", "shardyard.worker", run_dir)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        # Ranks the agent terminated after the first failure show a negative (signal) code; blame and
        # exit with the ranks that really failed (exit 2 stays 2: a user error such as a bad resume path).
        real = {r: c for r, c in codes.items() if c > 0} or codes
        first = min(real)
        print(f"shardyard: worker rank {first} failed with exit code {real[first]} "
              f"(failed ranks and codes: {codes}); its output is above. Run dir: {run_dir}", file=sys.stderr, flush=True)
        sys.exit(2 if set(real.values()) == {2} else 1)


def _without_child_failure_reports(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("failed (exitcode")


def horovod(run_dir: str, plan: Plan, launch_cfg: DictConfig) -> None:
    """``horovodrun -np N --gloo``: Horovod's own runner starts and watches the workers."""
    import subprocess

    n = plan.nproc_per_node
    runner = [sys.executable, "-c", "import sys; from horovod.runner.launch import run_commandline; "
              "sys.argv[0] = 'horovodrun'; run_commandline()"]
    cmd = [*runner, "-np", str(n), "-H", f"localhost:{n}", "--gloo", "--gloo-timeout-seconds",
           str(launch_cfg.timeout_s), sys.executable, "-m", "shardyard.worker", run_dir]
    env = dict(os.environ)
    if plan.device_type == "cpu" and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    code = subprocess.call(cmd, env=env)
    if code:
        print(f"shardyard: horovodrun exited with code {code} (a worker failed; its output is above). "
              f"Run dir: {run_dir}", file=sys.stderr, flush=True)
        sys.exit(2 if code == 2 else 1)


LAUNCHERS: dict[str, Callable[[str, Plan, DictConfig], None]] = {"elastic": elastic, "horovod": horovod}


def for_backend(backend_cfg: DictConfig) -> Callable[[str, Plan, DictConfig], None]:
    backend: Any = hydra.utils.get_object(backend_cfg._target_)  # a Backend class
    return LAUNCHERS[backend.launcher]
