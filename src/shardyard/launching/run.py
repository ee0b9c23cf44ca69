"""compose (Hydra, in train.py) -> validate once -> launch workers or train in-process.

The process that runs ``python train.py`` is the *parent*: it validates, owns the run directory, writes the
resolved config and the plan once, builds the data caches, and then either trains in-process (one worker)
or starts the workers with the engine's own launcher; they read config and plan from the run dir.
Processes started by an external launcher (torchrun, srun, deepspeed, horovodrun) are workers already:
each composed the config itself, so each validates it and trains.
"""

from __future__ import annotations

from omegaconf import DictConfig

from shardyard.core import dist_env, errors
from shardyard.training import rundir
from shardyard.planning import scale
from shardyard.core.facts import Plan
from shardyard.planning.validate import apply_fast_dev_run, validate
from shardyard.core.errors import UserError, report_and_exit



def run(cfg: DictConfig) -> float | None:
    """The task function's body. One job of a multirun goes through ``sweep.job``, which records its result and
    returns its objective (``sweep.objective``); a failed job does not end the sweep."""
    errors.JOB_STARTED = True  # composed: a later exit is not a composition error
    if _in_multirun():
        from shardyard.launching import sweep

        return sweep.job(cfg, _run)
    try:
        _run(cfg)
    except UserError as err:
        report_and_exit(err)
    return None


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _run(cfg: DictConfig) -> None:
    env = dist_env.detect()
    scaled = scale.apply(cfg)  # +scale=smoke: the recipe scaled down to run here
    if scaled and (env is None or env.is_rank0):
        print(f"shardyard | {scaled}", flush=True)
    apply_fast_dev_run(cfg)  # before the config is written: the workers read the shortened run
    if cfg.plan.search:  # the degrees the command line fixes must agree among themselves before anything is planned
        from shardyard.planning import layouts
        from shardyard.planning.hardware import named

        if cfg.plan.hardware is not None:
            world = named(cfg.plan.hardware, cfg.plan.nodes).world
            fixed = layouts.command_line()
            layouts.check_fixed(fixed, world)
            layouts.free_micro_batch(cfg, fixed, world)
    if cfg.plan.dry_run:  # the run at the named hardware's world, simulated here; nothing is written
        from shardyard.planning import dryrun

        errors.leave(dryrun.main(cfg, validate(cfg, env)))
    planned = _memory_plan(cfg, validate(cfg, env), env)
    if planned is None:
        return  # plan.only: the plan is printed, nothing runs
    plan = planned
    complete = rundir.finished(cfg)  # resume=auto on a finished run: every process decides alike, writes nothing
    if complete is not None:
        if env is None or env.is_rank0:
            print(f"shardyard | {complete} Run dir: {cfg.run_dir}", flush=True)
        return
    dist_env.network_env(cfg.launch.socket_ifname)  # before any process group exists
    dist_env.deterministic_env(cfg.train.deterministic)  # before any worker starts CUDA or NCCL
    if env is None:
        _run_parent(cfg, plan)
    else:
        _run_external_worker(cfg, env, plan)


def _memory_plan(cfg: DictConfig, plan: Plan, env: dist_env.DistEnv | None) -> Plan | None:
    """Print the plan's line and refuse, before anything is written or started, a run that does not fit."""
    import dataclasses

    from shardyard.planning import search as plan_search

    planned = plan_search.before_launch(cfg, plan, rank0=env is None or env.is_rank0)
    if planned is None:
        return None
    e, line = planned
    return dataclasses.replace(plan, memory={"device": e.device, "peak": e.device_peak, "line": line,
                                             "where": "cpu" if plan.device_type == "cpu" else "cuda"})


def _run_parent(cfg: DictConfig, plan: Plan) -> None:
    from shardyard.data import pipeline as data
    from shardyard.launching import launch
    from shardyard.training import worker

    node = cfg.launch.node_rank if plan.nnodes > 1 else 0
    # Node 0 writes the run dir; the other nodes wait until it holds their own config (node_rank aside).
    fresh = node == 0 and rundir.find(cfg) is None
    run_dir = rundir.prepare(cfg, plan) if node == 0 else rundir.wait_for_node0(cfg, cfg.launch.timeout_s)
    try:
        data.prepare(cfg, plan.facts.embedding_rows)  # tokenizer + token cache, built once here, not raced by N workers
    except UserError:
        if fresh:  # refused before anything ran (e.g. every record longer than data.seq_len): the dir holds no run
            rundir.release(cfg)
        raise
    where = " (config and plan written by node 0)" if node else ""
    print(f"shardyard | run dir {run_dir}{where}\nshardyard | {plan.describe()}\nshardyard | {plan.memory_line}",
          flush=True)
    if plan.world_size == 1:
        launch.single_process_env()
        worker.main(rundir.resolved(cfg), plan)
    else:
        launch.for_backend(cfg.backend)(run_dir, plan, cfg)


def _run_external_worker(cfg: DictConfig, env: dist_env.DistEnv, plan: Plan) -> None:
    from shardyard.training import worker

    dist_env.export_torch_env(env)
    if env.is_rank0:
        run_dir = rundir.prepare(cfg, plan)
        print(f"shardyard | run dir {run_dir} (workers started by {env.launcher})\nshardyard | {plan.describe()}\n"
              f"shardyard | {plan.memory_line}", flush=True)
    # Every rank trains from the config it composed; rank 0 alone wrote it to the run dir.
    worker.main(rundir.resolved(cfg), plan)
