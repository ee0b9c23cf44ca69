"""Expert parallelism for the FSDP2 family (``backend.ep``): each MoE layer's routed experts split across the ranks
of an expert-parallel group, tokens sent to their experts and back by all-to-all, nothing dropped.

The layout (torchtitan's, ``torchtitan/distributed/expert_parallel.py``): the data-parallel ranks that shard the
model, ``dp_shard``, are viewed as ``edp x ep`` with ``ep`` innermost, so an EP group is ``ep`` consecutive ranks
(within a node when it fits: the all-to-all is the chatty collective). Then

1. the routed experts' weights ([E, ...] tensors: transformers' fused ``gate_up_proj`` and ``down_proj``) become
   DTensors sharded on dim 0 over the ``ep`` mesh: ``E / ep`` whole experts per rank, the rank's own;
2. FSDP2 shards those over ``edp`` (what remains of data parallel), and everything else over all of
   ``dp_shard``: the usual ``fully_shard`` per block, whose experts are already their own FSDP unit;
3. the expert gradients are divided by the whole data-parallel world, not by ``edp``: each owner's gradient already
   sums the tokens of its EP peers (the all-to-all's backward brings them), and FSDP sums it over ``edp``.

Because the weights keep their global [E, ...] shapes as DTensors, checkpoints (DCP) and the full state dict see
the same tensors at every ``ep``: a checkpoint written at ep 2 resumes at ep 4, and the HF export is the same
file as without EP. The router stays replicated (a non-expert weight), so routing, balancing and its
all-reduced loads are exactly those of a run without EP.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from shardyard.moe import EXPERT_WEIGHTS, expert_modules

def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows of group g] @ w[g]`` for consecutive row groups ending at ``offs``: one grouped GEMM
    (``torch.nn.functional.grouped_mm``), or a loop over the groups where torch has none."""
    x = x.to(w.dtype)  # grouped_mm is outside autocast's cast list
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is not None and x.shape[0] > 0:
        return fn(x, w, offs=offs)
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ w[g])
        start = end
    return torch.cat(out) if out else x.new_zeros(0, w.shape[-1])


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


def expert_parallel_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of one MoE layer under expert parallelism (replaces the module's ``forward``; the
    arguments are transformers' ``Experts.forward``'s: [T, H] tokens, [T, K] experts and routing weights).

    1. Sort this rank's T x K routed slots by expert and count them per expert.
    2. Exchange the counts (one small all-to-all), so each rank knows how many slots it receives from every
       peer for each of its experts; the splits go to the host once (all_to_all needs them there).
    3. All-to-all the sorted token rows: each peer's slots for this rank's experts arrive, peer by peer.
    4. Regroup them by local expert and run the experts as two grouped GEMMs (gate|up, down) with SwiGLU.
    5. Undo 4, all-to-all the results back, weight them by the routing weights and add each token's K rows.
    """
    group, ep = self.ep_group, self.ep
    T, H = hidden_states.shape
    K = top_k_index.shape[-1]
    local = self.num_experts // ep
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # 1
    rows = hidden_states[order // K]
    if _UNIFORM["on"]:  # a dry run's fake tensors have no values to route by
        send, recv, received = _uniform_splits(T * K, self.num_experts, ep, dist.get_rank(group), x=flat)
    else:
        counts = torch.bincount(flat, minlength=self.num_experts)
        received = torch.empty_like(counts)  # 2: [peer, local expert]
        dist.all_to_all_single(received, counts, group=group)
        received = received.view(ep, local)
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.sum(1).tolist()
    x = _AllToAll.apply(rows, recv, send, group)  # 3
    # 4: rows arrive as [peer][expert]; the GEMMs want [expert][peer]
    src = torch.repeat_interleave(torch.arange(ep * local, device=x.device), received.flatten(),
                                  output_size=x.shape[0])
    by_expert = torch.argsort(src % local * ep + src // local, stable=True)
    x = x[by_expert]
    offs = torch.cumsum(received.sum(0), 0).to(torch.int32)
    w_gu = self.gate_up_proj.to_local() if isinstance(self.gate_up_proj, DTensor) else self.gate_up_proj
    w_d = self.down_proj.to_local() if isinstance(self.down_proj, DTensor) else self.down_proj
    gate, up = grouped_mm(x, w_gu.transpose(-2, -1), offs).chunk(2, dim=-1)
    y = grouped_mm(self.act_fn(gate) * up, w_d.transpose(-2, -1), offs)
    y = y[torch.argsort(by_expert)]  # 5
    y = _AllToAll.apply(y, send, recv, group)
    y = y.float() * top_k_weights.reshape(-1)[order, None].float()
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden_states.device)
    out.index_add_(0, order // K, y)
    return out.to(hidden_states.dtype)


_UNIFORM = {"on": False}


@contextlib.contextmanager
def assume_uniform_routing() -> Iterator[None]:
    """Inside, the expert-parallel forward routes every rank's T x K slots evenly over the E experts instead of
    by the router's choice: what a dry run on fake tensors (``shardyard.dryrun``), which has no values to route
    by, assumes. Nothing else changes: the same buffers, all-to-alls and grouped GEMMs run on those splits."""
    _UNIFORM["on"] = True
    try:
        yield
    finally:
        _UNIFORM["on"] = False


def _uniform_splits(slots: int, experts: int, ep: int, me: int, x: torch.Tensor) -> tuple[list, list, torch.Tensor]:
    """Even routing of ``slots`` routed slots per rank: what this rank sends to each peer, receives from each,
    and the [peer, local expert] counts it receives (every peer routes alike)."""
    local = experts // ep
    base, extra = divmod(slots, experts)
    per_expert = [base + (e < extra) for e in range(experts)]
    mine = per_expert[me * local:(me + 1) * local]
    send = [sum(per_expert[p * local:(p + 1) * local]) for p in range(ep)]
    recv = [sum(mine)] * ep
    return send, recv, torch.tensor([mine] * ep, dtype=torch.long, device=x.device)


def shard_experts(model: torch.nn.Module, ep_mesh: DeviceMesh) -> int:
    """Give every routed-experts module of ``model`` this rank's ``E / ep`` experts (dim-0 DTensor shards over
    ``ep_mesh``) and the all-to-all forward; returns how many modules it changed. Run before FSDP."""
    changed = 0
    for m in expert_modules(model):
        for name in EXPERT_WEIGHTS:
            p = getattr(m, name)
            shard = distribute_tensor(p.data, ep_mesh, [Shard(0)]) if not p.is_meta else \
                DTensor.from_local(p.data.chunk(ep_mesh.size())[ep_mesh.get_local_rank()], ep_mesh, [Shard(0)],
                                   run_check=False)
            setattr(m, name, torch.nn.Parameter(shard, requires_grad=p.requires_grad))
        # Plain attributes (not submodules, not parameters): the group and its size, read by the forward.
        object.__setattr__(m, "ep_group", ep_mesh.get_group())
        object.__setattr__(m, "ep", ep_mesh.size())
        m.forward = expert_parallel_forward.__get__(m)  # this instance only; its class stays transformers'
        changed += 1
    return changed


class ExpertGradients:
    """The routed experts' gradients, averaged over all of data parallel before the optimizer step. FSDP averages
    them over ``edp``; each EP owner's gradient already sums its ``ep`` peers' tokens (the all-to-all's
    backward brought them), so one more division by ``ep`` makes the mean over every data-parallel rank, as
    the other parameters get. (FSDP's ``set_gradient_divide_factor`` would fold it into the reduce-scatter, but
    its PREMUL_SUM reduction does not exist on gloo.)"""

    def __init__(self, model: torch.nn.Module, ep: int):
        self.params = [p for m in expert_modules(model) for p in m.parameters() if p.requires_grad]
        self.ep = ep

    def average(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.ep)  # one mesh: the experts'


def stepper_options(model: torch.nn.Module, ep: int) -> dict[str, Any]:
    """``TorchStepper``'s options under expert parallelism (none at ep 1): the experts' gradients divided by ep
    before unscaling (``ExpertGradients``), and the global norm of gradients on two meshes (experts: edp x ep;
    the rest: all ranks), which torch's norm does not combine (``sharded_grad_norm``)."""
    if ep <= 1:
        return {}
    return {"before_unscale": ExpertGradients(model, ep).average, "grad_norm": sharded_grad_norm}


def sharded_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of gradients that are all sharded (FSDP2 over dp_shard, experts over edp x ep): every
    element lives on exactly one rank, so the squares of the local shards add up over the world."""
    from shardyard.memory import local

    grads = [local(p.grad).float() for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    sq = sum((g.pow(2).sum() for g in grads), torch.zeros((), device=device))
    dist.all_reduce(sq)
    return sq.sqrt()


def clip_by_mesh(params: list[torch.nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """``clip_grads_with_norm_`` for gradients on several device meshes, one mesh at a time (its fused kernels
    take DTensors of one mesh only)."""
    by_mesh: dict[int, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)

