"""Optimizers and learning-rate schedules from the ``optim`` / ``sched`` groups."""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms, biases (1-D tensors) are left undecayed, as in GPT/LLaMA training."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, o: DictConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, o.weight_decay)
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov)
    raise AssertionError(f"validated earlier: {o.name}")


def lr_factor(step: int, total: int, s: DictConfig) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based): warmup, then decay to min_lr_ratio."""
    if step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.name == "constant":
        return 1.0
    progress = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    if s.name == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, s: DictConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, s))
