"""The memory and launch plan: will this recipe fit, and if not, what will?

``estimate(cfg, batch, hardware)`` is a pure function of the composed config, the batch plan and a hardware
description: per rank, the bytes of parameters, gradients, optimizer state, master weights, the engine's own
buffers and activations, what offload moves to host RAM or NVMe, the bytes each rank sends per step and the
step time those bytes and the FLOPs imply. Nothing is allocated: the model's shape comes from the one
meta-device build validation already does (``model.model_shape``), the optimizer's bytes per parameter from one
step on a 64 x 64 probe tensor.

Each engine states what it holds in its own module (``Backend.model_states``), next to the code that
allocates it; this module only adds activations, the runtime and the hardware. Where the figures come from
(measured, not guessed) is in docs/architecture.md, "The plan". The hardware itself is
:mod:`shardyard.planning.hardware`; every other engine and layout that could run the recipe (``plan.only``, a
refusal's alternatives, the check before launch) is :mod:`shardyard.planning.search`, which reads this module.

A module of the ``planning`` package: it imports ``core``, ``config``, ``models``, ``objectives`` and ``backends``
(each engine's ``model_states``), torch only to probe the optimizer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

from omegaconf import DictConfig

from shardyard.config import checkpointed_fraction, checkpointing_mode
from shardyard.core import moved
from shardyard.core.facts import MAX_NODES, ParallelDims, Plan, node_counts
from shardyard.planning.hardware import CPU_ALLOCATOR_SLACK, CPU_RUNTIME_BYTES, CUDA_RUNTIME_BYTES, GiB, Hardware


# ------------------------------------------------------------------------------------------- the model
def optimizer_bytes_per_param(o: DictConfig) -> float:
    """Optimizer state bytes per fp32 parameter: one real step of the recipe's optimizer on a 64 x 64 tensor
    (AdamW 8, SGD with momentum 4, Adafactor's factored rows and columns about 0.1)."""
    import torch

    key = repr(sorted((k, str(v)) for k, v in o.items()))
    if key not in _OPT_CACHE:
        p = torch.nn.Parameter(torch.zeros(64, 64))
        opt = _probe_optimizer(o, p)
        p.grad = torch.ones_like(p)
        opt.step()
        held = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.numel() > 1)
        _OPT_CACHE[key] = held / p.numel()
    return _OPT_CACHE[key]


_OPT_CACHE: dict[str, float] = {}


def _probe_optimizer(o: DictConfig, p: Any) -> Any:
    from hydra.utils import get_object

    from shardyard.backends.optim import optimizer_kwargs

    return get_object(o._target_)([{"params": [p], "weight_decay": 0.0}], **optimizer_kwargs(o))


# -------------------------------------------------------------------------------------------- the plan
@dataclass
class Estimate:
    """One rank's plan for one engine on one piece of hardware (bytes, seconds)."""

    engine: str
    """The engine's name, with its expert-parallel degree or HSDP copies when it has them (``fsdp ep=8``, ``fsdp replicate=2``)."""
    world: int
    micro_batch: int
    grad_accum: int
    activation_checkpointing: bool
    device: dict[str, float]
    """On the device (CUDA memory; host RAM on CPU): params, grads, optimizer, master, buffers, activations,
    and on CPU the worker's own runtime."""
    host: dict[str, float]
    """Host RAM per rank besides the device (offloaded state; empty on CPU, where everything is host RAM)."""
    nvme: float
    comm_bytes: float
    """Bytes each rank sends per optimizer step (ring collectives)."""
    compute_s: float | None
    comm_s: float
    notes: list[str] = field(default_factory=list)
    overlap: float = 0.0
    """Bytes of ``device`` never alive together (gradients built while activations are freed)."""
    fits: bool = True
    shortfall: str = ""

    @property
    def device_peak(self) -> float:
        return sum(self.device.values()) - self.overlap

    @property
    def host_peak(self) -> float:
        return sum(self.host.values())

    @property
    def model_states(self) -> dict[str, float]:
        """Parameters, gradients and optimizer state (master weights included) wherever they live."""
        both = {k: self.device.get(k, 0.0) + self.host.get(k, 0.0) for k in ("params", "grads", "optimizer", "master")}
        return {"params": both["params"], "grads": both["grads"], "optimizer": both["optimizer"] + both["master"]}

    @property
    def step_s(self) -> float | None:
        # Ring collectives overlap with compute at best; count the larger of the two plus a quarter of the other.
        if self.compute_s is None:
            return None
        return max(self.compute_s, self.comm_s) + 0.25 * min(self.compute_s, self.comm_s)


NF4_BYTES = (4 + 0.127) / 8
"""QLoRA's frozen weights: 4-bit NF4 plus double-quantised block constants (0.127 bits per parameter, QLoRA
paper section 3)."""


def frozen_base(states: Any, P: int, trainable: int, shape: dict, quantized: bool = False) -> Any:
    """Adapters (``peft=lora``): gradients, master weights and optimizer state exist for the trainable
    parameters only, so each engine's figures for them scale by trainable / P; the frozen base is held as the
    engine holds parameters (replicated, sharded or partitioned). ``qlora`` (replica engines): the blocks'
    linear weights in NF4, embeddings, norms and head (the root) and the adapters in fp32. Communication is
    left as for full training (an upper bound: gradient reductions shrink, parameter all-gathers do not)."""
    import dataclasses

    f = trainable / max(P, 1)

    def scaled(where: dict) -> dict:  # the adapters are parameters too, held as the base's are
        return {k: v * f if k in ("grads", "optimizer", "master") else v * (1 + f) if k == "params" else v
                for k, v in where.items()}

    device = scaled(states.device)
    if quantized:
        root = shape.get("root_params", 0)
        device["params"] = 4.0 * (root + trainable) + NF4_BYTES * max(P - root, 0)
    return dataclasses.replace(states, device=device, host=scaled(states.host),
                               accumulation_bytes=states.accumulation_bytes * f,
                               accumulation_buffers=states.accumulation_buffers * f,
                               notes=list(states.notes) + [f"peft: {trainable:,} trainable parameters "
                                                           f"({100 * f:.2f}%) hold gradients and optimizer state"])


def estimate_kinds(cfg: DictConfig, batch: Plan, hw: Hardware) -> list[Estimate]:
    """The plan of every kind of rank of ``cfg`` on ``hw`` (one on most engines; a pipeline's stages, in order):
    ``batch.facts.shape`` from the meta build."""
    from shardyard.backends import engine, parallel_dims

    shape = batch.facts.shape
    P, N = batch.facts.params, hw.world
    # This engine's layout on the hardware's world: the run's own (batch.dims) when they are the same run,
    # another engine's or world when the plan compares them.
    dims = parallel_dims(cfg, N)
    mp, dp = dims.model_parallel, dims.dp  # dp: the data-parallel replicas
    accum = _accumulation(cfg, batch, dp)
    mbs = batch.micro_batch_size
    first = engine(cfg.backend).model_states(cfg, P, N, shape, optimizer_bytes_per_param(cfg.optim))
    return [_one_rank(cfg, batch, hw, s, accum, dims) for s in [first, *first.others]]


def estimate(cfg: DictConfig, batch: Plan, hw: Hardware) -> Estimate:
    """The plan of ``cfg`` (its engine, model, precision, batch) on ``hw``: its busiest rank's (``estimate_kinds``).
    World size, micro batch and accumulation are those the hardware implies."""
    return max(estimate_kinds(cfg, batch, hw), key=lambda e: e.device_peak)


def _one_rank(cfg: DictConfig, batch: Plan, hw: Hardware, states: Any, accum: int, dims: Any) -> Estimate:
    """``estimate`` for one kind of rank, whose model states the engine gave (``states``)."""
    from shardyard.models import adapters

    shape, P, N, mbs = batch.facts.shape, batch.facts.params, hw.world, batch.micro_batch_size
    mp, dp = dims.model_parallel, dims.dp
    quantized = batch.facts.trainable is not None and adapters.method(cfg.peft).quantized_base
    trainable_share = 1.0 if batch.facts.trainable is None else batch.facts.trainable / max(P, 1)
    staged = checkpoint_staging(cfg, states, trainable_share)  # before frozen_base: what the save holds
    if batch.facts.trainable is not None:
        states = frozen_base(states, P, batch.facts.trainable, shape, quantized=quantized)
    mode = checkpointing_mode(cfg.model)
    ckpt = mode != "none"
    fraction = checkpointed_fraction(cfg.model, shape["blocks"])
    kept_share = 1 - (fraction if ckpt else 0.0)  # of the blocks, those whose activations stay until backward
    # Sequence and context parallelism (backend.sp, backend.cp): a rank holds 1/(sp x cp) of every sequence's
    # positions, and each block's activations are per position (Ulysses' attention too: after the exchange a rank
    # holds all positions of 1/sp of the heads)
    per_rank = mbs * batch.tokens_per_sample / (dims.sp * dims.cp)
    kept, transient, loss, copies = _activation_parts(shape, states.regime, per_rank, mode, fraction,
                                                      int(cfg.model.get("loss_chunk", 0)),
                                                      int(cfg.model.get("mlp_tiles", 0)),
                                                      int(cfg.model.get("norm_tiles", 0)))
    # model.activation_offload: what full checkpointing keeps of every block (its input) is in host RAM, not on
    # the device, from the block's forward to its backward (the recomputed block brings its own back: ``transient``)
    offloaded = offloaded_bytes(cfg, shape, states.regime, per_rank)
    kept -= offloaded if hw.device != "cpu" else 0.0  # one pool on CPU: the copy is in the same RAM
    gathered = 0.0
    if dims.cp > 1:  # all-gather context parallelism: each block's attention keeps the other ranks' keys and values
        # (gathered in the compute dtype) for its backward: every block's not checkpointed, the recomputed one's
        gathered = (mbs * batch.tokens_per_sample * (dims.cp - 1) / dims.cp * kv_width(cfg.model, shape)
                    * (4 if states.regime == "fp32" else 2))
        kept += kept_share * shape["blocks"] * gathered
        transient += gathered if ckpt else 0.0
    if batch.facts.trainable is not None:  # autocast caches the casts of weights that train only (not a frozen base)
        copies *= batch.facts.trainable / max(P, 1)
        if states.regime == "autocast" and not quantized:
            # but each frozen linear keeps its weight's bf16 cast for the backward of its input, until its
            # block's backward: every block's not checkpointed, one recomputed block's otherwise
            frozen_blocks = max(shape["block_params"] - batch.facts.trainable, 0)
            copies += 2 * (kept_share * frozen_blocks + (1 - kept_share) * shape["max_block_params"])
    if batch.facts.adapter_activations is not None:  # what the adapters keep, less what the frozen base does not
        adapters_keep = batch.facts.adapter_activations[states.regime]["cpu" if hw.device == "cpu" else "cuda"]
        frozen_skips = shape["activation_bytes_per_token"][states.regime]["frozen_blocks"]
        kept += kept_share * (adapters_keep - frozen_skips) * per_rank
    f = states.activation_factor
    fk, ft, fl = states.activation_parts or (f, f, f)
    # The loss's logits are freed by its backward before the first block is recomputed (or backpropagated): the
    # two never coexist (the dry run: a DeepSeek-V3 last stage 9.2 GiB, not 14 as their sum; deepseek7b 11.5).
    acts = (kept * fk + max(transient * ft, loss * fl)
            + (copies + states.dispatch_bytes_per_token * per_rank) * f
            + states.stage_bytes_per_token * per_rank + states.stage_bytes)
    device = dict(states.device)
    if accum > 1 and states.accumulation_bytes:
        device["grads"] = device.get("grads", 0.0) + states.accumulation_bytes
    all_reduced = states.accumulation_buffers if accum > 1 else 0.0  # made in backward as activations are freed
    if all_reduced:
        device["buffers"] = device.get("buffers", 0.0) + all_reduced
    device["activations"] = acts
    # Post-training (objective=dpo|grpo): the frozen reference is held as the engine holds the policy's parameters
    # (a replica, or its shards: Backend.reference_model) unless adapters are disabled instead (LoRA); GRPO keeps its
    # round of rollouts (ids, mask, positions, targets, the sampling policy's and the reference's log-probs).
    from shardyard.objectives import held

    reference, kept_per_token = held(cfg.objective)
    if reference and batch.facts.trainable is None:
        device["reference"] = states.device.get("params", 0.0)
        if states.host.get("params"):
            states = dataclasses.replace(states, host={**states.host, "reference": states.host["params"]})
    if kept_per_token:
        device["rollouts"] = kept_per_token * mbs * batch.tokens_per_sample * accum
    # Without accumulation, gradients freed by each step grow in backward as the activations shrink.
    overlap = min(device.get("grads", 0.0), acts) if states.grads_freed_each_step and accum == 1 else 0.0
    # Buffers alive only once the activations are freed (FSDP's root reduced after the whole backward).
    overlap = min(overlap + states.buffers_apart + all_reduced, acts)
    if hw.device == "cpu":  # one pool: the device is host RAM, offloaded state included
        for k, v in states.host.items():
            device[k] = device.get(k, 0.0) + v
        if staged:
            device[STAGING] = staged
        device["runtime"] = CPU_RUNTIME_BYTES + CPU_ALLOCATOR_SLACK * (sum(device.values()) - overlap)
        host: dict[str, float] = {}
    else:
        host = dict(states.host)
        if staged:
            host[STAGING] = staged
        if offloaded:
            host["activations"] = offloaded * fk
    tokens = per_rank * accum / mp  # a tensor-parallel or pipeline rank computes its part of each token
    recompute = {"none": 0.0, "full": 1 / 3, "selective": 1 / 30}[mode] * fraction  # a block's forward is 1/3 of its
    # training FLOPs; selective recomputes only the ops between matmuls (a few % of them)
    compute = None if hw.peak_flops is None else batch.facts.flops_per_token * tokens * (1 + recompute) / (
        hw.peak_flops * cfg.plan.mfu)
    comm_bytes = states.comm_bytes(accum) * (dp - 1) / dp  # the engine's collectives run over its replicas
    # Expert parallelism's all-to-all (``backends.expert_parallel_states`` 4): per micro-batch, moe_layers x tokens x
    # R x hidden x dtype bytes x passes (4; 6 with full recompute) x (ep - 1)/ep, R the rows a token is sent as: one
    # per rank holding any of its experts, at most min(top_k, ep) and, under group-limited routing lined up with
    # the ranks, at most topk_group x the ranks of a group (``moe.RoutingGroups.max_ranks``; measured against routed
    # tokens in tests/unit/test_group_routing.py). The routing line below says which bound holds.
    comm_bytes += states.all_to_all_per_micro * accum  # point to point: what leaves the rank, counted already
    if dims.sp > 1:  # Ulysses: per block, queries, keys, values and the output exchanged, forward and backward
        width = 2 if states.regime == "autocast" else 4
        comm_bytes += 8 * shape["blocks"] * per_rank * shape["hidden"] * width * (dims.sp - 1) / dims.sp * accum
    # all-gather context parallelism: per block, the keys and values gathered forward, their gradients reduce-scattered
    comm_bytes += 2 * shape["blocks"] * gathered * accum
    bw = hw.intra_bw if hw.nodes == 1 else hw.inter_bw
    ep = int(cfg.backend.get("ep", 1))
    notes = list(states.notes)
    if states.all_to_all_per_micro:
        notes += routing_notes(cfg, batch, ep, dims.shard_group, hw.ranks_per_node)
    replicate = int(cfg.backend.get("replicate", 1))  # HSDP's copies (the FSDP2 engines)
    name = (cfg.backend.name + (f" ep={ep}" if ep > 1 else "") + (f" replicate={replicate}" if replicate > 1 else "")
            + (f" sp={dims.sp}" if dims.sp > 1 else "") + (f" cp={dims.cp}" if dims.cp > 1 else ""))
    e = Estimate(name, N, mbs, accum, ckpt, device, host, states.nvme, comm_bytes, compute,
                 comm_bytes / bw if N > 1 else 0.0, notes, overlap)
    _check_fit(e, hw, cfg.plan.headroom)
    return e


def offloaded_bytes(cfg: DictConfig, shape: dict, regime: str, tokens: float) -> float:
    """``model.activation_offload``: the bytes of one micro-batch of ``tokens`` in host RAM per rank, every block's
    input (full checkpointing of every block: validation), 0 without it."""
    if not cfg.model.get("activation_offload") or checkpointing_mode(cfg.model) != "full":
        return 0.0
    return shape["blocks"] * shape["activation_bytes_per_token"][regime]["ckpt_per_block"] * tokens


def kv_width(model: DictConfig, shape: dict) -> float:
    """Elements per token of one block's attention keys and values as attention reads them: DeepSeek's MLA
    expanded to every head (heads x (qk_nope + qk_rope + v head sizes)), grouped-query attention's key/value
    heads (2 x hidden x kv heads / heads), else 2 x hidden."""
    h, heads = float(shape["hidden"]), int(model.get("num_heads") or 0)
    if model.get("qk_nope_head_dim") is not None and heads:
        return heads * (int(model.qk_nope_head_dim) + int(model.qk_rope_head_dim) + int(model.v_head_dim))
    kv = int(model.get("num_kv_heads") or heads or 0)
    return 2 * h * (kv / heads if heads and kv else 1.0)


STAGING = "checkpoint_staging"
"""The plan's name for the host copy a background save writes from (``checkpoint_staging``)."""


def checkpoint_staging(cfg: DictConfig, states: Any, trainable_share: float = 1.0) -> float:
    """``checkpoint.async_save``: the bytes of the host copy a background save writes from, per rank
    (``checkpoint.HostStaging``: one buffer, reused by every save): this rank's parameters and optimizer state
    (master weights included) wherever the engine holds them, those of the trainable parameters only
    (``trainable_share``: a frozen base is not saved); 0 without background saves. In the host column (on CPU
    in the one pool: the device is host RAM). Engines without a background save (validation refuses the key
    there) stage nothing: ``plan.only``'s other engines are planned as they would run."""
    from shardyard.backends import engine

    if not cfg.checkpoint.get("async_save") or not hasattr(engine(cfg.backend), "save_checkpoint_async"):
        return 0.0
    held = sum(states.device.get(k, 0.0) + states.host.get(k, 0.0) for k in ("params", "optimizer", "master"))
    return held * trainable_share


ROUTING = "routing groups: "
"""The start of the plan's note on group-limited routing under expert parallelism (``routing_notes``), which the
line printed at every start repeats."""


def routing_notes(cfg: DictConfig, batch: Plan, ep: int, dp_shard: int, ranks_per_node: int) -> list[str]:
    """Whether ``model.n_group``'s routing groups line up with the ranks (or nodes) of the EP groups, as one note
    (``moe.RoutingGroups.note``): none without a group limit. Not an error when they do not: the routing is the
    model's, only the all-to-all reaches more peers."""
    from shardyard.models.moe import routing_groups

    E, K = batch.facts.routed_experts, batch.facts.experts_per_token
    rg = routing_groups(cfg.model, E, K, ep, ranks_per_node)
    options = [d for d in range(2, min(E, dp_shard) + 1) if E % d == 0 and dp_shard % d == 0]
    note = rg.note(options)
    if note is None:
        return []
    assert note.startswith(ROUTING)
    return [note + ("" if rg.lined_up else " (a warning, not an error)") + f"; the all-to-all sends each token as "
            f"at most {rg.max_ranks} rows (one per rank holding any of its {K} experts)"]


def _accumulation(cfg: DictConfig, batch: Plan, world: int) -> int:
    gbs = cfg.train.global_batch_size
    if gbs is None:
        return batch.grad_accum_steps
    return max(1, gbs // (batch.micro_batch_size * world))


def _activations(shape: dict, regime: str, tokens: int, mode: str = "none", fraction: float = 0.0,
                 loss_chunk: int = 0, mlp_tiles: int = 0) -> float:
    """Activation bytes of one micro-batch of ``tokens``: the blocks (a ``fraction`` of them checkpointed in
    ``mode``), autocast's bf16 weight copies, and the loss (the logits of ``loss_chunk`` tokens at a time), which
    is freed before the recomputed block lives."""
    kept, transient, loss, copies = _activation_parts(shape, regime, tokens, mode, fraction, loss_chunk, mlp_tiles)
    return kept + max(transient, loss) + copies


def _activation_parts(shape: dict, regime: str, tokens: int, mode: str = "none", fraction: float = 0.0,
                      loss_chunk: int = 0, mlp_tiles: int = 0, norm_tiles: int = 0) -> tuple[float, float, float, float]:
    """``_activations`` as its parts: what the blocks keep until backward, the one block recomputed at a time,
    the loss (logits), autocast's weight copies."""
    a = shape["activation_bytes_per_token"][regime]
    n = max(shape["blocks"], 1)
    logits_tokens = min(loss_chunk, tokens) if loss_chunk else tokens
    loss = a["loss_hidden"] * tokens + a["logits"] * logits_tokens
    # model.mlp_tiles: the dense MLPs' intermediates are not kept (``mlp_blocks``); the backward of a block
    # recomputes one tile's of them at a time: the largest MLP's tile without checkpointing; under full
    # checkpointing the largest recomputed block less what its tiles do not hold at once
    tiled = mlp_tiles > 1 and "mlp_list" in a
    untiled = a["mlp_blocks"] if tiled else 0.0
    if mode == "none" or fraction == 0:
        kept, transient = a["blocks"] - untiled, max(a["mlp_list"]) / mlp_tiles if tiled else 0.0
    else:
        # checkpointed blocks keep their input (full) or their matmul outputs (selective); one block at a time
        # is recomputed in backward, all of it (full) or the ops between its matmuls (selective)
        own = n * a["ckpt_per_block"] if mode == "full" else a["selective_blocks"]
        kept = (1 - fraction) * (a["blocks"] - untiled) + fraction * own
        transient = a["max_block"] - (0.0 if mode == "full" else a["max_selective_block"])
        if tiled:  # full only (validation refuses tiles beside selective)
            transient = max(b - m * (1 - 1 / mlp_tiles) for b, m in zip(a["block_list"], a["mlp_list"]))
    if norm_tiles > 1 and "norm_tiled_backward" in a:  # the norms' fp32 intermediates one tile at a time
        nb = a["norm_tiled_backward"]
        transient += max(nb["other"], nb["mlp"] / (mlp_tiles if tiled else 1))
    else:
        transient += a.get("max_block_backward", 0.0)  # the backward of the largest block, beside its activations
    if loss_chunk and regime == "half" and tokens > loss_chunk:
        # The chunked loss under half parameters, beside the head's input and one chunk's logits (measured by the dry
        # run of deepseek7b, FSDP2 bf16, 16,384 tokens per rank, chunks of 4,096: 1.16 GiB more than the terms above):
        # the final norm's fp32 upcast and bf16 cast beside its output, and the whole-length gradient each chunk's
        # slice hands back (6 x hidden bytes per token more than ``loss_hidden``'s 4); and while the chunks' head
        # gradients accumulate, one more of the head's weight gradient (vocab x hidden in bf16)
        loss += 6 * shape["hidden"] * tokens + 2 * shape["vocab"] * shape["hidden"]
    # autocast casts each weight to bf16 once per forward and caches the copy until the forward's autocast region
    # ends, checkpointed blocks' too: every block's and the head's are alive at the loss (the dry run measured
    # 18.5 GiB of activations for deepseek7b under DDP/Horovod where counting one block's copies said 7.9)
    copies = 2 * (shape["block_params"] + shape["root_params"] / 2) if regime == "autocast" else 0.0
    d = int(shape.get("mtp_depth", 0))
    if d:
        # Multi-token prediction, D depths (``shardyard.models.mtp``; each depth's block is one of the blocks above). Its
        # norms', eh_proj's and head's inputs (``mtp_per_depth``) live until the depth's backward, and without
        # model.loss_chunk each term keeps its log-softmax (``mtp_logits``) until its own backward: at the first
        # term's backward, loss + D x (per_depth + logits). Autograd runs the depths' backward (created last)
        # before the main head's, so a depth's block is recomputed / backpropagated (``transient``) while the main
        # loss's and the other depths' log-softmax and their inputs are alive: transient + loss_hidden +
        # D x (per_depth + logits). The larger of the two stands in for the loss (it is on the last pipeline
        # stage, with the loss).
        saved = a["mtp_per_depth"] + (0 if loss_chunk else a["mtp_logits"])
        loss = max(loss + d * saved * tokens, (transient + a["loss_hidden"] + d * saved) * tokens)
    return kept * tokens, transient * tokens, loss, copies


def _check_fit(e: Estimate, hw: Hardware, headroom: float) -> None:
    short = []
    if hw.device == "cpu":
        need, have = e.device_peak * hw.ranks_per_node, hw.host_bytes * headroom
        if need > have:
            short.append(f"{hw.ranks_per_node} rank(s) x {e.device_peak / GiB:.1f} GiB = {need / GiB:.1f} GiB of host "
                         f"RAM, and {headroom:.0%} of the {hw.host_bytes / GiB:.1f} GiB available is {have / GiB:.1f} GiB")
    else:
        assert hw.device_bytes is not None
        need, have = e.device_peak + CUDA_RUNTIME_BYTES, hw.device_bytes * headroom
        if need > have:
            short.append(f"{need / GiB:.1f} GiB per GPU (with {CUDA_RUNTIME_BYTES / GiB:.0f} GiB of CUDA runtime), and "
                         f"{headroom:.0%} of its {hw.device_bytes / GiB:.1f} GiB is {have / GiB:.1f} GiB")
        host_need = e.host_peak * hw.ranks_per_node
        if host_need > hw.host_bytes * headroom:
            what = " and ".join(w for w, on in [("offloaded state", set(e.host) - {STAGING, "activations"}),
                                                ("offloaded activations (model.activation_offload)",
                                                 "activations" in e.host),
                                                (f"a background save's host copy ({e.host.get(STAGING, 0) / GiB:.1f} "
                                                 "GiB per rank, checkpoint.async_save)", STAGING in e.host)] if on)
            short.append(f"{host_need / GiB:.1f} GiB of host RAM per node for {what}, and {headroom:.0%} of "
                         f"{hw.host_bytes / GiB:.1f} GiB is {hw.host_bytes * headroom / GiB:.1f} GiB")
    if e.nvme:
        if hw.nvme_bytes is None:
            short.append("an NVMe directory (backend.nvme_path) that does not exist")
        elif e.nvme * hw.ranks_per_node > hw.nvme_bytes * headroom:
            short.append(f"{e.nvme * hw.ranks_per_node / GiB:.1f} GiB at backend.nvme_path, which has "
                         f"{hw.nvme_bytes / GiB:.1f} GiB free")
    e.fits, e.shortfall = not short, "; ".join(short)


def nodes_needed(cfg: DictConfig, batch: Plan, hw: Hardware, limit: int = MAX_NODES,
                 whole_batch: bool = False) -> int | None:
    """The fewest nodes of this hardware, ``hw.nodes`` or more, on which the recipe fits (None: not even ``limit``),
    among the node counts its layout allows (stages x tensor parallel dividing the world, ``ep`` dividing the
    data-parallel shards), searched over the whole range (``facts.node_counts``). The global batch is not a
    constraint unless ``whole_batch``: the alternatives keep the run's, which a much larger world may not divide,
    and the refusal names the nodes for the user to size the batch to; a dry run's advice (``whole_batch``) names
    a count the recipe can be dry-run at as it is."""
    from shardyard.backends import engine

    degrees = getattr(engine(cfg.backend), "degrees", None)
    fixed = degrees(cfg.backend) if degrees else {}
    gbs, mbs = cfg.train.global_batch_size, batch.micro_batch_size

    def allowed(n: int) -> bool:
        dims = ParallelDims.of(n * hw.ranks_per_node, fixed)
        return (dims.product == dims.world_size and dims.shard_group % max(dims.ep, 1) == 0
                and (not whole_batch or gbs is None or gbs % (mbs * dims.dp) == 0))

    def fits(n: int) -> bool:
        return estimate(cfg, batch, dataclasses.replace(hw, nodes=n)).fits

    counts = [n for n in node_counts(allowed, limit) if n >= hw.nodes]
    if not counts:
        return None
    # The per-rank figures only fall as the nodes grow: double the index until one fits, then bisect.
    lo, hi = -1, 0  # counts[hi] is tried; counts[lo] (lo >= 0) does not fit
    while not fits(counts[hi]):
        if hi == len(counts) - 1:
            return None
        lo, hi = hi, min(2 * hi + 1, len(counts) - 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(counts[mid]) else (mid, hi)
    return counts[hi]


def measured_fit(e: Estimate, hw: Hardware, peak: float, headroom: float) -> Estimate:
    """``e`` (the plan of one kind of rank) with the dry run's measured ``peak`` in place of the plan's, checked as
    the plan checks its own (``_check_fit``: the CUDA runtime added, ``headroom`` of the device). The dry run's
    fake tensors live in one pool, so what the plan puts in host RAM (offload) is taken out of the device's peak
    and kept as the plan's; on CPU the worker's runtime and the allocator's slack are added as the plan adds them."""
    if hw.device == "cpu":
        device = {"measured": peak, "runtime": CPU_RUNTIME_BYTES + CPU_ALLOCATOR_SLACK * peak}
    else:
        # (the offloaded activations are not in it: the dry run parks them on the meta device, ``prepare.offload_to``)
        device = {"measured": max(peak - (e.host_peak - e.host.get("activations", 0.0)), 0.0)}
    m = dataclasses.replace(e, device=device, overlap=0.0, notes=[])
    _check_fit(m, hw, headroom)
    return m


# ------------------------------------------------------------------------------------------- printing
CATEGORIES = ("params", "grads", "optimizer", "master", "buffers", "activations", "runtime")


def table(rows: Iterable[tuple[Estimate, int | None]], hw: Hardware) -> str:
    """One line per engine: per-rank memory by category, fits, bytes sent and step time."""
    where = "host RAM" if hw.device == "cpu" else "GPU"
    head = (f"{'engine':18} {'params':>7} {'grads':>7} {'optim':>7} {'master':>7} {'buffers':>7} {'activ':>7} "
            f"{'runtime':>7} | {'peak/' + where:>12} {'host':>7} {'nvme':>7} | {'fits':13} | {'sent/step':>9} "
            f"{'comm s':>7} {'compute s':>9}")
    lines = [f"plan for {hw.name}, {hw.nodes} node(s), {hw.world} rank(s); GiB per rank", head, "-" * len(head)]
    for e, nodes in rows:
        cells = " ".join(f"{e.device.get(k, 0.0) / GiB:7.2f}" for k in CATEGORIES)
        fits = "yes" if e.fits else (f"no: {nodes} nodes" if nodes else "no: nvme_path" if "NVMe" in e.shortfall else "no")
        comp = f"{e.compute_s:9.3f}" if e.compute_s is not None else f"{'-':>9}"
        lines.append(f"{e.engine:18} {cells} | {e.device_peak / GiB:12.2f} {e.host_peak / GiB:7.1f} "
                     f"{e.nvme / GiB:7.1f} | {fits:13} | {e.comm_bytes / GiB:7.2f}Gi {e.comm_s:7.3f} {comp}")
    return "\n".join(lines)


def describe(e: Estimate, hw: Hardware) -> str:
    """The line printed at every start."""
    parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in e.device.items() if v)
    if e.overlap:
        parts += f"; gradients or buffers that never peak with the activations: -{e.overlap / GiB:.2f}"
    if hw.device == "cpu":
        of = f"{hw.ranks_per_node} x {e.device_peak / GiB:.2f} GiB = {e.device_peak * hw.ranks_per_node / hw.host_bytes:.1%} " \
             f"of {hw.host_bytes / GiB:.1f} GiB host RAM available"
        return f"plan per rank: peak {e.device_peak / GiB:.2f} GiB ({parts}); {of}" + \
            "".join(f"\nshardyard | plan: {n}" for n in e.notes if n.startswith(ROUTING))
    assert hw.device_bytes is not None
    line = (f"plan per GPU rank: peak {e.device_peak / GiB:.2f} GiB allocated ({parts}) = "
            f"{(e.device_peak + CUDA_RUNTIME_BYTES) / hw.device_bytes:.1%} of {hw.device_bytes / GiB:.1f} GiB with the CUDA runtime")
    if e.host_peak:
        held = ", ".join(f"{'background save staging' if k == STAGING else k} {v / GiB:.2f}" for k, v in e.host.items())
        line += f"\nshardyard | plan per rank in host RAM: {e.host_peak / GiB:.2f} GiB ({held})"
    return line + "".join(f"\nshardyard | plan: {n}" for n in e.notes if n.startswith(ROUTING))


__getattr__ = moved.names_moved_from(__name__)
