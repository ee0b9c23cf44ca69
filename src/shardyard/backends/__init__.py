"""Distributed engines behind one small interface.

A backend is chosen by the ``_target_`` of the ``backend`` group; nothing outside this package branches on
its name. Engines share code by composition (``torch_step.TorchStepper``), never by inheritance. What the
engines build lives here too: optimizers and schedules (``optim``).

May import: ``models``, ``data``, ``monitors``, ``config``, ``core``. Independent of ``evaluation``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Protocol

import torch
from omegaconf import DictConfig

from shardyard.config import checkpointing_mode
from shardyard.core.facts import ParallelDims, Plan


@dataclass
class StepStats:
    grad_norm: torch.Tensor
    """Global L2 norm of all gradients before clipping (a 0-d tensor; read it only when logging)."""
    lr: float
    loss_scale: Optional[float] = None
    """Current dynamic loss scale under fp16, else None."""
    applied: bool = True
    """False when the update was not applied (non-finite gradients under a guard, or an fp16 overflow)."""
    nonfinite_param: Optional[int] = None
    """When gradients were non-finite: index (in ``hf_model().parameters()`` order) of the first parameter
    whose gradient on *this* rank is non-finite, if the engine can tell; else None."""


@dataclass(frozen=True)
class Collective:
    """One collective, point-to-point transfer or host copy an engine runs, as the step-time model reads it
    (``shardyard.planning.steptime``). Each engine states its own in ``model_states``, beside the bytes it holds."""

    op: str
    """``all-gather``, ``reduce-scatter``, ``all-reduce`` (rings: a rank sends (n-1)/n of ``bytes``, twice for an
    all-reduce), ``all-to-all`` and ``send`` (``bytes`` leave the rank: no ring factor), ``host`` (a copy between the
    device and host RAM over the host link: offload)."""
    bytes: float
    """Per occurrence: the whole buffer for a ring collective; what leaves the rank for the others."""
    group: str
    """The ``ParallelDims`` degree whose ranks it runs over: ``dp_shard``, ``dp_replicate``, ``dp``, ``tp``, ``pp``,
    ``ep``, ``sp``; ``host`` for a host copy."""
    per: str = "micro"
    """``micro``: on every micro-batch; ``step``: once per optimizer step."""
    calls: int = 1
    """The separate calls one occurrence is issued as (one per block, per bucket): each pays the library's latency."""
    hidden_by: str = "none"
    """What it overlaps with: ``prefetch`` (parameters gathered for the next block while this one computes, in
    forward and backward), ``backward`` (gradients reduced as backward produces them), ``none`` (the critical path)."""


@dataclass
class ModelStates:
    """What an engine holds per rank, for the plan (``shardyard.planning.plan``): bytes by category and place, and the
    bytes its collectives move. Each engine states it in its own module, next to the code that allocates it."""

    regime: str
    """How activations are stored: ``fp32``, ``autocast`` (fp32 parameters, half matmuls) or ``half``."""
    device: dict[str, float]
    """On the training device: ``params``, ``grads``, ``optimizer``, ``master``, ``buffers``."""
    host: dict[str, float] = field(default_factory=dict)
    """Moved to host RAM by offload (same categories)."""
    nvme: float = 0.0
    """Swapped to ``backend.nvme_path``."""
    comm_per_step: float = 0.0
    """Bytes of the collectives run once per optimizer step, before the ring's (N-1)/N factor."""
    comm_per_micro: float = 0.0
    """Bytes of the collectives run on every micro-batch (ZeRO-2/3 reduce and gather while accumulating)."""
    grads_freed_each_step: bool = False
    """The optimizer step frees the gradients (``zero_grad(set_to_none=True)``) and backward builds them
    block by block as it frees that block's activations: without accumulation the two never peak together,
    so the plan counts the larger, not both."""
    accumulation_bytes: float = 0.0
    """On the device only while gradients accumulate over micro-batches (grad_accum_steps > 1)."""
    accumulation_buffers: float = 0.0
    """The engine's buffers that exist only while gradients accumulate (grad_accum_steps > 1), in backward, as the
    activations are freed: HSDP's held all-reduce outputs (``FSDPBackend.model_states``, 10)."""
    activation_factor: float = 1.0
    """This rank's activations as a fraction of one micro-batch's through the whole model: 1/tp for tensor
    parallel, (layers held / layers) x (micro-batches in flight / pipeline micro-batches) for a pipeline."""
    all_to_all_per_micro: float = 0.0
    """Bytes this rank sends to other ranks by all-to-all on every micro-batch (expert parallelism's token
    dispatch and combine, forward and backward); point to point, so no ring factor applies."""
    dispatch_bytes_per_token: float = 0.0
    """Activation bytes per token of the micro-batch beside the model's own: expert parallelism's send and
    receive buffers of the MoE layer being run."""
    stage_bytes_per_token: float = 0.0
    """Activation bytes per token of the micro batch beside the blocks' own, scaled for this rank already: what
    a pipeline stage holds of each micro-batch in flight at its boundaries (``PipelineBackend.model_states`` 2)."""
    stage_bytes: float = 0.0
    """Activation bytes of this rank's root in backward (a pipeline stage's embedding or head, its gradient
    made beside the one accumulated over pipeline micro-batches): ``PipelineBackend.model_states`` 2."""
    activation_parts: Optional[tuple[float, float, float]] = None
    """Factors for what the blocks keep until backward, the block recomputed at a time and the loss, where
    they differ (a pipeline stage: its layers' share of the micro-batches in flight, one pipeline micro-batch
    recomputed, the logits on the last stage only); None: ``activation_factor`` for all three."""
    others: list = field(default_factory=list)
    """The figures of the other kinds of rank this engine has (a pipeline's stages other than this one): the
    plan computes every kind and plans the busiest."""
    buffers_apart: float = 0.0
    """Bytes of ``buffers`` alive only after the activations are gone (FSDP's root, reduced last, after the whole
    backward: ``fsdp_buffers`` 2): the plan's peak does not add them to the activations."""
    notes: list[str] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    """What this rank's engine sends, when and over which ranks, for the step-time model; empty on one rank."""
    bubble: float = 0.0
    """A pipeline's idle time, as a fraction of its rank's compute: (stages - 1) / (micro-batches x chunks)."""
    cpu_optimizer_params: float = 0.0
    """Parameters whose optimizer step runs on the host's cores (ZeRO-Offload's CPU Adam): this rank's share."""

    def comm_bytes(self, accum: int) -> float:
        return self.comm_per_step + accum * self.comm_per_micro


def fsdp_buffers(c: int, root: float, block: float, blocks: float, reshard: bool) -> tuple[float, float]:
    """FSDP2's own buffers at their largest (compute dtype bytes ``c``; ``root``: the root's parameters, ``block``:
    the largest block's, ``blocks``: all blocks'), measured by the dry run (docs/plan.md, "The dry run"):

    1. While the blocks run: the root unsharded (``reshard_after_forward=False`` keeps it), the block computing
       and the one prefetched in the compute dtype (every block, from its forward to its backward, without
       resharding); in backward one block's gradients unsharded in the compute dtype beside their fp32
       reduce-scatter input, and the head's gradient, made first and reduced with the root at the end:
       c x (root + 2 blocks) + (c + 4) x block + c x root / 2.
    2. At the end of backward the root is reduced last: its fp32 reduce-scatter input beside what is left of its
       unsharded gradients in the compute dtype, a part of them freed as the input is filled (the dry run: 3/4 at
       deepseek7b, 5/8 at deepseek_moe_16b): (4 + 3c/4) x root. (At 7B and above the root's 100k-row vocabulary
       makes this the larger: 4.3 GiB at deepseek7b on 8 ranks, where 1 gives 3.45.)

    Returns the largest and how much of it never meets the activations at their peak (``buffers_apart``): all but
    the forward's gathered parameters, since the gradients of 1 and 2 exist only in backward, as the activations
    are freed (the dry run: deepseek_moe_16b_fsdp peaks 17% below the sum that counted them with the activations).
    """
    forward = c * (root + (2 * block if reshard else blocks))
    gathered = forward + (c + 4) * block + c * root / 2  # 1
    reduced = (4 + 0.75 * c) * root  # 2
    return max(gathered, reduced), max(gathered, reduced) - forward


def expert_parallel_states(states: ModelStates, cfg: DictConfig, shape: dict, world: int, c: int) -> ModelStates:
    """What expert parallelism (``backend.ep``) changes in an FSDP engine's figures (``states``, for ``world``
    data-parallel shards, compute dtype bytes ``c``):

    1. The shards stay the same: the experts are sharded over edp x ep = the same ranks as the rest, so
       parameters, gradients and optimizer state per rank do not change (P / N).
    2. What is all-gathered does: a block's FSDP unit now holds E / ep of its experts, so the gathered block
       (two at a time: the one computing and the one prefetched) and its unsharded fp32 gradients shrink by the
       experts' (1 - 1/ep). This is what lets a DeepSeek-V3 block, 11B parameters gathered whole, fit.
    3. The experts' all-gather and reduce-scatter run over edp only: their bytes shrink by 1/ep.
    4. All-to-all per micro-batch: every MoE layer sends each token once to each rank holding any of its K
       experts (``expert_parallel_forward``), R rows of H values, and back, in forward and again in backward
       (twice more with activation checkpointing's recompute), the (ep - 1)/ep of them that leave the rank. R is
       at most ``min(K, ep)``, and under group-limited routing lined up with the ranks at most ``topk_group`` x
       the ranks of a group (``moe.RoutingGroups.max_ranks``: DeepSeek-V3's device-limited routing at ep 8 sends
       4 rows, not 8): the plan counts that bound.
    5. Activations: the send and receive buffers of the layer being run (2 x R x H values per token), and the
       receiver's weighted expert outputs, one per routed slot in fp32 before a row's slots are added (K x H x 4
       bytes; the dry run of deepseek_v3_pipeline at 512 ranks measured them).
    """
    import dataclasses

    from shardyard.models.moe import routing_groups

    ep = int(cfg.backend.ep)
    if ep <= 1 or not shape.get("expert_params"):
        return states
    E_blk, E_all = shape["max_block_expert_params"], shape["expert_params"]
    saved = E_blk * (1 - 1 / ep)  # 2
    device = dict(states.device)
    device["buffers"], apart = fsdp_buffers(c, shape["root_params"], shape["max_block_params"] - saved,
                                            shape["block_params"] - E_all * (1 - 1 / ep),
                                            cfg.backend.reshard_after_forward)
    # this rank's tokens: its share of each sequence under sequence or context parallelism
    split = int(cfg.backend.get("sp", 1)) * int(cfg.backend.get("cp", 1))
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len / split
    passes = 6 if checkpointing_mode(cfg.model) == "full" else 4  # 4 (selective keeps the dispatched rows' outputs)
    experts = int(cfg.model.get("n_routed_experts", 0) or 0) or ep
    rows = routing_groups(cfg.model, experts, int(shape["experts_per_token"]), ep, 1).max_ranks  # 4
    a2a = shape["moe_layers"] * tokens * rows * shape["hidden"] * c * passes * (ep - 1) / ep
    # 3 and 4 for the step-time model: the experts' share of the gathers and reductions shrinks by 1/ep; the
    # all-to-all runs inside each MoE layer (dispatch and combine, forward and backward), on the critical path
    kept = 1 - E_all * (1 - 1 / ep) / max(shape["block_params"] + shape["root_params"], 1.0)
    collectives = [dataclasses.replace(k, bytes=k.bytes * kept) if k.group.startswith("dp") else k
                   for k in states.collectives]
    collectives.append(Collective("all-to-all", a2a, "ep", "micro", int(shape["moe_layers"]) * passes))
    return dataclasses.replace(
        states, device=device, buffers_apart=apart, collectives=collectives,
        comm_per_micro=max(states.comm_per_micro - (2 * c + 4) * E_all * (1 - 1 / ep), 0.0),  # 3
        all_to_all_per_micro=a2a,
        dispatch_bytes_per_token=(2 * rows * c + 4 * shape["experts_per_token"]) * shape["hidden"],  # 5
        notes=states.notes + [f"expert parallel {ep}: {E_all:,} expert parameters, {1 / ep:.0%} of each MoE "
                              f"block's gathered at a time, {a2a / 2**20:.1f} MiB all-to-all per micro-batch"])


HALF = 2
FP32 = 4


def refuse_speed_options(cfg: DictConfig, engine_name: str, why: dict[str, str]) -> None:
    """An engine's refusal of the speed options it cannot take (``why``: option -> the engine's reason), each
    set option named with its key and value: ``fp8`` (``precision=fp8``), ``loss_chunk``
    (``model.loss_chunk``), ``compile`` (``model.compile``), ``mlp_tiles`` (``model.mlp_tiles``), ``selective``
    (``model.activation_checkpointing=selective``), ``norm_tiles`` (``model.norm_tiles``), ``activation_offload``
    (``model.activation_offload``)."""
    from shardyard.core.errors import UserError

    m = cfg.model
    set_ = {"fp8": ("precision", "fp8", cfg.precision.name == "fp8", "Use precision=bf16."),
            "loss_chunk": ("model.loss_chunk", m.get("loss_chunk", 0), bool(m.get("loss_chunk", 0)),
                           "Use model.loss_chunk=0."),
            "compile": ("model.compile", True, bool(m.get("compile")), "Use model.compile=false."),
            "mlp_tiles": ("model.mlp_tiles", m.get("mlp_tiles", 0), int(m.get("mlp_tiles", 0)) > 1,
                          "Use model.mlp_tiles=0."),
            "selective": ("model.activation_checkpointing", "selective", checkpointing_mode(m) == "selective",
                          "Use model.activation_checkpointing=full."),
            "norm_tiles": ("model.norm_tiles", m.get("norm_tiles", 0), int(m.get("norm_tiles", 0)) > 1,
                           "Use model.norm_tiles=0."),
            "activation_offload": ("model.activation_offload", True, bool(m.get("activation_offload")),
                                   "Use model.activation_offload=false.")}
    for option, reason in why.items():
        key, value, on, fix = set_[option]
        if on:
            raise UserError(key, value, f"{engine_name} cannot take it: {reason}",
                            f"{fix} Or an engine that takes it (docs/performance.md).")


def engine(backend_cfg: DictConfig) -> Any:
    """The engine class ``backend._target_`` names (a class meeting ``Backend``): the one place that resolves it,
    for building the engine and for the facts the class states (``degrees``, ``quantized_base``, ``max_ranks``,
    ``model_states``, ``validate``, ``for_smoke``)."""
    from hydra.utils import get_object

    return get_object(backend_cfg._target_)


def parallel_dims(cfg: DictConfig, world: int) -> ParallelDims:
    """The layout of ``world`` ranks under ``cfg``'s engine, from its class's ``degrees``; an engine without
    them (a user's plug-in) is plain data parallel. Validation calls it once for the run (and checks it); the
    plan calls it for each engine it compares on the planned hardware's world."""
    degrees = getattr(engine(cfg.backend), "degrees", None)
    return ParallelDims.of(world, degrees(cfg.backend) if degrees else {})


def shard_ends(world: int) -> list[tuple[int, str, int]]:
    """The ranks a dry run simulates on an engine that shards evenly (``dry_run_roles``: rank, what, the plan's
    kind of rank): the first and the last, which alone can hold less when a tensor's rows do not divide by the
    world."""
    return [(0, "first shard", 0)] + ([(world - 1, "last shard", 0)] if world > 1 else [])


def uneven_shard_ends(cfg: DictConfig, shards: int) -> list[tuple[int, str, int]]:
    """``shard_ends`` of ``shards`` ranks (FSDP2's, which splits every parameter on its first dimension), only the
    first where every parameter's rows divide by ``shards`` (the adapters' too, built on the meta device as the run
    builds them): then each rank holds the same shapes, as the last can hold less only of a remainder, and one
    simulation stands for all (a DeepSeek-7B or MoE-16B dry run at a node's 8 ranks is half the work). With expert
    parallelism (``backend.ep``) the routed experts' E rows are first split over the ep group, and their E / ep
    over the shards / ep that hold the same experts (``parallelize_fsdp``'s edp); the dry run routes uniformly."""
    from shardyard.backends.expert_parallel import EXPERT_WEIGHTS
    from shardyard.models import adapters
    from shardyard.models.build import shape_model
    from shardyard.models.moe import expert_modules

    if shards > 1:
        ep = int(cfg.backend.get("ep", 1))
        model = adapters.apply(shape_model(cfg.model), cfg.peft, 0)
        experts = {id(getattr(m, n)) for m in expert_modules(model) for n in EXPERT_WEIGHTS} if ep > 1 else set()

        def even(p: torch.Tensor) -> bool:
            if p.dim() == 0:
                return False
            if id(p) in experts:
                return p.shape[0] % ep == 0 and (p.shape[0] // ep) % (shards // ep) == 0
            return p.shape[0] % shards == 0

        if all(even(p) for p in model.parameters()):
            return [(0, f"every shard (rows divide by {shards})", 0)]
    return shard_ends(shards)


def smoke_degree(degree: int, world: int) -> int:
    """A parallel degree shrunk to a smoke run's ``world`` (``+scale=smoke``): the largest that divides it, so
    that the split itself is still exercised (2 or more where the world allows)."""
    return max(d for d in range(1, world + 1) if world % d == 0 and d <= max(int(degree), 1))


class Backend(Protocol):
    """Every method the worker, the loop, the checkpointer and the export call. Built as
    ``Backend(cfg, plan)`` from ``backend._target_``; engines share code by composition only."""

    launcher: ClassVar[str]
    """Name of the function in ``shardyard.launching.launch.LAUNCHERS`` that starts this engine's workers."""
    checkpoint_format: ClassVar[str]
    """Name of the on-disk form (``dcp``, ``deepspeed``, ``torch-rank0``); a checkpoint resumes only into
    an engine of the same format."""

    @staticmethod
    def read_model_state(path: str, model: torch.nn.Module, meta: dict) -> dict[str, torch.Tensor]:
        """The model tensors of a checkpoint this engine wrote (``path``; ``meta``: its ``meta.json``), read whole in
        one process without a process group, named as ``model.state_dict()`` (``model``: built from the run's
        config, adapters applied; a frozen base's tensors may be absent): what ``shardyard generate`` and ``eval``
        load (``inference.load``). A file refused or unreadable is a ``UserError``."""
        ...
    rank: int
    world_size: int
    dp_rank: int
    """This rank's index among the data-parallel replicas: ranks that differ only in their tensor-parallel or
    pipeline coordinate read the same batches (equal to ``rank`` on the data-parallel engines)."""
    dp_size: int
    """Number of data-parallel replicas (``world_size`` / (tensor-parallel x pipeline degree))."""
    device: torch.device

    degree_keys: ClassVar[dict[str, str]]
    """The option setting each degree ``degrees`` fixes (``{"tp": "backend.tp"}``), named by validation's
    refusals; empty on the data-parallel engines."""

    def __init__(self, cfg: DictConfig, plan: Plan) -> None: ...

    @staticmethod
    def degrees(b: DictConfig) -> dict[str, int | None]:
        """The ``ParallelDims`` degrees this engine's options (``b``: the backend config) fix, and as None the
        data-parallel one that takes the rest of the world: ``{"tp": b.tp, "dp_shard": None}``. The run reads
        the layout from ``plan.dims``, never from these options."""

    @staticmethod
    def validate(cfg: DictConfig, plan: Plan) -> None:
        """Engine-specific checks of the composed config; raise ``UserError``."""

    @staticmethod
    def model_states(cfg: DictConfig, n_params: int, world: int, shape: dict, optim_bytes: float) -> ModelStates:
        """Bytes per rank this engine holds for ``n_params`` parameters over ``world`` ranks (``shape``: the
        plan's model shape; ``optim_bytes``: optimizer state bytes per fp32 parameter)."""

    def init(self) -> None:
        """Process group, device, seeds of the communication layer."""

    def prepare(self, build: Callable[..., torch.nn.Module], total_steps: int) -> None:
        """Build the model with ``build(allow_meta=...)`` where and how this engine needs it (meta device,
        ``deepspeed.zero.Init``), apply activation checkpointing and compile, wrap/shard it, and build the
        optimizer, scheduler and loss scaler from the recipe."""

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, is_last_micro: bool,
                         weight: torch.Tensor) -> torch.Tensor:
        """Backward of one micro-batch's loss terms (``model.causal_lm_loss_sum``: the summed cross-entropy of
        the main head, then of each multi-token-prediction depth) times ``weight`` (fp32 on the device, one per
        term: accumulation steps x ``dp_size`` / the term's label tokens in the step over every data-parallel
        rank, times the term's factor), summed, as one of the micro-batch losses whose mean over micro-batches
        and data-parallel ranks the engine's gradient is: the step's gradient is then that of the token-weighted
        means (docs/architecture.md, "Token-weighted loss"). MoE balance losses keep the plain mean. Returns
        the micro-batch's summed cross-entropies (``[1 + depths]``), unweighted and detached, on every rank;
        gradients are synchronised only when ``is_last_micro``."""

    def step(self, guard: bool = False) -> StepStats:
        """Unscale, clip, optimizer + scheduler step, zero grads. With ``guard``, an update whose global
        gradient norm is non-finite is not applied (the schedule still advances) and the first
        non-finite local gradient is reported: the loop's ``debug.nan_policy`` decides what follows."""

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of ``t`` over every rank of the world (a new tensor). Ranks of one replica (tensor-parallel
        peers, a pipeline's stages) hold the same value, so it is also the mean over the ``dp_size`` replicas:
        times ``dp_size``, their sum (the loop's label count per step)."""

    def barrier(self) -> None: ...

    def hf_model(self) -> torch.nn.Module:
        """The underlying HF model (for generation and its config)."""

    def reference_model(self, build: Callable[..., torch.nn.Module]) -> torch.nn.Module:
        """A frozen copy of the policy at its starting weights, for the objectives that compare with one (DPO,
        GRPO's KL term): built once after ``prepare`` from the same ``build`` (so the same init or
        ``model.weights``; the training's random streams are left as they were), placed and sharded as this
        engine places and shards the policy, in eval mode, every parameter frozen, in no optimizer, with no
        gradient hooks; no activation checkpointing or compile (``backends.reference``). Called like the policy
        (``model._call(ref, inputs)``, ``model.logits``); its forward runs under ``torch.no_grad`` and gives the
        policy's logits at step 0 in the policy's numerics (the same autocast, MixedPrecisionPolicy, DeepSpeed
        bf16/fp16). What each engine holds for it per rank (P parameters over N ranks, c bytes per value of the
        compute dtype): single, DDP, Horovod 4P (an fp32 replica); FSDP 4P/N (fp32 shards) and FSDP+TP 4P/N
        (N = tp x dp), plus, while it runs, one or two blocks gathered in the compute dtype (every unit, the
        root too, reshards after its forward); ZeRO-1/2 cP (DeepSpeed stage 0: a replica in the precision's
        dtype); ZeRO-3 cP/N (partitioned, parameters offloaded as the policy's are), plus the modules being
        fetched while it runs and those under ``stage3_param_persistence_threshold``. The pipeline refuses
        (``UserError``). LoRA/QLoRA never ask: the policy with its adapters disabled is the reference."""

    def full_state_dict(self) -> Optional[dict]:
        """Full, unsharded CPU state dict on rank 0 (None elsewhere); collective on sharded engines."""

    def save_checkpoint(self, path: str) -> None:
        """Collective: every rank writes its part of model and optimizer state into ``path``."""

    def load_checkpoint(self, path: str, meta: dict) -> None:
        """Collective: load model and optimizer state from ``path``; ``meta`` is its parsed ``meta.json``
        (world size and engine state it was saved with)."""

    def training_state(self) -> dict:
        """JSON-able state beside the shards (scheduler, loss scaler, engine facts) for ``meta.json``."""

    def load_training_state(self, state: dict) -> None: ...

    def close(self) -> None: ...
