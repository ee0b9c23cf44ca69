"""``backend=fsdp_tp``: tensor parallel inside a node (Megatron-style, ``torch.distributed.tensor.parallel``)
and FSDP2 over the data-parallel replicas, on one 2D DeviceMesh (dp x tp)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardyard.config import checkpointing_mode
from shardyard.core.facts import Plan
from shardyard.backends import Collective, ModelStates, process_group, reference, refuse_speed_options, shard_ends, smoke_degree
from shardyard.backends.forward import forward_to
from shardyard.backends.fsdp import FSDPBackend, fsdp_mesh, gather_full_state_dict, with_copies
from shardyard.backends.process_group import init_process_group, teardown
from shardyard.backends.torch_step import COMPUTE_DTYPES, TorchStepper, pick_device, read_dcp_model_state
from shardyard.core.errors import UserError
from shardyard.models.build import materialize
from shardyard.models.prepare import apply_activation_checkpointing, apply_compile
from shardyard.models.shape import transformer_blocks

BLOCK_PLAN = {  # the Megatron split of a LLaMA block: one all-reduce after attention, one after the MLP
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}
NORMS = ("input_layernorm", "post_attention_layernorm")


def parallelize_fsdp_tp(model: Any, cfg: DictConfig, mesh: DeviceMesh, device: torch.device) -> torch.nn.Module:
    """Tensor parallel -> activation checkpointing -> compile -> FSDP2 over dp -> materialise. In this order because:

    1. Tensor parallel first, on the tp sub-mesh: it replaces each linear's weight with its DTensor shard, and
       FSDP2 applied afterwards shards those shards again over dp (a 2D DTensor, dp x tp). The reverse order is
       not supported by FSDP2.
       - q/k/v and gate/up are column-parallel: each tp rank computes its own heads and its own slice of the
         MLP's hidden units, with no communication (HF's attention reshapes with -1 heads, so it sees local
         heads only).
       - o and down are row-parallel: each rank multiplies its slice and one all-reduce sums them, so every
         block costs two all-reduces of the activations in forward and two in backward.
       - the embedding is row-parallel over the vocabulary (one all-reduce) and the LM head column-parallel
         with its logits gathered: the loss sees full logits, as on every other engine.
       - RMSNorm weights are replicated over tp (DTensors, so that every parameter lives on the same 2D mesh
         and the gradient norm and the optimizer see one kind of tensor). Sequence parallelism for the norms
         is not applied: HF's models derive positions and the causal mask from the embedding output's
         length, which sequence parallelism would shard (docs/architecture.md).
    2-3. As in ``parallelize_fsdp``: checkpointing and compile wrap each block before FSDP's hooks.
    4. FSDP2 per block, then the root, over the dp sub-mesh; parameters all-gathered in the compute dtype,
       gradients reduce-scattered in fp32 (averaged over dp; the tp ranks' gradients of a replicated norm are
       identical, since their inputs are). With HSDP (``backend.replicate``) the dp ranks are copies x shards:
       FSDP2 on the 2-D (replicate, dp) mesh shards over dp and all-reduces across the copies.
    5. A model built on the meta device gets storage for this rank's shards only.
    """
    tp, dp = mesh["tp"], with_copies(mesh, mesh["dp"])
    style = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    inner = model.model
    parallelize_module(model, tp, {  # 1
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for block in inner.layers:
        parallelize_module(block, tp, {name: style[kind]() for name, kind in BLOCK_PLAN.items()})
        for norm in NORMS:
            _replicate(getattr(block, norm), tp)
    _replicate(inner.norm, tp)
    apply_activation_checkpointing(model, cfg.model)  # 2
    apply_compile(model, cfg.model)  # 3
    pr = cfg.precision
    mp = MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[pr.name], reduce_dtype=torch.float32) \
        if pr.name != "fp32" else MixedPrecisionPolicy()
    for block in transformer_blocks(model):  # 4
        fully_shard(block, mesh=dp, reshard_after_forward=cfg.backend.reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=dp, reshard_after_forward=False, mp_policy=mp)
    materialize(model, device, cfg.seed, cfg.model)  # 5
    return model.to(device)


def _replicate(module: torch.nn.Module, tp: DeviceMesh) -> None:
    """Parameters as replicated DTensors on the tp mesh; plain tensors in and out."""
    distribute_module(
        module, tp,
        input_fn=lambda mod, inputs, mesh: tuple(  # type: ignore[arg-type]  # typed as returning None; the result is used
            DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, torch.Tensor) else t
            for t in inputs),
        output_fn=lambda mod, out, mesh: out.to_local())


def check_tp_model(model: Any, tp: int) -> None:
    """The block layout ``parallelize_fsdp_tp`` splits, and dimensions that tp divides; refused naming why."""
    blocks = transformer_blocks(model)
    names = {n for n, _ in blocks[0].named_modules()} if blocks else set()
    inner = getattr(model, "model", None)
    missing = [n for n in [*BLOCK_PLAN, *NORMS] if n not in names]
    if missing or inner is None or not hasattr(inner, "embed_tokens") or not hasattr(model, "lm_head"):
        moe = any("expert" in n for n, _ in model.named_modules())
        raise UserError("backend", "fsdp_tp",
                        f"Tensor parallelism splits LLaMA-style blocks (q/k/v/o and gate/up/down projections); this "
                        f"model's blocks ({type(blocks[0]).__name__ if blocks else 'none found'}) lack "
                        f"{', '.join(missing) or 'the embedding or LM head'}"
                        + (". Its mixture-of-experts layers would need expert parallelism, which shardyard does not "
                           "implement" if moe else "") + ".",
                        "Use backend=pipeline (layers split across ranks, FSDP over the rest: works for any block), "
                        "or backend=fsdp.")
    c = model.config
    dims = {"model.num_heads": c.num_attention_heads, "model.num_kv_heads": c.num_key_value_heads,
            "model.intermediate_size": c.intermediate_size, "model.vocab_size": c.vocab_size}
    for key, value in dims.items():
        if value % tp:
            raise UserError("backend.tp", tp, f"Tensor parallelism splits {key.split('.')[1]} evenly across the tp "
                            f"ranks, and {key}={value} is not a multiple of {tp}.",
                            f"Use a backend.tp that divides {value}, or change {key}.")
    if getattr(c, "tie_word_embeddings", False):
        raise UserError("model.tie_word_embeddings", True, "The embedding is split by vocabulary rows and the LM "
                        "head by output columns under tensor parallelism, so one tensor cannot serve as both.",
                        "Use model.tie_word_embeddings=false, or backend=fsdp.")


class FSDPTPBackend:
    launcher: ClassVar[str] = "elastic"
    dry_run: ClassVar[str] = "engine"
    """``plan.dry_run``: this engine itself runs on a fake process group and fake tensors (``shardyard.planning.dryrun``)."""
    checkpoint_format: ClassVar[str] = "dcp"

    @staticmethod
    def read_model_state(path: str, model: torch.nn.Module, meta: dict) -> dict[str, torch.Tensor]:
        return read_dcp_model_state(path, model, meta)

    degree_keys: ClassVar[dict[str, str]] = {"tp": "backend.tp", "dp_replicate": "backend.replicate",
                                             "cp": "backend.cp"}

    @staticmethod
    def degrees(b: DictConfig) -> dict[str, int | None]:
        # FSDP over the world / tp replicas (HSDP: backend.replicate copies of world / (tp x replicate) shards each);
        # a sequence's context-parallel ranks (backend.cp) shard the parameters with the others
        return {"tp": int(b.tp), "dp_replicate": int(b.get("replicate", 1)), "cp": int(b.get("cp", 1)),
                "dp_shard": None}

    @staticmethod
    def dry_run_roles(cfg: DictConfig, dims) -> list[tuple[int, str, int]]:
        """The ranks whose figures can differ: the ends of the shards."""
        return shard_ends(dims.world_size)

    @staticmethod
    def for_smoke(cfg: DictConfig, world: int) -> None:
        """``+scale=smoke``: tensor parallel over the largest part of the smoke world it fits."""
        cfg.backend.tp = smoke_degree(cfg.backend.tp, world)

    def __init__(self, cfg: DictConfig, plan: Plan):
        self.cfg, self.plan, self.bcfg = cfg, plan, cfg.backend
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.tp = plan.dims.tp
        # The mesh is (dp, tp), tp innermost: the tp ranks of a replica are consecutive, i.e. on one node,
        # where their per-block all-reduces use NVLink; only FSDP's traffic crosses nodes. HSDP: (replicate, dp, tp).
        # Context parallelism (backend.cp): dp is the shards x cp, a sequence's cp ranks the same tp index in
        # cp x tp consecutive ranks (``sequence_parallel.groups``): data-parallel ranks holding other positions.
        self.dp_rank, self.dp_size = self.rank // self.tp, self.world_size // self.tp

    @staticmethod
    def validate(cfg: DictConfig, plan) -> None:
        from shardyard.models.build import shape_model

        FSDPBackend.validate(cfg, plan)
        refuse_speed_options(cfg, "backend=fsdp_tp", {
            "fp8": "tensor-parallel float8 needs its own sharding plans (float8 all-gathers of the split layers).",
            "loss_chunk": "the LM head is split over the tensor-parallel ranks (vocab-parallel logits).",
            "mlp_tiles": "its MLPs are split over the tensor-parallel ranks already (the tiles are not tried on "
                         "their DTensors).",
            "norm_tiles": "its norms run on the tensor-parallel blocks' sequence shards (the tiles are not tried there).",
            "activation_offload": "its blocks are checkpointed without the host copies here.",
            "compile": "inductor's code for the tensor-parallel blocks (DTensor) trains differently from eager on "
                       "torch 2.13 (measured: 4e-4 apart after 4 steps, where every other engine agrees to 1e-6)."})
        if cfg.precision.name == "fp16":  # the loss scaler's found-inf would have to agree across every split rank
            raise UserError("precision", "fp16", "fp16 loss scaling is not implemented with tensor parallel here (it is "
                            "untested on GPUs, and CPUs cannot run fp16).", "Use precision=bf16 (or fp32).")
        tp = plan.dims.tp  # at least 1, dividing the world (validation's layout check)
        if cfg.backend.cpu_offload:
            raise UserError("backend.cpu_offload", True, "CPU offload is not supported with tensor parallelism here.",
                            "Use backend=fsdp_offload, or backend.cpu_offload=false.")
        if cfg.peft.name != "none":
            raise UserError("peft", str(cfg.peft.name), "LoRA wraps the very projections tensor parallelism splits; the "
                            "combination is not implemented.", "Use backend=fsdp (or ddp, zero2) with adapters.")
        if plan.nproc_per_node % tp and plan.nnodes > 1:
            raise UserError("backend.tp", tp, f"A tensor-parallel group must sit inside one node, and "
                            f"{plan.nproc_per_node} ranks per node are not a multiple of {tp}.",
                            f"Use a backend.tp that divides launch.nproc_per_node={plan.nproc_per_node}.")
        check_tp_model(shape_model(cfg.model), tp)

    @staticmethod
    def model_states(cfg: DictConfig, n_params: int, world: int, shape: dict, optim_bytes: float) -> ModelStates:
        """FSDP2's states of a 1/tp slice of the model over dp = world/tp ranks (``FSDPBackend.model_states``),
        and 1/tp of the activations. Approximations: the replicated norms (under 0.01% of a LLaMA) count as
        split; the block inputs and norm outputs, which are replicated without sequence parallelism, count as
        split too, and the tp all-reduces of activations (4 per block per micro-batch) are not in the
        communication figure."""
        tp = int(cfg.backend.tp)
        sliced = {**shape, **{k: shape[k] / tp for k in ("block_params", "max_block_params", "root_params")}}
        states = FSDPBackend.model_states(cfg, n_params // tp, max(world // tp, 1), sliced, optim_bytes)
        # For the step-time model: the tensor-parallel all-reduces of the activations, 2 per block in forward (after
        # o_proj and down_proj) and 2 in backward (before q/k/v and gate/up), 2 more with full recompute, each of
        # the micro batch's tokens x hidden in the compute dtype, on the critical path.
        c = 4 if cfg.precision.name == "fp32" else 2
        # (a context-parallel rank's share of the tokens)
        tokens = float(cfg.train.micro_batch_size) * float(cfg.data.seq_len) / int(cfg.backend.get("cp", 1))
        per_block = 6 if checkpointing_mode(cfg.model) == "full" else 4
        blocks = max(int(shape["blocks"]), 1)
        tp_reduce = Collective("all-reduce", per_block * blocks * tokens * shape["hidden"] * c, "tp", "micro",
                               per_block * blocks)
        return dataclasses.replace(states, activation_factor=1 / tp, collectives=states.collectives + [tp_reduce], notes=states.notes + [
            f"tensor parallel {tp}: parameters, gradients, optimizer state and activations split {tp} ways, then "
            f"FSDP over {max(world // tp, 1)} data-parallel ranks"])

    def init(self) -> None:
        import logging

        # DTensor logs at every 2D gradient norm and every export that it reduces over dp and tp one after the
        # other ("flatten mesh dimensions"): correct, and a flattened 1-D group would not change the numbers.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        self.device = pick_device(self.plan, int(os.environ.get("LOCAL_RANK", 0)))
        init_process_group(self.cfg, self.device)
        dims = self.plan.dims
        self.mesh = fsdp_mesh(self.device.type, {}, dims.dp_replicate, {"dp": dims.dp_shard * dims.cp}, {"tp": self.tp})

    def prepare(self, build, total_steps: int) -> None:
        self.model = parallelize_fsdp_tp(build(allow_meta=True), self.cfg, self.mesh, self.device)
        self.stepper = TorchStepper(self.model, self.cfg, self.device, self.plan.grad_accum_steps, total_steps,
                                    autocast=False)  # the MixedPrecisionPolicy casts instead

    def forward_backward(self, inputs, targets, is_last_micro: bool, weight: torch.Tensor) -> torch.Tensor:
        self.model.set_requires_gradient_sync(is_last_micro or self.bcfg.reduce_every_micro_batch)  # type: ignore[operator]
        return self.stepper.forward_backward(inputs, targets, weight)

    step = forward_to("stepper", TorchStepper.step)  # every gradient is a (dp, tp) DTensor: one global norm
    eval_loss = forward_to("stepper", TorchStepper.eval_loss)
    save_checkpoint = forward_to("stepper", TorchStepper.save_checkpoint)  # HF names: any dp x tp layout loads them
    save_checkpoint_async = forward_to("stepper", TorchStepper.save_checkpoint_async)  # checkpoint.async_save
    load_checkpoint = forward_to("stepper", TorchStepper.load_checkpoint)
    training_state = forward_to("stepper", TorchStepper.training_state)
    load_training_state = forward_to("stepper", TorchStepper.load_training_state)

    all_reduce_mean = staticmethod(process_group.all_reduce_mean)  # tp ranks of a replica agree: the mean is dp's
    barrier = staticmethod(process_group.barrier)

    def hf_model(self) -> torch.nn.Module:
        return self.model

    def reference_model(self, build) -> torch.nn.Module:
        """Its own tensor-parallel plan and ``fully_shard`` over dp by ``parallelize_fsdp_tp``, on the policy's
        mesh: fp32 shards, 4P/(tp x dp) bytes per rank. Frozen after it is sharded too (the tensor-parallel
        styles make new parameters, which require gradients), before any forward makes FSDP2's unsharded
        parameters; every unit, the root too, reshards after its forward (``FSDPBackend.reference_model``)."""
        if "reference" not in self.__dict__:
            with reference.keep_rng(self.device):
                model = parallelize_fsdp_tp(reference.build_frozen(build, self.cfg, allow_meta=True),
                                            reference.options(self.cfg),
                                            self.mesh, self.device)
            model.set_reshard_after_forward(True)  # type: ignore[operator]  # FSDPModule method, added at runtime
            reference.frozen_forward(reference.freeze(model))
            self.reference = model
        return self.reference

    def full_state_dict(self) -> dict | None:
        return gather_full_state_dict(self.model, self.rank)  # each (dp, tp) DTensor gathered in full

    def close(self) -> None:
        teardown(self, "stepper", "model", "reference")
