"""``backend=zero1|zero2|zero3`` (+ ``_offload``, ``zero_infinity``): a real DeepSpeed engine.

The DeepSpeed JSON is generated from the recipe (batch sizes, accumulation, clipping, optimizer,
precision, ZeRO knobs from the backend YAML): nothing is left as "auto". The learning-rate schedule is
shardyard's own (the same function every engine uses), handed to ``deepspeed.initialize`` as a callable
so DeepSpeed steps it on its optimizer; DeepSpeed's built-in schedulers differ by one step in warmup.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import json
import logging
import math
import os
import shutil
from typing import ClassVar

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from shardyard.core.facts import Plan
from shardyard.backends import (FP32, HALF, Collective, ModelStates, StepStats, deepspeed_patches, process_group, reference,
                                refuse_speed_options)
from shardyard.backends.process_group import init_process_group, teardown
from shardyard.backends.torch_step import pick_device
from shardyard.core.errors import UserError
from shardyard.models import moe
from shardyard.core import op_builds
from shardyard.models.build import wants_meta
from shardyard.models.loss import causal_lm_loss, causal_lm_loss_sum
from shardyard.models.prepare import prepare_model
from shardyard.backends.optim import build_optimizer, build_scheduler, optimizer_kwargs, param_groups
from shardyard.core.safe_load import weights_only_loads


def ds_config(cfg: DictConfig, plan) -> dict:
    """The complete DeepSpeed config for this recipe and launch."""
    b, pr = cfg.backend, cfg.precision
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
            zero[f"offload_{what}"] = {"device": device, "pin_memory": b.pin_memory}
        if device == "nvme":
            # ZeRO-Infinity swaps into a directory of this run's own (two runs sharing a disk never read each
            # other's files); the buffers are the pinned host memory tensors pass through on their way.
            zero[f"offload_{what}"].update(nvme_path=swap_dir(cfg), buffer_count=b.nvme_buffer_count if what == "param"
                                           else b.nvme_optimizer_buffer_count)
            if what == "param":
                zero[f"offload_{what}"]["buffer_size"] = int(b.nvme_buffer_size)
    config = {
        # DeepSpeed's data-parallel world is every rank, and a sequence group's sp (cp) ranks each train a share of
        # the same micro-batch: it counts sp x cp "samples" where the run has one
        "train_batch_size": plan.global_batch_size * plan.dims.sp * plan.dims.cp,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "gradient_clipping": float(cfg.train.max_grad_norm),
        "zero_optimization": zero,
        "bf16": {"enabled": pr.name == "bf16"},
        "fp16": {"enabled": pr.name == "fp16", "loss_scale": 0, "initial_scale_power": pr.initial_scale_power,
                 "loss_scale_window": pr.loss_scale_window, "hysteresis": pr.hysteresis,
                 "min_loss_scale": pr.min_loss_scale},
        "zero_allow_untested_optimizer": True,
        # Offloaded SGD (or AdamW with a user's choice) must be allowed to run as a plain torch optimizer.
        "zero_force_ds_cpu_optimizer": False,
        # DeepSpeed prints its own timers (wall_clock_breakdown) every steps_per_print steps; nothing else.
        "steps_per_print": cfg.train.log_every_n_steps if b.wall_clock_breakdown else 10 ** 9,
        "wall_clock_breakdown": b.wall_clock_breakdown,
    }
    if "nvme" in (b.offload_optimizer, b.offload_param):  # DeepSpeed's async I/O to the swap files (libaio)
        config["aio"] = {"block_size": b.aio_block_size, "queue_depth": b.aio_queue_depth,
                         "intra_op_parallelism": b.aio_thread_count, "single_submit": b.aio_single_submit,
                         "overlap_events": b.aio_overlap_events, "use_gds": False}
    if b.flops_profiler:
        # DeepSpeed counts steps from 0 (global_steps before the step); ours are 1-based.
        config["flops_profiler"] = {"enabled": True, "profile_step": b.flops_profiler_step - 1, "module_depth": -1,
                                    "top_modules": 3, "detailed": True,
                                    "output_file": os.path.join(cfg.run_dir, "deepspeed_flops_profile.txt")}
    if pr.name == "bf16":  # bf16 compute, fp32 gradient accumulation (and fp32 master weights in ZeRO)
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    optimizer = ds_optimizer(cfg.optim)
    if optimizer is not None:
        config["optimizer"] = optimizer
    return config


def reference_ds_config(config: dict, cfg: DictConfig) -> dict:
    """The DeepSpeed config of the frozen reference model (``DeepSpeedBackend.reference_model``), from the
    policy's ``config`` as TRL's ``prepare_deepspeed`` makes it:

    1. No optimizer, no scheduler (nothing trains), nothing offloaded of an optimizer; no profiler or timers.
    2. ZeRO-3 stays stage 3, its parameters partitioned as the policy's (and offloaded as they are); ZeRO-1/2
       become stage 0, a plain replica: their partitions are of optimizer state and gradients, which a frozen
       model has none of.
    3. The same ``bf16``/``fp16`` sections, so that DeepSpeed casts the module as it cast the policy and the
       logits are the policy's.
    4. Parameters swapped to NVMe go to a directory of their own under the run's swap directory: DeepSpeed's
       parameter swapper empties its folder when it starts, which would be the policy's."""
    ref = copy.deepcopy(config)
    for key in ("optimizer", "scheduler", "flops_profiler"):  # 1
        ref.pop(key, None)
    ref["wall_clock_breakdown"] = False
    zero = ref["zero_optimization"]
    zero.pop("offload_optimizer", None)
    if zero["stage"] != 3:  # 2
        zero["stage"] = 0
    param = zero.get("offload_param", {})
    if param.get("device") == "nvme":  # 4
        param["nvme_path"] = os.path.join(swap_dir(cfg), "reference")
    else:
        ref.pop("aio", None)
    return ref


def swap_dir(cfg: DictConfig) -> str:
    """This run's ZeRO-Infinity swap directory under ``backend.nvme_path``: named after the run directory
    (the same on every rank and node, and again when the run resumes)."""
    import hashlib

    run = os.path.abspath(cfg.run_dir)
    return os.path.join(cfg.backend.nvme_path, f"shardyard-swap-{os.path.basename(run)}-"
                        f"{hashlib.sha256(run.encode()).hexdigest()[:8]}")


def remove_swap_files(cfg: DictConfig, rank: int) -> None:
    """This rank's swap files (DeepSpeed writes them under ``.../rank<N>/``), then whatever directories were
    left empty: no collective, so a rank whose peers died still cleans up after itself."""
    import shutil

    root = swap_dir(cfg)
    for dirpath, dirnames, _ in os.walk(root):
        if f"rank{rank}" in dirnames:
            shutil.rmtree(os.path.join(dirpath, f"rank{rank}"), ignore_errors=True)
    for dirpath, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):  # deepest first
        try:
            os.rmdir(dirpath)
        except OSError:
            pass  # another rank's files are still there: that rank removes the directory


def ds_optimizer(o: DictConfig) -> dict | None:
    """The JSON ``optimizer`` section for ``optim._target_``, or None when DeepSpeed is handed the built
    optimizer object instead (a client optimizer).

    1. A ``torch.optim`` class is expressed by name: DeepSpeed maps Adam/AdamW onto its own fused (GPU) or
       CPU-Adam (offload) kernels and builds any other name as ``torch.optim.<type>`` from the same params.
    2. Anything else (DeepSpeed's ``deepspeed.ops`` optimizers, a user's factory) is built by us from the
       recipe and passed to ``deepspeed.initialize(optimizer=...)``; ZeRO wraps it like its own.
    """
    module, _, name = o._target_.rpartition(".")
    if module != "torch.optim" or not hasattr(torch.optim, name):
        return None
    params = {k: list(v) if isinstance(v, tuple) else v for k, v in optimizer_kwargs(o).items()}
    return {"type": name, "params": params}


class DeepSpeedBackend:
    launcher: ClassVar[str] = "elastic"
    requires: ClassVar[str] = "deepspeed"
    """The optional package this engine needs (``shardyard.config.preflight``: the ``deepspeed`` extra, which ``make
    train``'s setup installs; its ops compile on first use)."""
    dry_run: ClassVar[str] = "estimators"
    """``plan.dry_run``: the plan's model states against DeepSpeed's own estimators; ZeRO allocates its flat
    partitions with real storage, so it does not run on fake tensors."""
    degree_keys: ClassVar[dict[str, str]] = {"sp": "backend.sp", "cp": "backend.cp"}

    @staticmethod
    def degrees(b: DictConfig) -> dict[str, int | None]:
        # ZeRO-3 shards the parameters; ZeRO-1/2 keep them whole on every rank (their optimizer-state and
        # gradient partitions do not change which batches a rank reads).
        return {"sp": int(b.get("sp", 1)), "cp": int(b.get("cp", 1)), "dp_shard" if b.stage == 3 else "dp_replicate": None}

    def __init__(self, cfg: DictConfig, plan: Plan):
        self.cfg, self.plan, self.bcfg = cfg, plan, cfg.backend
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.dp_rank, self.dp_size = self.rank, self.world_size

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
            # The buffer and aio sizes are bounded in schema.ZERO_RANGES (checked before this).
            from deepspeed.ops.op_builder import AsyncIOBuilder

            if not AsyncIOBuilder().is_compatible(verbose=False):
                raise UserError("backend", b.name, "ZeRO-Infinity needs DeepSpeed's async I/O op, and this machine "
                                "lacks its system library (libaio).",
                                "Install it (as root: apt-get install libaio-dev; `make test` does so where it "
                                "can; elsewhere ask for the libaio development package, or build libaio into a "
                                "prefix and set CFLAGS/LDFLAGS to it), or use backend=zero3_offload (CPU offload).")
        target = cfg.optim._target_
        if b.offload_optimizer != "none" and ds_optimizer(cfg.optim) is None and not target.startswith("deepspeed.ops."):
            raise UserError("optim._target_", target, f"{b.name} runs the optimizer step on the CPU (ZeRO-Offload), "
                            "which DeepSpeed does with its own CPU kernels or a torch.optim class, not with an "
                            "arbitrary optimizer object.",
                            "Use a torch.optim optimizer (optim=adamw, sgd, adafactor) or deepspeed.ops.adam."
                            "DeepSpeedCPUAdam, or the same engine without offload (backend=zero2/zero3).")
        why = {"fp8": "DeepSpeed's engine casts the model to bf16 itself and has no torchao float8 path here."}
        if b.stage == 3:
            inside = "ZeRO-3 gathers parameters in hooks on every submodule, inside the blocks that "
            why["compile"] = inside + "regional compile would trace."
            why["selective"] = inside + "the selective policy replays op by op (their allocations differ between " \
                                        "forward and the recompute)."
        refuse_speed_options(cfg, f"backend={b.name}", why)
        if cfg.precision.name == "fp16":
            from deepspeed.accelerator import get_accelerator

            if plan.device_type == "cpu" or not get_accelerator().is_fp16_supported():
                raise UserError("precision", "fp16", f"DeepSpeed's {plan.device_type} accelerator has no fp16 support.",
                                "Use precision=bf16 (or fp32), or run on GPUs.")

    @staticmethod
    def model_states(cfg: DictConfig, n_params: int, world: int, shape: dict, optim_bytes: float) -> ModelStates:
        """What DeepSpeed 0.19's ZeRO optimizers hold per rank for this recipe (read from its
        runtime/zero/stage_1_and_2.py, stage3.py and bf16_optimizer.py; measured by bench/memory.py and
        tests/dist/test_plan.py):

        1. Parameters in the precision's dtype (bf16/fp16: 2 bytes, fp32: 4); ZeRO-3 partitions them.
        2. An fp32 master copy of this rank's partition (4 P/N, made even when the parameters are fp32) and
           the optimizer state on it (opt x P/N).
        3. Gradients. ZeRO-1 under bf16 runs BF16_Optimizer: full bf16 gradients (2P) plus a full fp32
           accumulation buffer (4P) on every rank. Otherwise every stage reduces the gradients bucket by
           bucket during backward straight into an fp32 partition (4 P/N; grad_accum_dtype fp32 under
           bf16) and frees the full ones.
        4. Buffers: ZeRO-2/3's reduce bucket (reduce_bucket_size elements of the parameter dtype, two with
           overlap_comm, never more than the model), and ZeRO-3's gathered parameters: it fetches module by
           module, so the largest module's own parameters, computing and prefetched.
        5. offload_optimizer=cpu moves (2)'s master and state and the fp32 gradient partition to host RAM
           (nvme: master and state to backend.nvme_path); offload_param moves ZeRO-3's parameter partition.
        Communication, the ZeRO paper's volumes in the communication dtype (DeepSpeed's default: the
        parameters'): ZeRO-1 2P per step; ZeRO-2 a reduce-scatter per micro-batch and one all-gather per
        step; ZeRO-3 gather (forward, backward) and reduce-scatter on every micro-batch, 3P.
        6. For the step-time model (``collectives``): the reductions run bucket by bucket (reduce_bucket_size) while
           backward fills them (overlap_comm), the all-gather of ZeRO-1/2's updated parameters after the step
           on the critical path, ZeRO-3's gathers module by module ahead of use (its prefetch: two per block, forward
           and backward). offload_optimizer: each step the fp32 gradient partition goes to host RAM and the
           updated parameters come back (the host link), and CPU Adam steps this rank's partition; offload_param:
           the partition comes over the host link for each forward and backward.
        """
        b, P, N = cfg.backend, float(n_params), max(world, 1)
        c = FP32 if cfg.precision.name == "fp32" else HALF
        stage = b.stage
        params = c * P / N if stage == 3 else c * P
        master, optimizer = FP32 * P / N, optim_bytes * P / N
        if stage == 1 and cfg.precision.name == "bf16":
            grads_device, grads_partition = c * P + FP32 * P, 0.0
        else:
            grads_device, grads_partition = 0.0, FP32 * P / N
        buffers = 0.0
        if stage >= 2:
            buffers += c * min(float(b.reduce_bucket_size), P) * (2 if b.overlap_comm else 1)
        if stage == 3:
            buffers += c * 2 * shape["max_module_params"]
        device = {"params": params, "grads": grads_device + grads_partition, "optimizer": optimizer, "master": master,
                  "buffers": buffers}
        host: dict[str, float] = {}
        nvme = 0.0
        if b.offload_optimizer != "none":
            device["grads"] = grads_device
            host = {"grads": grads_partition, "master": master, "optimizer": optimizer}
            device["optimizer"] = device["master"] = 0.0
            if b.offload_optimizer == "nvme":  # swapped out; pinned swap buffers stay in host RAM
                nvme += master + optimizer
                host.update(master=0.0, optimizer=0.0, buffers=2 * FP32 * shape["max_block_params"])
        if stage == 3 and b.offload_param != "none":
            device["params"] = 0.0
            if b.offload_param == "nvme":
                nvme += params
            else:
                host["params"] = params
        comm = {1: (2 * c * P, 0.0), 2: (c * P, c * P), 3: (0.0, 3 * c * P)}[stage]
        reduces, gathers = math.ceil(P / float(b.reduce_bucket_size)), math.ceil(P / float(b.allgather_bucket_size))
        hide = "backward" if b.overlap_comm else "none"
        collectives = {  # 6
            1: [Collective("reduce-scatter", c * P, "dp", "step", reduces, hide),
                Collective("all-gather", c * P, "dp", "step", gathers)],
            2: [Collective("reduce-scatter", c * P, "dp", "micro", reduces, hide),
                Collective("all-gather", c * P, "dp", "step", gathers)],
            3: [Collective("all-gather", 2 * c * P, "dp", "micro", 2 * max(int(shape["blocks"]), 1), "prefetch"),
                Collective("reduce-scatter", c * P, "dp", "micro", reduces, hide)]}[stage]
        if b.offload_optimizer != "none":
            collectives.append(Collective("host", (FP32 + c) * P / N, "host", "step"))
        if stage == 3 and b.offload_param != "none":
            collectives.append(Collective("host", 2 * c * P / N, "host", "micro", 2 * max(int(shape["blocks"]), 1),
                                          "prefetch"))
        return ModelStates("fp32" if c == FP32 else "half", device, host, nvme, comm[0], comm[1], collectives=collectives,
                           cpu_optimizer_params=P / N if b.offload_optimizer != "none" else 0.0)

    def init(self) -> None:
        import deepspeed

        # DeepSpeed logs a lot at INFO; its timers (wall_clock_breakdown) are INFO too, so keep them then.
        logging.getLogger("DeepSpeed").setLevel(logging.INFO if self.bcfg.wall_clock_breakdown else logging.WARNING)
        self.device = pick_device(self.plan, int(os.environ.get("LOCAL_RANK", 0)))
        init_process_group(self.cfg, self.device)  # restart-safe; DeepSpeed adopts the existing group
        if self.device.type == "cpu":
            # DeepSpeed's CPU communication backend compiles its shared-memory op (about 2 minutes on 2 cores,
            # on first use) for `inference_all_reduce`, which only inference and AutoTP call; training's
            # collectives go through torch.distributed. Marking the op unavailable skips that build.
            import deepspeed.ops

            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
            # backend.device=cpu on a machine with GPUs: DeepSpeed would pick its CUDA accelerator by itself and
            # place the engine on cuda:LOCAL_RANK.
            from deepspeed.accelerator import get_accelerator, set_accelerator

            if get_accelerator().device_name() != "cpu":
                from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

                set_accelerator(CPU_Accelerator())
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo",
                                   timeout=datetime.timedelta(seconds=self.cfg.launch.timeout_s))

    def prepare(self, build, total_steps: int) -> None:
        import deepspeed

        from deepspeed.runtime.zero.partition_parameters import Init as ZeroInit

        self.config = ds_config(self.cfg, self.plan)
        self._write_config()
        # DeepSpeed compiles the ops this config needs on first use (its client optimizers when built): a build
        # lock left by a killed compile is reported here, naming the file, instead of waited on forever.
        op_builds.check_deepspeed_ops(op_builds.deepspeed_needs(self.config, self.cfg.optim._target_, self.bcfg.name))
        # ZeRO-3 numbers parameters with a process-wide counter (ds_id), and ZeRO-Infinity names its swap files
        # by those numbers: a resumed run finds its checkpoint's files only if it numbers its parameters as the
        # saving run did. Start from 0 as a fresh process does, also after an earlier engine in this process
        # (an in-process sweep job, a test's shared workers); that engine is closed, so no two live ids clash.
        ZeroInit.param_id = 0
        if self.bcfg.stage == 3:
            deepspeed_patches.keep_given_zero3_dtype()
        m = self.cfg.model
        if self.bcfg.stage == 3 and wants_meta(m, self.plan.facts):
            # HF sees the live ZeRO-3 config and builds under deepspeed.zero.Init: every parameter is
            # partitioned as soon as its module exists, and HF's init gathers each one to initialise it.
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_ds = HfDeepSpeedConfig(self.config)
        model = build(allow_meta=False)
        prepare_model(model, self.cfg, self.device)  # checkpointing, compile (ZeRO-1/2: validate), loss head
        client = build_optimizer(model, self.cfg.optim) if "optimizer" not in self.config else None
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, self.cfg.optim.weight_decay), config=self.config,
            optimizer=client, lr_scheduler=lambda opt: build_scheduler(opt, self.cfg.sched, total_steps))
        self._nonfinite: torch.Tensor | None = None
        if self.cfg.debug.nan_policy != "off":
            self._watch_gradients()

    def _write_config(self) -> None:
        if self.rank != 0:
            return
        text = json.dumps(self.config, indent=2)
        with open(os.path.join(self.cfg.run_dir, "deepspeed_config.json"), "w") as f:
            f.write(text + "\n")
        if self.bcfg.dump_config:
            print(f"shardyard | generated DeepSpeed config (lr schedule: shardyard's {self.cfg.sched._target_}, "
                  f"passed as a callable):\n{text}", flush=True)

    def forward_backward(self, inputs, targets, is_last_micro: bool, weight: torch.Tensor) -> torch.Tensor:
        ce_sum = causal_lm_loss_sum(self.engine, inputs, targets)
        # engine.backward divides by gradient_accumulation_steps and ZeRO averages over the data-parallel ranks:
        # the mean of the weighted micro-batch losses, i.e. the token-weighted mean (the weight counts both).
        # MoE balance losses keep the plain mean. Under fp16 DeepSpeed's own loss scale multiplies this loss.
        self.engine.backward((ce_sum * weight).sum() + moe.aux_loss(self.engine))
        if not is_last_micro:
            self.engine.step()  # bookkeeping only: not an accumulation boundary
        return ce_sum.detach()

    def step(self, guard: bool = False) -> StepStats:
        assert self.engine.is_gradient_accumulation_boundary()
        lr = self.engine.get_lr()[0]
        # Clip, optimizer step, our scheduler, zero grads. DeepSpeed checks the gradients itself and skips
        # an update whose norm is non-finite (its overflow path), whatever the precision.
        self.engine.step()
        norm = self.engine.get_global_grad_norm()  # pre-clip, over every partition
        norm = float(norm if norm is not None else float("nan"))
        scale = getattr(self.engine.optimizer, "cur_scale", None) if self.cfg.precision.name == "fp16" else None
        stats = StepStats(torch.as_tensor(norm), lr, float(scale) if scale is not None else None,
                          applied=self.engine.was_step_applied())
        if self._nonfinite is not None:
            if guard and not math.isfinite(norm):
                bad = self._nonfinite.nonzero()
                stats.nonfinite_param = int(bad[0]) if len(bad) else None
            self._nonfinite.zero_()
        return stats

    def _watch_gradients(self) -> None:
        """DeepSpeed reduces and partitions gradients inside backward and clears them on an overflow, so the
        first non-finite gradient is recorded as it is produced: a flag per parameter, set by a tensor hook
        on this rank's own (pre-reduction) gradient, read only after a non-finite step."""
        params = [p for p in self.engine.module.parameters() if p.requires_grad]  # as NonFiniteGuard.names
        flags = self._nonfinite = torch.zeros(len(params), dtype=torch.bool, device=self.device)

        def hook(i):
            def flag(grad):
                flags[i] |= ~torch.isfinite(grad).all()
            return flag

        for i, p in enumerate(params):
            p.register_hook(hook(i))

    @torch.no_grad()
    def eval_loss(self, inputs, targets) -> torch.Tensor:
        return causal_lm_loss(self.engine, inputs, targets).detach()

    checkpoint_format: ClassVar[str] = "deepspeed"

    @staticmethod
    def read_model_state(path: str, model: torch.nn.Module, meta: dict) -> dict[str, torch.Tensor]:
        """DeepSpeed's ``zero_to_fp32``: the fp32 masters of every rank's partitions, merged (each pickle vetted
        by opcode first, then read ``weights_only`` with ``_safe_globals`` only). ZeRO-Infinity's masters live in
        per-rank NVMe swap files, which it does not read: refused."""
        if meta.get("training_state", {}).get("nvme"):
            raise UserError("path", path, "It is a ZeRO-Infinity checkpoint: its fp32 weights live in per-rank NVMe "
                            "swap files, which DeepSpeed's zero_to_fp32 does not read.",
                            "Load the run's HF export (<run>/hf, written with checkpoint.save_final=true, or "
                            "checkpoint.export_hf=true for one beside every checkpoint).")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        from shardyard.models.adapters import frozen
        from shardyard.core.safe_load import refused, unsafe_global_in, weights_only_loads

        allowed = _safe_globals()
        found = unsafe_global_in(path, allowed)
        if found:
            raise refused(found[0], found[1], "a DeepSpeed checkpoint")
        with weights_only_loads(allowed, source=path), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):  # its progress bars
            state = get_fp32_state_dict_from_zero_checkpoint(path, tag="zero", exclude_frozen_parameters=frozen(model))
        return dict(state)

    def save_checkpoint(self, path: str) -> None:
        # Collective: each rank writes its ZeRO partitions; DeepSpeed also saves our scheduler and its scaler.
        # The universal-checkpoint marker lets ds_to_universal convert it later (world-size or stage changes).
        from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                    UNIVERSAL_CHECKPOINT_VERSION_VALUE)

        from shardyard.models.adapters import frozen

        self.engine.save_checkpoint(path, tag="zero", save_latest=False, client_state={
            UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}},
            exclude_frozen_parameters=frozen(self.engine.module))  # adapters: the base is re-read from model.weights

    def load_checkpoint(self, path: str, meta: dict) -> None:
        self._vet_pickles(path)
        saved_nvme, nvme = bool(meta["training_state"].get("nvme")), self._swaps_optimizer()
        if self.bcfg.offload_param == "nvme" and not nvme:
            raise UserError("backend.offload_optimizer", self.bcfg.offload_optimizer, "A resume with the parameters on "
                            "NVMe restores them from the fp32 masters, which shardyard does (and has tested) only "
                            "with the optimizer state swapped to NVMe too.", "Use backend.offload_optimizer=nvme "
                            "(zero_infinity's default), or backend.offload_param=cpu.").on_every_rank()
        if saved_nvme or nvme:
            # ZeRO-Infinity keeps its fp32 masters and Adam moments in per-rank swap files, which the checkpoint
            # copies (offloaded_tensors/rank<N>/), not in the partitions every other ZeRO layout reads.
            if not (saved_nvme and nvme and meta["world_size"] == self.world_size):
                raise UserError("checkpoint.resume", path, f"It was saved by {meta['engine']} x{meta['world_size']} "
                                f"and this run is {self.bcfg.name} x{self.world_size}. A ZeRO-Infinity checkpoint "
                                "holds its optimizer state in per-rank swap files, so it resumes only with the "
                                "optimizer on NVMe at the same world size, and other ZeRO checkpoints do not resume "
                                "into ZeRO-Infinity.",
                                f"Resume with backend={meta['engine']} on {meta['world_size']} ranks, or start a new "
                                "run from the checkpointed run's HF export (model.weights=<run>/hf).").on_every_rank()
            self._load(path)
            self._restore_swapped_optimizer(path)
            return
        saved_stage = meta["training_state"].get("zero_stage", self.bcfg.stage)
        if (saved_stage == 3) != (self.bcfg.stage == 3):
            # ds_to_universal keeps ZeRO-3's per-rank model files, which stages 1-2 do not read (and back).
            raise UserError("checkpoint.resume", path, f"It holds ZeRO-{saved_stage} partitions and this run is "
                            f"ZeRO-{self.bcfg.stage}. Supported changes of a DeepSpeed checkpoint: any world size "
                            "within ZeRO-1/2 (stages 1 and 2 interchangeable) and any world size within ZeRO-3, "
                            "offload variants included, through DeepSpeed's universal checkpoint.",
                            f"Resume with a ZeRO-{saved_stage} backend (backend=zero{saved_stage}), or start from "
                            "the checkpoint's HF export (model=hf model.path=...).").on_every_rank()
        same_layout = meta["world_size"] == self.world_size and saved_stage == self.bcfg.stage
        if same_layout:  # each rank reads back exactly the partition it wrote
            self._load(path)
            return
        from shardyard.models.adapters import frozen

        if frozen(self.engine.module):  # ds_to_universal expects every parameter in the checkpoint
            raise UserError("checkpoint.resume", path, f"It is an adapter-only checkpoint (the base is frozen) of "
                            f"ZeRO-{saved_stage} x{meta['world_size']}; DeepSpeed's universal conversion, which "
                            "reshards, is not proven for checkpoints without the frozen parameters.",
                            f"Resume at the same world size and stage (ZeRO-{saved_stage}, {meta['world_size']} "
                            "ranks), or use backend=fsdp/ddp, whose DCP checkpoints reshard.").on_every_rank()
        # ZeRO partitions are cut per rank and per stage, so another world size (or stage) cannot read them.
        # DeepSpeed's universal format stores every parameter whole (fp32 weights plus optimizer moments);
        # we convert once with its ds_to_universal and load that, so resharding needs no manual step.
        universal = self._to_universal(path)
        self.engine._config.load_universal_checkpoint = True  # DeepSpeed 0.19's switch, read at load time
        try:
            self._load(universal)
        finally:
            self.engine._config.load_universal_checkpoint = False
        self.barrier()
        if self.rank == 0:  # a full fp32 copy with optimizer state: too big to keep once loaded
            shutil.rmtree(universal, ignore_errors=True)
            print(f"shardyard | resharded ZeRO-{meta['training_state'].get('zero_stage', '?')} x{meta['world_size']} "
                  f"-> ZeRO-{self.bcfg.stage} x{self.world_size} through DeepSpeed's universal checkpoint", flush=True)

    def _load(self, path: str) -> None:
        with weights_only_loads(_safe_globals(), source=path):  # DeepSpeed's own loads use weights_only=False
            from shardyard.models.adapters import frozen

            load_path, _ = self.engine.load_checkpoint(path, tag="zero", load_optimizer_states=True,
                                                       load_lr_scheduler_states=True,
                                                       load_module_strict=not frozen(self.engine.module))
        assert load_path is not None, f"DeepSpeed found no checkpoint under {path}"

    def _swaps_optimizer(self) -> bool:
        return self.bcfg.offload_optimizer == "nvme"

    def _restore_swapped_optimizer(self, path: str) -> None:
        """Finish DeepSpeed 0.19's resume of an NVMe-offloaded optimizer (read from runtime/engine.py
        ``load_checkpoint`` and runtime/zero/stage3.py; measured by tests/dist/test_zero_infinity.py).

        DeepSpeed copies the checkpoint's swap files back and refreshes the parameters from the swapped fp32
        masters, but skips the optimizer's own checkpoint file. Three things are lost without this:

        1. Sub-groups below DeepSpeed's 1 MiB swap floor (the norms' group here) are never swapped: their fp32
           masters and Adam moments live in RAM and exist only in that file; they restarted from the fresh init.
        2. The swapped Adam moments: the swapper reads a state tensor's file (``<key>-<ds_id>.tensor.swp``)
           only once the optimizer holds that state, and a fresh optimizer holds none, so the first step
           started the moments from zero and overwrote the copied files.
        3. Adam's step counts (bias correction) and the loss scaler.

        So this rank's optimizer file is loaded into the base optimizer (step counts, RAM sub-groups'
        moments), RAM sub-groups get their fp32 masters and then their parameters, and swapped sub-groups get
        placeholders the size of their swap files (zero-stride views: no memory) so that the next swap-in
        reads the checkpoint's moments."""
        from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT

        zero = self.engine.optimizer  # DeepSpeedZeroOptimizer_Stage3; .optimizer is the base (CPU Adam)
        with weights_only_loads(_safe_globals(), source=path):
            sd = torch.load(self.engine._get_zero_ckpt_name(path, "zero"), map_location="cpu")["optimizer_state_dict"]
        zero.loss_scaler, zero.dynamic_loss_scale, zero.overflow = sd[LOSS_SCALER], sd["dynamic_loss_scale"], sd["overflow"]
        zero.checkpoint_event_prologue()  # every parameter partitioned, as DeepSpeed's own load starts
        zero._set_fp32_optimizer_param_groups()
        zero.optimizer.load_state_dict(sd[OPTIMIZER_STATE_DICT])
        zero._clear_fp32_optimizer_param_groups()
        for i, master in enumerate(zero.fp32_partitioned_groups_flat):
            if zero._swappable_optimizer_subgroup(i):
                numel = zero.optimizer_swapper.swap_params_info[master.ds_id].numel()
                state = zero.optimizer.state[master]
                for key, value in state.items():
                    if torch.is_tensor(value) and value.numel() == 0:  # released at save: its bytes are on disk
                        state[key] = torch.zeros(1, dtype=master.dtype).expand(numel)
            else:
                master.data.copy_(sd[FP32_FLAT_GROUPS][i])
                zero._reassign_or_swap_out_partitioned_parameters(i)  # the parameters from their fp32 masters
        zero.checkpoint_event_epilogue()  # unpartitioned (persistent) parameters gathered again

    def _to_universal(self, path: str) -> str:
        """Rank 0 converts ``path`` into ``<run_dir>/universal/<name>`` (under a temporary name first)."""
        out = os.path.join(self.cfg.run_dir, "universal", os.path.basename(os.path.normpath(path)))
        if self.rank == 0:
            import argparse
            import contextlib
            import io

            from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

            tmp = out + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
            args = argparse.Namespace(input_folder=os.path.join(path, "zero"), output_folder=os.path.join(tmp, "zero"),
                                      num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                      strict=True, inject_missing_state=True)
            # One extract/merge worker: the conversion runs in this process, inside the fence.
            with contextlib.redirect_stdout(io.StringIO()), weights_only_loads(_safe_globals(), source=path):
                ds_to_universal(args)
            os.replace(tmp, out)
        self.barrier()
        return out

    def training_state(self) -> dict:
        # The rest is inside DeepSpeed's own files.
        return {"zero_stage": self.bcfg.stage, "nvme": self._swaps_optimizer()}

    def load_training_state(self, state: dict) -> None:
        opt = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)  # ZeRO's base optimizer
        deepspeed_patches.continue_adam_bias_correction(opt, self.device)

    def _vet_pickles(self, path: str) -> None:
        """Rank 0 reads the globals of every rank's files (as opcodes) before any collective load: ZeRO-3 ranks
        each load only their own partition file, and rank 0 alone converts to a universal checkpoint, so a
        crafted file one rank reads would otherwise fail there alone and leave the others in a collective."""
        from shardyard.core.safe_load import refused, unsafe_global_in

        found = unsafe_global_in(path, _safe_globals()) if self.rank == 0 else None
        flag = torch.tensor([1.0 if found else 0.0], device=self.device)
        dist.all_reduce(flag)
        if found:
            raise refused(found[0], found[1], "a DeepSpeed checkpoint").on_every_rank()
        if flag.item():
            raise UserError("checkpoint.resume", path, "Rank 0 refused one of its files (its error is above).",
                            "Resume from an earlier checkpoint of the run.").on_every_rank()

    all_reduce_mean = staticmethod(process_group.all_reduce_mean)
    barrier = staticmethod(process_group.barrier)

    def hf_model(self) -> torch.nn.Module:
        return self.engine.module

    def reference_model(self, build) -> torch.nn.Module:
        """A DeepSpeed engine of its own without an optimizer (``reference_ds_config``), in eval mode: ZeRO-3
        partitions it as the policy, cP/N bytes per rank (c: the precision's bytes; offloaded as the policy's
        parameters are); ZeRO-1/2 hold a replica in the precision's dtype, cP. Where the policy was built under
        ``deepspeed.zero.Init`` (``HfDeepSpeedConfig``), the reference is too, under its own config; the
        policy's is the live one again after. Returned as the engine (``_bare`` finds the module inside)."""
        if "reference" in self.__dict__:
            return self.reference
        import deepspeed
        from transformers.integrations.deepspeed import HfDeepSpeedConfig, set_hf_deepspeed_config

        config = reference_ds_config(self.config, self.cfg)
        with reference.keep_rng(self.device):
            # ZeRO-3 and a model built on the meta device (``prepare``): HF holds the live config by a weak
            # reference, so this one is kept while the build runs.
            live = HfDeepSpeedConfig(config) if "_hf_ds" in self.__dict__ else None
            try:
                model = reference.build_frozen(build, self.cfg, allow_meta=False)
            finally:
                if live is not None:
                    set_hf_deepspeed_config(self._hf_ds)
            prepare_model(model, reference.options(self.cfg), self.device)  # nothing to apply: all off
            engine, _, _, _ = deepspeed.initialize(model=model, config=config)
        reference.frozen_forward(reference.freeze(engine.module))
        engine.eval()
        self.reference: torch.nn.Module = engine
        return engine

    def full_state_dict(self) -> dict | None:
        if self.bcfg.stage == 3:  # collective: gathers one parameter at a time into rank 0
            sd = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            sd = self.engine.module.state_dict() if self.rank == 0 else None
        return {k: v.detach().cpu() for k, v in sd.items()} if self.rank == 0 else None

    def close(self) -> None:
        import deepspeed.comm

        for name in ("reference", "engine"):  # the reference's engine first: built last
            if hasattr(self, name):
                engine = getattr(self, name)
                module = engine.module
                engine.destroy()  # removes its hooks and buffers
                if self.bcfg.stage == 3:
                    deepspeed_patches.release_zero3(module)
        deepspeed_patches.restore_torch_linear()
        # DeepSpeed's own teardown also drops its cached groups, so a later engine in this process (the
        # next job of an in-process sweep) starts from a clean slate.
        teardown(self, "engine", "reference", "_hf_ds", destroy=deepspeed.comm.destroy_process_group)
        if "nvme" in (self.bcfg.offload_optimizer, self.bcfg.offload_param):  # after the engine closed its files
            remove_swap_files(self.cfg, self.rank)


def _safe_globals() -> list:
    """The plain (data-only) classes DeepSpeed 0.19 pickles into its checkpoints besides tensors (found with
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` on fp32 and bf16 checkpoints of every stage;
    DynamicLossScaler is what fp16 runs hold in LossScaler's place)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]

