"""Helpers for shardyard's own tests: compose configs and run real multi-process (gloo) workers."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")

# A model and data shape small enough for 2 CPU cores, still the real architecture.
TINY = ["model.hidden_size=64", "model.intermediate_size=176", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=4", "data.seq_len=64", "train.micro_batch_size=4", "train.sample_tokens=0",
        "train.eval_batches=2", "train.log_every_n_steps=1", "sched.warmup_steps=2", "checkpoint.save_final=false",
        "monitor=[console]", "monitor.console.style=plain"]


def compose(overrides: list[str], run_dir: str | None = None) -> DictConfig:
    """The config ``python train.py <overrides>`` composes (typed, as ``run.validate`` sees it), outside a
    Hydra app. ``shardyard.rundir.resolved`` turns it into what the workers get."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from shardyard.config import register_configs, register_resolvers

    register_configs()
    register_resolvers()
    extra = [f"run_dir={run_dir}"] if run_dir else ["run_dir=unused"]
    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR):
        cfg = hydra_compose("train", overrides=list(overrides) + extra)
    return cfg


def _rank_main(rank: int, world: int, ports: list[int], jobs: list[tuple[list[str], str]]) -> None:
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # Several runs in one set of processes: each with its own process group (on its own port) and run
    # dir; only interpreter start-up and imports are shared.
    for port, (overrides, run_dir) in zip(ports, jobs):
        os.environ["MASTER_PORT"] = str(port)
        _one_run(rank, overrides, run_dir)


def _one_run(rank: int, overrides: list[str], run_dir: str) -> None:
    import torch

    from shardyard import worker
    from shardyard.config.validate import validate
    from shardyard.dist_env import detect
    from shardyard.memory import local
    from shardyard.rundir import resolved

    cfg = compose(overrides, run_dir)
    plan = validate(cfg, detect())  # what run.py does before any worker starts
    cfg = resolved(cfg)
    out: dict = {}

    def grab(backend):
        out["full"] = backend.full_state_dict()  # collective on sharded engines; rank 0 gets the dict
        # This rank's own tensors exactly as the engine holds them (a replica, or DTensor local shards).
        out["local"] = {k: local(v).detach().cpu().clone()
                        for k, v in backend.hf_model().state_dict().items()}

    out["summary"] = worker.main(cfg, plan, after_train=grab)
    torch.save(out, os.path.join(run_dir, f"rank{rank}.pt"))


def run_many(world: int, jobs: list[tuple[list[str], str]]) -> list[list[dict]]:
    """Run each (overrides, run_dir) job on ``world`` real worker processes (spawned once, gloo), one job
    after another; return, per job, each rank's summary, gathered full params and local tensors."""
    import torch
    import torch.multiprocessing as mp

    from shardyard.launch import free_port

    for _, run_dir in jobs:
        os.makedirs(run_dir, exist_ok=True)
    ports = [free_port() for _ in jobs]
    mp.start_processes(_rank_main, args=(world, ports, [(list(o), d) for o, d in jobs]), nprocs=world,
                       start_method="spawn")
    return [[torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)] for _, d in jobs]


def run_ranks(world: int, overrides: list[str], run_dir: str) -> list[dict]:
    """One run on ``world`` real worker processes."""
    return run_many(world, [(overrides, run_dir)])[0]


def hf_eval_loss(hf_dir: str, cfg: DictConfig, world: int) -> float:
    """Eval loss of an HF export on exactly the sequences a ``world``-rank run evaluates (same mean)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardyard import data
    from shardyard.model import causal_lm_loss

    prep = data.prepare(cfg)
    val = data.open_split(prep, "val", cfg.data.seq_len)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32).eval()
    losses = []
    with torch.no_grad():
        for rank in range(world):
            for x, y in data.eval_batches(val, cfg.train.eval_batches, cfg.train.micro_batch_size, rank, world):
                losses.append(causal_lm_loss(model, x, y).item())
    return sum(losses) / len(losses)
