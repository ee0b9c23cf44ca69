"""Imports that shardyard's dependencies make at their own import and shardyard never uses, kept from loading.

The house rule: deepspeed, horovod, trl, lm-eval, wandb and mlflow load only when the chosen config needs them.
DeepSpeed breaks it for mlflow: ``deepspeed/autotuning/autotuner.py`` (DeepSpeed 0.19) runs ``import mlflow`` when
``deepspeed`` is imported, whenever mlflow is installed (the ``monitors`` extra), to log its autotuner's
experiments, which shardyard never runs: 2.7-3.0 s of every ZeRO rank's start, of ``plan.only`` (DeepSpeed's
estimators) and of every DeepSpeed export, measured here (``import torch, deepspeed`` 5.9-6.5 s, 3.1-3.3 s without
it). :class:`_NotFor` answers that one import, from that one module (an exact (importer, name) pair, never a
prefix), with ImportError: the autotuner's own ``except`` sets ``has_mlflow = False``. Every other import of
mlflow (``monitor=mlflow``, a user's) is untouched, before or after DeepSpeed's.

This module imports nothing of shardyard: ``shardyard/__init__.py`` installs the hook.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

KEPT_OUT: frozenset[tuple[str, str]] = frozenset({
    ("deepspeed.autotuning.autotuner", "mlflow"),
})
"""(importing module, imported module) pairs answered with ImportError."""


class _NotFor:
    """A ``sys.meta_path`` finder that refuses exactly the imports of ``KEPT_OUT``; it finds nothing itself."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if not any(name == kept for _, kept in KEPT_OUT):
            return None
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("importlib"):
            frame = frame.f_back  # the import machinery's own frames, up to the module running the import
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if (importer, name) in KEPT_OUT:
            raise ImportError(f"{name} is not loaded for {importer} (shardyard.core.lazy_imports)", name=name)
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _NotFor) for f in sys.meta_path):
        sys.meta_path.insert(0, _NotFor())
