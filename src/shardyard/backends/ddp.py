"""``backend=ddp``: torch DistributedDataParallel; gloo on CPU, nccl on CUDA."""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import ClassVar

import torch
from omegaconf import DictConfig
from torch.nn.parallel import DistributedDataParallel

from shardyard.core.facts import Plan
from shardyard.backends import Collective, process_group, reference
from shardyard.backends.forward import forward_to
from shardyard.backends.process_group import init_process_group, teardown
from shardyard.backends.torch_step import TorchStepper, pick_device, read_dcp_model_state, replica_states
from shardyard.core.errors import UserError
from shardyard.models.prepare import prepare_replica


def _buffer_sync_kwargs(sync: bool) -> dict:
    # torch >= 2.12 renamed broadcast_buffers to forward_sync_buffers; a user's older torch has only the former.
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": sync} if "forward_sync_buffers" in params else {"broadcast_buffers": sync}


class DDPBackend:
    quantized_base = True
    """peft=qlora: every rank holds the whole 4-bit base (bitsandbytes' packed weights are not sharded)."""
    launcher: ClassVar[str] = "elastic"
    dry_run: ClassVar[str] = "replica"
    """``plan.dry_run``: every rank is one whole replica, which the dry run simulates on the ``single`` engine's
    code (the replica this engine wraps); its gradient buckets are checked by arithmetic."""
    degree_keys: ClassVar[dict[str, str]] = {"sp": "backend.sp", "cp": "backend.cp"}

    @staticmethod
    def degrees(b: DictConfig) -> dict[str, int | None]:
        return {"sp": int(b.get("sp", 1)), "cp": int(b.get("cp", 1)), "dp_replicate": None}  # every rank a replica

    def __init__(self, cfg: DictConfig, plan: Plan):
        self.cfg, self.plan, self.bcfg = cfg, plan, cfg.backend
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.dp_rank, self.dp_size = self.rank, self.world_size

    @staticmethod
    def dry_run_keeps_gradients(cfg: DictConfig) -> bool:
        """Gradients as views of the buckets (``gradient_as_bucket_view``) live as long as the buckets: the dry
        run's replica keeps them between steps."""
        return bool(cfg.backend.gradient_as_bucket_view)

    @staticmethod
    def validate(cfg: DictConfig, plan) -> None:
        b = cfg.backend
        if b.dist_backend not in ("auto", "gloo", "nccl"):
            raise UserError("backend.dist_backend", b.dist_backend, "Unknown process-group backend.", "Use auto, gloo or nccl.")
        if b.dist_backend == "nccl" and plan.device_type != "cuda":
            raise UserError("backend.dist_backend", "nccl", "NCCL needs CUDA devices, and this run is on CPU.",
                            "Use backend.dist_backend=auto (gloo on CPU).")
        if b.bucket_cap_mb <= 0:
            raise UserError("backend.bucket_cap_mb", b.bucket_cap_mb, "It must be positive.", "Use e.g. 25.")

    @staticmethod
    def model_states(cfg: DictConfig, n_params: int, world: int, shape: dict, optim_bytes: float):
        # A full replica per rank (torch_step.replica_states). Gradients are views into DDP's buckets with
        # gradient_as_bucket_view; without it the buckets are a second fp32 copy of every gradient. One
        # all-reduce of the fp32 gradients per optimizer step (no_sync while accumulating): 2 x 4 bytes x P,
        # bucket by bucket (bucket_cap_mb) as the last micro-batch's backward fills them.
        import dataclasses
        import math

        P = float(n_params)
        states = replica_states(cfg, n_params, optim_bytes, buffers=0.0 if cfg.backend.gradient_as_bucket_view else 4 * P,
                                grads_freed=not cfg.backend.gradient_as_bucket_view,
                                comm_per_step=2 * 4 * P)
        buckets = max(1, math.ceil(4 * P / (float(cfg.backend.bucket_cap_mb) * 2 ** 20)))
        return dataclasses.replace(states, collectives=[Collective("all-reduce", 4 * P, "dp", "step", buckets, "backward")])

    def init(self) -> None:
        self.device = pick_device(self.plan, int(os.environ.get("LOCAL_RANK", 0)))
        init_process_group(self.cfg, self.device, self.bcfg.dist_backend)

    def prepare(self, build, total_steps: int) -> None:
        b = self.bcfg
        model = prepare_replica(build(allow_meta=True), self.cfg, self.device)
        # DDP broadcasts rank 0's parameters at construction, so every replica starts identical.
        self.ddp = DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=b.bucket_cap_mb, find_unused_parameters=b.find_unused_parameters,
            static_graph=b.static_graph, gradient_as_bucket_view=b.gradient_as_bucket_view,
            **_buffer_sync_kwargs(b.forward_sync_buffers))
        self.stepper = TorchStepper(self.ddp, self.cfg, self.device, self.plan.grad_accum_steps, total_steps)

    def forward_backward(self, inputs, targets, is_last_micro: bool, weight: torch.Tensor) -> torch.Tensor:
        # no_sync() skips the gradient all-reduce on non-final micro-steps; gradients accumulate locally.
        sync = contextlib.nullcontext() if is_last_micro else self.ddp.no_sync()
        return self.stepper.forward_backward(inputs, targets, weight, sync)

    step = forward_to("stepper", TorchStepper.step)  # gradients are already averaged: the norm is the global one
    eval_loss = forward_to("stepper", TorchStepper.eval_loss)

    checkpoint_format: ClassVar[str] = "dcp"

    @staticmethod
    def read_model_state(path: str, model: torch.nn.Module, meta: dict) -> dict[str, torch.Tensor]:
        return read_dcp_model_state(path, model, meta)

    save_checkpoint = forward_to("stepper", TorchStepper.save_checkpoint)  # of self.ddp, the stepper's model
    save_checkpoint_async = forward_to("stepper", TorchStepper.save_checkpoint_async)  # checkpoint.async_save
    load_checkpoint = forward_to("stepper", TorchStepper.load_checkpoint)
    training_state = forward_to("stepper", TorchStepper.training_state)
    load_training_state = forward_to("stepper", TorchStepper.load_training_state)

    all_reduce_mean = staticmethod(process_group.all_reduce_mean)
    barrier = staticmethod(process_group.barrier)

    def hf_model(self) -> torch.nn.Module:
        return self.ddp.module

    def reference_model(self, build) -> torch.nn.Module:
        """A frozen fp32 replica on every rank, under the policy's autocast, without DDP's wrapper (nothing to
        reduce): 4P bytes per rank (``Backend.reference_model``)."""
        if "reference" not in self.__dict__:
            self.reference = reference.replica(build, self.cfg, self.device)
        return self.reference

    def full_state_dict(self) -> dict | None:
        if self.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.ddp.module.state_dict().items()}

    def close(self) -> None:
        teardown(self, "stepper", "ddp", "reference")
