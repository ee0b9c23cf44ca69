"""The torch-native optimizer step shared by the single, DDP (and FSDP) engines, by composition."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from shardyard.backends import FP32, ModelStates, StepStats
from shardyard.backends.expert_parallel import clip_by_mesh
from shardyard.models import moe
from shardyard.core.memory import local
from shardyard.models.loss import causal_lm_loss, causal_lm_loss_sum
from shardyard.backends.optim import build_optimizer, build_scheduler

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
"""``precision.name`` -> the autocast dtype (fp8: bf16 around the float8 linears, which cast themselves); master
weights, gradients and reductions stay fp32."""


class TorchStepper:
    """Autocast forward, scaled backward over accumulation micro-steps, then unscale -> clip -> step."""

    def __init__(self, model: torch.nn.Module, cfg: DictConfig, device: torch.device, accum: int, total_steps: int,
                 scaler: torch.amp.GradScaler | None = None, autocast: bool = True,
                 wrap_optimizer: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None = None,
                 before_unscale: Callable[[], None] | None = None,
                 step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 norm_group: Any = None, own_param_groups: bool = False,
                 grad_norm: Callable[[list[torch.nn.Parameter]], torch.Tensor] | None = None):
        """``before_unscale`` / ``step_context``: an engine that reduces gradients inside its optimizer
        (Horovod) finishes the reduction before unscale and clip, and keeps the step from waiting again.
        ``norm_group``: the process group over which the rest of the model lives (a pipeline's stages): the
        global gradient norm sums the squared norms of every part. ``own_param_groups``: see
        ``load_checkpoint``. ``grad_norm``: the global gradient norm of the parameters, where torch's does not
        apply (gradients on several device meshes: expert parallelism)."""
        self.norm_group, self.own_param_groups, self.grad_norm = norm_group, own_param_groups, grad_norm
        pr = cfg.precision
        self.model, self.accum, self.device_type = model, accum, device.type
        self.max_norm = cfg.train.max_grad_norm
        self.before_unscale, self.step_context = before_unscale, step_context
        self.dtype = COMPUTE_DTYPES[pr.name]
        self.autocast_on = autocast and pr.name != "fp32"
        self.optimizer = build_optimizer(model, cfg.optim)
        if wrap_optimizer is not None:  # e.g. Horovod's DistributedOptimizer
            self.optimizer = wrap_optimizer(self.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.sched, total_steps)
        # fp16 needs dynamic loss scaling; fp32 master weights stay in the optimizer either way.
        self.scaler = scaler or torch.amp.GradScaler(
            device.type, init_scale=2.0 ** pr.initial_scale_power, growth_interval=pr.loss_scale_window,
            enabled=pr.name == "fp16")
        self.params = [p for p in model.parameters() if p.requires_grad]

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.autocast_on)

    def forward_backward(self, inputs, targets, weight: torch.Tensor,
                         sync_context=contextlib.nullcontext()) -> torch.Tensor:
        """``Backend.forward_backward``: the micro-batch's summed cross-entropies (detached, unweighted; one per
        loss term: the main head's, then each MTP depth's)."""
        with sync_context:
            with self.autocast():
                ce_sum = causal_lm_loss_sum(self.model, inputs, targets)
            # 1/accum here and the engine's mean over data-parallel ranks average the micro-batch losses; with
            # weight = accum x dp / (the step's label tokens), per loss term, that average is the token-weighted
            # mean of each term's cross-entropy. MoE balance losses keep the plain mean of micro-batches. The weight is a plain
            # factor before the fp16 loss scale, which the scaler applies (and removes) as before.
            self.scaler.scale(((ce_sum * weight).sum() + moe.aux_loss(self.model)) / self.accum).backward()
        return ce_sum.detach()

    def step(self, guard: bool = False) -> StepStats:
        if self.before_unscale is not None:
            self.before_unscale()
        self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.params if p.grad is not None]
        # Works for plain and DTensor (FSDP2) gradients alike: the global pre-clip norm.
        grad_norm = self.grad_norm(self.params) if self.grad_norm else torch.nn.utils.get_total_norm(grads)
        if isinstance(grad_norm, torch.distributed.tensor.DTensor):
            grad_norm = grad_norm.full_tensor()
        if self.norm_group is not None and self.grad_norm is None:  # a grad_norm function's norm is global already
            squared = grad_norm.float() ** 2
            torch.distributed.all_reduce(squared, group=self.norm_group)
            grad_norm = squared.sqrt()
        lr = self.optimizer.param_groups[0]["lr"]
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        # Under fp16 an overflow is routine: the scaler skips that step and lowers the scale by itself.
        if guard and not self.scaler.is_enabled() and not torch.isfinite(grad_norm).item():
            # The norm is global, so every rank takes this branch together. Look before clipping (which
            # would spread the NaN to every gradient), then drop the update.
            bad = next((i for i, p in enumerate(self.params)
                        if p.grad is not None and not torch.isfinite(local(p.grad)).all()), None)
            self.scheduler.step()
            self.optimizer.zero_grad()
            return StepStats(grad_norm.detach(), lr, scale, applied=False, nonfinite_param=bad)
        if self.max_norm > 0:
            clip = clip_by_mesh if self.grad_norm else torch.nn.utils.clip_grads_with_norm_
            clip(self.params, self.max_norm, grad_norm)
        with self.step_context():
            self.scaler.step(self.optimizer)  # skipped by the scaler when fp16 gradients overflowed
        self.scaler.update()
        # An overflow lowers the scale (only fp16 has one).
        applied = scale is None or self.scaler.get_scale() >= scale
        self.scheduler.step()
        self.optimizer.zero_grad()  # set_to_none=True is the default (and Horovod takes no argument)
        return StepStats(grad_norm.detach(), lr, scale, applied=applied)

    @torch.no_grad()
    def eval_loss(self, inputs, targets) -> torch.Tensor:
        with self.autocast():
            return causal_lm_loss(self.model, inputs, targets).detach()

    def training_state(self) -> dict:
        """Scheduler and loss-scaler state (JSON-able); model and optimizer go into the engine's shards."""
        sched = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        return {"scheduler": sched, "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None}

    def load_training_state(self, state: dict) -> None:
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **state["scheduler"]})
        # The learning rate the saved run would step with next (the same value its optimizer held; set here for
        # engines whose param groups come from the fresh optimizer: own_param_groups=True).
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def save_checkpoint(self, path: str) -> None:
        """torch.distributed.checkpoint (the ``dcp`` format): every rank writes its own shards (replicated
        tensors once). A partly frozen model (adapters) saves only its trainable tensors: the base is re-read
        from model.weights."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_dcp_options(self.model))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    def save_checkpoint_async(self, path: str, group: Any, stager: Any = None) -> Any:
        """``save_checkpoint`` in the background (``checkpoint.async_save``): the state is copied to host memory
        now (``stager``: the caller's, whose host buffer every save reuses; DCP's default, a new copy each time,
        without one), so the next steps cannot change what is written, and written by a thread, whose
        collectives run over ``group`` (gloo, apart from the training's). Returns the write's Future."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_dcp_options(self.model))
        return dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group,
                              no_dist=not dist.is_initialized(), async_stager=stager)

    def load_checkpoint(self, path: str, meta: dict) -> None:
        """Loads into this run's layout, so a checkpoint resumes at another world size (DCP reshards; ``meta``
        is not needed). ``own_param_groups``: keep this optimizer's param groups (hyperparameters from the
        recipe, the learning rate from the scheduler's state). DCP writes non-tensor values from rank 0 only, so
        a rank whose parameters rank 0 does not hold (a later pipeline stage) finds no param groups of its own
        in the file."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from shardyard.core.safe_load import dcp_load

        model = self.model
        options = _dcp_options(model)
        model_sd, optim_sd = get_state_dict(model, self.optimizer, options=options)
        state: dict = {"model": model_sd, "optim": optim_sd}
        groups = copy.deepcopy(optim_sd["param_groups"])
        dcp_load(state, path)  # dcp.load, unpickling nothing but data (DCP's own reads pickle.load)
        if self.own_param_groups:
            state["optim"]["param_groups"] = groups
        set_state_dict(model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)


def read_dcp_model_state(path: str, model: torch.nn.Module, meta: dict) -> dict[str, torch.Tensor]:
    """``Backend.read_model_state`` of the DCP engines: every rank's shards read into whole tensors in this one
    process (``no_dist``), into ``model``'s own tensors in place (no second copy of the model); the ``.metadata``
    pickle through the exact unpickler, the shards ``weights_only``."""
    import os

    import torch.distributed.checkpoint as dcp

    from shardyard.models.adapters import checkpoint_state
    from shardyard.core.safe_load import dcp_reader, read_dcp_metadata, weights_only_loads

    metadata = read_dcp_metadata(path)
    saved = {k[len("model."):] for k in metadata.state_dict_metadata if k.startswith("model.")}
    state = {"model": {k: v.detach() for k, v in checkpoint_state(model).items() if k in saved}}
    with weights_only_loads(source=os.path.join(path, "*.distcp")):
        dcp.load(state, storage_reader=dcp_reader(path, metadata), no_dist=True)
    return state["model"]


def _dcp_options(model: torch.nn.Module):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from shardyard.models.adapters import frozen

    # The frozen base is not in the checkpoint, so loading it back is not strict about the base's keys.
    return StateDictOptions(ignore_frozen_params=True, strict=False) if frozen(model) else StateDictOptions()


def pick_device(plan, local_rank: int) -> torch.device:
    if plan.device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def replica_states(cfg: DictConfig, n_params: int, optim_bytes: float, buffers: float = 0.0,
                   comm_per_step: float = 0.0, grads_freed: bool = True) -> ModelStates:
    """What a full-replica engine (single, DDP, Horovod) holds per rank, whatever the world size.

    1. Autocast trains fp32 parameters in every precision: they are the master weights (no separate copy),
       and bf16/fp16 matmuls cast them on the fly (those copies are activations: ``plan._activations``).
    2. Gradients are fp32 like their parameters; the optimizer keeps ``optim_bytes`` per parameter.
    3. ``grads_freed``: the step frees the gradients (``zero_grad(set_to_none=True)``) and backward rebuilds them as
       it frees the activations, so without accumulation the two do not peak together (the dry run: the default
       run's replica peaks 14% below their sum); not when an engine keeps them in its own buffers (DDP's
       bucket views).
    """
    regime = "fp32" if cfg.precision.name == "fp32" else "autocast"
    P = float(n_params)
    return ModelStates(regime, {"params": FP32 * P, "grads": FP32 * P, "optimizer": optim_bytes * P, "buffers": buffers},
                       comm_per_step=comm_per_step, grads_freed_each_step=grads_freed)

