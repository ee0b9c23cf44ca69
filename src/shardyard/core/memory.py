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
