"""``backend=pipeline``: the layers split into stages across ranks (``torch.distributed.pipelining``: GPipe,
1F1B or interleaved 1F1B), and FSDP2 over each stage's data-parallel replicas, on one 2D DeviceMesh (pp x dp)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shardyard.models import moe, mtp
from shardyard.core.facts import Plan
from shardyard.backends import FP32, HALF, Collective, ModelStates, process_group, refuse_speed_options, smoke_degree
from shardyard.backends.expert_parallel import shard_experts, stepper_options
from shardyard.models.moe import expert_modules
from shardyard.backends.forward import forward_to
from shardyard.backends.fsdp import FSDPBackend, fsdp_mesh, with_copies
from shardyard.backends.process_group import init_process_group, teardown
from shardyard.backends.sequence_parallel import Batch, Shards
from shardyard.backends.torch_step import COMPUTE_DTYPES, TorchStepper, pick_device, read_dcp_model_state
from shardyard.core.errors import UserError
from shardyard.models.build import materialize
from shardyard.models.loss import SEQUENCE_SHARDS
from shardyard.models.prepare import apply_activation_checkpointing, apply_compile
from shardyard.models.shape import signature


def edge_units(s: int, pp: int, chunks: int, m: int, in_flight: int, mtp_depth: int) -> float:
    """What pipeline stage ``s`` (of ``pp``; ``chunks`` in all, this rank's every ``pp``-th) holds at its edges, in
    hidden states of one pipeline micro-batch (h x c bytes per token of it), as torch's ``PipelineStage`` allocates
    them (torch 2.13, ``torch.distributed.pipelining.stage``): every chunk after the first receives into one buffer
    per pipeline micro-batch of the step (``m``), kept for the whole step, and the input gradient it sends lives
    until the send completes (one); every chunk before the last receives its output's gradient into one buffer per
    pipeline micro-batch, and keeps each output it sent until that micro-batch's backward (``in_flight``). With
    multi-token prediction the first stage's embedding travels beside the hidden states (``Stage``): every buffer
    is two hidden states, an output one (the embedding passed on is a view of the one received). A received
    buffer in flight is its stage's first layer's input, which the blocks' activations count already (the layer
    keeps its input: checkpointed or not), so those are not counted twice."""
    carry = 2 if mtp_depth else 1
    mine = list(range(s, chunks, pp))
    receives = sum(1 for ch in mine if ch > 0)
    sends = sum(1 for ch in mine if ch < chunks - 1)
    received = carry * (m * receives + 1) - in_flight if receives else 0
    return float(received + carry * m * sends + (in_flight if sends else 0))


class Hole(torch.nn.Module):
    """Stands where a layer held by another stage was: no parameters, never called."""


class Stage(torch.nn.Module):
    """One pipeline stage of an HF decoder-only model: the embedding (first stage), layers ``lo..hi-1``,
    the final norm and LM head (last stage). Positions, rotary embeddings and the causal mask are rebuilt
    from the sequence length in every stage, exactly as the HF model builds them once.

    Multi-token prediction (``shardyard.models.mtp``) runs on the last stage, beside the head it shares. Its depths
    read the shared embedding of the tokens ahead, which only the first stage holds: while training
    (``with_mtp``), every stage passes the first stage's embedding output along beside the hidden states (one
    more hidden-sized activation per boundary), so its gradient flows back to the one embedding through the
    pipeline itself, with no copy of the table to keep in sync. The last stage returns the logits of the main
    head and of each depth, concatenated along the sequence (``_scaled_loss`` splits them)."""

    def __init__(self, hf: Any, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        inner = hf.model
        self.lo, self.hi, self.first, self.last = lo, hi, first, last
        self.embed: Any = inner.embed_tokens if first else None
        self.layers = torch.nn.ModuleDict({str(i): inner.layers[i] for i in range(lo, hi)})
        self.mtp = torch.nn.ModuleList(mtp.layers(hf) if last else [])
        self.with_mtp = mtp.depth(hf) > 0
        """Carry the embedding and compute the MTP depths (training; ``PipelineBackend._run_chunks`` turns it off)."""
        self.norm: Any = inner.norm if last else None
        self.head: Any = hf.lm_head if last else None
        # Shared by every stage of this rank and without parameters: kept out of the module tree (and FSDP).
        object.__setattr__(self, "_hf", hf)
        self.loss_scale = 1.0
        """What the pipeline's loss function multiplies the loss by (set by the engine)."""
        self.pipe: Any = None
        """The ``PipelineStage`` that drives this module (set by the engine)."""

    def _infers_shapes(self) -> bool:
        """The schedule's first step runs this stage once on placeholder tensors to learn the shapes it sends
        (torch.distributed.pipelining's metadata inference, before its output metadata exists): not training."""
        meta = getattr(self.pipe, "_stage_meta", None) if self.pipe is not None else None
        return meta is not None and getattr(meta, "outputs", True) is None

    def forward(self, x: torch.Tensor, emb: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                segments: torch.Tensor | None = None, shards: Shards | None = None) -> Any:
        """``x``: the token ids (first stage) or the hidden states received. The keyword arguments reach every
        stage from the engine's own ``schedule.step`` call (``stage_inputs``: torch's schedules split their tensors
        into the pipeline micro-batches along the rows and hand them to every stage, as they do not the hidden
        states):

        1. ``position_ids``: the positions of ``x``'s columns (packed documents restart them; a context-parallel
           rank's are its two chunks'), for RoPE and transformers' packed-documents mask; None: 0..T-1.
        2. ``shards`` (and ``segments``, the whole sequence's documents, ``sequence_parallel.Batch``): this rank's
           context-parallel group; every attention of the stage then gathers the group's keys and values
           (``sequence_parallel.attention``), and the mask transformers would build for the share is not built."""
        from transformers.masking_utils import create_causal_mask

        inner: Any = self._hf.model  # type: ignore[union-attr]  # set with object.__setattr__, not a submodule
        h = self.embed(x) if self.embed is not None else x
        carry = self.with_mtp
        if carry and self.first:
            emb = h
        pos = position_ids if position_ids is not None else torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # 1
        split = {SEQUENCE_SHARDS: Batch(shards, segments)} if shards is not None else {}  # 2
        mask = None if split else create_causal_mask(config=inner.config, inputs_embeds=h, attention_mask=None,
                                                     past_key_values=None, position_ids=pos)
        rope = inner.rotary_emb(h, position_ids=pos)
        with moe.paused(self._hf) if self._infers_shapes() else contextlib.nullcontext():
            for layer in self.layers.values():
                h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos, **split)
            if self.last:
                h = self.norm(h)
                heads = [self.head(h)]
                if carry:  # the MTP depths (shardyard.models.mtp._forward's, on the embedding carried from the first stage)
                    assert emb is not None
                    heads += [self.head(n) for n in mtp.run_depths(self._hf, h, emb, attention_mask=mask,
                                                                  position_embeddings=rope, position_ids=pos)]
                h = torch.cat(heads, dim=1) if len(heads) > 1 else heads[0]
        # The loss function sees only the last stage: this stage's MoE balance losses ride on its output's gradient.
        h = moe.attach(h, self._hf, self.loss_scale)
        if carry and not self.last:
            assert emb is not None
            return h, emb.view_as(emb)  # a view: the stage's own output, whose gradient goes back to its input
        return h


@contextlib.contextmanager
def _without_mtp(stages: list[Stage]):
    """The stages as the plain causal LM (evaluation, sampling): no embedding carried, no MTP depths."""
    was = [s.with_mtp for s in stages]
    for s in stages:
        s.with_mtp = False
    try:
        yield
    finally:
        for s, w in zip(stages, was):
            s.with_mtp = w


def stage_inputs(inputs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """A micro-batch as the loop hands it (token ids; or ``input_ids`` and ``position_ids`` of packed documents, and
    with context parallelism this rank's share of them and its ``sequence_parallel.Batch``) as the first stage's
    token ids and the keyword arguments of every stage (``Stage.forward``): the position ids, and the context-parallel
    group with the whole sequence's documents. Tensors only, and the group, because torch's schedules split the
    keyword arguments' tensors into the pipeline micro-batches by rows and hand anything else to each as it is: the
    ``Batch`` (whose documents are the micro batch's rows) is made again per pipeline micro-batch by each stage."""
    if not isinstance(inputs, dict):
        return inputs, {}
    batch = inputs.get(SEQUENCE_SHARDS)
    kwargs: dict[str, Any] = {"position_ids": inputs["position_ids"]}
    if batch is not None:
        kwargs["shards"] = batch.shards
        if batch.segments is not None:
            kwargs["segments"] = batch.segments
    return inputs["input_ids"], kwargs


def _rows(kwargs: dict[str, Any], m: int) -> list[dict[str, Any]]:
    """``stage_inputs``' keyword arguments of ``m`` pipeline micro-batches, split by rows as torch's schedules do."""
    return [{k: v.chunk(m)[j] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()} for j in range(m)]


def layer_split(layers: int, chunks: int) -> list[tuple[int, int]]:
    """``layers`` split into ``chunks`` consecutive ranges, the earlier ones one longer when it does not divide
    (the first and last chunks also hold the embedding and the head, so a remainder lands there is no better)."""
    base, extra = divmod(layers, chunks)
    out, lo = [], 0
    for c in range(chunks):
        hi = lo + base + (c < extra)
        out.append((lo, hi))
        lo = hi
    return out


def parallelize_pipeline(model: Any, cfg: DictConfig, mesh: DeviceMesh, device: torch.device) -> list[Stage]:
    """Checkpointing -> compile -> cut into stages -> FSDP2 per stage over dp -> materialise. In this order because:

    1. Activation checkpointing and compile wrap each block first (as in ``parallelize_fsdp``); a stage then
       calls its blocks directly.
    2. The model is cut into ``stages x virtual_stages`` chunks by layer counts; this rank keeps chunks
       ``pp_rank, pp_rank + stages, ...`` (one chunk unless interleaved) and every other layer is replaced
       by a ``Hole``, so the full model never gets storage here. Parameter names stay those of the whole
       model ("model.layers.17..."), so checkpoints and the export read the same at any stage count.
    3. FSDP2 over the stage's dp replicas: per block, then each stage's root (embedding or norm + head).
       ``torch.distributed.pipelining`` drives FSDP itself: it defers the reduce-scatter to the last
       micro-batch of each schedule step. With expert parallelism (``backend.ep``) the stage's dp ranks are
       (edp, ep) as in ``parallelize_fsdp``: each keeps its experts of the stage's MoE layers, FSDP-sharded over
       edp, and the rest of each block over all of the stage's dp. With HSDP (``backend.replicate``) a stage's dp
       ranks are copies x shards: each of these meshes gets the copies as its outer dimension (``with_copies``).
    4. Only now does a meta-built model get storage, for this rank's shards of this rank's layers.
    """
    b = cfg.backend
    apply_activation_checkpointing(model, cfg.model)  # 1
    apply_compile(model, cfg.model)
    model.shardyard_signature = signature(model)  # the whole model's names and shapes, before the cut
    pp, expert_parallel = mesh["pp"], "ep" in (mesh.mesh_dim_names or ())
    dp = with_copies(mesh, mesh["edp", "ep"]._flatten("dp") if expert_parallel else mesh["dp"])
    chunks = b.stages * (b.virtual_stages if b.schedule == "interleaved" else 1)
    main = len(model.model.layers) - mtp.depth(model)  # the MTP depths follow the main layers: the last stage's
    spans = layer_split(main, chunks)
    mine = list(range(pp.get_local_rank(), chunks, b.stages))  # 2
    keep = {i for c in mine for i in range(*spans[c])} | (set(range(main, len(model.model.layers)))
                                                          if chunks - 1 in mine else set())
    for i in range(len(model.model.layers)):
        if i not in keep:
            model.model.layers[i] = Hole()
    if 0 not in mine:
        model.model.embed_tokens = Hole()
    if chunks - 1 not in mine:
        model.model.norm, model.lm_head = Hole(), Hole()
    stages = [Stage(model, *spans[c], first=c == 0, last=c == chunks - 1) for c in mine]
    pr = cfg.precision
    mp = MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[pr.name], reduce_dtype=torch.float32) \
        if pr.name != "fp32" else MixedPrecisionPolicy()
    for stage in stages:  # 3
        for layer in [*stage.layers.values(), *stage.mtp]:
            if expert_parallel and shard_experts(layer, mesh["ep"], b.ep_capacity_factor):
                for experts in expert_modules(layer):
                    fully_shard(experts, mesh=with_copies(mesh, mesh["edp"]),
                                reshard_after_forward=b.reshard_after_forward, mp_policy=mp)
            fully_shard(layer, mesh=dp, reshard_after_forward=b.reshard_after_forward, mp_policy=mp)
        fully_shard(stage, mesh=dp, reshard_after_forward=False, mp_policy=mp)
    materialize(model, device, cfg.seed, cfg.model)  # 4
    model.to(device)
    return stages


def check_pipeline_model(model: Any, cfg: DictConfig) -> None:
    b = cfg.backend
    inner = getattr(model, "model", None)
    needed = ["embed_tokens", "layers", "norm", "rotary_emb"]
    if inner is None or not hasattr(model, "lm_head") or any(not hasattr(inner, n) for n in needed):
        raise UserError("backend", "pipeline", f"The pipeline cuts HF decoder-only models (model.embed_tokens, "
                        f"model.layers, model.norm, model.rotary_emb, lm_head); {type(model).__name__} is not laid "
                        "out so.", "Use backend=fsdp, or an HF causal LM (LLaMA, Qwen2, Mistral, DeepSeek-V3 ...).")
    chunks = b.stages * (b.virtual_stages if b.schedule == "interleaved" else 1)
    layers = len(inner.layers) - mtp.depth(model)  # the MTP depths ride on the last stage
    if layers < chunks:
        virtual = chunks // b.stages
        key, value, most = (("backend.virtual_stages", b.virtual_stages, layers // b.stages) if virtual > 1
                            else ("backend.stages", b.stages, layers))
        raise UserError(key, value, f"The model has {layers} layers, fewer than the {chunks} pipeline chunks "
                        f"(backend.stages x virtual stages) that each need at least one.",
                        f"Use {key}<={max(most, 1)}, or a model with more layers (model.num_layers).")
    if getattr(model.config, "tie_word_embeddings", False):
        raise UserError("model.tie_word_embeddings", True, "The embedding lives on the first stage and the LM head "
                        "on the last, so one tensor cannot serve as both.",
                        "Use model.tie_word_embeddings=false, or backend=fsdp.")


class PipelineBackend:
    launcher: ClassVar[str] = "elastic"
    dry_run: ClassVar[str] = "engine"
    """``plan.dry_run``: this engine itself runs on a fake process group and fake tensors (``shardyard.planning.dryrun``)."""
    checkpoint_format: ClassVar[str] = "dcp"

    @staticmethod
    def read_model_state(path: str, model: torch.nn.Module, meta: dict) -> dict[str, torch.Tensor]:
        return read_dcp_model_state(path, model, meta)

    degree_keys: ClassVar[dict[str, str]] = {"pp": "backend.stages", "ep": "backend.ep",
                                             "dp_replicate": "backend.replicate", "cp": "backend.cp"}
    post_training: ClassVar[bool] = False
    """The post-training objectives (DPO, GRPO) need each sequence's log-probabilities from one forward of the
    whole model, and GRPO samples with it: a stage holds only its layers (``planning.rules.validate_objective``)."""

    @staticmethod
    def degrees(b: DictConfig) -> dict[str, int | None]:
        # each stage FSDP over the world / stages replicas (HSDP: backend.replicate copies of their shards); a
        # stage's context-parallel ranks (backend.cp) shard it with the others, and expert parallelism borrows from
        # the shards
        return {"pp": int(b.stages), "dp_replicate": int(b.get("replicate", 1)), "cp": int(b.get("cp", 1)),
                "dp_shard": None, "ep": int(b.ep)}

    @staticmethod
    def dry_run_roles(cfg: DictConfig, dims) -> list[tuple[int, str, int]]:
        """The ranks whose figures can differ, each with its stage (the plan's kind of rank, ``model_states``):
        the first data-parallel rank of every stage that holds something the others do not (the embedding, the
        head, another count of layers or of MoE layers); of stages alike, the first, which has the most
        micro-batches in flight. Every rank of a stage holds the same shapes (its experts and shards are even
        splits), so one data-parallel rank stands for its stage. A middle stage with no more layers and no more
        MoE layers (nor dense ones) than an earlier middle one is not simulated: every figure of it is that stage's, over fewer
        of the same blocks with fewer micro-batches in flight (DeepSeek-V3 at 8 stages: stage 5's 7 layers
        beside stage 1's 8, a sixth of its dry run)."""
        from shardyard.models.build import shape_model

        b = cfg.backend
        model: Any = shape_model(cfg.model)
        is_moe = [bool(expert_modules(layer)) for layer in model.model.layers]
        chunks = int(b.stages) * (int(b.virtual_stages) if b.schedule == "interleaved" else 1)
        d = mtp.depth(model)  # the MTP depths: the last layers, on the last chunk (parallelize_pipeline)
        spans = layer_split(len(is_moe) - d, chunks)
        spans[-1] = (spans[-1][0], len(is_moe))
        seen: set[tuple[bool, bool, int, int]] = set()
        roles: list[tuple[int, str, int]] = []
        for s in range(int(b.stages)):
            mine = [spans[c] for c in range(s, chunks, int(b.stages))]
            kind = (s == 0, s == int(b.stages) - 1, sum(hi - lo for lo, hi in mine),
                    sum(sum(is_moe[lo:hi]) for lo, hi in mine))
            middle = not (kind[0] or kind[1])
            bounded = middle and any(not (k[0] or k[1]) and k[2] >= kind[2] and k[3] >= kind[3]
                                     and k[2] - k[3] >= kind[2] - kind[3] for k in seen)  # layers, MoE, dense
            if not bounded:  # the first of a kind has the most micro-batches in flight
                seen.add(kind)
                layers, moe = kind[2], kind[3]
                where = "first stage" if s == 0 else "last stage" if s == int(b.stages) - 1 else f"stage {s}"
                roles.append((s * (dims.world_size // dims.pp), f"{where}: {layers} layers, {moe} MoE", s))
        return roles

    @staticmethod
    def for_smoke(cfg: DictConfig, world: int) -> None:
        """``+scale=smoke``: as many stages as the smoke world fits, a layer per chunk, and the micro batch split
        as often as there are stages; expert and context parallelism over what a stage's ranks leave."""
        b = cfg.backend
        b.stages = smoke_degree(b.stages, world)
        chunks = b.stages * (b.virtual_stages if b.schedule == "interleaved" else 1)
        if "num_layers" in cfg.model:
            cfg.model.num_layers = max(int(cfg.model.num_layers), chunks)
        b.microbatches = b.stages
        cfg.train.micro_batch_size = max(cfg.train.micro_batch_size, b.stages)
        b.ep = smoke_degree(b.ep, world // b.stages)  # over a stage's data-parallel ranks
        if int(b.get("cp", 1)) > 1:  # and so is a stage's context-parallel group
            b.cp = smoke_degree(b.cp, world // b.stages)

    def __init__(self, cfg: DictConfig, plan: Plan):
        self.cfg, self.plan, self.bcfg = cfg, plan, cfg.backend
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.pp = plan.dims.pp
        # The mesh is (pp, dp), dp innermost: a stage's FSDP replicas are consecutive ranks (within a node when
        # they fit in one), and the stages' point-to-point activations cross between those groups. A stage's
        # context-parallel ranks (backend.cp) are among them: consecutive ranks of one stage
        # (``sequence_parallel.groups``), data-parallel ranks holding different positions to FSDP and the loop.
        self.dp_size = self.world_size // self.pp
        self.pp_rank, self.dp_rank = divmod(self.rank, self.dp_size)
        self.chunks = self.pp * (cfg.backend.virtual_stages if cfg.backend.schedule == "interleaved" else 1)

    @staticmethod
    def validate(cfg: DictConfig, plan) -> None:
        from shardyard.models.build import shape_model

        import transformers

        FSDPBackend.validate(cfg, plan)
        refuse_speed_options(cfg, "backend=pipeline", {
            "fp8": "the stages are not built with float8 linears here.",
            "loss_chunk": "the last stage's loss function receives the logits from the schedule.",
            "mlp_tiles": "the stages are built without the tiled MLPs here.",
            "norm_tiles": "the stages are built without the tiled norms here.",
            "activation_offload": "the stages are checkpointed without the host copies here."})
        if int(transformers.__version__.split(".")[0]) < 5:  # Stage.forward builds the mask as transformers 5 does
            raise UserError("backend", "pipeline", f"The pipeline stages call transformers 5's masking API, and "
                            f"transformers {transformers.__version__} is installed.",
                            "Install transformers>=5 (pip install -U transformers), or use backend=fsdp.")
        if cfg.precision.name == "fp16":  # the loss scaler's found-inf would have to agree across every split rank
            raise UserError("precision", "fp16", "fp16 loss scaling is not implemented with pipeline here (it is "
                            "untested on GPUs, and CPUs cannot run fp16).", "Use precision=bf16 (or fp32).")
        b = cfg.backend
        for key in ("stages", "microbatches", "virtual_stages"):
            if b[key] < 1:
                raise UserError(f"backend.{key}", b[key], "It must be at least 1.", f"Use backend.{key}=2 or more.")
        if plan.micro_batch_size % b.microbatches:
            raise UserError("backend.microbatches", b.microbatches, f"Each micro batch of train.micro_batch_size="
                            f"{plan.micro_batch_size} sequences is split into backend.microbatches pipeline "
                            "micro-batches, so it must divide it.",
                            f"Use a divisor of {plan.micro_batch_size}, or raise train.micro_batch_size.")
        if b.schedule != "gpipe" and b.microbatches % b.stages:
            raise UserError("backend.microbatches", b.microbatches, f"The {b.schedule} schedule runs its micro-batches "
                            f"in rounds of backend.stages={b.stages}, so it needs a multiple of it.",
                            f"Use backend.microbatches={b.stages} (or a multiple), or backend.schedule=gpipe.")
        unsupported = [("backend.cpu_offload", True, b.cpu_offload, "CPU offload"),
                       ("peft", str(cfg.peft.name), cfg.peft.name != "none", "Adapters (peft)"),
                       ("data", "sft", cfg.data._target_ == "shardyard.data.sft.SFTData", "Packed SFT rows (their "
                        "positions reach every stage as data.document_mask's do, but no test trains them here)")]
        for key, value, on, what in unsupported:
            if on:
                raise UserError(key, value, f"{what} with pipeline stages is not implemented.",
                                "Use backend=fsdp (or fsdp_tp) for this run.")
        depth = int(OmegaConf.select(cfg, "model.mtp.depth") or 0)
        split = [(k, v) for k, v, on in (("backend.cp", b.get("cp", 1), int(b.get("cp", 1)) > 1),
                                         ("data.document_mask", True, bool(cfg.data.document_mask))) if on]
        if depth and split:  # the last stage's MTP targets are rolled from its own rows (_scaled_loss)
            key, value = split[0]
            raise UserError(key, value, f"Multi-token prediction (model.mtp.depth={depth}) on the pipeline takes each "
                            "depth's tokens and targets from the last stage's own positions, which with "
                            f"{key} are not the whole sequence's (context parallelism's shares, or documents' "
                            "edges).", f"Use model.mtp.depth=0 with {key} on the pipeline, or backend=fsdp.")
        if not b.reduce_every_micro_batch:
            raise UserError("backend.reduce_every_micro_batch", False, "The pipeline schedule decides when FSDP "
                            "reduces (at the last pipeline micro-batch of each micro batch).",
                            "Leave backend.reduce_every_micro_batch=true with backend=pipeline.")
        check_pipeline_model(shape_model(cfg.model), cfg)

    @staticmethod
    def model_states(cfg: DictConfig, n_params: int, world: int, shape: dict, optim_bytes: float) -> ModelStates:
        """FSDP2's states (``FSDPBackend.model_states``) of every stage over its dp = world/stages ranks, stage 0's
        first and the others in ``others`` (the plan plans the busiest):

        1. A stage's own layers (``layer_split``, the first chunks one longer) counted block by block, MoE or
           dense, plus the embedding (the first stage) or the final norm and head (the last).
        2. Activations: its layers' share of what the micro-batches in flight keep, each 1/microbatches of the
           micro batch (GPipe: all of them; 1F1B: stage s runs stages - s forwards before its first backward;
           interleaved is counted as 1F1B), with what the stage holds of each at its edges; one block recomputed
           for one pipeline micro-batch, and on the last stage the logits of one pipeline micro-batch (1F1B: its
           loss and backward follow each forward; GPipe keeps all of them); the root's gradient made in backward.
           The point-to-point activations are not in the communication figure.
        3. Buffers: torch's schedule runs every backward of a step without resharding or reducing (FSDP's
           reduce-scatter waits for the last pipeline micro-batch), so the stage's own parameters stay unsharded
           in the compute dtype for the whole step, its gradients accumulate unsharded in fp32 (FSDP2's
           accumulation in the reduce dtype), and each block's backward adds its gradient in the compute dtype:
           (c + 4) x the stage's blocks + c x its largest block, counting this rank's 1/ep of the experts. The
           embedding or head (the stage's root, reduced once at the end) accumulates in the compute dtype:
           2 x c x its parameters.
           Found by the dry run (deepseek_v3_pipeline_ep: 40-43 GiB per GPU, where per-block FSDP accounting
           said 10).
        4. For the step-time model (``collectives``, ``bubble``): the stage's parameters gathered once per
           micro batch (they stay unsharded through the schedule), its gradients reduce-scattered after the
           schedule's last backward (on the critical path); each pipeline micro-batch's activations sent to the
           next stage and their gradients back at every chunk's edge (c x tokens x hidden each way, a
           context-parallel rank's share of the tokens, on the critical path); the bubble, (stages - 1) /
           (micro-batches x chunks per rank) of the compute (GPipe and 1F1B alike; interleaved divides it by its
           chunks, Megatron-LM's (p - 1) / (v m)).
        """
        b = cfg.backend
        pp, m = int(b.stages), int(b.microbatches)
        chunks = pp * (int(b.virtual_stages) if b.schedule == "interleaved" else 1)
        n = max(int(shape["blocks"]), 1)
        per_block = shape.get("block_param_list") or [shape["block_params"] / n] * n
        per_experts = shape.get("block_expert_list") or [0] * n
        d = int(shape.get("mtp_depth", 0))  # MTP depths: the last blocks, on the last stage (parallelize_pipeline)
        spans = layer_split(n - d, chunks)
        ep = int(b.ep) if shape.get("expert_params") else 1
        c, dp = (FP32 if cfg.precision.name == "fp32" else HALF), max(world // pp, 1)
        kinds = []
        for s in range(pp):
            mine = [i for ch in range(s, chunks, pp) for i in range(*spans[ch])]  # 1
            mine += list(range(n - d, n)) if (chunks - 1) % pp == s else []
            root = shape["root_params"] / 2 * ((s == 0) + (s == pp - 1))
            blocks, experts = sum(per_block[i] for i in mine), sum(per_experts[i] for i in mine)
            big = max(mine, key=lambda i: per_block[i], default=None)
            largest, largest_e = (per_block[big], per_experts[big]) if big is not None else (0.0, 0.0)
            sliced = {**shape, "blocks": len(mine), "block_params": blocks, "max_block_params": largest,
                      "root_params": root, "moe_layers": sum(1 for i in mine if per_experts[i]),
                      "expert_params": experts, "max_block_expert_params": largest_e}
            states = FSDPBackend.model_states(cfg, int(blocks + root), dp, sliced, optim_bytes)
            in_flight = m if b.schedule == "gpipe" else min(pp - s, m)  # 2
            logits = (m if b.schedule == "gpipe" else 1) if s == pp - 1 else 0
            held = blocks - experts * (1 - 1 / ep)  # 3
            device = {**states.device, "buffers": (c + FP32) * held + 2 * c * root
                      + c * (largest - largest_e * (1 - 1 / ep))}
            # 2: beside its blocks' checkpointed inputs, the stage's edges as torch allocates them (``edge_units``:
            # a receive buffer per pipeline micro-batch of the step, the outputs in flight). The root's backward
            # (stage_bytes): the embedding's or the head's gradient made in the compute dtype beside the one
            # accumulated, and the head's from the fp32 logits' gradient, c x root x 3.1 on the last stage, x 1.4 on
            # the first (measured by the dry run on both V3 layouts, 8 and 16 of 16 micro-batches in flight there;
            # with the edges fitted per micro-batch in flight it had taken 0.7 where all were in flight)
            edge = c * shape["root_params"] / 2 * (1.36 * (s == 0) + 3.13 * (s == pp - 1))
            # 3: the first stage backpropagates its embedding last, after the blocks whose recompute is the
            # activations' peak: its gradient (and, with every micro-batch in flight, the accumulated one) is not
            # there yet
            apart = c * root * (2 if in_flight == m else 1) if s == 0 and pp > 1 else 0.0
            # MTP: every stage carries the embedding beside the hidden states (``edge_units``: its buffers hold
            # two), and the last stage's output holds each depth's logits beside the main head's (c x vocab per
            # token).
            out_logits = c * shape["vocab"] * d * logits / m if s == pp - 1 else 0.0
            kinds.append(dataclasses.replace(
                states, device=device, buffers_apart=apart, activation_factor=1 / m,
                stage_bytes_per_token=edge_units(s, pp, chunks, m, in_flight, d) * c * shape["hidden"] / m
                + out_logits, stage_bytes=edge,
                activation_parts=(in_flight / m * len(mine) / n, 1 / m if mine else 0.0, logits / m),
                notes=states.notes + [f"pipeline {pp} stages ({b.schedule}, {m} micro-batches): stage {s} holds "
                                      f"{len(mine)} layers, {in_flight} micro-batches in flight, FSDP over {dp} "
                                      "data-parallel ranks"]))
        v = int(b.virtual_stages) if b.schedule == "interleaved" else 1  # 4
        # a rank's share of the micro batch's positions (backend.cp: the hidden states it sends are its share's)
        tokens = float(cfg.train.micro_batch_size) * float(cfg.data.seq_len) / int(b.get("cp", 1))

        def timed(k: ModelStates) -> ModelStates:
            gathered = [dataclasses.replace(x, bytes=x.bytes / 2, calls=max(x.calls // 2, 1)) if x.op == "all-gather"
                        else dataclasses.replace(x, hidden_by="none") if x.op == "reduce-scatter" else x
                        for x in k.collectives]
            sends = Collective("send", 2 * v * tokens * shape["hidden"] * c, "pp", "micro", 2 * m * v)
            return dataclasses.replace(k, collectives=gathered + ([sends] if pp > 1 else []), bubble=(pp - 1) / (m * v))

        kinds = [timed(k) for k in kinds]
        return dataclasses.replace(kinds[0], others=kinds[1:])

    def init(self) -> None:
        self.device = pick_device(self.plan, int(os.environ.get("LOCAL_RANK", 0)))
        init_process_group(self.cfg, self.device)
        ep, dims = self.plan.dims.ep, self.plan.dims
        shard = dims.dp_shard * dims.cp  # a stage's shard group: its context-parallel ranks too
        self.mesh = fsdp_mesh(self.device.type, {"pp": self.pp}, dims.dp_replicate,
                              {"edp": shard // ep, "ep": ep} if ep > 1 else {"dp": shard}, {})
        self.pp_group = self.mesh["pp"].get_group()

    def prepare(self, build, total_steps: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        b = self.bcfg
        self.model = build(allow_meta=True)
        self.depths = mtp.depth(self.model)  # multi-token prediction: loss terms beside the main head's
        self.stages = parallelize_pipeline(self.model, self.cfg, self.mesh, self.device)
        self.mine = list(range(self.pp_rank, self.chunks, self.pp))
        for stage in self.stages:  # MoE balance losses: the plain mean over pipeline micro-batches and accumulation
            stage.loss_scale = 1 / (b.microbatches * self.plan.grad_accum_steps)
        pipe = [PipelineStage(s, c, self.chunks, self.device, group=self.pp_group) for s, c in zip(self.stages, self.mine)]
        for stage, driver in zip(self.stages, pipe):
            object.__setattr__(stage, "pipe", driver)  # not a submodule
        self.accum = self.plan.grad_accum_steps
        schedule: Any = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[b.schedule]
        # scale_grads=False: the loss function scales each pipeline micro-batch's loss itself (_scaled_loss), so
        # gradients add up across the several schedule steps of one optimizer step (the schedule's own scaling
        # would divide what earlier micro-batches accumulated again).
        self.schedule = schedule(pipe if b.schedule == "interleaved" else pipe[0], n_microbatches=b.microbatches,
                                 loss_fn=self._scaled_loss, scale_grads=False)
        # norm_group: the norm over every stage's gradients. own_param_groups: a resumed later stage keeps its
        # optimizer's param groups, since DCP stores them from rank 0 (the first stage's parameters) only.
        self.stepper = TorchStepper(self.model, self.cfg, self.device, self.accum, total_steps, autocast=False,
                                    norm_group=self.pp_group, own_param_groups=True,
                                    **stepper_options(self.model, self.plan.dims.ep, self.plan.dims.dp_replicate))
        self.model.forward = self._forward_whole  # for sampling through hf_model(): the whole model's logits
        self._terms: list[torch.Tensor] = []

    def _scaled_loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One pipeline micro-batch's (a chunk of the micro batch) summed cross-entropy x ``weight`` / accumulation:
        over the chunks it adds up to the micro batch's ``ce_sum x weight / accum``, as ``TorchStepper``
        backpropagates, and FSDP's mean over dp makes the step's gradient the token-weighted mean's. With MTP
        depths ``out`` holds the main head's logits and each depth's, one after the other along the sequence: each
        term is summed against its own targets (``mtp.depth_targets``) and weighted by its own ``weight``. The
        terms are kept (``_terms``) for the log: the schedule's own losses are the weighted totals."""
        parts = out.chunk(self.depths + 1, dim=1)
        sums = torch.stack([F.cross_entropy(o.float().reshape(-1, o.size(-1)), mtp.depth_targets(targets, None, k)
                                            .reshape(-1), ignore_index=-100, reduction="sum")
                            for k, o in enumerate(parts)])
        self._terms.append(sums.detach())
        return (sums * self._weight).sum() / self.accum

    def forward_backward(self, inputs, targets, is_last_micro: bool, weight: torch.Tensor) -> torch.Tensor:
        self._weight, self._terms = weight, []  # read and filled by _scaled_loss
        losses: list[torch.Tensor] = []
        ids, kwargs = stage_inputs(inputs)  # positions and the context-parallel group: to every stage
        args = (ids,) if 0 in self.mine else ()
        self.schedule.step(*args, target=targets, losses=losses, **kwargs)
        # Only the last stage computed the loss: it sends the micro batch's summed cross-entropies (one per term) to
        # the others of its pipeline. The schedule's first step also calls the loss function once to infer the
        # backward's shapes, before the micro-batches: their terms are the last ones kept.
        ce = torch.stack(self._terms[-self.bcfg.microbatches:]).sum(0) if losses \
            else torch.zeros(1 + self.depths, device=self.device)
        dist.broadcast(ce, group=self.pp_group, group_src=self.pp - 1)
        return ce if self.depths else ce[0]

    def simulated_forward_backward(self, inputs, targets, is_last_micro: bool, weight: torch.Tensor) -> None:
        """The dry run's ``forward_backward`` (``shardyard.planning.dryrun``): this rank's stages at the schedule's deepest
        point, on a fake process group that cannot carry the schedule's shape handshake. The micro-batches in
        flight (GPipe: all ``microbatches``; 1F1B: ``stages - s`` of them on stage s) run forward, each on its slice
        of the micro batch, then backward, and 1F1B one more forward after the first backward: its steady state,
        where a backward runs beside the gradients earlier ones accumulated. The edges are torch's
        (``torch.distributed.pipelining.PipelineStage``, torch 2.13): a stage after the first receives into one
        buffer per pipeline micro-batch of the step (the hidden states, and the carried embedding with MTP), a
        stage before the last receives its output's gradient into one buffer per pipeline micro-batch too, all of
        them held by every chunk of this rank for the whole step; an output stays until its backward; an input's
        gradient stays until it is sent (here: until the next backward). FSDP runs as the schedule runs it: every
        backward without resharding or reducing, so each stage keeps its parameters unsharded and its gradients
        unsharded and accumulating over the step's pipeline micro-batches, then one reduction
        (``perform_reduce_grad``). The last stage's loss is the run's ``_scaled_loss``."""
        b = self.bcfg
        m = int(b.microbatches)
        in_flight = m if b.schedule == "gpipe" else min(self.pp - self.pp_rank, m)  # 1F1B: stage s, pp - s
        self._weight = weight
        dtype = COMPUTE_DTYPES[self.cfg.precision.name]
        inputs, kwargs = stage_inputs(inputs)  # with backend.cp: this rank's share, its exchanges simulated
        per_micro = _rows(kwargs, m)
        rows = inputs.shape[0] // m
        shape = (rows, inputs.shape[1], self.model.config.hidden_size)

        def buffers(stage: Stage, requires_grad: bool) -> list[tuple[torch.Tensor, ...]]:
            return [tuple(torch.empty(shape, dtype=dtype, requires_grad=requires_grad)
                          for _ in range(1 + stage.with_mtp)) for _ in range(m)]

        # every chunk's receive buffers at once, as the schedule's stages hold them: inputs (after the first
        # chunk), output gradients (before the last)
        received = [buffers(st, True) if not st.first else None for st in self.stages]
        grads_in = [buffers(st, False) if not st.last else None for st in self.stages]
        for stage, inputs_of, grads_of in zip(self.stages, received, grads_in):
            todo = list(enumerate(zip(inputs.chunk(m), targets.chunk(m))))[:min(in_flight + 1, m)]
            outs: list = []

            def forward() -> None:
                j, (ids, tgt) = todo.pop(0)
                outs.append((j, stage(ids, **per_micro[j]) if inputs_of is None else
                             stage(*inputs_of[j], **per_micro[j]), tgt))

            for _ in range(in_flight):
                forward()
            sending: list = []  # the input gradient sent last, alive until its send completes
            while outs:  # each output released after its backward, as the schedule drops it (and its graph)
                j, out, tgt = outs.pop(0)
                stage.set_is_last_backward(False)  # type: ignore[operator]  # FSDPModule methods, added at runtime
                stage.set_reshard_after_backward(False)  # type: ignore[operator]
                stage.set_requires_gradient_sync(False)  # type: ignore[operator]
                if stage.last:
                    self._scaled_loss(out, tgt).backward()
                else:
                    sent = out if isinstance(out, tuple) else (out,)
                    assert grads_of is not None
                    torch.autograd.backward(sent, list(grads_of[j][:len(sent)]))
                del out
                if inputs_of is not None:  # torch takes the input's gradient off its buffer to send it
                    sending = [x.grad for x in inputs_of[j]]
                    for x in inputs_of[j]:
                        x.grad = None
                if todo:
                    forward()
            del sending
            stage.pipe.perform_reduce_grad(1)

    step = forward_to("stepper", TorchStepper.step)

    @torch.no_grad()
    def eval_loss(self, inputs, targets) -> torch.Tensor:
        """The micro batch's mean cross-entropy over its labelled tokens, on every rank, outside the schedule:

        1. The chunks run in order (``_run_chunks``), each stage sending its hidden states to the next only.
        2. The last stage computes the loss from its logits, as a sum and a label count, and sends those two
           numbers to the other stages: the logits ([B, T, V] fp32, 17 GB at B 4, T 8192, V 128k) never leave it.
        """
        out = self._run_chunks(inputs)  # 1
        pair = torch.zeros(2, device=self.device)
        if out is not None:  # 2
            pair[0] = F.cross_entropy(out.float().reshape(-1, out.size(-1)), targets.reshape(-1), ignore_index=-100,
                                      reduction="sum")
            pair[1] = (targets != -100).sum()
        dist.broadcast(pair, group=self.pp_group, group_src=(self.chunks - 1) % self.pp)
        return pair[0] / pair[1]  # no label: 0 / 0, NaN, as the mean over none

    def _run_chunks(self, inputs: Any) -> torch.Tensor | None:
        """The whole model on ``inputs`` (token ids, or a micro-batch as ``stage_inputs`` takes it) outside the
        schedule: chunk by chunk, each computed by its stage's ranks (FSDP over their dp; with backend.cp the
        group's shares) and its output sent point to point to the next chunk's stage, in the compute dtype (the
        next stage casts its input to it anyway). The last chunk's output (the logits) on the last stage's ranks;
        None elsewhere. The main model only: multi-token prediction is a training loss."""
        with _without_mtp(self.stages):
            return self._run_plain_chunks(*stage_inputs(inputs))

    def _run_plain_chunks(self, ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
        c = self.model.config
        dtype = COMPUTE_DTYPES[self.cfg.precision.name]
        h: torch.Tensor | None = ids
        for chunk in range(self.chunks):
            owner, prev = chunk % self.pp, (chunk - 1) % self.pp
            if owner != self.pp_rank:
                continue
            if chunk > 0 and prev != self.pp_rank:
                h = torch.empty(*ids.shape, c.hidden_size, dtype=dtype, device=self.device)
                dist.recv(h, group=self.pp_group, group_src=prev)
            assert h is not None
            h = self.stages[self.mine.index(chunk)](h, **kwargs)
            if chunk < self.chunks - 1 and (chunk + 1) % self.pp != self.pp_rank:
                dist.send(h.to(dtype).contiguous(), group=self.pp_group, group_dst=(chunk + 1) % self.pp)
        return h if (self.chunks - 1) % self.pp == self.pp_rank else None

    def _forward_whole(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole model's logits on every rank (fp32): the pruned model's ``forward``, for sampling through
        ``hf_model()`` (a one-row prompt of a few tokens). Evaluation does not come here (``eval_loss``)."""
        out = self._run_chunks(ids)
        logits = out.float().contiguous() if out is not None else \
            torch.empty(*ids.shape, self.model.config.vocab_size, device=self.device)
        dist.broadcast(logits, group=self.pp_group, group_src=(self.chunks - 1) % self.pp)
        return logits

    save_checkpoint = forward_to("stepper", TorchStepper.save_checkpoint)  # this rank's layers, whole-model names
    save_checkpoint_async = forward_to("stepper", TorchStepper.save_checkpoint_async)  # checkpoint.async_save
    load_checkpoint = forward_to("stepper", TorchStepper.load_checkpoint)  # with own_param_groups (prepare)
    training_state = forward_to("stepper", TorchStepper.training_state)
    load_training_state = forward_to("stepper", TorchStepper.load_training_state)

    all_reduce_mean = staticmethod(process_group.all_reduce_mean)  # stages hold their pipeline's value: dp's mean
    barrier = staticmethod(process_group.barrier)

    def hf_model(self) -> torch.nn.Module:
        return self.model

    def reference_model(self, build) -> torch.nn.Module:
        """Not offered: the objectives that need a reference run the whole model's forward on a rank, and a stage
        holds only its layers (validation refuses the objective on this engine before any rank starts)."""
        objective = OmegaConf.select(self.cfg, "objective.name", default=None) or "an objective with a reference"
        raise UserError("objective", objective, "It compares the policy with a frozen reference model run whole on "
                        "each rank, and backend=pipeline splits the model into stages across ranks.",
                        "Use backend=fsdp or zero3 (the reference sharded as the policy), or fsdp_tp, ddp, zero1/2."
                        ).on_every_rank()

    def full_state_dict(self) -> dict | None:
        """Each stage's tensors gathered over its dp replicas one at a time (a full tensor at a time on the
        device) into its first replica's CPU memory, then sent to rank 0, which holds the whole model."""
        part = {}
        for name, t in self.model.state_dict().items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if self.dp_rank == 0:
                part[name] = full.detach().cpu()
        parts: list = [None] * self.world_size if self.rank == 0 else []
        dist.gather_object(part if self.dp_rank == 0 else None, parts if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return None
        return {k: v for p in parts if p for k, v in p.items()}

    def close(self) -> None:
        teardown(self, "stepper", "schedule", "stages", "model")
