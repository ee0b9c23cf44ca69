"""Bytes a rank really holds, by category; each storage counted once (views and flat buffers dedupe)."""

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
