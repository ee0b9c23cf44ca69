"""Sequence parallelism, Ulysses style (``backend.sp``; DeepSpeed-Ulysses, arXiv 2309.14509), and context
parallelism, all-gather style (``backend.cp``; Llama 3's and torch's ``flex_cp_allgather``).

The ranks of a sequence group (sp or cp of them) read the same sequences, and each keeps a share of their
positions: its token ids, position ids and targets (``shard``). Everything a block computes position by position
(embeddings, norms, MLPs, MoE routing and expert dispatch, the head and the loss) runs on the share, so a rank's
activations are 1/sp (1/cp) of the sequence's. Attention mixes positions:

* Ulysses (sp): each rank holds a contiguous 1/sp of the positions. Around attention one all-to-all trades the
  sequence shards of the queries, keys and values for shards of their heads (a rank then holds every position of
  H / sp heads), attention runs over the whole sequence, and a second all-to-all trades the output back. It needs
  heads that divide by sp.
* All-gather (cp): each rank holds two of the 2 cp chunks of the sequence, chunk r and chunk 2 cp - 1 - r (the
  head-tail balance of Megatron's and torch's context parallel: every rank then has the same causal work). Its
  queries stay; the keys and values of every rank are gathered (their gradients reduce-scattered back) and its
  two chunks attend to the keys before them (lower-right causal, no mask tensor), or to those of their own document.
  Any head count; a rank holds the whole sequence's keys and values of a layer while it attends.

RoPE was applied before either, with each share's own positions; packed documents' masks are the whole sequence's
(``Batch``). The engines need nothing else: the group's ranks are data-parallel ranks to them (each holds
different tokens), so their averaged gradients, with the loop's token-weighted loss (every rank's summed
cross-entropy times accum x ranks / the step's label tokens), are exactly one rank's over the whole sequence. The
data-parallel size, the ranks reading different sequences, is world / (sp x cp) (``ParallelDims.sp``, ``.cp``).

DPO and GRPO cut their own rows with ``shard`` (``objectives.Objective.splits_sequences``): DPO's chosen and rejected
rows, its per-sequence log-probabilities added over the group (``sequence_sum``); GRPO's prompt + completion rows,
padded at their end to a length the split divides and their prompts' left padding masked over the whole row
(``Batch.keys``), its completions sampled whole and made the group's first rank's (``from_first``).

How it reaches attention: ``install`` registers ``attention`` in transformers' attention registry and makes it
the model's implementation; it is plain SDPA unless the model's keyword arguments carry a ``Batch`` (under
``SEQUENCE_SHARDS``), which transformers passes through every decoder layer to the attention function. So only
the sharded training and evaluation forwards exchange anything; generation and exports run as before.

A module of ``backends``: it imports torch, transformers' attention registry and ``shardyard.models``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardyard.models.loss import SEQUENCE_SHARDS

NAME = "shardyard_ulysses"
"""The attention implementation ``install`` registers (transformers' ``config._attn_implementation``)."""


ULYSSES, ALL_GATHER = "ulysses", "all-gather"


@dataclass(frozen=True)
class Shards:
    """This rank's place in its sequence group: ``size`` ranks, this one's ``index``, their process ``group``, and
    how they split a sequence (``style``: ``ULYSSES`` for backend.sp, ``ALL_GATHER`` for backend.cp)."""

    size: int
    index: int
    group: Any
    style: str = ULYSSES

    @property
    def parts(self) -> int:
        """The equal parts a sequence is cut into: ``size`` (Ulysses), ``2 size`` (all-gather's chunks)."""
        return self.size if self.style == ULYSSES else 2 * self.size

    def data_rank(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """The (rank, world) that choose sequences: the sequence groups, each reading one share of the batch."""
        return dp_rank // self.size, dp_size // self.size

    def positions(self, length: int, device: Any = None) -> torch.Tensor:
        """The indices into the whole sequence of this rank's positions, in its order: a contiguous 1/size (Ulysses),
        or chunks ``index`` and ``2 size - 1 - index`` of 2 size (all-gather's head-tail balance)."""
        if self.style == ULYSSES:
            n = length // self.size
            return torch.arange(self.index * n, (self.index + 1) * n, device=device)
        c = length // (2 * self.size)
        head, tail = self.index, 2 * self.size - 1 - self.index
        return torch.cat([torch.arange(head * c, (head + 1) * c, device=device),
                          torch.arange(tail * c, (tail + 1) * c, device=device)])


def groups(world: int, dims: Any, rank: int, simulated: bool = False) -> Shards | None:
    """Every rank makes every sequence group (``new_group`` is collective): ``dims.sp`` (or ``dims.cp``) ranks each,
    consecutive but for tensor parallel's (``dims.tp``, innermost in ``fsdp_tp``'s mesh): a group is the ranks of
    one tp index in ``size x tp`` consecutive ranks, so the tp ranks of one sequence hold the same positions, each
    its heads of them. On one node when ``size x tp`` divides it (their exchanges are the chatty collectives); None
    when neither degree is above 1 (validation refuses both at once). On the pipeline a group is ranks of one stage:
    its mesh is (pp, dp) with a stage's world / pp data-parallel ranks consecutive, a multiple of the degree
    (``ParallelDims.cp`` is a factor of it), so each group's ranks hold the same layers. ``simulated``: the dry
    run's rank ``rank`` of a group without a process group (its exchanges allocate and send nothing)."""
    size, style = (dims.sp, ULYSSES) if dims.sp > 1 else (dims.cp, ALL_GATHER)
    if size <= 1:
        return None
    tp = max(int(getattr(dims, "tp", 1)), 1)
    index = rank // tp % size
    if simulated:
        return Shards(size, index, None, style)
    mine = None
    for start in range(0, world, size * tp):
        for t in range(tp):
            members = [start + j * tp + t for j in range(size)]
            g = dist.new_group(members)
            if rank in members:
                mine = g
    return Shards(size, index, mine, style)


@dataclass
class Batch:
    """One micro-batch's sequence split, carried in the model's keyword arguments to every attention."""

    shards: Shards
    segments: torch.Tensor | None
    """``[B, T]`` document number of every position of the whole sequence (packed documents, positions restarting
    at 0); None: one causal sequence."""
    keys: torch.Tensor | None = None
    """``[B, T]`` bool: the positions of the whole sequence attention may read (an ``attention_mask``'s padding off:
    GRPO's left-padded prompts); None: every position."""
    ahead: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    """Multi-token prediction (``model.mtp``): for each depth k, the token ids at this rank's positions + k (the
    embeddings depth k reads, wrapping at the row's end as one process's roll does) and depth k's targets at its
    positions, both taken from the whole sequence before the split: they cross the shares' edges
    (``models.mtp``). None without depths."""
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def to(self, *args: Any, **kwargs: Any) -> Batch:
        """Rides along through ``objectives.to_device`` as the batch's tensors move; MTP's ``ahead`` moves with them
        (copied as they are, ``non_blocking``: the depths read them without making the host wait)."""
        if self.ahead is None:
            return self
        ids, targets = self.ahead
        return dataclasses.replace(self, ahead=([t.to(*args, **kwargs) for t in ids],
                                                [t.to(*args, **kwargs) for t in targets]))

    def mask(self, device: torch.device) -> torch.Tensor | None:
        """The attention mask of this rank's queries over the whole sequence's keys (bool ``[B, 1, queries, T]``: a
        position sees the earlier ones of its own document, and only the ``keys`` attention may read, as
        transformers' SDPA mask of a padded batch), built once per micro-batch for all layers; None: no documents
        and no padding (Ulysses: causal; all-gather: lower-right causal per chunk, ``_gathered_attention``).
        Ulysses' queries are every position (of its heads); all-gather's its own positions."""
        if self.segments is None and self.keys is None:
            return None
        if self._mask is None:
            known = self.segments if self.segments is not None else self.keys
            assert known is not None
            length = known.size(-1)
            mine = torch.arange(length, device=device) if self.shards.style == ULYSSES \
                else self.shards.positions(length, device)
            keys = torch.arange(length, device=device)
            mask = (keys[None, :] <= mine[:, None])[None]  # causal
            if self.segments is not None:
                seg = self.segments.to(device)
                mask = mask & (seg[:, mine][:, :, None] == seg[:, None, :])
            if self.keys is not None:
                mask = mask & self.keys.to(device)[:, None, :]
            self._mask = mask[:, None]
        return self._mask


LAST_SHARE: dict[str, int] = {}
"""What ``shard`` cut last in this process: ``positions`` (this rank's share), ``of`` (the whole, padded length) and
``first`` (the share's first position), which the run's ``summary.json`` reports (``sequence_share``): what the
rank really trained on, not what it was configured to."""


def shard(inputs: Any, targets: torch.Tensor, shards: Shards, depths: int = 0) -> tuple[dict, torch.Tensor]:
    """A micro-batch of whole sequences (token ids; or ``input_ids`` and ``position_ids`` of packed documents; or
    those and a padded batch's ``attention_mask``, 1 on the tokens attention may read) as this rank's shard: its
    1/sp of the positions, their position ids (so RoPE rotates by the true position), its targets (already shifted
    by the data: the last position of a shard predicts the next shard's first token), and the ``Batch`` that
    attention reads; with ``depths`` MTP depths, what each depth reads past the share's edge (``Batch.ahead``).

    A length that ``Shards.parts`` does not divide (GRPO's prompt + completion rows) is padded at its end first:
    token 0, positions counting on, no target (-100), masked off when an ``attention_mask`` is given. Causal
    attention never lets an earlier position read a later one, so no loss or gradient changes."""
    ids = inputs["input_ids"] if isinstance(inputs, dict) else inputs
    extra = set(inputs) - {"input_ids", "position_ids", "attention_mask"} if isinstance(inputs, dict) else set()
    assert not extra, f"sequence parallelism splits token ids, positions and padding masks, not {sorted(extra)}"
    given = inputs if isinstance(inputs, dict) else {}
    rows, length = ids.shape
    pad = -length % shards.parts
    if pad:
        ids, targets = F.pad(ids, (0, pad)), F.pad(targets, (0, pad), value=-100)
        given = {k: F.pad(v, (0, pad)) if k == "attention_mask" else v for k, v in given.items()}
        if "position_ids" in given:
            p = given["position_ids"]
            given["position_ids"] = torch.cat([p, p[:, -1:] + torch.arange(1, pad + 1, device=p.device)], 1)
        length += pad
    cut = shards.positions(length, ids.device)
    # (from the shapes, not the tensor's values: the dry run's fake tensors have none)
    first = shards.index * (length // shards.size if shards.style == ULYSSES else length // (2 * shards.size))
    LAST_SHARE.update(positions=int(cut.numel()), of=int(length), first=first)
    keys = given["attention_mask"].bool() if "attention_mask" in given else None
    if "position_ids" in given:
        positions = given["position_ids"]
        # with an attention mask the positions are a padded row's, not packed documents' (as transformers reads them)
        segments = (positions == 0).cumsum(-1) if keys is None else None
        whole = keys is not None or bool((positions == torch.arange(length, device=positions.device)).all())
    else:
        positions = torch.arange(length, device=ids.device).expand(rows, length)
        segments, whole = None, True
    ahead = None
    if depths:
        from shardyard.models.mtp import depth_targets

        packed = given.get("position_ids")
        ahead = ([ids[:, (cut + k) % length] for k in range(1, depths + 1)],
                 [depth_targets(targets, packed, k)[:, cut] for k in range(1, depths + 1)])
    batch = Batch(shards, None if whole else segments, keys, ahead)
    return {"input_ids": ids[:, cut], "position_ids": positions[:, cut], SEQUENCE_SHARDS: batch}, targets[:, cut]


def sequence_sum(x: torch.Tensor, shards: Shards) -> torch.Tensor:
    """Per-sequence sums of this rank's share of the positions (``[B]``, e.g. DPO's response log-probabilities) as
    the whole sequences', added over the sequence group (``models.moe.SumOver``). Every rank then computes the same
    loss from the same sums; in backward each rank's share takes ``size`` x the gradient of that loss, which the
    engines' mean over their ``dp x size`` data-parallel ranks makes one process's. Without a group (the dry run's
    simulated rank) the share's sums."""
    from shardyard.models.moe import SumOver

    return SumOver.apply(x, shards.size, shards.group)


def from_first(x: torch.Tensor, shards: Shards) -> torch.Tensor:
    """``x`` as the sequence group's first rank holds it, on every rank of the group (a broadcast): what the ranks
    of a group must hold alike, e.g. GRPO's sampled completions, whatever their kernels' nondeterminism."""
    x = x.contiguous()
    if shards.group is not None:
        dist.broadcast(x, group=shards.group, group_src=0)
    return x


class _AllGather(torch.autograd.Function):
    """``all_gather_into_tensor`` along a new dim 0 (one part per rank of the group); its backward reduce-scatters
    the gradients (each rank's part sums what every rank's attention sent back to it). Without a group (the dry
    run's simulated rank) it allocates what the gather does and sends nothing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # the parts end to end on dim 0, as gloo takes them
        if group is not None:
            dist.all_gather_into_tensor(out, x, group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[1:])
        if ctx.group is not None:
            dist.reduce_scatter_tensor(out, grad.view(-1, *grad.shape[2:]), group=ctx.group)
        return out, None, None


def _gathered(x: torch.Tensor, shards: Shards) -> torch.Tensor:
    """``[B, H, 2c, D]`` (this rank's chunks: head r, tail 2n-1-r) -> ``[B, H, 2nc, D]``, the whole sequence in order:
    the heads of ranks 0..n-1, then the tails of ranks n-1..0."""
    b, h, t, d = x.shape
    n, c = shards.size, t // 2
    parts = _AllGather.apply(x, n, shards.group).reshape(n, b, h, 2, c, d)  # [rank, B, H, head|tail, c, D]
    heads = parts[:, :, :, 0].permute(1, 2, 0, 3, 4)  # [B, H, rank, c, D]
    tails = parts.flip(0)[:, :, :, 1].permute(1, 2, 0, 3, 4)
    return torch.cat([heads, tails], dim=2).reshape(b, h, 2 * n * c, d)


def _gathered_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        batch: Batch, dropout: float, scaling: float | None) -> torch.Tensor:
    """All-gather context parallelism: this rank's queries (its two chunks) over every rank's keys and values.

    1. The keys and values gathered, in sequence order (``_gathered``).
    2. Packed documents: one mask of this rank's queries over every key (``Batch.mask``). Otherwise each chunk
       attends to the keys up to its own end, lower-right causal: torch's ``causal_lower_right``, which no mask
       tensor holds (the flash kernels take it as an offset on CUDA).
    """
    from torch.nn.attention.bias import causal_lower_right

    k, v = _gathered(key, batch.shards), _gathered(value, batch.shards)  # 1
    p = dropout if module.training else 0.0
    gqa = k.shape[1] != query.shape[1]
    mask = batch.mask(query.device)  # 2
    if mask is not None:
        return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, dropout_p=p, scale=scaling, enable_gqa=gqa)
    n, c = batch.shards.size, query.shape[2] // 2
    out = []
    for j, chunk in enumerate((batch.shards.index, 2 * n - 1 - batch.shards.index)):
        end = (chunk + 1) * c
        q = query[:, :, j * c:(j + 1) * c]
        # The dry run's simulated rank (no group) computes no values: the kernel's memory is the same unmasked (the
        # flash and efficient kernels take the lower-right bias as an offset; fake tensors have no kernel for it)
        bias = causal_lower_right(c, end) if batch.shards.group is not None else None
        out.append(F.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], attn_mask=bias, dropout_p=p,
                                                  scale=scaling, enable_gqa=gqa))
    return torch.cat(out, dim=2)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of equal parts along dim 0 (one per rank of the group); its backward is the same
    exchange of the gradients. Without a group (``group`` None: the dry run's simulated rank) it allocates what the
    exchange does and sends nothing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)  # (of a contiguous tensor: empty_like keeps a view's strides)
    if group is not None:
        dist.all_to_all_single(out, x, group=group)
    return out


def _to_heads(x: torch.Tensor, shards: Shards) -> torch.Tensor:
    """``[B, H, T/sp, D]`` (this rank's positions, every head) -> ``[B, H/sp, T, D]`` (every position, this rank's
    heads): part j of the exchange holds the heads of rank j, and what comes back from rank j is its positions."""
    b, h, t, d = x.shape
    sp = shards.size
    parts = x.reshape(b, sp, h // sp, t, d).transpose(0, 1)  # [sp: whose heads, B, H/sp, T/sp, D]
    got = _AllToAll.apply(parts, shards.group)  # [sp: whose positions, B, H/sp, T/sp, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * t, d)


def _to_positions(x: torch.Tensor, shards: Shards) -> torch.Tensor:
    """``_to_heads`` reversed: ``[B, H/sp, T, D]`` -> ``[B, H, T/sp, D]``."""
    b, h, t, d = x.shape
    sp = shards.size
    parts = x.reshape(b, h, sp, t // sp, d).permute(2, 0, 1, 3, 4)  # [sp: whose positions, B, H/sp, T/sp, D]
    got = _AllToAll.apply(parts, shards.group)  # [sp: whose heads, B, H/sp, T/sp, D]
    return got.transpose(0, 1).reshape(b, sp * h, t // sp, d)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (``[B, heads, T, D]`` in, ``[B, T, heads, D]`` out). Without a
    ``Batch`` in ``kwargs``: SDPA, as ``attn_implementation=sdpa``. All-gather context parallelism:
    ``_gathered_attention``. Ulysses:

    1. Grouped-query attention whose key/value heads do not divide by sp repeats them to the query heads first
       (each rank needs the key/value heads of its query heads); otherwise each rank takes its share of them.
    2. The exchange to head shards, for queries, keys and values (MLA's value head size may differ: its own).
    3. Attention over the whole sequence: causal, or the documents' block-diagonal mask (``Batch.mask``); the mask
       transformers built for the shard is not the sequence's and is not read. The scale is the module's (YaRN's
       mscale included).
    4. The exchange back to this rank's positions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch: Batch | None = kwargs.pop(SEQUENCE_SHARDS, None)
    if batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    shards = batch.shards
    if shards.style == ALL_GATHER:
        return _gathered_attention(module, query, key, value, batch, dropout, scaling).transpose(1, 2).contiguous(), None
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % shards.size:  # 1
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (_to_heads(t, shards) for t in (query, key, value))  # 2
    mask = batch.mask(q.device)  # 3
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                         dropout_p=dropout if module.training else 0.0, scale=scaling,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return _to_positions(out, shards).transpose(1, 2).contiguous(), None  # 4


def install(model: torch.nn.Module) -> None:
    """Make ``attention`` the model's attention (and SDPA's mask builder its mask builder), for every config the
    model holds (a composite model's sub-configs too)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = NAME


def sharded_micro_batches(batches: Any, shards: Shards | None) -> Any:
    """Each ``(inputs, targets)`` of ``batches`` as this rank's shard (``shard``); unchanged without sequence
    parallelism."""
    for x, y in batches:
        yield shard(x, y, shards) if shards is not None else (x, y)


class ShardedStream:
    """A ``data.TrainStream`` of a sequence group (made with ``Shards.data_rank``) whose micro-batches are this
    rank's shard of them; everything else (positions, weights, checkpointed state) is the stream's."""

    def __init__(self, stream: Any, shards: Shards, depths: int = 0):
        self.stream, self.shards, self.depths = stream, shards, depths

    def micro_batch(self, step: int, micro: int) -> tuple[dict, torch.Tensor]:
        x, y = self.stream.micro_batch(step, micro)
        return shard(x, y, self.shards, self.depths)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)
