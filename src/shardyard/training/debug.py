"""``debug.*``: what happens when a loss or gradient goes non-finite, and anomaly detection.

The decision is global: it rests on the global gradient norm (or, under fp16, on every rank's loss), so all
ranks stop or skip together and nothing hangs. Only then do the ranks exchange where it happened, so the
message names the rank that produced it (a non-finite local loss, or the first non-finite gradient seen
on that rank) and the parameter.
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch
from omegaconf import DictConfig

from shardyard.config.schema import Precision
from shardyard.core.errors import UserError


class NonFiniteGuard:
    def __init__(self, debug: DictConfig, precision: str, backend):
        """``debug``: the run's ``debug`` section (``nan_policy``, ``max_skipped``); ``precision``: the
        ``precision.name`` (under fp16 the loss scaler owns gradient overflows, the guard only the loss)."""
        self.policy, self.max_skipped = debug.nan_policy, debug.max_skipped
        self.fp16 = Precision(precision) is Precision.fp16
        self.backend = backend
        from shardyard.models.shape import signature

        model = backend.hf_model()
        # A rank reports its first non-finite gradient by its index among the *whole* model's parameters, the
        # same list on every rank even where a rank holds only part of the model (a pipeline stage).
        self.local_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.names = list(signature(model))
        self.skipped = 0
        self.in_a_row = 0

    @property
    def active(self) -> bool:
        return self.policy != "off"

    def check(self, step: int, loss: torch.Tensor, stats) -> None:
        """After ``backend.step(guard=True)``: raise (stop), or count a skipped step."""
        if self.fp16:  # gradient overflows are the loss scaler's; a non-finite loss on any rank is ours
            flag = (~torch.isfinite(loss)).float()
            bad = self.backend.all_reduce_mean(flag.to(self.backend.device)).item() > 0
        else:  # the global norm, which the engine has already synchronised on
            bad = not stats.applied or not math.isfinite(float(stats.grad_norm))
        if not bad:
            self.in_a_row = 0
            return
        where = self._locate(not torch.isfinite(loss).item(), stats.nonfinite_param)
        what = f"at step {step} the {'loss' if self.fp16 else 'gradient norm'} is not finite " \
               f"(grad norm {float(stats.grad_norm)}); {where}"
        if self.policy == "stop":
            raise UserError("debug.nan_policy", "stop", f"Training stopped before applying the update: {what}. "
                            "The parameters are those of the step before.",
                            "Lower optim.lr or raise sched.warmup_steps, keep train.max_grad_norm > 0, run with "
                            "debug.detect_anomaly=true to find the operation, or use debug.nan_policy=skip.").on_every_rank()
        self.skipped += 1
        self.in_a_row += 1
        if self.backend.rank == 0:
            print(f"shardyard | debug.nan_policy=skip: skipped the update of step {step} "
                  f"({self.skipped} so far, {self.in_a_row} in a row): {what}", file=sys.stderr, flush=True)
        if self.in_a_row >= self.max_skipped:
            raise UserError("debug.max_skipped", self.max_skipped, f"{self.in_a_row} updates in a row were skipped "
                            f"for non-finite values; the last {what}.",
                            "The run has diverged: resume from an earlier checkpoint with a lower optim.lr, or "
                            "run with debug.detect_anomaly=true to find the operation.").on_every_rank()

    def _locate(self, local_bad: bool, local_param: int | None) -> str:
        """Collective: every rank contributes (non-finite loss?, first non-finite gradient) to one table."""
        b, world = self.backend, self.backend.world_size
        row = torch.zeros(world, 2, dtype=torch.float64, device=b.device)  # only our own row is non-zero
        row[b.rank, 0] = float(local_bad)
        row[b.rank, 1] = -1 if local_param is None else self.names.index(self.local_names[local_param])
        table = (b.all_reduce_mean(row) * world).round().cpu().tolist()
        loss_ranks = [r for r, (lb, _) in enumerate(table) if lb > 0]
        grad_ranks = [r for r, (_, p) in enumerate(table) if p >= 0]
        rank = (loss_ranks or grad_ranks or [-1])[0]  # -1: no rank could tell
        parts = []
        if loss_ranks:
            parts.append(f"the loss is non-finite on rank(s) {loss_ranks}")
        if grad_ranks:
            r = rank if rank in grad_ranks else grad_ranks[0]
            seen = f"rank {r}" if len(grad_ranks) == 1 else f"seen on ranks {grad_ranks} after the gradient reduction"
            parts.append(f"first non-finite gradient: {self.names[int(table[r][1])]} ({seen})")
        if not parts:
            parts.append("no rank saw a non-finite gradient in its own part (the overflow arose in the reduction)")
        return "; ".join(parts)


def anomaly_detection(debug: DictConfig):
    """``torch.autograd.detect_anomaly`` around forward and backward when ``debug.detect_anomaly`` asks (``debug``:
    the run's ``debug`` section): a NaN produced in backward raises at the operation that made it, with the
    forward traceback of that operation."""
    return torch.autograd.detect_anomaly(check_nan=True) if debug.detect_anomaly else contextlib.nullcontext()
