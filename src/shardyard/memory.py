"""Bytes a rank really holds, by category; each storage counted once (views and flat buffers dedupe).

For benchmarks and the plan's tests only (``bench/memory.py``): nothing in a training step calls it.
"""

from __future__ import annotations

from typing import Iterable

import torch


def local(t):
    """The tensor this rank holds: a DTensor's local shard, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def breakdown(categories: dict[str, Iterable]) -> dict[str, int]:
    """``{"params": tensors, "grads": ..., "optimizer": ...}`` -> bytes; earlier categories win on overlap."""
    seen: set[int] = set()
    out = {}
    for name, tensors in categories.items():
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            t = local(t)
            if t.numel() == 0:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        out[name] = total
    return out


def optimizer_state_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


# Where DeepSpeed 0.19's ZeRO optimizers keep their fp32 master partitions and flat gradient buffers.
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")
_GRAD_ATTRS = ("averaged_gradients", "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
               "fp32_groups_gradients_flat", "grad_partitions_flat_buffer", "ipg_buffer")


def held_by(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state (master weights included) this rank holds for ``model``
    and its ``optimizer`` (a torch optimizer, a Horovod wrapper or a DeepSpeed ZeRO optimizer)."""
    params = [getattr(p, "ds_tensor", p) for p in model.parameters()]  # ZeRO-3: this rank's partition
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    masters = [m for name in _MASTER_ATTRS for m in (getattr(optimizer, name, None) or [])]
    grads += [m.grad for m in masters if m.grad is not None]
    for name in _GRAD_ATTRS:
        value = getattr(optimizer, name, None)
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, torch.Tensor):
            value = [value]
        for v in value or []:
            grads += v if isinstance(v, list) else [v]
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed wraps the torch optimizer
    return breakdown({"params": params, "grads": grads, "optimizer": masters + list(optimizer_state_tensors(inner))})


def _planned(cfg, plan) -> dict:
    """The plan's per-rank figures for this run on this machine (what ``plan.only=true`` prints)."""
    from shardyard import plan as memory_plan

    e = memory_plan.estimate(cfg, plan, memory_plan.hardware(cfg, plan))
    return {"device": e.device, "peak": e.device_peak}


def measure_engines(rank: int, world: int, ports: list[int], jobs: list[list[str]], out: str) -> None:
    """In a spawned rank of ``world``: for each job (overrides), build the engine, train one step and run the
    backward of the next (gradients and optimizer state both alive), and record what this rank holds
    (``held_by``) beside the parameter count. Rank 0 writes ``[{"overrides", "P", "params", ...}]`` to ``out``."""
    import json
    import os
    import tempfile

    import hydra.utils

    from shardyard import data
    from shardyard.config.validate import validate
    from shardyard.dist_env import detect
    from shardyard.model import build_model, param_count
    from shardyard.testing import compose

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    results = []
    for port, overrides in zip(ports, jobs):
        os.environ["MASTER_PORT"] = str(port)
        cfg = compose([*overrides, "train.steps=2"], run_dir=tempfile.mkdtemp(prefix="shardyard-mem-"))
        plan = validate(cfg, detect())
        backend = hydra.utils.get_object(cfg.backend._target_)(cfg, plan)
        backend.init()
        built: dict = {}

        def build(allow_meta: bool) -> torch.nn.Module:
            from shardyard.adapters import apply

            model = build_model(cfg.model, cfg.seed)
            built["P"] = param_count(model)
            built["m"] = apply(model, cfg.peft, cfg.seed)  # peft=lora: adapters, the base frozen
            return built["m"]

        backend.prepare(build, 2)
        prep = data.prepare(cfg)
        stream = data.TrainStream(data.open_split(prep, "train", cfg.data.seq_len), 0,
                                  plan.global_batch_size, plan.micro_batch_size, backend.dp_rank, backend.dp_size)
        x, y = stream.micro_batch(0, 0)
        backend.forward_backward(x, y, True)
        backend.step()
        x, y = stream.micro_batch(1, 0)
        backend.forward_backward(x, y, True)  # gradients of step 2 alive, optimizer state from step 1
        engine = getattr(backend, "engine", None)  # DeepSpeed's ZeRO optimizer, or the torch one of the stepper
        optimizer = engine.optimizer if engine is not None else getattr(backend, "stepper").optimizer
        results.append({"overrides": overrides, "P": built["P"], "trainable": param_count(backend.hf_model(), trainable=True),
                        "plan": _planned(cfg, plan), **held_by(backend.hf_model(), optimizer)})
        backend.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def run_measurements(world: int, jobs: list[list[str]]) -> list[dict]:
    """``measure_engines`` on ``world`` gloo ranks (``testing.on_ranks``' pool); one result per job."""
    import json
    import tempfile

    from shardyard.launch import free_port
    from shardyard.testing import on_ranks

    out = tempfile.mktemp(suffix=".json", prefix=f"shardyard-memory-w{world}-")
    on_ranks(world, measure_engines, [free_port() for _ in jobs], jobs, out)
    with open(out) as f:
        return json.load(f)
