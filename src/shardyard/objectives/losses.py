"""The post-training loss math, pure torch on given log-probabilities (no model): DPO and its IPO and hinge
variants, GRPO's group-relative advantages, clipped surrogate and k3 KL, and the two loss aggregations.

Every formula is TRL 1.16's (``trl/trainer/dpo_trainer.py`` ``_compute_loss``, ``trl/trainer/grpo_trainer.py``
``_generate_and_score_completions`` and ``_compute_loss``, GRPO's log-probabilities at the sampling temperature as
its fused LM head computes them), and tests/unit/test_objective_losses.py runs TRL's own code on the same
log-probabilities (and, for GRPO, on the same model and sequences, loss and gradient) and asserts equality within
1e-6. The math runs in fp32 at least (bf16 and fp16 log-probabilities are upcast first; fp64 stays fp64, which the
tests use to compare formulas to 1e-12), so every engine computes the same numbers from the same inputs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

IGNORE = -100
"""A target that is not scored (the prompt, padding): its log-probability is 0."""

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")
ADVANTAGE_SCALES = ("group", "batch", "none")
AGGREGATIONS = ("token", "sequence")
ADVANTAGE_EPS = 1e-4
"""Added to the reward standard deviation before dividing (TRL's ``std_rewards + 1e-4``)."""


def _f32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or fp64 when it is (never lower)."""
    return x if x.dtype == torch.float64 else x.float()


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]``: ``log softmax(logits[b, t] / temperature)[targets[b, t]]`` in fp32 (at least), 0 where
    ``targets`` is ``IGNORE``.

    ``temperature``: the distribution the tokens were sampled from (GRPO's rollouts at ``objective.temperature``,
    as TRL's ``GRPOTrainer`` scores them: its fused LM head divides the logits by ``args.temperature``); 1 (DPO,
    SFT): the model's own. ``targets`` are already shifted (``targets[t]`` is the token after position ``t``, as
    ``sft.encode`` writes them). Computed as ``-cross_entropy(..., reduction="none")``: fp32 logits are used as they
    are, lower precisions are upcast once (and divided in place), and the only other ``[B, T, V]`` tensor is the one
    cross-entropy's own log-softmax needs (no ``log_softmax`` + ``gather`` copy besides it)."""
    b, t, v = logits.shape
    flat = logits.reshape(b * t, v)
    x = _f32(flat)
    if temperature != 1.0:  # in place on the upcast copy (its backward needs neither), else a new tensor
        x = x.div_(temperature) if x.data_ptr() != flat.data_ptr() else x / temperature
    nll = F.cross_entropy(x, targets.reshape(b * t), ignore_index=IGNORE, reduction="none")
    return -nll.view(b, t)


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each pair's loss ``[B]`` and the implicit rewards ``beta (log pi - log ref)`` of its chosen and rejected
    responses ``[B]`` (detached: metrics), from sequence log-probabilities ``[B]``.

    With ``d = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))`` and ``e = label_smoothing``:

    - ``sigmoid``: ``-(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d)``. ``e = 0`` is DPO (Rafailov et al.
      2023, eq. 7); ``e > 0`` is conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences", eq. 3),
      TRL's ``sigmoid`` up to 0.x. TRL 1.16's ``sigmoid`` no longer reads ``label_smoothing``; the same formula is
      its ``aot`` loss for one pair, which is what the test compares against when ``e > 0``.
    - ``ipo``: ``(d - 1 / (2 beta))^2`` (Azar et al. 2023, eq. 17, ``beta`` = tau). TRL divides each log-ratio by
      the response's token count first: the caller passes per-token MEAN log-probabilities for IPO (and the
      rewards returned are then per token too; TRL logs ``beta`` times the summed log-ratio).
    - ``hinge``: ``relu(1 - beta d)`` (SLiC, Zhao et al. 2023).

    ``label_smoothing`` is read by ``sigmoid`` only (as TRL). The step's loss is the mean over pairs (the caller
    sums ``losses`` and the loop divides by the pairs, docs/architecture.md "Token-weighted loss")."""
    pc, pr = _f32(policy_chosen_logps), _f32(policy_rejected_logps)
    rc, rr = _f32(ref_chosen_logps), _f32(ref_rejected_logps)
    chosen_logratios, rejected_logratios = pc - rc, pr - rr
    d = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * d) * (1 - label_smoothing) - F.logsigmoid(-beta * d) * label_smoothing
    elif loss_type == "ipo":
        losses = (d - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * d)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}: one of {DPO_LOSS_TYPES}")
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def _std(x: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The Bessel-corrected standard deviation (``n - 1``), TRL's ``nanstd`` without NaNs."""
    return x.std(dim=dim, unbiased=True) if dim is not None else x.std(unbiased=True)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """GRPO's advantages ``[N G]`` of the rewards ``[N G]`` (each prompt's ``G = group_size`` completions
    consecutive), in fp32 (at least): ``A_i = r_i - mean(r of i's group)``, divided by ``std + 1e-4`` where

    - ``group``: std = the standard deviation of i's group (Shao et al. 2024, DeepSeekMath, section 4.1.2);
    - ``batch``: std = the standard deviation of all ``N G`` rewards, the mean still per group (Liu et al. 2025,
      "Understanding R1-Zero-like training", as TRL's ``scale_rewards="batch"``);
    - ``none``: no division (Dr. GRPO).

    The standard deviations are Bessel-corrected (``n - 1``), as TRL's ``nanstd``. A group whose rewards are all
    equal gets advantages 0 (no learning signal). ``rewards`` are the weighted sums over the reward functions.
    The caller passes the whole generation batch (every rank's completions) when scaling by ``batch``, as TRL
    gathers the rewards before normalising."""
    r = _f32(rewards).reshape(-1)
    if group_size < 1 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not form groups of {group_size}")
    grouped = r.view(-1, group_size)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale == "none":
        return advantages
    if scale == "group":
        std = _std(grouped, dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(r)
    elif scale == "batch":
        std = _std(r).expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
    else:
        raise ValueError(f"unknown advantage scale {scale!r}: one of {ADVANTAGE_SCALES}")
    return advantages / (std + ADVANTAGE_EPS)


class GRPOTokens(NamedTuple):
    """``grpo_per_token``'s result, every field ``[B, T]`` and 0 (False) where the mask is 0."""

    loss: torch.Tensor
    """The per-token loss: clipped surrogate plus ``beta`` times the KL."""
    kl: torch.Tensor
    """The k3 estimate of KL(policy || reference) per token, times the ratio when ``bias_correction_kl`` (TRL's
    ``kl`` metric likewise); 0 everywhere when there is no reference."""
    low_clipped: torch.Tensor
    """``ratio < 1 - epsilon_low`` where the advantage is negative (TRL's ``clip_ratio/low``)."""
    high_clipped: torch.Tensor
    """``ratio > 1 + epsilon_high`` where the advantage is positive (TRL's ``clip_ratio/high``)."""
    region_clipped: torch.Tensor
    """Either (TRL's ``clip_ratio/region``): the tokens whose gradient the clip removes."""


def grpo_per_token(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: Optional[torch.Tensor],
                   advantages: torch.Tensor, mask: torch.Tensor, epsilon_low: float, epsilon_high: float,
                   beta: float, *, bias_correction_kl: bool) -> GRPOTokens:
    """GRPO's per-token loss (Shao et al. 2024, eq. 3; TRL's ``loss_type`` grpo/bnpo/dapo before aggregation):

    ``ratio = exp(logps - old_logps)``, ``A`` = the sequence's advantage (``advantages`` ``[B]``),
    ``loss = -min(ratio A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) A) + beta kl``,
    ``kl = exp(ref - logps) - (ref - logps) - 1`` (the k3 estimator, Schulman 2020; DeepSeekMath eq. 4), times
    ``ratio`` when ``bias_correction_kl`` (DeepSeek-V3.2, arXiv 2512.02556, eq. 7: the importance-weighted k3, whose
    gradient is the unbiased reverse-KL gradient; TRL's ``use_bias_correction_kl``, on by default). The ratio is
    differentiable, so the correction changes the KL's gradient even on a round's first step, where it is 1.

    ``epsilon_high != epsilon_low`` is DAPO's asymmetric "clip-higher" (Yu et al. 2025). ``old_logps`` are the
    rollout policy's (detached; equal to ``logps`` on the first optimisation step of a batch of rollouts, where
    the ratio is 1 and only its gradient counts). ``ref_logps`` None (or ``beta`` 0 with no reference): no KL
    term and ``kl`` is 0. The gradient flows through ``logps`` only. Everything in fp32 (at least), masked to 0."""
    lp = _f32(logps)
    m = mask.to(lp.dtype)
    a = _f32(advantages).reshape(-1, 1)
    ratio = torch.exp(lp - _f32(old_logps).detach())
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * a, clipped * a)
    if ref_logps is not None:
        delta = _f32(ref_logps).detach() - lp
        kl = torch.exp(delta) - delta - 1
        if bias_correction_kl:
            kl = kl * ratio
        if beta != 0.0:
            loss = loss + beta * kl
        kl = kl * m
    else:
        if beta != 0.0:
            raise ValueError("GRPO with beta != 0 needs the reference log-probabilities")
        kl = torch.zeros_like(lp)
    on = mask.bool()
    low = (ratio < 1 - epsilon_low) & (a < 0) & on
    high = (ratio > 1 + epsilon_high) & (a > 0) & on
    return GRPOTokens(loss * m, kl, low, high, low | high)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, lengths: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, units)``, both 0-d fp32 (at least): the step's loss is the sum of ``loss_sum`` over its
    micro-batches and ranks divided by the sum of ``units`` (docs/architecture.md "Token-weighted loss"), which
    splits exactly.

    - ``token``: ``loss_sum`` = the masked per-token loss summed, ``units`` = the masked tokens. Over a whole step
      this is TRL's ``dapo`` (and ``bnpo`` when the step is one batch): every completion token weighs the same
      (DAPO, Yu et al. 2025, "token-level policy gradient loss").
    - ``sequence``: ``loss_sum`` = each sequence's masked-token mean, summed; ``units`` = the sequences. This is
      TRL's ``grpo`` (the GRPO paper's ``1/G sum_i 1/|o_i| sum_t``): every completion weighs the same whatever its
      length. A row with no masked token adds 0 and still counts as a unit, as TRL's ``clamp(min=1)`` does.

    ``per_token`` is expected 0 where ``mask`` is 0 (``grpo_per_token`` makes it so); it is masked again here.
    ``lengths`` (``[B]``): each row's masked tokens when ``per_token`` holds a share of its positions (sequence
    parallelism: the ``sequence`` mean is then the share's part of the whole row's; ``token`` does not read it)."""
    x = _f32(per_token)
    m = mask.to(x.dtype)
    x = x * m
    if how == "token":
        return x.sum(), m.sum()
    if how == "sequence":
        per_sequence = x.sum(-1) / (m.sum(-1) if lengths is None else lengths.to(x.dtype)).clamp(min=1.0)
        return per_sequence.sum(), torch.tensor(float(x.shape[0]), dtype=x.dtype, device=x.device)
    raise ValueError(f"unknown aggregation {how!r}: one of {AGGREGATIONS}")
