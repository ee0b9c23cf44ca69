"""What a training step optimises: the ``objective`` group.

``objective=lm`` (the default: next-token cross-entropy, with DeepSeek-V3's multi-token depths when the model has
them), ``objective=dpo`` (preference tuning on ``data=preference``) or ``objective=grpo`` (reinforcement learning
with verifiable rewards on ``data=prompts``). Each option's ``_target_`` is a class meeting ``Objective``; a user's
own plugs in the same way (``objective._target_=mypkg.MyObjective``).

The engines never see which objective runs. An objective other than ``lm`` is installed on the model the engine
trains (``install``) and ``model.causal_lm_loss_sum`` / ``causal_lm_loss`` hand the forward to it, as multi-token
prediction's state is installed (``shardyard.models.mtp``): so DDP's, FSDP's, DeepSpeed's and Horovod's own
forward/backward, gradient sync, accumulation and loss scaling run unchanged, and the loop's token weighting
(docs/architecture.md, "Token-weighted loss") makes every objective's step loss exact over micro-batches and ranks:
an objective states what its loss averages over (``counts``: label tokens, preference pairs, completion tokens or
completions) and returns the sum (``loss_sum``).

May import: ``backends``, ``evaluation`` and everything below them (``models``, ``data``, ``monitors``, ``config``,
``core``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
from omegaconf import DictConfig

from shardyard.backends import Backend
from shardyard.core.errors import UserError


@dataclass
class Setup:
    """What an objective may use when the run starts (``Objective.setup``), after the engine has built the policy."""

    backend: Backend
    build: Callable[..., torch.nn.Module]
    """The worker's model builder, the one the engine's ``prepare`` used: ``Backend.reference_model(build)``."""
    cfg: DictConfig
    """The whole run config (an objective reads ``seed``, ``train`` and its own section)."""
    tokenizer_dir: str
    train_rows: Any
    """The training split's rows (``data.open_train``)."""
    val_rows: dict
    """Every source's held-out rows, by name (``data.open_val``)."""
    shards: Any = None
    """``backend.sp`` / ``backend.cp``: this rank's sequence group (``backends.sequence_parallel.Shards``), for an
    objective that splits its own sequences (``splits_sequences``); None without."""


class Objective(Protocol):
    """A training objective. The loop calls, per step: ``micro_batches``, ``counts`` of each, ``factors``; the
    engine's forward/backward calls ``loss_sum`` (through ``model.causal_lm_loss_sum``, once ``install``-ed); at
    log steps ``train_metrics``; at evaluations ``evaluate``; the checkpointer ``save`` / ``load``."""

    name: str
    """The option's name, in logs (``objective.name``)."""
    loss_falls: bool
    """Whether a train loss that does not fall means the run is not learning (``loop.Health``'s warnings)."""
    data_kind: str
    """The rows it trains on, as the data option states them (its source's ``kind``; ``text`` when it states
    none): ``text`` (token windows or SFT rows), ``preference`` (``data=preference``), ``prompts``."""
    splits_sequences: bool
    """(Optional, False when absent.) Under ``backend.sp`` / ``backend.cp`` the objective cuts its own sequences into
    the rank's share (``Setup.shards``, with ``sequence_parallel.shard``): its stream hands it whole rows, and the
    sequences a group's ranks read are the same (DPO's pairs, GRPO's rollouts). Without it the stream hands each
    rank its share of every row (``sequence_parallel.ShardedStream``: ``objective=lm``); validation refuses the
    split for an objective other than ``lm`` that does not state it."""

    def setup(self, s: Setup) -> None:
        """Once, after the engine has prepared the policy: reference model, rewards, tokenizer; checks the data."""

    def terms(self) -> int:
        """Loss terms per step (the main one, plus MTP depths for ``lm``)."""

    def micro_batches(self, step: int, accum: int, stream: Any, backend: Backend) -> list[tuple[Any, torch.Tensor]]:
        """This rank's ``accum`` micro-batches ``(inputs, targets)`` of step ``step`` (counted from 0), on the
        device: the stream's rows, or (GRPO) the rollouts generated from them."""

    def counts(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """What each loss term of this micro-batch averages over (``[terms]``, int64 or float64): the loop
        all-reduces the step's sum before the first backward."""

    def factors(self, step: int) -> torch.Tensor:
        """Each term's factor at step ``step`` (counted from 1), on the device."""

    def loss_sum(self, model: Any, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss terms summed over their units (fp32; 0-d for one term); ``model``: the module
        the engine trains (its wrapper included)."""

    def eval_loss(self, model: Any, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of a held-out micro-batch (``Backend.eval_loss``)."""

    def train_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The objective's own metrics since the last log step (``reduce``: the mean over ranks), then reset."""

    def evaluate(self, backend: Backend, val: dict, batches: int, micro_batch: int) -> Optional[dict[str, float]]:
        """The evaluation's metrics, ``eval/loss`` among them (lower is better: early stopping and sweeps read
        it), or None for the loop's own held-out loss (``loop.evaluate``)."""

    def save(self, path: str, rank: int, step: int) -> None:
        """Write this rank's state into the checkpoint of ``step`` steps being saved at ``path`` (GRPO: the batch of
        rollouts in use)."""

    def load(self, path: str, rank: int, same_world: bool) -> None:
        """Read it back when resuming from ``path``."""


def build(cfg: DictConfig) -> Objective:
    """The objective ``objective._target_`` names, with the option's other keys (``name`` included) as arguments."""
    from inspect import signature

    from hydra.utils import get_object
    from omegaconf import OmegaConf

    o = cfg.objective
    try:
        cls = get_object(o._target_)
    except Exception as e:
        raise UserError("objective._target_", o._target_, f"It cannot be imported ({type(e).__name__}: {e}).",
                        "Use objective=lm, dpo or grpo, or a class meeting shardyard.objectives.Objective.") from None
    keys = OmegaConf.to_container(o, resolve=True)
    assert isinstance(keys, dict)
    kwargs = {str(k): v for k, v in keys.items() if k != "_target_"}
    try:
        params = signature(cls).parameters
    except (TypeError, ValueError):  # no signature to read: the call itself judges
        return cls(**kwargs)
    named = [p for p in params if params[p].kind in (params[p].POSITIONAL_OR_KEYWORD, params[p].KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for k in kwargs:
            if k not in named:
                raise UserError(f"objective.{k}", kwargs[k], f"{o._target_} takes no such key (its keys: "
                                f"{', '.join(named) or 'none'}).",
                                "Remove it, or spell one of those (a user objective: add it to its constructor).")
    try:
        signature(cls).bind(**kwargs)
    except TypeError as e:  # a required argument no key gives
        raise UserError("objective", o._target_, f"Its constructor cannot be called with the option's keys ({e}).",
                        "Give every argument it needs (a user objective: in its option's YAML).") from None
    return cls(**kwargs)


def _stated(o: DictConfig, what: str) -> Any:
    """A plan figure the objective class states as a static method (``sequences``, ``held``), or None."""
    from hydra.utils import get_object

    try:
        return getattr(get_object(o._target_), what, None)
    except Exception:
        return None  # validation names a target that does not import (objectives.build)


def sequences(o: DictConfig, seq_len: int) -> tuple[int, int]:
    """What the plan counts per sample of the batch under objective ``o``: (sequences, tokens of each). An
    objective class states it as ``sequences(o, seq_len)`` (DPO: a chosen and a rejected row; GRPO: G prompt +
    completion rows); otherwise one row of ``seq_len``."""
    of = _stated(o, "sequences")
    return of(o, seq_len) if of is not None else (1, seq_len)


def splits_sequences(o: DictConfig) -> bool:
    """Whether objective ``o``'s class cuts its own sequences under ``backend.sp`` / ``backend.cp``
    (``Objective.splits_sequences``)."""
    return bool(_stated(o, "splits_sequences"))


def held(o: DictConfig) -> tuple[bool, float]:
    """What else the plan counts under objective ``o``, as its class states it (``held(o)``): whether a frozen
    reference model is held beside the policy (without adapters), and the bytes per token of a step's micro-batches
    kept from one step to the next (GRPO's rollouts)."""
    of = _stated(o, "held")
    return of(o) if of is not None else (False, 0.0)


def install(model: torch.nn.Module, objective: Objective) -> None:
    """Make ``model.causal_lm_loss_sum`` and ``causal_lm_loss`` of ``model`` (the engine's ``hf_model()``) hand
    the forward to ``objective``; not an attribute PyTorch sees (no submodule, no state)."""
    object.__setattr__(model, "shardyard_objective", objective)


def to_device(x: Any, device: torch.device) -> Any:
    """A batch's inputs on ``device``: token ids, or the model's keyword arguments (``data=sft``: ids and positions)."""
    if isinstance(x, dict):
        return {k: v.to(device, non_blocking=True) for k, v in x.items()}
    return x.to(device, non_blocking=True)


def pairs(inputs: Any, targets: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """A preference micro-batch (``[mb, 2, L]``: chosen, rejected) as ``2 mb`` rows, chosen rows first."""
    def flat(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, 0], t[:, 1]])

    return {k: flat(v) for k, v in inputs.items()}, flat(targets)
