"""``backend=zero1|zero2|zero3`` (+ ``_offload``, ``zero_infinity``): a real DeepSpeed engine.

The DeepSpeed JSON is generated from the recipe (batch sizes, accumulation, clipping, optimizer,
precision, ZeRO knobs from the backend YAML): nothing is left as "auto". The learning-rate schedule is
shardyard's own (the same function every engine uses), handed to ``deepspeed.initialize`` as a callable
so DeepSpeed steps it on its optimizer; DeepSpeed's built-in schedulers differ by one step in warmup.
"""

from __future__ import annotations

import datetime
import json
import logging
import os

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from shardyard.backends import StepStats
from shardyard.backends.ddp import all_reduce_mean, init_process_group, teardown
from shardyard.backends.torch_step import pick_device
from shardyard.errors import UserError
from shardyard.model import META_INIT_ABOVE, apply_activation_checkpointing, causal_lm_loss, count_params
from shardyard.optim import build_scheduler, param_groups


def ds_config(cfg: DictConfig, plan) -> dict:
    """The complete DeepSpeed config for this recipe and launch."""
    b, pr, o = cfg.backend, cfg.precision, cfg.optim
    if o.name == "adamw":
        optimizer = {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                                 "weight_decay": o.weight_decay}}
    else:
        optimizer = {"type": "SGD", "params": {"lr": o.lr, "momentum": o.momentum, "nesterov": o.nesterov,
                                               "weight_decay": o.weight_decay}}
    zero = {"stage": b.stage, "overlap_comm": b.overlap_comm, "contiguous_gradients": b.contiguous_gradients,
            "reduce_scatter": b.reduce_scatter, "reduce_bucket_size": int(b.reduce_bucket_size),
            "allgather_bucket_size": int(b.allgather_bucket_size)}
    if b.stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(b.stage3_prefetch_bucket_size),
                    stage3_param_persistence_threshold=int(b.stage3_param_persistence_threshold),
                    stage3_max_live_parameters=int(b.stage3_max_live_parameters),
                    stage3_max_reuse_distance=int(b.stage3_max_reuse_distance),
                    stage3_gather_16bit_weights_on_model_save=b.stage3_gather_16bit_weights_on_model_save,
                    sub_group_size=int(b.sub_group_size))
    for what in ("optimizer", "param"):
        device = b[f"offload_{what}"]
        if device != "none":
            zero[f"offload_{what}"] = {"device": device, "pin_memory": b.pin_memory,
                                       **({"nvme_path": b.nvme_path} if device == "nvme" else {})}
    config = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "gradient_clipping": float(cfg.train.max_grad_norm),
        "optimizer": optimizer,
        "zero_optimization": zero,
        "bf16": {"enabled": pr.name == "bf16"},
        "fp16": {"enabled": pr.name == "fp16", "loss_scale": 0, "initial_scale_power": pr.initial_scale_power,
                 "loss_scale_window": pr.loss_scale_window, "hysteresis": pr.hysteresis,
                 "min_loss_scale": pr.min_loss_scale},
        "zero_allow_untested_optimizer": True,
        # Offloaded SGD (or AdamW with a user's choice) must be allowed to run as a plain torch optimizer.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": b.wall_clock_breakdown,
    }
    if pr.name == "bf16":  # bf16 compute, fp32 gradient accumulation (and fp32 master weights in ZeRO)
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


class DeepSpeedBackend:
    launcher = "elastic"

    def __init__(self, cfg: DictConfig, plan):
        self.cfg, self.plan, self.bcfg = cfg, plan, cfg.backend
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    @staticmethod
    def validate(cfg: DictConfig, plan) -> None:
        b = cfg.backend
        if b.stage not in (1, 2, 3):
            raise UserError("backend.stage", b.stage, "ZeRO has stages 1, 2 and 3.", "Use backend=zero1, zero2 or zero3.")
        for what in ("optimizer", "param"):
            if b[f"offload_{what}"] not in ("none", "cpu", "nvme"):
                raise UserError(f"backend.offload_{what}", b[f"offload_{what}"], "Unknown offload device.",
                                "Use none, cpu or nvme.")
        if b.offload_param != "none" and b.stage != 3:
            raise UserError("backend.offload_param", b.offload_param,
                            f"Only ZeRO-3 partitions parameters, so ZeRO-{b.stage} has no parameters to offload.",
                            "Use backend=zero3_offload (or zero_infinity), or backend.offload_param=none.")
        if "nvme" in (b.offload_optimizer, b.offload_param):
            path = b.nvme_path
            if not path or not os.path.isdir(path) or not os.access(path, os.W_OK):
                raise UserError("backend.nvme_path", path, "ZeRO-Infinity swaps tensors to a directory on fast local "
                                "storage, and this one is missing or not writable.",
                                "Use backend.nvme_path=/local_nvme/swap (an existing, writable directory).")
            from deepspeed.ops.op_builder import AsyncIOBuilder

            if not AsyncIOBuilder().is_compatible(verbose=False):
                raise UserError("backend", b.name, "ZeRO-Infinity needs DeepSpeed's async I/O op, and this machine "
                                "lacks its system library (libaio).",
                                "Install it (apt-get install libaio-dev) and reinstall deepspeed, or use "
                                "backend=zero3_offload (CPU offload).")
        if cfg.precision.name == "fp16":
            from deepspeed.accelerator import get_accelerator

            if plan.device_type == "cpu" or not get_accelerator().is_fp16_supported():
                raise UserError("precision", "fp16", f"DeepSpeed's {plan.device_type} accelerator has no fp16 support.",
                                "Use precision=bf16 (or fp32), or run on GPUs.")

    def init(self) -> None:
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self.device = pick_device(self.plan, int(os.environ.get("LOCAL_RANK", 0)))
        init_process_group(self.cfg, self.device)  # restart-safe; DeepSpeed adopts the existing group
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo",
                                   timeout=datetime.timedelta(seconds=self.cfg.launch.timeout_s))

    def prepare(self, build, total_steps: int) -> None:
        import deepspeed

        self.config = ds_config(self.cfg, self.plan)
        self._write_config()
        m = self.cfg.model
        big = m.init_device == "meta" or (m.init_device == "auto" and count_params(m) > META_INIT_ABOVE)
        if self.bcfg.stage == 3 and big:
            # HF sees the live ZeRO-3 config and builds under deepspeed.zero.Init: every parameter is
            # partitioned as soon as its module exists, and HF's init gathers each one to initialise it.
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_ds = HfDeepSpeedConfig(self.config)
        model = build(allow_meta=False)
        apply_activation_checkpointing(model, m)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, self.cfg.optim.weight_decay), config=self.config,
            lr_scheduler=lambda opt: build_scheduler(opt, self.cfg.sched, total_steps))

    def _write_config(self) -> None:
        if self.rank != 0:
            return
        text = json.dumps(self.config, indent=2)
        with open(os.path.join(self.cfg.run_dir, "deepspeed_config.json"), "w") as f:
            f.write(text + "\n")
        if self.bcfg.dump_config:
            print(f"shardyard | generated DeepSpeed config (lr schedule: shardyard's {self.cfg.sched.name}, "
                  f"passed as a callable):\n{text}", flush=True)

    def forward_backward(self, inputs, targets, is_last_micro: bool) -> torch.Tensor:
        loss = causal_lm_loss(self.engine, inputs, targets)
        self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
        if not is_last_micro:
            self.engine.step()  # bookkeeping only: not an accumulation boundary
        return loss.detach()

    def step(self) -> StepStats:
        assert self.engine.is_gradient_accumulation_boundary()
        lr = self.engine.get_lr()[0]
        self.engine.step()  # clip, optimizer step, our scheduler, zero grads
        norm = self.engine.get_global_grad_norm()  # pre-clip, over every partition
        scale = getattr(self.engine.optimizer, "cur_scale", None) if self.cfg.precision.name == "fp16" else None
        return StepStats(torch.as_tensor(float(norm if norm is not None else float("nan"))), lr,
                         float(scale) if scale is not None else None)

    @torch.no_grad()
    def eval_loss(self, inputs, targets) -> torch.Tensor:
        return causal_lm_loss(self.engine, inputs, targets).detach()

    def memory_breakdown(self) -> dict:
        """What DeepSpeed's ZeRO optimizers hold on this rank (attribute names of DeepSpeed 0.19)."""
        from shardyard.memory import breakdown, optimizer_state_tensors

        opt = self.engine.optimizer
        params = [getattr(p, "ds_tensor", p) for p in self.engine.module.parameters()]  # ZeRO-3: own partition
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        masters = []
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
            masters += list(getattr(opt, name, None) or [])
        grads += [m.grad for m in masters if m.grad is not None]
        for name in ("averaged_gradients", "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
                     "fp32_groups_gradients_flat", "grad_partitions_flat_buffer", "ipg_buffer"):
            value = getattr(opt, name, None)
            if isinstance(value, dict):
                value = list(value.values())
            if isinstance(value, torch.Tensor):
                value = [value]
            for v in value or []:
                grads += v if isinstance(v, list) else [v]
        return breakdown({"params": params, "grads": grads,
                          "optimizer": masters + list(optimizer_state_tensors(opt.optimizer if hasattr(opt, "optimizer") else opt))})

    checkpoint_format = "deepspeed"

    def save_checkpoint(self, path: str) -> None:
        # Collective: each rank writes its ZeRO partitions; DeepSpeed also saves our scheduler and its scaler.
        self.engine.save_checkpoint(path, tag="zero", save_latest=False)

    def load_checkpoint(self, path: str) -> None:
        load_path, _ = self.engine.load_checkpoint(path, tag="zero", load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        assert load_path is not None, f"DeepSpeed found no checkpoint under {path}"

    def training_state(self) -> dict:
        return {}  # inside DeepSpeed's own files

    def load_training_state(self, state: dict) -> None:
        pass

    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_mean(t)

    def barrier(self) -> None:
        dist.barrier()

    def hf_model(self) -> torch.nn.Module:
        return self.engine.module

    def full_state_dict(self) -> dict | None:
        if self.bcfg.stage == 3:  # collective: gathers one parameter at a time into rank 0
            sd = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            sd = self.engine.module.state_dict() if self.rank == 0 else None
        return {k: v.detach().cpu() for k, v in sd.items()} if self.rank == 0 else None

    def close(self) -> None:
        import deepspeed.comm

        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as ZeroInit

        if hasattr(self, "engine"):
            self.engine.destroy()  # removes its hooks and buffers
        # ZeRO-3 swaps torch.nn.functional.linear for its own memory-efficient version "until manually
        # reset"; left in place it slows down (and changes the autograd graph of) any later model in
        # this process.
        if hasattr(ZeroInit, "linear_bk"):
            torch.nn.functional.linear = ZeroInit.linear_bk
        # DeepSpeed's own teardown also drops its cached groups, so a later engine in this process (the
        # next job of an in-process sweep) starts from a clean slate.
        teardown(self, "engine", "_hf_ds", destroy=deepspeed.comm.destroy_process_group)
