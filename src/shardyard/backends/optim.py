"""Optimizers and learning-rate schedules: ``optim._target_`` and ``sched._target_`` build them.

An optimizer option is ``_target_(param_groups, **its other keys)``: a ``torch.optim`` class, DeepSpeed's
or your own factory. A schedule option is ``_target_(**its keys)`` returning ``factor(step, total_steps)``,
the multiplier of the peak learning rate; every engine (DeepSpeed included) follows that one function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from omegaconf import DictConfig

Schedule = Callable[[int, int], float]
"""``factor(step, total_steps)``: multiplier of ``optim.lr`` at 0-based optimizer step ``step``."""


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms, biases (1-D tensors) are left undecayed, as in GPT/LLaMA training.

    Parameters sharded over different device meshes (expert parallelism: the experts over edp x ep, the rest
    over all ranks) go to groups of their own: an optimizer runs its fused (``foreach``) kernels per group, and
    DTensors of two meshes cannot meet in one of them."""
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            mesh = getattr(p, "device_mesh", None)
            # by mesh equality, not identity: FSDP2 gives every parameter its own (equal) mesh object
            groups.setdefault((p.ndim >= 2, mesh), []).append(p)
    meshes = list(dict.fromkeys(m for _, m in groups)) or [None]
    return [{"params": groups.get((decays, m), []), "weight_decay": weight_decay if decays else 0.0}
            for m in meshes for decays in (True, False) if (decays, m) in groups or len(meshes) == 1]


def optimizer_kwargs(o: DictConfig) -> dict:
    """The optimizer option's keys as the arguments of its ``_target_`` (lists become tuples: betas, eps)."""
    from shardyard.config.plugins import arguments

    return {k: tuple(v) if isinstance(v, list) else v for k, v in arguments(o).items()}


def build_optimizer(model: torch.nn.Module, o: DictConfig) -> torch.optim.Optimizer:
    from hydra.utils import get_object

    kwargs = optimizer_kwargs(o)
    return get_object(o._target_)(param_groups(model, kwargs.get("weight_decay", 0.0)), **kwargs)


def build_schedule(s: DictConfig) -> Schedule:
    from shardyard.config.plugins import build

    return build(s)


def build_scheduler(optimizer: torch.optim.Optimizer, s: DictConfig, total_steps: int):
    schedule = build_schedule(s)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step, total_steps))


@dataclass(frozen=True)
class WarmupConstant:
    """Linear warmup from 0 to the peak over ``warmup_steps``, then the peak."""

    warmup_steps: int

    def __call__(self, step: int, total: int) -> float:
        return (step + 1) / self.warmup_steps if step < self.warmup_steps else 1.0


def _warmup_then_decay(step: int, total: int, warmup: int, min_ratio: float, decay: Callable[[float], float]) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * decay(progress)


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup, then a half cosine from the peak down to ``min_lr_ratio`` x peak at the last step."""

    warmup_steps: int
    min_lr_ratio: float

    def __call__(self, step: int, total: int) -> float:
        return _warmup_then_decay(step, total, self.warmup_steps, self.min_lr_ratio,
                                  lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class WarmupLinear:
    """Linear warmup, then a straight line from the peak down to ``min_lr_ratio`` x peak."""

    warmup_steps: int
    min_lr_ratio: float

    def __call__(self, step: int, total: int) -> float:
        return _warmup_then_decay(step, total, self.warmup_steps, self.min_lr_ratio, lambda progress: 1.0 - progress)
