"""The step-time model: how long one optimizer step of a layout takes on a piece of hardware, before it is rented;
what ``plan.search`` ranks the layouts that fit by (``shardyard.planning.layouts``).

    step = compute x (1 + the pipeline's bubble) + the communication compute does not hide
           + the optimizer step (device memory, or the host's cores under offload)

1. Compute, per rank: the model's FLOPs per token (``ModelFacts.flops_per_token``, PaLM's 6N + 12LHQT, as torchtitan and
   llm-foundry count them) for the tokens this rank computes. The matmuls of the blocks and head run at
   ``MATMUL_EFFICIENCY`` of the peak, lowered by a roofline on each rank's matmul shape (tokens per micro-batch,
   hidden, the MLP's width over the tensor-parallel degree; a routed expert's share of the tokens): a matmul whose
   arithmetic intensity is under the hardware's ridge point (peak FLOP/s over memory bandwidth) is bound by memory.
   The attention kernel runs its causal half of the 12LHQT term at ``ATTENTION_EFFICIENCY``. The ops between
   matmuls (norms, activations, rotary, residuals, the loss) are bound by memory: ``MEMORY_PASSES`` passes over the
   activation bytes the plan counts per token. Activation checkpointing adds its recompute: a block's forward
   again (full) or its ops between matmuls (selective).
2. Communication: each engine states its collectives in its own module (``backends.Collective``: bytes, the
   ranks they run over, how often, what hides them). A ring over n ranks moves (n-1)/n of the buffer (twice for an
   all-reduce) at the intra-node bandwidth when its ranks share a node and at the NIC's when they do not (the
   ranks are laid out tensor-parallel innermost, then the data-parallel shards, their copies, the pipeline's
   stages: the engines' meshes), plus NCCL's own latency per call and ring step (``hardware.NCCL_*``). What hides
   it: prefetched gathers overlap the micro-batch's compute, gradient reductions its backward (2/3 of it), minus
   the first gather and the last reduction, which nothing hides; the rest (tensor-parallel all-reduces, the
   all-to-all of expert parallelism, a pipeline's sends, ZeRO-1/2's gather after the step) is on the critical path.
3. The optimizer step: a read and a write of the model states each rank holds, at the memory bandwidth; under
   offload the states' trip over the host link and the host's cores (``HOST_ADAM_PARAMS_PER_S``).

What it does not model (docs/plan.md, "Predicted step time"): compute slowed by the collectives running beside it,
NCCL's NVLink SHARP and tree algorithms, a network's oversubscription and congestion, kernel-launch and Python
overhead, torch.compile and FP8, the power limit's clocks beyond the table's peak, stragglers and data loading.

A module of the ``planning`` package: it imports ``core``, ``config``, ``backends`` (the engines' ``model_states``)
and the plan's hardware and optimizer probe (:mod:`shardyard.planning.plan`, :mod:`shardyard.planning.hardware`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from shardyard.config import checkpointed_fraction, checkpointing_mode
from shardyard.core.facts import ParallelDims, Plan
from shardyard.planning.hardware import NCCL_BASE_S, Hardware

MATMUL_EFFICIENCY = 0.55
"""The fraction of the data sheet's dense peak a large bf16 matmul of a training step reaches, fitted to one
published run: llm-foundry's MPT-1B on 8 H100-80GB (700 W), seq 2,048, micro batch 14, FSDP full shard, no
checkpointing, 41.82% MFU (its scripts/train/benchmarking/README.md). Held against the other published runs in
docs/plan.md, "Predicted step time", which it was not fitted to."""
ATTENTION_EFFICIENCY = 0.30
"""The attention kernel's fraction of the peak, on the causal half of the 12LHQT FLOPs it runs: FlashAttention-2
on an H100 (the FlashAttention-3 paper, Shah et al. 2024, arXiv 2407.08608: "FlashAttention-2 achieves only 35%
utilization on H100"). Not fitted."""
MEMORY_PASSES = 4
"""Passes over the activation bytes per token (the plan's ``activation_bytes_per_token``) the ops between
matmuls make: written in forward, read in backward, their gradients written and read. Counted, not fitted."""
BACKWARD_SHARE = 2 / 3
"""Of a micro-batch's compute, the backward's (twice the forward's FLOPs): what gradient reductions overlap."""
HOST_ADAM_PARAMS_PER_S = 1e9
"""Parameters per second one node's cores step with a CPU Adam (ZeRO-Offload, FSDP's CPU offload), shared by the
node's ranks. An assumption, neither fitted nor sourced: offloaded layouts rank by it only among themselves in
practice (they fit where nothing else does)."""


@dataclass
class StepTime:
    """The predicted optimizer step of one layout on one piece of hardware, seconds, and what bounds it."""

    compute_s: float
    """Every micro-batch's compute on one rank, recompute included, bubble excluded."""
    bubble_s: float
    """A pipeline's idle time."""
    comm_s: float
    """The communication compute does not hide."""
    optimizer_s: float
    """The optimizer step (and offload's host copies and CPU step)."""
    tokens_per_step: float
    world: int
    model_flops_per_token: float
    peak_flops: float
    parts: dict[str, float] = field(default_factory=dict)
    """Exposed seconds by collective (``all-gather dp_shard, inter-node``)."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.comm_s + self.optimizer_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_s / self.world

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recompute) per second per GPU over the table's peak."""
        return self.model_flops_per_token * self.tokens_per_s_per_gpu / self.peak_flops

    @property
    def bottleneck(self) -> str:
        """What the step spends the most time on: compute, the bubble, a collective, or the optimizer."""
        candidates = {"compute": self.compute_s, "pipeline bubble": self.bubble_s, "optimizer step": self.optimizer_s,
                      **{f"exposed {k}": v for k, v in self.parts.items()}}
        return max(candidates, key=lambda k: candidates[k])


def predict(cfg: DictConfig, batch: Plan, hw: Hardware, accum: int) -> StepTime | None:
    """The step time of ``cfg``'s layout (its engine, degrees, micro batch, checkpointing) on ``hw`` with ``accum``
    micro-batches per step and ``batch``'s global batch; None where the hardware has no FLOP/s or memory bandwidth
    figure (CPU)."""
    from shardyard.backends import engine, parallel_dims
    from shardyard.planning.plan import optimizer_bytes_per_param

    if hw.peak_flops is None or hw.memory_bw is None:
        return None
    dims = parallel_dims(cfg, hw.world)
    states = engine(cfg.backend).model_states(cfg, batch.facts.params, hw.world, batch.facts.shape,
                                              optimizer_bytes_per_param(cfg.optim))
    micro = micro_compute_s(cfg, batch, hw, dims, states)
    compute = accum * micro
    comm, parts = exposed_comm_s([*states.collectives, *sequence_exchanges(cfg, batch, dims, states),
                                  *offload_copies(cfg, batch, dims, states)], dims, hw, micro, accum)
    return StepTime(compute, compute * states.bubble, comm, optimizer_s(states, hw), batch.global_batch_size *
                    batch.tokens_per_sample, hw.world, batch.facts.flops_per_token, hw.peak_flops, parts)


# --------------------------------------------------------------------------------------------- 1. compute
def micro_compute_s(cfg: DictConfig, batch: Plan, hw: Hardware, dims: ParallelDims, states: Any) -> float:
    """One micro-batch's forward and backward on one rank, recompute included (the module's 1)."""
    assert hw.peak_flops is not None and hw.memory_bw is not None
    f, shape = batch.facts, batch.facts.shape
    # 1. This rank's tokens: a tensor-parallel rank computes 1/tp of each, a pipeline stage its layers' share, a rank
    # of a sequence group (backend.sp) 1/sp of the positions (and of attention: every position of 1/sp of the heads).
    tokens = batch.micro_batch_size * batch.tokens_per_sample / dims.model_parallel / (dims.sp * dims.cp)
    attention = f.attention_flops_per_token
    linear = f.flops_per_token - attention
    # 2. Activation checkpointing's recompute, on the checkpointed share of the blocks: full runs a block's forward
    # again (a third of its FLOPs), selective the ops between its matmuls (memory-bound, below).
    mode = checkpointing_mode(cfg.model)
    share = checkpointed_fraction(cfg.model, shape["blocks"]) if mode != "none" else 0.0
    again = share / 3 if mode == "full" else 0.0
    # model.mlp_tiles: each tile's MLP runs its forward once more in backward (2 FLOPs per parameter and token)
    tiled = 2.0 * shape.get("dense_mlp_params", 0) if int(cfg.model.get("mlp_tiles", 0)) > 1 else 0.0
    matmuls = (linear * (1 + again) + tiled) / (hw.peak_flops * matmul_efficiency(cfg, batch, hw, dims, states))
    # 3. The attention kernel, at its own efficiency on the FLOPs counted for it (12LHQT, causal or not).
    attn = attention * (1 + again) / (hw.peak_flops * ATTENTION_EFFICIENCY)
    # 4. The ops between matmuls, bound by memory: passes over the activation bytes per token (selective recomputes
    # what it does not keep, full the whole block's).
    a = shape["activation_bytes_per_token"][states.regime]
    recomputed = {"none": 0.0, "full": a["blocks"], "selective": a["blocks"] - a["selective_blocks"]}[mode] * share
    memory = (MEMORY_PASSES * (a["blocks"] + a["logits"]) + recomputed) / hw.memory_bw
    return tokens * (matmuls + attn + memory)


def matmul_efficiency(cfg: DictConfig, batch: Plan, hw: Hardware, dims: ParallelDims, states: Any) -> float:
    """``MATMUL_EFFICIENCY`` under a roofline on this rank's matmul shapes, weighted by their FLOPs: the dense
    matmuls (rows: the tokens of one micro-batch, or of a pipeline micro-batch; the hidden size; the MLP's width
    over tp) and a routed expert's (rows: its share of the tokens its rank receives)."""
    assert hw.peak_flops is not None and hw.memory_bw is not None
    shape, f = batch.facts.shape, batch.facts
    c = 4 if states.regime == "fp32" else 2
    ridge = hw.peak_flops / hw.memory_bw  # FLOP per byte where a matmul stops being bound by memory
    h = float(shape["hidden"])
    blocks = max(int(shape["blocks"]), 1)
    # 1. A pipeline splits each micro batch into its micro-batches (activation_factor x tp: 1/m; 1 otherwise).
    rows = batch.micro_batch_size * batch.tokens_per_sample * min(1.0, states.activation_factor * dims.tp)
    dense_block = (shape["block_params"] - shape["expert_params"]) / blocks
    width = max((dense_block - 4 * h * h) / (3 * h), h)  # the MLP's (attention's 4h^2, the MLP's 3hi)

    def roofline(m: float, n: float, k: float) -> float:
        intensity = 2 * m * n * k / (c * (m * k + k * n + m * n))
        return (hw.matmul_efficiency or MATMUL_EFFICIENCY) * min(1.0, intensity / ridge)

    dense = min(roofline(rows, h / dims.tp, h), roofline(rows, width / dims.tp, h))
    if not shape["expert_params"] or not f.routed_experts:
        return dense
    # 2. Routed experts: E / ep of them per rank, each receiving top_k x ep / E of the group's rows.
    E, K = f.routed_experts, f.experts_per_token
    expert_width = shape["expert_params"] / (max(shape["moe_layers"], 1) * E * 3 * h)
    expert = roofline(max(rows * K * dims.ep / E, 1.0), expert_width, h)
    active = 6 * shape["expert_params"] * K / E  # FLOPs per token in routed experts
    linear = max(f.flops_per_token - f.attention_flops_per_token, active)
    share = active / linear
    return 1 / (share / expert + (1 - share) / dense)


# --------------------------------------------------------------------------------------------- 2. communication
def sequence_exchanges(cfg: DictConfig, batch: Plan, dims: ParallelDims, states: Any) -> list:
    """Ulysses sequence parallelism's all-to-alls (``backend.sp``; ``backends.sequence_parallel``): per block and
    micro-batch, queries, keys, values and the output, forward and backward (8 calls), each of this rank's tokens x
    the attention's width (the hidden size) in the compute dtype, (sp - 1)/sp of it leaving the rank; and all-gather
    context parallelism's (``backend.cp``): per block and micro-batch the whole sequence's keys and values gathered
    (a ring: (cp - 1)/cp of them arrive) and their gradients reduce-scattered. Both on the critical path (attention
    waits for its inputs)."""
    from shardyard.backends import Collective
    from shardyard.planning.plan import kv_width

    shape = batch.facts.shape
    blocks = max(int(shape["blocks"]), 1)
    width = 4 if states.regime == "fp32" else 2
    if dims.cp > 1:  # all-gather context parallelism: keys and values gathered forward, reduce-scattered backward
        whole = batch.micro_batch_size * batch.tokens_per_sample * kv_width(cfg.model, shape) * width
        return [Collective("all-gather", whole, "cp", calls=2 * blocks),
                Collective("reduce-scatter", whole, "cp", calls=2 * blocks)]
    if dims.sp <= 1:
        return []
    tokens = batch.micro_batch_size * batch.tokens_per_sample / dims.sp
    leaving = 8 * blocks * tokens * shape["hidden"] * width * (dims.sp - 1) / dims.sp
    return [Collective("all-to-all", leaving, "sp", calls=8 * blocks)]


def offload_copies(cfg: DictConfig, batch: Plan, dims: ParallelDims, states: Any) -> list:
    """``model.activation_offload``: per micro-batch each block's input out to host RAM and back for its recompute
    (``prepare.apply_activation_offload`` 2): 2 copies of the offloaded bytes over the host link, on the compute
    stream (the critical path)."""
    from shardyard.backends import Collective
    from shardyard.planning.plan import offloaded_bytes

    tokens = batch.micro_batch_size * batch.tokens_per_sample / (dims.sp * dims.cp)
    moved = offloaded_bytes(cfg, batch.facts.shape, states.regime, tokens)
    blocks = max(int(batch.facts.shape["blocks"]), 1)
    return [Collective("host", 2 * moved, "host", calls=2 * blocks)] if moved else []


LAYOUT_ORDER = ("tp", "dp_shard", "dp_replicate", "pp")
"""How the ranks are laid out, innermost first: the engines' meshes (``(dp, tp)``, ``(replicate, shard)``,
``(pp, dp)``; expert parallelism the innermost ranks of the shards, a sequence group's (``sp``) too)."""


def group_span(group: str, dims: ParallelDims, ranks_per_node: int) -> tuple[int, int]:
    """(ranks, nodes) of one group of the ``ParallelDims`` degree ``group`` (``dp``: the shards and their copies).
    A sequence group's ranks (``sp``) are data-parallel ranks to the engines: the shards' and replicas' collectives
    run over them too."""
    seq = dims.sp * dims.cp
    sizes = {"tp": dims.tp, "dp_shard": dims.dp_shard * seq, "dp_replicate": dims.dp_replicate, "pp": dims.pp,
             "ep": dims.ep, "dp": dims.dp * seq, "sp": dims.sp, "cp": dims.cp}
    stride = 1
    for inner in LAYOUT_ORDER:
        if inner == group or (group in ("ep", "dp", "sp", "cp") and inner == "dp_shard"):
            break
        stride *= sizes[inner]
    n = max(sizes[group], 1)
    nodes = n if stride >= ranks_per_node else max(1, math.ceil(stride * n / ranks_per_node))
    return n, min(nodes, n)


def collective_s(k: Any, dims: ParallelDims, hw: Hardware) -> tuple[float, str]:
    """One occurrence of collective ``k``: seconds, and the link it is bound by (``inter-node``, ``intra-node``,
    ``host link``)."""
    if k.group == "host":
        return k.bytes / hw.host_link_bw, "host link"
    n, nodes = group_span(k.group, dims, hw.ranks_per_node)
    if n <= 1:
        return 0.0, "none"
    across = nodes > 1
    bw, link = (hw.inter_bw, "inter-node") if across else (hw.intra_bw, "intra-node")
    if k.op in ("send", "all-to-all"):  # what leaves the rank, point to point
        return k.bytes / bw + k.calls * (NCCL_BASE_S + (hw.inter_latency if across else hw.intra_latency)), link
    # A ring (NCCL's cost model, tuning.cc): (n-1) steps, 2(n-1) for an all-reduce, of which those between nodes
    # pay the network's latency.
    twice = 2 if k.op == "all-reduce" else 1
    steps, between = twice * (n - 1), twice * (nodes - 1)
    latency = NCCL_BASE_S + (steps - between) * hw.intra_latency + between * hw.inter_latency
    return twice * k.bytes * (n - 1) / n / bw + k.calls * latency, link


def exposed_comm_s(collectives: list, dims: ParallelDims, hw: Hardware, micro: float, accum: int
                   ) -> tuple[float, dict[str, float]]:
    """The seconds of communication compute does not hide over one step (the module's 2), and by collective."""
    parts: dict[str, float] = {}
    total = 0.0
    for per, occurrences in (("micro", accum), ("step", 1)):
        mine = [(k, *collective_s(k, dims, hw)) for k in collectives if k.per == per]
        mine = [m for m in mine if m[1] > 0]
        prefetch = sum(t for k, t, _ in mine if k.hidden_by == "prefetch")
        backward = sum(t for k, t, _ in mine if k.hidden_by == "backward")
        # 1. Hidden behind one micro-batch's compute (a per-step reduction: the last micro-batch's backward only),
        # but for the first gather and the last reduction (a call of each), which nothing runs beside.
        window = micro if per == "micro" else BACKWARD_SHARE * micro
        tail = {id(k): t / max(k.calls, 1) for k, t, _ in mine if k.hidden_by != "none"}
        rest = prefetch + backward - sum(tail.values())
        rest_backward = backward - sum(tail[id(k)] for k, _, _ in mine if k.hidden_by == "backward")
        over = max(0.0, rest - window, rest_backward - BACKWARD_SHARE * micro)
        for k, t, link in mine:
            name = f"{k.op} over {k.group} ({link})"
            # 2. What each leaves exposed: all of it on the critical path; else its tail and its share of the overflow
            exposed = t if k.hidden_by == "none" else tail[id(k)] + (over * (t - tail[id(k)]) / rest if rest else 0.0)
            parts[name] = parts.get(name, 0.0) + occurrences * exposed
            total += occurrences * exposed
    return total, {k: v for k, v in parts.items() if v > 0}


# --------------------------------------------------------------------------------------------- 3. the optimizer
def optimizer_s(states: Any, hw: Hardware) -> float:
    """The optimizer step: a read and a write of the model states on the device, at the memory bandwidth; the
    offloaded share's step on the host's cores (the module's 3; its host copies are collectives)."""
    assert hw.memory_bw is not None
    held = sum(states.device.get(k, 0.0) for k in ("params", "grads", "optimizer", "master"))
    host = states.cpu_optimizer_params * hw.ranks_per_node / HOST_ADAM_PARAMS_PER_S
    return 2 * held / hw.memory_bw + host
