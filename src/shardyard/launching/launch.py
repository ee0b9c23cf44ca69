"""Starting workers: torch's elastic agent (single/ddp/fsdp/zero*) or an engine's own runner.

A backend names its launcher with the class attribute ``launcher``; ``for_backend`` maps that name to one
of the functions here, so run.py never branches on the engine.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import uuid
from typing import Any, Callable, NoReturn

import hydra.utils
from omegaconf import DictConfig

from shardyard.core.dist_env import interface_address
from shardyard.core.facts import Plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def single_process_env() -> None:
    """A world of one, trained in this process: the env:// rendezvous variables of rank 0 of 1."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def rendezvous(run_dir: str, launch_cfg: DictConfig) -> dict[str, Any]:
    """How the elastic agents of a run meet: ``LaunchConfig`` arguments.

    1. One node: a fixed membership, so the static rendezvous (rank 0 of 1 agent) skips the c10d backend's
       join rounds (about half a second per start); restarts work the same.
    2. Several nodes: torch's c10d rendezvous, hosted by node 0 at ``launch.rdzv_endpoint``. Every node's
       agent joins it, and joins again when any node's workers fail, so with ``max_restarts`` all nodes
       restart together. The run id comes from the run dir, which every node shares, so two runs on one
       endpoint never meet by mistake. Each node announces the address of ``launch.socket_ifname``, which is
       how the others reach it (the hostname may resolve to a loopback or a management address).
    """
    if launch_cfg.nnodes == 1:  # 1
        port = launch_cfg.master_port or free_port()
        return dict(min_nodes=1, max_nodes=1, run_id=f"shardyard-{uuid.uuid4().hex[:8]}", rdzv_backend="static",
                    rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"timeout": launch_cfg.timeout_s, "rank": 0})
    n = launch_cfg.nnodes  # 2
    run_id = "shardyard-" + hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]
    return dict(min_nodes=n, max_nodes=n, run_id=run_id, rdzv_backend="c10d", rdzv_endpoint=launch_cfg.rdzv_endpoint,
                rdzv_configs={"join_timeout": launch_cfg.timeout_s, "is_host": launch_cfg.node_rank == 0},
                local_addr=interface_address(launch_cfg.socket_ifname))


def elastic(run_dir: str, plan: Plan, cfg: DictConfig) -> None:
    """``torchrun`` in-process: torch's elastic agent starts, watches and restarts this node's workers."""
    launch_cfg = cfg.launch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from shardyard.core.errors import EXIT_REQUEUE
    from shardyard.training.loop import PREEMPTION_SIGNALS

    # On CPU the workers fork from this process, which has imported torch and transformers already (about 5 s
    # per worker saved, the bulk of a short job's start-up). A CUDA context must never exist before a fork,
    # so GPU workers start as fresh interpreters (this process never initialises CUDA either way). Nor do
    # multi-node workers fork: forked from an agent that holds the c10d rendezvous connections, their first
    # gloo collective across hosts never completed (seen with torch 2.13 on two namespace hosts).
    fork = plan.device_type == "cpu" and launch_cfg.nnodes == 1
    # A preemption signal (SIGTERM, SIGUSR1) to this process: the agent passes it on to every worker, which
    # save at their next step boundary and exit 75, and waits up to launch.timeout_s for them before it kills
    # them (its default, 30 s, is too short for a large save). Without SIGUSR1 in its list, that signal would
    # end this process at once (its default action) and leave the workers running.
    preemption = ",".join(sig.name for sig in PREEMPTION_SIGNALS)
    config = LaunchConfig(nproc_per_node=plan.nproc_per_node, **rendezvous(run_dir, launch_cfg),
                          max_restarts=launch_cfg.max_restarts, monitor_interval=0.2,
                          start_method="fork" if fork else "spawn",
                          signals_to_handle=f"{preemption},SIGINT,SIGHUP,SIGQUIT",
                          shutdown_timeout=int(launch_cfg.timeout_s))
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
            import gc

            from shardyard.training.worker import from_run_dir

            # The heap the workers inherit (torch, transformers, the config) is theirs for good: frozen, their
            # collections skip it (an engine's teardown collects, ~0.6 s over it on 2 cores; a full collection
            # during training as long) and do not write to its pages, which stay shared with this process. Collected
            # first: a process that launches job after job (a sweep's basic launcher) never freezes a job's garbage.
            gc.collect()
            gc.freeze()
            elastic_launch(config, from_run_dir)(run_dir)
        else:
            elastic_launch(config, sys.executable)("-m", "shardyard.training.worker", run_dir)
    except RendezvousError as e:
        print(f"shardyard: node {launch_cfg.node_rank} of {launch_cfg.nnodes}: the rendezvous at "
              f"{launch_cfg.rdzv_endpoint} did not complete ({type(e).__name__}: {e}). Every node must be started "
              f"within launch.timeout_s={launch_cfg.timeout_s} s of the others, with the same launch.rdzv_endpoint "
              "and hydra.run.dir, and reach node 0 at that address (launch.socket_ifname picks the interface). "
              f"Run dir: {run_dir}", file=sys.stderr, flush=True)
        sys.exit(1)
    except SignalException as e:
        if e.sigval not in PREEMPTION_SIGNALS:
            raise
        print(f"shardyard: {e.sigval.name}: the workers were asked to stop after their current step with a "
              f"checkpoint (rank 0's line above names it); exit {EXIT_REQUEUE}: requeue the job, or run the same "
              f"command with checkpoint.resume=auto. Run dir: {run_dir}", file=sys.stderr, flush=True)
        sys.exit(EXIT_REQUEUE)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        if set(codes.values()) == {EXIT_REQUEUE}:  # preempted: every worker saved and stopped (a signal of its own)
            _exit_requeue(run_dir)
        # Ranks the agent terminated after the first failure show a negative (signal) code; blame and
        # exit with the ranks that really failed (exit 2 stays 2: a user error such as a bad resume path).
        real = {r: c for r, c in codes.items() if c > 0} or codes
        first = min(real)
        node = f" (node {launch_cfg.node_rank} of {launch_cfg.nnodes})" if launch_cfg.nnodes > 1 else ""
        global LAST_FAILURE
        LAST_FAILURE = f"worker rank {first}{node} failed with exit code {real[first]} (failed ranks and codes: {codes})"
        print(f"shardyard: {LAST_FAILURE}; its output is above. Run dir: {run_dir}", file=sys.stderr, flush=True)
        sys.exit(2 if set(real.values()) == {2} else 1)


def _exit_requeue(run_dir: str) -> NoReturn:
    """Every worker stopped on a preemption signal after saving: say so and exit 75 (a launcher's last word)."""
    from shardyard.core.errors import EXIT_REQUEUE

    print(f"shardyard: the workers stopped on a preemption signal after saving; exit {EXIT_REQUEUE}: requeue "
          f"the job, or run the same command with checkpoint.resume=auto. Run dir: {run_dir}", file=sys.stderr,
          flush=True)
    sys.exit(EXIT_REQUEUE)


LAST_FAILURE: str | None = None
"""The last failed launch in this process, as the job of a sweep reports it (``shardyard.launching.sweep``)."""


def _without_child_failure_reports(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("failed (exitcode")


def horovod(run_dir: str, plan: Plan, cfg: DictConfig) -> None:
    """``horovodrun -np N --gloo`` (or ``--mpi`` with ``backend.controller=mpi``): Horovod's own runner starts
    and watches the workers. Under ``--mpi`` it runs ``mpirun --allow-run-as-root --tag-output``, so each output
    line carries its rank (``[1,0]<stdout>:``). On CPU under Gloo the workers fork from this process instead
    (``_horovod_gloo_forked``), as the elastic launcher's do."""
    import subprocess

    n = plan.nproc_per_node
    if plan.device_type == "cpu" and cfg.backend.controller != "mpi":
        return _horovod_gloo_forked(run_dir, n, cfg)
    runner = [sys.executable, "-c", "import sys; from horovod.runner.launch import run_commandline; "
              "sys.argv[0] = 'horovodrun'; run_commandline()"]
    if cfg.backend.controller == "mpi":
        controller = ["--mpi"] + (["--mpi-args=--oversubscribe"] if n > (os.cpu_count() or 1) else [])
    else:  # gloo and auto: Gloo is always built
        controller = ["--gloo", "--gloo-timeout-seconds", str(cfg.launch.timeout_s)]
    cmd = [*runner, "-np", str(n), "-H", f"localhost:{n}", *controller, sys.executable, "-m", "shardyard.training.worker",
           run_dir]
    env = dict(os.environ)
    if plan.device_type == "cpu" and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    code = subprocess.call(cmd, env=env)
    if code:
        global LAST_FAILURE
        LAST_FAILURE = f"horovodrun exited with code {code}"
        print(f"shardyard: horovodrun exited with code {code} (a worker failed; its output is above). "
              f"Run dir: {run_dir}", file=sys.stderr, flush=True)
        sys.exit(2 if code == 2 else 1)


def _horovod_gloo_forked(run_dir: str, n: int, cfg: DictConfig) -> None:
    """What ``horovodrun -np N -H localhost:N --gloo`` does, with workers forked from this process, which has
    imported torch and transformers already: horovodrun starts each worker as a fresh interpreter (about 5 s of
    imports each, 7 s of a short CPU job's start on 2 cores, and its own interpreter's on top).

    1. Horovod's own rendezvous server (``RendezvousServer``, as ``gloo_run.launch_gloo`` starts it) with the
       slots ``get_host_assignments`` gives N processes on one host.
    2. Each worker: the run env horovodrun exports (``create_run_env_vars``: the server's address, the Gloo
       controller and CPU operations, the interface) and its slot's (``create_slot_env_vars``: rank, size, local
       and cross ranks), ``--gloo-timeout-seconds`` as ``HOROVOD_GLOO_TIMEOUT_SECONDS``; then the worker's
       ``from_run_dir``, whose ``hvd.init`` reads them. Forked with the heap frozen (``elastic``'s reason). A worker
       that fails only because a peer went away waits before it exits, so that the first to fail is named
       (``SHARDYARD_FORKED_HOROVOD``: ``worker._let_the_first_failure_be_seen``).
    3. Watched as horovodrun watches them: the first to fail ends the others (SIGTERM, then SIGKILL after
       ``launch.timeout_s``); the job exits 1 naming it (2 where every failure was a user error's 2).
    4. A preemption signal (SIGTERM, SIGUSR1) to this process goes on to every worker, which save at their next
       step and exit 75; then this process exits 75 (horovodrun ends its workers without a save).

    Not for GPUs (no CUDA context may exist before a fork: horovodrun's fresh interpreters) nor MPI (mpirun)."""
    import gc
    import multiprocessing
    import multiprocessing.connection
    import signal

    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousServer

    from shardyard.core.errors import EXIT_REQUEUE
    from shardyard.training.loop import PREEMPTION_SIGNALS

    slots = get_host_assignments(parse_hosts(f"localhost:{n}"), n)  # 1
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(slots)
    env = {**{k: str(v) for k, v in create_run_env_vars("127.0.0.1", ["lo"], port).items()},
           "HOROVOD_GLOO_TIMEOUT_SECONDS": str(cfg.launch.timeout_s), "SHARDYARD_FORKED_HOROVOD": "1"}
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    gc.collect()
    gc.freeze()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_horovod_worker, args=(run_dir, {**env, **create_slot_env_vars(slot)}),
                         name=f"shardyard-horovod-rank{slot.rank}") for slot in slots]  # 2
    preempted: list[int] = []

    def pass_on(signum: int, _frame: Any) -> None:  # 4
        preempted.append(signum)
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signum)

    def stop(signum: int, _frame: Any) -> None:  # SIGHUP, SIGQUIT: end the workers with this process (below)
        raise SystemExit(128 + signum)

    def end(running: list) -> None:  # SIGTERM, then SIGKILL once launch.timeout_s has passed for them all
        import time

        for p in running:
            p.terminate()
        deadline = time.monotonic() + cfg.launch.timeout_s
        for p in running:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join()

    old: dict = {}
    try:
        for p in procs:
            p.start()
        # (after the forks: the workers keep the default handlers until the loop installs its own)
        old.update({sig: signal.signal(sig, pass_on) for sig in PREEMPTION_SIGNALS})
        old.update({sig: signal.signal(sig, stop) for sig in (signal.SIGHUP, signal.SIGQUIT)})
        failed: dict[int, int] = {}
        running = list(procs)
        while running:  # 3
            multiprocessing.connection.wait([p.sentinel for p in running])
            for rank, p in enumerate(procs):
                if p in running and p.exitcode is not None:
                    running.remove(p)
                    if p.exitcode not in (0, EXIT_REQUEUE) and not preempted:  # 75: saved on a signal of its own
                        failed.setdefault(rank, p.exitcode)
            if failed and running:
                end(running)
                running = []
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        end([p for p in procs if p.pid is not None and p.exitcode is None])  # an interrupt: none left behind
        server.stop()
    codes = [p.exitcode for p in procs]
    # Preempted: every worker saved (75), finished, or was ended by the signal before the loop could catch it (in its
    # start-up or export): requeue, as the elastic launcher does; resume=auto takes the newest checkpoint there is.
    signalled = {EXIT_REQUEUE, 0, *(-int(sig) for sig in PREEMPTION_SIGNALS)}
    if all(c == EXIT_REQUEUE for c in codes) or (preempted and all(c in signalled for c in codes)):
        _exit_requeue(run_dir)
    real = {r: c for r, c in enumerate(codes) if c and c > 0} or {r: c for r, c in enumerate(codes) if c}
    if real:
        blamed = failed or real  # the first to fail (ranks ended after it may exit 1 on the peer they lost)
        first = min(blamed)
        global LAST_FAILURE
        LAST_FAILURE = f"horovod worker rank {first} failed with exit code {codes[first]} (exit codes: {codes})"
        print(f"shardyard: {LAST_FAILURE}; its output is above. Run dir: {run_dir}", file=sys.stderr, flush=True)
        sys.exit(2 if set(blamed.values()) == {2} else 1)


def _horovod_worker(run_dir: str, env: dict[str, str]) -> None:
    """One forked Horovod worker (``_horovod_gloo_forked``): its slot's environment, then the run."""
    os.environ.update(env)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # horovodrun's workers: PYTHONUNBUFFERED
    from shardyard.training.worker import from_run_dir

    try:
        from_run_dir(run_dir)
    except Exception:
        sys.exit(1)  # its traceback is printed already (from_run_dir); multiprocessing would print it again


LAUNCHERS: dict[str, Callable[[str, Plan, DictConfig], None]] = {"elastic": elastic, "horovod": horovod}
"""Each takes the run dir, the plan and the whole config (``launch`` and the engine's own keys)."""


def for_backend(backend_cfg: DictConfig) -> Callable[[str, Plan, DictConfig], None]:
    backend: Any = hydra.utils.get_object(backend_cfg._target_)  # a Backend class
    return LAUNCHERS[backend.launcher]
