"""The torch-native optimizer step shared by the single, DDP (and FSDP) engines, by composition."""

from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig

from shardyard.backends import StepStats
from shardyard.model import causal_lm_loss
from shardyard.optim import build_optimizer, build_scheduler

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchStepper:
    """Autocast forward, scaled backward over accumulation micro-steps, then unscale -> clip -> step."""

    def __init__(self, model: torch.nn.Module, cfg: DictConfig, device: torch.device, accum: int, total_steps: int,
                 scaler: torch.amp.GradScaler | None = None, autocast: bool = True):
        pr = cfg.precision
        self.model, self.accum, self.device_type = model, accum, device.type
        self.max_norm = cfg.train.max_grad_norm
        self.dtype = DTYPES[pr.compute_dtype]
        self.autocast_on = autocast and pr.name != "fp32"
        self.optimizer = build_optimizer(model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.sched, total_steps)
        # fp16 needs dynamic loss scaling; fp32 master weights stay in the optimizer either way.
        self.scaler = scaler or torch.amp.GradScaler(
            device.type, init_scale=2.0 ** pr.initial_scale_power, growth_interval=pr.loss_scale_window,
            enabled=pr.name == "fp16")
        self.params = [p for p in model.parameters() if p.requires_grad]

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.autocast_on)

    def forward_backward(self, inputs, targets, sync_context=contextlib.nullcontext()) -> torch.Tensor:
        with sync_context:
            with self.autocast():
                loss = causal_lm_loss(self.model, inputs, targets)
            # Each micro-batch holds the same number of tokens, so scaling by 1/accum makes the summed
            # gradient the mean over the global batch.
            self.scaler.scale(loss / self.accum).backward()
        return loss.detach()

    def step(self) -> StepStats:
        self.scaler.unscale_(self.optimizer)
        max_norm = self.max_norm if self.max_norm > 0 else float("inf")
        # Works for plain and DTensor (FSDP2) parameters alike; returns the global pre-clip norm.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        if isinstance(grad_norm, torch.distributed.tensor.DTensor):
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)  # skipped by the scaler when fp16 gradients overflowed
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(grad_norm.detach(), lr, self.scaler.get_scale() if self.scaler.is_enabled() else None)

    @torch.no_grad()
    def eval_loss(self, inputs, targets) -> torch.Tensor:
        with self.autocast():
            return causal_lm_loss(self.model, inputs, targets).detach()

    def memory_breakdown(self) -> dict:
        from shardyard.memory import breakdown, optimizer_state_tensors

        return breakdown({"params": self.params, "grads": [p.grad for p in self.params if p.grad is not None],
                          "optimizer": optimizer_state_tensors(self.optimizer)})

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.scheduler.load_state_dict(sd["scheduler"])
        if sd.get("scaler"):
            self.scaler.load_state_dict(sd["scaler"])


def pick_device(plan, local_rank: int) -> torch.device:
    if plan.device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
