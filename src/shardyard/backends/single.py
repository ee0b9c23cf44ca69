"""``backend=single``: one process, no process group. The reference every engine is tested against."""

from __future__ import annotations

from typing import ClassVar

import torch
from omegaconf import DictConfig

from shardyard.core.facts import Plan
from shardyard.backends import reference
from shardyard.backends.forward import forward_to
from shardyard.backends.torch_step import TorchStepper, pick_device, read_dcp_model_state, replica_states
from shardyard.core.errors import UserError
from shardyard.models.prepare import prepare_replica


class SingleBackend:
    quantized_base = True
    """peft=qlora: every rank holds the whole 4-bit base (bitsandbytes' packed weights are not sharded)."""
    max_ranks = 1
    """It trains in one process: the plan offers it as an alternative only to a one-rank run."""
    launcher: ClassVar[str] = "elastic"
    dry_run: ClassVar[str] = "replica"
    """``plan.dry_run``: its one rank is simulated as it is."""
    degree_keys: ClassVar[dict[str, str]] = {}

    @staticmethod
    def degrees(b: DictConfig) -> dict[str, int | None]:
        return {"dp_replicate": None}  # its one rank (``validate`` refuses more)

    def __init__(self, cfg: DictConfig, plan: Plan):
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
        self.model = prepare_replica(build(allow_meta=True), self.cfg, self.device)
        self.stepper = TorchStepper(self.model, self.cfg, self.device, self.plan.grad_accum_steps, total_steps)

    def forward_backward(self, inputs, targets, is_last_micro: bool, weight: torch.Tensor) -> torch.Tensor:
        return self.stepper.forward_backward(inputs, targets, weight)

    step = forward_to("stepper", TorchStepper.step)
    eval_loss = forward_to("stepper", TorchStepper.eval_loss)

    checkpoint_format: ClassVar[str] = "dcp"

    @staticmethod
    def read_model_state(path: str, model: torch.nn.Module, meta: dict) -> dict[str, torch.Tensor]:
        return read_dcp_model_state(path, model, meta)

    save_checkpoint = forward_to("stepper", TorchStepper.save_checkpoint)
    save_checkpoint_async = forward_to("stepper", TorchStepper.save_checkpoint_async)  # checkpoint.async_save
    load_checkpoint = forward_to("stepper", TorchStepper.load_checkpoint)
    training_state = forward_to("stepper", TorchStepper.training_state)
    load_training_state = forward_to("stepper", TorchStepper.load_training_state)

    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        pass

    def hf_model(self) -> torch.nn.Module:
        return self.model

    def reference_model(self, build) -> torch.nn.Module:
        """A frozen fp32 replica on the device, under the policy's autocast: 4P bytes (``Backend.reference_model``)."""
        if "reference" not in self.__dict__:
            self.reference = reference.replica(build, self.cfg, self.device)
        return self.reference

    def full_state_dict(self) -> dict:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        self.__dict__.pop("reference", None)
