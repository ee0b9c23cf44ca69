"""The post-training losses (``shardyard.objectives.losses``, issue 44) against TRL 1.16's own code on the same
log-probabilities, within 1e-6 (computed in fp64 on both sides, so the formulas are compared, not roundings; the
last test runs the fp32 path production uses): DPO's sigmoid (with conservative-DPO label smoothing), IPO and hinge
losses and rewards; GRPO's advantages (group / batch / none scaling), per-token clipped surrogate, k3 KL and clip
flags (symmetric and DAPO's asymmetric clip, with and without KL, with and without TRL's default
``use_bias_correction_kl``); both aggregations, whole and split over micro-batches; ``token_logps`` (at a
temperature too); and ``GRPO.loss_sum`` on a tiny model at temperature 0.7 against TRL's loss on the same model,
loss and gradient (issue 53: log-probs of the sampling distribution).

TRL is called, not re-typed: ``DPOTrainer._compute_loss``, ``GRPOTrainer._compute_loss`` and
``GRPOTrainer._generate_and_score_completions`` run as plain functions on a namespace that carries the attributes
they read (``_trl_*`` below). The model behind them is replaced by the given log-probabilities (the DPO stub model
returns them as ``outputs.log_probs``; GRPO's ``_get_per_token_logps_and_entropies`` returns them; its generation
and reward calls return fixed completions and rewards), so both sides compute from identical numbers; in the
model test TRL's own fused LM head (``add_fused_lm_head`` at the temperature) computes its log-probs.
"""

import contextlib
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import selective_log_softmax

from shardyard.objectives.losses import aggregate, dpo_loss, group_advantages, grpo_per_token, token_logps

TOL = 1e-6


def _close(ours, theirs, tol=TOL):
    ours, theirs = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert torch.allclose(ours, theirs, rtol=0, atol=tol), (ours - theirs).abs().max().item()


# --------------------------------------------------------------------------------------------------- DPO


def _pairs(b: int = 8, length: int = 10, seed: int = 0):
    """``b`` preference pairs: a response mask ``[2b, length]`` (chosen rows first, each a prompt of 1..3 tokens,
    a response of 1..length-4 tokens, padding), the policy's per-token log-probs on the shifted positions
    ``[2b, length - 1]`` (0 off the response), and the reference's summed log-probs ``[b]`` per side."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * b, length, dtype=torch.long)
    for i in range(2 * b):
        start = int(torch.randint(1, 4, (1,), generator=g))
        n = int(torch.randint(1, length - 4, (1,), generator=g))
        mask[i, start:start + n] = 1
    shifted = mask[:, 1:]
    per_token = -torch.rand(2 * b, length - 1, generator=g, dtype=torch.float64) * 3 * shifted
    sums = per_token.sum(1)
    # The reference differs from the policy by a few nats per sequence, both ways: beta d spans both signs.
    ref = sums + torch.randn(2 * b, generator=g, dtype=torch.float64) * 8
    return mask, per_token, ref[:b], ref[b:]


class _StubModel:
    """What ``DPOTrainer._compute_loss`` reads from the policy's output: the given per-token log-probs."""

    training = True

    def __init__(self, per_token: torch.Tensor):
        self.per_token = per_token

    def __call__(self, **kwargs):
        lp = self.per_token
        return SimpleNamespace(log_probs=lp, entropy=torch.zeros_like(lp), mean_logits=torch.zeros_like(lp),
                               is_top1=torch.zeros_like(lp, dtype=torch.bool))


def _trl_dpo(loss_type: str, beta: float, label_smoothing: float, mask, per_token, ref_c, ref_r):
    """TRL's ``DPOTrainer._compute_loss`` (reference log-probs precomputed): the mean loss over the pairs and its
    logged metrics (``rewards/chosen`` ...: means over the pairs)."""
    model = _StubModel(per_token)
    trainer = SimpleNamespace(
        model=model, accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t,
                                                 gather_for_metrics=lambda t: t),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing, use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1, args=SimpleNamespace())
    inputs = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return loss, {k: v[0] for k, v in trainer._metrics["train"].items()}


def _ours_dpo(loss_type: str, beta: float, label_smoothing: float, mask, per_token, ref_c, ref_r):
    """Ours, as objectives/dpo.py calls it: sequence log-probs summed over the response (IPO: their mean)."""
    lp, b = per_token.sum(1), ref_c.shape[0]
    ref = torch.cat([ref_c, ref_r])
    if loss_type == "ipo":
        n = mask[:, 1:].sum(1).clamp(min=1)
        lp, ref = lp / n, ref / n
    return dpo_loss(lp[:b], lp[b:], ref[:b], ref[b:], beta, loss_type, label_smoothing)


def _one_pair(i: int, b: int, mask, per_token, ref_c, ref_r):
    rows = [i, b + i]
    return mask[rows], per_token[rows], ref_c[i:i + 1], ref_r[i:i + 1]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_losses_and_rewards_equal_trl(loss_type, beta):
    data = _pairs()
    b = data[2].shape[0]
    losses, chosen, rejected = _ours_dpo(loss_type, beta, 0.0, *data)
    if loss_type == "ipo":  # given mean log-probs, the rewards are per token; TRL logs them on the sums
        n = data[0][:, 1:].sum(1)
        chosen, rejected = chosen * n[:b], rejected * n[b:]
    trl_loss, trl_metrics = _trl_dpo(loss_type, beta, 0.0, *data)
    _close(losses.mean(), trl_loss)
    _close(chosen.mean(), trl_metrics["rewards/chosen"])
    _close(rejected.mean(), trl_metrics["rewards/rejected"])
    _close((chosen > rejected).double().mean(), trl_metrics["rewards/accuracies"])
    # Pair by pair (TRL logs only means): each loss and reward.
    for i in range(b):
        pair = _one_pair(i, b, *data)
        trl_loss, trl_metrics = _trl_dpo(loss_type, beta, 0.0, *pair)
        _close(losses[i], trl_loss)
        _close(chosen[i], trl_metrics["rewards/chosen"])
        _close(rejected[i], trl_metrics["rewards/rejected"])
    if loss_type == "hinge":  # both sides of the hinge are exercised
        assert (losses == 0).any() and (losses > 0).any()
    assert ((chosen > rejected).any() and (chosen < rejected).any())


@pytest.mark.parametrize("label_smoothing", [0.1, 0.3])
def test_dpo_label_smoothing_is_conservative_dpo_as_trl(label_smoothing):
    """``sigmoid`` with ``label_smoothing`` e: ``-(1-e) log s(beta d) - e log s(-beta d)``. TRL 1.16's ``sigmoid``
    ignores ``label_smoothing``; the same formula is its ``aot`` loss on one pair (sorting one value is a no-op)."""
    data = _pairs(seed=1)
    b = data[2].shape[0]
    losses, chosen, rejected = _ours_dpo("sigmoid", 0.2, label_smoothing, *data)
    plain, _, _ = _ours_dpo("sigmoid", 0.2, 0.0, *data)
    assert (losses - plain).abs().min() > 1e-3  # the smoothing is felt on every pair
    for i in range(b):
        trl_loss, trl_metrics = _trl_dpo("aot", 0.2, label_smoothing, *_one_pair(i, b, *data))
        _close(losses[i], trl_loss)
        _close(chosen[i], trl_metrics["rewards/chosen"])


def test_dpo_is_fp32_and_rewards_carry_no_gradient():
    pc = torch.tensor([-3.0, -5.0], dtype=torch.bfloat16, requires_grad=True)
    pr = torch.tensor([-4.0, -2.0], dtype=torch.bfloat16, requires_grad=True)
    ref = torch.tensor([-3.5, -3.5], dtype=torch.bfloat16)
    losses, chosen, rejected = dpo_loss(pc, pr, ref, ref, 0.1)
    assert losses.dtype == chosen.dtype == torch.float32
    assert losses.requires_grad and not chosen.requires_grad and not rejected.requires_grad
    _close(losses[0], -F.logsigmoid(torch.tensor(0.1 * (0.5 - -0.5))))


# --------------------------------------------------------------------------------------------------- GRPO


RATIOS = [0.5, 0.75, 0.85, 0.95, 1.0, 1.1, 1.25, 1.5, 3.0]
"""Policy / rollout-policy probability ratios spread over the tokens: inside the clip range, between a symmetric
0.2 and DAPO's 0.28 upper bound (1.25), and far outside on both sides."""


def _rollouts(seed: int = 0, groups: int = 2, g_size: int = 4, length: int = 7):
    """``groups x g_size`` completions: per-token log-probs of the policy, the rollout policy and the reference,
    advantages of both signs (and 0), and right-padded completion masks (lengths 1..length)."""
    gen = torch.Generator().manual_seed(seed)
    b = groups * g_size
    logps = -torch.rand(b, length, generator=gen, dtype=torch.float64) * 4 - 0.05
    ratio = torch.tensor(RATIOS, dtype=torch.float64)[torch.randint(0, len(RATIOS), (b, length), generator=gen)]
    old = logps - torch.log(ratio)
    ref = logps + torch.randn(b, length, generator=gen, dtype=torch.float64) * 0.5
    lengths = torch.randint(1, length + 1, (b,), generator=gen)
    lengths[0], lengths[-1] = 1, length
    mask = (torch.arange(length) < lengths[:, None]).long()
    rewards = torch.randint(0, 3, (b,), generator=gen).double()
    advantages = group_advantages(rewards, g_size)
    advantages[1] = 0.0
    return logps, old, ref, advantages, mask


def _trl_grpo(loss_type: str, logps, old, ref, advantages, mask, eps_low: float, eps_high: float, beta: float,
              num_items=None, accumulation: int = 1, bias_correction_kl: bool = True):
    """TRL's ``GRPOTrainer._compute_loss`` with its log-prob method returning ``logps``: the loss and the logged
    metrics. ``num_items``: the generation batch's completion tokens (``dapo``'s normaliser); ``accumulation``:
    micro-batches per step (and per generation, TRL's default ``steps_per_generation``); ``bias_correction_kl``:
    TRL's ``use_bias_correction_kl`` (its default True)."""
    b, t = logps.shape
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=eps_low,
        epsilon_high=eps_high, use_vllm=False, _entropy_bonus_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=bias_correction_kl, delta=None, steps_per_generation=accumulation),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=accumulation,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x),
        _metrics=defaultdict(lambda: defaultdict(list)))
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old,
              "num_items_in_batch": torch.tensor(float(mask.sum() if num_items is None else num_items))}
    if beta != 0.0:
        inputs["ref_per_token_logps"] = ref
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, {k: v[0] for k, v in trainer._metrics["train"].items()}


CLIPS = [(0.2, 0.2, 0.0), (0.2, 0.28, 0.0), (0.2, 0.2, 0.04), (0.1, 0.3, 0.1)]
"""(epsilon_low, epsilon_high, beta): symmetric, DAPO's clip-higher, each with and without the KL term."""


@pytest.mark.parametrize("eps_low, eps_high, beta", CLIPS)
def test_grpo_per_token_loss_kl_and_clip_flags_equal_trl(eps_low, eps_high, beta):
    """Token by token: TRL on each single (completion, token) gives that token's loss (``bnpo`` over one token),
    its KL (the ``kl`` metric) and its clip flags (the ``clip_ratio/*_mean`` metrics)."""
    logps, old, ref, adv, mask = _rollouts()
    out = grpo_per_token(logps, old, ref, adv, mask, eps_low, eps_high, beta, bias_correction_kl=True)
    b, t = logps.shape
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                assert out.loss[i, j] == 0 and out.kl[i, j] == 0 and not out.region_clipped[i, j]
                continue
            cell = (slice(i, i + 1), slice(j, j + 1))
            loss, metrics = _trl_grpo("bnpo", logps[cell], old[cell], ref[cell], adv[i:i + 1], mask[cell],
                                      eps_low, eps_high, beta)
            _close(out.loss[i, j], loss)
            _close(out.low_clipped[i, j].float(), metrics["clip_ratio/low_mean"])
            _close(out.high_clipped[i, j].float(), metrics["clip_ratio/high_mean"])
            _close(out.region_clipped[i, j].float(), metrics["clip_ratio/region_mean"])
            if beta != 0.0:
                _close(out.kl[i, j], metrics["kl"])
    # Every case the formula distinguishes occurs: clipped below and above, and inside the range.
    on = mask.bool()
    assert out.low_clipped.any() and out.high_clipped.any() and (on & ~out.region_clipped).any()
    if eps_high == 0.28:  # ratios in (1.2, 1.28] with a positive advantage: clipped only by a symmetric 0.2
        symmetric = grpo_per_token(logps, old, ref, adv, mask, 0.2, 0.2, beta, bias_correction_kl=True)
        assert (symmetric.high_clipped & ~out.high_clipped).any()


def test_grpo_kl_is_k3_and_zero_without_reference():
    logps, old, ref, adv, mask = _rollouts(seed=3)
    out = grpo_per_token(logps, old, ref, adv, mask, 0.2, 0.2, 0.0, bias_correction_kl=False)
    d = (ref - logps).double()
    _close(out.kl, ((d.exp() - d - 1) * mask).float())
    assert (out.kl[mask.bool()] > 0).all()
    # DeepSeek-V3.2's bias correction (TRL's default): the k3 estimate times the ratio to the sampling policy
    corrected = grpo_per_token(logps, old, ref, adv, mask, 0.2, 0.2, 0.0, bias_correction_kl=True)
    _close(corrected.kl, ((d.exp() - d - 1) * (logps - old).exp() * mask).float())
    no_ref = grpo_per_token(logps, old, None, adv, mask, 0.2, 0.2, 0.0, bias_correction_kl=True)
    assert (no_ref.kl == 0).all()
    _close(no_ref.loss, out.loss)  # beta 0: the KL is a metric only
    with pytest.raises(ValueError, match="reference"):
        grpo_per_token(logps, old, None, adv, mask, 0.2, 0.2, 0.04, bias_correction_kl=True)


@pytest.mark.parametrize("eps_low, eps_high, beta", CLIPS)
@pytest.mark.parametrize("how, trl_types", [("sequence", ["grpo"]), ("token", ["bnpo", "dapo"])])
@pytest.mark.parametrize("bias", [True, False])
def test_grpo_aggregated_loss_and_metrics_equal_trl(eps_low, eps_high, beta, how, trl_types, bias):
    logps, old, ref, adv, mask = _rollouts(seed=1)
    out = grpo_per_token(logps, old, ref, adv, mask, eps_low, eps_high, beta, bias_correction_kl=bias)
    loss_sum, units = aggregate(out.loss, mask, how)
    on = mask.bool()
    for trl_type in trl_types:
        trl_loss, metrics = _trl_grpo(trl_type, logps, old, ref, adv, mask, eps_low, eps_high, beta,
                                      bias_correction_kl=bias)
        _close(loss_sum / units, trl_loss)
        _close(out.region_clipped[on].float().mean(), metrics["clip_ratio/region_mean"])
        if beta != 0.0:
            _close(out.kl[on].mean(), metrics["kl"])
    assert units == (mask.sum() if how == "token" else mask.shape[0])


def test_grpo_first_step_ratio_one_and_gradient_through_policy_only():
    """On a batch's first optimisation step old == new: the loss is -A per token, its gradient A d log pi
    (the policy-gradient form), and nothing flows into the old or reference log-probs."""
    logps, _, ref, adv, mask = _rollouts(seed=4)
    logps = logps.clone().requires_grad_(True)
    old = logps.detach().clone().requires_grad_(True)
    out = grpo_per_token(logps, old, ref, adv, mask, 0.2, 0.2, 0.0, bias_correction_kl=True)
    _close(out.loss, (-adv[:, None] * mask).float())
    loss_sum, units = aggregate(out.loss, mask, "token")
    (loss_sum / units).backward()
    _close(logps.grad, -adv[:, None] * mask / mask.sum())
    assert old.grad is None


@pytest.mark.parametrize("how", ["token", "sequence"])
def test_aggregation_splits_over_micro_batches_exactly(how):
    """(sum of loss_sum) / (sum of units) over micro-batches of unequal sizes and lengths is the whole batch's
    value; for ``token`` it is also TRL's ``dapo`` accumulated over the same micro-batches (its normaliser is the
    generation batch's token count)."""
    logps, old, ref, adv, mask = _rollouts(seed=2, groups=3, g_size=3)
    whole = aggregate(grpo_per_token(logps, old, ref, adv, mask, 0.2, 0.28, 0.04, bias_correction_kl=True).loss,
                      mask, how)
    parts = [slice(0, 2), slice(2, 7), slice(7, 9)]
    total_sum, total_units, trl_total = 0.0, 0.0, 0.0
    for s in parts:
        out = grpo_per_token(logps[s], old[s], ref[s], adv[s], mask[s], 0.2, 0.28, 0.04, bias_correction_kl=True)
        part_sum, part_units = aggregate(out.loss, mask[s], how)
        total_sum, total_units = total_sum + part_sum, total_units + part_units
        trl_loss, _ = _trl_grpo("dapo", logps[s], old[s], ref[s], adv[s], mask[s], 0.2, 0.28, 0.04,
                                num_items=int(mask.sum()), accumulation=len(parts))
        trl_total = trl_total + trl_loss
    _close(total_sum / total_units, whole[0] / whole[1])
    if how == "token":
        _close(total_sum / total_units, trl_total)
    else:
        _close(total_sum / total_units, _trl_grpo("grpo", logps, old, ref, adv, mask, 0.2, 0.28, 0.04)[0])


def test_sequence_aggregation_weighs_completions_token_aggregation_weighs_tokens():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    s, u = aggregate(per_token, mask, "sequence")
    assert (s.item(), u.item()) == (4.0, 2.0)  # (1 + 3) / 2 completions
    s, u = aggregate(per_token, mask, "token")
    assert (s.item(), u.item()) == (7.0, 5.0)  # (4 + 3) / 5 tokens
    s, u = aggregate(per_token, torch.zeros_like(mask), "sequence")
    assert (s.item(), u.item()) == (0.0, 2.0)  # rows with no token count, as TRL's clamp(min=1)


# --------------------------------------------------------------------------------------------------- advantages


def _trl_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, g_size: int, scale: str):
    """TRL's ``GRPOTrainer._generate_and_score_completions`` on fixed completions and rewards: its advantages."""
    n = rewards_per_func.shape[0]
    logs = {"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
            "extra": defaultdict(list), "images": []}
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1,
                                    gather=lambda x: x),
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False), environment_factories=None,
        tools=None, environments=None, _tokenizer=SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None,
        mask_truncated_completions=False, num_iterations=1, use_vllm=False, beta=0.0, log_multimodal=False,
        args=SimpleNamespace(per_device_train_batch_size=n, gradient_checkpointing_kwargs=None,
                             steps_per_generation=1, gradient_accumulation_steps=1),
        _generate=lambda prompts: ([[1, 2]] * n, [[3, 4, 5]] * n, None, ["c"] * n, None, {}, None, []),
        _calculate_rewards=lambda *a: rewards_per_func, num_generations=g_size,
        multi_objective_aggregation="sum_then_normalize", reward_weights=weights, scale_rewards=scale,
        reward_func_names=[f"r{i}" for i in range(rewards_per_func.shape[1])],
        _metrics=defaultdict(lambda: defaultdict(list)), _logs=logs, _pending_extra_logs={}, _pending_metrics={})
    out = GRPOTrainer._generate_and_score_completions(trainer, [{"prompt": "p"}] * n)
    return out["advantages"]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trl(scale):
    """Two reward functions with weights (the caller passes their weighted sum), four groups of four, one group
    whose rewards are all equal (advantage 0: no signal), one with a single outlier."""
    per_func = torch.tensor([[1, 0], [0, 1], [1, 1], [0, 0],
                             [1, 1], [1, 1], [1, 1], [1, 1],
                             [0, 0], [0, 0], [0, 0], [1, 0],
                             [0, 1], [1, 0], [1, 1], [0, 1]], dtype=torch.float64)
    weights = torch.tensor([1.0, 0.25], dtype=torch.float64)
    ours = group_advantages((per_func * weights).sum(1), 4, scale)
    _close(ours, _trl_advantages(per_func, weights, 4, scale))
    assert (ours[4:8] == 0).all() and (ours != 0).any()


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0])
    std = math.sqrt(0.25)  # group 1: mean 0.25, Bessel-corrected std 0.5 over 4
    _close(group_advantages(r[:4], 4, "group"), torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-4))
    _close(group_advantages(r[:4], 2, "none"), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    _close(group_advantages(r[4:], 2, "group"), torch.zeros(2))
    with pytest.raises(ValueError):
        group_advantages(r, 4)


# --------------------------------------------------------------------------------------------------- token_logps


def test_token_logps_equal_trl_and_brute_force_zero_where_ignored():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    targets = torch.randint(0, 11, (3, 5), generator=g)
    targets[0, :2] = -100
    targets[2, 3:] = -100
    ours = token_logps(logits, targets)
    safe = targets.clamp(min=0)
    brute = torch.log_softmax(logits.double(), -1).gather(-1, safe[..., None])[..., 0] * (targets != -100)
    _close(ours, brute)
    trl = selective_log_softmax(logits, safe) * (targets != -100)
    _close(ours, trl)
    assert ours.dtype == torch.float32 and (ours[targets == -100] == 0).all()
    half = token_logps(logits.bfloat16(), targets)  # upcast: the same as fp32 math on the bf16 values
    assert half.dtype == torch.float32
    _close(half, token_logps(logits.bfloat16().float(), targets))
    # at a temperature: the log-probs of logits / T, from fp32 and bf16 logits (the latter divided in place on the
    # upcast copy, leaving the caller's logits as they were)
    for t in (0.7, 1.5):
        brute_t = torch.log_softmax(logits.double() / t, -1).gather(-1, safe[..., None])[..., 0] * (targets != -100)
        _close(token_logps(logits.double(), targets, t), brute_t)  # fp64 stays fp64: the formula, to 1e-6
        _close(token_logps(logits, targets, t), brute_t, 1e-5)  # fp32: values up to ~30, rounded at ~2e-6
        kept = logits.bfloat16()
        copy = kept.clone()
        _close(token_logps(kept, targets, t), token_logps(kept.float(), targets, t))
        assert torch.equal(kept, copy)


# ------------------------------------------------------------------------------ GRPO on a model, at temperature T


def _tiny_lm(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
    return LlamaForCausalLM(cfg).double()


def _trl_logps(trainer, model, ids, attn, completion_len: int, **kwargs):
    """TRL's ``GRPOTrainer._get_per_token_logps_and_entropies`` itself (under its profiling decorator): the
    completion's log-probs from the model's fused LM head (``add_fused_lm_head``: at the model's temperature)."""
    return GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__(trainer, model, ids, attn, completion_len,
                                                                        **kwargs)


def _trl_on_model(policy, ref, inputs: dict, loss_type: str, beta: float, bias: bool):
    """TRL's own ``_compute_loss`` on a model: its fused LM head (``add_fused_lm_head``, the logits divided by the
    temperature) computes the policy's log-probs, ``_get_per_token_logps_and_entropies`` the reference's. The loss
    (before backward) and the metrics."""
    from functools import partial

    trainer = SimpleNamespace(
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
        use_vllm=False, _entropy_bonus_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=bias, delta=None, steps_per_generation=1),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x,
                                    autocast=contextlib.nullcontext),
        _metrics=defaultdict(lambda: defaultdict(list)))
    trainer._get_per_token_logps_and_entropies = partial(_trl_logps, trainer)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    if beta != 0.0 and "ref_per_token_logps" not in inputs:
        with torch.no_grad():
            inputs["ref_per_token_logps"] = _trl_logps(trainer, ref, ids, attn, inputs["completion_ids"].size(1))[0]
    loss = GRPOTrainer._compute_loss(trainer, policy, inputs)
    return loss, {k: v[0] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("how, trl_type", [("token", "dapo"), ("sequence", "grpo")])
@pytest.mark.parametrize("bias", [True, False])
def test_grpo_on_a_model_at_temperature_equals_trl_loss_and_gradient(how, trl_type, bias):
    """``GRPO.loss_sum`` on a tiny LLaMA at T = 0.7 with beta = 0.04 against TRL's ``_compute_loss`` on a copy of
    the same model and the same sequences (TRL's fused LM head at ``temperature``, its reference log-probs by its own
    method): the loss, the KL and clip metrics and every parameter's gradient within 1e-6 (relative), on a round's
    first step (old = the policy's own log-probs) and on its second, after the policy moved (old = the log-probs of
    the policy that sampled, which must also be taken at T). Fails if the log-probs are of the raw logits (issue
    53: the loss differs by 5e-4 at the first step)."""
    from trl.trainer.utils import add_fused_lm_head

    from shardyard.objectives.grpo import GRPO

    T, beta, B, P, M = 0.7, 0.04, 6, 5, 7
    ours, ref = _tiny_lm(0), _tiny_lm(1)  # the reference: other weights, so the KL is not 0
    theirs, ref_theirs = _tiny_lm(0), _tiny_lm(1)
    for m in (theirs, ref_theirs):
        add_fused_lm_head(m, temperature=T, outputs=("log_probs", "entropy"))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 40, (B, P), generator=g)
    comp = torch.randint(0, 40, (B, M), generator=g)
    lengths = torch.tensor([1, 3, 7, 5, 7, 2])
    cmask = (torch.arange(M) < lengths[:, None]).long()
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.3], dtype=torch.float64)
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), cmask], 1)
    x = {"input_ids": torch.cat([prompt, comp], 1), "attention_mask": attn,
         "position_ids": (attn.cumsum(-1) - 1).clamp(min=0), "advantages": adv}
    targets = torch.where(cmask.bool(), comp, torch.full_like(comp, -100))
    objective = GRPO(rewards=[{"_target_": "shardyard.objectives.rewards.NumericAnswer"}], temperature=T, beta=beta,
                     epsilon=0.2, epsilon_high=0.28, loss_aggregation=how, use_bias_correction_kl=bias)
    objective.reference, objective.policy = ref, ours
    trl_inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones(B, P, dtype=torch.long), "completion_ids": comp,
                  "completion_mask": cmask, "advantages": adv, "num_items_in_batch": cmask.sum().double()}

    def close(a, b):  # relative 1e-6: ``loss_sum`` returns the loss in fp32 (the loop's dtype), so is its backward
        _close(a, b, TOL * max(1.0, float(torch.as_tensor(b).detach().abs().max())))

    def step():
        objective.loss_sums = torch.zeros(5, dtype=torch.float64)
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
        loss = objective.loss_sum(ours, x, targets) / objective.counts(x, targets)[0]
        loss.backward()
        trl_loss, metrics = _trl_on_model(theirs, ref_theirs, trl_inputs, trl_type, beta, bias)
        trl_loss.backward()
        close(loss, trl_loss)
        close(objective.loss_sums[0] / cmask.sum(), metrics["kl"])
        close(objective.loss_sums[3] / cmask.sum(), metrics["clip_ratio/region_mean"])
        theirs_grads = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            close(p.grad, theirs_grads[name].grad)
        return metrics

    step()  # the round's first step: old = the policy's own log-probs (at T), ratio 1
    assert "old_logps" in x and "ref_logps" in x
    # the sampling policy's log-probs, as TRL keeps them for a later step of the round: at T, before the update
    with torch.no_grad():
        ids_all = torch.cat([prompt, comp], 1)
        trl_inputs["old_per_token_logps"] = _trl_logps(
            SimpleNamespace(accelerator=SimpleNamespace(autocast=contextlib.nullcontext)), theirs, ids_all, attn, M)[0]
        for a, b in zip(ours.parameters(), theirs.parameters()):  # the same update on both copies
            noise = torch.randn(a.shape, generator=g, dtype=a.dtype) * 0.1
            a.add_(noise)
            b.add_(noise)
    metrics = step()  # the round's second step: old = the sampling policy's (stored in x), ratio != 1
    assert metrics["clip_ratio/region_mean"] > 0  # the clip is exercised


# --------------------------------------------------------------------------------------------------- fp32


def test_fp32_path_equals_trl_in_fp32():
    """What production runs: fp32 log-probs on both sides (the same values up to fp32 rounding, 1e-6 relative)."""
    def close32(ours, theirs):
        assert ours.dtype == torch.float32
        assert torch.allclose(ours.double(), torch.as_tensor(theirs).double(), rtol=1e-6, atol=1e-6)

    mask, per_token, ref_c, ref_r = _pairs(seed=5)
    data = (mask, per_token.float(), ref_c.float(), ref_r.float())
    for loss_type in ("sigmoid", "ipo", "hinge"):
        close32(_ours_dpo(loss_type, 0.1, 0.0, *data)[0].mean(), _trl_dpo(loss_type, 0.1, 0.0, *data)[0])
    logps, old, ref, adv, mask = (x.float() if x.is_floating_point() else x for x in _rollouts(seed=5))
    out = grpo_per_token(logps, old, ref, adv, mask, 0.2, 0.28, 0.04, bias_correction_kl=True)
    for how, trl_type in (("sequence", "grpo"), ("token", "dapo")):
        loss_sum, units = aggregate(out.loss, mask, how)
        close32(loss_sum / units, _trl_grpo(trl_type, logps, old, ref, adv, mask, 0.2, 0.28, 0.04)[0])
    per_func = torch.tensor([[0.0], [1.0], [1.0], [0.0], [1.0], [0.0], [0.0], [0.0]])
    for scale in ("group", "batch", "none"):
        close32(group_advantages(per_func[:, 0], 4, scale), _trl_advantages(per_func, torch.ones(1), 4, scale))
