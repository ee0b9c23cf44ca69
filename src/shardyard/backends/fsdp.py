"""``backend=fsdp`` / ``fsdp_offload``: FSDP2 (``torch.distributed.fsdp.fully_shard``), per block and at the root."""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from omegaconf import DictConfig
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from shardyard.core.facts import Plan
from shardyard.backends import (FP32, HALF, Collective, ModelStates, expert_parallel_states, fsdp_buffers, process_group,
                                reference, refuse_speed_options, smoke_degree, uneven_shard_ends)
from shardyard.backends.expert_parallel import shard_experts, stepper_options
from shardyard.models.moe import expert_modules
from shardyard.backends.forward import forward_to
from shardyard.backends.process_group import init_process_group, teardown
from shardyard.backends.torch_step import COMPUTE_DTYPES, TorchStepper, pick_device, read_dcp_model_state
from shardyard.core.errors import UserError
from shardyard.models.build import materialize
from shardyard.models.prepare import prepare_model
from shardyard.models.shape import transformer_blocks


def parallelize_fsdp(model: torch.nn.Module, cfg: DictConfig, device: torch.device,
                     mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """Float8 linears -> activation checkpointing -> compile -> chunked loss head -> experts to their EP ranks
    -> shard blocks -> shard root -> materialise. In this order because:

    1. ``prepare_model``: float8 linears (``precision=fp8``) replace the blocks' layers before anything wraps
       them; activation checkpointing wraps each block's forward inside FSDP's hooks, so that the pre-forward
       all-gather runs again when the block is recomputed in backward.
    2. Compile each block next (in ``prepare_model``): FSDP2's hooks then sit outside the compiled graphs (one
       graph serves every identical block; graph breaks on collectives are avoided). The chunked loss head
       (``model.loss_chunk``) runs inside the root's forward, whose parameters stay unsharded until backward.
    3. Expert parallelism (``mesh``: the (edp, ep) mesh, when ``backend.ep`` > 1): each rank keeps its
       ``E / ep`` routed experts of every MoE layer (``expert_parallel.shard_experts``), and FSDP shards them
       over ``edp`` as their own unit (``ExpertGradients`` divides their gradients by ep as well: the EP peers'
       tokens are already summed in them).
    4. Shard every transformer block as its own unit (its all-gather overlaps the previous block's
       compute), then the root, which takes what is left: embeddings, final norm and LM head; over every rank
       (with EP: the flattened edp x ep mesh). With HSDP (``backend.replicate``: the engine's mesh has a
       ``replicate`` dimension) each of these meshes gets the copies as its outer dimension (``with_copies``):
       FSDP2 shards over the inner one and all-reduces the reduce-scattered gradients over the outer one.
    5. A big model was built on the meta device; only now, sharded, does each rank give its own shards
       storage and initialise them, so no rank ever holds the full model. With CPU offload the shards get
       host memory and the buffers the compute device: the offload policy moves parameters, never buffers,
       and the forward reads them beside its activations (a V3 router's ``e_score_correction_bias``).
    """
    b, pr = cfg.backend, cfg.precision
    prepare_model(model, cfg, device)  # 1, 2
    # bf16/fp16: parameters all-gathered in the compute dtype, gradients reduced in fp32; the sharded fp32
    # parameters are the master weights the optimizer updates.
    mp = MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[pr.name], reduce_dtype=torch.float32) \
        if pr.name != "fp32" else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if b.cpu_offload else OffloadPolicy()
    names = mesh.mesh_dim_names or () if mesh is not None else ()
    dp = with_copies(mesh, mesh["shard"]) if mesh is not None and "shard" in names else None  # 4: HSDP
    if mesh is not None and "ep" in names:  # 3
        shard_experts(model, mesh["ep"], b.ep_capacity_factor)
        dp = with_copies(mesh, mesh["edp", "ep"]._flatten("dp"))
        for experts in expert_modules(model):
            fully_shard(experts, mesh=with_copies(mesh, mesh["edp"]), reshard_after_forward=b.reshard_after_forward,
                        mp_policy=mp, offload_policy=offload)
    for block in transformer_blocks(model):  # 4
        fully_shard(block, mesh=dp, reshard_after_forward=b.reshard_after_forward, mp_policy=mp,
                    offload_policy=offload)
    # The root is all-gathered again right at the start of backward: keeping it unsharded saves that.
    fully_shard(model, mesh=dp, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    materialize(model, torch.device("cpu") if b.cpu_offload else device, cfg.seed, cfg.model, buffers=device)  # 5
    if not b.cpu_offload:
        model.to(device)
    return model


def fsdp_mesh(device_type: str, outer: dict[str, int], replicate: int, shard: dict[str, int],
              inner: dict[str, int]) -> DeviceMesh:
    """The one mesh of an engine built on FSDP2, its dimensions outermost first: ``outer`` (pipeline stages), then
    HSDP's copies (``replicate``, left out at 1), then the shard group's dimensions (``shard``: ``shard``, ``dp``
    or ``edp`` x ``ep``), then ``inner`` (tensor parallel). The copies sit outside the shard group, so a shard
    group is consecutive ranks (whole nodes, where its all-gathers stay on NVLink) and only the copies'
    all-reduce crosses between them."""
    dims = {**outer, **({"replicate": replicate} if replicate > 1 else {}), **shard, **inner}
    return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def with_copies(mesh: DeviceMesh, shard: DeviceMesh) -> DeviceMesh:
    """What ``fully_shard`` runs on for a shard group ``shard`` of the engine's ``mesh``: the shard group itself,
    or, with HSDP's copies (a ``replicate`` dimension), the 2-D (replicate, shard) mesh."""
    if "replicate" not in (mesh.mesh_dim_names or ()):
        return shard
    return DeviceMesh._concatenate([mesh["replicate"], shard])


def gather_full_state_dict(model: torch.nn.Module, rank: int) -> dict | None:
    """The full state dict of a model sharded by FSDP2 (over a 1D or a 2D mesh): gathered tensor by tensor
    into rank 0's CPU memory; the other ranks receive nothing (None)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if rank == 0 else None


class FSDPBackend:
    launcher: ClassVar[str] = "elastic"
    dry_run: ClassVar[str] = "engine"
    """``plan.dry_run``: this engine itself runs on a fake process group and fake tensors (``shardyard.planning.dryrun``)."""
    degree_keys: ClassVar[dict[str, str]] = {"dp_replicate": "backend.replicate", "ep": "backend.ep",
                                             "sp": "backend.sp", "cp": "backend.cp"}

    @staticmethod
    def degrees(b: DictConfig) -> dict[str, int | None]:
        # the shards take the ranks the copies leave (HSDP: backend.replicate copies); EP borrows from the shards.
        # A sequence's sp (cp) ranks shard the parameters with the others (the shard group is world / replicate ranks)
        return {"dp_replicate": int(b.get("replicate", 1)), "sp": int(b.get("sp", 1)), "cp": int(b.get("cp", 1)),
                "dp_shard": None, "ep": int(b.ep)}

    @staticmethod
    def dry_run_roles(cfg: DictConfig, dims) -> list[tuple[int, str, int]]:
        """The ranks whose figures can differ: the ends of the shards, or the first alone where every parameter
        divides evenly (``uneven_shard_ends``; with expert parallelism the ends of each group; with HSDP, of the
        first copy's shard group: every copy holds the same)."""
        return uneven_shard_ends(cfg, dims.shard_group)

    @staticmethod
    def for_smoke(cfg: DictConfig, world: int) -> None:
        """``+scale=smoke``: expert parallel over as much of the smoke world as it fits (the smoke MoE's 4
        experts divide any smoke world)."""
        cfg.backend.ep = smoke_degree(cfg.backend.ep, world)

    def __init__(self, cfg: DictConfig, plan: Plan):
        self.cfg, self.plan, self.bcfg = cfg, plan, cfg.backend
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.dp_rank, self.dp_size = self.rank, self.world_size

    @staticmethod
    def validate(cfg: DictConfig, plan) -> None:
        if cfg.precision.name == "fp16" and plan.device_type == "cpu":
            raise UserError("precision", "fp16", "FSDP2 keeps fp16 parameters for compute, and fp16 matmuls on CPU "
                            "are emulated and unstable.", "Use precision=bf16 (or fp32) on CPU; fp16 works on CUDA.")
        if int(cfg.backend.get("ep", 1)) > 1:  # measured: the recompute's op count differs, torch raises mid-backward
            refuse_speed_options(cfg, f"backend={cfg.backend.name} with backend.ep={cfg.backend.ep}", {
                "selective": "the experts are an FSDP unit of their own inside each MoE block, whose hooks run "
                             "other ops in the recompute than in the forward, and the selective policy replays "
                             "the forward op by op."})

    @staticmethod
    def model_states(cfg: DictConfig, n_params: int, world: int, shape: dict, optim_bytes: float) -> ModelStates:
        """What ``parallelize_fsdp`` leaves each rank holding:

        1. Sharded fp32 parameters (they are the master weights: MixedPrecisionPolicy casts on all-gather),
           sharded fp32 gradients (reduce_dtype fp32) and optimizer state on the shards: (8 + opt) x P / N.
        2-3. Unsharded parameters in the compute dtype while in use (the root, the block computing and the one
           prefetched) and unsharded gradients before their reduce-scatter: ``backends.fsdp_buffers``.
        4. cpu_offload: the shards, their gradients and the optimizer live in host RAM; only (2)-(3) stay.
        5. The sharded gradients are freed by each step and rebuilt during backward as activations are freed
           (measured on an H100: counting both overestimated a 1B model's peak by 18%).
        6. reduce_every_micro_batch=false: the unsharded fp32 gradients of the whole model stay between
           micro-batches (FSDP2 accumulates them in the reduce dtype), 4 x P more while accumulating.
        7. Expert parallelism (``backend.ep``): ``backends.expert_parallel_states``.
        8. HSDP (``backend.replicate`` = R): N above is the shard group's world / R ranks, and each rank also
           all-reduces its fp32 gradient shard across the R copies (ring: 2 x 4 x P / N bytes sent) wherever
           the reduce-scatter runs.
        Communication per optimizer step: all-gather in forward and again in backward (the compute dtype)
        on every micro-batch, and an fp32 reduce-scatter on every micro-batch (or only the last):
        (2 x c + 4) x P x accumulation, or 2 x c x P x accumulation + 4 x P.
        9. For the step-time model (``collectives``): the gathers run block by block, the next block's prefetched
           while this one computes (forward and backward); the reduce-scatters block by block as backward produces
           the gradients, over the shard group; HSDP's all-reduce of each block's gradient shard across the copies
           as well, after its reduce-scatter.
        10. HSDP while accumulating: FSDP2 (torch 2.13) keeps each unit's all-reduced gradient shard referenced until
           the end of the backward (``FSDPParamGroup._all_reduce_state``, so that the next unit's reduce-scatter
           cannot reuse its memory while the all-reduce is in flight). On the first micro-batch that buffer is the
           gradient itself; on the others it is added into the gradient and held beside it: every unit's, 4 x P / N,
           by the end of the backward (the dry run of deepseek7b at 2 copies of 8, accumulation 2: 3.22 GiB more at
           the peak than at accumulation 1, the plan's 3.22; tests/unit/test_dryrun.py's tiny model: 10.04 MiB, the
           plan's 10.04).
        """
        b, P = cfg.backend, float(n_params)
        R = max(int(b.get("replicate", 1)), 1)
        N = max(world // R, 1)  # 8
        c = FP32 if cfg.precision.name == "fp32" else HALF
        buffers, apart = fsdp_buffers(c, shape["root_params"], shape["max_block_params"], shape["block_params"],
                               b.reshard_after_forward)
        shards = {"params": FP32 * P / N, "grads": FP32 * P / N, "optimizer": optim_bytes * P / N}
        device, host = ({"buffers": buffers}, shards) if b.cpu_offload else ({**shards, "buffers": buffers}, {})
        every_micro = b.reduce_every_micro_batch
        across = 2 * FP32 * P / N if R > 1 else 0.0  # 8
        units = max(int(shape["blocks"]), 1) + 1  # 9: the blocks and the root
        reduced = "micro" if every_micro else "step"
        collectives = [Collective("all-gather", 2 * c * P, "dp_shard", "micro", 2 * units, "prefetch"),
                       Collective("reduce-scatter", FP32 * P, "dp_shard", reduced, units, "backward")]
        if R > 1:
            collectives.append(Collective("all-reduce", FP32 * P / N, "dp_replicate", reduced, units, "backward"))
        if b.cpu_offload:  # 4: the shards cross the host link each step; the step runs on the host's cores
            collectives.append(Collective("host", (FP32 + FP32) * P / N, "host", "step"))
        states = ModelStates("fp32" if c == FP32 else "half", device, host,
                             comm_per_step=0.0 if every_micro else FP32 * P + across,
                             comm_per_micro=(2 * c + FP32) * P + across if every_micro else 2 * c * P,
                             grads_freed_each_step=True, buffers_apart=apart,  # 5
                             accumulation_bytes=0.0 if every_micro else FP32 * P,  # 6
                             accumulation_buffers=FP32 * P / N if R > 1 and every_micro else 0.0,  # 10
                             collectives=collectives, cpu_optimizer_params=P / N if b.cpu_offload else 0.0)
        return expert_parallel_states(states, cfg, shape, N, c)  # 7

    def init(self) -> None:
        self.device = pick_device(self.plan, int(os.environ.get("LOCAL_RANK", 0)))
        init_process_group(self.cfg, self.device)
        ep, replicate = self.plan.dims.ep, self.plan.dims.dp_replicate
        shard = self.world_size // replicate  # the ranks of one copy (HSDP) or all of them
        self.mesh: DeviceMesh | None = None
        if ep > 1 or replicate > 1:  # ([replicate,] edp, ep), ep innermost: an EP group is consecutive ranks (one
            # node); without EP ([replicate,] shard)
            self.mesh = fsdp_mesh(self.device.type, {}, replicate, {"edp": shard // ep, "ep": ep} if ep > 1
                                  else {"shard": shard}, {})

    def prepare(self, build, total_steps: int) -> None:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        self.model = parallelize_fsdp(build(allow_meta=True), self.cfg, self.device, self.mesh)
        pr = self.cfg.precision
        # The sharded scaler all-reduces "found inf" so every rank skips the same fp16 steps.
        scaler = ShardedGradScaler(self.device.type, init_scale=2.0 ** pr.initial_scale_power,
                                   growth_interval=pr.loss_scale_window, enabled=pr.name == "fp16")
        self.stepper = TorchStepper(self.model, self.cfg, self.device, self.plan.grad_accum_steps, total_steps,
                                    scaler=scaler, autocast=False,  # the MixedPrecisionPolicy casts instead
                                    **stepper_options(self.model, self.plan.dims.ep, self.plan.dims.dp_replicate))

    def forward_backward(self, inputs, targets, is_last_micro: bool, weight: torch.Tensor) -> torch.Tensor:
        # reduce_every_micro_batch=false: non-final micro-steps keep unsharded gradients and skip the reduce-scatter.
        sync = is_last_micro or self.bcfg.reduce_every_micro_batch
        self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]  # FSDPModule method, added at runtime
        return self.stepper.forward_backward(inputs, targets, weight)

    step = forward_to("stepper", TorchStepper.step)  # the norm of DTensor gradients: global, over all shards
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

    all_reduce_mean = staticmethod(process_group.all_reduce_mean)
    barrier = staticmethod(process_group.barrier)

    def hf_model(self) -> torch.nn.Module:
        return self.model

    def reference_model(self, build) -> torch.nn.Module:
        """Its own ``fully_shard`` by ``parallelize_fsdp`` (the policy's blocks-then-root units, mixed precision,
        CPU offload and expert parallelism), frozen before it is sharded: fp32 shards, 4P/N bytes per rank (in
        host RAM with ``cpu_offload``). Every unit, the root too, reshards after its forward: without a backward
        to come, keeping the root gathered (as the policy does) would hold its whole embedding and head."""
        if "reference" not in self.__dict__:
            with reference.keep_rng(self.device):
                model = parallelize_fsdp(reference.build_frozen(build, self.cfg, allow_meta=True),
                                         reference.options(self.cfg),
                                         self.device, self.mesh)
            model.set_reshard_after_forward(True)  # type: ignore[operator]  # FSDPModule method, added at runtime
            reference.frozen_forward(reference.freeze(model))  # the MixedPrecisionPolicy casts, as the policy's
            self.reference = model
        return self.reference

    def full_state_dict(self) -> dict | None:
        return gather_full_state_dict(self.model, self.rank)

    def close(self) -> None:
        teardown(self, "stepper", "model", "reference")
