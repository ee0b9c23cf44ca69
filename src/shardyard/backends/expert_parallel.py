"""Expert parallelism for the FSDP2 family (``backend.ep``): each MoE layer's routed experts split across the ranks
of an expert-parallel group, tokens sent to their experts and back by all-to-all, nothing dropped.

The layout (torchtitan's, ``torchtitan/distributed/expert_parallel.py``): the ranks of one copy that shard the
model (``ParallelDims.shard_group``: ``dp_shard``, with a sequence group's ranks among them; all of them but HSDP's
other copies) are viewed as ``edp x ep`` with ``ep`` innermost, so an EP group is ``ep`` consecutive ranks (within
a node when it fits: the all-to-all is the chatty collective). Then

1. the routed experts' weights ([E, ...] tensors: transformers' fused ``gate_up_proj`` and ``down_proj``) become
   DTensors sharded on dim 0 over the ``ep`` mesh: ``E / ep`` whole experts per rank, the rank's own;
2. FSDP2 shards those over ``edp`` (what remains of data parallel), and everything else over all of
   ``dp_shard``: the usual ``fully_shard`` per block, whose experts are already their own FSDP unit;
3. the expert gradients are divided by the whole data-parallel world, not by ``edp``: each owner's gradient already
   sums the tokens of its EP peers (the all-to-all's backward brings them), and FSDP averages it over ``edp`` (and
   HSDP's copies).

Because the weights keep their global [E, ...] shapes as DTensors, checkpoints (DCP) and the full state dict see
the same tensors at every ``ep``: a checkpoint written at ep 2 resumes at ep 4, and the HF export is the same
file as without EP. The router stays replicated (a non-expert weight), so routing, balancing and its
all-reduced loads are exactly those of a run without EP.

Each MoE layer's forward makes the host wait for the device once (issue 41): the all-to-all's split sizes must be
host integers, so the group's routing counts are exchanged on the device and read to the host in one transfer
(``routing_splits``); everything else (counting, regrouping, the grouped GEMMs, the backward) needs no host value
that is not already there. The same numbers bound the receive buffer when ``backend.ep_capacity_factor`` is set
(``check_capacity``): dropless by default, as DeepSeek-V3 trains, and are added up on the host per rank of the group
(``ep_rows_sent``, training forwards), which the tests read to see that tokens crossed ranks.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from shardyard.core.errors import UserError
from shardyard.models.moe import EXPERT_WEIGHTS, count_routed, expert_modules

_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def fused_grouped_mm(w: torch.Tensor) -> bool:
    """Whether the experts' GEMMs run as torch's grouped GEMM for weights ``w``: the one place that chooses.
    Its fused CUDA kernel takes bf16 on SM90/SM100 only; another dtype or GPU gets torch's fallback, which
    copies the group offsets to the host (a sync per call, the backward's two included) and loops over the
    groups, so that loop runs here instead, on the group sizes the host already holds. On CPU bf16 takes it too (the
    offsets are host memory there); fp32 loops, as a dry run's fake tensors must (torch's meta kernel takes
    bf16 only)."""
    if _GROUPED_MM is None or w.dtype != torch.bfloat16:
        return False
    if w.device.type == "cuda":
        return torch.cuda.get_device_capability(w.device)[0] in (9, 10)
    return w.device.type == "cpu"


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``x[rows of group g] @ w[g]`` for consecutive row groups ending at ``offs`` (on the device), whose
    ``sizes`` the host holds: one grouped GEMM where ``fused_grouped_mm`` says so, else one GEMM per group, cut
    by the host's sizes; neither waits for the device. (``split`` and ``unbind``, not slices: their backward
    is one concatenation, where each slice's would fill a zero tensor of the whole input or weights.)"""
    x = x.to(w.dtype)  # grouped_mm is outside autocast's cast list
    if fused_grouped_mm(w) and x.shape[0] > 0 and _GROUPED_MM is not None:
        return _GROUPED_MM(x, w, offs=offs)
    return torch.cat([rows @ wg for rows, wg in zip(x.split(sizes), w.unbind(0))])


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward is the reverse all-to-all (gloo and NCCL)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


@dataclass
class Splits:
    """One MoE layer's routing over its expert-parallel group, as this rank needs it. A *row* is one token sent
    to one rank (once, however many of its experts that rank holds); a *slot* is one (token, expert) choice."""

    send: list[int]
    """Rows this rank sends to each peer (host)."""
    recv: list[int]
    """Rows it receives from each peer (host)."""
    per_expert: list[int]
    """Slots each of its local experts gets (host): where the grouped GEMMs cut."""
    per_rank: list[int]
    """Rows every rank of the group receives (host, the same on every rank): the receive bound's check."""
    received: torch.Tensor
    """[peer, local expert] slots received (device): the grouped GEMMs' offsets."""


def routing_splits(flat: torch.Tensor, rows: torch.Tensor, experts: int, group: Any) -> Splits:
    """The group's routing, from this rank's routed expert ids ``flat`` and its token rows for each rank ``rows``
    ([ep], device): one all-gather of every rank's counts, then the one host read of the layer (the all-to-all
    takes its split sizes as host integers).

    1. Count the slots per expert on the device (``moe.count_routed``: no host sync).
    2. All-gather [sender, slots per expert | rows per receiver], the same table on every rank of the group, so
       each rank also knows what the others receive (an all-to-all would tell it only its own share).
    3. What the host needs, in one transfer of 3 ep + E / ep integers whatever the tokens."""
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    local = experts // ep
    counts = count_routed(torch.zeros(experts, dtype=torch.int64, device=flat.device), flat)  # 1
    mine = torch.cat([counts, rows.to(counts.dtype)])
    table = torch.empty(ep * (experts + ep), dtype=counts.dtype, device=counts.device)
    dist.all_gather_single(table, mine, group=group)  # 2
    table = table.view(ep, experts + ep)
    received = table[:, me * local:(me + 1) * local]
    sent = table[:, experts:]
    host = torch.cat([sent[me], sent[:, me], received.sum(0), sent.sum(0)]).tolist()  # 3
    return Splits(host[:ep], host[ep:2 * ep], host[2 * ep:2 * ep + local], host[2 * ep + local:], received)


def check_capacity(s: Splits, factor: float | None, group: Any) -> None:
    """``backend.ep_capacity_factor``: no rank of the group may receive more than ``factor`` x its balanced
    share of rows (the group's rows / ep, a row one token sent to one rank); null bounds nothing (dropless). Read
    from the host numbers ``routing_splits`` fetched anyway, and the same on every rank of the group: all of them
    raise together, before the all-to-all, rather than one rank leaving its peers waiting in it."""
    if factor is None:
        return
    ep, rows = len(s.per_rank), sum(s.per_rank)
    bound = math.ceil(factor * rows / ep)
    most = max(s.per_rank)
    if most <= bound:
        return
    err = UserError(
        "backend.ep_capacity_factor", factor,
        f"A MoE layer's router sent {most} token rows to rank {s.per_rank.index(most)} of its expert-parallel "
        f"group of {ep}, and the receive buffer is bounded to {bound} rows: {factor:g} x the {rows / ep:g} each "
        f"rank receives when the group's {rows} rows (one per token and rank holding any of its experts) are "
        f"balanced. The routing has collapsed onto the experts of few ranks, as it can early in training.",
        f"Raise backend.ep_capacity_factor (backend.ep_capacity_factor={ep} always fits: every row on one rank), "
        f"or leave it null (the default: dropless, the buffer sized by the routing).")
    if dist.get_world_size(group) == dist.get_world_size():
        err.on_every_rank()  # every rank raises it: rank 0 prints it once
    raise err


def expert_parallel_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of one MoE layer under expert parallelism (replaces the module's ``forward``; the
    arguments are transformers' ``Experts.forward``'s: [T, H] tokens, [T, K] experts and routing weights).

    1. Each token goes once to each rank that holds any of its K experts (DeepEP's dispatch), not once per expert:
       with group-limited routing lined up with the ranks (``model.n_group``, ``moe.RoutingGroups``) that is at
       most ``topk_group`` x the ranks of a group, e.g. 4 rows instead of 8 for DeepSeek-V3's device-limited
       routing at ep 8. Rows go rank by rank, each rank's tokens in order.
    2. Learn the group's routing (``routing_splits``: the layer's one host sync) and check the receive bound.
    3. All-to-all the token rows and, beside each, its K slots' local expert ids and routing weights on that
       rank (fp32; -1 and 0 for slots held elsewhere), so the weights' gradients come back the same way.
    4. The receiver lists the received slots by local expert (the ones it holds, first: their count is on the
       host), runs its experts as two grouped GEMMs (gate|up, down) with SwiGLU, weights each slot, and adds a
       row's slots into one row.
    5. All-to-all those rows back; each token adds its rows (fp32).
    """
    group, ep = self.ep_group, self.ep
    T, H = hidden_states.shape
    K = top_k_index.shape[-1]
    local = self.num_experts // ep
    owner = top_k_index // local  # 1: the rank holding each slot's expert
    hit = (owner.unsqueeze(0) == torch.arange(ep, device=owner.device).view(ep, 1, 1)).any(-1)  # [ep, T]
    if _UNIFORM["on"]:  # a dry run's fake tensors have no values to route by
        s = _uniform_splits(T, K, self.ep_rows_per_token, self.num_experts, ep, dist.get_rank(group), x=top_k_index)
    else:
        s = routing_splits(top_k_index.reshape(-1), hit.sum(1), self.num_experts, group)  # 2
    check_capacity(s, self.ep_capacity_factor, group)
    if self.training:  # host integers it holds anyway: what the all-to-all sends each rank of the group
        self.ep_rows_sent[:] = [a + b for a, b in zip(self.ep_rows_sent, s.send)]
    pair = torch.nonzero_static(hit.flatten(), size=sum(s.send)).squeeze(1)  # rank-major; its size is on the host
    dest, tok = pair // T, pair % T
    on = owner[tok] == dest[:, None]  # [rows, K]: the row's slots its destination holds
    meta = torch.cat([torch.where(on, top_k_weights[tok].float(), 0.0),
                      torch.where(on, top_k_index[tok] % local, -1).float()], dim=1)  # ids < 2^24: exact in fp32
    x = _AllToAll.apply(hidden_states[tok], s.recv, s.send, group)  # 3
    meta = _AllToAll.apply(meta, s.recv, s.send, group)
    weights, ids = meta[:, :K], meta[:, K:].detach().long()
    # 4: the received slots by local expert (stable: by row within an expert); slots held elsewhere (-1) sort last
    slots = torch.argsort(torch.where(ids >= 0, ids, local).flatten(), stable=True)[:sum(s.per_expert)]
    row = slots // K
    offs = torch.cumsum(s.received.sum(0), 0).to(torch.int32)
    w_gu = self.gate_up_proj.to_local() if isinstance(self.gate_up_proj, DTensor) else self.gate_up_proj
    w_d = self.down_proj.to_local() if isinstance(self.down_proj, DTensor) else self.down_proj
    gate, up = grouped_mm(x[row], w_gu.transpose(-2, -1), offs, s.per_expert).chunk(2, dim=-1)
    y = grouped_mm(self.act_fn(gate) * up, w_d.transpose(-2, -1), offs, s.per_expert)
    y = y.float() * weights.flatten()[slots, None]
    back = torch.zeros(x.shape[0], H, dtype=torch.float32, device=x.device).index_add_(0, row, y)
    back = _AllToAll.apply(back.to(x.dtype), s.send, s.recv, group)  # 5
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden_states.device)
    out.index_add_(0, tok, back.float())
    return out.to(hidden_states.dtype)


_UNIFORM = {"on": False}


@contextlib.contextmanager
def assume_uniform_routing() -> Iterator[None]:
    """Inside, the expert-parallel forward routes every rank's T x K slots evenly over the E experts instead of
    by the router's choice: what a dry run on fake tensors (``shardyard.planning.dryrun``), which has no values to route
    by, assumes. Nothing else changes: the same buffers, all-to-alls and grouped GEMMs run on those splits."""
    _UNIFORM["on"] = True
    try:
        yield
    finally:
        _UNIFORM["on"] = False


def _uniform_splits(tokens: int, k: int, rows_per_token: int, experts: int, ep: int, me: int,
                    x: torch.Tensor) -> Splits:
    """Even routing of ``tokens`` x ``k`` routed slots per rank (every peer routes alike), as ``routing_splits``
    gives it: the slots even over the experts, each token on ``rows_per_token`` ranks (the plan's bound:
    ``moe.RoutingGroups.max_ranks``), and never fewer rows to a rank than its slots need (k per row at most) nor
    more than it has slots or there are tokens."""
    local = experts // ep
    base, extra = divmod(tokens * k, experts)
    per_expert = [base + (e < extra) for e in range(experts)]
    mine = per_expert[me * local:(me + 1) * local]
    rows, more = divmod(tokens * rows_per_token, ep)
    send = []
    for p in range(ep):
        slots = sum(per_expert[p * local:(p + 1) * local])
        send.append(min(tokens, slots, max(-(-slots // k), rows + (p < more))))
    return Splits(send, [send[me]] * ep, [ep * n for n in mine], [ep * n for n in send],
                  torch.tensor([mine] * ep, dtype=torch.long, device=x.device))


def shard_experts(model: torch.nn.Module, ep_mesh: DeviceMesh, capacity_factor: float | None = None) -> int:
    """Give every routed-experts module of ``model`` this rank's ``E / ep`` experts (dim-0 DTensor shards over
    ``ep_mesh``) and the all-to-all forward, its receive buffer bounded by ``capacity_factor``
    (``backend.ep_capacity_factor``; None: dropless); returns how many modules it changed. Run before FSDP."""
    from shardyard.models.moe import RoutingGroups, routers

    found = routers(model)
    router: Any = found[0].module if found else None
    top_k = found[0].top_k if found else 1
    experts = found[0].experts if found else 1
    groups, topk_group = int(getattr(router, "num_group", 1) or 1), int(getattr(router, "topk_group", 1) or 1)
    if getattr(router, "topk_method", "group_limited_greedy") == "greedy" or experts % groups:  # DeepSeek-V2 greedy
        groups, topk_group = 1, 1
    rows_per_token = RoutingGroups(experts, groups, min(topk_group, groups), top_k, ep_mesh.size(), 1).max_ranks \
        if found and experts >= ep_mesh.size() else top_k  # a dense block: no experts to split
    changed = 0
    for m in expert_modules(model):
        for name in EXPERT_WEIGHTS:
            p = getattr(m, name)
            shard = distribute_tensor(p.data, ep_mesh, [Shard(0)]) if not p.is_meta else \
                DTensor.from_local(p.data.chunk(ep_mesh.size())[ep_mesh.get_local_rank()], ep_mesh, [Shard(0)],
                                   run_check=False)
            setattr(m, name, torch.nn.Parameter(shard, requires_grad=p.requires_grad))
        # Plain attributes (not submodules, not parameters): the group, its size and the receive bound, read by
        # the forward.
        object.__setattr__(m, "ep_group", ep_mesh.get_group())
        object.__setattr__(m, "ep", ep_mesh.size())
        object.__setattr__(m, "ep_capacity_factor", capacity_factor)
        # The rows a token is sent as, at most (one per rank holding any of its experts, under the routing
        # groups' limit): what a dry run's uniform routing assumes, as the plan counts it.
        object.__setattr__(m, "ep_rows_per_token", rows_per_token)
        # The token rows its training forwards dispatched to each rank of the group (its own index: kept here),
        # counted on the host from the split sizes it holds anyway: the tests read what crossed ranks.
        object.__setattr__(m, "ep_rows_sent", [0] * ep_mesh.size())
        m.forward = expert_parallel_forward.__get__(m)  # this instance only; its class stays transformers'
        changed += 1
    return changed


class ExpertGradients:
    """The routed experts' gradients, averaged over all of data parallel before the optimizer step. FSDP averages
    them over ``edp`` (and HSDP's copies, ``replicate x edp``); each EP owner's gradient already sums its ``ep``
    peers' tokens (the all-to-all's backward brought them), so one more division by ``ep`` makes the mean over
    every data-parallel rank, as the other parameters get. (FSDP's ``set_gradient_divide_factor`` would fold it into the reduce-scatter, but
    its PREMUL_SUM reduction does not exist on gloo.)"""

    def __init__(self, model: torch.nn.Module, ep: int):
        self.params = [p for m in expert_modules(model) for p in m.parameters() if p.requires_grad]
        self.ep = ep

    def average(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.ep)  # one mesh: the experts'


def stepper_options(model: torch.nn.Module, ep: int, copies: int = 1) -> dict[str, Any]:
    """``TorchStepper``'s options under expert parallelism (none at ep 1): the experts' gradients divided by ep
    before unscaling (``ExpertGradients``), and the global norm of gradients on two meshes (experts: edp x ep;
    the rest: all ranks), which torch's norm does not combine (``sharded_grad_norm``; ``copies``: HSDP's)."""
    if ep <= 1:
        return {}
    return {"before_unscale": ExpertGradients(model, ep).average,
            "grad_norm": functools.partial(sharded_grad_norm, copies=copies)}


def sharded_grad_norm(params: list[torch.nn.Parameter], copies: int = 1) -> torch.Tensor:
    """The global L2 norm of gradients that are all sharded (FSDP2 over dp_shard, experts over edp x ep): every
    element lives on exactly one rank of each of HSDP's ``copies`` (which hold the same gradients after their
    all-reduce), so the squares of the local shards add up over the world to ``copies`` times the model's."""
    from shardyard.core.memory import local

    grads = [local(p.grad).float() for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    sq = sum((g.pow(2).sum() for g in grads), torch.zeros((), device=device))
    dist.all_reduce(sq)
    return (sq / copies).sqrt()


def clip_by_mesh(params: list[torch.nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """``clip_grads_with_norm_`` for gradients on several device meshes, one mesh at a time (its fused kernels
    take DTensors of one mesh only)."""
    by_mesh: dict[int, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)

