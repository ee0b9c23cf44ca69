"""A trained run read back into one process: ``load`` (``loading``: a run dir, a checkpoint of any engine, an
HF export), ``shardyard generate`` (``generate``), MTP speculative decoding (``speculative``), DeepSpeed's
inference engine (``ds_inference``) and ``shardyard eval`` (``evaluate``).

May import: ``planning``, ``training`` and everything below them. Independent of ``launching`` (same level).
``from shardyard.inference import load`` (and ``Trained``) is the documented entry; it imports torch only
when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardyard.inference.loading import Trained, load

__all__ = ["Trained", "load"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from shardyard.inference import loading

        return getattr(loading, name)
    from shardyard.core.moved import attribute

    return attribute(__name__, name)
