"""``objective=dpo``: direct preference optimisation on ``data=preference`` pairs (Rafailov et al. 2023), with
the IPO (Azar et al. 2023) and hinge (SLiC) variants of the loss, as TRL's ``DPOTrainer`` computes them.

    python train.py objective=dpo data=preference model.weights=outputs/.../hf
    python train.py recipe=dpo_tiny

A step's loss is the mean over its preference pairs (every micro-batch and rank: ``counts`` is the pairs) of
``-log sigmoid(beta x ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))`` (sigmoid), each sequence's
log-probability summed over its response tokens (IPO: their mean, as TRL). The reference is the policy at its
starting weights, frozen: with LoRA/QLoRA the same model with its adapters disabled (no second copy); otherwise
``Backend.reference_model``, sharded as the engine shards the policy (FSDP its own ``fully_shard``, ZeRO-3
partitioned without an optimizer). Its forward runs under ``no_grad`` inside the engine's own autocast, so at step
0 the two agree bit for bit and the loss is log 2.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from shardyard import moe
from shardyard.adapters import is_peft
from shardyard.backends import Backend
from shardyard.errors import UserError
from shardyard.objectives import Setup, install, pairs, to_device
from shardyard.objectives.losses import dpo_loss, token_logps

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
"""Means over the pairs, named as TRL logs them (``train/`` or ``eval/`` before each)."""


class DPO:
    data_kind = "preference"
    """The rows it trains on (a data option's ``kind``), checked at validation."""
    loss_falls = True
    """The loop's warnings on a flat or oscillating train loss apply: the preference loss falls as the margins grow."""

    def __init__(self, name: str = "dpo", beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0):
        if not beta > 0:
            raise UserError("objective.beta", beta, "DPO's beta scales the log-ratio of policy and reference; it "
                            "must be above 0 (IPO divides by it).", "Use e.g. objective.beta=0.1.")
        if loss_type not in LOSS_TYPES:
            raise UserError("objective.loss_type", loss_type, "Unknown DPO loss.", f"Use one of {list(LOSS_TYPES)}.")
        if not 0 <= label_smoothing < 0.5:
            raise UserError("objective.label_smoothing", label_smoothing, "It is the assumed share of flipped "
                            "preference labels, in [0, 0.5).", "Use 0 (plain DPO) or e.g. 0.1.")
        self.name, self.beta, self.loss_type, self.label_smoothing = name, beta, loss_type, label_smoothing
        self.reference: Optional[torch.nn.Module] = None
        self.sums: dict[str, torch.Tensor] = {}

    @staticmethod
    def sequences(o: Any, seq_len: int) -> tuple[int, int]:
        """Per preference pair: the chosen and the rejected row (``objectives.sequences``)."""
        return 2, seq_len

    @staticmethod
    def held(o: Any) -> tuple[bool, float]:
        """A reference model, no rollouts (``objectives.held``)."""
        return True, 0.0

    def setup(self, s: Setup) -> None:
        hf = s.backend.hf_model()
        self.adapters = is_peft(hf)
        # LoRA/QLoRA: the reference is the policy with its adapters disabled; else a frozen copy placed as the policy.
        self.reference = None if self.adapters else s.backend.reference_model(s.build)
        self.policy: Any = hf  # a PeftModel when adapters train (disable_adapter)
        dev = s.backend.device
        self.sums = {"train": torch.zeros(len(METRICS) + 1, device=dev), "eval": torch.zeros(len(METRICS) + 1, device=dev)}
        self._one = torch.ones(1, device=dev)
        install(hf, self)

    def terms(self) -> int:
        return 1

    def micro_batches(self, step: int, accum: int, stream: Any, backend: Backend) -> list:
        dev = backend.device
        return [(to_device(x, dev), y.to(dev, non_blocking=True))
                for x, y in (stream.micro_batch(step, micro) for micro in range(accum))]

    def counts(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor([targets.shape[0]], dtype=torch.int64, device=targets.device)  # preference pairs

    def factors(self, step: int) -> torch.Tensor:
        return self._one

    def _logps(self, model: Any, inputs: dict, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's log-probability over its response tokens (IPO: their mean): chosen, rejected."""
        from shardyard.model import _call, logits

        per_token = token_logps(logits(_call(model, inputs)), targets)
        lp = per_token.sum(-1)
        if self.loss_type == "ipo":
            lp = lp / (targets != -100).sum(-1).clamp(min=1)
        half = lp.shape[0] // 2
        return lp[:half], lp[half:]

    def _reference_logps(self, model: Any, inputs: dict, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            if self.reference is not None:
                return self._logps(self.reference, inputs, targets)
            # The policy with its adapters off; MoE routers neither count these tokens nor add a balance loss.
            with self.policy.disable_adapter(), moe.paused(model):
                return self._logps(model, inputs, targets)

    def _loss(self, model: Any, inputs: Any, targets: torch.Tensor, mode: str) -> torch.Tensor:
        flat, y = pairs(inputs, targets)
        ref_c, ref_r = self._reference_logps(model, flat, y)
        pol_c, pol_r = self._logps(model, flat, y)
        losses, chosen, rejected = dpo_loss(pol_c, pol_r, ref_c, ref_r, self.beta, self.loss_type,
                                            self.label_smoothing)
        with torch.no_grad():
            self.sums[mode] += torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(),
                                            (chosen - rejected).sum(), pol_c.sum(), pol_r.sum(),
                                            torch.tensor(float(len(losses)), device=losses.device)]).float()
        return losses.float().sum()

    def loss_sum(self, model: Any, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(model, inputs, targets, "train")

    def eval_loss(self, model: Any, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(model, inputs, targets, "eval") / targets.shape[0]

    def _metrics(self, mode: str, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        sums = reduce(self.sums[mode]).tolist()
        self.sums[mode].zero_()
        n = max(sums[-1], 1e-12)
        return {f"{mode}/{k}": v / n for k, v in zip(METRICS, sums)}

    def train_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        return self._metrics("train", reduce)

    def evaluate(self, backend: Backend, val: dict, batches: int, micro_batch: int) -> Optional[dict[str, float]]:
        """The loop's held-out loss (the mean DPO loss over the val pairs) and the pairs' reward metrics."""
        from shardyard.data import eval_batches

        model = backend.hf_model()
        was = model.training
        model.eval()
        total = torch.zeros(2, device=backend.device)
        for rows in val.values():
            for x, y in eval_batches(rows, batches, micro_batch, backend.dp_rank, backend.dp_size):
                n = y.shape[0]
                total += torch.stack([backend.eval_loss(to_device(x, backend.device), y.to(backend.device)).float() * n,
                                      torch.tensor(float(n), device=backend.device)])
        model.train(was)
        loss_sum, n = backend.all_reduce_mean(total).tolist()
        return {"eval/loss": loss_sum / max(n, 1e-12), **self._metrics("eval", backend.all_reduce_mean)}

    def save(self, path: str, rank: int, step: int) -> None:
        pass

    def load(self, path: str, rank: int, same_world: bool) -> None:
        pass

