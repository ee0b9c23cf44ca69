"""``backend=horovod``: Horovod 0.28.1, launched by Horovod's runner (``horovodrun --gloo`` or ``--mpi``) or by a
plain ``mpirun``; ``backend.controller`` says which controller coordinates the workers."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig

from shardyard.core.facts import Plan
from shardyard.backends import Collective, reference, refuse_speed_options
from shardyard.backends.forward import forward_to
from shardyard.backends.torch_step import TorchStepper, pick_device, replica_states
from shardyard.core.errors import UserError
from shardyard.models.prepare import prepare_replica


class HorovodBackend:
    launcher: ClassVar[str] = "horovod"
    requires: ClassVar[str] = "horovod"
    """The optional package this engine needs (``shardyard.config.preflight``: the ``horovod`` extra, built by setup)."""
    dry_run: ClassVar[str] = "replica"
    """``plan.dry_run``: every rank is one whole replica, which the dry run simulates on the ``single`` engine's
    code (the replica this engine wraps); its gradient buckets are checked by arithmetic."""
    degree_keys: ClassVar[dict[str, str]] = {}

    @staticmethod
    def degrees(b: DictConfig) -> dict[str, int | None]:
        return {"dp_replicate": None}  # every rank a whole replica

    def __init__(self, cfg: DictConfig, plan: Plan):
        self.cfg, self.plan, self.bcfg = cfg, plan, cfg.backend

    @staticmethod
    def validate(cfg: DictConfig, plan) -> None:
        from shardyard.core.dist_env import detect

        try:
            import horovod.torch as hvd
        except ImportError as e:
            raise UserError("backend", "horovod", f"Horovod is not installed or not built for this torch ({e}).",
                            "Run `make setup` (it builds Horovod 0.28.1 with PyTorch + Gloo, and MPI when Open MPI "
                            "is installed), or pick another backend.") from None
        refuse_speed_options(cfg, "backend=horovod", {"fp8": "float8 training is proven here on single, ddp and "
                                                      "fsdp only."})
        if cfg.backend.compression not in ("none", "fp16"):
            raise UserError("backend.compression", cfg.backend.compression, "Unknown gradient compression.",
                            "Use none or fp16.")
        env = detect()
        if env is not None and env.launcher == "elastic" and env.world_size > 1:
            raise UserError("backend", "horovod", "Horovod workers must be started by Horovod's runner or mpirun, "
                            "not by torchrun/deepspeed.", "Use `python train.py backend=horovod launch.nproc_per_node=N`, "
                            "`horovodrun -np N python train.py backend=horovod` or `mpirun -np N python train.py "
                            "backend=horovod`.")
        if env is None and plan.nnodes > 1:
            raise UserError("launch.nnodes", plan.nnodes, "Horovod's runner reaches other hosts over ssh (or MPI), "
                            "not through launch.rdzv_endpoint.", "Start it on the first host with `horovodrun -np N "
                            "-H host1:n,host2:n python train.py backend=horovod` (docs/clusters.md), leaving "
                            "launch.nnodes=1.")
        controller = cfg.backend.controller
        wants_mpi = controller == "mpi" or (env is not None and env.launcher == "mpi")
        if wants_mpi and not hvd.mpi_built():
            raise UserError("backend.controller", controller, "This Horovod was built without MPI"
                            + (" but the workers were started by mpirun." if env is not None else "."),
                            "Install Open MPI (`apt-get install openmpi-bin libopenmpi-dev`) and run `make setup` "
                            "again: it rebuilds Horovod with the MPI controller (about 6 minutes, once). Or use "
                            "backend.controller=gloo with launch.nproc_per_node=N.")
        if env is None and controller == "mpi" and plan.world_size > 1:
            import shutil

            if shutil.which("mpirun") is None:
                raise UserError("backend.controller", "mpi", "mpirun is not on PATH; `horovodrun --mpi` runs it.",
                                "Put Open MPI's bin directory on PATH, or use backend.controller=gloo.")
        if env is not None and env.launcher == "mpi" and controller == "gloo":
            raise UserError("backend.controller", "gloo", "The workers were started by mpirun (or horovodrun "
                            "--mpi), whose processes coordinate over MPI; Horovod's Gloo controller needs the "
                            "rendezvous that `horovodrun --gloo` provides.", "Leave backend.controller=auto (or set "
                            "mpi) under mpirun, or start the workers with `horovodrun --gloo` or our own "
                            "launch.nproc_per_node=N.")
        if env is not None and env.launcher == "horovod" and controller == "mpi":
            raise UserError("backend.controller", "mpi", "The workers were started by `horovodrun --gloo`.",
                            "Start them with `horovodrun --mpi` or `mpirun`, or leave backend.controller=auto.")

    @staticmethod
    def model_states(cfg: DictConfig, n_params: int, world: int, shape: dict, optim_bytes: float):
        # A full replica per rank (torch_step.replica_states) plus Horovod's fusion buffer, which packs small
        # gradients for one all-reduce (HOROVOD_FUSION_THRESHOLD, 128 MiB unless set). Gradients are
        # all-reduced once per optimizer step, as fp16 with compression=fp16, else fp32.
        P = float(n_params)
        fusion = min(float(os.environ.get("HOROVOD_FUSION_THRESHOLD", 128 * 2 ** 20)), 4 * P)
        reduce_bytes = 2 if cfg.backend.compression == "fp16" else 4
        # For the step-time model: the all-reduce runs fused buffer by fused buffer as the last backward of the step
        # produces gradients (its background thread overlaps them with the rest of backward).
        import dataclasses
        import math

        states = replica_states(cfg, n_params, optim_bytes, buffers=fusion, comm_per_step=2 * reduce_bytes * P)
        calls = max(1, math.ceil(reduce_bytes * P / max(fusion, 1.0)))
        return dataclasses.replace(states, collectives=[Collective("all-reduce", reduce_bytes * P, "dp", "step", calls,
                                                                   "backward")])

    def init(self) -> None:
        import horovod.torch as hvd

        if self.bcfg.timeline:
            os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")  # lets us start it from here, on every rank
        hvd.init()
        self.hvd = hvd
        # Which controller Horovod really runs (mpirun's workers: MPI; horovodrun --gloo's: Gloo); the summary and
        # the first log line name it.
        self.controller = "mpi" if hvd.mpi_enabled() else "gloo"
        if hvd.rank() == 0:
            print(f"shardyard | horovod: {hvd.size()} worker{'s' * (hvd.size() != 1)}, {self.controller.upper()} "
                  "controller", flush=True)
        self.rank, self.world_size = hvd.rank(), hvd.size()
        self.dp_rank, self.dp_size = self.rank, self.world_size
        self.device = pick_device(self.plan, hvd.local_rank())
        if self.bcfg.timeline:
            # Every rank must call it (it is coordinated); rank 0 writes the Chrome-trace JSON.
            hvd.start_timeline(os.path.join(self.cfg.run_dir, "horovod_timeline.json"), mark_cycles=False)

    def prepare(self, build, total_steps: int) -> None:
        hvd = self.hvd
        model = prepare_replica(build(allow_meta=True), self.cfg, self.device)
        compression = hvd.Compression.fp16 if self.bcfg.compression == "fp16" else hvd.Compression.none

        def distributed(optimizer):
            # Rank 0's initial weights everywhere, then gradient all-reduce hooks that fire once every
            # `backward_passes_per_step` backward passes: Horovod's own gradient accumulation.
            # No hvd.broadcast_optimizer_state: the optimizer is new (empty state, same config on every rank;
            # a resume loads the same optimizer.pt everywhere), and on an empty state it runs one optimizer
            # step on zero gradients, whose decoupled weight decay shrinks every decayed weight by
            # (1 - lr * weight_decay) before training. (DistributedOptimizer below is a new instance from
            # param_groups, so that step's state is dropped anyway; only the weight change remained.)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            compression=compression, op=hvd.Average,
                                            backward_passes_per_step=self.plan.grad_accum_steps)

        self.model = model

        def hvd_optimizer() -> Any:  # hvd.DistributedOptimizer: a torch optimizer class made at runtime
            return self.stepper.optimizer

        # Horovod's AMP pattern: synchronize() finishes the gradient all-reduces before unscale and clip; the
        # step then runs inside skip_synchronize() so the optimizer does not wait for them a second time.
        self.stepper = TorchStepper(model, self.cfg, self.device, self.plan.grad_accum_steps, total_steps,
                                    wrap_optimizer=distributed, before_unscale=lambda: hvd_optimizer().synchronize(),
                                    step_context=lambda: hvd_optimizer().skip_synchronize())

    def forward_backward(self, inputs, targets, is_last_micro: bool, weight: torch.Tensor) -> torch.Tensor:
        # The stepper's 1/accum and DistributedOptimizer's hvd.Average (it accumulates backward_passes_per_step
        # passes without dividing) average the weighted micro-batch losses, as DDP does.
        return self.stepper.forward_backward(inputs, targets, weight)

    step = forward_to("stepper", TorchStepper.step)  # synchronize() -> unscale -> clip -> skip_synchronize(): step
    eval_loss = forward_to("stepper", TorchStepper.eval_loss)

    checkpoint_format: ClassVar[str] = "torch-rank0"

    @staticmethod
    def read_model_state(path: str, model: torch.nn.Module, meta: dict) -> dict[str, torch.Tensor]:
        """Rank 0's ``model.safetensors`` (every rank held the same replica)."""
        from safetensors.torch import load_file

        return load_file(os.path.join(path, "model.safetensors"))

    def save_checkpoint(self, path: str) -> None:
        # Every rank holds the same replica and optimizer state: rank 0 writes them, once.
        if self.rank == 0:
            from safetensors.torch import save_file

            from shardyard.models.adapters import checkpoint_state  # adapters only, when the base is frozen

            save_file({k: v.contiguous() for k, v in checkpoint_state(self.model).items()},
                      os.path.join(path, "model.safetensors"))
            torch.save(self.stepper.optimizer.state_dict(), os.path.join(path, "optimizer.pt"))

    def load_checkpoint(self, path: str, meta: dict) -> None:
        from safetensors.torch import load_file

        from shardyard.models.adapters import frozen
        from shardyard.core.safe_load import load_weights_only

        self.model.load_state_dict(load_file(os.path.join(path, "model.safetensors"), device=str(self.device)),
                                   strict=not frozen(self.model))
        self.stepper.optimizer.load_state_dict(load_weights_only(os.path.join(path, "optimizer.pt"),
                                                                 map_location=self.device))

    training_state = forward_to("stepper", TorchStepper.training_state)
    load_training_state = forward_to("stepper", TorchStepper.load_training_state)

    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        return self.hvd.allreduce(t.detach(), op=self.hvd.Average, name="shardyard.metric")

    def barrier(self) -> None:
        self.hvd.barrier()

    def hf_model(self) -> torch.nn.Module:
        return self.model

    def reference_model(self, build) -> torch.nn.Module:
        """A frozen fp32 replica on every rank, under the policy's autocast, in no ``DistributedOptimizer`` and
        with no broadcast (``build`` gives every rank the same weights): 4P bytes per rank
        (``Backend.reference_model``)."""
        if "reference" not in self.__dict__:
            self.reference = reference.replica(build, self.cfg, self.device)
        return self.reference

    def full_state_dict(self) -> dict | None:
        if self.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        if not hasattr(self, "hvd"):
            return
        if self.bcfg.timeline:
            self.hvd.stop_timeline()
        self.__dict__.pop("stepper", None)
        self.__dict__.pop("model", None)
        self.__dict__.pop("reference", None)
        self.hvd.shutdown()
