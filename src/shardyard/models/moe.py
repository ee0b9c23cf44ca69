"""Mixture-of-experts routing kept balanced in training, the same on every engine, and measured.

A MoE layer's router sends each token to ``top_k`` of ``E`` routed experts. Left alone, training collapses the
routing onto a few experts (measured here: 50% of a layer's routed slots on one expert of 8 after 150 steps).
The DeepSeek papers keep it balanced in two ways, chosen by what the router is:

* **DeepSeek-V3** (arXiv 2412.19437, "Auxiliary-Loss-Free Load Balancing"): the router adds a per-expert bias
  ``b`` to its sigmoid affinities only to choose the top-k (HF's ``e_score_correction_bias`` buffer, which
  nothing in transformers updates). After every optimizer step ``b_i += gamma * sign(mean load - load_i)``,
  the loads counted over the whole global batch: every micro-batch of every data-parallel rank, one
  all-reduce per step for all layers (``model.balance.bias_update_speed`` = gamma). Beside it, a small
  sequence-wise balance loss (``model.balance.seq_aux_alpha``).
* **DeepSeek-V2** (arXiv 2405.04434, section 2.2.3): softmax routers without a bias, balanced by auxiliary
  losses: expert-level (``seq_aux_alpha``, computed per sequence as the released V2 models do), device-level
  (``device_aux_alpha``) and communication (``comm_aux_alpha``) over the expert-parallel groups.

The balance losses all have the paper's form ``alpha * sum_i f_i * P_i`` for one sequence of T tokens, averaged
over the sequences of the micro-batch: ``f_i = E / (K T) * #tokens routed to i`` (1 for every expert when
balanced) and ``P_i`` the mean over the sequence of the expert's normalised affinity ``s_i / sum_j s_j``
(softmax scores are normalised already). The device-level and communication forms group the experts into the
``D`` expert-parallel groups (section 2.2.3); with D = 1 they are constant and are not computed. Under sequence
or context parallelism (``backend.sp``, ``backend.cp``) a rank holds a share of each sequence's tokens: its sums
over them (``P_i``'s affinities, the routed slots) are added over the sequence group before the ratios are taken,
so each sequence's loss is the whole sequence's, as one process computes it (``SequenceSplit``).

How it meets the engines (no engine needs to know any of this but one call):

1. ``Balancer.install(model, ...)`` after the engine placed the model: a forward hook on every router (found
   by what it has, not by name) counts the routed slots of each expert in training mode, and computes the
   balance losses of the micro-batch. A forward that activation checkpointing recomputes inside backward
   runs the same computations (its saved tensors must match) but counts nothing and adds no loss again.
2. The engines add ``aux_loss(model)`` (the micro-batch's pending balance losses, 0 without MoE) to the loss
   they backpropagate, and still report the cross-entropy alone. A pipeline stage attaches its own layers'
   losses to its output (``attach``), since its loss function sees only the last stage.
3. The loop calls ``after_step`` once per optimizer step: one all-reduce of the loads of every layer (a mean
   over the world: each layer's rows are scaled alike, which leaves signs and ratios as they are), then the
   bias update. The biases are buffers of the model: every checkpoint and the HF export carry them.
4. ``metrics()`` at each log step: per layer the max/mean and min/mean load and the experts that got no
   token over the interval, and the balance loss.

Nothing here makes the host wait for the device inside a layer (issue 41): the loads are counted by a scatter-add
into a tensor kept on the device (``count_routed``; ``torch.bincount`` reads its output size on the host first),
the balance losses stay tensors, and ``metrics()`` reads everything it reports in one transfer per log step.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from omegaconf import DictConfig


@dataclass
class Router:
    """One MoE layer's router, as the balancer reads it."""

    layer: int
    """The layer index (the first number in the module's name: ``model.layers.3.mlp.gate`` is 3)."""
    module: torch.nn.Module
    experts: int
    """Routed experts it chooses among (E)."""
    top_k: int
    """Experts each token goes to (K)."""
    biased: bool
    """A DeepSeek-V3 router: sigmoid affinities and a selection bias (``e_score_correction_bias``) added to them
    only to choose the top-k; else a softmax router (DeepSeek-V2, Mixtral)."""

    @property
    def bias(self) -> torch.Tensor:
        """The selection bias, read from the module each time (an engine or a load may replace the buffer)."""
        b = getattr(self.module, "e_score_correction_bias")
        assert isinstance(b, torch.Tensor) and self.biased
        return b


def routers(model: torch.nn.Module) -> list[Router]:
    """The MoE routers of ``model``: modules with a ``weight`` of shape [num_experts, hidden] that choose
    ``top_k`` experts (transformers' DeepSeek-V2/V3 and Mixtral-style routers), found by what they have."""
    found: list[Router] = []
    for name, m in model.named_modules():
        w, k, e = getattr(m, "weight", None), getattr(m, "top_k", None), getattr(m, "num_experts", None)
        if isinstance(k, int) and isinstance(e, int) and isinstance(w, torch.Tensor) \
                and len(getattr(w, "ds_shape", w.shape)) == 2:  # a ZeRO-3 partition is flat: its shape is ds_shape
            idx = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
            found.append(Router(int(idx.group(1)) if idx else len(found), m, e, k,
                                isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)))
    return found


EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The routed experts' stacked weights in transformers 5's MoE blocks (DeepSeek-V2/V3, Qwen-MoE, Mixtral)."""


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routed-experts modules of ``model``: those holding [E, ...] ``gate_up_proj`` and ``down_proj``
    (what expert parallelism splits, and what the plan counts as expert parameters)."""
    return [m for m in model.modules()
            if all(isinstance(getattr(m, w, None), torch.nn.Parameter) for w in EXPERT_WEIGHTS)
            and getattr(m, "num_experts", None)]


def count_routed(into: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Add the routed slots of ``chosen`` (expert ids, any shape) to ``into`` (one count per expert), in place on
    the device, and return it. No host sync: a scatter-add of ones has a fixed output, where ``torch.bincount``
    (on CUDA) first reads the largest id on the host to size its output."""
    flat = chosen.reshape(-1)
    return into.scatter_add_(0, flat, torch.ones(flat.shape, dtype=into.dtype, device=into.device))


@dataclass(frozen=True)
class SequenceSplit:
    """The sequence group a rank's tokens are a share of (``backend.sp`` or ``backend.cp``): ``size`` ranks and
    their process ``group`` (None in the dry run: nothing is exchanged, the sums are the share's)."""

    size: int
    group: Any


class SumOver(torch.autograd.Function):
    """The sum over a sequence group of ``size`` ranks of each rank's per-sequence sums; in backward every rank's
    gradient of the sum, added up: they are equal (every rank computes the same loss from the same sums), so
    ``size`` x its own, without an exchange. Each rank's share then gets ``size`` x its part of the gradient, which
    the data-parallel mean over all ``dp x size`` ranks turns into the one-process gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
        ctx.size = size
        out = x.clone()
        if group is not None:
            torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad * ctx.size, None, None


def balance_loss(logits: torch.Tensor, chosen: torch.Tensor, batch: int, sigmoid: bool, groups: int = 1,
                 alphas: tuple[float, float, float] = (0.0, 0.0, 0.0), split: SequenceSplit | None = None
                 ) -> torch.Tensor:
    """``alpha * sum_i f_i P_i`` per sequence, averaged over the ``batch`` sequences, for the expert-level
    (``alphas[0]``), device-level (``alphas[1]``) and communication (``alphas[2]``) forms.

    ``logits``: the router's [tokens, E] logits (fp32); ``chosen``: the [tokens, K] experts each token went to;
    ``sigmoid``: the router scores with sigmoid (DeepSeek-V3) rather than softmax (V2); ``groups``: the D
    expert-parallel groups (consecutive experts), for the device-level and communication forms; ``split``: the
    sequence group whose ranks hold the other shares of these sequences' tokens (their sums are added)."""
    tokens, E = logits.shape
    K = chosen.shape[-1]
    T = tokens // batch  # this rank's tokens of each sequence
    s = logits.sigmoid() if sigmoid else logits.softmax(-1)
    affinity = (s / s.sum(-1, keepdim=True)).view(batch, T, E).sum(1)  # [batch, E]
    routed = torch.zeros(batch, E, device=logits.device, dtype=affinity.dtype)
    routed.scatter_add_(1, chosen.reshape(batch, T * K), torch.ones(batch, T * K, device=logits.device,
                                                                    dtype=affinity.dtype))
    device_level = groups > 1 and bool(alphas[1] or alphas[2])
    per = E // groups
    sent = routed.new_zeros(batch, 0)  # the tokens that reach each group: f''_i's count
    if device_level:
        reach = torch.zeros(tokens, groups, device=logits.device, dtype=affinity.dtype)
        reach.scatter_(1, torch.div(chosen, per, rounding_mode="floor"), 1.0)
        sent = reach.view(batch, T, groups).sum(1)
    if split is not None and split.size > 1:  # the whole sequence's sums, from every share
        T *= split.size
        affinity = SumOver.apply(affinity, split.size, split.group)
        counts = torch.cat([routed, sent], 1)  # one exchange for both counts
        if split.group is not None:
            torch.distributed.all_reduce(counts, group=split.group)
        routed, sent = counts[:, :E], counts[:, E:]
    p = affinity / T  # P_i per sequence: [batch, E]
    f = routed * (E / (K * T))  # 1 for every expert when balanced
    loss = alphas[0] * (f * p).sum(-1).mean()
    if device_level:
        p_dev = p.view(batch, groups, per).sum(-1)  # P'_i: the group's summed affinity
        f_dev = f.view(batch, groups, per).mean(-1)  # f'_i: the mean f of its experts
        loss = loss + alphas[1] * (f_dev * p_dev).sum(-1).mean()
        # f''_i = D / (M T) * #tokens sent to group i, M = the most groups one token can reach
        M = min(K, groups)
        f_comm = sent * (groups / (M * T))
        loss = loss + alphas[2] * (f_comm * p_dev).sum(-1).mean()
    return loss


def bias_update(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> None:
    """DeepSeek-V3's update, in place: ``b_i += gamma * sign(mean load - load_i)`` (an overloaded expert is
    chosen less next step, an underloaded one more; an expert exactly at the mean stays)."""
    bias += gamma * torch.sign(load.mean() - load).to(bias.dtype)


def _recomputing() -> bool:
    """True inside backward, where activation checkpointing re-runs a block's forward."""
    return torch._C._current_graph_task_id() != -1


class Balancer:
    """The routers of one model, their step's loads and pending balance losses (see the module docstring)."""

    def __init__(self, found: list[Router], b: DictConfig, layers: int, experts: int, groups: int,
                 device: torch.device, split: SequenceSplit | None = None):
        self.routers, self.b, self.groups, self.device, self.split = found, b, groups, device, split
        self.experts, self.layers = experts, layers
        # this rank's routed slots per [layer, expert] this step, kept on the device and added to in place
        self.counts = torch.zeros(layers, experts, device=device, dtype=torch.float64)
        self.window: torch.Tensor | None = None  # the global loads since the last log step
        self.pending: list[torch.Tensor] = []  # balance losses of the micro-batch being run
        self.aux: torch.Tensor | None = None  # this step's balance losses (summed) and micro-batches, on device
        self.aux_window: torch.Tensor | None = None  # the same, global, since the last log step
        self.alphas = (float(b.seq_aux_alpha), float(b.device_aux_alpha), float(b.comm_aux_alpha))
        self.paused = False  # a forward that is not training (a pipeline's metadata inference): not counted
        self.handles = [r.module.register_forward_hook(self._hook(r)) for r in found]

    @classmethod
    def install(cls, model: torch.nn.Module, b: DictConfig, experts: int, groups: int = 1,
                device: torch.device | None = None, split: SequenceSplit | None = None) -> Balancer | None:
        """Hooks on the routers ``model`` holds on this rank (None: a dense model, ``experts`` = 0). ``b``: the
        ``model.balance`` section; ``experts``: routed experts per layer (``ModelFacts.routed_experts``);
        ``groups``: the expert-parallel degree; ``device``: where the engine's collectives run (the model's
        first parameter's by default); ``split``: the sequence group of this rank (sp, cp), if any. Every rank of a
        MoE model gets one, also a pipeline stage that holds no MoE layer: each takes part in the step's
        all-reduce. It rides on the model (``of``)."""
        if not experts:
            return None
        found = routers(model)
        config = getattr(model, "config", None)
        # every layer of the whole model, the MTP depths after the main layers (config.num_nextn_predict_layers):
        # each pipeline stage holds some of them, and all take part in one all-reduce of the same size
        whole = (getattr(config, "num_hidden_layers", 0) or 0) + (getattr(config, "num_nextn_predict_layers", 0) or 0)
        layers = max(whole, max((r.layer for r in found), default=-1) + 1)
        balancer = cls(found, b, layers, experts, groups, device or next(model.parameters()).device, split)
        object.__setattr__(model, "shardyard_balancer", balancer)
        return balancer

    def _hook(self, router: Router) -> Callable:
        layer, sigmoid = router.layer, router.biased

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if not module.training or not torch.is_grad_enabled():
                return  # evaluation, generation (GRPO's rollouts), a reference forward: not a training token
            logits, chosen = output[0], output[-1]
            hidden = args[0]
            # A forward that is recomputed in backward (activation checkpointing) or that does not train (paused)
            # computes what a training forward computes, so that a recomputation saves the same tensors, and
            # leaves no trace: no load counted, no loss added.
            quiet = self.paused or _recomputing()
            if any(self.alphas) and torch.is_grad_enabled():
                batch = hidden.shape[0] if hidden.dim() == 3 else 1
                loss = balance_loss(logits.float(), chosen, batch, sigmoid, self.groups, self.alphas, self.split)
                if not quiet:
                    self.pending.append(loss)
            if quiet:
                return
            with torch.no_grad():
                count_routed(self.counts[layer], chosen)

        return hook

    def take_loss(self) -> torch.Tensor | float:
        """The pending balance losses of the micro-batch just run (summed over its MoE layers), and clear them."""
        if not self.pending:
            return 0.0
        loss = torch.stack(self.pending).sum()
        self.pending = []
        seen = torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=loss.device)])
        self.aux = seen if self.aux is None else self.aux + seen  # no host sync: read at the log step
        return loss

    @torch.no_grad()
    def after_step(self, all_reduce_mean: Callable[[torch.Tensor], torch.Tensor], applied: bool = True) -> None:
        """One all-reduce of this step's loads of every layer, then (DeepSeek-V3 routers) the bias update.
        Every rank calls it once per optimizer step; an update that was not applied (non-finite gradients, an
        fp16 overflow) leaves the biases as they are too."""
        counts = self.counts
        aux = self.aux if self.aux is not None else torch.zeros(2, device=counts.device, dtype=torch.float64)
        packet = all_reduce_mean(torch.cat([counts.flatten(), aux.to(counts.device)]))  # the step's one all-reduce
        loads, aux = packet[:-2].view_as(counts), packet[-2:]
        counts.zero_()
        self.aux = None
        self.window = loads if self.window is None else self.window + loads
        self.aux_window = aux if self.aux_window is None else self.aux_window + aux
        gamma = float(self.b.bias_update_speed)
        if not (applied and gamma):
            return
        for r in self.routers:
            if r.biased:
                bias_update(r.bias, loads[r.layer].to(r.bias.device), gamma)

    def metrics(self) -> dict[str, float]:
        """Per MoE layer, over the global loads since the last call: ``moe/layer_N/max_over_mean``,
        ``min_over_mean``, ``dead_experts`` (experts that got no token); the worst layer's max/mean as
        ``moe/max_over_mean``; and the mean balance loss per micro-batch, ``moe/balance_loss``. One transfer
        to the host for all of it, whatever the number of layers."""
        out: dict[str, float] = {}
        if self.window is None or self.aux_window is None:
            return out
        values = torch.cat([self.window.flatten(), self.aux_window.to(self.window.device)]).tolist()  # the one read
        self.window, self.aux_window = None, None
        E = self.experts
        # Rows with routed tokens: every MoE layer of the whole model, also those another pipeline stage holds.
        for layer in range(self.layers):
            load = values[layer * E:(layer + 1) * E]
            mean = sum(load) / E
            if mean <= 0:
                continue
            out[f"moe/layer_{layer}/max_over_mean"] = max(load) / mean
            out[f"moe/layer_{layer}/min_over_mean"] = min(load) / mean
            out[f"moe/layer_{layer}/dead_experts"] = float(sum(v == 0 for v in load))
        worst = [v for k, v in out.items() if k.endswith("max_over_mean")]
        if worst:
            out["moe/max_over_mean"] = max(worst)
        aux_sum, seen = values[-2:]
        if seen > 0:
            out["moe/balance_loss"] = aux_sum / seen
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def of(model: Any) -> Balancer | None:
    """The balancer installed on ``model`` (unwrapping DDP's and DeepSpeed's ``.module`` and a pipeline stage's
    whole model), or None."""
    while hasattr(model, "module"):
        model = model.module
    model = getattr(model, "_hf", model)
    return getattr(model, "shardyard_balancer", None)


@contextlib.contextmanager
def paused(model: Any) -> Iterator[None]:
    """Forwards of ``model`` inside are neither counted nor given a balance loss: a pipeline schedule's first
    step runs each stage once on placeholder tensors to learn the shapes it sends."""
    balancer = of(model)
    if balancer is None:
        yield
        return
    balancer.paused = True
    try:
        yield
    finally:
        balancer.paused = False


def aux_loss(model: Any) -> torch.Tensor | float:
    """The balance losses of the micro-batch ``model`` just ran forward (0 for a dense model): engines add it
    to the loss they backpropagate."""
    balancer = of(model)
    return balancer.take_loss() if balancer is not None else 0.0


class _Attach(torch.autograd.Function):
    """``attach(h, loss, scale)``: ``h`` unchanged; in backward, ``loss`` gets the gradient ``scale``, as if it
    had been added (times ``scale``) to the loss whose gradient reaches ``h``."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.shape, ctx.dtype = scale, loss.shape, loss.dtype
        return h.clone()  # not a view: FSDP's pre-backward hook goes on the stage's output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, torch.full(ctx.shape, ctx.scale, dtype=ctx.dtype, device=grad.device), None


def attach(h: torch.Tensor, model: Any, scale: float) -> torch.Tensor:
    """A pipeline stage's output with its layers' pending balance losses attached (``scale``: what the loss
    function multiplies the loss by)."""
    loss = aux_loss(model)
    if isinstance(loss, torch.Tensor) and h.requires_grad:
        return _Attach.apply(h, loss, scale)
    return h


@torch.no_grad()
def held_out_loads(model: torch.nn.Module, batches: Any) -> dict[int, torch.Tensor]:
    """Each MoE layer's routed slots per expert when ``model`` (in eval mode) reads ``batches`` of token ids:
    how the router sends text it was not trained on (``bench/moe.py``, the README's figures)."""
    found = routers(model)
    device = next(model.parameters()).device
    loads = {r.layer: torch.zeros(r.experts, dtype=torch.float64, device=device) for r in found}

    def count(layer: int) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            count_routed(loads[layer], output[-1])
        return hook

    handles = [r.module.register_forward_hook(count(r.layer)) for r in found]
    was = model.training
    model.eval()
    try:
        for ids in batches:
            model(ids)
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    return {layer: load.cpu() for layer, load in loads.items()}


def imbalance(load: torch.Tensor) -> tuple[float, float, int]:
    """(max/mean, min/mean, experts without a token) of one layer's load."""
    mean = load.mean()
    return float(load.max() / mean), float(load.min() / mean), int((load == 0).sum())



# ------------------------------------------------------------------------ group-limited routing x expert parallel
@dataclass(frozen=True)
class RoutingGroups:
    """How group-limited routing (``model.n_group`` / ``model.topk_group``: each token's experts drawn from the
    ``topk_group`` best of ``n_group`` groups of consecutive experts, DeepSeek-V3's node-limited routing) meets
    the expert-parallel layout (``backend.ep``: rank j of an EP group holds the consecutive experts
    ``j E/ep .. (j+1) E/ep - 1``, ``expert_parallel.shard_experts``; an EP group is ``ep`` consecutive ranks, so
    ``ranks_per_node`` of them share a node).

    The groups *line up* with the ranks when every group's experts sit on whole ranks of their own: ``n_group``
    a multiple of ``ep`` (each rank holds ``n_group / ep`` whole groups; ``n_group = ep`` is the paper's
    device-limited routing) or ``ep`` a multiple of ``n_group`` (each group fills ``ep / n_group`` ranks, no rank
    shared by two groups; one node each is the paper's node-limited routing, Megatron's
    ``--moe-router-num-groups`` = the nodes of the EP group). Then a token, whose experts lie in ``topk_group``
    groups, reaches at most ``topk_group x ranks_per_group`` ranks, where without groups it may reach ``top_k``.
    Otherwise a group straddles a rank boundary and the bound is looser (``max_ranks`` counts it exactly)."""

    experts: int
    groups: int
    topk_group: int
    top_k: int
    ep: int
    ranks_per_node: int

    @property
    def per_group(self) -> int:
        return self.experts // self.groups

    @property
    def limited(self) -> bool:
        """Whether the groups limit anything: more than one group and fewer kept than there are."""
        return self.groups > 1 and self.topk_group < self.groups

    @property
    def lined_up(self) -> bool:
        return self.groups % self.ep == 0 or self.ep % self.groups == 0

    def _spans(self, per: int) -> list[set[int]]:
        """For each group, the ranks (``per`` experts per rank) or nodes (``per`` experts per node) it touches."""
        return [{e // per for e in range(g * self.per_group, (g + 1) * self.per_group)} for g in range(self.groups)]

    def _most(self, per: int, units: int) -> int:
        # A token's experts lie in topk_group groups: at most the units (ranks or nodes) of the topk_group groups
        # that touch the most of them, and never more than its top_k experts or the units there are.
        touched = sorted((len(s) for s in self._spans(per)), reverse=True)
        return min(self.top_k, units, sum(touched[:self.topk_group]))

    @property
    def max_ranks(self) -> int:
        """The most ranks of its EP group one token's experts lie on (under the group limit)."""
        return self._most(self.experts // self.ep, self.ep)

    @property
    def nodes(self) -> int | None:
        """Nodes an EP group spans (consecutive ranks from a node's first); None where ``ep`` and the ranks per
        node do not divide one another (EP groups then straddle nodes unevenly)."""
        if self.ranks_per_node % self.ep == 0:
            return 1
        return self.ep // self.ranks_per_node if self.ep % self.ranks_per_node == 0 else None

    @property
    def max_nodes(self) -> int | None:
        """The most nodes of its EP group one token's experts lie on, or None (``nodes``)."""
        n = self.nodes
        return None if n is None else self._most(self.experts // n, n)

    def where(self) -> str:
        """Where a group's experts sit, in words."""
        if self.groups % self.ep == 0:
            return ("one per rank of the EP group (device-limited)" if self.groups == self.ep
                    else f"{self.groups // self.ep} per rank of the EP group")
        r = self.ep // self.groups
        if self.nodes and self.nodes > 1 and r == self.ranks_per_node:
            return "one per node of the EP group (node-limited)"
        return f"each on {r} ranks of the EP group" + (" within a node" if self.ranks_per_node % r == 0 else "")

    def note(self, ep_options: list[int] | None = None) -> str | None:
        """The plan's line on it (None: no group limit, or no expert parallelism); ``ep_options``: the EP degrees
        the layout allows, for the values that would line the groups up."""
        if not self.limited or self.ep <= 1:
            return None
        head = f"routing groups: {self.groups} groups of {self.per_group} experts"
        nodes = "" if not self.nodes or self.nodes == 1 or self.max_nodes is None else \
            f", of its {self.nodes} nodes at most {self.max_nodes}"
        reach = (f"each token's all-to-all reaches at most {self.max_ranks} of the {self.ep} ranks "
                 f"(topk_group={self.topk_group}, top_k={self.top_k}){nodes}")
        if self.lined_up:
            return f"{head}, {self.where()}: {reach}"
        return (f"{head} do not line up with ep={self.ep} ranks of {self.experts // self.ep} experts (groups "
                f"straddle ranks): {reach}. They would line up with {self.fixes(ep_options)}")

    def fixes(self, ep_options: list[int] | None = None) -> str:
        """The values that would line the groups up: ``model.n_group`` (dividing the experts, groups of 2 or more,
        ``topk_group`` of them at most) or ``backend.ep`` (of ``ep_options``, the degrees the layout allows)."""
        groups = [g for g in range(max(self.topk_group, 2), self.experts // 2 + 1)
                  if self.experts % g == 0 and (g % self.ep == 0 or self.ep % g == 0)]
        eps = [e for e in (ep_options or []) if self.groups % e == 0 or e % self.groups == 0]
        said = [f"model.n_group in {groups}" if groups else ""]
        said.append(f"backend.ep in {eps}" if eps else "")
        return " or ".join(s for s in said if s) or "no n_group of this model (make n_routed_experts divide evenly)"


def routing_groups(model_cfg: Any, experts: int, top_k: int, ep: int, ranks_per_node: int) -> RoutingGroups:
    """The ``RoutingGroups`` of a model config (``model.n_group`` / ``model.topk_group``; 1 group, no limit, for
    a model without them or a DeepSeek-V2 router choosing greedily, ``model.topk_method=greedy``)."""
    get = getattr(model_cfg, "get", lambda k, d=None: d)
    groups, topk = int(get("n_group", 1) or 1), int(get("topk_group", 1) or 1)
    method = get("topk_method", "group_limited_greedy")
    if getattr(method, "value", method) == "greedy" or groups < 1 or experts % groups:
        groups, topk = 1, 1
    return RoutingGroups(experts, groups, min(topk, groups), top_k, max(ep, 1), max(ranks_per_node, 1))
