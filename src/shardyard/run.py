"""compose (Hydra, in train.py) -> validate -> launch workers or train in-process.

The process that runs ``python train.py`` is the *parent*: it owns the run directory, writes the resolved
config once, builds the data caches, and then either trains in-process (one worker) or starts the workers
with the engine's own launcher. Processes started by an external launcher (torchrun, srun, deepspeed,
horovodrun) are workers already and train directly.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from shardyard import dist_env
from shardyard.config.validate import apply_fast_dev_run, validate
from shardyard.errors import UserError, report_and_exit


def run(cfg: DictConfig) -> None:
    env = dist_env.detect()
    try:
        apply_fast_dev_run(cfg)  # before the config is written: the workers read the shortened run
        plan = validate(cfg, env)
        if env is None:
            _run_parent(cfg, plan)
        else:
            _run_external_worker(cfg, env)
    except UserError as err:
        report_and_exit(err)


def _run_parent(cfg: DictConfig, plan) -> None:
    from shardyard import data, launch, worker

    run_dir = prepare_run_dir(cfg)
    data.prepare(cfg)  # tokenizer + token cache, built once here rather than raced by N workers
    print(f"shardyard | run dir {run_dir}\nshardyard | {plan.describe()}", flush=True)
    if plan.world_size == 1:
        launch.single_process_env()
        worker.main(load_run_config(run_dir))
    else:
        launcher = launch.for_backend(cfg.backend)
        launcher(run_dir, plan, cfg.launch)


def _run_external_worker(cfg: DictConfig, env: dist_env.DistEnv) -> None:
    from shardyard import worker

    dist_env.export_torch_env(env)
    if env.is_rank0:
        prepare_run_dir(cfg)
    # Every rank trains from the config it composed; rank 0 alone wrote it to the run dir.
    worker.main(resolved(cfg))


def resolved(cfg: DictConfig) -> DictConfig:
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


def prepare_run_dir(cfg: DictConfig) -> str:
    """Create the run dir and write ``config.yaml`` (resolved) atomically, without clobbering a run."""
    run_dir = cfg.run_dir
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    ckpt_dir = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")
    if os.path.exists(path) and cfg.checkpoint.resume is None and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise UserError("hydra.run.dir", run_dir, "That run directory already holds a run with checkpoints.",
                        "Continue it with checkpoint.resume=auto, or choose a new hydra.run.dir.")
    if os.path.exists(path):  # keep the config the run started with beside the new one
        os.replace(path, os.path.join(run_dir, "config.previous.yaml"))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(OmegaConf.to_yaml(resolved(cfg)))
    os.replace(tmp, path)
    return run_dir


def load_run_config(run_dir: str) -> DictConfig:
    return OmegaConf.load(os.path.join(run_dir, "config.yaml"))
