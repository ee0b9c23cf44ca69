"""``backend=single``: one process, no process group. The reference every engine is tested against."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from shardyard.backends import StepStats
from shardyard.backends.torch_step import TorchStepper, pick_device, replica_states
from shardyard.errors import UserError
from shardyard.model import prepare_replica


class SingleBackend:
    quantized_base = True
    """peft=qlora: every rank holds the whole 4-bit base (bitsandbytes' packed weights are not sharded)."""
    launcher = "elastic"

    def __init__(self, cfg: DictConfig, plan):
        self.cfg, self.plan = cfg, plan
        self.rank, self.world_size = 0, 1
        self.dp_rank, self.dp_size = 0, 1

    @staticmethod
    def validate(cfg: DictConfig, plan) -> None:
        if plan.world_size != 1:
            raise UserError("backend", "single", f"It trains in one process, but the launch asks for {plan.world_size}.",
                            "Use backend=ddp (or another distributed engine), or launch.nproc_per_node=1.")

    @staticmethod
    def model_states(cfg: DictConfig, n_params: int, world: int, shape: dict, optim_bytes: float):
        return replica_states(cfg, n_params, optim_bytes)

    def init(self) -> None:
        self.device = pick_device(self.plan, 0)

    def prepare(self, build, total_steps: int) -> None:
        self.model = prepare_replica(build(allow_meta=True), self.cfg.model, self.device, self.cfg.seed)
        self.stepper = TorchStepper(self.model, self.cfg, self.device, self.plan.grad_accum_steps, total_steps)

    def forward_backward(self, inputs, targets, is_last_micro: bool) -> torch.Tensor:
        return self.stepper.forward_backward(inputs, targets)

    def step(self, guard: bool = False) -> StepStats:
        return self.stepper.step(guard)

    def eval_loss(self, inputs, targets) -> torch.Tensor:
        return self.stepper.eval_loss(inputs, targets)

    checkpoint_format = "dcp"

    def save_checkpoint(self, path: str) -> None:
        self.stepper.save_dcp(path, self.model)

    def load_checkpoint(self, path: str, meta: dict) -> None:
        self.stepper.load_dcp(path, self.model)

    def training_state(self) -> dict:
        return self.stepper.training_state()

    def load_training_state(self, state: dict) -> None:
        self.stepper.load_training_state(state)

    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        pass

    def hf_model(self) -> torch.nn.Module:
        return self.model

    def full_state_dict(self) -> dict:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        pass
