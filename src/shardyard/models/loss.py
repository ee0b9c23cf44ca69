"""The causal LM loss as the engines compute it: the mean for evaluation (``causal_lm_loss``), the summed terms
training backpropagates (``causal_lm_loss_sum``: the main head's, each multi-token-prediction depth's, or an
installed objective's), the chunked head's path, and packed rows' attention masks (``packed_kwargs``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shardyard.models import mtp
from shardyard.models.prepare import has_chunked_loss
from shardyard.models.shape import _bare, attn_implementation


SEQUENCE_SHARDS = "shardyard_sequence_shards"
"""The model keyword argument under which a sequence-parallel micro-batch carries its split to every attention
(``shardyard.backends.sequence_parallel``); such inputs bring their own whole-sequence masks."""


def logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def causal_lm_loss(model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the tokens with a target (-100 marks the others: prompts, padding);
    logits upcast to fp32 for a stable softmax under autocast. ``inputs``: token ids, or the model's keyword
    arguments (``input_ids`` and ``position_ids`` of packed rows, ``data=sft``). Evaluation's form; training
    backpropagates ``causal_lm_loss_sum``. Under an installed objective (``shardyard.objectives.install``: DPO,
    GRPO), that objective's held-out loss."""
    objective = _objective(model)
    if objective is not None:
        return objective.eval_loss(model, inputs, targets)
    return _cross_entropy(model, inputs, targets, "mean")


def causal_lm_loss_sum(model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """The training loss's terms, each the cross-entropy summed over its labelled tokens (fp32; 0 when none is
    labelled, where the mean is NaN): the main head's (0-d), or ``[main, MTP depth 1, ..., depth D]`` for a model
    with multi-token prediction (``shardyard.models.mtp``). The engines weight each term so that an optimizer step's loss is
    its token-weighted mean over every micro-batch and rank (docs/architecture.md, "Token-weighted loss"), times
    its factor (``mtp.term_weights``). Under an installed objective (``shardyard.objectives.install``: DPO, GRPO),
    that objective's terms, summed over what it averages over (``Objective.counts``)."""
    objective = _objective(model)
    if objective is not None:
        return objective.loss_sum(model, inputs, targets)
    bare = _bare(model)
    if mtp.depth(bare):
        with mtp.training_targets(bare, targets):
            return logits(_call(model, inputs))
    return _cross_entropy(model, inputs, targets, "sum")


def _objective(model: Any) -> Any:
    """The objective installed on the model the engine trains (``shardyard.objectives.install``), or None (``lm``)."""
    return getattr(_bare(model), "__dict__", {}).get("shardyard_objective")


def _cross_entropy(model: torch.nn.Module, inputs: Any, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    bare = _bare(model)
    if has_chunked_loss(model):  # the head returns the summed cross-entropy (apply_chunked_loss)
        head = bare.get_output_embeddings()
        head.shardyard_targets = targets
        try:
            total = logits(_call(model, inputs))
        finally:
            head.shardyard_targets = None
        return total if reduction == "sum" else total / (targets != -100).sum()
    out = logits(_call(model, inputs))
    return F.cross_entropy(out.float().reshape(-1, out.size(-1)), targets.reshape(-1), ignore_index=-100,
                           reduction=reduction)


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    return model(**packed_kwargs(model, inputs)) if isinstance(inputs, dict) else model(inputs)


def packed_kwargs(model: Any, inputs: dict) -> dict:
    """Keep packed conversations apart. Positions restart at 0 at every conversation; FlashAttention-2 reads
    those restarts as varlen boundaries, sdpa and eager get them as a block-diagonal causal mask (a token
    attends to the earlier tokens of its own conversation only). transformers does not build that mask from
    ``position_ids`` for sdpa/eager (measured: logits of a packed row then differ from each conversation run
    alone by 0.28), so it is built here: boolean for sdpa, additive for eager."""
    impl = attn_implementation(model)
    if impl == "flash_attention_2" or "attention_mask" in inputs or SEQUENCE_SHARDS in inputs:
        return inputs
    pos = inputs["position_ids"]
    segment = (pos == 0).cumsum(-1)
    L = pos.size(-1)
    causal = torch.ones(L, L, dtype=torch.bool, device=pos.device).tril()
    mask = ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]
    if impl == "eager":
        mask = torch.zeros(mask.shape, device=pos.device).masked_fill(~mask, torch.finfo(torch.float32).min)
    return {**inputs, "attention_mask": mask}
