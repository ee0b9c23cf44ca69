"""``objective=lm``: next-token cross-entropy over the label tokens (pre-training, SFT), plus one term per
multi-token-prediction depth when the model has them (``shardyard.models.mtp``). The model's own loss path
(``model.causal_lm_loss_sum``), so nothing is installed."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from shardyard.models import mtp
from shardyard.backends import Backend
from shardyard.objectives import Setup, to_device


class LanguageModeling:
    """The token-weighted mean cross-entropy of every term (docs/architecture.md, "Token-weighted loss")."""
    data_kind = "text"
    """The rows it trains on (a data option's ``kind``), checked at validation."""
    loss_falls = True
    """The loop's warnings on a flat or oscillating train loss apply: the cross-entropy falls as the model learns."""


    def __init__(self, name: str = "lm"):
        self.name = name
        self.depths = 0

    def setup(self, s: Setup) -> None:
        self.depths = mtp.depth(s.backend.hf_model())
        self._factors = mtp.term_factors(s.cfg.model.get("mtp"), s.backend.device)

    def terms(self) -> int:
        return 1 + self.depths

    def micro_batches(self, step: int, accum: int, stream: Any, backend: Backend) -> list:
        dev = backend.device
        return [(to_device(x, dev), y.to(dev, non_blocking=True))
                for x, y in (stream.micro_batch(step, micro) for micro in range(accum))]

    def counts(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return mtp.label_counts(inputs, targets, self.depths)

    def factors(self, step: int) -> torch.Tensor:
        return self._factors(step)

    def loss_sum(self, model: Any, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        from shardyard.models.loss import causal_lm_loss_sum

        return causal_lm_loss_sum(model, inputs, targets)

    def eval_loss(self, model: Any, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        from shardyard.models.loss import causal_lm_loss

        return causal_lm_loss(model, inputs, targets)

    def train_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        return {}

    def evaluate(self, backend: Backend, val: dict, batches: int, micro_batch: int) -> Optional[dict[str, float]]:
        return None

    def save(self, path: str, rank: int, step: int) -> None:
        pass

    def load(self, path: str, rank: int, same_world: bool) -> None:
        pass
